"""JVM perf-map requests (host/jvm.py) without a JVM: versions, the rate limit, and the note
(capture/jitnote.py) a session's JIT frames get."""

from __future__ import annotations

from bistouri import wire
from bistouri.capture.jitnote import jit_notes, note_lines
from bistouri.host import jvm


def test_java_major_from_a_release_file():
    assert jvm.java_major(b'IMPLEMENTOR="Eclipse Adoptium"\nJAVA_VERSION="25.0.1"\n') == 25
    assert jvm.java_major(b'JAVA_VERSION="17.0.9"\n') == 17
    assert jvm.java_major(b'JAVA_VERSION="1.8.0_392"\n') == 8
    assert jvm.java_major(b'JAVA_VERSION="x"\n') is None
    assert jvm.java_major(b"") is None


def test_each_process_is_asked_at_most_once_an_interval_and_never_after_a_final_outcome(tmp_path):
    now = [100.0]
    outcomes = {1: jvm.OK, 2: jvm.NO_SIGQUIT_HANDLER}
    asked: list[int] = []

    def attach(pid: int) -> jvm.AttachResult:
        asked.append(pid)
        return jvm.AttachResult(outcomes[pid])

    told: list[tuple[int, str]] = []
    maps = jvm.JvmPerfMaps(
        str(tmp_path),
        min_interval_s=60,
        attach=attach,
        clock=lambda: now[0],
        on_result=lambda *a: told.append(a),
    )

    def run_queued() -> None:
        while not maps._queue.empty():
            maps.attempt(maps._queue.get_nowait())

    for pid in (1, 2, 1, 2):
        maps.request(pid)
    run_queued()
    assert asked == [1, 2] and told == [(1, jvm.OK), (2, jvm.NO_SIGQUIT_HANDLER)]
    assert maps.outcome(1) == jvm.OK and maps.outcome(3) is None
    now[0] += 30
    maps.request(1)  # a session starts 30 s later: too soon
    run_queued()
    now[0] += 31
    maps.request(1)
    maps.request(2)  # -Xrs: never again
    run_queued()
    assert asked == [1, 2, 1]


def test_a_full_queue_drops_requests_instead_of_blocking(tmp_path):
    maps = jvm.JvmPerfMaps(str(tmp_path), attach=lambda pid: jvm.AttachResult(jvm.OK))
    for pid in range(maps._QUEUE + 10):
        maps.request(pid)  # never blocks
    assert maps._queue.qsize() == maps._QUEUE


class _Maps:
    """What jit_notes reads of ProcMaps: each pid's runtime, last request outcome, named or not."""

    def __init__(self, runtimes: dict[int, tuple[str, str, bool]]) -> None:
        self.runtimes = runtimes

    def runtime(self, pid: int) -> tuple[str, str, bool]:
        return self.runtimes.get(pid, ("", "", False))


def _trace(pid: int, *kinds: int, n: int = 10) -> wire.Trace:
    frames = tuple(
        wire.UserFrame(k, b"", 0x1000 + i, "f" if k == wire.FRAME_JIT else "") for i, k in enumerate(kinds)
    )
    return wire.Trace(kernel=(), user=frames, pid=pid, tid=pid, on_cpu=n)


def test_the_jit_note_says_what_each_runtime_lacks():
    J, R, U = wire.FRAME_JIT, wire.FRAME_RESOLVED, wire.FRAME_UNKNOWN
    maps = _Maps(
        {
            1: ("jvm", "ok", True),  # walked through: nothing to say but the outcome
            2: ("jvm", "ok", True),  # stacks stop at the JIT leaf
            3: ("jvm", "attach_timeout", False),
            4: ("node", "", False),  # no --perf-basic-prof
            5: ("node", "", True),  # named: nothing to say
            6: ("jvm", "", False),  # record --no-jvm-perfmap
            7: ("", "", False),  # no runtime: not noted
        }
    )
    traces = [
        _trace(1, J, J, R, R),
        _trace(2, J, n=9),
        _trace(2, J, J, R, n=1),
        _trace(3, U, R),
        _trace(4, U, U, R),
        _trace(5, J, R),
        _trace(6, U, R),
        _trace(7, U),
    ]
    notes = jit_notes(maps, traces)  # type: ignore[arg-type]
    assert notes == {
        "jvm_ok": 2,
        "jvm_cut_in_jit": 1,
        "jvm_attach_timeout": 1,
        "node_unnamed": 1,
        "jvm_not_asked": 1,
    }
    lines = "\n".join(note_lines(notes))
    assert "-XX:+PreserveFramePointer" in lines and "--perf-basic-prof" in lines
    assert "jcmd PID Compiler.perfmap" in lines and "did not answer" in lines
    assert note_lines({"jvm_ok": 3}) == []
