"""The host's debug files as `record` and `check` find them: the path mirror, and what is there."""

from __future__ import annotations

import shutil
from pathlib import Path

from bistouri.elf import ElfFile
from bistouri.host import debuginfo

TRUE = Path("/bin/true")


def test_the_path_mirror_gives_a_debug_file_only_of_the_same_build(tmp_path: Path) -> None:
    with ElfFile(TRUE) as f:
        bid = f.file_id
    assert bid is not None
    real = str(TRUE.resolve())
    mirror = tmp_path / "debug"
    where = mirror / real.lstrip("/")
    where.parent.mkdir(parents=True)
    assert debuginfo.mirror_debug_file(real, bid, None, str(mirror)) is None
    shutil.copy(TRUE, str(where) + ".debug")  # <mirror>/usr/bin/true.debug
    assert debuginfo.mirror_debug_file(real, bid, None, str(mirror)) == str(where) + ".debug"
    assert debuginfo.mirror_debug_file(real, b"\x01" * 20, None, str(mirror)) is None  # another build
    shutil.copy(TRUE, where.parent / "true.dbg")  # the name its .gnu_debuglink gives
    assert debuginfo.mirror_debug_file(real, bid, "true.dbg", str(mirror)) == str(where.parent / "true.dbg")
    assert debuginfo.mirror_debug_file("relative/path", bid, None, str(mirror)) is None


def test_describe_counts_the_build_id_tree_and_names_the_servers(tmp_path: Path) -> None:
    tree = tmp_path / ".build-id" / "ab"
    tree.mkdir(parents=True)
    for name in ("cdef.debug", "0123.debug", "cdef"):
        (tree / name).write_bytes(b"")
    got = dict(debuginfo.describe(str(tmp_path), {"DEBUGINFOD_URLS": "https://a.example https://b.example"}))
    assert got[str(tmp_path)].startswith("2 debug files")
    assert got["DEBUGINFOD_URLS"] == "https://a.example https://b.example"
    got = dict(debuginfo.describe(str(tmp_path / "absent"), {}))
    assert got[str(tmp_path / "absent")].startswith("absent") and got["DEBUGINFOD_URLS"].startswith("unset")


def test_the_symbolizer_skips_the_hosts_debug_tree_only_while_it_is_absent(tmp_path: Path) -> None:
    from bistouri.symbolizer.service.cli import debug_dirs_in_use

    host = str(tmp_path / "usr-lib-debug")
    other = str(tmp_path / "mine")
    assert debug_dirs_in_use([host, other], host) == [other]  # `other` is still checked (and refused) later
    Path(host).mkdir()
    assert debug_dirs_in_use([host, other], host) == [host, other]
