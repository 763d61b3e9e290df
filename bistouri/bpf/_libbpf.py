"""ctypes signatures of the libbpf functions bistouri uses. No logic lives here.

Every function is declared once in `SIGNATURES` and applied in a loop, so a
typo cannot silently leave a function undeclared (ctypes accepts any attribute
name). Pointer returns get typed opaque pointers: the default `c_int` restype
truncates 64-bit handles and the next call crashes. tests/unit/test_libbpf.py
checks the table against the library.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_char,
    c_char_p,
    c_int,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)

TYPE_CHECKING = False  # not typing itself: ~2 ms of imports before `record`'s first sample
if TYPE_CHECKING:
    from typing import Any


class bpf_object(Structure):
    pass


class bpf_program(Structure):
    pass


class bpf_map(Structure):
    pass


class bpf_link(Structure):
    pass


class ring_buffer(Structure):
    pass


class btf(Structure):
    pass


class btf_type(Structure):
    _fields_ = [("name_off", c_uint32), ("info", c_uint32), ("size_or_type", c_uint32)]


class btf_member(Structure):
    _fields_ = [("name_off", c_uint32), ("type", c_uint32), ("offset", c_uint32)]


class btf_var_secinfo(Structure):
    _fields_ = [("type", c_uint32), ("offset", c_uint32), ("size", c_uint32)]


class bpf_object_open_opts(Structure):
    """libbpf.h's struct bpf_object_open_opts up to btf_custom_path (libbpf >= 0.5): `sz` says
    how much of it is given, so the fields after it keep their defaults."""

    _fields_ = [
        ("sz", c_size_t),
        ("object_name", c_char_p),
        ("relaxed_maps", c_bool),
        ("pin_root_path", c_char_p),
        ("_removed_attach_prog_fd", c_uint32),
        ("kconfig", c_char_p),
        ("btf_custom_path", c_char_p),
    ]


class bpf_map_create_opts(Structure):
    """bpf.h's struct bpf_map_create_opts up to map_extra (libbpf >= 0.7): `sz` says how much of it
    is given, the rest stays 0 (no BTF, no inner map, any NUMA node)."""

    _fields_ = [
        ("sz", c_size_t),
        ("btf_fd", c_uint32),
        ("btf_key_type_id", c_uint32),
        ("btf_value_type_id", c_uint32),
        ("btf_vmlinux_value_type_id", c_uint32),
        ("inner_map_fd", c_uint32),
        ("map_flags", c_uint32),
        ("map_extra", c_uint64),
    ]


obj_p = POINTER(bpf_object)
prog_p = POINTER(bpf_program)
map_p = POINTER(bpf_map)
link_p = POINTER(bpf_link)
rb_p = POINTER(ring_buffer)
btf_p = POINTER(btf)

# int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size)
RING_BUFFER_SAMPLE_FN = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t)
# int (*libbpf_print_fn_t)(enum libbpf_print_level level, const char *fmt, va_list ap)
# va_list is passed through as an opaque pointer to vsnprintf.
PRINT_FN = CFUNCTYPE(c_int, c_int, c_char_p, c_void_p)

# (name, restype, argtypes). Pointer returns: NULL + errno. Int returns: -errno.
SIGNATURES: list[tuple[str, Any, list[Any]]] = [
    ("libbpf_major_version", c_uint32, []),
    ("libbpf_minor_version", c_uint32, []),
    ("libbpf_version_string", c_char_p, []),
    ("libbpf_strerror", c_int, [c_int, POINTER(c_char), c_size_t]),
    ("libbpf_set_print", c_void_p, [PRINT_FN]),
    ("libbpf_num_possible_cpus", c_int, []),
    ("bpf_object__open_file", obj_p, [c_char_p, POINTER(bpf_object_open_opts)]),
    ("bpf_object__load", c_int, [obj_p]),
    ("bpf_object__close", None, [obj_p]),
    ("bpf_object__btf", btf_p, [obj_p]),
    ("bpf_object__find_map_by_name", map_p, [obj_p, c_char_p]),
    ("bpf_object__find_program_by_name", prog_p, [obj_p, c_char_p]),
    ("bpf_object__next_map", map_p, [obj_p, map_p]),
    ("bpf_object__next_program", prog_p, [obj_p, prog_p]),
    ("bpf_program__name", c_char_p, [prog_p]),
    ("bpf_program__set_autoload", c_int, [prog_p, c_bool]),
    ("bpf_program__set_log_buf", c_int, [prog_p, c_char_p, c_size_t]),
    ("bpf_program__fd", c_int, [prog_p]),
    ("bpf_program__attach", link_p, [prog_p]),
    ("bpf_program__attach_perf_event", link_p, [prog_p, c_int]),
    ("bpf_link__destroy", c_int, [link_p]),
    ("bpf_map__name", c_char_p, [map_p]),
    ("bpf_map__fd", c_int, [map_p]),
    ("bpf_map__key_size", c_uint32, [map_p]),
    ("bpf_map__value_size", c_uint32, [map_p]),
    ("bpf_map__set_max_entries", c_int, [map_p, c_uint32]),
    ("bpf_map__reuse_fd", c_int, [map_p, c_int]),
    ("bpf_map__set_autocreate", c_int, [map_p, c_bool]),
    ("bpf_map__initial_value", c_void_p, [map_p, POINTER(c_size_t)]),
    ("bpf_map__update_elem", c_int, [map_p, c_void_p, c_size_t, c_void_p, c_size_t, c_uint64]),
    ("bpf_map__lookup_elem", c_int, [map_p, c_void_p, c_size_t, c_void_p, c_size_t, c_uint64]),
    ("bpf_map__delete_elem", c_int, [map_p, c_void_p, c_size_t, c_uint64]),
    ("bpf_map__get_next_key", c_int, [map_p, c_void_p, c_void_p, c_size_t]),
    ("bpf_map__max_entries", c_uint32, [map_p]),
    ("bpf_map__map_flags", c_uint32, [map_p]),
    ("bpf_map__type", c_int, [map_p]),
    # (type, name, key size, value size, max entries, opts): a map on its own, outside any object.
    (
        "bpf_map_create",
        c_int,
        [c_int, c_char_p, c_uint32, c_uint32, c_uint32, POINTER(bpf_map_create_opts)],
    ),
    # (fd, in_batch, out_batch, keys, values, count in/out, opts): every entry in a few syscalls.
    (
        "bpf_map_lookup_and_delete_batch",
        c_int,
        [c_int, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), c_void_p],
    ),
    # (fd, keys, values, count in/out, opts): many entries in one syscall (unwind rows).
    ("bpf_map_update_batch", c_int, [c_int, c_void_p, c_void_p, POINTER(c_uint32), c_void_p]),
    ("ring_buffer__new", rb_p, [c_int, RING_BUFFER_SAMPLE_FN, c_void_p, c_void_p]),
    ("ring_buffer__add", c_int, [rb_p, c_int, RING_BUFFER_SAMPLE_FN, c_void_p]),
    ("ring_buffer__consume", c_int, [rb_p]),
    ("ring_buffer__poll", c_int, [rb_p, c_int]),
    ("ring_buffer__epoll_fd", c_int, [rb_p]),
    ("ring_buffer__free", None, [rb_p]),
    ("btf__parse", btf_p, [c_char_p, c_void_p]),
    ("btf__free", None, [btf_p]),
    ("btf__find_by_name_kind", c_int, [btf_p, c_char_p, c_uint32]),
    ("btf__type_by_id", POINTER(btf_type), [btf_p, c_uint32]),
    ("btf__name_by_offset", c_char_p, [btf_p, c_uint32]),
    ("btf__resolve_size", ctypes.c_int64, [btf_p, c_uint32]),
]

# Present only in some libbpf versions: probed, never assumed. Debian's 1.1.2
# declares libbpf_set_memlock_rlim in its header but does not export it.
OPTIONAL_SIGNATURES: list[tuple[str, Any, list[Any]]] = [
    ("libbpf_set_memlock_rlim", c_int, [c_size_t]),
    ("bpf_enable_stats", c_int, [c_int]),
]

MIN_VERSION = (1, 0)
# The .deb's own copy of Debian 12's libbpf 1.1.2 (packaging/build-packages.sh), for the
# systems without a libbpf >= 1.0 (Debian 11 has 0.3): tried after the system's libbpf.so.1.
PRIVATE_LIBRARY = "/usr/lib/bistouri/libbpf/libbpf.so.1"
LIBRARY_NAMES = ("libbpf.so.1", PRIVATE_LIBRARY)


def _apply(lib: ctypes.CDLL, table: list[tuple[str, Any, list[Any]]], optional: bool) -> set[str]:
    present = set()
    for name, restype, argtypes in table:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if optional:
                continue
            raise
        fn.restype = restype
        fn.argtypes = argtypes
        present.add(name)
    return present


class Library:
    """The loaded libbpf with every signature applied."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        _apply(lib, SIGNATURES, optional=False)
        self.optional = _apply(lib, OPTIONAL_SIGNATURES, optional=True)
        self.version = (lib.libbpf_major_version(), lib.libbpf_minor_version())
        self.private = path == PRIVATE_LIBRARY

    def has(self, name: str) -> bool:
        return name in self.optional

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)


def open_library(names: tuple[str, ...] = LIBRARY_NAMES) -> Library:
    """Load libbpf with errno capture (libbpf >= 1.0 reports through errno)."""
    last: OSError | None = None
    for name in names:
        try:
            return Library(ctypes.CDLL(name, use_errno=True), name)
        except OSError as e:
            last = e
    from ctypes.util import find_library  # the fallback only: it imports subprocess, shutil (~5 ms)

    found = find_library("bpf")
    if found:
        return Library(ctypes.CDLL(found, use_errno=True), found)
    raise OSError(f"cannot load libbpf ({', '.join(names)}): {last}")
