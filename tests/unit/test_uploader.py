"""The uploader's stream: gzip'd as read, and held to --upload-rate-bytes."""

from __future__ import annotations

import os
import zlib

from prometheus_client import CollectorRegistry

from bistouri.agent.settings import AgentSettings
from bistouri.agent.uploader import Uploader


class _Waits:
    """Stands for the uploader's stop event: records the pauses asked for, never sleeps."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.asked.append(seconds)
        return False


def test_the_stream_is_gzip_of_the_file_and_paced_to_the_rate(tmp_path, monkeypatch) -> None:
    rate = 1 << 20
    settings = AgentSettings(symbolizer_endpoint="http://127.0.0.1:1", upload_rate_bytes=rate)
    uploader = Uploader(settings, lambda *a, **k: None, lambda b: None, CollectorRegistry())
    waits = _Waits()
    uploader._stop = waits  # type: ignore[assignment]
    # A clock that stands still (nothing slept, and compressing takes no time): each pause is then
    # exactly the bytes sent so far over the rate, however busy the host.
    monkeypatch.setattr("bistouri.agent.uploader.time.monotonic", lambda: 1000.0)
    data = os.urandom(4 << 20)  # incompressible: about 4 MiB go on the wire
    sent = [0]
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    body = b"".join(uploader._gzip_stream(fd, sent))
    os.close(fd)
    assert zlib.decompress(body, 16 + zlib.MAX_WBITS) == data
    assert sent[0] == len(body)
    # Each pause is the stream's lead over the rate: with the clock still, it only grew, to the 4 s
    # that 4 MiB take at 1 MiB/s.
    assert waits.asked == sorted(waits.asked) and len(waits.asked) > 1
    assert waits.asked[-1] == len(body) / rate
