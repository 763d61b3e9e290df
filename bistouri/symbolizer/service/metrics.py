"""Prometheus metrics of the symbolizer service (`bistouri_symbolizer_` prefix).

Under gunicorn each worker counts in PROMETHEUS_MULTIPROC_DIR and /metrics sums
them; database gauges are read at scrape time because every worker and
instance shares the database.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from .store import Store

log = logging.getLogger(__name__)


class Metrics:
    """The service's metrics. In gunicorn's multi-process mode values live in PROMETHEUS_MULTIPROC_DIR."""

    def __init__(self, store: Callable[[], Store]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter("bistouri_symbolizer_" + name, doc, labels, registry=self.registry)

        self.http_requests = counter(
            "http_requests_total", "HTTP requests by route and status", "route", "code"
        )
        self.rejected = counter("requests_rejected_total", "Requests refused with a 4xx, by reason", "reason")
        self.abandoned = counter(
            "responses_abandoned_total", "Responses the client did not read in time, by reason", "reason"
        )
        self.received_bytes = counter("received_bytes_total", "Compressed bytes of accepted ingest bodies")
        self.ingested = counter("sessions_ingested_total", "Sessions symbolized and stored")
        self.duplicates = counter("sessions_duplicate_total", "Sessions received again, not stored twice")
        self.sessions_rejected = counter(
            "sessions_rejected_total", "Sessions refused in a batch, by reason", "reason"
        )
        self.sessions_failed = counter(
            "sessions_failed_total",
            "Sessions not stored because of a failure on the server's side (sent again later), by reason",
            "reason",
        )
        self.resymbolized = counter(
            "sessions_resymbolized_total", "Sessions symbolized again for late kallsyms"
        )
        self.expired = counter("sessions_expired_total", "Sessions deleted by retention, by reason", "reason")
        self.kernel_uploads = counter("kernel_uploads_total", "kallsyms snapshots uploaded")
        self.uploads = counter("uploads_total", "ELF files agents uploaded and kept, by kind", "kind")
        self.uploaded_bytes = counter("uploaded_bytes_total", "Uncompressed bytes of the ELF files kept")
        self.uploads_refused = counter(
            "uploads_refused_total", "ELF uploads refused (nothing kept), by reason", "reason"
        )
        self.uploads_evicted = counter(
            "uploads_evicted_total",
            "Uploaded files deleted, by reason (quota: room for a new one; age, size: retention)",
            "reason",
        )
        self.kernel_uploads_refused = counter(
            "kernel_uploads_refused_total",
            "kallsyms snapshots refused (nothing kept), by reason (conflict: another kernel under its key)",
            "reason",
        )
        self.reads_truncated = counter(
            "reads_truncated_total",
            "Read answers cut at a bound (sessions left out of a merge, tree nodes), by reason",
            "reason",
        )
        self.frames = counter("frames_total", "Distinct frames symbolized, by kind", "kind")
        self.stored_bytes = counter("stored_bytes_total", "Compressed bytes written to the database")
        # Forwarding (exports.py); `exporter` is otlp or pyroscope.
        self.exports_sent = counter(
            "exports_sent_total", "Sessions an export endpoint accepted, by exporter", "exporter"
        )
        self.exported_bytes = counter(
            "exported_bytes_total", "Bytes of the payloads export endpoints accepted, by exporter", "exporter"
        )
        self.exports_failed = counter(
            "exports_failed_total",
            "Sends that failed (retried, or dropped when refused), by exporter and reason",
            "exporter",
            "reason",
        )
        self.exports_dropped = counter(
            "exports_dropped_total",
            "Sessions that will not be sent, by exporter and reason (queue_full, expired, refused, "
            "session_gone, encode_failed, endpoint_removed)",
            "exporter",
            "reason",
        )
        self.export_latency = Histogram(
            "bistouri_symbolizer_export_duration_seconds",
            "Time an export endpoint took to accept one session",
            ["exporter"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.latency = Histogram(
            "bistouri_symbolizer_symbolize_duration_seconds",
            "Time to symbolize one session",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self._store = store
        self.exporters: tuple[str, ...] = ()  # the kinds configured: their backlog is read at scrape time

    def exposition(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import GaugeMetricFamily

        registry: Any
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        text = generate_latest(registry)
        # Database size is read at scrape time: it is shared by every worker and instance.
        try:
            n, used = self._store().stats()
            backlog = self._store().export_backlog() if self.exporters else {}
        except Exception as e:
            log.warning("cannot read database stats for /metrics. error=%s", e)
            return text
        # The export backlog by exporter, every configured one (zero when empty).
        queued = {kind: [0, 0, 0] for kind in self.exporters}
        now = time.time_ns()
        for key, b in backlog.items():
            q = queued.setdefault(key.split(" ", 1)[0], [0, 0, 0])
            q[0] += b.rows
            q[1] += b.bytes
            q[2] = max(q[2], now - b.oldest_ns if b.rows else 0)
        extra = CollectorRegistry()

        class _Db:
            def collect(self) -> Iterable[Any]:
                yield GaugeMetricFamily(
                    "bistouri_symbolizer_db_sessions", "Sessions in the database", value=n
                )
                yield GaugeMetricFamily(
                    "bistouri_symbolizer_db_bytes", "Compressed session bytes in the database", value=used
                )
                yield from self._backlog()

            def _backlog(self) -> Iterable[Any]:
                rows = GaugeMetricFamily(
                    "bistouri_symbolizer_export_queue_sessions",
                    "Sessions waiting to be sent, by exporter",
                    labels=["exporter"],
                )
                size = GaugeMetricFamily(
                    "bistouri_symbolizer_export_queue_bytes",
                    "Stored bytes of the sessions waiting to be sent, by exporter",
                    labels=["exporter"],
                )
                age = GaugeMetricFamily(
                    "bistouri_symbolizer_export_queue_oldest_seconds",
                    "Age of the oldest session waiting to be sent, by exporter (0: none waits)",
                    labels=["exporter"],
                )
                for kind, (r, b, a) in sorted(queued.items()):
                    rows.add_metric([kind], r)
                    size.add_metric([kind], b)
                    age.add_metric([kind], a / 1e9)
                return [rows, size, age] if queued else []

        extra.register(_Db())
        return text + generate_latest(extra)
