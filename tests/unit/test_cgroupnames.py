"""Cgroup paths to the names people read: systemd units, containers and their runtimes, pods."""

from __future__ import annotations

import pytest

from bistouri import wire
from bistouri.host.cgroupnames import MAX_DEPTH, CgroupNames, names_of

# Ids and uids of the forms the runtimes write (64 hex digits; a pod uid is a UUID).
ID = "4f1b9c2e7a6d5038b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e"
ID2 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
POD = "8d9a4c2b-5e6f-4a1b-9c3d-2e1f0a9b8c7d"
POD_ = POD.replace("-", "_")  # systemd's slice names write the uid's dashes as underscores


def c(cid: str, runtime: str, pod: str = "") -> wire.Container:
    return wire.Container(cid, runtime, pod)


CASES = [
    # systemd: slices, then the unit
    ("/", "", None),
    ("", "", None),
    ("/system.slice/nginx.service", "nginx.service", None),
    ("/system.slice/system-getty.slice/getty@tty1.service", "getty@tty1.service", None),
    ("/system.slice/nginx.service/workers", "nginx.service", None),  # a service's own sub-cgroups
    ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope", None),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service", "user@1000.service", None),
    ("/system.slice", "system.slice", None),  # slices alone: the innermost
    ("/machine.slice/systemd-nspawn@web.service/payload", "systemd-nspawn@web.service", None),
    ("/system.slice/dev-mapper-swap.swap", "dev-mapper-swap.swap", None),
    ("/system.slice/var-lib-x\\x2dy.mount", "var-lib-x\\x2dy.mount", None),
    ("/init.scope", "init.scope", None),
    # docker: systemd driver, cgroupfs driver (v2, and v1 lines of a hybrid host's /proc/PID/cgroup)
    (f"/system.slice/docker-{ID}.scope", f"docker-{ID}.scope", c(ID, "docker")),
    (f"/docker/{ID}", "", c(ID, "docker")),
    (f"/docker/{ID}/docker/{ID2}", "", c(ID, "docker")),  # docker in docker: the host's container
    # containerd through Kubernetes' CRI: systemd driver (kubeadm's default), cgroupfs driver, kind/k3s
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/cri-containerd-{ID}.scope",
        f"cri-containerd-{ID}.scope",
        c(ID, "containerd", POD),
    ),
    (
        f"/kubepods.slice/kubepods-pod{POD_}.slice/cri-containerd-{ID}.scope",  # Guaranteed QoS
        f"cri-containerd-{ID}.scope",
        c(ID, "containerd", POD),
    ),
    (f"/kubepods/besteffort/pod{POD}/{ID}", "", c(ID, "containerd", POD)),
    (f"/kubepods/pod{POD}/{ID}", "", c(ID, "containerd", POD)),
    (
        f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{POD_}.slice/cri-containerd-{ID}.scope",
        f"cri-containerd-{ID}.scope",
        c(ID, "containerd", POD),
    ),
    # a pod's slice itself: its unit, no container
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice",
        f"kubepods-burstable-pod{POD_}.slice",
        None,
    ),
    # podman: systemd (root and rootless), cgroupfs; conmon is the container's monitor, not the container
    (f"/machine.slice/libpod-{ID}.scope", f"libpod-{ID}.scope", c(ID, "podman")),
    (f"/machine.slice/libpod-{ID}.scope/container", f"libpod-{ID}.scope", c(ID, "podman")),
    (
        f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope",
        "user@1000.service",
        c(ID, "podman"),
    ),
    (f"/libpod_parent/libpod-{ID}", "", c(ID, "podman")),
    (f"/machine.slice/libpod-conmon-{ID}.scope", f"libpod-conmon-{ID}.scope", None),
    # CRI-O: systemd driver, cgroupfs driver, its conmon
    (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-{ID}.scope",
        f"crio-{ID}.scope",
        c(ID, "crio", POD),
    ),
    (f"/kubepods/burstable/pod{POD}/crio-{ID}", "", c(ID, "crio", POD)),
    (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/crio-conmon-{ID}.scope",
        f"crio-conmon-{ID}.scope",
        None,
    ),
    # cri-dockerd under Kubernetes: docker's scope in a pod's slice
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/docker-{ID}.scope",
        f"docker-{ID}.scope",
        c(ID, "docker", POD),
    ),
]


@pytest.mark.parametrize(("path", "unit", "container"), CASES, ids=[p[:70] for p, _, _ in CASES])
def test_real_world_paths(path, unit, container):
    assert names_of(path) == CgroupNames(unit, container)


HOSTILE = [
    # not the runtimes' id forms: no container
    "/system.slice/docker-abc.scope",
    f"/system.slice/docker-{ID.upper()}.scope",
    f"/system.slice/docker-{ID}0.scope",
    f"/docker/{ID}x",
    f"/other/{ID}",  # a bare id outside docker's and kubelet's trees
    f"/kubepods/burstable/{ID}",  # a bare id not under a pod
    # no unit: the first name after the slices is not a unit's
    "/system.slice/not a unit",
    "/..",
    "/system.slice/" + "a" * 300 + ".service",
]


@pytest.mark.parametrize("path", HOSTILE, ids=[p[:50] for p in HOSTILE])
def test_what_is_not_a_runtimes_name_names_no_container(path):
    assert names_of(path).container is None


def test_a_delegate_cannot_rename_the_container_or_the_unit_it_runs_in():
    """Below its own cgroup a container (or a user's manager) names what it likes: the outermost wins."""
    inner = f"/system.slice/docker-{ID}.scope/system.slice/docker-{ID2}.scope/evil.service"
    assert names_of(inner) == CgroupNames(f"docker-{ID}.scope", c(ID, "docker"))
    fake_pod = f"/kubepods/burstable/pod{POD}/{ID}/pod{POD.replace('8', '9')}/{ID2}"
    assert names_of(fake_pod).container == c(ID, "containerd", POD)


def test_a_path_is_read_to_a_bounded_depth_and_length():
    deep = "/a.slice" * 10_000 + f"/docker-{ID}.scope"
    assert names_of(deep) == CgroupNames("a.slice", None)  # read MAX_DEPTH levels only: slices there
    assert names_of("/a.slice" * (MAX_DEPTH - 1) + f"/docker-{ID}.scope").container == c(ID, "docker")
    assert names_of("/" + "x" * 100_000) == CgroupNames()
    wide = "/kubepods/" + "-".join(["a"] * 120) + "-pod" + "/x"
    assert names_of(wide) == CgroupNames()
