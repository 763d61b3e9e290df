"""The packages: built by `make package`'s script, lint-clean, installable, with working
maintainer scripts and units.

The .deb lifecycle (install, upgrade, remove, purge) and the .rpm payload and scriptlets
(`rpm -i --nodeps`) run in a systemd-nspawn container booted from the VM image's tree:
systemd is PID 1 there, so scriptlets start and stop real units.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import FULL_VERSION, ROOT, need
from .nspawn import Container

DEBS = [
    f"bistouri_{FULL_VERSION}_amd64.deb",
    f"bistouri-agent_{FULL_VERSION}_all.deb",
    f"bistouri-symbolizer_{FULL_VERSION}_all.deb",
]
RPMS = [
    f"bistouri-{FULL_VERSION}.x86_64.rpm",
    f"bistouri-agent-{FULL_VERSION}.noarch.rpm",
    f"bistouri-symbolizer-{FULL_VERSION}.noarch.rpm",
]


def sh(*argv: str | Path) -> str:
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True).stdout


def test_all_packages_are_built(dist: Path) -> None:
    assert sorted(p.name for p in dist.iterdir()) == sorted(DEBS + RPMS)


def test_lintian_and_rpmlint_are_clean(dist: Path) -> None:
    need("lintian", "rpmlint")
    r = subprocess.run(
        ["packaging/lint-packages.sh"],
        cwd=ROOT,
        env={"DIST": str(dist), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"lint failed:\n{r.stdout}\n{r.stderr}"


def test_deb_payload_and_conffiles(dist: Path) -> None:
    files = sh("dpkg-deb", "--contents", dist / DEBS[0])
    assert "./usr/lib/bistouri/python/bistouri/bpf/_bpfobj/bistouri.bpf.o" in files
    assert "./usr/bin/bistouri" in files
    assert "__pycache__" not in files  # compiled by postinst on the target's Python
    # Debian 12's libbpf, for the systems without libbpf >= 1.0 (Debian 11), and its licence.
    assert "./usr/lib/bistouri/libbpf/libbpf.so.1" in files
    assert "./usr/share/doc/bistouri/libbpf.copyright" in files
    agent = dist / DEBS[1]
    assert sh("dpkg-deb", "--info", agent, "conffiles").split() == [
        "/etc/bistouri/trigger.yaml",
        "/etc/default/bistouri-agent",
    ]
    assert f"bistouri (= {FULL_VERSION})" in sh("dpkg-deb", "--field", agent, "Depends")
    assert "./lib/systemd/system/bistouri-agent.service" in sh("dpkg-deb", "--contents", agent)
    symbolizer = sh("dpkg-deb", "--contents", dist / DEBS[2])
    # May hold a database password: not world-readable (postinst gives it to the service's group).
    assert re.search(r"^-rw-r----- root/root .* \./etc/default/bistouri-symbolizer$", symbolizer, re.M), (
        symbolizer
    )


def test_deb_holds_the_bpf_object_of_its_architecture_only(dist: Path) -> None:
    files = sh("dpkg-deb", "--contents", dist / DEBS[0])
    assert "bistouri.arm64.bpf.o" not in files


def test_arm64_packages_hold_the_arm64_object_and_are_lint_clean(tmp_path: Path) -> None:
    """`make package-arm64`: the bistouri package for arm64 (aarch64 for rpm) with the arm64
    BPF object alone, beside the same "all" service packages; lintian and rpmlint clean."""
    need("lintian", "rpmlint", "rpm")
    if not (ROOT / "bistouri" / "bpf" / "_bpfobj" / "bistouri.arm64.bpf.o").exists():
        pytest.skip("the arm64 BPF object is not built: run `make bpf`")
    env = {"DIST": str(tmp_path), "PATH": "/usr/bin:/bin", "BISTOURI_ARCH": "arm64"}
    r = subprocess.run(["packaging/build-packages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"build-packages.sh failed:\n{r.stdout}\n{r.stderr}"
    deb = tmp_path / f"bistouri_{FULL_VERSION}_arm64.deb"
    rpm = tmp_path / f"bistouri-{FULL_VERSION}.aarch64.rpm"
    assert sh("dpkg-deb", "--field", deb, "Architecture").strip() == "arm64"
    objects = [f for f in sh("dpkg-deb", "--contents", deb).split() if f.endswith(".o")]
    assert objects == ["./usr/lib/bistouri/python/bistouri/bpf/_bpfobj/bistouri.arm64.bpf.o"]
    assert sh("rpm", "-qp", "--qf", "%{ARCH}", rpm) == "aarch64"
    assert [f for f in sh("rpm", "-qpl", rpm).split() if f.endswith(".o")] == [
        "/usr/lib/bistouri/python/bistouri/bpf/_bpfobj/bistouri.arm64.bpf.o"
    ]
    r = subprocess.run(["packaging/lint-packages.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"lint failed:\n{r.stdout}\n{r.stderr}"


def test_rpm_payload_config_and_requires(dist: Path) -> None:
    need("rpm")
    agent = dist / RPMS[1]
    assert sh("rpm", "-qpc", agent).split() == ["/etc/bistouri/trigger.yaml", "/etc/sysconfig/bistouri-agent"]
    assert f"bistouri = {FULL_VERSION}" in sh("rpm", "-qp", "--requires", agent)
    assert "/usr/lib/systemd/system/bistouri-agent.service" in sh("rpm", "-qpl", agent)
    requires = sh("rpm", "-qp", "--requires", dist / RPMS[0])
    assert "python3dist(msgpack) >= 1.0" in requires
    # %config(noreplace): rpm keeps an edited file on upgrade and writes .rpmnew.
    dump = sh("rpm", "-qp", "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]", agent)
    assert "/etc/bistouri/trigger.yaml cn" in dump
    modes = sh("rpm", "-qp", "--qf", "[%{FILENAMES} %{FILEMODES:perms}\n]", dist / RPMS[2])
    assert "/etc/sysconfig/bistouri-symbolizer -rw-r-----" in modes, modes


def test_apt_resolves_the_dependencies_on_bookworm(dist: Path) -> None:
    """The host is bookworm: apt must find every dependency in Debian's archive."""
    need("apt-get")
    r = subprocess.run(
        ["apt-get", "install", "--simulate", "--no-install-recommends", *[str(dist / d) for d in DEBS]],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("bistouri", "bistouri-agent", "bistouri-symbolizer"):
        assert f"Inst {name} " in r.stdout


@pytest.fixture
def container(image: Path, dist: Path, tmp_path: Path) -> Iterator[Container]:
    with Container(
        image / "rootfs",
        f"bistouri-pkg-{int(time.time()) % 100000}",
        {dist: "/dist"},
        tmp_path / "nspawn.log",
    ) as c:
        yield c


def unit_state(c: Container, unit: str) -> str:
    return c.run(f"systemctl is-active {unit}", check=False).stdout.strip()


def wait_active(c: Container, unit: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while unit_state(c, unit) != "active":
        if time.monotonic() > deadline:
            journal = c.run(f"journalctl --no-pager -n 60 -u {unit}", check=False).stdout
            raise AssertionError(f"{unit} is {unit_state(c, unit)}, not active:\n{journal}")
        time.sleep(1)


def wait_healthy(c: Container, timeout: float = 120) -> None:
    """The unit is active as soon as its process starts; gunicorn listens a little later."""
    probe = (
        "import urllib.request as u, sys\n"
        "try: body = u.urlopen('http://127.0.0.1:8470/healthz', timeout=5).read()\n"
        "except OSError: sys.exit(1)\n"
        "sys.exit(0 if body.strip() == b'ok' else 1)\n"
    )
    deadline = time.monotonic() + timeout
    while c.run(f"python3 -c {shlex.quote(probe)}", check=False).returncode != 0:
        if time.monotonic() > deadline:
            journal = c.run("journalctl --no-pager -n 200 -u bistouri-symbolizer", check=False).stdout
            raise AssertionError(f"the symbolizer never answered /healthz:\n{journal}")
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.root
def test_deb_lifecycle_in_nspawn(container: Container, dist: Path, tmp_path: Path) -> None:
    c = container
    debs = " ".join(f"/dist/{d}" for d in DEBS)
    c.run(f"DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {debs}")
    # postinst: user from sysusers.d, directories from tmpfiles.d, units enabled and started.
    assert c.run("getent passwd bistouri bistouri-symbolizer | cut -d: -f1,7").stdout.split() == [
        "bistouri:/usr/sbin/nologin",
        "bistouri-symbolizer:/usr/sbin/nologin",
    ]
    assert c.run("stat -c '%U %a' /var/lib/bistouri/spool").stdout.strip() == "bistouri 750"
    assert c.run("systemctl is-enabled bistouri-agent bistouri-symbolizer").stdout.split() == [
        "enabled",
        "enabled",
    ]
    wait_healthy(c)
    assert c.run("test -d /usr/lib/bistouri/python/bistouri/__pycache__", check=False).returncode == 0
    # The env file, readable by the service's group only; the unit's bounds and cache directory.
    env_stat = c.run("stat -c '%U:%G %a' /etc/default/bistouri-symbolizer").stdout.strip()
    assert env_stat == "root:bistouri-symbolizer 640"
    props = c.run("systemctl show -p MemoryMax -p TasksMax -p Environment bistouri-symbolizer").stdout
    assert "MemoryMax=1073741824" in props and "TasksMax=256" in props, props
    assert "BISTOURI_SYMBOLIZER_CACHE_DIR=/var/cache/bistouri-symbolizer" in props, props
    started = c.run("journalctl -u bistouri-symbolizer --no-pager -o cat").stdout
    assert "cache_dir=/var/cache/bistouri-symbolizer" in started, started[-2000:]

    # Upgrade to the same version again (dpkg runs the full upgrade path: prerm upgrade,
    # postinst configure <old>): config edits and the spool survive, the service restarts.
    c.run("echo '# local edit' >> /etc/default/bistouri-agent && touch /var/lib/bistouri/spool/keep.msgpack")
    c.run("chmod 0644 /etc/default/bistouri-symbolizer")  # as an older package left it
    pid_before = c.run("systemctl show -p MainPID --value bistouri-symbolizer").stdout.strip()
    apt = "DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confold"
    c.run(f"{apt} install -y --reinstall {debs}")
    assert "# local edit" in c.run("cat /etc/default/bistouri-agent").stdout
    assert c.run("stat -c '%a' /etc/default/bistouri-symbolizer").stdout.strip() == "640"
    assert c.run("test -f /var/lib/bistouri/spool/keep.msgpack", check=False).returncode == 0
    wait_active(c, "bistouri-symbolizer")
    assert c.run("systemctl show -p MainPID --value bistouri-symbolizer").stdout.strip() != pid_before

    # remove: services stopped, state and config kept; purge: state gone.
    c.run("DEBIAN_FRONTEND=noninteractive apt-get remove -y bistouri-agent bistouri-symbolizer")
    assert unit_state(c, "bistouri-symbolizer") in ("inactive", "unknown")
    assert (
        c.run(
            "test -f /var/lib/bistouri/spool/keep.msgpack && test -f /etc/bistouri/trigger.yaml", check=False
        ).returncode
        == 0
    )
    c.run("DEBIAN_FRONTEND=noninteractive apt-get purge -y bistouri-agent bistouri-symbolizer bistouri")
    assert (
        c.run(
            "test -e /var/lib/bistouri || test -e /var/lib/bistouri-symbolizer || test -e /etc/bistouri",
            check=False,
        ).returncode
        != 0
    )
    assert c.run("find /usr/lib/bistouri 2>/dev/null | head -1").stdout == ""


@pytest.mark.slow
@pytest.mark.root
def test_rpm_payload_and_scriptlets_in_nspawn(container: Container, dist: Path) -> None:
    """rpm -i --nodeps into a Debian root: payload, %post/%preun/%postun and units, not Requires."""
    c = container
    # The Python modules the payload imports come from Debian (rpm cannot resolve them here).
    c.run("DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends rpm")
    rpms = " ".join(f"/dist/{r}" for r in RPMS)
    c.run(f"rpm -i --nodeps {rpms}")
    assert c.run("rpm -q bistouri bistouri-agent bistouri-symbolizer").stdout.split() == [
        f"bistouri-{FULL_VERSION}.x86_64",
        f"bistouri-agent-{FULL_VERSION}.noarch",
        f"bistouri-symbolizer-{FULL_VERSION}.noarch",
    ]
    # %post: user, directories, daemon-reload (the unit is known); RPM leaves start to presets.
    c.run("getent passwd bistouri bistouri-symbolizer")
    assert c.run("stat -c '%U' /var/lib/bistouri/spool").stdout.strip() == "bistouri"
    assert c.run("rpm -qf /usr/lib/systemd/system/bistouri-agent.service").returncode == 0
    assert "ExecStart=/usr/bin/bistouri agent" in c.run("systemctl cat bistouri-agent").stdout
    env_stat = c.run("stat -c '%U:%G %a' /etc/sysconfig/bistouri-symbolizer").stdout.strip()
    assert env_stat == "root:bistouri-symbolizer 640"
    c.run("systemctl start bistouri-symbolizer")
    wait_active(c, "bistouri-symbolizer")
    wait_healthy(c)
    # %preun 0: stop and disable; %postun 0: state kept (rpm has no purge).
    c.run("systemctl enable bistouri-symbolizer")
    c.run("rpm -e bistouri-symbolizer bistouri-agent bistouri")
    state = unit_state(c, "bistouri-symbolizer")
    assert state in ("inactive", "unknown"), (
        state + "\n" + c.run("journalctl --no-pager -n 200 -u bistouri-symbolizer", check=False).stdout
    )
    assert (
        c.run(
            "test -e /etc/systemd/system/multi-user.target.wants/bistouri-symbolizer.service", check=False
        ).returncode
        != 0
    )
    assert c.run("test -d /var/lib/bistouri/spool").returncode == 0
    assert (
        c.run(
            "test -e /usr/bin/bistouri || test -e /usr/lib/bistouri/python/bistouri", check=False
        ).returncode
        != 0
    )


@pytest.mark.slow
@pytest.mark.root
def test_systemd_analyze_security(container: Container, dist: Path, tmp_path: Path) -> None:
    """Exposure scores of both units (docs/deployment.md quotes them); fail if they regress."""
    c = container
    c.run(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        + " ".join(f"/dist/{d}" for d in DEBS)
    )
    scores = {}
    for unit, ceiling in (("bistouri-agent", 5.5), ("bistouri-symbolizer", 2.5)):
        out = c.run(f"systemd-analyze security --no-pager {unit}.service", check=False).stdout
        (tmp_path / f"{unit}.security.txt").write_text(out)
        last = [line for line in out.splitlines() if "Overall exposure level" in line][-1]
        scores[unit] = float(last.split(":")[1].split()[0])
        assert scores[unit] <= ceiling, f"{unit} exposure {scores[unit]} > {ceiling}:\n{out}"
    print(f"systemd-analyze security: {scores}")
