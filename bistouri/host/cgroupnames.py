"""What a cgroup path names: its systemd unit, and the container (id, runtime, Kubernetes pod) behind it.

Pure: a path in, names out; no file is read. The path is a cgroup's, from the root of its hierarchy
(the cgroup2 path of a session's trigger, or a v1 line of /proc/PID/cgroup on a hybrid host):

- systemd: slices, then the unit (`/system.slice/nginx.service`, `/user.slice/user-1000.slice/
  user@1000.service/...`, `/user.slice/user-1000.slice/session-3.scope`); a path of slices alone
  names its innermost slice;
- docker: `docker-<id>.scope` (systemd driver), `/docker/<id>` (cgroupfs driver);
- containerd (Kubernetes CRI): `cri-containerd-<id>.scope`, and `/kubepods/<qos>/pod<uid>/<id>`
  (cgroupfs driver: a bare id, which cri-dockerd writes too; containerd is what runs it today);
- podman: `libpod-<id>.scope`, `/libpod_parent/libpod-<id>` (cgroupfs); `libpod-conmon-<id>.scope`
  holds podman's monitor of the container, not the container: it names a unit, no container;
- CRI-O: `crio-<id>.scope` (systemd driver), `crio-<id>` (cgroupfs); `crio-conmon-<id>.scope` as podman's;
- Kubernetes pods: `kubepods-<qos>-pod<uid>.slice` (systemd: `_` for `-` in the uid), `pod<uid>`.

Hostile-safe: below a delegated cgroup (a container, `user@.service`) the names are its owner's to
choose, so the outermost match wins (the one the host's systemd or runtime made), ids must have their
runtime's exact form (64 hex digits), and a path is read at most MAX_DEPTH levels deep. A container
read below a user's manager (rootless podman or docker, under `user@UID.service`, the unit then) is that
user's word: the user names the cgroups there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import wire
from ..compat import SLOTS

MAX_DEPTH = 32  # levels read from the top: systemd nests a few slices, Kubernetes four levels
_MAX_COMPONENT = 255  # the kernel's NAME_MAX: longer is no cgroup's name

_ID = r"([0-9a-f]{64})"
# systemd scopes the runtimes create, by prefix: the first match of a path, read top down, wins.
_SCOPES = (
    (re.compile(rf"docker-{_ID}\.scope"), "docker"),
    (re.compile(rf"cri-containerd-{_ID}\.scope"), "containerd"),
    (re.compile(rf"libpod-{_ID}\.scope"), "podman"),
    (re.compile(rf"crio-{_ID}\.scope"), "crio"),
)
_BARE_ID = re.compile(_ID)
_CRIO_CGROUPFS = re.compile(rf"crio-{_ID}")
_LIBPOD_CGROUPFS = re.compile(rf"libpod-{_ID}")
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SLICE = re.compile(rf"(?:[a-z]+-)*kubepods(?:-[a-z]+)*-pod({_UUID})\.slice")
_POD_DIR = re.compile(rf"pod({_UUID})")
# A systemd unit that can hold processes, as systemd writes its name: an escaped name, a type.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]{1,240}\.(service|scope|socket|mount|swap|slice)")


@dataclass(frozen=True, **SLOTS)
class CgroupNames:
    """What a cgroup path names: the systemd unit and the container, if any."""

    unit: str = ""  # the system unit ("nginx.service"), or the innermost slice of a path of slices
    container: wire.Container | None = None


NONE = CgroupNames()


def names_of(path: str) -> CgroupNames:
    """The unit and the container a cgroup path names; empty names for "/" or a path that names neither."""
    parts = [p for p in path.split("/", MAX_DEPTH + 1)[: MAX_DEPTH + 1] if p][:MAX_DEPTH]
    if any(len(p) > _MAX_COMPONENT for p in parts):
        return NONE
    return CgroupNames(_unit(parts), _container(parts))


def _unit(parts: list[str]) -> str:
    """systemd's reading: skip the slices from the top; the next name is the unit, if it is one."""
    slice_ = ""
    for p in parts:
        m = _UNIT.fullmatch(p)
        if m is None:
            return ""  # slices, then no unit (a cgroupfs path, a delegate's own directory)
        if m.group(1) != "slice":
            return p
        slice_ = p
    return slice_


def _container(parts: list[str]) -> wire.Container | None:
    pod = ""
    # kubelet's tree: /kubepods (cgroupfs), /kubepods.slice, or under a slice of its own (kind, k3s)
    kube = any(p == "kubepods" or p.endswith("kubepods.slice") for p in parts[:2])
    for i, p in enumerate(parts):
        for pattern, runtime in _SCOPES:
            m = pattern.fullmatch(p)
            if m is not None:
                return wire.Container(m.group(1), runtime, pod)
        if kube and not pod:
            m = _POD_SLICE.fullmatch(p) or _POD_DIR.fullmatch(p)
            if m is not None:
                pod = m.group(1).replace("_", "-")
                continue
        parent = parts[i - 1] if i else ""
        if kube and pod:  # cgroupfs driver: a container's directory right under its pod's
            if parent.startswith("pod") and _BARE_ID.fullmatch(p):
                return wire.Container(p, "containerd", pod)
            m = _CRIO_CGROUPFS.fullmatch(p)
            if m is not None and parent.startswith("pod"):
                return wire.Container(m.group(1), "crio", pod)
        if i == 1 and parent == "docker" and _BARE_ID.fullmatch(p):
            return wire.Container(p, "docker")
        if i == 1 and parent == "libpod_parent":
            m = _LIBPOD_CGROUPFS.fullmatch(p)
            if m is not None:
                return wire.Container(m.group(1), "podman")
    return None
