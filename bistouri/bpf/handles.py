"""Owned handles over libbpf: the BPF object, its maps and programs, links, ring buffers.

Every handle has an idempotent `close()` and is a context manager; children keep
their parent and refuse to work once it is closed. `__del__` is only a safety
net and warns when it has to free something.
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..compat import SLOTS
from ..errors import BpfError
from . import _libbpf

# Not `from typing import ...` nor pathlib: ~4 ms of imports before `record`'s first sample,
# and type checkers read a module-level TYPE_CHECKING as theirs.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

log = logging.getLogger(__name__)
libbpf_log = logging.getLogger("bistouri.libbpf")

_lib: _libbpf.Library | None = None
_lib_lock = threading.Lock()
# Kept alive for the life of the process: libbpf may call it at any time.
_print_cb: Any = None
_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.restype = ctypes.c_int
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]

# libbpf_print_level -> logging level
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}

VERIFIER_LOG_BYTES = 1 << 20  # per program, written only when its load fails

BTF_KIND_STRUCT = 4
BTF_KIND_ENUM = 6
BTF_KIND_TYPEDEF = 8
BTF_KIND_DATASEC = 15


def _on_libbpf_print(level: int, fmt: bytes, va: int) -> int:
    try:
        # A load prints ~700 debug lines: not formatted unless someone reads them.
        if not libbpf_log.isEnabledFor(_LEVELS.get(level, logging.DEBUG)):
            return 0
        buf = ctypes.create_string_buffer(4096)
        _libc.vsnprintf(buf, len(buf), fmt, va)
        text = buf.value.decode(errors="replace").rstrip()
        if text:
            libbpf_log.log(_LEVELS.get(level, logging.DEBUG), "%s", text)
    except BaseException:  # never let an exception cross into C
        pass
    return 0


def library() -> _libbpf.Library:
    """libbpf, loaded once, version-checked, with its log routed to `bistouri.libbpf`."""
    global _lib, _print_cb
    with _lib_lock:
        if _lib is None:
            lib = _libbpf.open_library()
            if lib.version < _libbpf.MIN_VERSION:
                raise BpfError(
                    "loading libbpf",
                    errno.ENOTSUP,
                    hint=(
                        f"{lib.path} is libbpf {lib.version[0]}.{lib.version[1]}; bistouri needs >= 1.0 "
                        "(error conventions changed in 1.0). Install libbpf1 (Debian 12+, RHEL 9+)"
                    ),
                )
            _print_cb = _libbpf.PRINT_FN(_on_libbpf_print)
            lib.libbpf_set_print(_print_cb)
            _lib = lib
        return _lib


class LibbpfSilenced:
    """Within it libbpf prints nothing, unless `bistouri.libbpf` logs at debug level.

    libbpf calls its print function ~700 times a load, and each call into Python waits for
    the GIL: a load on one thread while another imports modules was a third slower. The
    print function is libbpf's, process-wide: only for a load no other thread overlaps.
    """

    def __enter__(self) -> LibbpfSilenced:
        self.silenced = not libbpf_log.isEnabledFor(logging.DEBUG)
        if self.silenced:
            library().libbpf_set_print(_libbpf.PRINT_FN())  # NULL: libbpf skips printing
        return self

    def __exit__(self, *exc: object) -> None:
        if self.silenced:
            library().libbpf_set_print(_print_cb)


def check_int(ret: int, op: str, log_text: str = "") -> int:
    """libbpf >= 1.0 int APIs return -errno on failure."""
    if ret < 0:
        raise BpfError(op, -ret, log=log_text)
    return ret


def check_ptr(ptr: Any, op: str, log_text: str = "", hint: str = "") -> Any:
    """libbpf >= 1.0 pointer APIs return NULL and set errno on failure."""
    if not ptr:
        err = ctypes.get_errno() or errno.EINVAL
        raise BpfError(op, err, log=log_text, hint=hint)
    return ptr


class _Handle:
    _closed = True  # a failed __init__ leaves a handle that __del__ may see

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._closed:
            warnings.warn(
                f"{type(self).__name__} was not closed; freeing it now", ResourceWarning, stacklevel=1
            )
            try:
                self.close()
            except Exception:
                pass


_BPF_F_MMAPABLE = 1 << 10
_ARRAY_WINDOW = 1 << 20  # bytes of an mmapable array mapped at once (Map.update_array)


class Map:
    """A map of a loaded object. Keys and values are bytes-like of the exact sizes."""

    def __init__(self, obj: BpfObject, ptr: Any) -> None:
        self._obj = obj
        self._ptr = ptr
        lib = library()
        self.name = lib.bpf_map__name(ptr).decode()
        self.key_size = lib.bpf_map__key_size(ptr)
        self.value_size = lib.bpf_map__value_size(ptr)
        self._batch_buffers: tuple[ctypes.Array[ctypes.c_char], ctypes.Array[ctypes.c_char]] | None = None

    def _check(self) -> Any:
        self._obj._check_open()
        return self._ptr

    @property
    def fd(self) -> int:
        return check_int(library().bpf_map__fd(self._check()), f"fd of map {self.name}")

    def reuse(self, other: Map) -> None:
        """Use `other`'s kernel map (of another object opened from the same file): before load,
        instead of creating one, so that programs of both objects share it; after, for a map
        the load left to `other`'s object (set_autocreate)."""
        check_int(
            library().bpf_map__reuse_fd(self._check(), other.fd), f"sharing map {self.name} with its twin"
        )

    def create(self) -> None:
        """After load, for a map the load did not create (set_autocreate): create it as the object
        declares it (type, sizes, flags; without BTF, which only maps holding locks or timers need)
        and use it from now on, as reuse() does."""
        lib = library()
        ptr = self._check()
        opts = _libbpf.bpf_map_create_opts(
            sz=ctypes.sizeof(_libbpf.bpf_map_create_opts), map_flags=lib.bpf_map__map_flags(ptr)
        )
        fd = check_int(
            lib.bpf_map_create(
                lib.bpf_map__type(ptr),
                self.name.encode(),
                self.key_size,
                self.value_size,
                lib.bpf_map__max_entries(ptr),
                ctypes.byref(opts),
            ),
            f"creating map {self.name}",
        )
        try:
            check_int(lib.bpf_map__reuse_fd(ptr, fd), f"adopting map {self.name}")
        finally:
            os.close(fd)  # the object holds its own duplicate

    def set_autocreate(self, create: bool) -> None:
        """Before load: whether the load creates this map (no program of the object may use it)."""
        check_int(library().bpf_map__set_autocreate(self._check(), create), f"autocreate of map {self.name}")

    def set_max_entries(self, n: int) -> None:
        """Resize before load (for a ring buffer: its size in bytes, a power of 2)."""
        check_int(library().bpf_map__set_max_entries(self._check(), n), f"resizing map {self.name}")

    def update(self, key: bytes, value: bytes, flags: int = 0) -> None:
        ptr = self._check()
        kb = ctypes.create_string_buffer(bytes(key), len(key))
        vb = ctypes.create_string_buffer(bytes(value), len(value))
        check_int(
            library().bpf_map__update_elem(ptr, kb, len(key), vb, len(value), flags),
            f"update of map {self.name}",
        )

    @property
    def max_entries(self) -> int:
        return int(library().bpf_map__max_entries(self._check()))

    def update_array(self, first: int, values: bytes, value_size: int) -> None:
        """Write consecutive entries of an ARRAY map from index `first`: copied into a mapping of
        the map if it is mmapable (BPF_F_MMAPABLE), else in one batch syscall."""
        if value_size != self.value_size or len(values) % value_size:
            raise ValueError(f"map {self.name}: {value_size}-byte values, the map holds {self.value_size}")
        n = len(values) // value_size
        if not n:
            return
        if library().bpf_map__map_flags(self._check()) & _BPF_F_MMAPABLE:
            self._copy_array(first, values, value_size)
            return
        # From an array, not n arguments: 580 000 keys (a large binary's rows) took 42 ms, now 6.
        keys = (ctypes.c_uint32 * n).from_buffer(array.array("I", range(first, first + n)))
        count = ctypes.c_uint32(n)
        vb = ctypes.create_string_buffer(values, len(values))
        check_int(
            library().bpf_map_update_batch(self.fd, keys, vb, ctypes.byref(count), None),
            f"batch update of map {self.name}",
        )

    def _copy_array(self, first: int, values: bytes, value_size: int) -> None:
        """update_array through a mapping: the kernel lays entries out 8-byte aligned, so each
        value is padded to that stride; mapped and padded a window at a time (the mapped pages
        count in the process's RSS while mapped; a whole padded copy was 6 MB for node's rows)."""
        stride = (value_size + 7) & ~7
        n = len(values) // value_size
        if first + n > self.max_entries:
            raise ValueError(f"map {self.name}: entries {first}..{first + n} past its end")
        per_window = _ARRAY_WINDOW // stride
        for i in range(0, n, per_window):
            chunk = values[i * value_size : min(n, i + per_window) * value_size]  # a window's copy
            if stride == value_size:
                laid: bytes | bytearray = chunk
            else:  # byte column by column: a few C loops, not one Python step per entry
                padded = bytearray(len(chunk) // value_size * stride)
                for col in range(value_size):
                    padded[col::stride] = chunk[col::value_size]
                laid = padded
            at = (first + i) * stride  # in the map's data, which the mapping's offset 0 is
            base = at - at % mmap.PAGESIZE
            with mmap.mmap(self.fd, at - base + len(laid), offset=base) as window:
                window[at - base : at - base + len(laid)] = laid

    def lookup(self, key: bytes, value_size: int | None = None) -> bytes | None:
        ptr = self._check()
        size = value_size or self.value_size
        kb = ctypes.create_string_buffer(bytes(key), len(key))
        vb = ctypes.create_string_buffer(size)
        ret = library().bpf_map__lookup_elem(ptr, kb, len(key), vb, size, 0)
        if ret == -errno.ENOENT:
            return None
        check_int(ret, f"lookup in map {self.name}")
        return vb.raw

    def delete(self, key: bytes) -> bool:
        ptr = self._check()
        kb = ctypes.create_string_buffer(bytes(key), len(key))
        ret = library().bpf_map__delete_elem(ptr, kb, len(key), 0)
        if ret == -errno.ENOENT:
            return False
        check_int(ret, f"delete from map {self.name}")
        return True

    def keys(self) -> Iterator[bytes]:
        ptr = self._check()
        prev = None
        nxt = ctypes.create_string_buffer(self.key_size)
        while True:
            ret = library().bpf_map__get_next_key(ptr, prev, nxt, self.key_size)
            if ret == -errno.ENOENT:
                return
            check_int(ret, f"iteration of map {self.name}")
            key = nxt.raw
            yield key
            prev = ctypes.create_string_buffer(key, len(key))

    def take_all(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value) of a hash map, deleted as read (atomically per bucket: an update
        racing with the read lands either in this result or in the map, never nowhere)."""
        ptr = self._check()
        fd = self.fd
        n = library().bpf_map__max_entries(ptr)
        if self._batch_buffers is None:  # allocated once: this runs at every drain
            self._batch_buffers = (
                ctypes.create_string_buffer(n * self.key_size),
                ctypes.create_string_buffer(n * self.value_size),
            )
        keys, values = self._batch_buffers
        token_in = ctypes.create_string_buffer(8)  # a hash map's batch token is a u32 bucket
        token_out = ctypes.create_string_buffer(8)
        out: list[tuple[bytes, bytes]] = []
        first = True
        while True:
            count = ctypes.c_uint32(n)
            ret = library().bpf_map_lookup_and_delete_batch(
                fd, None if first else token_in, token_out, keys, values, ctypes.byref(count), None
            )
            if ret < 0 and ret != -errno.ENOENT:
                check_int(ret, f"batch read of map {self.name}")
            ks, vs = self.key_size, self.value_size
            kraw = ctypes.string_at(keys, count.value * ks)  # not .raw: the buffers are large
            vraw = ctypes.string_at(values, count.value * vs)
            out.extend((kraw[i * ks : (i + 1) * ks], vraw[i * vs : (i + 1) * vs]) for i in range(count.value))
            if ret == -errno.ENOENT:  # the last batch (possibly empty)
                return out
            ctypes.memmove(token_in, token_out, 8)
            first = False

    def lookup_percpu_u64(self, key: bytes) -> list[int]:
        """Per-CPU values of a PERCPU map of u64: one value per possible CPU."""
        ncpu = check_int(library().libbpf_num_possible_cpus(), "libbpf_num_possible_cpus")
        raw = self.lookup(key, value_size=8 * ncpu)
        if raw is None:
            return [0] * ncpu
        return [int.from_bytes(raw[i * 8 : i * 8 + 8], "little") for i in range(ncpu)]


@dataclass(frozen=True, **SLOTS)
class BtfMember:
    """A struct member as the BTF describes it: name, offset and size in bytes."""

    name: str
    offset: int  # bytes
    size: int


class Btf:
    """Read-only view of a BTF blob (the object's), used for the ABI checks and .rodata offsets."""

    def __init__(self, ptr: Any, owner: Any) -> None:
        self._ptr = ptr
        self._owner = owner  # keeps the object (and so the BTF memory) alive

    def _type(self, type_id: int) -> Any:
        return library().btf__type_by_id(self._ptr, type_id).contents

    def _name(self, off: int) -> str:
        return (library().btf__name_by_offset(self._ptr, off) or b"").decode()

    def struct(self, name: str) -> tuple[int, list[BtfMember]] | None:
        """Size and members (name, byte offset, byte size) of a struct, None if absent."""
        lib = library()
        tid = lib.btf__find_by_name_kind(self._ptr, name.encode(), BTF_KIND_STRUCT)
        if tid < 0:
            return None
        t = self._type(tid)
        vlen = t.info & 0xFFFF
        kind_flag = t.info >> 31
        base = ctypes.addressof(t) + ctypes.sizeof(_libbpf.btf_type)
        members = []
        for i in range(vlen):
            m = _libbpf.btf_member.from_address(base + i * ctypes.sizeof(_libbpf.btf_member))
            bit_off = m.offset & 0xFFFFFF if kind_flag else m.offset
            size = lib.btf__resolve_size(self._ptr, m.type)
            members.append(BtfMember(self._name(m.name_off), bit_off // 8, int(size)))
        return t.size_or_type, members

    def enum(self, name: str) -> dict[str, int] | None:
        """Names and values of an enum, None if absent."""
        tid = library().btf__find_by_name_kind(self._ptr, name.encode(), BTF_KIND_ENUM)
        if tid < 0:
            return None
        t = self._type(tid)
        base = ctypes.addressof(t) + ctypes.sizeof(_libbpf.btf_type)
        values = {}
        for i in range(t.info & 0xFFFF):
            # struct btf_enum { __u32 name_off; __s32 val; }
            name_off, val = struct.unpack_from("<Ii", ctypes.string_at(base + i * 8, 8))
            values[self._name(name_off)] = val
        return values

    def has_typedef(self, name: str) -> bool:
        return library().btf__find_by_name_kind(self._ptr, name.encode(), BTF_KIND_TYPEDEF) >= 0

    def datasec_var_offset(self, section: str, var: str) -> int | None:
        """Offset of variable `var` inside data section `section` (e.g. .rodata)."""
        lib = library()
        tid = lib.btf__find_by_name_kind(self._ptr, section.encode(), BTF_KIND_DATASEC)
        if tid < 0:
            return None
        t = self._type(tid)
        base = ctypes.addressof(t) + ctypes.sizeof(_libbpf.btf_type)
        for i in range(t.info & 0xFFFF):
            v = _libbpf.btf_var_secinfo.from_address(base + i * ctypes.sizeof(_libbpf.btf_var_secinfo))
            if self._name(self._type(v.type).name_off) == var:
                return int(v.offset)
        return None


# A BTF blob with no type (btf_header, then an empty string section): kernel types for an object
# whose loaded programs read no kernel struct, so that libbpf skips parsing the kernel's own.
_EMPTY_BTF = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, 0, 0, 1) + b"\0"


class NoKernelTypes:
    """A path to give BpfObject as btf_custom_path when the programs to load have no CO-RE
    relocation (libbpf then never reads /sys/kernel/btf/vmlinux: ~11 ms). An anonymous file
    (memfd), nothing on disk; valid inside the `with`."""

    def __enter__(self) -> str:
        fd = os.memfd_create("bistouri-no-kernel-types", os.MFD_CLOEXEC)
        try:
            os.write(fd, _EMPTY_BTF)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return f"/proc/self/fd/{fd}"

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


class BtfFile(_Handle):
    """BTF parsed from an ELF file without loading anything into the kernel."""

    def __init__(self, path: str | Path) -> None:
        ptr = check_ptr(library().btf__parse(str(path).encode(), None), f"parsing BTF of {path}")
        self._ptr = ptr
        self._closed = False
        self.btf = Btf(ptr, self)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            library().btf__free(self._ptr)


class Link(_Handle):
    """An attached program. Destroying it detaches and closes the perf fd it owns."""

    def __init__(self, ptr: Any, what: str) -> None:
        self._ptr = ptr
        self.what = what
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            library().bpf_link__destroy(self._ptr)


class Program:
    def __init__(self, obj: BpfObject, ptr: Any) -> None:
        self._obj = obj
        self._ptr = ptr
        self.name = library().bpf_program__name(ptr).decode()
        # The verifier log of this program lands here if its load fails. Anonymous memory, not a
        # ctypes buffer: its pages cost nothing until the verifier writes (a failed load only), where
        # zeroing 1 MiB per program delayed every start.
        self._log_map: mmap.mmap | None = mmap.mmap(-1, VERIFIER_LOG_BYTES)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._log_map))
        library().bpf_program__set_log_buf(ptr, ctypes.c_char_p(address), VERIFIER_LOG_BYTES)

    @property
    def verifier_log(self) -> str:
        if self._log_map is None:
            return ""
        end = self._log_map.find(b"\0")
        return self._log_map[: end if end >= 0 else VERIFIER_LOG_BYTES].decode(errors="replace")

    def release_log(self) -> None:
        """Free the verifier log buffer once the object is loaded."""
        library().bpf_program__set_log_buf(self._ptr, None, 0)
        if self._log_map is not None:
            try:
                self._log_map.close()
            except BufferError:  # a ctypes view still exports it: freed with this Program
                pass
            self._log_map = None

    @property
    def fd(self) -> int:
        """The loaded program's fd (for a PROG_ARRAY slot)."""
        return check_int(library().bpf_program__fd(self._ptr), f"fd of program {self.name}")

    def set_autoload(self, autoload: bool) -> None:
        check_int(library().bpf_program__set_autoload(self._ptr, autoload), f"set_autoload {self.name}")

    def attach(self) -> Link:
        self._obj._check_open()
        ptr = check_ptr(library().bpf_program__attach(self._ptr), f"attaching program {self.name}")
        return Link(ptr, self.name)

    def attach_perf_event(self, perf_fd: int) -> Link:
        """Attach to a perf event fd. The link owns the fd from then on (and closes it)."""
        self._obj._check_open()
        try:
            ptr = check_ptr(
                library().bpf_program__attach_perf_event(self._ptr, perf_fd),
                f"attaching program {self.name} to perf event",
            )
        except BpfError:
            os.close(perf_fd)  # not owned by a link: ours to close
            raise
        return Link(ptr, f"{self.name}@perf{perf_fd}")


class BpfObject(_Handle):
    """A BPF ELF object: open → configure (rodata, autoload) → load → attach."""

    def __init__(self, path: str | Path, btf_custom_path: str | None = None) -> None:
        """`btf_custom_path`: kernel types for the CO-RE relocations, instead of the running
        kernel's whole BTF (which libbpf takes ~10 ms to parse): see NoKernelTypes."""
        self.path = str(path)
        lib = library()
        if not os.path.exists(self.path):
            raise BpfError(
                f"opening BPF object {self.path}",
                errno.ENOENT,
                hint="run `make bpf` in a source tree, or reinstall the package that ships it",
            )
        opts = None
        if btf_custom_path is not None:
            opts = _libbpf.bpf_object_open_opts(btf_custom_path=btf_custom_path.encode())
            opts.sz = _libbpf.bpf_object_open_opts.btf_custom_path.offset + ctypes.sizeof(ctypes.c_char_p)
        ptr = check_ptr(
            lib.bpf_object__open_file(self.path.encode(), None if opts is None else ctypes.byref(opts)),
            f"opening BPF object {self.path}",
        )
        self._ptr = ptr
        self._closed = False
        self.loaded = False
        self.maps: dict[str, Map] = {}
        self.programs: dict[str, Program] = {}
        m = lib.bpf_object__next_map(ptr, None)
        while m:
            mp = Map(self, m)
            self.maps[mp.name] = mp
            m = lib.bpf_object__next_map(ptr, m)
        p = lib.bpf_object__next_program(ptr, None)
        while p:
            pr = Program(self, p)
            self.programs[pr.name] = pr
            p = lib.bpf_object__next_program(ptr, p)

    def _check_open(self) -> None:
        if self._closed:
            raise BpfError("using a closed BPF object", errno.EBADF)

    @property
    def btf(self) -> Btf:
        self._check_open()
        return Btf(check_ptr(library().bpf_object__btf(self._ptr), "BTF of the BPF object"), self)

    def _internal_map(self, suffix: str) -> Map:
        # libbpf names internal maps "<obj prefix>.rodata": match the suffix.
        for name, m in self.maps.items():
            if name.endswith(suffix):
                return m
        raise BpfError(f"finding the {suffix} map of {self.path}", errno.ENOENT)

    def write_rodata(self, var: str, data: bytes) -> None:
        """Write a `const volatile` global before load (writes after load are ignored by the kernel)."""
        self._check_open()
        if self.loaded:
            raise BpfError(f"writing .rodata variable {var}", errno.EBUSY, hint="it must be set before load")
        offset = self.btf.datasec_var_offset(".rodata", var)
        if offset is None:
            raise BpfError(f"finding .rodata variable {var}", errno.ENOENT)
        m = self._internal_map(".rodata")
        size = ctypes.c_size_t()
        ptr = check_ptr(
            library().bpf_map__initial_value(m._ptr, ctypes.byref(size)), "bpf_map__initial_value"
        )
        if offset + len(data) > size.value:
            raise BpfError(f"writing .rodata variable {var}", errno.EOVERFLOW)
        ctypes.memmove(ptr + offset, data, len(data))

    def load(self) -> None:
        self._check_open()
        ret = library().bpf_object__load(self._ptr)
        if ret < 0:
            logs = "\n".join(
                f"[{p.name}]\n{p.verifier_log}" for p in self.programs.values() if p.verifier_log.strip()
            )
            raise BpfError(f"loading BPF object {self.path}", -ret, log=logs)
        self.loaded = True
        for p in self.programs.values():
            p.release_log()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            library().bpf_object__close(self._ptr)


class RingBuffer(_Handle):
    """libbpf ring buffer manager over one or more ring maps.

    Each map gets a handler `fn(data: bytes) -> None`. Handlers run on the
    thread that calls `consume()`; an exception inside one stops the current
    consume and is re-raised there, never swallowed by ctypes.
    """

    STOP = -4096  # returned by a callback to end consume() early (budget or error)

    def __init__(self, maps: list[tuple[Map, Callable[[bytes], None]]]) -> None:
        if not maps:
            raise ValueError("a ring buffer needs at least one map")
        lib = library()
        self._callbacks: list[Any] = []  # CFUNCTYPE objects must outlive the ring buffer
        self._error: BaseException | None = None
        self._budget = 0
        self._owner = maps[0][0]._obj
        first, fn = maps[0]
        cb = self._make_callback(fn)
        ptr = check_ptr(lib.ring_buffer__new(first.fd, cb, None, None), f"ring buffer on map {first.name}")
        self._ptr = ptr
        self._closed = False
        for m, fn in maps[1:]:
            cb = self._make_callback(fn)
            check_int(lib.ring_buffer__add(ptr, m.fd, cb, None), f"adding map {m.name} to ring buffer")

    def _make_callback(self, fn: Callable[[bytes], None]) -> Any:
        def trampoline(_ctx: int, data: int, size: int) -> int:
            try:
                fn(ctypes.string_at(data, size))
            except BaseException as e:  # stored and re-raised by consume()
                self._error = e
                return self.STOP
            self._budget -= 1
            return self.STOP if self._budget <= 0 else 0

        cb = _libbpf.RING_BUFFER_SAMPLE_FN(trampoline)
        self._callbacks.append(cb)
        return cb

    def epoll_fd(self) -> int:
        self._owner._check_open()
        return check_int(library().ring_buffer__epoll_fd(self._ptr), "ring_buffer__epoll_fd")

    def consume(self, budget: int = 4096) -> int:
        """Handle at most about `budget` records; returns how many were handled.

        Bounded because consume() does not return while the producer keeps up.
        """
        if self._closed:
            raise BpfError("consuming a closed ring buffer", errno.EBADF)
        self._owner._check_open()
        self._budget = budget
        ret = library().ring_buffer__consume(self._ptr)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if ret < 0 and ret != self.STOP and ret != -errno.EINTR:
            raise BpfError("ring_buffer__consume", -ret)
        return budget - self._budget

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            library().ring_buffer__free(self._ptr)
