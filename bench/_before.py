"""An earlier commit of this repository, as its own tree: what `--before` in the benches measures.

Each commit runs its own Python against its own BPF object: an object is built by the commit's own
Makefile (`make -s bpf`: its sources, its vmlinux.h, its flags), since the object's ABI (maps, struct
layouts) changes with the Python that reads it. The built objects are kept under
.cache/before/COMMIT, so a second run of a bench does not rebuild them.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache/before"
OBJECTS = "bistouri/bpf/_bpfobj"  # where the Makefile puts the objects, in every version so far


def commit_of(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def extract(commit: str, into: Path) -> None:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def built_objects(commit: str) -> Path:
    """The BPF objects of `commit`, built once by its own Makefile in a scratch tree."""
    cached = CACHE / commit
    if (cached / "bistouri.bpf.o").exists():
        return cached
    with tempfile.TemporaryDirectory(prefix="bistouri-before-build-") as d:
        tree = Path(d) / "tree"
        extract(commit, tree)
        # Its own deps-demo stamp (an apt check that installs nothing when the packages are there).
        subprocess.run(["make", "-s", "-C", str(tree), "bpf"], check=True)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(commit + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(tree / OBJECTS, partial)
        partial.rename(cached)  # whole or absent: a build killed halfway is not taken for one
    return cached


def before_tree(ref: str, work: Path) -> Path:
    """Commit `ref` extracted under `work` (removed with it), its own BPF objects in its package."""
    commit = commit_of(ref)
    tree = work / f"before-{commit[:12]}"
    extract(commit, tree)
    shutil.copytree(built_objects(commit), tree / OBJECTS, dirs_exist_ok=True)
    return tree
