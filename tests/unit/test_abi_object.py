"""The Python mirrors of bpf/bistouri.h against the BTF of the built object.

Unprivileged: BTF is parsed from the ELF file (libbpf's btf__parse), nothing
is loaded into the kernel. What needs the kernel (the verifier's refusal
reaching the error) stays in tests/bpf/test_abi.py.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bistouri.bpf import abi, loader
from bistouri.bpf.handles import BtfFile
from tests.conftest import BPF_OBJECT, ROOT

pytestmark = pytest.mark.skipif(not BPF_OBJECT.exists(), reason=f"{BPF_OBJECT} is not built (run `make bpf`)")


def test_every_mirror_matches_the_shipped_object():
    with BtfFile(BPF_OBJECT) as f:
        assert abi.abi_mismatches(f.btf) == []


def test_the_arm64_object_has_the_same_abi():
    """One wire for both architectures: the arm64 object's structs and enums are x86-64's."""
    arm64 = BPF_OBJECT.with_name(loader.object_name("aarch64"))
    if not arm64.exists():
        pytest.skip(f"{arm64} is not built (run `make bpf`)")
    with BtfFile(arm64) as f:
        assert abi.abi_mismatches(f.btf) == []


def test_the_object_is_chosen_by_the_machine():
    assert loader.object_name("x86_64") == BPF_OBJECT.name
    assert loader.object_name("aarch64") == "bistouri.arm64.bpf.o"


def test_every_shared_struct_has_a_mirror():
    header = (ROOT / "bpf" / "bistouri.h").read_text()
    declared = set(re.findall(r"^struct (bistouri_\w+) \{", header, re.M))
    assert declared == set(abi.MIRRORS)


def test_every_shared_enum_has_a_mirror():
    header = (ROOT / "bpf" / "bistouri.h").read_text()
    declared = set(re.findall(r"^enum (bistouri_\w+) \{", header, re.M))
    assert declared == set(abi.ENUMS)


def test_precompiled_decoders_agree_with_mirrors():
    assert abi.StackEvent.kernel_stack.offset == abi.STACK_HEADER_SIZE
    assert ctypes.sizeof(abi.StackEvent) == abi.STACK_EVENT_SIZE
    assert abi.EXEC_EVENT.size == ctypes.sizeof(abi.ExecEvent)
    assert abi.PY_FRAME.size == ctypes.sizeof(abi.PyFrame)
    assert abi.ERROR_EVENT.size == ctypes.sizeof(abi.ErrorEvent)


def _build_modified(tmp_path: Path, header_edit: tuple[str, str]) -> Path:
    """The object built from bpf/ with one edit of bistouri.h."""
    bpf = tmp_path / "bpf"
    shutil.copytree(ROOT / "bpf", bpf, ignore=shutil.ignore_patterns("vmlinux"))
    header = bpf / "bistouri.h"
    old, new = header_edit
    text = header.read_text()
    assert old in text
    header.write_text(text.replace(old, new))
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
    return obj


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is needed to build a modified object")
def test_a_field_added_in_c_only_is_detected(tmp_path: Path):
    """Adding a field to a shared struct without its Python mirror must fail the ABI check."""
    obj = _build_modified(
        tmp_path,
        (
            "\t__u64 cgroup_id;       /* cgroup2 inode of the process */",
            "\t__u64 cgroup_id;       /* cgroup2 inode of the process */\n\t__u64 added_in_c_only;",
        ),
    )
    with BtfFile(obj) as f:
        problems = abi.abi_mismatches(f.btf)
    assert any("bistouri_exec_event" in p and "size 40" in p for p in problems), problems


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is needed to build a modified object")
def test_fields_swapped_at_equal_size_are_detected(tmp_path: Path):
    """Same size, different offsets: sizes alone would not see it."""
    obj = _build_modified(
        tmp_path,
        ("\t__u32 rule_id;\n\t__u32 pid;             /* tgid */", "\t__u32 pid;\n\t__u32 rule_id;"),
    )
    with BtfFile(obj) as f:
        problems = abi.abi_mismatches(f.btf)
    assert any("bistouri_exec_event" in p and "fields" in p for p in problems), problems


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is needed to build a modified object")
def test_an_enum_value_changed_in_c_only_is_detected(tmp_path: Path):
    obj = _build_modified(
        tmp_path,
        ("BISTOURI_CNT_MAP_CHANGES = 10,", "BISTOURI_CNT_MAP_CHANGES = 11, BISTOURI_CNT_NEW = 10,"),
    )
    with BtfFile(obj) as f:
        problems = abi.abi_mismatches(f.btf)
    assert any("enum bistouri_counter" in p for p in problems), problems
