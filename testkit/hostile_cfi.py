"""Hostile call frame information: `.eh_frame` sections, and an ELF file to map them from."""

from __future__ import annotations

import struct

EH_FRAME_ADDR = 0x1000


def cie() -> bytes:
    """CIE "zR" (FDE pointers pcrel|sdata4), code align 1, data align -8, RA r16: CFA rsp+8."""
    body = b"\0\0\0\0" + b"\x01" + b"zR\0" + b"\x01" + b"\x78" + b"\x10" + b"\x01" + b"\x1b"
    body += bytes([0x0C, 7, 8, 0x90, 1])
    body += b"\0" * (-(len(body) + 4) % 8)
    return len(body).to_bytes(4, "little") + body


def fde(cie_at: int, at: int, pc: int, size: int, program: bytes, address: int = 0) -> bytes:
    """An FDE at section offset `at` for [pc, pc + size), the section loaded at `address`."""
    body = (at + 4 - cie_at).to_bytes(4, "little")
    body += (pc - (address + at + 8)).to_bytes(4, "little", signed=True) + size.to_bytes(4, "little") + b"\0"
    body += program
    body += b"\0" * (-(len(body) + 4) % 8)
    return len(body).to_bytes(4, "little") + body


def row_bomb(total_bytes: int, rows_per_fde: int = 30000, address: int = 0) -> bytes:
    """FDEs whose programs make a new row every 3 bytes (advance 1, CFA offset 16 or 24):
    about `total_bytes` / 3 rows, each FDE's program short enough to pass for an honest one."""
    out = bytearray(cie())
    program = bytes([0x41, 0x0E, 16, 0x41, 0x0E, 24]) * (rows_per_fde // 2)
    pc = 0x10000
    while len(out) < total_bytes:
        out += fde(0, len(out), pc, rows_per_fde + 1, program, address)
        pc += 0x10000
    return bytes(out + b"\0\0\0\0")


def elf_with_eh_frame(eh_frame: bytes, build_id: bytes = b"\xcf" * 20) -> bytes:
    """A minimal x86-64 ELF shared object: one R+X PT_LOAD of the whole file, a GNU build id
    note and `eh_frame` loaded at EH_FRAME_ADDR (its file offset too)."""
    names = b"\0.note.gnu.build-id\0.eh_frame\0.shstrtab\0"
    note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
    note_at = 64 + 56
    eh_at = EH_FRAME_ADDR
    names_at = eh_at + len(eh_frame)
    sh_at = (names_at + len(names) + 7) & ~7
    size = sh_at + 4 * 64
    ehdr = b"\x7fELF\x02\x01\x01" + b"\0" * 9
    ehdr += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, sh_at, 0, 64, 56, 1, 64, 4, 3)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, size, size, 0x1000)
    shdrs = b"\0" * 64
    shdrs += struct.pack("<IIQQQQIIQQ", 1, 7, 2, note_at, note_at, len(note), 0, 0, 4, 0)
    shdrs += struct.pack("<IIQQQQIIQQ", 20, 1, 2, eh_at, eh_at, len(eh_frame), 0, 0, 8, 0)
    shdrs += struct.pack("<IIQQQQIIQQ", 30, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    out = bytearray(size)
    out[0:64] = ehdr
    out[64:note_at] = phdr
    out[note_at : note_at + len(note)] = note
    out[eh_at:names_at] = eh_frame
    out[names_at : names_at + len(names)] = names
    out[sh_at:] = shdrs
    return bytes(out)
