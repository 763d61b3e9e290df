"""Demangling: Itanium C++, Rust legacy and Rust v0, chosen by mangling scheme.

`demangle(name)` picks the scheme from the name itself:

- `_R…` is Rust v0, decoded here;
- `_ZN…17h<16 hex>E` is Rust legacy (an Itanium-shaped nested name whose last
  component is a hash), decoded here with the hash dropped;
- any other `_Z…` is Itanium C++, through `cxxfilt` (libstdc++'s
  `__cxa_demangle`), else a long-running `c++filt`/`llvm-cxxfilt`, else raw.

No Rust demangler package is used: the one on PyPI mis-handles C++ names, and
C++ demanglers leave legacy Rust escapes (`$LT$`) in place. Compiler clone
suffixes (`.cold`, `.isra.0`, `.part.1`, `.llvm.123`) are kept as
` [clone .cold]`, as c++filt prints them. Anything that fails to decode comes
back unchanged. Results are memoized.

Names come from untrusted uploads (kallsyms), and both Rust v0 and Itanium
back-references can double the output at every step: a 206-character v0 name
printed 25 M characters. So the work is bounded: names over `MAX_NAME_CHARS`
are not decoded, v0 decoding stops after `_MAX_V0_STEPS` productions or
`_MAX_V0_WORK` printed characters, and a C++ name is handed to libstdc++ only
when its back-references cannot expand past `_MAX_CXX_WORK` characters. A name
over a budget comes back mangled; a C++ name that decodes longer than
`MAX_DEMANGLED_CHARS` is cut there and ends with `TRUNCATED_MARK`.
"""

from __future__ import annotations

import codecs
import functools
import logging
import math
import re
import select
import shutil
import subprocess
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_MEMO_SIZE = 1 << 14  # with the caps below, at most ~130 MB even if every entry is as long as allowed
_FILT_TIMEOUT_S = 2.0

MAX_NAME_CHARS = 4096  # mangled; longer names are left as they are
MAX_DEMANGLED_CHARS = 4096  # the longest name in 300 real rustc symbols demangles to 572
TRUNCATED_MARK = " [truncated]"
# 300 real rustc symbols take at most 132 steps and 9 149 characters of work: ~15 times that.
_MAX_V0_STEPS = 1 << 11  # grammar productions, each back-reference expansion counted again
_MAX_V0_WORK = 1 << 17  # characters printed along the way, a nested part counted at every level
_MAX_CXX_WORK = 1 << 22  # estimated characters libstdc++ may print before the cut
# Itanium back-references: substitutions (S_, S0_, …) and template parameters (T_, T0_, …).
_CXX_BACKREF = re.compile(r"[ST][0-9A-Z]*_")

# Clone suffixes GCC and LLVM append to a mangled name.
_SUFFIX = re.compile(r"(\.(?:cold|part|isra|constprop|lto_priv|localalias|clone|str|unlikely)(?:\.\d+)*)+$")
# ThinLTO's promotion suffix is a hash that only makes names differ between builds: dropped.
_LLVM_SUFFIX = re.compile(r"\.llvm\.\d+$")
_LEGACY_HASH = re.compile(r"h[0-9a-f]{16}")


class _Invalid(Exception):
    """The name does not follow the scheme it looked like."""


class _OverBudget(_Invalid):
    """The name would print too much or take too long to decode: left mangled."""


# --- Rust legacy ----------------------------------------------------------------

_LEGACY_ESCAPES = {"SP": "@", "BP": "*", "RF": "&", "LT": "<", "GT": ">", "LP": "(", "RP": ")", "C": ","}


def _legacy_component(part: str) -> str:
    # A component starting with an escape is prefixed with "_" to stay an identifier.
    if part.startswith("_$"):
        part = part[1:]
    out: list[str] = []
    i = 0
    n = len(part)
    while i < n:
        c = part[i]
        if c == "$":
            end = part.find("$", i + 1)
            if end < 0:
                raise _Invalid(part)
            code = part[i + 1 : end]
            if code in _LEGACY_ESCAPES:
                out.append(_LEGACY_ESCAPES[code])
            elif code.startswith("u") and 1 < len(code) <= 7:
                try:
                    out.append(chr(int(code[1:], 16)))
                except ValueError:
                    raise _Invalid(part)
            else:
                raise _Invalid(part)
            i = end + 1
        elif c == "." and i + 1 < n and part[i + 1] == ".":
            out.append("::")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def demangle_rust_legacy(name: str) -> str:
    """`_ZN3foo3bar17h0123456789abcdefE` → `foo::bar`. Raises ValueError if not legacy Rust."""
    if not name.startswith("_ZN"):
        raise ValueError(f"not a legacy Rust symbol: {name!r}")
    parts: list[str] = []
    i = 3
    n = len(name)
    while i < n and name[i] != "E":
        j = i
        while j < n and name[j].isdigit():
            j += 1
        if j == i:
            raise ValueError(f"bad length at {i} in {name!r}")
        length = int(name[i:j])
        parts.append(name[j : j + length])
        if len(parts[-1]) != length:
            raise ValueError(f"truncated component in {name!r}")
        i = j + length
    if i >= n or not parts or not _LEGACY_HASH.fullmatch(parts[-1]):
        raise ValueError(f"not a legacy Rust symbol: {name!r}")
    try:
        return "::".join(_legacy_component(p) for p in parts[:-1])
    except _Invalid as e:
        raise ValueError(f"bad escape {e} in {name!r}")


# --- Rust v0 --------------------------------------------------------------------

_BASIC_TYPES = {
    "a": "i8",
    "b": "bool",
    "c": "char",
    "d": "f64",
    "e": "str",
    "f": "f32",
    "h": "u8",
    "i": "isize",
    "j": "usize",
    "l": "i32",
    "m": "u32",
    "n": "i128",
    "o": "u128",
    "s": "i16",
    "t": "u16",
    "u": "()",
    "v": "...",
    "x": "i64",
    "y": "u64",
    "z": "!",
    "p": "_",
}
_SIGNED = frozenset("ailnsx")
_UNSIGNED = frozenset("hjmoty")
_MAX_DEPTH = 256


class _V0:
    """Recursive-descent reader for the v0 grammar (RFC 2603), printing as it goes.

    Output follows rustc-demangle's alternate form, as llvm-symbolizer shows it:
    no crate disambiguator hashes, no type suffix on integer constants.
    """

    def __init__(self, sym: str) -> None:
        self.s = sym  # the symbol after "_R"
        self.pos = 0
        self.depth = 0
        self.bound = 0  # lifetimes bound by enclosing for<...> binders
        self.steps = 0
        self.work = 0

    # -- lexing --

    def peek(self) -> str:
        return self.s[self.pos] if self.pos < len(self.s) else ""

    def next(self) -> str:
        if self.pos >= len(self.s):
            raise _Invalid("unexpected end")
        c = self.s[self.pos]
        self.pos += 1
        return c

    def eat(self, c: str) -> bool:
        if self.peek() == c:
            self.pos += 1
            return True
        return False

    def base62(self) -> int:
        if self.eat("_"):
            return 0
        value = 0
        while True:
            c = self.next()
            if c == "_":
                return value + 1
            if c.isdigit():
                d = ord(c) - 48
            elif "a" <= c <= "z":
                d = ord(c) - 97 + 10
            elif "A" <= c <= "Z":
                d = ord(c) - 65 + 36
            else:
                raise _Invalid("bad base-62 digit")
            value = value * 62 + d
            if value > 1 << 64:
                raise _Invalid("base-62 overflow")

    def opt_base62(self, tag: str) -> int:
        return self.base62() + 1 if self.eat(tag) else 0

    def decimal(self) -> int:
        if self.eat("0"):  # no leading zeros: "0" stands alone
            return 0
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            raise _Invalid("bad decimal")
        return int(self.s[start : self.pos])

    def ident(self) -> tuple[int, str]:
        dis = self.opt_base62("s")
        puny = self.eat("u")
        length = self.decimal()
        self.eat("_")
        raw = self.s[self.pos : self.pos + length]
        if len(raw) != length:
            raise _Invalid("truncated identifier")
        self.pos += length
        if puny:
            basic, sep, ext = raw.rpartition("_")
            try:
                raw = codecs.decode((basic + "-" + ext if sep else ext).encode("ascii"), "punycode")
            except (UnicodeError, ValueError):
                raise _Invalid("bad punycode")
        return dis, raw

    def backref(self, fn: Callable[[bool], str], in_value: bool) -> str:
        start = self.pos - 1
        target = self.base62()
        if target >= start:
            raise _Invalid("forward backref")
        saved = self.pos
        self.pos = target
        try:
            return fn(in_value)
        finally:
            self.pos = saved

    def enter(self) -> None:
        self.depth += 1
        self.steps += 1
        if self.depth > _MAX_DEPTH:
            raise _Invalid("too deep")
        if self.steps > _MAX_V0_STEPS:
            raise _OverBudget(f"over {_MAX_V0_STEPS} steps")

    def printed(self, text: str) -> str:
        # Back-references re-print what they point to: what a symbol prints is bounded, not its length.
        self.work += len(text)
        if len(text) > MAX_DEMANGLED_CHARS:
            raise _OverBudget(f"demangles to over {MAX_DEMANGLED_CHARS} characters")
        if self.work > _MAX_V0_WORK:
            raise _OverBudget(f"over {_MAX_V0_WORK} characters of work")
        return text

    # -- grammar --

    def path(self, in_value: bool) -> str:
        self.enter()
        try:
            return self.printed(self._path(in_value))
        finally:
            self.depth -= 1

    def _path(self, in_value: bool) -> str:
        c = self.next()
        if c == "C":
            return self.ident()[1]
        if c == "N":
            ns = self.next()
            prefix = self.path(in_value)
            dis, name = self.ident()
            if "A" <= ns <= "Z":
                kind = {"C": "closure", "S": "shim"}.get(ns, ns)
                label = f"{kind}:{name}" if name else kind
                return f"{prefix}::{{{label}#{dis}}}"
            return f"{prefix}::{name}" if name else prefix
        if c == "M":
            self.opt_base62("s")
            self.path(False)  # the impl's own path is not printed
            return f"<{self.type_()}>"
        if c == "X":
            self.opt_base62("s")
            self.path(False)
            ty = self.type_()
            return f"<{ty} as {self.path(False)}>"
        if c == "Y":
            ty = self.type_()
            return f"<{ty} as {self.path(False)}>"
        if c == "I":
            base = self.path(in_value)
            args = self.generic_args()
            return f"{base}{'::' if in_value else ''}<{args}>"
        if c == "B":
            return self.backref(self.path, in_value)
        raise _Invalid(f"bad path tag {c!r}")

    def generic_args(self) -> str:
        args = []
        while not self.eat("E"):
            if self.eat("L"):
                lt = self.lifetime_name(self.base62())
                if lt != "'_":
                    args.append(lt)
            elif self.eat("K"):
                args.append(self.const())
            else:
                args.append(self.type_())
        return ", ".join(args)

    def lifetime_name(self, index: int) -> str:
        if index == 0:
            return "'_"
        depth = self.bound - index
        if depth < 0:
            raise _Invalid("unbound lifetime")
        return "'" + chr(ord("a") + depth) if depth < 26 else f"'_{depth}"

    def binder(self) -> str:
        if not self.eat("G"):
            return ""
        count = self.base62() + 1
        if count > _MAX_DEPTH:
            raise _Invalid(f"binder of {count} lifetimes")
        names = [self.lifetime_name_new(i) for i in range(count)]
        self.bound += count
        return f"for<{', '.join(names)}> "

    def lifetime_name_new(self, i: int) -> str:
        depth = self.bound + i
        return "'" + chr(ord("a") + depth) if depth < 26 else f"'_{depth}"

    def type_(self, _in_value: bool = False) -> str:
        self.enter()
        try:
            return self.printed(self._type())
        finally:
            self.depth -= 1

    def _type(self) -> str:
        c = self.peek()
        if c in _BASIC_TYPES:
            self.pos += 1
            return _BASIC_TYPES[c]
        if c in "CMNXYI":
            return self.path(False)
        self.pos += 1
        if c == "A":
            ty = self.type_()
            return f"[{ty}; {self.const()}]"
        if c == "S":
            return f"[{self.type_()}]"
        if c in "RQ":
            lt = ""
            if self.eat("L"):
                name = self.lifetime_name(self.base62())
                lt = "" if name == "'_" else name + " "
            mut = "mut " if c == "Q" else ""
            return f"&{lt}{mut}{self.type_()}"
        if c == "P":
            return f"*const {self.type_()}"
        if c == "O":
            return f"*mut {self.type_()}"
        if c == "F":
            return self.fn_sig()
        if c == "D":
            return self.dyn_bounds()
        if c == "T":
            items = []
            while not self.eat("E"):
                items.append(self.type_())
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if c == "B":
            return self.backref(self.type_, False)
        raise _Invalid(f"bad type tag {c!r}")

    def fn_sig(self) -> str:
        saved_bound = self.bound
        head = self.binder()
        if self.eat("U"):
            head += "unsafe "
        if self.eat("K"):
            abi = "C" if self.eat("C") else self.ident_raw().replace("_", "-")
            head += f'extern "{abi}" '
        params = []
        while not self.eat("E"):
            params.append(self.type_())
        ret = self.type_()
        self.bound = saved_bound
        out = f"{head}fn({', '.join(params)})"
        return out if ret == "()" else f"{out} -> {ret}"

    def ident_raw(self) -> str:
        length = self.decimal()
        self.eat("_")
        raw = self.s[self.pos : self.pos + length]
        self.pos += length
        return raw

    def dyn_bounds(self) -> str:
        saved_bound = self.bound
        head = self.binder()
        traits = []
        while not self.eat("E"):
            trait = self.path(False)
            assoc = []
            while self.eat("p"):
                name = self.ident_raw()
                assoc.append(f"{name} = {self.type_()}")
            if assoc:
                joined = ", ".join(assoc)
                trait = f"{trait[:-1]}, {joined}>" if trait.endswith(">") else f"{trait}<{joined}>"
            traits.append(trait)
        self.bound = saved_bound
        lt = ""
        if self.eat("L"):
            name = self.lifetime_name(self.base62())
            lt = "" if name == "'_" else f" + {name}"
        return f"dyn {head}{' + '.join(traits)}{lt}"

    def const(self, _in_value: bool = False) -> str:
        self.enter()
        try:
            return self.printed(self._const())
        finally:
            self.depth -= 1

    def _const(self) -> str:
        if self.eat("p"):
            return "_"
        if self.eat("B"):
            return self.backref(self.const, False)
        ty = self.next()
        if ty in _SIGNED or ty in _UNSIGNED:
            neg = ty in _SIGNED and self.eat("n")
            value = self.hex_digits()
            return f"-{value}" if neg else str(value)
        if ty == "b":
            value = self.hex_digits()
            if value > 1:
                raise _Invalid("bad bool")
            return "true" if value else "false"
        if ty == "c":
            code = self.hex_digits()
            if code > 0x10FFFF:
                raise _Invalid("bad char")
            return repr(chr(code))
        raise _Invalid(f"unsupported const type {ty!r}")

    def hex_digits(self) -> int:
        start = self.pos
        while self.peek() in "0123456789abcdef" and self.peek():
            self.pos += 1
        digits = self.s[start : self.pos]
        if not self.eat("_"):
            raise _Invalid("bad const")
        return int(digits, 16) if digits else 0


def demangle_rust_v0(name: str) -> str:
    """`_RNvCs1234_4core3foo` → `core::foo`. Raises ValueError if the name is not valid v0."""
    if not name.startswith("_R"):
        raise ValueError(f"not a Rust v0 symbol: {name!r}")
    body = name[2:]
    if body[:1].isdigit():  # optional encoding version
        raise ValueError(f"unsupported Rust v0 encoding version in {name!r}")
    p = _V0(body)
    try:
        out = p.path(True)
        # Optional instantiating crate, not printed.
        if p.peek() in ("C", "B", "N", "I", "M", "X", "Y"):
            p.path(False)
    except (_Invalid, IndexError, RecursionError) as e:
        raise ValueError(f"invalid Rust v0 symbol {name!r}: {e}")
    if p.pos != len(body):
        raise ValueError(f"trailing characters in Rust v0 symbol {name!r}")
    return out


# --- Itanium C++ ----------------------------------------------------------------


class _FiltProcess:
    """A long-running c++filt reading one name per line: the fallback when cxxfilt is missing."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.broken = False

    def demangle(self, name: str) -> str | None:
        if self.broken or not name.isprintable() or " " in name:
            return None
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = subprocess.Popen(
                        self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
                    )
                assert self.proc.stdin is not None and self.proc.stdout is not None
                self.proc.stdin.write(name.encode() + b"\n")
                self.proc.stdin.flush()
                ready, _, _ = select.select([self.proc.stdout], [], [], _FILT_TIMEOUT_S)
                if not ready:
                    raise TimeoutError(f"{self.argv[0]} did not answer within {_FILT_TIMEOUT_S} s")
                line = self.proc.stdout.readline()
                if not line:
                    raise EOFError(f"{self.argv[0]} exited")
                return line.decode("utf-8", "replace").rstrip("\n")
            except (OSError, TimeoutError, EOFError) as e:
                log.warning(
                    "C++ demangler process failed; names stay mangled. argv=%s error=%s", self.argv, e
                )
                self.broken = True
                if self.proc is not None:
                    self.proc.kill()
                return None


def _itanium_backend() -> tuple[str, Callable[[str], str | None]]:
    try:
        import cxxfilt

        def via_cxxfilt(name: str) -> str | None:
            try:
                return str(cxxfilt.demangle(name, external_only=False))
            except cxxfilt.Error:
                return None

        return "cxxfilt", via_cxxfilt
    except Exception as e:  # ImportError, or cxxfilt failing to find libstdc++ at import
        reason = str(e)
    for tool in ("c++filt", "llvm-cxxfilt-19", "llvm-cxxfilt"):
        path = shutil.which(tool)
        if path:
            log.info("cxxfilt module unavailable, using %s for C++ names. reason=%s", tool, reason)
            return tool, _FiltProcess([path]).demangle
    log.warning(
        "No C++ demangler: install the cxxfilt package or binutils (c++filt); C++ names stay mangled. "
        "reason=%s",
        reason,
    )
    return "none", lambda name: None


_chosen: tuple[str, Callable[[str], str | None]] | None = None
_choosing = threading.Lock()


def _itanium_chosen() -> tuple[str, Callable[[str], str | None]]:
    """The C++ demangler, chosen at the first C++ name: importing cxxfilt looks libstdc++ up
    (`ldconfig -p`, run twice), which naming C or Python code never needs (`record`'s runs)."""
    global _chosen
    if _chosen is None:
        with _choosing:
            if _chosen is None:
                _chosen = _itanium_backend()
    return _chosen


def itanium_backend() -> str:
    """Which C++ demangler is in use: cxxfilt, c++filt, llvm-cxxfilt(-19) or none."""
    return _itanium_chosen()[0]


# --- dispatcher -----------------------------------------------------------------


def _split_suffix(name: str) -> tuple[str, str]:
    m = _SUFFIX.search(name)
    if m is None or m.start() == 0:
        return name, ""
    return name[: m.start()], name[m.start() :]


def _clone_suffix(suffix: str) -> str:
    # ".part.0.isra.0" → " [clone .part.0] [clone .isra.0]", as c++filt prints it.
    parts = re.findall(r"\.[A-Za-z_]*(?:\.?\d+)*", suffix)
    return "".join(f" [clone {p}]" for p in parts)


# k back-references can multiply a name's length by up to ~3^(k/3) (each group of three tripling it).
_LOG_REF_GROWTH = math.log(3) / 3
_LOG_MAX_CXX_WORK = math.log(_MAX_CXX_WORK)


def _itanium_bounded(name: str) -> str | None:
    # libstdc++ has no output limit: f(A, A<A, A>, A<A<A, A>, A<A, A> >, …) printed 3.5 GB from 284
    # characters. A name that could print more than the budget is not handed to it.
    refs = len(_CXX_BACKREF.findall(name))
    if refs * _LOG_REF_GROWTH + math.log(len(name)) > _LOG_MAX_CXX_WORK:
        return None
    out = _itanium_chosen()[1](name)
    if out and len(out) > MAX_DEMANGLED_CHARS:
        out = out[: MAX_DEMANGLED_CHARS - len(TRUNCATED_MARK)] + TRUNCATED_MARK
    return out


@functools.lru_cache(maxsize=_MEMO_SIZE)
def demangle(name: str) -> str:
    """Demangle a linkage name of any supported scheme; unknown, invalid or over-budget names stay as is."""
    if not name.startswith(("_Z", "_R")) or len(name) > MAX_NAME_CHARS:
        return name
    if "." in name:
        m = _LLVM_SUFFIX.search(name)
        if m is not None:
            name = name[: m.start()]
    if name[1] == "R":
        # v0 names never contain a dot: anything after one is a suffix.
        base, dot, rest = name.partition(".")
        try:
            return demangle_rust_v0(base) + _clone_suffix(dot + rest)
        except ValueError:
            return name
    if name.startswith("_ZN"):
        base, suffix = _split_suffix(name) if "." in name else (name, "")
        if base.endswith("E") and base[-20:-18] == "17" and _LEGACY_HASH.fullmatch(base[-18:-1]):
            try:
                return demangle_rust_legacy(base) + _clone_suffix(suffix)
            except ValueError:
                pass
    out = _itanium_bounded(name)
    return out if out else name
