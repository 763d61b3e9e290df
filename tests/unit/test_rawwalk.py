"""The Python walk of raw stack copies (unwind/rawwalk.py) against the BPF walk's own step.

The same cases as test_unwind_userspace.py (whose C build of bpf/unwind_step.h is the
reference): synthesized stacks through every rule kind and every way a walk ends, and stacks
recorded from Debian's python3.11 and xz with gdb's backtrace as the truth, walked with the
rows our table builder makes from the same binaries. Then a raw record (abi.RawStack) walked
into its event, and the holder's bounds (capture/rawstacks.py).
"""

from __future__ import annotations

import bisect
import ctypes
import struct

import pytest

from bistouri.bpf import abi
from bistouri.bpf.abi import CfaKind, Counter, RbpKind
from bistouri.capture.rawstacks import RawStacks, event_of, hash_ips, pid_of, walked_event
from bistouri.unwind.ehframe import ROW
from bistouri.unwind.rawwalk import NO_RULE, Rule, RuleOf, walk
from tests.unit import test_unwind_userspace as c_walk
from tests.unit.test_unwind_userspace import (
    BASE,
    START,
    TABLE,
    Stack,
    Table,
    _every_kind,
    _recorded,
    _step,
    _tables_of,
    _walk,
)

CRule = c_walk.Rule  # struct unwind_rule, for the C step
host = c_walk.host  # the C step built for user space (a fixture)


def rules_of(tables: list[Table]) -> RuleOf:
    """The rule of a PC from in-memory tables, as MappedRules finds it in the BPF maps."""
    parsed = [(t, [r[0] for r in ROW.iter_unpack(t.rows)], list(ROW.iter_unpack(t.rows))) for t in tables]

    def rule_of(ip: int, exact: bool) -> Rule:
        for t, pcs, rows in parsed:
            if t.start <= ip < t.end:
                i = bisect.bisect_right(pcs, ip - t.bias - (0 if exact else 1)) - 1
                if i < 0:
                    return NO_RULE
                _pc, cfa_off, rbp_off, kind, rbp_kind = rows[i]
                return Rule(kind, cfa_off, rbp_kind, rbp_off, t.bias)
        return NO_RULE

    return rule_of


def test_every_rule_kind_is_walked_as_the_bpf_step_does(host):
    (ip, sp, bp), stack, expected = _every_kind()
    c = _walk(host, (ip, sp, bp), bytes(stack.data), stack.base, [TABLE])
    py = walk(ip, sp, bp, bytes(stack.data), stack.base, rules_of([TABLE]))
    assert py.ips == c.ips == expected
    assert (py.stop, py.by_table, py.by_fp) == (c.stop, c.by_table, c.by_fp) == (Counter.WALK_END, 5, 1)
    assert not py.left_copy


@pytest.mark.parametrize(
    ("rule", "regs"),
    [
        (CRule(cfa_kind=CfaKind.NONE), (START, BASE + 8, 0)),
        (CRule(cfa_kind=CfaKind.RSP, cfa_off=0), (START, BASE + 8, 0)),
        (CRule(cfa_kind=CfaKind.RSP, cfa_off=16), (START, BASE + 4096, 0)),
        (CRule(cfa_kind=CfaKind.SIGNAL), (START, BASE + 4000, 0)),
        (CRule(cfa_kind=CfaKind.RSP, cfa_off=16), (START, BASE + 16, 0)),
        (
            CRule(cfa_kind=CfaKind.RBP, cfa_off=16, rbp_kind=RbpKind.AT_CFA, rbp_off=-16),
            (START, BASE, BASE + 64),
        ),
        (CRule(cfa_kind=CfaKind.PLT, cfa_off=11), (START + 12, BASE + 32, 0)),
        (
            CRule(bias=START, cfa_off=16, rbp_off=4 | 10 << 8, cfa_kind=CfaKind.TRAMPOLINE),
            (START + 85, BASE, 0),
        ),
        (CRule(cfa_kind=CfaKind.END), (START, BASE, 0)),
    ],
)
def test_one_step_ends_or_goes_on_as_the_bpf_step_does(host, rule, regs):
    s = Stack(BASE, 4096)
    for addr in range(BASE, BASE + 4096, 8):  # return addresses above USER_TOP end a walk too
        s.put(addr, 0x7F00_0000_0000 + addr - BASE if addr != BASE + 24 else 0xFFFF_FFFF_8100_0000)
    ended, c = _step(host, rule, regs, s)
    py_rule = Rule(rule.cfa_kind, rule.cfa_off, rule.rbp_kind, rule.rbp_off, rule.bias)
    py = walk(
        *regs, bytes(s.data), s.base, lambda ip, exact: py_rule if ip == regs[0] else NO_RULE, max_depth=1
    )
    if ended:
        assert py.stop == c.stop
    else:
        assert py.stop == Counter.WALK_DEPTH  # went on to a second frame, past max_depth
    assert (py.by_table, py.by_fp) == (c.by_table, c.by_fp)


@pytest.mark.parametrize("name", ["python311", "xz_1", "xz_2"])
def test_a_recorded_stack_copy_is_walked_to_the_entry_as_gdb_does(host, name):
    case, stack = _recorded(name)
    regs = case["regs"]
    tables = _tables_of(case)
    args = (regs["rip"], regs["rsp"], regs["rbp"])
    py = walk(*args, stack, case["stack_base"], rules_of(tables))
    assert [hex(ip) for ip in py.ips] == [hex(pc) for pc in case["gdb_frames"]]
    assert py.ips == _walk(host, args, stack, case["stack_base"], tables).ips
    assert (py.stop, py.by_fp, py.by_table) == (Counter.WALK_END, 0, len(py.ips))


def test_a_walk_that_leaves_the_copy_stops_there_with_the_frames_found():
    case, stack = _recorded("xz_1")
    regs = case["regs"]
    tables = _tables_of(case)
    whole = walk(regs["rip"], regs["rsp"], regs["rbp"], stack, case["stack_base"], rules_of(tables))
    cut = walk(regs["rip"], regs["rsp"], regs["rbp"], stack[:256], case["stack_base"], rules_of(tables))
    assert 0 < len(cut.ips) < len(whole.ips)
    assert cut.ips == whole.ips[: len(cut.ips)]
    assert cut.stop == Counter.WALK_READ_FAILED and cut.left_copy


def _raw_record(pid: int, regs: tuple[int, int, int], stack: bytes, bpf_ips: list[int]) -> bytes:
    """A raw_stacks record as bpf/stack.bpf.h sends it, cut after the stack copied."""
    raw = abi.RawStack(ip=regs[0], sp=regs[1], bp=regs[2], stack_size=len(stack))
    raw.event.kind = abi.EventKind.ON_CPU
    raw.event.pid = pid
    raw.event.timestamp_ns = 123
    raw.event.user_key.pid = pid
    raw.event.user_key.hash = hash_ips(bpf_ips)
    raw.event.user_stack_size = 8 * len(bpf_ips)
    raw.event.user_walk_end = Counter.WALK_NO_FP
    for i, ip in enumerate(bpf_ips):
        raw.event.user_stack[i] = ip
    ctypes.memmove(ctypes.addressof(raw) + abi.RAW_BYTES_OFFSET, stack, len(stack))
    return bytes(raw)[: abi.RAW_BYTES_OFFSET + len(stack)]


def test_a_raw_record_becomes_its_event_with_the_whole_user_stack():
    case, stack = _recorded("python311")
    regs = case["regs"]
    # A copy starts at the sampled SP, as the BPF copy does.
    copy = stack[regs["rsp"] - case["stack_base"] :][: abi.RAW_STACK_BYTES]
    record = _raw_record(42, (regs["rip"], regs["rsp"], regs["rbp"]), copy, [regs["rip"]])
    assert (
        pid_of(record) == 42
        and event_of(record)[: abi.STACK_HEADER_SIZE]
        == bytes(abi.RawStack.from_buffer_copy(record.ljust(ctypes.sizeof(abi.RawStack), b"\0")).event)[
            : abi.STACK_HEADER_SIZE
        ]
    )
    event, w = walked_event(record, rules_of(_tables_of(case)))
    ev = abi.StackEvent.from_buffer_copy(event)
    assert list(ev.user_stack[: ev.user_stack_size // 8]) == case["gdb_frames"] == w.ips
    assert ev.user_key.hash == hash_ips(case["gdb_frames"])  # the key its mapped frames are cached by
    assert (ev.user_by_table, ev.user_by_fp, ev.user_walk_end) == (len(w.ips), 0, Counter.WALK_END)
    assert (ev.pid, ev.timestamp_ns, ev.kind) == (42, 123, abi.EventKind.ON_CPU)


def test_a_raw_record_without_tables_keeps_what_the_bpf_walk_found():
    case, stack = _recorded("python311")
    regs = case["regs"]
    copy = stack[regs["rsp"] - case["stack_base"] :]
    bpf_ips = [regs["rip"], 0x7F00_0000_1234]  # longer than a walk without any table gets
    record = _raw_record(42, (regs["rip"], regs["rsp"], regs["rbp"]), copy, bpf_ips)
    event, _ = walked_event(record, lambda ip, exact: NO_RULE)
    assert event == event_of(record)


def test_copies_are_held_within_their_bounds_and_released_counted():
    held = RawStacks(max_records=2, max_bytes=1 << 20)
    records = [_raw_record(pid, (START, BASE, 0), b"\0" * 64, [START]) for pid in (1, 1, 2)]
    assert [held.hold(r) for r in records] == [True, True, False]
    assert len(held) == 2 and held.held_pids() == {1} and held.stats.dropped == 1
    assert held.take(1) == records[:2] and len(held) == 0
    held.hold(records[2])
    assert held.release() == [event_of(records[2])]
    assert held.stats.unwalked == 1 and len(held) == 0
    assert struct.unpack_from("<I", event_of(records[2]), abi.StackEvent.pid.offset)[0] == 2


def test_an_ending_session_releases_the_copies_of_its_processes_only():
    held = RawStacks(max_records=8, max_bytes=1 << 20)
    records = [_raw_record(pid, (START, BASE, 0), b"\0" * 64, [START]) for pid in (1, 2, 2)]
    for r in records:
        held.hold(r)
    assert held.nbytes == sum(map(len, records))
    assert held.release([2, 3]) == [event_of(r) for r in records[1:]]
    assert held.held_pids() == {1} and held.nbytes == len(records[0]) and held.stats.unwalked == 2


def test_the_ring_thread_holds_copies_only_while_their_process_asks_for_them():
    """The agent's sessions: copies held while a session waits for their tables; released as they
    came when it ends; a straggler sent after that (already in the ring) goes on at once, counted,
    instead of sitting in the bounds for the agent's life. No BPF: the ring thread's handler fed."""
    from bistouri.capture.profiler import Profiler, ProfilerOptions

    p = Profiler(ProfilerOptions(proc_root="/nonexistent-proc", raw_stacks=True, raw_held_records=4))
    copy = _raw_record(7, (START, BASE, 0), b"\0" * 64, [START])
    p._raw_filters[7] = abi.FilterFlags.ON_CPU | abi.FilterFlags.RAW_STACK  # set_pid_filter's, in a session
    p._on_raw_stack(copy)
    assert len(p.raw) == 1 and not p._batch
    p._walk_raw(final=False, release={7})  # the session ends (catch_up)
    del p._raw_filters[7]  # ... and its filter value no longer asks
    p._on_raw_stack(copy)
    assert len(p.raw) == 0 and [s.pid for s in p._batch] == [7, 7]
    assert p.raw.stats.received == 2 and p.raw.stats.unwalked == 2 and p.raw.stats.dropped == 0
