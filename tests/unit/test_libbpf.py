"""The ctypes signature table against the libbpf the machine has."""

from __future__ import annotations

import subprocess

import pytest

from bistouri.bpf import _libbpf
from bistouri.bpf.handles import check_int, check_ptr, library
from bistouri.errors import BpfError


def _exported() -> set[str]:
    lib = library()
    out = subprocess.run(
        [
            "nm",
            "-D",
            "--defined-only",
            lib.lib._name if "/" in lib.lib._name else f"/usr/lib/x86_64-linux-gnu/{lib.lib._name}",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        pytest.skip(f"nm cannot read libbpf: {out.stderr}")
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


def test_every_required_function_is_exported_and_typed():
    exported = _exported()
    lib = library()
    for name, restype, argtypes in _libbpf.SIGNATURES:
        assert name in exported, f"{name} is not exported by {lib.path}"
        fn = getattr(lib.lib, name)
        assert fn.argtypes == argtypes, name
        assert fn.restype == restype, name


def test_optional_functions_are_probed_not_assumed():
    exported = _exported()
    lib = library()
    for name, _, _ in _libbpf.OPTIONAL_SIGNATURES:
        assert lib.has(name) == (name in exported), name


def test_pointer_returns_are_never_plain_int():
    import ctypes

    for name, restype, _ in _libbpf.SIGNATURES:
        if name.startswith(
            (
                "bpf_object__open",
                "bpf_object__find",
                "bpf_object__next",
                "ring_buffer__new",
                "bpf_program__attach",
                "btf__parse",
            )
        ):
            assert restype not in (ctypes.c_int, None), name


def test_version_is_at_least_1_0():
    assert library().version >= (1, 0)


def test_error_conventions_become_one_exception_type():
    with pytest.raises(BpfError) as e:
        check_int(-2, "lookup")
    assert e.value.errno == 2 and e.value.op == "lookup" and "ENOENT" in str(e.value)
    import ctypes

    ctypes.set_errno(13)
    with pytest.raises(BpfError) as e2:
        check_ptr(None, "open")
    assert e2.value.errno == 13


def test_opening_a_missing_object_says_what_to_do(tmp_path):
    from bistouri.bpf.handles import BpfObject

    with pytest.raises(BpfError) as e:
        BpfObject(tmp_path / "nope.bpf.o")
    assert "make bpf" in str(e.value)
