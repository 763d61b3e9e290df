"""Where ELF files come from, by build id.

`DebugSources.find(build_id, kind)` looks, in this order:

1. local `.build-id` trees (`--debug-dir`, repeatable): `xx/rest.debug` for
   debug info, `xx/rest` for the executable (the GDB / debuginfod layout);
2. directories of binaries (`--binary-dir`), indexed by build id and re-scanned
   when a directory changes;
3. the on-disk cache of debuginfod downloads (`<cache>/<hex>/debuginfo|executable`,
   the layout of the elfutils client);
4. debuginfod servers (`DEBUGINFOD_URLS` semantics: several URLs separated by
   spaces, tried in order), with a negative cache so a missing build id is not
   asked for again before its TTL;
5. last, the files agents uploaded (uploads.py), of the tenant asked for only
   (`scope`): the operator's sources always win over an agent's upload.

Every file found is checked to carry the build id asked for. Lookups are
thread-safe and single-flight: concurrent requests for one build id wait for
the first instead of downloading twice.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .. import atomicfile
from ..compat import SLOTS
from ..discard import Discarded
from ..elf import ELF_MAGIC, read_build_id
from .tenants import TENANT_RE

# Imported when used: requests on the first download (~13 MB of RSS: urllib3, ssl,
# charset_normalizer), prometheus_client only with a registry (`record` passes none and keeps no
# metric: bistouri.discard).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import requests
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

DEBUGINFO = "debuginfo"
EXECUTABLE = "executable"
KINDS = (DEBUGINFO, EXECUTABLE)

DEFAULT_TIMEOUT_S = 30.0  # connect + between bytes; a 600 MB vmlinux streams for seconds
DEFAULT_MAX_DOWNLOAD = 4 << 30
DEFAULT_NEGATIVE_TTL_S = 600.0  # the elfutils client's cache_miss_s
DEFAULT_ERROR_TTL_S = 60.0  # after a transient error (timeout, 5xx)
DEFAULT_RESCAN_S = 30.0
DEFAULT_CACHE_MAX_BYTES = 20 << 30
_NEGATIVE_MAX = 100_000
_SCAN_MAX_FILES = 200_000
_BUILD_ID_RE = re.compile(r"[0-9a-f]{2,128}")


@dataclass(frozen=True, **SLOTS)
class Found:
    """A debug file found for a build id, and where it was found."""

    path: str
    source: str  # debug-dir | binary-dir | cache | debuginfod | upload


def check_build_id(build_id: bytes | str) -> str:
    """Lower-case hex of a build id; ValueError for anything that could escape a path."""
    hexid = build_id.hex() if isinstance(build_id, bytes) else build_id.lower()
    if not _BUILD_ID_RE.fullmatch(hexid) or len(hexid) % 2:
        raise ValueError(f"invalid build id {hexid[:140]!r}: expected 2-128 hex digits")
    return hexid


def urls_from_env(value: str | None = None) -> list[str]:
    """Server URLs from a `DEBUGINFOD_URLS`-style string (space separated)."""
    value = os.environ.get("DEBUGINFOD_URLS", "") if value is None else value
    return [u.rstrip("/") for u in value.split() if u.startswith(("http://", "https://"))]


class NegativeCache:
    """Build ids known to be absent, each until its own deadline. Bounded; thread-safe."""

    def __init__(self, max_entries: int = _NEGATIVE_MAX, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, key: tuple[str, str], ttl_s: float) -> None:
        with self._lock:
            self._entries[key] = self._clock() + ttl_s
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple):
            return False
        with self._lock:
            until = self._entries.get(key)
            if until is None:
                return False
            if self._clock() >= until:
                del self._entries[key]
                return False
            return True

    def __len__(self) -> int:
        return len(self._entries)


class BinaryDirIndex:
    """Build id → path for every ELF file under some directories, re-scanned when they change.

    A directory's mtime changes when entries are added, removed or renamed into
    it, which is how binaries get deployed; files seen before are not re-read
    unless their size or mtime changed.
    """

    def __init__(self, dirs: Sequence[str], rescan_s: float = DEFAULT_RESCAN_S) -> None:
        self.dirs = [os.path.abspath(d) for d in dirs]
        self.rescan_s = rescan_s
        self._by_id: dict[str, str] = {}
        self._seen: dict[str, tuple[int, int, str | None]] = {}  # path -> (size, mtime_ns, hex id)
        self._dir_mtimes: dict[str, int] = {}
        self._checked = -1e18
        self._lock = threading.Lock()

    def _dirs_changed(self) -> bool:
        for top in self.dirs:
            for root, dirnames, _files in os.walk(top):
                try:
                    m = os.stat(root).st_mtime_ns
                except OSError:
                    return True
                if self._dir_mtimes.get(root) != m:
                    return True
                if len(self._dir_mtimes) > _SCAN_MAX_FILES:
                    dirnames.clear()
        return not self._dir_mtimes and bool(self.dirs)

    def scan(self) -> None:
        by_id: dict[str, str] = {}
        seen: dict[str, tuple[int, int, str | None]] = {}
        mtimes: dict[str, int] = {}
        count = 0
        for top in self.dirs:
            for root, _dirs, files in os.walk(top):
                try:
                    mtimes[root] = os.stat(root).st_mtime_ns
                except OSError:
                    continue
                for name in files:
                    count += 1
                    if count > _SCAN_MAX_FILES:
                        log.warning(
                            "Binary directory scan stopped at %d files. dirs=%s", _SCAN_MAX_FILES, self.dirs
                        )
                        break
                    path = os.path.join(root, name)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    if not os.path.isfile(path) or st.st_size < 64:
                        continue
                    old = self._seen.get(path)
                    if old is not None and old[:2] == (st.st_size, st.st_mtime_ns):
                        hexid = old[2]
                    else:
                        hexid = self._read_id(path)
                    seen[path] = (st.st_size, st.st_mtime_ns, hexid)
                    if hexid is not None:
                        by_id.setdefault(hexid, path)
        self._by_id, self._seen, self._dir_mtimes = by_id, seen, mtimes

    @staticmethod
    def _read_id(path: str) -> str | None:
        try:
            with open(path, "rb") as f:
                if f.read(4) != ELF_MAGIC:
                    return None
        except OSError:
            return None
        bid = read_build_id(path)
        return bid.hex() if bid else None

    def get(self, hexid: str) -> str | None:
        with self._lock:
            path = self._by_id.get(hexid)
            now = time.monotonic()
            if path is None and now - self._checked >= self.rescan_s:
                self._checked = now
                if self._dirs_changed():
                    self.scan()
                path = self._by_id.get(hexid)
            return path

    def __len__(self) -> int:
        return len(self._by_id)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter

        self.found = Counter(
            "bistouri_symbolizer_sources_found_total",
            "ELF files found by build id, by source (debug_dir, binary_dir, cache, debuginfod, upload)",
            ["source"],
            registry=registry,
        )
        self.missing = Counter(
            "bistouri_symbolizer_sources_missing_total",
            "Build id lookups that found no file (negative cache hits included)",
            registry=registry,
        )
        self.fetch_errors = Counter(
            "bistouri_symbolizer_fetch_errors_total",
            "Failed debuginfod downloads, by reason (timeout, connection, http_5xx, http_other, "
            "too_large, bad_build_id, disk)",
            ["reason"],
            registry=registry,
        )
        self.fetched_bytes = Counter(
            "bistouri_symbolizer_fetched_bytes_total",
            "Bytes downloaded from debuginfod servers",
            registry=registry,
        )


class DebugSources:
    """Finds ELF files by build id in local trees, binary directories and debuginfod. Thread-safe."""

    def __init__(
        self,
        debug_dirs: Sequence[str] = (),
        binary_dirs: Sequence[str] = (),
        debuginfod_urls: Sequence[str] | None = None,
        cache_dir: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_download: int = DEFAULT_MAX_DOWNLOAD,
        negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        error_ttl_s: float = DEFAULT_ERROR_TTL_S,
        cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
        rescan_s: float = DEFAULT_RESCAN_S,
        registry: CollectorRegistry | None = None,
        session: requests.Session | None = None,
        uploads_dir: str | None = None,
    ) -> None:
        self.debug_dirs = [self._build_id_root(d) for d in debug_dirs]
        # <uploads_dir>/<tenant>/.build-id: each tenant's uploads (uploads.py), looked at last.
        self.uploads_dir = uploads_dir
        self.binaries = BinaryDirIndex(binary_dirs, rescan_s) if binary_dirs else None
        self.urls = list(
            urls_from_env() if debuginfod_urls is None else [u.rstrip("/") for u in debuginfod_urls]
        )
        if self.urls and not cache_dir:
            raise ValueError("debuginfod servers need a cache directory for downloads (cache_dir)")
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self.max_download = max_download
        self.negative_ttl_s = negative_ttl_s
        self.error_ttl_s = error_ttl_s
        self.cache_max_bytes = cache_max_bytes
        self.negative = NegativeCache()
        self.metrics = _Metrics(registry) if registry is not None else Discarded()
        self._http = session  # created on the first download (_session)
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], threading.Event] = {}
        self._cache_bytes = -1  # unknown until first download
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)

    @staticmethod
    def _build_id_root(d: str) -> str:
        # Accept both /usr/lib/debug and /usr/lib/debug/.build-id.
        d = os.path.abspath(d)
        return d if os.path.basename(d) == ".build-id" else os.path.join(d, ".build-id")

    def close(self) -> None:
        if self._http is not None:
            self._http.close()

    def _session(self) -> requests.Session:
        with self._lock:
            if self._http is None:
                import requests

                self._http = requests.Session()
            return self._http

    # --- lookup --------------------------------------------------------------

    def find(self, build_id: bytes | str, kind: str = DEBUGINFO, scope: str | None = None) -> Found | None:
        """A file with this build id: debug info (`debuginfo`) or the binary itself (`executable`).

        `scope` (a tenant's, tokens.upload_scope) adds that tenant's uploads, after every operator source.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        hexid = check_build_id(build_id)
        found = self._find_local(hexid, kind)
        if found is None and self.urls:
            found = self._find_remote(hexid, kind)
        if found is None and scope is not None:
            found = self._find_upload(hexid, kind, scope)
        if found is None:
            self.metrics.missing.inc()
        else:
            self.metrics.found.labels(found.source.replace("-", "_")).inc()
        return found

    def _valid(self, path: str, hexid: str) -> bool:
        bid = read_build_id(path)
        return bid is not None and bid.hex() == hexid

    def _find_local(self, hexid: str, kind: str) -> Found | None:
        for root in self.debug_dirs:
            base = os.path.join(root, hexid[:2], hexid[2:])
            path = base + ".debug" if kind == DEBUGINFO else base
            if os.path.isfile(path) and self._valid(path, hexid):
                return Found(path, "debug-dir")
        if self.binaries is not None:
            indexed = self.binaries.get(hexid)
            if indexed is not None and self._valid(indexed, hexid):
                return Found(indexed, "binary-dir")
        cached = self._cache_path(hexid, kind)
        if cached is not None and os.path.isfile(cached) and os.path.getsize(cached) > 0:
            try:
                os.utime(cached)  # recently used: evicted last
            except OSError:
                pass
            return Found(cached, "cache")
        return None

    def upload_path(self, hexid: str, kind: str, scope: str) -> str | None:
        """Where a tenant's upload of this build id would be (uploads.Uploads.path), None without uploads."""
        if self.uploads_dir is None or not TENANT_RE.fullmatch(scope):
            return None
        base = os.path.join(self.uploads_dir, scope, ".build-id", hexid[:2], hexid[2:])
        return base + ".debug" if kind == DEBUGINFO else base

    def has_upload(self, build_id: bytes | str, scope: str) -> bool:
        """Whether this tenant uploaded a file of this build id (a stat or two, no parsing)."""
        hexid = check_build_id(build_id)
        return any(os.path.isfile(p) for k in KINDS if (p := self.upload_path(hexid, k, scope)) is not None)

    def _find_upload(self, hexid: str, kind: str, scope: str) -> Found | None:
        path = self.upload_path(hexid, kind, scope)
        if path is not None and os.path.isfile(path) and self._valid(path, hexid):
            return Found(path, "upload")
        return None

    def _cache_path(self, hexid: str, kind: str) -> str | None:
        return os.path.join(self.cache_dir, hexid, kind) if self.cache_dir else None

    def _find_remote(self, hexid: str, kind: str) -> Found | None:
        key = (hexid, kind)
        if key in self.negative:
            return None
        with self._lock:
            ev = self._inflight.get(key)
            leader = ev is None
            if leader:
                ev = self._inflight[key] = threading.Event()
        assert ev is not None
        if not leader:
            ev.wait(self.timeout_s * (len(self.urls) + 1))
            return self._find_local(hexid, kind)
        try:
            # Another thread may have finished between our local miss and the lock.
            found = self._find_local(hexid, kind)
            if found is None and key not in self.negative:
                found = self._download(hexid, kind)
            return found
        finally:
            with self._lock:
                del self._inflight[key]
            ev.set()

    def _download(self, hexid: str, kind: str) -> Found | None:
        dest = self._cache_path(hexid, kind)
        assert dest is not None and self.cache_dir is not None
        ttl = self.negative_ttl_s
        for base in self.urls:
            url = f"{base}/buildid/{hexid}/{kind}"
            reason = self._fetch(url, dest, hexid)
            if reason is None:
                self._evict()
                return Found(dest, "debuginfod")
            if reason != "not_found":
                ttl = min(ttl, self.error_ttl_s)
        self.negative.add((hexid, kind), ttl)
        return None

    def _fetch(self, url: str, dest: str, hexid: str) -> str | None:
        """Download into the cache; None on success, else a reason."""
        import requests  # imported by _session already: its exceptions

        try:
            with self._session().get(url, stream=True, timeout=self.timeout_s) as r:
                if r.status_code == 404:
                    return "not_found"
                if r.status_code != 200:
                    reason = "http_5xx" if r.status_code >= 500 else "http_other"
                    log.warning("debuginfod refused a download. url=%s status=%d", url, r.status_code)
                    self.metrics.fetch_errors.labels(reason).inc()
                    return reason
                size = int(r.headers.get("Content-Length") or 0)
                if size > self.max_download:
                    self.metrics.fetch_errors.labels("too_large").inc()
                    log.warning(
                        "debuginfod file too large. url=%s bytes=%d limit=%d", url, size, self.max_download
                    )
                    return "too_large"
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                total = 0
                with atomicfile.replacing(dest) as out:  # a cache: not synced
                    for chunk in r.iter_content(1 << 20):
                        total += len(chunk)
                        if total > self.max_download:
                            out.discard()
                            self.metrics.fetch_errors.labels("too_large").inc()
                            log.warning("debuginfod download passed the size limit. url=%s", url)
                            return "too_large"
                        out.file.write(chunk)
                    self.metrics.fetched_bytes.inc(total)
                    out.finish()
                    if not self._valid(out.path, hexid):
                        out.discard()
                        self.metrics.fetch_errors.labels("bad_build_id").inc()
                        log.warning("debuginfod sent a file with another build id, or not ELF. url=%s", url)
                        return "bad_build_id"
            if self._cache_bytes >= 0:
                self._cache_bytes += total
            return None
        except requests.Timeout as e:
            self.metrics.fetch_errors.labels("timeout").inc()
            log.warning("debuginfod request timed out. url=%s error=%s", url, e)
            return "timeout"
        except requests.RequestException as e:
            self.metrics.fetch_errors.labels("connection").inc()
            log.warning("debuginfod request failed. url=%s error=%s", url, e)
            return "connection"
        except OSError as e:
            self.metrics.fetch_errors.labels("disk").inc()
            log.warning("Cannot write a debuginfod download to the cache. dest=%s error=%s", dest, e)
            return "disk"

    # --- cache size ------------------------------------------------------------

    def _evict(self) -> None:
        """Keep the download cache under its byte budget, least recently used first."""
        if not self.cache_dir or not self.cache_max_bytes:
            return
        with self._lock:
            if 0 <= self._cache_bytes <= self.cache_max_bytes:
                return
            files = list(_cache_files(self.cache_dir))
            total = sum(size for _, size, _ in files)
            files.sort(key=lambda f: f[2])
            for path, size, _ in files:
                if total <= self.cache_max_bytes:
                    break
                try:
                    os.unlink(path)
                    total -= size
                except OSError:
                    pass
            self._cache_bytes = total


def _cache_files(cache_dir: str) -> Iterable[tuple[str, int, float]]:
    with os.scandir(cache_dir) as entries:  # not pathlib: ~3.5 ms of record's imports
        dirs = [e.path for e in entries if e.is_dir()]
    for d in dirs:
        for kind in KINDS:
            f = os.path.join(d, kind)
            try:
                st = os.stat(f)
            except OSError:
                continue
            yield f, st.st_size, max(st.st_mtime, st.st_atime)
