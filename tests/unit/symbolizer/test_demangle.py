"""Demangling tables: Itanium C++, Rust legacy and Rust v0, clone suffixes, garbage."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bistouri.compat import zip_strict
from bistouri.symbolizer import demangle as dm
from bistouri.symbolizer.demangle import demangle, demangle_rust_legacy, demangle_rust_v0

from .helpers import FIXTURE_SRC

RUST_TABLE = [
    tuple(line.split("\t"))
    for line in (FIXTURE_SRC / "rust_symbols.tsv").read_text().splitlines()
    if line and not line.startswith("#")
]

CXX = [
    ("_ZN2ns5outerEm", "ns::outer(unsigned long)"),
    (
        "_ZN2fx6detail3mixImEET_S2_S2_",
        "unsigned long fx::detail::mix<unsigned long>(unsigned long, unsigned long)",
    ),
    ("_ZNSt6vectorIiSaIiEE9push_backERKi", "std::vector<int, std::allocator<int> >::push_back(int const&)"),
    (
        "_ZN2fx11AccumulatorImLi3EE3runEPKmm.isra.0",
        "fx::Accumulator<unsigned long, 3>::run(unsigned long const*, unsigned long) [clone .isra.0]",
    ),
    ("_Z3fooi.cold", "foo(int) [clone .cold]"),
    ("_Z3fooi.part.0.isra.0", "foo(int) [clone .part.0] [clone .isra.0]"),
    ("_Z3fooi.llvm.1234567", "foo(int)"),  # ThinLTO hash dropped
    ("_ZL3barv.lto_priv.0", "bar() [clone .lto_priv.0]"),
]


@pytest.mark.parametrize(("mangled", "expected"), CXX)
def test_itanium(mangled: str, expected: str) -> None:
    if dm.itanium_backend() == "none":
        pytest.skip("no C++ demangler installed (cxxfilt package or binutils)")
    assert demangle(mangled) == expected


@pytest.mark.parametrize(
    ("mangled", "expected"),
    [
        ("_ZN4core3ptr13drop_in_place17h0123456789abcdefE", "core::ptr::drop_in_place"),
        (
            "_ZN4core3ptr85drop_in_place$LT$std..rt..lang_start$LT$$LP$$RP$$GT$..$u7b$$u7b$closure$u7d$$u7d$$GT$"
            "17h0123456789abcdefE",
            "core::ptr::drop_in_place<std::rt::lang_start<()>::{{closure}}>",
        ),
        (
            "_ZN70_$LT$alloc..vec..Vec$LT$T$C$A$GT$$u20$as$u20$core..ops..drop..Drop$GT$4drop17h1c3fcc5a1ea2b3d4E",
            "<alloc::vec::Vec<T,A> as core::ops::drop::Drop>::drop",
        ),
        ("_ZN3foo3bar17h0123456789abcdefE.llvm.42", "foo::bar"),
        ("_ZN3foo3bar17h0123456789abcdefE.cold", "foo::bar [clone .cold]"),
    ],
)
def test_rust_legacy(mangled: str, expected: str) -> None:
    assert demangle(mangled) == expected


@pytest.mark.parametrize(
    ("mangled", "expected"),
    [
        ("_RNvCsdQRCmn6UdKS_3inl4main", "inl::main"),
        (
            "_RNvXNtCsdQRCmn6UdKS_3inl7widgetsINtB2_6WidgetKj3_ENtB2_5Named4nameB4_",
            "<inl::widgets::Widget<3> as inl::widgets::Named>::name",
        ),
        ("_RNvMs_NtCsdQRCmn6UdKS_3inl7widgetsINtB4_3NegKln7_E3valB6_", "<inl::widgets::Neg<-7>>::val"),
        ("_RNvMs0_NtCsdQRCmn6UdKS_3inl7widgetsINtB5_4FlagKb1_E3getB7_", "<inl::widgets::Flag<true>>::get"),
        ("_RNvMs1_NtCsdQRCmn6UdKS_3inl7widgetsINtB5_2ChKc78_E3getB7_", "<inl::widgets::Ch<'x'>>::get"),
        ("_RNvNtCsdQRCmn6UdKS_3inlu13ncd_dma1a7bzbu9gre_6ka8l", "inl::ünïcödé::grüße"),  # punycode
        ("_RINvCsdQRCmn6UdKS_3inl5applyNCNvB2_4main0EB2_", "inl::apply::<inl::main::{closure#0}>"),
        (
            "_RNvMs3_NtCslNYArtu3iFV_5alloc7raw_vecINtB5_6RawVecTOhFUKCBN_EuENtNtCsjrHSEGnQ3l9_3std5alloc6System"
            "E8grow_oneB13_",
            '<alloc::raw_vec::RawVec<(*mut u8, unsafe extern "C" fn(*mut u8)), std::alloc::System>>'
            "::grow_one",
        ),
        (
            "_RNvXs1g_NtCsgEmfK2I1SDS_4core3fmtRDNtB6_5DebugEL_Bx_3fmtB8_",
            "<&dyn core::fmt::Debug as core::fmt::Debug>::fmt",
        ),
        (
            "_RNvNtNtCsjrHSEGnQ3l9_3std6thread11main_thread4MAIN.0",
            "std::thread::main_thread::MAIN [clone .0]",
        ),
    ],
)
def test_rust_v0(mangled: str, expected: str) -> None:
    assert demangle(mangled) == expected


def test_rust_corpus_from_rustc() -> None:
    """~300 real rustc symbols (v0 and legacy) against what llvm-cxxfilt-19 / c++filt print."""
    assert len(RUST_TABLE) > 250
    wrong = [(m, e, demangle(m)) for m, e in RUST_TABLE if demangle(m) != e]
    assert not wrong, wrong[:5]


def test_rust_v0_agrees_with_llvm_cxxfilt() -> None:
    tool = shutil.which("llvm-cxxfilt-19")
    if tool is None:
        pytest.skip("llvm-cxxfilt-19 is not installed (apt-get install llvm-19)")
    names = [m for m, _ in RUST_TABLE if m.startswith("_R") and "." not in m]
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    for name, ref in zip_strict(names, out.splitlines()):
        assert demangle(name) == ref, name


@pytest.mark.parametrize(
    "name",
    ["main", "", "_R", "_Z", "_RNvC", "_ZN3foo", "_RNvCs_3foo3barXYZ", "_RB_", "_Zbad", "_R" + "I" * 500],
)
def test_garbage_comes_back_unchanged(name: str) -> None:
    assert demangle(name) == name


def test_strict_decoders_reject() -> None:
    with pytest.raises(ValueError):
        demangle_rust_v0("_ZN3foo3barE")
    with pytest.raises(ValueError):
        demangle_rust_legacy("_ZN3foo3barE")  # no hash: an Itanium name
    with pytest.raises(ValueError):
        demangle_rust_v0("_RNvCs_3foo")  # truncated


def test_c_names_and_clones_untouched() -> None:
    assert demangle("hidden_square.isra.0") == "hidden_square.isra.0"
    assert demangle("schedule") == "schedule"


def test_cplusplus_filter_process_fallback() -> None:
    """The long-running c++filt used when the cxxfilt module is missing."""
    tool = shutil.which("c++filt") or shutil.which("llvm-cxxfilt-19")
    if tool is None:
        pytest.skip("neither c++filt nor llvm-cxxfilt-19 is installed")
    proc = dm._FiltProcess([tool])
    try:
        assert proc.demangle("_ZN2ns5outerEm") == "ns::outer(unsigned long)"
        assert proc.demangle("_Z3fooi.isra.0") in ("foo(int) [clone .isra.0]", "foo(int) (.isra.0)")
        assert proc.demangle("has space") is None
        pid = proc.proc.pid if proc.proc else 0
        assert proc.demangle("_Z3barv") == "bar()"
        assert proc.proc is not None and proc.proc.pid == pid  # one process for every name
    finally:
        if proc.proc is not None:
            proc.proc.kill()
            proc.proc.wait()


def test_memoized() -> None:
    demangle.cache_clear()
    demangle("_ZN2ns5outerEm")
    demangle("_ZN2ns5outerEm")
    info = demangle.cache_info()
    assert info.hits == 1 and info.misses == 1
