#!/usr/bin/python3
"""How whole the stacks of folded text (stdin: "frame;frame;... count" lines) are, as JSON.

A whole stack starts at the program's entry (_start, then libc's start functions and main: at
least MIN_WHOLE user frames). Debian's binaries are stripped, so _start has no name of its own
("<binary or build id>+0x..."): the entry is taken as the most common outermost frame of the
stacks that deep. Run in the VM by the molecule verify playbooks (python3 only).
"""

import json
import sys

MIN_WHOLE = 3

rows = []
for line in sys.stdin.read().splitlines():
    stack, _, count = line.rpartition(" ")
    if stack:
        user = [f for f in stack.split(";") if not f.endswith("_[k]")]
        rows.append((user, int(count)))
samples = sum(n for _, n in rows)
with_user = sum(n for user, n in rows if user)
roots: dict[str, int] = {}
for user, n in rows:
    if len(user) >= MIN_WHOLE:
        roots[user[0]] = roots.get(user[0], 0) + n
entry, whole = max(roots.items(), key=lambda kv: kv[1], default=("", 0))
json.dump(
    {
        "samples": samples,
        "entry": entry,
        "whole_share": round(whole / max(with_user, 1), 4),
        "user_frames_per_sample": round(sum(len(u) * n for u, n in rows) / max(samples, 1), 1),
        "kernel_only": samples - with_user,
    },
    sys.stdout,
)
