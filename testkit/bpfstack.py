"""The combined stack of every call chain of a BPF object, as the verifier adds it up.

The verifier gives a program and all the BPF-to-BPF calls it makes at most 512 bytes of stack
together (MAX_BPF_STACK): each function's depth rounded up to 32, summed along every chain of calls
(check_max_stack_depth). Kernel 6.1 refuses a program past it; 6.18 does not check it the same way,
so a chain past 512 loads here and is refused only on an older kernel. This reads the object
statically, from `llvm-objdump -d -r` and `-t`:

- a function's depth: the deepest `r10 - N` it touches, directly (`*(u64 *)(r10 - 8)`) or through a
  register derived from r10 (`r2 = r10; r2 += -64`, a buffer handed to a helper or a callee);
- its calls: `call` to a local function (src_reg 1: by relocation, or pc-relative in the same
  section), and the functions it hands to a helper as callbacks (`ld_imm64` relocated against a
  function or a code section: bpf_loop's callback runs on top of its caller's frame).

Run `python -m testkit.bpfstack OBJECT...` for each program's worst chain.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_BPF_STACK = 512
STACK_ROUND = 32  # the interpreter's stack granularity, which the verifier rounds each frame to

_SECTION = re.compile(r"^Disassembly of section (\S+):$")
_INSN = re.compile(r"^\s*(\d+):\t((?:[0-9a-f]{2} ){7}[0-9a-f]{2}(?: (?:[0-9a-f]{2} ){7}[0-9a-f]{2})?)\s")
_RELOC = re.compile(r"^\s+[0-9a-f]+:\s+(R_BPF_\w+)\s+(\S+)")
# `llvm-objdump -t`: address, flags, section, size, name.
_SYMBOL = re.compile(r"^([0-9a-f]{16}) (.{7}) (\S+)\t([0-9a-f]{16}) (\S+)$")

# Opcode classes and modes (include/uapi/linux/bpf.h).
LD, LDX, ST, STX, ALU, JMP, JMP32, ALU64 = range(8)
MEM, ATOMIC = 0x60, 0xC0
CALL, LD_IMM64 = 0x85, 0x18
PSEUDO_CALL = 1
FP = 10


@dataclass
class Function:
    name: str
    section: str
    start: int  # byte offset in its section
    size: int
    is_program: bool  # a global function outside .text: an entry point the loader attaches
    depth: int = 0  # the deepest r10 - N touched, in bytes
    calls: set[str] = field(default_factory=set)

    @property
    def frame(self) -> int:
        """Its frame as check_max_stack_depth counts it: at least one slot, rounded up to 32."""
        return -(-max(self.depth, 1) // STACK_ROUND) * STACK_ROUND


def objdump(*args: str) -> str:
    return subprocess.run(["llvm-objdump", *args], check=True, capture_output=True, text=True).stdout


def functions_of(obj: Path) -> dict[str, Function]:
    funcs: dict[str, Function] = {}
    for line in objdump("-t", str(obj)).splitlines():
        m = _SYMBOL.match(line)
        if m and "F" in m.group(2):
            name, section = m.group(5), m.group(3)
            funcs[name] = Function(
                name,
                section,
                int(m.group(1), 16),
                int(m.group(4), 16),
                section != ".text" and "g" in m.group(2),
            )
    return funcs


def analyse(obj: Path) -> dict[str, Function]:
    """Every function of `obj` with its stack depth and the functions it calls."""
    funcs = functions_of(obj)
    by_section: dict[str, list[Function]] = {}
    for f in funcs.values():
        by_section.setdefault(f.section, []).append(f)

    def at(section: str, offset: int) -> Function | None:
        return next((f for f in by_section.get(section, ()) if f.start <= offset < f.start + f.size), None)

    section = ""
    current: Function | None = None
    derived: dict[int, int] = {}  # register -> its offset from r10, while it holds one
    # The last instruction, until the next line tells whether a relocation names its target:
    # (its function, index, opcode, src_reg, imm).
    pending: tuple[Function, int, int, int, int] | None = None

    def settle(reloc: tuple[str, str] | None) -> None:
        """The target of the pending instruction, if it is a local call or a function's address."""
        if pending is None:
            return
        caller, index, op, src, imm = pending
        target = None
        if op == CALL and src == PSEUDO_CALL:
            if reloc is None:  # resolved by the assembler: pc-relative in the same section
                target = at(caller.section, (index + 1 + imm) * 8)
            else:  # a function, or a section with the insn offset (less one) in imm, as libbpf reads it
                target = funcs.get(reloc[1]) or at(reloc[1], (imm + 1) * 8)
        elif op == LD_IMM64 and reloc is not None:
            # A function's address (a callback, bpf_loop's): a function, or a section plus a byte offset.
            target = funcs.get(reloc[1]) or at(reloc[1], imm)
        if target is not None:
            caller.calls.add(target.name)

    for line in objdump("-d", "-r", str(obj)).splitlines():
        if m := _RELOC.match(line):
            settle((m.group(1), m.group(2)))
            pending = None
            continue
        if m := _SECTION.match(line):
            settle(None)
            section, current, derived, pending = m.group(1), None, {}, None
            continue
        m = _INSN.match(line)
        if not m:
            continue
        settle(None)
        pending = None
        index, raw = int(m.group(1)), bytes.fromhex(m.group(2).replace(" ", ""))
        op, regs = raw[0], raw[1]
        dst, src = regs & 0xF, regs >> 4
        off, imm = struct.unpack_from("<hi", raw, 2)
        owner = at(section, index * 8)
        if owner is not current:
            current, derived = owner, {}
        if current is None:
            continue
        pending = (current, index, op, src, imm)
        _track(current, derived, op, dst, src, off, imm)
    settle(None)
    return funcs


def _track(f: Function, derived: dict[int, int], op: int, dst: int, src: int, off: int, imm: int) -> None:
    """One instruction's effect on the registers that hold r10 - N, and on the depth touched."""

    def touch(offset: int) -> None:
        if offset < 0:
            f.depth = max(f.depth, -offset)

    def base(reg: int) -> int | None:
        return 0 if reg == FP else derived.get(reg)

    cls, mode = op & 0x07, op & 0xE0
    if cls == LDX:
        if (b := base(src)) is not None:
            touch(b + off)
        derived.pop(dst, None)
    elif cls in (ST, STX):
        if (b := base(dst)) is not None:
            touch(b + off)
        if mode == ATOMIC:  # a fetch writes the old value into src (cmpxchg into r0)
            derived.pop(src, None)
            derived.pop(0, None)
    elif cls == ALU64 and dst != FP:
        code, by_reg = op & 0xF0, op & 0x08
        b = base(dst)
        if code == 0xB0 and by_reg and off == 0 and base(src) is not None:  # rD = r10 (or a derived one)
            derived[dst] = base(src)  # type: ignore[assignment]
        elif code in (0x00, 0x10) and not by_reg and b is not None:  # rD += imm, rD -= imm
            derived[dst] = b + imm if code == 0x00 else b - imm
            touch(derived[dst])
        else:
            derived.pop(dst, None)
    elif cls in (ALU, LD):
        derived.pop(dst, None)
    elif op == CALL:  # r0-r5 are the callee's
        for r in range(6):
            derived.pop(r, None)


def worst_chain(funcs: dict[str, Function], entry: str) -> tuple[int, list[str]]:
    """The largest combined stack over the call chains from `entry`, and that chain."""

    def walk(name: str, seen: tuple[str, ...]) -> tuple[int, list[str]]:
        f = funcs[name]
        best: tuple[int, list[str]] = (0, [])
        for callee in sorted(f.calls):
            if callee in seen:  # the verifier refuses recursion anyway
                continue
            best = max(best, walk(callee, (*seen, callee)), key=lambda c: c[0])
        return f.frame + best[0], [name, *best[1]]

    return walk(entry, (entry,))


def chains(obj: Path) -> dict[str, tuple[int, list[str]]]:
    """Each program of `obj`: its worst call chain's combined stack and that chain."""
    funcs = analyse(obj)
    return {name: worst_chain(funcs, name) for name, f in sorted(funcs.items()) if f.is_program}


def main(argv: list[str]) -> int:
    worst = 0
    for path in argv:
        print(path)
        funcs = analyse(Path(path))
        for name in sorted(n for n, f in funcs.items() if f.is_program):
            total, chain = worst_chain(funcs, name)
            worst = max(worst, total)
            print(f"  {total:4d}  " + " -> ".join(f"{f} ({funcs[f].frame})" for f in chain))
    return 1 if worst > MAX_BPF_STACK else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
