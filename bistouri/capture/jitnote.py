"""The JIT part of a session's data-quality note: which runtimes' JIT frames could not be named,
or were cut short, and what their user can do about it.

A session's `unwind.jit` counts its processes by note (wire-format.md): for a JVM, the outcome of
the agent's last perf-map request (`jvm_<reason>`, host/jvm.py) and `jvm_cut_in_jit` when its
stacks stop at JIT code (no `-XX:+PreserveFramePointer`, and no unwind rows for that code: compiled
after the last perf map, or a stub of a kind unwind/hotspot.py does not size); for node,
`node_unnamed` when it writes no perf map (no `--perf-basic-prof`). `note_lines` says them in words
(`record` prints them; the UI's session page says the same, ui/js/common.js).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from .. import wire
from ..host.procmaps import ProcMaps

CUT_IN_JIT = "jvm_cut_in_jit"
NODE_UNNAMED = "node_unnamed"
JVM_NOT_ASKED = "jvm_not_asked"  # unnamed JIT frames of a JVM nobody asked (record --no-jvm-perfmap)

_WORDS = {
    "jvm_old_jvm": "a JVM before JDK 17 has no Compiler.perfmap: its JIT frames stay unnamed",
    "jvm_no_sigquit_handler": "a JVM with no attach listener that does not catch SIGQUIT (-Xrs) was not "
    "asked for its perf map: its JIT frames stay unnamed",
    "jvm_attach_timeout": "a JVM did not answer the attach request (-XX:+DisableAttachMechanism?): "
    "its JIT frames stay unnamed",
    "jvm_refused": "a JVM's attach socket or file was not its own: not asked for its perf map",
    "jvm_failed": "a JVM's perf-map request failed (see the log): its JIT frames may be unnamed",
    JVM_NOT_ASKED: "a JVM's JIT frames are unnamed: run `jcmd PID Compiler.perfmap` during the capture",
    CUT_IN_JIT: "Java stacks stop at JIT code the agent could not size (compiled after the JVM's last perf "
    "map, or a stub): the leaf is named, its callers are lost. Start the JVM with -XX:+PreserveFramePointer "
    "and every JIT frame is walked, whatever its perf map holds",
    NODE_UNNAMED: "node's JIT frames are unnamed: start node with --perf-basic-prof (or --perf-prof) "
    "to name them",
}


def jit_notes(maps: ProcMaps, traces: Iterable[wire.Trace]) -> dict[str, int]:
    """Processes of a session by JIT note (empty when every JIT frame was named and walked through)."""
    jit_leaf: dict[int, int] = defaultdict(int)  # pid -> samples whose leaf is named JIT code
    cut: dict[int, int] = defaultdict(int)  # ... and whose walk reached no file above it
    unknown: set[int] = set()  # pids with an unnamed user frame
    for t in traces:
        if not t.user:
            continue
        n = t.on_cpu + t.off_cpu
        if t.user[0].kind == wire.FRAME_JIT:
            jit_leaf[t.pid] += n
            if all(f.kind != wire.FRAME_RESOLVED for f in t.user):
                cut[t.pid] += n
        if any(f.kind == wire.FRAME_UNKNOWN for f in t.user):
            unknown.add(t.pid)
    notes: dict[str, int] = defaultdict(int)
    for pid in jit_leaf.keys() | unknown:
        runtime, outcome, named = maps.runtime(pid)
        if runtime == "jvm":
            if outcome:
                notes[f"jvm_{outcome}"] += 1
            elif pid in unknown and not named:
                notes[JVM_NOT_ASKED] += 1
            if cut[pid] * 2 > jit_leaf[pid]:
                notes[CUT_IN_JIT] += 1
        elif runtime == "node" and pid in unknown and not named:
            notes[NODE_UNNAMED] += 1
    return dict(notes)


def note_lines(jit: Mapping[str, int]) -> list[str]:
    """What a user should know of a session's JIT frames, one sentence per note."""
    return [_WORDS[k] for k in _WORDS if jit.get(k)]


__all__ = ["jit_notes", "note_lines"]
