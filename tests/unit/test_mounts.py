"""mounts.py: the one mount table reader (mountinfo) and its unescaper."""

from __future__ import annotations

from pathlib import Path

import pytest

from bistouri.host import mounts

PROC = str(Path(__file__).resolve().parents[1] / "fixtures" / "proc")


@pytest.mark.parametrize(
    ("field", "path"),
    [
        (rb"/mnt/a\040b", "/mnt/a b"),
        (rb"/mnt/tab\011here", "/mnt/tab\there"),
        (rb"/mnt/new\012line", "/mnt/new\nline"),
        (rb"/mnt/back\134slash", "/mnt/back\\slash"),
        (rb"/mnt/\040\134\011", "/mnt/ \\\t"),
    ],
)
def test_the_kernels_octal_escapes_are_undone(field: bytes, path: str) -> None:
    assert mounts.unescape(field) == path


@pytest.mark.parametrize(
    ("field", "path"),
    [
        (rb"/mnt/\09x", "/mnt/\\09x"),  # not three octal digits: kept as written
        (rb"/mnt/end\04", "/mnt/end\\04"),  # cut short
        (rb"/mnt/plain", "/mnt/plain"),
        (b"/mnt/\xff", "/mnt/\udcff"),  # not UTF-8: kept byte for byte
    ],
)
def test_anything_else_is_kept(field: bytes, path: str) -> None:
    assert mounts.unescape(field) == path


def test_mountinfo_lines_with_optional_fields_and_a_sub_root() -> None:
    found = mounts.parse(
        b"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 master:2 - cgroup2 cgroup2 rw\n"
        b"35 31 0:32 /kube/pod1 /sys/fs/cgroup/mem\\040ory rw - cgroup cgroup rw,memory\n"
        b"garbage\n1 2 3 - x\n"
    )
    assert found == [
        mounts.Mount("/sys/fs/cgroup/unified", "/", "cgroup2", ("rw",)),
        mounts.Mount("/sys/fs/cgroup/mem ory", "/kube/pod1", "cgroup", ("rw", "memory")),
    ]


def test_the_first_cgroup2_mount_is_found_unescaped() -> None:
    assert mounts.find_cgroup2_mount(PROC) == "/sys/fs/cgroup/unified v2"


def test_no_cgroup2_mount_or_no_mountinfo_is_none(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text(
        "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    )
    assert mounts.find_cgroup2_mount(str(tmp_path)) is None
    assert mounts.find_cgroup2_mount(str(tmp_path / "missing")) is None
    assert mounts.read(str(tmp_path / "missing")) == []


def test_this_hosts_mount_table_is_read() -> None:
    assert any(m.point == "/" for m in mounts.read())
