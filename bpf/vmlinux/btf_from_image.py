#!/usr/bin/env python3
"""The raw BTF of a kernel image, for `bpftool btf dump file RAW format c` (a vmlinux.h).

A kernel built with CONFIG_DEBUG_INFO_BTF carries its BTF (.BTF) inside the image: a
header (magic 0xeB9F, version 1, header length 24, then the offsets and lengths of the
types and the strings) followed by both. This finds that header and cuts the blob at the
lengths it declares. bpf/vmlinux/arm64/vmlinux.h was made so from Debian 12's arm64
kernel (its Image is not compressed):

    apt-get download linux-image-6.1.0-50-arm64   # an arm64 apt configuration (docs/deployment.md)
    dpkg-deb -x linux-image-6.1.0-50-arm64_*_arm64.deb x
    python3 bpf/vmlinux/btf_from_image.py x/boot/vmlinuz-6.1.0-50-arm64 > arm64.btf
    bpftool btf dump file arm64.btf format c > bpf/vmlinux/arm64/vmlinux.h
"""

import struct
import sys

_HEADER = struct.Struct("<HBBIIIII")  # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_START = b"\x9f\xeb\x01\x00\x18\x00\x00\x00\x00\x00\x00\x00"  # magic, version 1, flags 0, hdr_len 24, type_off 0


def raw_btf(image: bytes) -> bytes:
    """The largest BTF blob whose strings follow its types (the kernel's own; modules' are split)."""
    best = b""
    at = image.find(_START)
    while at >= 0:
        _, _, _, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(image, at)
        size = hdr_len + str_off + str_len
        if str_off == type_off + type_len and at + size <= len(image) and size > len(best):
            best = image[at : at + size]
        at = image.find(_START, at + 1)
    if not best:
        raise SystemExit("no BTF in this image (a compressed one must be uncompressed first)")
    return best


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        sys.stdout.buffer.write(raw_btf(f.read()))
