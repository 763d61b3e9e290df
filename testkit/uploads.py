"""The upload program and the agent's export side, for the upload tests and bench/bench_upload.py.

`build` compiles a small program (its symbols kept, or stripped with a separate debug file),
`session` a wire session with stacks in it, `Agent` a spool and an exporter that upload what the
symbolizer asks for, `names` the frame names the symbolizer shows for a session.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import requests
from prometheus_client import CollectorRegistry

from bistouri import wire
from bistouri.agent.exporter import Exporter
from bistouri.agent.settings import AgentSettings
from bistouri.agent.spool import Spool
from bistouri.elf import ElfFile
from bistouri.host.procmaps import ProcMaps
from bistouri.pressure import PressureFigures
from testkit.helpers import wait_until

DEADLINE_S = 60.0
UPLOAD_C = r"""
#include <unistd.h>
__attribute__((noinline)) void upload_leaf(void) { for (;;) pause(); }
__attribute__((noinline)) void upload_middle(void) { upload_leaf(); }
int main(void) { upload_middle(); return 0; }
"""
FUNCTIONS = ("upload_leaf", "upload_middle", "main")  # leaf first, as the wire has it


class Program:
    def __init__(self, path: Path, build_id: bytes, offsets: dict[str, int]) -> None:
        self.path, self.build_id, self.offsets = path, build_id, offsets


def build(tmp_path: Path, name: str, variant: str, marker: str = "") -> Program:
    """The upload program: `symtab` keeps .symtab without DWARF; `stripped` has neither, its DWARF and
    symbols in `<tmp>/debug/.build-id/xx/rest.debug` (the agent host's debug tree)."""
    src = tmp_path / f"{name}.c"
    src.write_text(UPLOAD_C + f'const char *marker = "{marker or name}";\n')  # a build id per program
    out = tmp_path / name
    subprocess.run(
        ["gcc", "-g", "-O0", "-fno-omit-frame-pointer", "-Wl,--build-id", "-o", str(out), str(src)],
        check=True,
    )
    offsets = {}
    with ElfFile(out) as elf:
        build_id = elf.build_id
        for fn in FUNCTIONS:
            vaddr = elf.find_symbol(fn)
            assert vaddr is not None, fn
            seg = next(s for s in elf.segments if s.vaddr <= vaddr < s.vaddr + s.filesz)
            offsets[fn] = vaddr - seg.vaddr + seg.offset + 4
    assert build_id
    if variant == "symtab":
        subprocess.run(["objcopy", "--strip-debug", str(out)], check=True)
    elif variant == "stripped":
        hexid = build_id.hex()
        debug = tmp_path / "debug" / ".build-id" / hexid[:2] / (hexid[2:] + ".debug")
        debug.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["objcopy", "--only-keep-debug", str(out), str(debug)], check=True)
        subprocess.run(["strip", "--strip-all", str(out)], check=True)
    return Program(out, build_id, offsets)


def session(sid: str, prog: Program) -> wire.Session:
    user = tuple(wire.UserFrame(wire.FRAME_RESOLVED, prog.build_id, prog.offsets[f]) for f in FUNCTIONS)
    return wire.Session(
        session_id=sid,
        trigger=wire.Trigger(
            "cpu", "some", 100_000, 2_000_000, "/t.slice", 10**18, pressure=PressureFigures(1.0, 1.0, 1.0, 1)
        ),
        kernel=wire.KernelInfo("6.18.0-test", b"", 0),
        start_ns=10**18,
        duration_ns=10**9,
        period_ns=10**7,
        service="svc",
        host="h",
        labels={},
        processes={1: "upload"},
        threads={1: "upload"},
        traces=[wire.Trace((), user, 1, 1, on_cpu=5)],
    )


class Agent:
    """The agent's export side: a spool, ProcMaps reading the running program, the exporter."""

    def __init__(self, tmp_path: Path, url: str, name: str, pid: int, **settings: Any) -> None:
        self.registry = CollectorRegistry()
        self.maps = ProcMaps()
        self.maps.track(pid)
        self.spool = Spool(str(tmp_path / f"spool-{name}"), 16 << 20, registry=self.registry)
        s = AgentSettings(symbolizer_endpoint=url, **settings)
        self.exporter = Exporter(self.spool, s, registry=self.registry, file_locator=self.maps.locate)

    def send(self, *sessions: wire.Session) -> None:
        for s in sessions:
            assert self.spool.put(s.session_id, wire.encode_session(s))
        self.exporter.start()
        self.exporter.notify()

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def uploaded(self, kind: str) -> bool:
        """One file of this kind uploaded: counted once the agent read the answer, which comes after
        the symbolizer named the session again."""
        return bool(
            wait_until(lambda: self.metric("bistouri_upload_files_total", kind=kind) == 1, DEADLINE_S)
        )

    def stop(self) -> None:
        self.exporter.stop()


def speedscope_frames(url: str, sid: str) -> list[dict[str, Any]]:
    r = requests.get(f"{url}/v1/sessions/{sid}/speedscope", timeout=10)
    if r.status_code == 404:
        return []  # not stored yet: the exporter sends it in its own time
    r.raise_for_status()
    return list(r.json()["shared"]["frames"])


def names(url: str, sid: str) -> set[str]:
    return {f["name"] for f in speedscope_frames(url, sid)}
