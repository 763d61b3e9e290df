"""A process recognised as CPython and described for the BPF walk, or the reason it is not.

`describe(pid)` reads the process's maps, opens the ELF that holds the interpreter (a mapped
`libpython3.X*.so*`, else the executable) the safe way (`procmaps.MappedPath`: the very file mapped, else
its path inside the process's root with no link followed, bounded in size), and from its dynamic symbols
and the live memory finds:

- the version: `Py_Version` (3.11+), the `_Py_DebugOffsets` header at `_PyRuntime` (3.13+), else the
  file's name (`libpython3.9.so.1.0`, `python3.9`);
- `_PyRuntime` and the pthread key CPython binds each thread's state to (`autoTSSkey`);
- where, from the thread pointer, the sampled thread's `PyThreadState` is: glibc keeps the value of a key
  below 32 in `struct pthread` at `B + 16*key + 8`, and `pthread_self()` is the thread pointer (fsbase on
  x86-64). `B` is glibc's own; it is found on the live process: the interpreter's thread list gives each
  thread's state and `pthread_self()` (`thread_id`), and the one `B` at which those threads' key slots
  hold their own states is it. The key slot holds the state whether the thread holds the GIL or not (the
  runtime's "current" thread state names the GIL holder, 3.12+'s thread-local is NULL while a thread waits
  without the GIL: notes cpython-frames.md §3);
- the eval loop's address ranges (splicing Python frames into the native stack).

Everything read is bounded and checked; a process this cannot describe gets an `Unsupported` with a
`reason` (a metric label and a data-quality note) and keeps its native frames.
"""

from __future__ import annotations

import itertools
import os
import re
import struct
from dataclasses import dataclass

from ..bpf import abi
from ..compat import SLOTS
from ..elf import ElfFile, ElfFormatError
from ..host import safeopen
from ..host.procmaps import MappedPath
from .layouts import LAYOUTS, SHIM_OWNER, STR_HASH, Layout
from .memory import MemoryReadError, ProcessMemory

MAX_MAPS_BYTES = 16 << 20  # of /proc/PID/maps
MAX_ELF_BYTES = 512 << 20  # of the interpreter's file
MAX_THREADS = 64  # thread states looked at to find the key slot
# Where glibc's inline key slots may start in struct pthread (0x310 on 2.36, x86-64).
_SLOTS_MIN, _SLOTS_MAX = 0x100, 0x1000
_KEYS_INLINE = 32  # PTHREAD_KEY_2NDLEVEL_SIZE: keys past it live in a second-level block
_DEBUG_COOKIE = b"xdebugpy"

_LIBPYTHON = re.compile(r"^libpython(3)\.(\d{1,2})[a-z]*\.so")
_PYTHON = re.compile(r"^python(3)\.(\d{1,2})[a-z]*$")
_EVAL = ("_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold")  # GCC may split out a .cold part
_SYMBOLS = (
    "_PyRuntime",
    "Py_Version",
    "_PyEval_EvalFrameDefault",
    "_PyEval_EvalFrameDefault.cold",
    "PyCode_Type",
    "PyUnicode_Type",
    "PyBytes_Type",
    "_Py_next_func_version",  # 3.12's count of code objects made (a local symbol: .symtab only)
)

# Why a process has no Python frames (metric label `reason`, a session's data-quality note).
REASONS = (
    "not_python",  # no interpreter in it (no libpython, no _PyRuntime)
    "version_unknown",  # a CPython we have no layout for (the version is in the detail)
    "free_threaded",  # a free-threaded (no GIL) build: other object layouts, not walked yet
    "layout_mismatch",  # the interpreter's own debug offsets (3.13+) disagree with our layout
    "no_thread_key",  # the thread-state slot was not found (not glibc, a key >= 32, no thread state)
    "unreadable",  # its maps, file or memory could not be read (permissions, gone)
)


@dataclass(frozen=True, **SLOTS)
class Unsupported:
    """Why a process gets no Python frames."""

    reason: str  # one of REASONS
    detail: str


@dataclass(frozen=True, **SLOTS)
class Interpreter:
    """A CPython process, as the BPF walk and the namer need it. Addresses are the process's."""

    pid: int
    version: tuple[int, int, int]
    layout: Layout
    path: str  # the interpreter's ELF in the process's root
    build_id: bytes
    bias: int  # process address = file virtual address + bias
    runtime: int  # _PyRuntime
    tss_key: int
    tstate_slot: int  # the thread's state is at (thread pointer + tstate_slot)
    eval_ranges: tuple[tuple[int, int], ...]  # [start, end) of the eval loop, offsets in the file (`path`)
    code_type: int
    str_type: int
    bytes_type: int
    # The count of code objects made: its address (3.12), or its offset in the thread's interpreter state
    # (counter_in_interp, 3.13); 0: none (before 3.12, or not found)
    code_counter: int = 0
    counter_in_interp: bool = False

    @property
    def version_text(self) -> str:
        """`3.11.7`; `3.9` when only the file's name said which (the micro version unknown)."""
        major, minor, micro = self.version
        return f"{major}.{minor}.{micro}" if micro or self.layout.version >= (3, 11) else f"{major}.{minor}"


# Each record's own number (bistouri_python_proc.owner): checksums BPF keeps between samples are a record's.
_OWNERS = itertools.count(1)


def record(interp: Interpreter) -> abi.PythonProc:
    """The BPF walk's record of a process (map `python_procs`, keyed by tgid)."""
    lay = interp.layout
    frame_fields = (lay.frame_previous, lay.frame_code, lay.frame_instr, lay.frame_entry)
    window = min(lay.code_firstlineno, lay.code_filename)
    checksummed = lay.checksum_fields
    return abi.PythonProc(
        tstate_slot=interp.tstate_slot,
        tstate_frame=lay.tstate_frame,
        cframe_frame=lay.cframe_frame,
        frame_previous=lay.frame_previous,
        frame_code=lay.frame_code,
        frame_instr=lay.frame_instr,
        frame_entry=lay.frame_entry,
        frame_size=(max(frame_fields) + 8 + 7) & ~7,
        code_adaptive=max(lay.code_adaptive, 0),
        code_window=window,
        code_window_size=max(checksummed) + 8 - window,
        code_firstlineno=lay.code_firstlineno - window,
        code_filename=lay.code_filename - window,
        code_name=lay.code_name - window,
        code_linetable=lay.code_linetable - window,
        instr_kind=lay.instr_kind,
        entry_kind=lay.entry_kind,
        shim_owner=SHIM_OWNER,
        version=lay.version[0] << 8 | lay.version[1],
        str_hash=STR_HASH,
        tstate_datastack=lay.tstate_datastack,
        code_version=lay.code_version - window if lay.code_version >= 0 else -1,
        code_counter=interp.code_counter,
        owner=next(_OWNERS),
        tstate_interp=lay.tstate_interp,
        counter_in_interp=interp.counter_in_interp,
    )


def maps_libpython(pid: int, proc_root: str = "/proc") -> bool:
    """Whether `pid` maps a libpython now (one starting, or embedding Python, maps it after its exec)."""
    try:
        maps = _read_bounded(f"{proc_root}/{pid}/maps", MAX_MAPS_BYTES)
    except OSError:
        return False
    return any(_LIBPYTHON.match(os.path.basename(path)) for path in _file_mappings(maps))


def describe(pid: int, proc_root: str = "/proc") -> Interpreter | Unsupported:
    """The CPython interpreter of `pid`, or why there is none we can walk."""
    proc = f"{proc_root}/{pid}"
    try:
        maps = _read_bounded(f"{proc}/maps", MAX_MAPS_BYTES)
        exe = os.readlink(f"{proc}/exe").removesuffix(" (deleted)")
    except OSError as e:
        return Unsupported("unreadable", f"maps: {e.strerror}")
    found = _interpreter_file(_file_mappings(maps), exe)
    if found is None:
        return Unsupported("not_python", "no libpython mapped, no executable mapping")
    path, mappings = found
    try:
        fd = MappedPath(proc, mappings[0][3], path).open(max_bytes=MAX_ELF_BYTES)
    except safeopen.Refused as e:
        return Unsupported("unreadable", f"{path}: refused ({e.reason})")
    except OSError as e:
        return Unsupported("unreadable", f"{path}: {e.strerror}")
    try:
        with ElfFile(safeopen.fd_path(fd)) as elf:
            symbols = elf.find_symbols(_SYMBOLS)
            bias = _bias(elf, mappings)
            build_id = elf.build_id or b""
            evals = _eval_offsets(elf, symbols)
    except ElfFormatError as e:
        return Unsupported("not_python", str(e))
    finally:
        os.close(fd)
    if "_PyRuntime" not in symbols:
        return Unsupported("not_python", f"{path}: no _PyRuntime")
    if bias is None:
        return Unsupported("unreadable", f"{path}: no mapping of its first segment")
    try:
        with ProcessMemory(pid, proc_root) as mem:
            return _describe(pid, mem, path, build_id, bias, symbols, evals)
    except OSError as e:
        return Unsupported("unreadable", f"memory: {e.strerror}")
    except MemoryReadError as e:
        return Unsupported("unreadable", str(e))


def _describe(
    pid: int,
    mem: ProcessMemory,
    path: str,
    build_id: bytes,
    bias: int,
    symbols: dict[str, tuple[int, int]],
    evals: tuple[tuple[int, int], ...],
) -> Interpreter | Unsupported:
    runtime = symbols["_PyRuntime"][0] + bias
    version = _version(mem, runtime, symbols, bias, path)
    if version is None:
        return Unsupported("version_unknown", f"{path}: no version found")
    layout = LAYOUTS.get(version[:2])
    if layout is None:
        return Unsupported("version_unknown", f"{path}: CPython {'.'.join(map(str, version))}")
    if layout.version >= (3, 13):
        refused = _check_debug_offsets(mem.read(runtime, _DEBUG_313.size), layout)
        if refused is not None:
            return refused
    initialized, key = struct.unpack("<iI", mem.read(runtime + layout.runtime_tss_key, 8))
    if initialized != 1:
        return Unsupported("no_thread_key", f"autoTSSkey not initialized ({initialized})")
    if key >= _KEYS_INLINE:
        return Unsupported("no_thread_key", f"pthread key {key} is not an inline one")
    base = _key_slots(mem, layout, runtime, key)
    if base is None:
        return Unsupported("no_thread_key", "no thread's key slot holds its thread state")
    return Interpreter(
        pid=pid,
        version=version,
        layout=layout,
        path=path,
        build_id=build_id,
        bias=bias,
        runtime=runtime,
        tss_key=key,
        tstate_slot=base + 16 * key + 8,
        eval_ranges=evals,
        code_type=_address(symbols, "PyCode_Type", bias),
        str_type=_address(symbols, "PyUnicode_Type", bias),
        bytes_type=_address(symbols, "PyBytes_Type", bias),
        **_code_counter(mem, layout, runtime, symbols, bias),
    )


def _code_counter(
    mem: ProcessMemory, layout: Layout, runtime: int, symbols: dict[str, tuple[int, int]], bias: int
) -> dict:
    """Where the count of code objects made is (Interpreter.code_counter): BPF takes a checksum from an
    earlier sample only while it has not moved, so a wrong place would name a reused address wrongly.
    3.12's is a symbol of its own; 3.13's field is taken only in a build whose interpreter state has the
    size of the one its offset was read from (_Py_DebugOffsets says) and where the main interpreter's
    holds a count (not 0: ran out or not there; below 2^31: a pointer's low half is not one)."""
    if layout.version == (3, 12) and "_Py_next_func_version" in symbols:
        return {"code_counter": symbols["_Py_next_func_version"][0] + bias}
    if layout.interp_code_counter >= 0:
        try:
            _cookie, _version, _free, *offsets = _DEBUG_313.unpack(mem.read(runtime, _DEBUG_313.size))
            if offsets[_DEBUG_INTERP_SIZE] != layout.interp_size:
                return {}
            main = mem.u64(runtime + layout.runtime_interpreters_head)
            count = mem.u32(main + layout.interp_code_counter) if main else 0
        except MemoryReadError:
            count = 0
        if 0 < count < 1 << 31:
            return {"code_counter": layout.interp_code_counter, "counter_in_interp": True}
    return {}


def _version(
    mem: ProcessMemory, runtime: int, symbols: dict[str, tuple[int, int]], bias: int, path: str
) -> tuple[int, int, int] | None:
    if "Py_Version" in symbols:  # PY_VERSION_HEX, 3.11+
        return _from_hex(mem.u32(symbols["Py_Version"][0] + bias))
    head = mem.read(runtime, 16)
    if head[:8] == _DEBUG_COOKIE:  # _Py_DebugOffsets, 3.13+
        return _from_hex(struct.unpack_from("<Q", head, 8)[0])
    name = os.path.basename(path)
    m = _LIBPYTHON.match(name) or _PYTHON.match(name)
    return (int(m[1]), int(m[2]), 0) if m else None


# The head of 3.13's _Py_DebugOffsets (Include/internal/pycore_runtime.h), at _PyRuntime: cookie, version,
# free_threaded, then blocks of u64 offsets, each led by its struct's size: runtime state (3), interpreter
# state (13), thread state (9), interpreter frame (6), code object (10).
_DEBUG_313 = struct.Struct("<8sQQ" + "Q" * 41)
_DEBUG_INTERP_SIZE = 3  # sizeof(PyInterpreterState), leading its block
_DEBUG_FIELDS_313 = {  # index among the 41 offsets -> the Layout field it must equal
    2: "runtime_interpreters_head",
    6: "interp_threads_head",
    18: "tstate_next",
    19: "tstate_interp",
    20: "tstate_frame",
    21: "tstate_thread_id",
    26: "frame_previous",
    27: "frame_code",
    28: "frame_instr",
    30: "frame_entry",
    32: "code_filename",
    33: "code_name",
    34: "code_qualname",
    35: "code_linetable",
    36: "code_firstlineno",
    40: "code_adaptive",
}


def _check_debug_offsets(head: bytes, layout: Layout) -> Unsupported | None:
    """3.13's own description of its layout against ours: a build with other offsets (a distribution's
    patch, a free-threaded build) is refused, not walked wrong."""
    cookie, _version, free_threaded, *offsets = _DEBUG_313.unpack(head)
    if cookie != _DEBUG_COOKIE:
        return Unsupported("layout_mismatch", "no _Py_DebugOffsets at _PyRuntime")
    if free_threaded:
        return Unsupported("free_threaded", "a free-threaded build")
    wrong = [
        f"{f}={offsets[i]} (ours {getattr(layout, f)})"
        for i, f in _DEBUG_FIELDS_313.items()
        if offsets[i] != getattr(layout, f)
    ]
    return Unsupported("layout_mismatch", ", ".join(wrong)) if wrong else None


def _from_hex(v: int) -> tuple[int, int, int]:
    return (v >> 24) & 0xFF, (v >> 16) & 0xFF, (v >> 8) & 0xFF


def _key_slots(mem: ProcessMemory, layout: Layout, runtime: int, key: int) -> int | None:
    """glibc's offset of the inline key slots in struct pthread (the `B` of the module's docstring): the
    one at which the most listed threads hold their own state, if no other offset does as well."""
    interp = mem.u64(runtime + layout.runtime_interpreters_head)
    tstate = mem.u64(interp + layout.interp_threads_head) if interp else 0
    votes: dict[int, int] = {}
    seen: set[int] = set()
    for _ in range(MAX_THREADS):
        if not tstate or tstate in seen:
            break
        seen.add(tstate)
        try:
            block = mem.read(tstate, max(layout.tstate_thread_id, layout.tstate_next) + 8)
        except MemoryReadError:
            break  # the list is torn (a thread exiting): those read already voted
        thread = struct.unpack_from("<Q", block, layout.tstate_thread_id)[0]
        nxt = struct.unpack_from("<Q", block, layout.tstate_next)[0]
        # struct pthread may end its mapping (a thread's stack block): as much of the window as maps.
        window = mem.read_prefix(thread, _SLOTS_MAX + 16 * key + 16) if thread else b""
        for base in range(_SLOTS_MIN, _SLOTS_MAX, 8):
            at = base + 16 * key + 8
            if at + 8 <= len(window) and struct.unpack_from("<Q", window, at)[0] == tstate:
                votes[base] = votes.get(base, 0) + 1
        tstate = nxt
    if not votes:
        return None
    best = max(votes.values())
    winners = [b for b, n in votes.items() if n == best]
    return winners[0] if len(winners) == 1 else None


def _eval_offsets(elf: ElfFile, symbols: dict[str, tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The eval loop's parts as [start, end) file offsets: what a native frame is (procmaps)."""
    out = []
    for name in _EVAL:
        start, size = symbols.get(name, (0, 0))
        for seg in elf.segments:
            if size and seg.vaddr <= start < seg.vaddr + seg.filesz:
                out.append((start - seg.vaddr + seg.offset, start - seg.vaddr + seg.offset + size))
                break
    return tuple(out)


def _address(symbols: dict[str, tuple[int, int]], name: str, bias: int) -> int:
    return symbols[name][0] + bias if name in symbols else 0


# start, end, pgoff, range (the maps line's first field)
_Mapping = tuple[int, int, int, str]


def _file_mappings(maps: bytes) -> dict[str, list[_Mapping]]:
    """The file mappings of a maps file by path, in address order."""
    out: dict[str, list[_Mapping]] = {}
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[4] == b"0" or not parts[5].startswith(b"/"):
            continue
        path = parts[5].decode(errors="replace").removesuffix(" (deleted)")
        lo, _, hi = parts[0].partition(b"-")
        try:
            mapping = (int(lo, 16), int(hi, 16), int(parts[2], 16), parts[0].decode())
        except ValueError:
            continue
        out.setdefault(path, []).append(mapping)
    return out


def _interpreter_file(files: dict[str, list[_Mapping]], exe: str) -> tuple[str, list[_Mapping]] | None:
    for path, mappings in files.items():
        if _LIBPYTHON.match(os.path.basename(path)):
            return path, mappings
    if exe in files:
        return exe, files[exe]
    return None


def _bias(elf: ElfFile, mappings: list[_Mapping]) -> int | None:
    """Process address minus file virtual address, from the mapping of a PT_LOAD segment."""
    for start, _end, pgoff, _range in mappings:
        for seg in elf.segments:
            if seg.offset & ~0xFFF == pgoff:
                return start - (seg.vaddr & ~0xFFF)
    return None


def _read_bounded(path: str, limit: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(limit)
