"""The gunicorn worker of the symbolizer: threads, and request headers read by the poller.

gunicorn's threaded worker gives a thread to each new connection, which then blocks
reading the request headers: fifty clients sending their headers slowly hold fifty
threads, and `/healthz` waits behind them. This worker keeps a connection in its poller
(no thread) until its headers are all in, reading what arrives without blocking, and
closes it when they are not complete within HEADER_TIMEOUT_S or grow past
MAX_HEADER_BYTES. The bytes read are handed back to gunicorn's parser, so the request is
then parsed as usual, in a thread.

Written against what gunicorn 20.1 (Debian bookworm) and later versions share:
`enqueue_req(conn)` submits a connection to the thread pool, `conn.init()` makes its
parser, the parser's `unreader.unread(bytes)` gives bytes back, the poller calls
`callback(fileobj)`, and `murder_keepalived()` runs about once a second.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from functools import partial
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # from the first byte wanted to the blank line ending the headers
MAX_HEADER_BYTES = 64 << 10
_READ_BYTES = 16 << 10
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 38\r\n\r\nrequest headers over 65536 bytes: sent\n"
)


def _headers_complete(buf: bytearray) -> bool:
    return b"\r\n\r\n" in buf or b"\n\n" in buf


class _Pending:
    __slots__ = ("buf", "deadline")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.buf = bytearray()


class HeaderGateWorker(ThreadWorker):
    """gunicorn's gthread worker whose threads only see requests whose headers have arrived."""

    def init_process(self) -> None:
        self._pending: dict[Any, _Pending] = {}
        super().init_process()

    def _poller_lock(self) -> Any:
        # gunicorn 20.1 changes the poller from pool threads under this lock; later ones do not.
        lock = getattr(self, "_lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    def enqueue_req(self, conn: Any) -> None:
        if getattr(conn, "bistouri_headers_in", False):
            conn.bistouri_headers_in = False
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
        if _headers_complete(pending.buf):
            self._forget(conn)
            conn.init()
            conn.parser.unreader.unread(bytes(pending.buf))
            conn.bistouri_headers_in = True
            self.enqueue_req(conn)
        elif len(pending.buf) > MAX_HEADER_BYTES:
            with contextlib.suppress(OSError):
                sock.send(_TOO_LARGE)
            self._drop(conn)

    def _forget(self, conn: Any) -> None:
        self._pending.pop(conn, None)
        with self._poller_lock(), contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(conn.sock)

    def _drop(self, conn: Any) -> None:
        self._forget(conn)
        self.nr_conns -= 1
        with contextlib.suppress(OSError):
            conn.close()

    def murder_keepalived(self, *args: Any, **kwargs: Any) -> None:
        super().murder_keepalived(*args, **kwargs)
        now = time.monotonic()
        late = [c for c, p in self._pending.items() if p.deadline <= now]
        for conn in late:
            self._drop(conn)
        if late:
            log.info("closed connections whose request headers were late. count=%d", len(late))
