"""A session's raw stacks → a profile's symbolized ones: the one stack assembler.

Both symbolizers name addresses their own way, the service's `Resolver` (debug files,
llvm-symbolizer, kallsyms snapshots) and `bistouri record` (its on-disk cache first,
record/symcache.py), and both build their profile here, so the two cannot drift: the same
root-first stacks, frame table, counts, off-CPU wait state and before-the-trigger mark.

    stacks = SessionStacks(session)
    # name every distinct frame of stacks.user[leaf] (by id) and stacks.kernel[leaf] (by ip)
    profile = stacks.profile(user_answers, kernel_answers)

Leaf matters: a return address (every frame but the leaf) is named at address - 1.
Imports only the wire and the model: a fully cached `record` run loads no more.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from .. import wire
from ..compat import zip_strict
from . import model

# One address's frames, root first (outer function, then what was inlined into it): rows, which the
# collector does not track (model.FrameRow), made Frames in the profile.
Frames = tuple[model.FrameRow, ...]
# [call site, leaf]: indexed by `leaf` (False 0, True 1).
ByLeaf = tuple[dict[int, Frames], dict[int, Frames]]


VDSO: model.FrameRow = ("[vdso]", "[vdso]", "", 0, model.KIND_VDSO, False)
JIT_MODULE = "[jit]"
PYTHON_MODULE = "[python]"


def label(f: wire.UserFrame) -> model.FrameRow:
    """A user frame named by what the agent sent alone, no file read: how a frame without a build id
    (a file's name and offset, the vDSO, JIT code, a Python function, an unknown address) is named."""
    if f.kind == wire.FRAME_RESOLVED and f.name:
        return (f"{f.name}+0x{f.address:x}", f.name, "", 0, model.KIND_USER, False)
    if f.kind == wire.FRAME_VDSO:
        return VDSO
    if f.kind == wire.FRAME_JIT:  # named by the process's perf map on the host: the name is the answer
        return (f.name, JIT_MODULE, "", 0, model.KIND_JIT, False)
    if f.kind == wire.FRAME_PYTHON:  # named while the process lived (wire v4): name, file and line
        return (f.name, PYTHON_MODULE, f.file, f.address, model.KIND_PYTHON, False)
    return (f"[unknown]+0x{f.address:x}", "", "", 0, model.KIND_UNKNOWN, False)


class SessionStacks:
    """The distinct frames of a session's stacks, to be named, then its profile.

    User frames are told apart by object (id): the wire decoder shares one object per
    distinct frame and one per distinct stack, so nothing is hashed on the hot path.
    Kernel frames are addresses. A session built in process (record's) shares nothing:
    each of its frames is its own entry, which costs a lookup, never a wrong answer.
    """

    __slots__ = ("distinct", "kernel", "session", "user")

    def __init__(self, session: wire.Session) -> None:
        self.session = session
        # [leaf]: id -> the user frame; ip -> None (kernel), in the order first met.
        self.user: tuple[dict[int, wire.UserFrame], dict[int, wire.UserFrame]] = ({}, {})
        self.kernel: tuple[dict[int, None], dict[int, None]] = ({}, {})
        self.distinct: list[wire.Trace] = []  # the first trace of each distinct stack
        seen: set[tuple[int, int]] = set()
        ucall, uleaf = self.user
        kcall, kleaf = self.kernel
        for t in session.traces:
            skey = (id(t.kernel), id(t.user))
            if skey in seen:
                continue
            seen.add(skey)
            self.distinct.append(t)
            user, kern = t.user, t.kernel
            if user:
                uleaf[id(user[0])] = user[0]
                callers = user[1:]
                ucall.update(zip_strict(map(id, callers), callers))
            if kern:
                kleaf[kern[0]] = None
                kcall.update(dict.fromkeys(kern[1:]))

    def profile(
        self, user: ByLeaf, kernel: ByLeaf, frame_of: Callable[[model.FrameRow], model.Frame] | None = None
    ) -> model.Profile:
        """The profile, from the frames of every entry of `user` and `kernel` (same keys).

        Equal rows must be one object (interned): a frame is indexed by id(). The frame table
        lists frames in the order first met from the root of the session's stacks, whatever
        order the answers came in. A row met becomes its Frame through `frame_of` (the resolver's,
        shared by its profiles: a cached session's frames are not made again), else a new one."""
        session = self.session
        Frame = frame_of or _new_frame
        frame_ids: dict[int, int] = {}
        frames_out: list[model.Frame] = []
        by_result: dict[int, tuple[int, ...]] = {}

        def indexes(frames: Frames) -> tuple[int, ...]:
            # Names-only answers are shared by every address of a function: their tuple is too.
            got = by_result.get(id(frames))
            if got is not None:
                return got
            out = []
            for f in frames:
                i = frame_ids.get(id(f))
                if i is None:
                    i = frame_ids[id(f)] = len(frames_out)
                    frames_out.append(Frame(f))
                out.append(i)
            got = by_result[id(frames)] = tuple(out)
            return got

        # Index tuples per distinct frame, made when first met (the order of the frame table).
        ucall, uleaf = (_Indexes(answers, indexes) for answers in user)
        kcall, kleaf = (_Indexes(answers, indexes) for answers in kernel)
        call_get, kcall_get = ucall.__getitem__, kcall.__getitem__
        stacks: dict[tuple[int, int], tuple[int, ...]] = {}
        for t in self.distinct:
            user_frames, kern = t.user, t.kernel
            # Root first: user frames from the root down, then kernel frames down to the leaf.
            # Slices [:0:-1] walk from the root to the frame above the leaf, in C.
            parts = list(chain.from_iterable(map(call_get, map(id, user_frames[:0:-1]))))
            if user_frames:
                parts.extend(uleaf[id(user_frames[0])])
            parts.extend(chain.from_iterable(map(kcall_get, kern[:0:-1])))
            if kern:
                parts.extend(kleaf[kern[0]])
            stacks[(id(kern), id(user_frames))] = tuple(parts)
        threads = session.threads
        samples = [
            model.Sample(
                stacks[(id(t.kernel), id(t.user))],
                t.pid,
                t.tid,
                threads.get(t.tid, ""),
                t.on_cpu,
                t.off_cpu,
                t.off_cpu_ns,
                t.pre_trigger,
                t.wait,
            )
            for t in session.traces
        ]
        return model.Profile(meta=model.SessionMeta.from_wire(session), frames=frames_out, samples=samples)


def _new_frame(row: model.FrameRow) -> model.Frame:
    return model.Frame(*row)


class _Indexes(dict[int, tuple[int, ...]]):
    """Key -> the index tuple of its answer, made on first use (a lookup stays a C call)."""

    __slots__ = ("answers", "indexes")

    def __init__(self, answers: dict[int, Frames], indexes: Callable[[Frames], tuple[int, ...]]) -> None:
        super().__init__()
        self.answers = answers
        self.indexes = indexes

    def __missing__(self, key: int) -> tuple[int, ...]:
        got = self[key] = self.indexes(self.answers[key])
        return got
