"""Prometheus `/metrics` for a mount (``kvfs mount ... --metrics-port PORT``).

State is read from a snapshot of the daemon's report that the event loop refreshes every
second: the HTTP server runs on its own thread and must never walk structures the loop is
changing. Request latencies are observed as they happen (prometheus-client is thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import trio
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

T = TypeVar("T")

# The FUSE operations whose latency is worth a histogram (the data path and the namespace).
TIMED_OPERATIONS = (
    "lookup",
    "getattr",
    "create",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "rename",
    "unlink",
    "mkdir",
    "statfs",
    "getxattr",
    "setxattr",
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.snapshot: dict[str, Any] = {}
        self.latency = Histogram(
            "kvfs_operation_duration_seconds",
            "Time to answer a FUSE request, by operation",
            ["operation"],
            registry=self.registry,
            buckets=(
                1e-5,
                5e-5,
                1e-4,
                2.5e-4,
                5e-4,
                1e-3,
                2.5e-3,
                5e-3,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
            ),
        )
        self.registry.register(_SnapshotCollector(self))

    def serve(self, port: int, address: str) -> None:
        """Listen on ``address`` (--metrics-address: loopback unless the operator says
        otherwise, since /metrics names every model namespace on the mount)."""
        start_http_server(port, addr=address, registry=self.registry)

    async def refresh_forever(self, report: Callable[[], dict[str, Any]]) -> None:
        """Keep the snapshot fresh, from the event loop (the HTTP thread must not walk the
        live index)."""
        while True:
            self.snapshot = report()
            await trio.sleep(1)

    def timed(self, name: str, handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """The handler, its latency observed if it is one of TIMED_OPERATIONS."""
        if name not in TIMED_OPERATIONS:
            return handler
        observe = self.latency.labels(name).observe

        @wraps(handler)
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            start = time.perf_counter()
            try:
                return await handler(*args, **kwargs)
            finally:
                observe(time.perf_counter() - start)

        return wrapper


class _SnapshotCollector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._metrics.snapshot
        if not s:
            return
        yield _gauge("kvfs_capacity_bytes", "Bytes the tier may hold", s["capacity"])
        yield _gauge("kvfs_used_bytes", "Bytes held (file sizes in 4 KiB blocks)", s["used"])
        yield _gauge("kvfs_chunks", "Files in the tier", s["files"])
        yield _gauge(
            "kvfs_write_buffer_bytes",
            "Memory held by files being written",
            s["write_buffer"]["used"],
        )
        counters = s["counters"]
        yield _counter("kvfs_reads", "Files opened for reading", counters.get("reads", 0))
        yield _counter(
            "kvfs_read_bytes",
            "Bytes read from the backing store and verified",
            counters.get("bytes_read", 0),
        )
        yield _counter(
            "kvfs_publishes", "Files published (written whole)", counters.get("publishes", 0)
        )
        yield _counter("kvfs_written_bytes", "Bytes published", counters.get("bytes_written", 0))
        lookups = CounterMetricFamily(
            "kvfs_lookups",
            "Chunks opened for reading (hit), lookups of chunk names no store followed (miss)",
            labels=["result"],
        )
        for result in ("hit", "miss"):
            lookups.add_metric([result], s["lookups"][result])
        yield lookups
        evictions = CounterMetricFamily(
            "kvfs_evictions", "Files evicted, by reason", labels=["reason"]
        )
        for reason in ("capacity", "watermark", "disk full", "request"):
            evictions.add_metric([reason], s["evictions"].get(reason, 0))
        yield evictions
        yield _counter(
            "kvfs_checksum_failures",
            "Reads that failed their checksum (the file was quarantined)",
            s["checksum_failures"],
        )
        yield _counter(
            "kvfs_deadline_expiries",
            "Requests failed with EIO after --io-timeout",
            s["deadline_expiries"],
        )
        scrub = s["scrub"]
        yield _counter("kvfs_scrub_files", "Files the background scrub checked", scrub["files"])
        yield _counter("kvfs_scrub_bytes", "Bytes the background scrub checked", scrub["bytes"])
        yield _counter("kvfs_scrub_passes", "Complete passes of the scrub", scrub["passes"])
        yield _counter(
            "kvfs_scrub_failures",
            "Files the scrub found corrupt (each was quarantined)",
            scrub["failures"],
        )
        depth = GaugeMetricFamily(
            "kvfs_queue_depth", "Backing-store jobs waiting, per queue", labels=["queue"]
        )
        running = GaugeMetricFamily(
            "kvfs_queue_running", "Backing-store jobs running", labels=["queue"]
        )
        for queue, state in s["queues"].items():
            depth.add_metric([queue], state["waiting"])
            running.add_metric([queue], state["running"])
        yield depth
        yield running
        ns_chunks = GaugeMetricFamily(
            "kvfs_namespace_chunks", "Chunks per namespace", labels=["namespace", "model"]
        )
        ns_bytes = GaugeMetricFamily(
            "kvfs_namespace_bytes", "Bytes per namespace", labels=["namespace", "model"]
        )
        for ns in s["namespaces"]:
            labels = [ns["namespace"], ns["model"] or ""]
            ns_chunks.add_metric(labels, ns["chunks"])
            ns_bytes.add_metric(labels, ns["bytes"])
        yield ns_chunks
        yield ns_bytes


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
