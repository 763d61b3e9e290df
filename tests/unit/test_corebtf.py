"""corebtf.py without the kernel: the cache's key, who may use a file, and its bound."""

from __future__ import annotations

import os

from bistouri import corebtf


def test_the_key_follows_the_object_and_the_kernel(tmp_path):
    obj = tmp_path / "a.bpf.o"
    obj.write_bytes(b"\x7fELF one")
    first = corebtf.cache_name(str(obj))
    assert first == corebtf.cache_name(str(obj))
    obj.write_bytes(b"\x7fELF two")
    assert corebtf.cache_name(str(obj)) != first
    other_kernel = tmp_path / "vmlinux"
    other_kernel.write_bytes(b"x" * 12345)
    assert corebtf.cache_name(str(obj), kernel_btf=str(other_kernel)) != corebtf.cache_name(str(obj))


def test_only_a_regular_file_of_this_user_is_used(tmp_path):
    obj = tmp_path / "a.bpf.o"
    obj.write_bytes(b"\x7fELF")
    path = tmp_path / corebtf.cache_name(str(obj))
    assert corebtf.cached(str(tmp_path), str(obj)) is None
    path.write_bytes(b"")
    assert corebtf.cached(str(tmp_path), str(obj)) is None  # empty: a build that failed midway
    path.write_bytes(b"btf")
    assert corebtf.cached(str(tmp_path), str(obj)) == str(path)
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(b"btf")
    path.symlink_to(tmp_path / "elsewhere")
    assert corebtf.cached(str(tmp_path), str(obj)) is None
    if os.geteuid() == 0:
        path.unlink()
        path.write_bytes(b"btf")
        os.chown(path, 65534, 65534)
        assert corebtf.cached(str(tmp_path), str(obj)) is None


def test_the_cache_keeps_the_most_recent_files(tmp_path):
    for i in range(corebtf.KEEP_FILES + 3):
        f = tmp_path / f"{i:02d}.btf"
        f.write_bytes(b"btf")
        os.utime(f, ns=(i * 10**9, i * 10**9))
    (tmp_path / "unrelated").write_bytes(b"")
    corebtf._prune(str(tmp_path), corebtf.KEEP_FILES)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"{i:02d}.btf" for i in range(3, corebtf.KEEP_FILES + 3)] + ["unrelated"]
