"""The gunicorn worker of the symbolizer: threads, and slow peers kept off them.

gunicorn's threaded worker gives a thread to each new connection, which then blocks
reading the request, and writing the response: eight clients sending slowly, or never
reading what they asked for, hold eight threads, and `/healthz` and ingest wait behind
them. This worker keeps slow peers in its poller instead, where they cost no thread:

- A connection stays in the poller (no thread) until its request headers and then its
  body (up to BODY_BUFFER_BYTES of it) are in, read without blocking. Headers not
  complete within HEADER_TIMEOUT_S, or over MAX_HEADER_BYTES, close the connection; a
  body that does not keep up with `body_deadline` (BODY_TIMEOUT_S, plus the time its
  bytes take at MIN_BODY_RATE) is answered 408 and the connection closed. The bytes read
  are handed back to gunicorn's parser, so the request is parsed as usual, in a thread.
- In the thread, the socket (`_PeerSocket`) holds the same deadline for the rest of a
  large or chunked body (the application answers 408: `TimeoutError`), and writes the
  response without blocking: what the client does not take at once waits in the poller,
  at most WRITE_TIMEOUT_S, then the response is abandoned. Beyond MAX_OUTBOX_BYTES of
  such responses in a worker, a thread writes itself, for WRITE_TIMEOUT_S at most.

- `GET /healthz` is answered by the poller as soon as its headers are in: the process
  lives and accepts connections. Behind the requests queued for threads, it took over 2 s
  in a burst of ingest, and HAProxy took every instance of a fleet out at once.

Counted: `bistouri_symbolizer_requests_rejected_total{reason="slow_body"}` and
`bistouri_symbolizer_responses_abandoned_total{reason="slow_reader"}`.

Written against what gunicorn 20.1 (Debian bookworm) and later versions share:
`enqueue_req(conn)` submits a connection to the thread pool, `conn.init()` makes its
parser and sets the socket blocking, the parser's `unreader.unread(bytes)` gives bytes
back and reads with `sock.recv`, responses are written with `sock.sendall`, the poller
calls `callback(fileobj)`, `finish_request` gets the future last (and the connection
first, or as `fs.conn`), and `murder_keepalived()` runs about once a second.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from functools import partial
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # from the first byte wanted to the blank line ending the headers
MAX_HEADER_BYTES = 64 << 10
# A body must arrive within BODY_TIMEOUT_S plus what its bytes take at MIN_BODY_RATE (as
# Apache's mod_reqtimeout): an agent's 4 MiB batch at 64 KiB/s has 74 s, a trickle 10 s.
BODY_TIMEOUT_S = 10.0
MIN_BODY_RATE = 64 << 10  # bytes per second
BODY_BUFFER_BYTES = 256 << 10  # read by the poller; a larger body's rest is read in the thread
MAX_BUFFERED_BYTES = 64 << 20  # bodies held by a worker's poller; past that, read in threads
WRITE_TIMEOUT_S = 20.0  # a response the client does not read within this is abandoned
MAX_OUTBOX_BYTES = 64 << 20  # unsent responses held by a worker's poller
IO_TIMEOUT_S = 30.0  # any one blocking socket call in a thread
_READ_BYTES = 64 << 10
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 38\r\n\r\nrequest headers over 65536 bytes: sent\n"
)
_HEALTHY = (
    b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 3\r\n\r\nok\n"
)
_TOO_SLOW = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b'Content-Length: 75\r\n\r\n{"error": "slow_body", "detail": "the request body did not arrive in time"}'
)


def body_deadline(start: float, received: int) -> float:
    """The monotonic time by which a body begun at `start` must have more than `received` bytes."""
    return start + BODY_TIMEOUT_S + received / MIN_BODY_RATE


def _headers_end(buf: bytearray) -> int:
    """The offset just past the headers' blank line, or -1."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else -1


class _Body:
    """What the headers say of the body: its length (None: chunked, ends with a last chunk),
    and whether the client waits for a 100 Continue before sending it."""

    __slots__ = ("chunked", "expect", "length")

    def __init__(self, head: bytes) -> None:
        self.length: int | None = 0
        self.chunked = self.expect = False
        for line in head.split(b"\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                self.chunked, self.length = True, None
            elif name == b"expect":
                self.expect = value.strip().lower() == b"100-continue"
            elif name == b"content-length" and not self.chunked:
                # Unparsable: no body read here, and gunicorn's parser answers 400 in the thread.
                self.length = int(value) if value.strip().isdigit() else 0

    def complete(self, buf: bytearray, received: int) -> bool:
        """Whether the `received` bytes at the end of `buf` are all of the body, or as much
        as the poller reads."""
        if received >= BODY_BUFFER_BYTES:
            return True
        if self.length is None:  # the last chunk, with no trailer (a body may fake it: harmless)
            return received >= 5 and buf.endswith(b"0\r\n\r\n")
        return received >= self.length


class _Pending:
    """A connection in the poller: its bytes so far, and the deadline of what is missing."""

    __slots__ = ("body", "body_start", "buf", "deadline", "head", "reserved")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.buf = bytearray()
        self.head = -1  # the headers' length, once they are in
        self.body: _Body | None = None
        self.body_start = 0.0
        self.reserved = 0  # of the worker's MAX_BUFFERED_BYTES


class _PeerSocket(socket.socket):
    """A connection's socket while a thread serves its request.

    Reads keep the body's deadline (TimeoutError when late); writes never block the
    thread while the worker's outbox has room: what the kernel does not take goes to
    `outbox`, which the poller sends once the thread is done."""

    __slots__ = ("body_start", "closing", "gate", "outbox", "received")
    body_start: float
    closing: bool  # the thread is done: the worker's main thread closes it
    gate: HeaderGateWorker
    outbox: bytearray
    received: int

    @classmethod
    def adopt(
        cls, old: socket.socket, gate: HeaderGateWorker, body_start: float, received: int
    ) -> _PeerSocket:
        """This socket in place of `old` (which is left closed), `received` body bytes in."""
        peer = cls(old.family, old.type, old.proto, fileno=old.detach())
        peer.body_start, peer.received, peer.outbox, peer.gate = body_start, received, bytearray(), gate
        peer.closing = False
        return peer

    def setblocking(self, flag: bool) -> None:
        # gunicorn sets its sockets blocking for the thread: blocking, but never forever.
        if flag:
            self.settimeout(IO_TIMEOUT_S)
        else:
            super().setblocking(False)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if self.closing:
            # gunicorn 22+ closes "gracefully" from the main thread, waiting up to 2 s for
            # the client to close first: a client that never does would stall the worker.
            super().setblocking(False)
            return super().recv(bufsize, flags)
        left = body_deadline(self.body_start, self.received) - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request body did not arrive in time")
        timeout = self.gettimeout()
        if timeout is None or timeout > left:
            self.settimeout(left)
        data = super().recv(bufsize, flags)
        self.received += len(data)
        return data

    def sendall(self, data: Any, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        if not self.outbox:
            super().setblocking(False)
            with contextlib.suppress(BlockingIOError, InterruptedError):
                view = view[self.send(view, flags) :]
            if not view:
                return
        if self.gate.reserve_outbox(len(view)):
            self.outbox += view
            return
        # The worker holds enough unsent responses: this thread writes, for a while at most.
        self.settimeout(WRITE_TIMEOUT_S)  # sendall's timeout is for the whole call
        try:
            if self.outbox:
                super().sendall(self.outbox, flags)
            super().sendall(view, flags)
        except TimeoutError:
            self.gate.count_abandoned()
            raise BrokenPipeError(errno.EPIPE, "the client did not read the response in time") from None
        finally:
            self.gate.release_outbox(len(self.outbox))
            self.outbox.clear()


class HeaderGateWorker(ThreadWorker):
    """gunicorn's gthread worker whose threads only see requests that have arrived, and
    whose responses are finished by the poller."""

    def init_process(self) -> None:
        self._pending: dict[Any, _Pending] = {}
        self._writing: dict[Any, float] = {}  # connection -> deadline of its response
        self._buffered = 0
        self._outbox_lock = threading.Lock()
        self._outboxed = 0
        super().init_process()

    def _poller_lock(self) -> Any:
        # gunicorn 20.1 changes the poller from pool threads under this lock; later ones do not.
        lock = getattr(self, "_lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    def _metric(self, name: str, *labels: str) -> None:
        metrics = getattr(self.wsgi, "metrics", None)
        counter = getattr(metrics, name, None)
        if counter is not None:
            counter.labels(*labels).inc()

    def _may_answer_health(self, sock: Any) -> bool:
        """/healthz is answered by the poller, not behind the requests queued for threads: a
        load balancer must not take out an instance that is busy, as every instance is in a
        burst (seen: both instances of a fleet marked down, 2 s health checks). Not on the
        listener that serves only /metrics."""
        metrics_port = getattr(getattr(self.wsgi, "config", None), "metrics_port", None)
        try:
            return not metrics_port or sock.getsockname()[1] != metrics_port
        except OSError:
            return False

    def count_abandoned(self) -> None:
        self._metric("abandoned", "slow_reader")

    def reserve_outbox(self, n: int) -> bool:
        with self._outbox_lock:
            if self._outboxed + n > MAX_OUTBOX_BYTES:
                return False
            self._outboxed += n
            return True

    def release_outbox(self, n: int) -> None:
        with self._outbox_lock:
            self._outboxed -= n

    # -- reading the request in the poller

    def enqueue_req(self, conn: Any) -> None:
        if getattr(conn, "bistouri_request_in", False):
            conn.bistouri_request_in = False
            super().enqueue_req(conn)
            return
        parser = getattr(conn, "parser", None)
        if parser is not None and parser.unreader.buf.getvalue():
            # Bytes of a next (pipelined) request are already buffered: a thread parses them.
            super().enqueue_req(conn)
            return
        conn.sock.setblocking(False)
        self._pending[conn] = _Pending(time.monotonic() + HEADER_TIMEOUT_S)
        with self._poller_lock():
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _on_readable(self, conn: Any, sock: Any) -> None:
        pending = self._pending.get(conn)
        if pending is None:
            return
        try:
            data = sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)  # the client went away
            return
        pending.buf += data
        if pending.head < 0:
            end = _headers_end(pending.buf)
            if end < 0:
                if len(pending.buf) > MAX_HEADER_BYTES:
                    with contextlib.suppress(OSError):
                        sock.send(_TOO_LARGE)
                    self._drop(conn)
                return
            if pending.buf.startswith(b"GET /healthz HTTP/1.") and self._may_answer_health(sock):
                with contextlib.suppress(OSError):
                    sock.send(_HEALTHY)
                self._drop(conn)
                self._metric("http_requests", "healthz", "200")
                return
            pending.head = end
            pending.body_start = time.monotonic()
            pending.body = _Body(bytes(pending.buf[:end]))
            want = BODY_BUFFER_BYTES if pending.body.length is None else pending.body.length
            want = min(want, BODY_BUFFER_BYTES)
            if self._buffered + want <= MAX_BUFFERED_BYTES:
                pending.reserved = want
                self._buffered += want
            else:
                pending.body = None  # the poller holds enough bodies: a thread reads this one
            if pending.body is not None and pending.body.expect:
                with contextlib.suppress(OSError):  # gunicorn sends another: clients take several
                    sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        received = len(pending.buf) - pending.head
        if pending.body is not None and not pending.body.complete(pending.buf, received):
            pending.deadline = body_deadline(pending.body_start, received)
            return
        self._forget(conn)
        self._hand_over(conn, pending, received)

    def _hand_over(self, conn: Any, pending: _Pending, received: int) -> None:
        """Give the connection to a thread, on a socket that keeps the body's deadline, with
        the bytes read so far given back to the parser."""
        conn.sock = _PeerSocket.adopt(conn.sock, self, pending.body_start, received)
        conn.init()  # the parser, on the new socket
        conn.parser.unreader.unread(bytes(pending.buf))
        conn.bistouri_request_in = True
        self.enqueue_req(conn)

    def _forget(self, conn: Any) -> None:
        pending = self._pending.pop(conn, None)
        if pending is not None:
            self._buffered -= pending.reserved
        with self._poller_lock(), contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(conn.sock)

    def _drop(self, conn: Any) -> None:
        self._forget(conn)
        self.nr_conns -= 1
        with contextlib.suppress(OSError):
            conn.close()

    # -- writing the response from the poller

    def finish_request(self, *args: Any) -> None:
        fs = args[-1]
        conn = args[0] if len(args) > 1 else fs.conn
        sock = conn.sock
        if isinstance(sock, _PeerSocket):
            sock.closing = True
        if not isinstance(sock, _PeerSocket) or not sock.outbox or fs.cancelled():
            super().finish_request(*args)
            return
        # The thread is done; the client has not taken the whole response yet. The
        # connection is closed once it has (no keep-alive: the service sets none).
        with self._poller_lock():
            self._writing[conn] = time.monotonic() + WRITE_TIMEOUT_S
            super(_PeerSocket, sock).setblocking(False)
            self.poller.register(sock, selectors.EVENT_WRITE, partial(self._on_writable, conn))

    def _on_writable(self, conn: Any, sock: Any) -> None:
        if conn not in self._writing:
            return
        try:
            n = sock.send(sock.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._end_write(conn)  # the client went away
            return
        del sock.outbox[:n]
        self.release_outbox(n)
        if not sock.outbox:
            self._end_write(conn)

    def _end_write(self, conn: Any) -> None:
        with self._poller_lock():
            self._writing.pop(conn, None)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.poller.unregister(conn.sock)
        self.release_outbox(len(conn.sock.outbox))
        conn.sock.outbox.clear()
        self.nr_conns -= 1
        with contextlib.suppress(OSError):
            conn.close()

    # -- deadlines, about once a second

    def murder_keepalived(self, *args: Any, **kwargs: Any) -> None:
        super().murder_keepalived(*args, **kwargs)
        now = time.monotonic()
        late = [(c, p) for c, p in self._pending.items() if p.deadline <= now]
        for conn, pending in late:
            if pending.head >= 0:  # the headers came, the body is late: say so
                with contextlib.suppress(OSError):
                    conn.sock.send(_TOO_SLOW)
                self._metric("rejected", "slow_body")
            self._drop(conn)
        if late:
            log.info("closed connections whose request was late. count=%d", len(late))
        with self._poller_lock():
            unread = [c for c, deadline in self._writing.items() if deadline <= now]
        for conn in unread:
            self._end_write(conn)
            self.count_abandoned()
        if unread:
            log.info("abandoned responses the client did not read. count=%d", len(unread))
