"""ProcMaps opens the files of watched processes with its lock released: a file that takes long
to open (a stuck FUSE mount in the process's namespace) stalls only the thread that opens it."""

from __future__ import annotations

import threading

from bistouri.host.procmaps import USER_FRAME, FrameStatus, MappedPath, ProcMaps
from tests.unit.test_capture import burner_maps, fake_proc


def test_a_slow_file_does_not_hold_the_other_thread(tmp_path, workloads, monkeypatch):
    fake_proc(tmp_path, 7, burner_maps(workloads))
    fake_proc(tmp_path, 8, f"00400000-00401000 r-xp 00000000 fd:01 99 {workloads / 'forker'}\n")
    maps = ProcMaps(str(tmp_path))
    maps.track(7)
    opening, release = threading.Event(), threading.Event()
    read_build_id = MappedPath.build_id

    def slow(self: MappedPath) -> bytes:
        opening.set()
        assert release.wait(30)
        return read_build_id(self)

    monkeypatch.setattr(MappedPath, "build_id", slow)
    other = threading.Thread(target=maps.track, args=(8,))
    other.start()
    try:
        assert opening.wait(10)
        # The ring-buffer thread's work on another process goes on meanwhile.
        done = threading.Event()
        frames: list[bytes] = []
        worker = threading.Thread(target=lambda: (frames.append(maps.resolve(7, (0x400100,))), done.set()))
        worker.start()
        assert done.wait(10), "resolve waited for a file another thread was opening"
        assert USER_FRAME.unpack(frames[0])[0] == FrameStatus.FILE
    finally:
        release.set()
        other.join(10)
    assert maps.file(USER_FRAME.unpack(maps.resolve(8, (0x400010,)))[1]).name == "forker"
