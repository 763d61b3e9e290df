"""The Python mirrors of bpf/bistouri.h against the BTF of the built object."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from bistouri import abi
from bistouri.bpf import BtfFile
from tests.conftest import BPF_OBJECT, ROOT

pytestmark = pytest.mark.requires_bpf


def test_every_mirror_matches_the_shipped_object():
    with BtfFile(BPF_OBJECT) as f:
        assert abi.abi_mismatches(f.btf) == []


def test_every_shared_struct_has_a_mirror():
    header = (ROOT / "bpf" / "bistouri.h").read_text()
    import re

    declared = set(re.findall(r"^struct (bistouri_\w+) \{", header, re.M))
    assert declared == set(abi.MIRRORS)


def test_precompiled_decoders_agree_with_mirrors():
    assert abi.StackEvent.kernel_stack.offset == abi.STACK_HEADER_SIZE
    assert abi.USER_FRAME.size == ctypes.sizeof(abi.UserFrame)
    assert abi.EXEC_EVENT.size == ctypes.sizeof(abi.ExecEvent)
    assert abi.ERROR_EVENT.size == ctypes.sizeof(abi.ErrorEvent)


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is needed to build a modified object")
def test_a_field_added_in_c_only_is_detected(tmp_path: Path):
    """Adding a field to a shared struct without its Python mirror must fail the ABI check."""
    bpf = tmp_path / "bpf"
    shutil.copytree(ROOT / "bpf", bpf, ignore=shutil.ignore_patterns("vmlinux"))
    header = bpf / "bistouri.h"
    text = header.read_text().replace(
        "\t__u64 cgroup_id;       /* cgroup2 inode of the process */",
        "\t__u64 cgroup_id;       /* cgroup2 inode of the process */\n\t__u64 added_in_c_only;",
    )
    assert "added_in_c_only" in text
    header.write_text(text)
    src = (bpf / "bistouri.bpf.c").read_text()
    src = src.replace("sizeof(struct bistouri_exec_event) == 32", "sizeof(struct bistouri_exec_event) == 40")
    (bpf / "bistouri.bpf.c").write_text(src)
    obj = tmp_path / "modified.bpf.o"
    subprocess.run(
        [
            "clang",
            "-target",
            "bpf",
            "-O2",
            "-g",
            "-D__TARGET_ARCH_x86",
            f"-I{bpf}",
            f"-I{ROOT / 'bpf' / 'vmlinux' / 'x86'}",
            "-c",
            str(bpf / "bistouri.bpf.c"),
            "-o",
            str(obj),
        ],
        check=True,
    )
    with BtfFile(obj) as f:
        problems = abi.abi_mismatches(f.btf)
    assert any("bistouri_exec_event" in p and "size 40" in p for p in problems), problems
