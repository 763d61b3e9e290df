"""Exception types. Every error a user can see says what failed, why, and what to do."""

from __future__ import annotations

import errno as _errno
import os


class BistouriError(Exception):
    """Base of every error bistouri raises on purpose."""


class BpfError(BistouriError, OSError):
    """A libbpf or bpf(2) operation failed.

    Carries the operation, the errno and, for a failed load, the verifier log.
    """

    def __init__(self, op: str, err: int, log: str = "", hint: str = "") -> None:
        self.op = op
        self.log = log
        self.hint = hint
        text = f"{op} failed: {os.strerror(err)} ({_errno.errorcode.get(err, err)})"
        if hint:
            text += f". {hint}"
        OSError.__init__(self, err, text)

    def __str__(self) -> str:
        text = str(self.strerror)
        if self.log:
            tail = "\n".join(self.log.rstrip().splitlines()[-40:])
            text += f"\n--- libbpf/verifier log (last lines) ---\n{tail}"
        return text


class ConfigError(BistouriError):
    """A configuration is invalid. Holds every problem found, as `path: problem`."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid configuration{f' in {source}' if source else ''}"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


class WireError(BistouriError):
    """A session payload cannot be decoded: malformed, wrong version or too large."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


class GzipError(BistouriError, ValueError):
    """A gzip body cannot be inflated: damaged, truncated, or with data after its one member.

    The message is a predicate for the caller to give a subject: f"the snapshot {e}"."""


class GzipTooLarge(GzipError):
    """A gzip body inflates to more than its bound (a gzip bomb, or only too large)."""
