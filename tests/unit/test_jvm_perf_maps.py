"""JVM perf-map requests (host/jvm.py) without a JVM: versions, the rate limit, and the note
(capture/jitnote.py) a session's JIT frames get."""

from __future__ import annotations

import os
import signal

from bistouri import wire
from bistouri.capture.jitnote import jit_notes, note_lines
from bistouri.host import jvm


def test_java_major_from_a_release_file():
    assert jvm.java_major(b'IMPLEMENTOR="Eclipse Adoptium"\nJAVA_VERSION="25.0.1"\n') == 25
    assert jvm.java_major(b'JAVA_VERSION="17.0.9"\n') == 17
    assert jvm.java_major(b'JAVA_VERSION="1.8.0_392"\n') == 8
    assert jvm.java_major(b'JAVA_VERSION="x"\n') is None
    assert jvm.java_major(b"") is None


def test_each_process_is_asked_at_most_once_an_interval_and_an_old_jvm_never_again(tmp_path):
    now = [100.0]
    outcomes = {1: jvm.OK, 2: jvm.OLD_JVM}
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
    assert asked == [1, 2] and told == [(1, jvm.OK), (2, jvm.OLD_JVM)]
    assert maps.outcome(1) == jvm.OK and maps.outcome(3) is None
    now[0] += 30
    maps.request(1)  # a session starts 30 s later: too soon
    run_queued()
    now[0] += 31
    maps.request(1)
    maps.request(2)  # no Compiler.perfmap: never again
    run_queued()
    assert asked == [1, 2, 1]


def test_an_attach_that_timed_out_is_tried_again_later_a_few_times_in_all(tmp_path):
    """A JVM that did not answer the signal (a long pause) may later: asked again after
    retry_after_s, by a session or by record's refresh, MAX_ATTACH_TIMEOUTS times in all."""
    now = [100.0]
    answers = [jvm.ATTACH_TIMEOUT, jvm.ATTACH_TIMEOUT, jvm.OK, jvm.ATTACH_TIMEOUT, jvm.ATTACH_TIMEOUT]
    asked: list[int] = []

    def attach(pid: int) -> jvm.AttachResult:
        asked.append(pid)
        return jvm.AttachResult(answers[len(asked) - 1])

    maps = jvm.JvmPerfMaps(
        str(tmp_path), min_interval_s=60, retry_after_s=600, attach=attach, clock=lambda: now[0]
    )

    def ask() -> None:
        maps.request(1)
        while not maps._queue.empty():
            maps.attempt(maps._queue.get_nowait())

    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "maps").write_text("")  # alive, for refresh
    before = jvm.RESULTS[jvm.ATTACH_TIMEOUT]
    ask()
    now[0] += 120  # past the interval, not the retry delay
    ask()
    assert len(asked) == 1 and maps.outcome(1) == jvm.ATTACH_TIMEOUT
    now[0] += 600
    ask()  # the second timeout
    now[0] += 600
    ask()  # answered
    assert len(asked) == 3 and maps.outcome(1) == jvm.OK
    now[0] += 60
    ask()  # the third timeout: the last one
    now[0] += 600
    ask()
    maps.refresh([1])  # record's refresh keeps the bound too
    assert len(asked) == 4 and maps.outcome(1) == jvm.ATTACH_TIMEOUT
    assert jvm.RESULTS[jvm.ATTACH_TIMEOUT] - before == jvm.MAX_ATTACH_TIMEOUTS == 3


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


def _fake_proc(tmp_path, dispatcher: bool):
    """A /proc entry for this very process that says it is a JVM catching SIGQUIT."""
    proc = tmp_path / "proc"
    base = proc / str(os.getpid())
    (base / "task" / "1").mkdir(parents=True)
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    (root / "tmp").mkdir(parents=True)
    cwd.mkdir()
    (base / "root").symlink_to(root)
    (base / "cwd").symlink_to(cwd)
    uid, gid = os.getuid(), os.getgid()
    quit_bit = 1 << (signal.SIGQUIT - 1)
    (base / "status").write_text(
        f"Name:\tjava\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{gid}\t{gid}\t{gid}\t{gid}\n"
        f"NSpid:\t{os.getpid()}\t7\nSigCgt:\t{quit_bit:016x}\nvoluntary_ctxt_switches:\t0\n"
    )
    (base / "maps").write_text("7f00-7f10 r-xp 00000000 08:01 42 /opt/jdk/lib/server/libjvm.so\n")
    (base / "task" / "1" / "comm").write_text("Signal Dispatch\n" if dispatcher else "java\n")
    return proc, cwd, root


def test_a_jvm_still_starting_is_not_signalled(tmp_path):
    proc, cwd, _ = _fake_proc(tmp_path, dispatcher=False)
    # This process does not catch SIGQUIT: a signal would end the test run.
    r = jvm.attach_perf_map(os.getpid(), str(proc))
    assert (r.reason, r.detail) == (jvm.FAILED, "still starting: no signal dispatcher yet")
    assert not list(cwd.iterdir())


def test_the_attach_file_is_the_jvms_and_gone_after_an_unanswered_signal(tmp_path):
    proc, cwd, root = _fake_proc(tmp_path, dispatcher=True)
    seen: list[tuple[int, bool]] = []
    trigger = cwd / ".attach_pid7"  # named with the pid of its namespace, in its cwd first

    def on_quit(*_: object) -> None:
        st = trigger.stat()
        seen.append((st.st_uid, bool(st.st_mode & 0o077)))

    old = signal.signal(signal.SIGQUIT, on_quit)
    try:
        r = jvm.attach_perf_map(os.getpid(), str(proc), attach_timeout_s=0.2)
    finally:
        signal.signal(signal.SIGQUIT, old)
    assert r.reason == jvm.ATTACH_TIMEOUT
    assert seen == [(os.getuid(), False)]  # there when signalled, the JVM user's, private
    assert not trigger.exists() and not list((root / "tmp").iterdir())


def test_a_planted_attach_file_is_not_followed(tmp_path):
    proc, cwd, root = _fake_proc(tmp_path, dispatcher=True)
    target = tmp_path / "victim"
    (cwd / ".attach_pid7").symlink_to(target)
    (root / "tmp" / ".attach_pid7").symlink_to(target)
    r = jvm.attach_perf_map(os.getpid(), str(proc), attach_timeout_s=0.2)
    assert (r.reason, r.detail) == (jvm.REFUSED, ".attach_pid7: cannot be created")
    assert not target.exists()
