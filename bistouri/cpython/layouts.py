"""Where CPython keeps what a profiler reads, per minor version (x86-64, GIL builds).

One `Layout` per supported minor version. The offsets were checked with `offsetof` against each
version's internal headers and live on pyenv's 3.8.18 ... 3.13.0 and Debian's 3.11.2 (notes
cpython-frames.md §4); tests/integration/test_cpython.py checks them again on every interpreter of the
host. Also here: the code-object checksum, the one formula BPF (bpf/python.bpf.h) and user space share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..bpf import abi
from ..compat import SLOTS

# How a frame's instruction field reads and how a C activation's frames end: the BPF record's words.
InstrKind = abi.PyInstrKind
EntryKind = abi.PyEntryKind

SHIM_OWNER = 3  # FRAME_OWNED_BY_CSTACK (3.12, 3.13)
STR_HASH = 24  # PyASCIIObject.hash, the str's cached hash (Py_hash_t), 3.8-3.13


@dataclass(frozen=True, **SLOTS)
class Layout:
    """The offsets of one minor version (bytes from the start of each struct)."""

    version: tuple[int, int]
    # _PyRuntimeState
    runtime_interpreters_head: int
    runtime_tss_key: int  # the Py_tss_t autoTSSkey; the pthread key is the int at +4
    # PyInterpreterState
    interp_threads_head: int
    # func_state.next_version, the count of code objects made where it is the interpreter's (3.13), -1
    # elsewhere (3.12's is the global _Py_next_func_version, found by its symbol; none before)
    interp_code_counter: int
    # sizeof(PyInterpreterState) of the build interp_code_counter was read from (DWARF of 3.13.0):
    # _Py_DebugOffsets does not list the field, so a build of another size does not use it
    interp_size: int
    # PyThreadState
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int  # pthread_self() of the thread (== its fsbase on x86-64 glibc)
    tstate_frame: int  # the innermost frame, or the _PyCFrame pointer when `cframe_frame` >= 0
    # datastack_chunk, then datastack_top: where the frames live (3.11+), -1 before
    tstate_datastack: int
    cframe_frame: int  # _PyCFrame.current_frame (3.11, 3.12), -1 when tstate_frame is the frame itself
    # the frame (PyFrameObject ≤3.10, _PyInterpreterFrame 3.11+)
    frame_previous: int
    frame_code: int
    frame_instr: int
    instr_kind: InstrKind
    frame_entry: int  # is_entry (3.11) or owner (3.12+); -1 when every frame is an entry
    entry_kind: EntryKind
    # PyCodeObject
    code_argcount: int
    code_flags: int
    code_firstlineno: int
    code_version: int  # co_version (3.12+), -1 before: a number no other code object of the process has
    code_filename: int
    code_name: int
    code_qualname: int  # -1 before 3.11
    code_linetable: int  # co_lnotab (3.8, 3.9), co_linetable (3.10+)
    code_code: int  # co_code, a bytes object (≤3.10), -1 after
    code_adaptive: int  # co_code_adaptive, the inline bytecode (3.11+), -1 before
    # compact str: characters of an ASCII one, of another one
    str_ascii_data: int
    str_data: int

    @property
    def code_read_size(self) -> int:
        """Bytes of a code object that hold every field read here."""
        return max(self.code_linetable, self.code_qualname, self.code_code) + 8

    @property
    def checksum_fields(self) -> tuple[int, ...]:
        """Offsets of the fields the checksum mixes: filename, name, line table (pointers), first line,
        and co_version where there is one."""
        fields = (self.code_filename, self.code_name, self.code_linetable, self.code_firstlineno)
        return (*fields, self.code_version) if self.code_version >= 0 else fields


# Each version is the one before with what changed (dataclasses.replace): the differences are the table.
_38 = Layout(
    version=(3, 8),
    runtime_interpreters_head=32,
    runtime_tss_key=1392,
    interp_threads_head=8,
    interp_code_counter=-1,
    interp_size=-1,
    tstate_next=8,
    tstate_interp=16,
    tstate_thread_id=176,
    tstate_frame=24,
    tstate_datastack=-1,
    cframe_frame=-1,
    frame_previous=24,
    frame_code=32,
    frame_instr=104,
    instr_kind=InstrKind.LASTI_BYTES,
    frame_entry=-1,
    entry_kind=EntryKind.EVERY,
    code_argcount=16,
    code_flags=36,
    code_firstlineno=40,
    code_version=-1,
    code_filename=104,
    code_name=112,
    code_qualname=-1,
    code_linetable=120,
    code_code=48,
    code_adaptive=-1,
    str_ascii_data=48,
    str_data=72,
)
_39 = replace(_38, version=(3, 9), runtime_tss_key=584)
_310 = replace(_39, version=(3, 10), frame_instr=96, instr_kind=InstrKind.LASTI_UNITS)
_311 = replace(
    _310,
    version=(3, 11),
    runtime_interpreters_head=40,
    runtime_tss_key=592,
    interp_threads_head=16,
    tstate_thread_id=152,
    tstate_frame=56,
    tstate_datastack=296,
    cframe_frame=8,
    frame_previous=48,
    frame_code=32,
    frame_instr=56,
    instr_kind=InstrKind.POINTER,
    frame_entry=68,
    entry_kind=EntryKind.IS_ENTRY,
    code_argcount=56,
    code_flags=48,
    code_firstlineno=72,
    code_filename=112,
    code_name=120,
    code_qualname=128,
    code_linetable=136,
    code_code=-1,
    code_adaptive=184,
)
_312 = replace(
    _311,
    version=(3, 12),
    runtime_tss_key=1544,
    interp_threads_head=72,
    tstate_thread_id=136,
    tstate_datastack=232,
    cframe_frame=0,
    frame_previous=8,
    frame_code=0,
    frame_entry=70,
    entry_kind=EntryKind.SHIM,
    code_argcount=52,
    code_firstlineno=68,
    code_version=92,
    code_adaptive=192,
    str_ascii_data=40,
    str_data=56,
)
_313 = replace(
    _312,
    version=(3, 13),
    runtime_interpreters_head=632,
    runtime_tss_key=2160,
    interp_threads_head=7344,
    interp_code_counter=17000,
    interp_size=194968,
    tstate_thread_id=152,
    tstate_frame=72,
    cframe_frame=-1,
    code_adaptive=200,
)
LAYOUTS: dict[tuple[int, int], Layout] = {lay.version: lay for lay in (_38, _39, _310, _311, _312, _313)}

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads the pointers' bits over the high word
_U64 = (1 << 64) - 1


def checksum(filename: int, name: int, linetable: int, firstlineno: int, ident: int) -> int:
    """The 32-bit identity of a code object (bpf/python.bpf.h computes the same at the sample).

    Its fields never change while the code object lives: the addresses of its filename, name and line
    table objects, its first line, and `ident`: its co_version (3.12+), or its name's cached hash where
    there is none (before 3.12, or once the version counter ran out: 0). Addresses alone do not tell two
    code objects apart: code made and dropped in a loop (exec, templates) frees a code object with its
    name, file name and line table, and the allocator gives the next one the same addresses for all
    four. co_version is a counter CPython gives each new code object, read with the fields (no read
    more); a different name differs in its hash, the name's object read apart. Not told apart with the
    hash: code of one name and first line, made again at one address from another file name or body.
    Never 0: 0 says BPF could not read the fields."""
    x = filename ^ _rotl(name, 21) ^ _rotl(linetable, 42) ^ (firstlineno & 0xFFFF_FFFF)
    x ^= _rotl(ident, 11)
    c = ((x * _MIX) & _U64) >> 32
    return c or 1


def _rotl(v: int, n: int) -> int:
    v &= _U64
    return ((v << n) | (v >> (64 - n))) & _U64
