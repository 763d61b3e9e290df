"""The digest of a kernel snapshot's loaded code, computed alike by the agent and the symbolizer.

The agent sends /proc/kallsyms once per kernel build id; the symbolizer answers a snapshot check with the
digest of the one it holds (`loaded_code`, docs/api.md). Both sides compute it here, so they agree.
"""

from __future__ import annotations

from ..sha import sha256


class LoadedCodeDigest:
    """A digest of the kallsyms lines of modules and BPF programs (those tagged `[name]`, listed after the
    kernel's own). It changes when one is loaded or unloaded: the agent then uploads its snapshot again,
    and the symbolizer reports the digest of the snapshot it holds. Fed whole lines, in any slices."""

    __slots__ = ("_hash", "_started")

    def __init__(self) -> None:
        self._hash = sha256()
        self._started = False

    def feed(self, lines: bytes) -> None:
        if not self._started:
            i = lines.find(b"\t[")
            if i < 0:
                return
            self._started = True
            lines = lines[lines.rfind(b"\n", 0, i) + 1 :]
        self._hash.update(lines)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]


def loaded_code_digest(kallsyms: bytes) -> str:
    """The LoadedCodeDigest of a whole /proc/kallsyms text."""
    digest = LoadedCodeDigest()
    digest.feed(kallsyms)
    return digest.hexdigest()
