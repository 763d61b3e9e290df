"""The debug info a host already has, as perf and gdb find it: `/usr/lib/debug` (its `.build-id`
tree and its path mirror) and the debuginfod servers of `$DEBUGINFOD_URLS`.

`bistouri record` reads them unless told not to (`--no-host-debuginfo`); `bistouri check` says
which of them this host has. Pure: paths and the environment are arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..elf import HOST_DEBUG_DIR, ElfFile, ElfFormatError

MAX_COUNTED = 100_000  # .build-id entries counted for `check` (Debian's whole -dbgsym set is less)


def mirror_debug_file(
    path: str, file_id: bytes, debuglink: str | None, root: str = HOST_DEBUG_DIR
) -> str | None:
    """The debug file of the binary at `path` in the path mirror (`root/<dir>/<debuglink>`, else
    `root/<path>.debug`), if there is one and it carries the binary's id; else None."""
    if not path.startswith("/") or not os.path.isdir(root):
        return None
    where = os.path.dirname(path)
    names = [os.path.basename(debuglink)] if debuglink else []
    names.append(os.path.basename(path) + ".debug")
    for name in names:
        cand = os.path.join(root + where, name)
        try:
            with ElfFile(cand) as f:
                if f.file_id == file_id:
                    return cand
        except ElfFormatError:
            continue
    return None


def count_build_ids(root: str = HOST_DEBUG_DIR) -> int:
    """How many debug files `root/.build-id` holds (at most MAX_COUNTED)."""
    n = 0
    try:
        with os.scandir(os.path.join(root, ".build-id")) as top:
            for d in top:
                if len(d.name) != 2 or not d.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(d.path) as sub:
                    n += sum(1 for e in sub if e.name.endswith(".debug"))
                if n >= MAX_COUNTED:
                    return MAX_COUNTED
    except OSError:
        return n
    return n


def describe(root: str = HOST_DEBUG_DIR, environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(name, what is there) of each debug source: for `bistouri check`."""
    out = []
    if os.path.isdir(root):
        n = count_build_ids(root)
        more = "+" if n >= MAX_COUNTED else ""
        out.append((root, f"{n}{more} debug files in {root}/.build-id (and the path mirror)"))
    else:
        out.append((root, "absent: install the -dbg/-dbgsym packages of what you profile"))
    urls = environ.get("DEBUGINFOD_URLS", "").split()  # the symbolizer's sources.py reads them
    out.append(("DEBUGINFOD_URLS", " ".join(urls) if urls else "unset: no debuginfod server is asked"))
    return out
