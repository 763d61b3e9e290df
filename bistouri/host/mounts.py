"""The mount table, read from /proc/self/mountinfo: the one reader of where filesystems are mounted.

Where cgroup2 is mounted (the agent's --cgroup-path default, `record --cgroup`, `bistouri check`), the
cgroup hierarchies with the sub-tree each mount shows (cgroupfs.CgroupMounts) and whether tracefs is
there all come from here. mountinfo rather than /proc/mounts: it also says which directory of its
filesystem a mount shows (a container's cgroup mount shows its own sub-tree, not the host's root).
`<proc>/self/mountinfo` under another proc root (a container's view of the host's /proc) is still the
reading process's own mount namespace, as `<proc>/mounts` (a link to self/mounts) was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..compat import SLOTS

# Bound of the read: hosts with thousands of mounts (a Kubernetes node) have mountinfo files of
# a few hundred KiB.
MAX_MOUNTINFO_BYTES = 8 << 20


@dataclass(frozen=True, **SLOTS)
class Mount:
    """One line of mountinfo (proc(5)): the fields bistouri uses."""

    point: str  # where it is mounted
    root: str  # the directory of its filesystem that the mount shows ("/" for all of it)
    fstype: str
    super_options: tuple[str, ...]  # e.g. ("rw", "cpu", "cpuacct") of a cgroup v1 mount


def unescape(field: bytes) -> str:
    r"""A path field of mountinfo or /proc/mounts: the kernel writes space, tab, newline and backslash
    as a backslash and three octal digits (\040 \011 \012 \134). Anything else is kept as it is."""
    out = bytearray()
    i = 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == 0x5C and len(digits) == 3 and all(0x30 <= c <= 0x37 for c in digits):
            out.append(int(digits, 8) & 0xFF)
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out).decode("utf-8", "surrogateescape")


def parse(data: bytes) -> list[Mount]:
    """The mounts of mountinfo content, in its order; malformed lines are skipped."""
    found = []
    for line in data.splitlines():
        fields = line.split()
        try:
            sep = fields.index(b"-")  # optional fields end with a lone "-"
        except ValueError:
            continue
        if sep < 5 or len(fields) < sep + 4:
            continue
        found.append(
            Mount(
                point=unescape(fields[4]),
                root=unescape(fields[3]),
                fstype=fields[sep + 1].decode(errors="replace"),
                super_options=tuple(fields[sep + 3].decode(errors="replace").split(",")),
            )
        )
    return found


def read(proc_root: str = "/proc") -> list[Mount]:
    """This process's mounts; [] when mountinfo cannot be read."""
    data = b""
    try:
        with open(os.path.join(proc_root, "self", "mountinfo"), "rb", buffering=0) as f:
            while len(data) < MAX_MOUNTINFO_BYTES:  # a proc file may come a page per read
                chunk = f.read(MAX_MOUNTINFO_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError:
        return []
    if len(data) == MAX_MOUNTINFO_BYTES:
        data = data[: data.rfind(b"\n") + 1]  # cut: a partial last line is not a mount
    return parse(data)


def find_cgroup2_mount(proc_root: str = "/proc") -> str | None:
    """Where the first cgroup2 filesystem is mounted; None if nowhere."""
    return next((m.point for m in read(proc_root) if m.fstype == "cgroup2"), None)
