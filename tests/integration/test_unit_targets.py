"""`unit:` targets on the real cgroup2 tree, against a `nobody` process in a delegated subtree."""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bistouri.agent.config import parse_targets_config
from bistouri.agent.discovery import WalkJob, walk_processes
from bistouri.agent.matcher import CommMatcher
from testkit.helpers import Cgroup, cgroup2_mount

NOBODY_UID = 65534
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def slices() -> Iterator[tuple[Path, Path]]:
    """A system slice (root's) and a user's manager with a delegated subtree (nobody's), as systemd
    lays them out: `<id>-system.slice` and `<id>-user.slice/user@65534.service`."""
    root = cgroup2_mount()
    tag = uuid.uuid4().hex[:8]
    system = root / f"bt{tag}-system.slice"
    user = root / f"bt{tag}-user.slice"
    delegated = user / f"user@{NOBODY_UID}.service"
    system.mkdir()
    delegated.mkdir(parents=True)
    for name in ("", "cgroup.procs", "cgroup.subtree_control"):  # what Delegate=yes hands over
        os.chown(delegated / name, NOBODY_UID, NOBODY_UID)
    yield system, delegated
    for top in (system, user):
        for d in sorted((top, *top.rglob("*")), key=lambda p: -len(p.parts)):
            if d.is_dir():
                Cgroup(d).kill_all()
                d.rmdir()


def test_a_unit_target_never_adopts_a_same_named_cgroup_in_a_delegated_subtree(slices):
    system, delegated = slices
    unit = f"victim{uuid.uuid4().hex[:6]}.service"
    # The attacker, in its own delegated subtree, makes a cgroup named like the unit and joins it.
    # It lives in its manager's subtree, as a user's processes do.
    join = f'mkdir "{delegated}/{unit}" && echo $$ > "{delegated}/{unit}/cgroup.procs"'
    fake = Cgroup(delegated).spawn(
        [*NOBODY, "sh", "-c", f"{join} && echo ready && exec sleep 60"], stdout=subprocess.PIPE
    )
    assert fake.stdout is not None and fake.stdout.readline() == b"ready\n"
    cfg = parse_targets_config(
        f"targets:\n  - {{unit: {unit}, service_id: s, resources: [{{resource: cpu, threshold: 1}}]}}\n"
    )
    job = WalkJob(CommMatcher(cfg.targets), 1, cfg.targets, str(cgroup2_mount()))
    units: dict[str, str] = {}
    try:
        first = walk_processes(job, "/proc", threading.Event(), units=units)
        assert first.target_cgroups == {} and fake.pid not in {p.pid for p in first.found}
        # The real unit starts: it is found at the next walk, and only its processes are taken.
        real_cg = system / unit
        real_cg.mkdir()
        real = subprocess.Popen(
            ["sh", "-c", f'echo $$ > "{real_cg}/cgroup.procs" && echo ready && exec sleep 60'],
            stdout=subprocess.PIPE,
        )
        assert real.stdout is not None and real.stdout.readline() == b"ready\n"
        try:
            second = walk_processes(job, "/proc", threading.Event(), units=units)
            rel = "/" + str(real_cg.relative_to(cgroup2_mount()))
            assert second.target_cgroups == {1: rel}
            assert {p.pid for p in second.found} == {real.pid}
        finally:
            real.kill()
            real.wait()
    finally:
        fake.kill()
        fake.wait()
