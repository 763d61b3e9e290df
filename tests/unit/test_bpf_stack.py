"""The combined stack of every program's call chains, <= 512 bytes, read from the built objects.

Kernel 6.1's verifier refuses a program whose chain of BPF-to-BPF calls needs more than 512 bytes
of stack together; this machine's 6.18 loads it, so only a VM used to catch it. The check is static
(testkit/bpfstack.py over `llvm-objdump`), on both objects, x86-64's and arm64's.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bistouri.bpf import loader
from testkit import bpfstack
from tests.conftest import BPF_OBJECT

pytestmark = pytest.mark.skipif(shutil.which("llvm-objdump") is None, reason="no llvm-objdump")

OBJECTS = [BPF_OBJECT, BPF_OBJECT.with_name(loader.object_name("aarch64"))]

# Two programs over a shared callee: one within the limit, one past it, and a bpf_loop callback.
PAST_THE_LIMIT = r"""
#define SEC(name) __attribute__((section(name), used))
typedef unsigned long long u64;
static long (*bpf_loop)(unsigned int, void *, void *, u64) = (void *)181;

static __attribute__((noinline)) int leaf(int i)
{
    volatile char buf[200];
    buf[i & 127] = 1;
    return buf[(i + 1) & 127];
}

static int step(unsigned int i, void *ctx)
{
    volatile char buf[100];
    buf[i & 63] = 1;
    return buf[3];
}

SEC("tracepoint/a") int deep(void *ctx)
{
    volatile char buf[400];
    buf[(long)ctx & 255] = 1;
    return leaf(buf[3]) + buf[5];
}

SEC("tracepoint/b") int shallow(void *ctx)
{
    volatile char buf[64];
    buf[(long)ctx & 31] = 1;
    return leaf(buf[3]);
}

SEC("tracepoint/c") int looped(void *ctx)
{
    volatile char buf[400];
    buf[(long)ctx & 255] = 1;
    return bpf_loop(4, step, 0, 0) + buf[5];
}

char LICENSE[] SEC("license") = "GPL";
"""


@pytest.fixture(scope="module")
def past_the_limit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("clang") is None:
        pytest.skip("no clang")
    d = tmp_path_factory.mktemp("bpfstack")
    src, obj = d / "past.bpf.c", d / "past.bpf.o"
    src.write_text(PAST_THE_LIMIT)
    subprocess.run(["clang", "-target", "bpf", "-O2", "-g", "-c", str(src), "-o", str(obj)], check=True)
    return obj


def test_a_chain_past_the_limit_is_found(past_the_limit: Path):
    chains = bpfstack.chains(past_the_limit)
    assert set(chains) == {"deep", "shallow", "looped"}
    # 400 -> 416 and 200 -> 224, each rounded up to 32 as the verifier does.
    assert chains["deep"] == (416 + 224, ["deep", "leaf"])
    assert chains["shallow"] == (64 + 224, ["shallow", "leaf"])
    assert chains["deep"][0] > bpfstack.MAX_BPF_STACK >= chains["shallow"][0]


def test_a_callback_runs_on_top_of_its_caller(past_the_limit: Path):
    total, chain = bpfstack.chains(past_the_limit)["looped"]
    assert chain == ["looped", "step"]
    assert total == 416 + 128


@pytest.mark.parametrize("obj", OBJECTS, ids=["x86-64", "arm64"])
def test_every_call_chain_fits_in_512_bytes(obj: Path):
    if not obj.exists():
        pytest.skip(f"{obj} is not built (run `make bpf`)")
    chains = bpfstack.chains(obj)
    assert "handle_perf" in chains
    # The walks' callees are seen (else every chain would be one frame and the check empty).
    assert len(chains["handle_perf"][1]) >= 3
    past = {name: c for name, c in chains.items() if c[0] > bpfstack.MAX_BPF_STACK}
    assert past == {}, "combined stack past 512 bytes (refused by 6.1's verifier)"
