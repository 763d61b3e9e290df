"""Kernel types for the BPF object's CO-RE relocations, cut down to what they use and cached.

On every load libbpf parses the running kernel's whole BTF (5.5 MB on 6.18, ~11 ms here) and
searches it for each relocated type (~0.7 ms each). `bpftool gen min_core_btf` writes just the
types and members the object's relocations use (~0.5 KB); opened with it (btf_custom_path),
`record`'s on-CPU sampler skips that work, ~14 ms of its start-up. The file is made once per
kernel and object, after a capture, where bpftool is installed. Without it, or for programs that
attach by kernel BTF (tp_btf: libbpf needs the kernel's BTF to find their targets), the
kernel's BTF is used as before.

Only the light standard modules are imported here: `cached()` runs before the first sample.
"""

from __future__ import annotations

import logging
import os
import stat
import zlib

log = logging.getLogger(__name__)

KERNEL_BTF = "/sys/kernel/btf/vmlinux"
KEEP_FILES = 8  # kernels x objects: the oldest files go past this (each is ~0.5 KB)
# Where bpftool is installed: root's PATH has the sbin directories, a user's often not.
_BPFTOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def cache_name(object_path: str, kernel_btf: str = KERNEL_BTF) -> str:
    """The file name of the object's types on this kernel: the kernel's release, version string
    (its build) and BTF size, and a checksum of the object."""
    u = os.uname()
    kernel = f"{u.release}\0{u.version}\0{os.stat(kernel_btf).st_size}".encode()
    with open(object_path, "rb") as f:
        obj = f.read()
    return f"{zlib.crc32(kernel):08x}-{zlib.crc32(obj):08x}-{len(obj)}.btf"


def cached(cache_dir: str, object_path: str) -> str | None:
    """The cached file for this kernel and object, if there is one this user made."""
    try:
        path = os.path.join(cache_dir, cache_name(object_path))
        st = os.lstat(path)
    except OSError:
        return None
    # Another user's file, or a link, could give the relocations wrong offsets: not used.
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not st.st_size:
        return None
    return path


def discard(path: str) -> None:
    """Remove a cached file the load refused (a kernel this key did not tell apart)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def find_bpftool() -> str | None:
    import shutil

    found = shutil.which("bpftool")
    if found:
        return found
    for d in _BPFTOOL_DIRS:
        path = os.path.join(d, "bpftool")
        if os.access(path, os.X_OK):
            return path
    return None


def build(cache_dir: str, object_path: str, timeout_s: float = 30.0) -> str | None:
    """Make the cached file if it is missing: returns its path, or None (no bpftool, or it failed:
    the next load uses the kernel's BTF, as without the cache)."""
    have = cached(cache_dir, object_path)
    if have is not None:
        return have
    bpftool = find_bpftool()
    if bpftool is None:
        log.debug("No bpftool: the BPF object keeps relocating against the kernel's whole BTF")
        return None
    import subprocess
    import tempfile

    try:
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        final = os.path.join(cache_dir, cache_name(object_path))
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".btf-", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        log.info("Cannot cache the kernel types of the BPF object. dir=%s error=%s", cache_dir, e)
        return None
    try:
        done = subprocess.run(
            [bpftool, "gen", "min_core_btf", KERNEL_BTF, tmp, object_path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode or not os.path.getsize(tmp):
            log.info(
                "bpftool could not cut the kernel's BTF down to the object's types. status=%d error=%s",
                done.returncode,
                done.stderr.strip()[-500:],
            )
            return None
        os.replace(tmp, final)
        _prune(cache_dir, KEEP_FILES)
        return final
    except (OSError, subprocess.SubprocessError) as e:
        log.info("bpftool could not cut the kernel's BTF down to the object's types. error=%s", e)
        return None
    finally:
        discard(tmp)  # gone already when it was renamed


def _prune(cache_dir: str, keep: int) -> None:
    """Remove all but the `keep` most recently made files (older kernels, older objects)."""
    try:
        with os.scandir(cache_dir) as it:
            files = [(e.stat().st_mtime_ns, e.path) for e in it if e.name.endswith(".btf") and e.is_file()]
    except OSError:
        return
    for _, path in sorted(files, reverse=True)[keep:]:
        discard(path)
