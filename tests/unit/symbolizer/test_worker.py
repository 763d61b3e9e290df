"""The symbolizer worker's reading of a request in its poller (issue 26, N7): what a body
is announced to be, when the poller has read enough of it, and its deadline."""

from __future__ import annotations

from bistouri.symbolizer.service.worker import (
    BODY_BUFFER_BYTES,
    BODY_TIMEOUT_S,
    MIN_BODY_RATE,
    _Body,
    _headers_end,
    body_deadline,
)


def test_the_body_is_announced_by_its_length_or_chunked():
    assert _Body(b"PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n").length == 12
    assert _Body(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n").length == 0
    chunked = _Body(b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n")
    assert chunked.length is None and chunked.chunked
    assert _Body(b"PUT /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n").length == 0  # gunicorn answers 400
    assert _Body(b"PUT /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n").expect


def test_the_poller_reads_a_body_whole_or_up_to_its_buffer():
    body = _Body(b"PUT /x HTTP/1.1\r\nContent-Length: 10\r\n\r\n")
    assert not body.complete(bytearray(b"h" * 40 + b"x" * 9), 9)
    assert body.complete(bytearray(b"h" * 40 + b"x" * 10), 10)
    big = _Body(f"PUT /x HTTP/1.1\r\nContent-Length: {10 * BODY_BUFFER_BYTES}\r\n\r\n".encode())
    assert big.complete(bytearray(BODY_BUFFER_BYTES), BODY_BUFFER_BYTES)  # a thread reads the rest


def test_a_chunked_body_ends_with_its_last_chunk_not_with_a_header_ending_in_0():
    body = _Body(b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-N: 10\r\n\r\n")
    head = b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-N: 10\r\n\r\n"
    assert not body.complete(bytearray(head), 0)
    assert not body.complete(bytearray(head + b"3\r\nabc\r\n"), 8)
    assert body.complete(bytearray(head + b"3\r\nabc\r\n0\r\n\r\n"), 13)


def test_the_headers_end_at_the_first_blank_line():
    assert _headers_end(bytearray(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody")) == 24
    assert _headers_end(bytearray(b"GET / HTTP/1.1\nA: b\n\nbody")) == 21
    assert _headers_end(bytearray(b"GET / HTTP/1.1\r\nA: b\r\n")) == -1


def test_a_body_has_ten_seconds_plus_its_bytes_at_the_minimum_rate():
    assert body_deadline(100.0, 0) == 100.0 + BODY_TIMEOUT_S
    assert body_deadline(100.0, 4 << 20) == 100.0 + BODY_TIMEOUT_S + (4 << 20) / MIN_BODY_RATE
