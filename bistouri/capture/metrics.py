"""What the capture layer counts: sessions, samples, traces and the flight recorder's memory.

Declared here, below the agent, so that sessions.py needs no agent module; the agent's metrics
(agent/metrics.py) extend this class with their own, and `bistouri record` counts nothing
(bistouri.discard). docs/metrics.csv is the catalogue.
"""

from __future__ import annotations

# Not at the top: prometheus_client is ~75 modules and ~5.6 MB of RSS that `record`, which keeps
# no metric, need not import while it captures.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


class CaptureMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r = registry
        self.sessions_started = Counter(
            "bistouri_sessions_started_total",
            "Capture sessions opened, by PSI resource",
            ["resource"],
            registry=r,
        )
        self.sessions_completed = Counter(
            "bistouri_sessions_completed_total",
            "Sessions finished with samples and spooled",
            ["resource"],
            registry=r,
        )
        self.sessions_empty = Counter(
            "bistouri_sessions_empty_total", "Sessions finished without any sample", ["resource"], registry=r
        )
        self.sessions_dropped = Counter(
            "bistouri_sessions_dropped_total",
            "Sessions not started or lost, by reason",
            ["reason"],
            registry=r,
        )
        self.sessions_active = Gauge("bistouri_sessions_active", "Capture sessions running now", registry=r)
        self.samples = Counter(
            "bistouri_samples_total", "Stack samples aggregated into sessions, by kind", ["kind"], registry=r
        )
        self.samples_unmatched = Counter(
            "bistouri_samples_unmatched_total", "Samples of a process with no running session", registry=r
        )
        self.user_frames = Counter(
            "bistouri_user_frames_total",
            "User frames by class (resolved, vdso, jit, python, python_unspliced; unmapped by reason: "
            "jit_unnamed, no_mapping, process_gone, no_access, corrupted)",
            ["kind"],
            registry=r,
        )
        self.traces_dropped = Counter(
            "bistouri_traces_dropped_total",
            "Distinct stacks not held, by reason (session_full, memory)",
            ["reason"],
            registry=r,
        )
        self.capture_bytes = Gauge(
            "bistouri_capture_bytes",
            "Estimated memory held by the stacks of running sessions (bound: --capture-max-bytes)",
            registry=r,
        )
        self.recorder_bytes = Gauge(
            "bistouri_recorder_bytes",
            "Estimated memory held by the flight recorder's samples (bound: --recorder-max-bytes)",
            registry=r,
        )
        self.recorder_dropped = Counter(
            "bistouri_recorder_dropped_total",
            "Flight-recorder samples let go early (memory) or processes not recorded (filter_full)",
            ["reason"],
            registry=r,
        )
        self.session_samples = Histogram(
            "bistouri_session_samples",
            "Samples per finished session",
            buckets=(1, 10, 50, 100, 500, 1000, 5000, 20000),
            registry=r,
        )
