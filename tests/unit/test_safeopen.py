"""safeopen: the one way to open a file a watched process controls."""

from __future__ import annotations

import os
import threading

import pytest

from bistouri.host import safeopen


@pytest.fixture(params=["openat2", "walk"])
def resolution(request, monkeypatch):
    """Both ways of resolving under a root: openat2, and the walk kept for older kernels."""
    monkeypatch.setattr(safeopen, "_openat2_works", request.param == "openat2")
    return request.param


def _open(root, path, **kw):
    rfd = safeopen.open_root(str(root))
    try:
        return safeopen.open_in_root(rfd, path, **kw)
    finally:
        os.close(rfd)


def test_a_regular_file_inside_the_root_is_read_from_its_descriptor(tmp_path, resolution):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "perf-7.map").write_bytes(b"1000 10 fn\n")
    fd = _open(tmp_path, "/tmp/perf-7.map", owners={os.getuid()}, max_bytes=100)
    try:
        assert os.pread(fd, 100, 0) == b"1000 10 fn\n"
        with open(safeopen.fd_path(fd), "rb") as f:  # the very file again, for path readers
            assert f.read() == b"1000 10 fn\n"
    finally:
        os.close(fd)


def test_a_fifo_is_refused_at_once(tmp_path, resolution):
    (tmp_path / "tmp").mkdir()
    os.mkfifo(tmp_path / "tmp" / "perf-7.map")
    before = safeopen.REFUSED["not_regular"]
    done = threading.Event()

    def attempt() -> None:
        with pytest.raises(safeopen.Refused) as e:
            _open(tmp_path, "tmp/perf-7.map")
        assert e.value.reason == "not_regular"
        done.set()

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    # A blocking open would wait here for a writer that never comes.
    assert done.wait(10), "opening a FIFO blocked"
    assert safeopen.REFUSED["not_regular"] == before + 1


@pytest.mark.parametrize("where", ["last", "directory", "absolute"])
def test_no_symlink_is_followed(tmp_path, resolution, where):
    secret = tmp_path / "secret"
    secret.write_text("root only")
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "real" / "perf-7.map").write_text("inside")
    if where == "last":
        (root / "real" / "link.map").symlink_to(secret)
        path = "real/link.map"
    elif where == "directory":
        (root / "tmp").symlink_to(root / "real")
        path = "tmp/perf-7.map"
    else:
        (root / "abs.map").symlink_to("/real/perf-7.map")  # even one that stays inside
        path = "abs.map"
    with pytest.raises(safeopen.Refused) as e:
        _open(root, path)
    assert e.value.reason == "symlink"


def test_dot_dot_does_not_leave_the_root(tmp_path, resolution):
    (tmp_path / "secret").write_text("outside")
    (tmp_path / "root").mkdir()
    with pytest.raises(OSError):
        os.close(_open(tmp_path / "root", "../secret"))


def test_owner_and_size_are_checked_on_the_descriptor(tmp_path, resolution):
    (tmp_path / "f").write_bytes(b"x" * 100)
    with pytest.raises(safeopen.Refused) as e:
        _open(tmp_path, "f", owners={12345})
    assert e.value.reason == "owner"
    with pytest.raises(safeopen.Refused) as e:
        _open(tmp_path, "f", max_bytes=99)
    assert e.value.reason == "too_large"
    os.close(_open(tmp_path, "f", owners={os.stat(tmp_path / "f").st_uid}, max_bytes=100))


def test_a_missing_file_is_an_ordinary_oserror(tmp_path, resolution):
    with pytest.raises(FileNotFoundError):
        _open(tmp_path, "nothing")


def test_mapped_and_host_files_are_regular_only(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for opener in (safeopen.open_mapped, safeopen.open_regular):
        with pytest.raises(safeopen.Refused):
            opener(str(tmp_path / "fifo"))
    with pytest.raises(safeopen.Refused):
        safeopen.open_regular(str(tmp_path))
