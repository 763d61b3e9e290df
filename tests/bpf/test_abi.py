"""What of the ABI contract needs the kernel: a program the verifier refuses reports why.

The mirrors against the object's BTF need only the file: tests/unit/test_abi_object.py.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bistouri.bpf.handles import BpfObject
from bistouri.errors import BpfError
from tests.conftest import ROOT

pytestmark = pytest.mark.bpf

_REFUSED_PROGRAM = r"""
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} counts SEC(".maps");

SEC("socket")
int unchecked(void *ctx)
{
	__u32 key = 0;
	__u64 *value = bpf_map_lookup_elem(&counts, &key);

	return *value; /* no NULL check: the verifier refuses it */
}

char LICENSE[] SEC("license") = "GPL";
"""


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is needed to build the object")
def test_a_refused_program_reports_the_verifiers_reason(tmp_path):
    """The verifier log reaches the error (it is written only on failure, into lazily mapped pages)."""
    source = tmp_path / "refused.bpf.c"
    source.write_text(_REFUSED_PROGRAM)
    obj = tmp_path / "refused.bpf.o"
    include = f"-I{ROOT / 'bpf' / 'vmlinux' / 'x86'}"
    subprocess.run(
        ["clang", "-target", "bpf", "-O2", "-g", include, "-c", str(source), "-o", str(obj)], check=True
    )
    with BpfObject(obj) as o, pytest.raises(BpfError) as err:
        o.load()
    assert "[unchecked]" in err.value.log
    assert "invalid mem access 'map_value_or_null'" in err.value.log, err.value.log
    assert "invalid mem access" in str(err.value)
