"""Attack suite, in process: hostile symbols, msgpack shapes and stack depths against the symbolizer's parts.

Each input here once broke something (see tests/hostile.py); hypothesis then looks for the next one. The
same inputs go through the real service in tests/integration/test_attacks_input.py.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bistouri.symbolizer import demangle as dm
from bistouri.symbolizer.demangle import demangle
from tests.hostile import cxx_bomb, rust_v0_bomb

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------
# Demangler


def _bounded(name: str, out: str) -> bool:
    # A clone suffix adds at most " [clone ]" per ".part" of the name.
    return len(out) <= dm.MAX_DEMANGLED_CHARS + 5 * len(name)


def test_rust_v0_backref_bomb_stays_mangled() -> None:
    """206 characters printed 25 M characters in 13 s: the budget stops it and the name stays mangled."""
    for levels in (21, 25, 60):
        name = rust_v0_bomb(levels)
        assert demangle(name) == name


def test_rust_v0_backrefs_within_budget_still_decode() -> None:
    out = demangle(rust_v0_bomb(3))
    assert out == "a::f::<u8, (u8, u8), ((u8, u8), (u8, u8)), (((u8, u8), (u8, u8)), ((u8, u8), (u8, u8)))>"


def test_cxx_substitution_bomb_never_reaches_libstdcxx() -> None:
    """284 characters made __cxa_demangle print 3.5 GB in 40 s."""
    for levels in (28, 40):
        name = cxx_bomb(levels)
        assert demangle(name) == name


def test_cxx_output_is_cut_at_the_limit() -> None:
    # 9 levels print 6.5 k characters: within the work estimate, over the output limit.
    out = demangle(cxx_bomb(9))
    assert len(out) == dm.MAX_DEMANGLED_CHARS
    assert out.startswith("f(A, A<A, A>, A<A<A, A>") and out.endswith(dm.TRUNCATED_MARK)


def test_overlong_names_are_not_decoded() -> None:
    name = "_ZN" + "3foo" * (dm.MAX_NAME_CHARS // 4) + "E"
    assert demangle(name) == name


def test_v0_char_constant_out_of_unicode_is_invalid() -> None:
    name = "_RINvC1a1fKcffffffffffffffffff_E"  # chr() of it raised OverflowError, not ValueError
    assert demangle(name) == name


def test_v0_huge_binder_is_invalid() -> None:
    name = "_RINvC1a1fFGzzzzzzzzzz_EuEE"  # for<'a, 'b, … 10^17 lifetimes> fn()
    assert demangle(name) == name


_V0_TOKENS = list("CNIMXYBEGKLTARQPOFDSpuvhjlmxyUcsb_0123456789") + ["B_", "B0_", "B1_", "3foo", "Cs1_"]


@FUZZ
@given(st.text(max_size=600))
def test_fuzz_any_text(name: str) -> None:
    for candidate in (name, "_R" + name, "_Z" + name, "_ZN" + name):
        out = demangle(candidate)
        assert isinstance(out, str) and _bounded(candidate, out)


@FUZZ
@given(st.lists(st.sampled_from(_V0_TOKENS), max_size=300), st.integers(0, 80))
def test_fuzz_v0_shaped(tokens: list[str], levels: int) -> None:
    for name in ("_R" + "".join(tokens), rust_v0_bomb(levels) + "".join(tokens), rust_v0_bomb(levels)):
        out = demangle(name)
        assert isinstance(out, str) and _bounded(name, out)


@FUZZ
@given(st.lists(st.sampled_from(list("NIESTLZ_0123456789AvifKRP") + ["S_", "S0_", "T_", "1A"]), max_size=300))
def test_fuzz_itanium_shaped(tokens: list[str]) -> None:
    name = "_Z" + "".join(tokens)
    out = demangle(name)
    assert isinstance(out, str) and _bounded(name, out)
