"""The session wire format: what the agent spools and sends, what the symbolizer ingests.

A session is one msgpack map, dictionary-encoded so that a repeated stack costs
a few bytes: build ids, kernel IPs, user frames and stacks each live once in a
table, and traces point into them by index. A request carries several sessions
(`encode_batch`), gzip-compressed by the transport. docs/wire-format.md is the
reference; tests/golden holds byte-exact examples.

The values (`model`), packing (`encode`), unpacking with validation (`decode`) and the framing
of a session on disk (`files`) are pure functions: no I/O, no clocks. This package imports
nothing of bistouri but `errors` and `pressure` (tests/unit/test_layers.py); `snapshot` holds the
kernel snapshots' digest both ends compute. Its names are re-exported here: `wire.Session`.

The codecs (`decode`, `encode`, `files`, and msgpack with them) are imported at their first name's
use: `bistouri record` builds sessions but never packs or unpacks one, and they were ~4 ms of its
start.
"""

from __future__ import annotations

from ..pressure import RESOURCES, STALLS  # the trigger's vocabulary, validated by the decoder
from .model import (
    BATCH_VERSION,
    FRAME_JIT,
    FRAME_KINDS,
    FRAME_PYTHON,
    FRAME_RESOLVED,
    FRAME_UNKNOWN,
    FRAME_VDSO,
    MAX_AGGRESSORS,
    MAX_ARRAY_LEN,
    MAX_BATCH_OBJECTS,
    MAX_BIN_LEN,
    MAX_CGROUP_CHARS,
    MAX_COMM_CHARS,
    MAX_CONTAINER_ID_CHARS,
    MAX_FRAMES_PER_REQUEST,
    MAX_JIT_NAME_CHARS,
    MAX_KERNEL_FRAMES,
    MAX_LABEL_KEY_CHARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    MAX_MAP_LEN,
    MAX_MAPPING_NAME_CHARS,
    MAX_NAME_CHARS,
    MAX_POD_CHARS,
    MAX_PY_FILE_CHARS,
    MAX_PY_LINE,
    MAX_PY_NAME_CHARS,
    MAX_PY_NOTE_KEYS,
    MAX_RELEASE_CHARS,
    MAX_RUNTIME_CHARS,
    MAX_SESSION_ID_CHARS,
    MAX_SESSION_OBJECTS,
    MAX_SESSIONS_PER_BATCH,
    MAX_STACK_ENTRIES_PER_REQUEST,
    MAX_STACKS_PER_REQUEST,
    MAX_STR_BYTES,
    MAX_U64,
    MAX_UNIT_CHARS,
    MAX_USER_FRAMES,
    MAX_VICTIMS,
    READABLE_VERSIONS,
    RUNTIMES,
    TRIGGER_KINDS,
    TRIGGER_MANUAL,
    TRIGGER_PSI,
    VERSION,
    VERSION_WITHOUT_PYTHON,
    WAIT_D,
    WAIT_NAMES,
    WAIT_RECLAIM,
    WAIT_RUNQUEUE,
    WAIT_S,
    WAIT_STATES,
    Aggressor,
    Container,
    Episode,
    KernelInfo,
    PressureEvent,
    Session,
    Trace,
    Trigger,
    UnwindSummary,
    UserFrame,
    Victim,
)

# Not `typing.TYPE_CHECKING` (compat.py says why): the codecs' names, for type checkers and readers.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .decode import (
        decode_batch,
        decode_session,
        session_from_wire,
    )
    from .encode import (
        count_objects,
        encode_batch,
        encode_session,
        encode_session_to_fit,
        session_to_wire,
        work_of,
    )
    from .files import (
        FILE_HEADER,
        FILE_HEADER_MAX,
        FILE_MAGIC,
        FILE_MAGIC_V1,
        SessionFile,
        frame_session,
        framed_kernel_build_id,
        is_framed,
        unframe_session,
    )

__all__ = [
    "BATCH_VERSION",
    "FILE_HEADER",
    "FILE_HEADER_MAX",
    "FILE_MAGIC",
    "FILE_MAGIC_V1",
    "FRAME_JIT",
    "FRAME_KINDS",
    "FRAME_PYTHON",
    "FRAME_RESOLVED",
    "FRAME_UNKNOWN",
    "FRAME_VDSO",
    "MAX_AGGRESSORS",
    "MAX_ARRAY_LEN",
    "MAX_BATCH_OBJECTS",
    "MAX_BIN_LEN",
    "MAX_CGROUP_CHARS",
    "MAX_COMM_CHARS",
    "MAX_CONTAINER_ID_CHARS",
    "MAX_FRAMES_PER_REQUEST",
    "MAX_JIT_NAME_CHARS",
    "MAX_KERNEL_FRAMES",
    "MAX_LABELS",
    "MAX_LABEL_KEY_CHARS",
    "MAX_LABEL_VALUE_CHARS",
    "MAX_MAPPING_NAME_CHARS",
    "MAX_MAP_LEN",
    "MAX_NAME_CHARS",
    "MAX_POD_CHARS",
    "MAX_PY_FILE_CHARS",
    "MAX_PY_LINE",
    "MAX_PY_NAME_CHARS",
    "MAX_PY_NOTE_KEYS",
    "MAX_RELEASE_CHARS",
    "MAX_RUNTIME_CHARS",
    "MAX_SESSIONS_PER_BATCH",
    "MAX_SESSION_ID_CHARS",
    "MAX_SESSION_OBJECTS",
    "MAX_STACKS_PER_REQUEST",
    "MAX_STACK_ENTRIES_PER_REQUEST",
    "MAX_STR_BYTES",
    "MAX_U64",
    "MAX_UNIT_CHARS",
    "MAX_USER_FRAMES",
    "MAX_VICTIMS",
    "READABLE_VERSIONS",
    "RESOURCES",
    "RUNTIMES",
    "STALLS",
    "TRIGGER_KINDS",
    "TRIGGER_MANUAL",
    "TRIGGER_PSI",
    "VERSION",
    "VERSION_WITHOUT_PYTHON",
    "WAIT_D",
    "WAIT_NAMES",
    "WAIT_RECLAIM",
    "WAIT_RUNQUEUE",
    "WAIT_S",
    "WAIT_STATES",
    "Aggressor",
    "Container",
    "Episode",
    "KernelInfo",
    "PressureEvent",
    "Session",
    "SessionFile",
    "Trace",
    "Trigger",
    "UnwindSummary",
    "UserFrame",
    "Victim",
    "count_objects",
    "decode_batch",
    "decode_session",
    "encode_batch",
    "encode_session",
    "encode_session_to_fit",
    "frame_session",
    "framed_kernel_build_id",
    "is_framed",
    "session_from_wire",
    "session_to_wire",
    "unframe_session",
    "work_of",
]

# What `__getattr__` imports at a codec name's first use: its module (the imports above, at run time).
_CODECS = {
    **dict.fromkeys(("decode_batch", "decode_session", "session_from_wire"), "decode"),
    **dict.fromkeys(
        (
            "count_objects",
            "encode_batch",
            "encode_session",
            "encode_session_to_fit",
            "session_to_wire",
            "work_of",
        ),
        "encode",
    ),
    **dict.fromkeys(
        (
            "FILE_HEADER",
            "FILE_HEADER_MAX",
            "FILE_MAGIC",
            "FILE_MAGIC_V1",
            "SessionFile",
            "frame_session",
            "framed_kernel_build_id",
            "is_framed",
            "unframe_session",
        ),
        "files",
    ),
}


def __getattr__(name: str) -> object:
    """A codec's name (PEP 562: called only for a name the package does not hold yet)."""
    module = _CODECS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # held from now on: the next use is a plain attribute
    return value
