"""What `bistouri record` reads and writes on disk: the output directory, and a .build-id
tree of the binaries its targets map (for the resolver).

Both are made safe to run as root in directories others can write: nothing is created
under a predictable name that an existing file or link could stand in for.
"""

from __future__ import annotations

import os
import time

from .. import atomicfile
from ..errors import BistouriError

# Not typing's: `record` imports this before its first sample (see command.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..host.procmaps import MappedPath


class OutputDir:
    """Where the outputs go (issue: a root `record` wrote into predictable paths, following links).

    Without `-o`, a new directory is made (never an existing one); with `-o`, an existing
    directory is used only because it was named. It is opened once (O_NOFOLLOW), and each
    file is written under a fresh name (O_EXCL) in it, then renamed over the final name: a
    symlink or hard link planted there is replaced, never written through.
    """

    def __init__(self, path: str, fd: int, created: bool) -> None:
        self.path = path
        self.fd = fd
        self.created = created
        self.written: list[str] = []

    @classmethod
    def open(cls, explicit: str | None) -> OutputDir:
        created = True
        if explicit is None:
            base = f"bistouri-record-{time.strftime('%Y%m%d-%H%M%S')}"
            for n in range(100):
                path = base if n == 0 else f"{base}.{n}"
                try:
                    os.mkdir(path, 0o755)
                    break
                except FileExistsError:
                    continue
                except OSError as e:
                    raise BistouriError(f"cannot create the output directory {path}: {e.strerror}")
            else:
                raise BistouriError(f"{base} and 99 like it exist already; name a new directory with -o")
        else:
            path = explicit
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                created = False
            except OSError as e:
                raise BistouriError(f"cannot create the output directory {path}: {e.strerror}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise BistouriError(
                f"cannot use {path} as the output directory: {e.strerror} "
                "(a symlink, or not a directory?); name another with -o"
            )
        return cls(path, fd, created)

    def write(self, name: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        # Outputs for the user: readable by others (0644), not synced (the run can be made again).
        atomicfile.write(name, raw, mode=0o644, dir_fd=self.fd)
        self.written.append(name)

    def close(self) -> None:
        """Close; a directory made by this run and left empty (the run failed) is removed."""
        if self.fd < 0:
            return
        if self.created and not self.written:
            try:
                os.rmdir(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = -1


class BuildIdTree:
    """A .build-id tree of links to the ELF files the targets map, for the resolver to read:
    the files are found while the processes live (a command that exited leaves no /proc)."""

    def __init__(self, proc_root: str, mirror: str | None = None) -> None:
        self.root = ""  # made at the first add(): not on the way to the first sample
        self.mirror = mirror  # a debug tree whose path mirror is looked at (/usr/lib/debug), or None
        self.proc_root = proc_root
        self._seen: set[tuple[int, int]] = set()  # (device, inode) of the files already looked at
        self._maps: dict[int, bytes] = {}

    def add(self, pids: list[int]) -> int:
        """Link the files mapped by `pids` not linked yet; returns how many were added."""
        from ..host.procmaps import MappedPath

        if not self.root:
            import tempfile

            self.root = tempfile.mkdtemp(prefix="bistouri-record-")  # 0700, a new name (not /tmp/...-<pid>)
        n = 0
        for pid in pids:
            try:
                with open(f"{self.proc_root}/{pid}/maps", "rb") as f:
                    maps = f.read()
            except OSError:
                continue
            if self._maps.get(pid) == maps:
                continue
            self._maps[pid] = maps
            for line in maps.splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) < 6 or b"x" not in parts[1] or not parts[5].startswith(b"/"):
                    continue
                name = os.fsdecode(parts[5]).removesuffix(" (deleted)")
                if self._link(MappedPath(f"{self.proc_root}/{pid}", parts[0].decode(), name)):
                    n += 1
        return n

    def _link(self, where: MappedPath) -> bool:
        """Link one mapped file, opened safely (the process may have put a FIFO or a symlink
        at its path): the link names the file the descriptor has open."""
        from ..elf import ElfFile, ElfFormatError
        from ..host import safeopen

        try:
            fd = where.open()
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in self._seen:
                return False
            self._seen.add((st.st_dev, st.st_ino))
            with ElfFile(safeopen.fd_path(fd)) as elf:
                bid, debuglink = elf.file_id, elf.debuglink
            target = os.readlink(safeopen.fd_path(fd))  # its path in our view, no link in it
        except (OSError, ElfFormatError):
            return False
        finally:
            os.close(fd)
        if not bid or not target.startswith("/") or target.endswith(" (deleted)"):
            return False
        hexid = bid.hex()
        link = os.path.join(self.root, ".build-id", hexid[:2], hexid[2:])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            return False
        os.symlink(target, link)
        if self.mirror is not None and not os.path.exists(
            os.path.join(self.mirror, ".build-id", hexid[:2], hexid[2:] + ".debug")
        ):
            from ..host.debuginfo import mirror_debug_file

            # Its debug file installed by path (`<mirror>/usr/bin/x.debug`), not by build id.
            debug = mirror_debug_file(target, bid, debuglink, self.mirror)
            if debug is not None:
                os.symlink(debug, link + ".debug")
        return True

    def remove(self) -> None:
        if self.root:
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)


def default_cache_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Where `record` keeps what it learnt between runs (symbols, unwind tables):
    $XDG_CACHE_HOME/bistouri, else ~/.cache/bistouri."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bistouri")
