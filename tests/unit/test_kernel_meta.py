from __future__ import annotations

import struct

from bistouri.host import kernel


def _note(name: bytes, ntype: int, desc: bytes) -> bytes:
    n = name + b"\0"
    pad = lambda b: b + b"\0" * (-len(b) % 4)  # noqa: E731
    return struct.pack("<III", len(n), len(desc), ntype) + pad(n) + pad(desc)


def test_gnu_build_id_is_found_among_other_notes():
    bid = bytes(range(20))
    blob = _note(b"Xen", 6, b"\x01\x02\x03\x04") + _note(b"Linux", 0x100, b"6.1") + _note(b"GNU", 3, bid)
    assert kernel.build_id_from_notes(blob) == bid


def test_no_gnu_note_means_no_build_id():
    assert kernel.build_id_from_notes(_note(b"Xen", 3, b"abcd")) is None


def test_text_address_and_hidden_addresses():
    assert (
        kernel.parse_text_address(b"ffffffff81000000 T _text\nffffffff81000000 T _stext\n")
        == 0xFFFFFFFF81000000
    )
    assert kernel.parse_text_address(b"0000000000000000 T _text\n") == 0
    assert kernel.parse_text_address(b"ffffffff81000000 T other\n") is None


def test_live_kernel_meta_is_never_fatal(tmp_path):
    meta = kernel.read_kernel_meta(sys_root=str(tmp_path), proc_root=str(tmp_path))
    assert meta.build_id == b"" and meta.text_addr == 0 and meta.release
