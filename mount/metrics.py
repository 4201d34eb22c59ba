"""Prometheus `/metrics` for a mount (``kvfs mount ... --metrics-port PORT``).

Every scrape shows the daemon as it is at that moment. The HTTP server runs on its own thread
and must never walk structures the event loop is changing, so it asks the loop for the daemon's
report (``Metrics.current``: one call between two requests, no lock anywhere on the data path)
and builds the metric families from it on its own thread; the backing filesystem's free space
it asks the kernel itself (statvfs), off the loop. Request latencies are observed as they
happen, on the event loop (``Latencies``).

Label values are fixed, snake_case words (``reason="disk_full"``), except the namespace and
model names, which are the directories' and the config's own.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import platform
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from functools import wraps
from typing import Any, TypeVar

import trio
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvfs import __version__
from kvfs.control_protocol import Report
from kvfs.mount.bridge import NeedsIO
from kvfs.mount.eviction import EvictionReason
from kvfs.mount.objects import PublishFailure

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long a scrape waits for the event loop to answer. A loop that does not answer within it is
# stuck (the log says so): the scrape gets the last report, not a hang.
LOOP_ANSWER_SECONDS = 5.0

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
        self._report: Callable[[], Report] | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._last: Report | None = None  # the last report a scrape got
        self.latency = Latencies(TIMED_OPERATIONS)
        self.registry.register(self.latency)
        self.registry.register(_ReportCollector(self))

    def serve(self, port: int, address: str) -> None:
        """Listen on ``address`` (--metrics-address: loopback unless the operator says
        otherwise, since /metrics names every model namespace on the mount)."""
        start_http_server(port, addr=address, registry=self.registry)

    async def refresh_forever(self, report: Callable[[], Report]) -> None:
        """From now until the event loop ends, answer each scrape with ``report()`` as the
        loop computes it at that moment (called on the loop; nothing runs on a timer)."""
        self._report = report
        self._token = trio.lowlevel.current_trio_token()
        try:
            await trio.sleep_forever()
        finally:
            self._token = None

    def current(self) -> Report | None:
        """The daemon's report now, computed on the event loop (called from a scrape's
        thread); None before the loop serves. If the loop does not answer within
        LOOP_ANSWER_SECONDS, the last report a scrape got."""
        token, report = self._token, self._report
        if token is None or report is None:
            return self._last
        answered = threading.Event()
        answer: list[Report] = []

        def on_the_loop() -> None:  # must not raise: trio would end the loop
            try:
                answer.append(report())
            except Exception:
                log.exception("the report for /metrics failed")
            finally:
                answered.set()

        try:
            token.run_sync_soon(on_the_loop)
        except trio.RunFinishedError:  # unmounting
            return self._last
        if answered.wait(LOOP_ANSWER_SECONDS) and answer:
            self._last = answer[0]
        else:
            log.warning("/metrics: the event loop did not answer in %.0fs", LOOP_ANSWER_SECONDS)
        return self._last

    def timed_now(self, name: str, handler: Callable[..., T]) -> Callable[..., T]:
        """``timed`` for the handlers a session calls inline (``lookup_now``...)."""
        observe = self.latency.of(name).observe
        clock = time.perf_counter

        @wraps(handler)
        def wrapper(*args: Any) -> T:  # (positional only: every first-time lookup comes here)
            start = clock()
            try:
                result = handler(*args)
            except NeedsIO:
                raise  # served in a task after all, and timed there
            except BaseException:
                observe(clock() - start)
                raise
            observe(clock() - start)
            return result

        return wrapper

    def timed(self, name: str, handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """The handler, its latency observed if it is one of TIMED_OPERATIONS."""
        if name not in TIMED_OPERATIONS:
            return handler
        observe = self.latency.of(name).observe

        @wraps(handler)
        async def wrapper(*args: Any, **kwargs: Any) -> T:
            start = time.perf_counter()
            try:
                return await handler(*args, **kwargs)
            finally:
                observe(time.perf_counter() - start)

        return wrapper


# Upper bounds of the latency histogram's buckets, in seconds.
LATENCY_BUCKETS = (
    1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
FIRST_BOUND = LATENCY_BUCKETS[0]  # where most requests answered inline fall


class Latency:
    """One operation's latency histogram, observed on the event loop only: no lock, where
    prometheus-client's Histogram took two and a microsecond, per request."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: past every bound
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        bucket = 0 if seconds <= FIRST_BOUND else bisect.bisect_left(LATENCY_BUCKETS, seconds)
        self.counts[bucket] += 1
        self.total += seconds


class Latencies:
    """``kvfs_operation_duration_seconds``, by operation: a collector that a scrape's thread
    reads while the loop observes (a copy of the counts; the sum may be one request ahead)."""

    def __init__(self, operations: Iterable[str]) -> None:
        self._by_operation = {name: Latency() for name in operations}

    def of(self, operation: str) -> Latency:
        return self._by_operation[operation]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "kvfs_operation_duration_seconds",
            "Time to answer a FUSE request, by operation",
            labels=["operation"],
        )
        bounds = [*map(repr, LATENCY_BUCKETS), "+Inf"]
        for name, latency in self._by_operation.items():
            counts, total = list(latency.counts), latency.total
            family.add_metric(
                [name], list(zip(bounds, itertools.accumulate(counts), strict=True)), total
            )
        yield family


class _ReportCollector:
    """The daemon's state, as metric families, from the report of the moment of the scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._metrics.current()
        if not s:
            return
        info = GaugeMetricFamily(
            "kvfs_build_info",
            "1, labelled with the kvfs version, the FUSE session and the Python version",
            labels=["version", "session", "python"],
        )
        info.add_metric([__version__, str(s["session"]["name"]), platform.python_version()], 1)
        yield info
        yield from _space(s)
        yield from _activity(s)
        yield from _health(s)
        yield from _queues_and_namespaces(s)
        share = s.get("share")
        if share is not None:
            yield from _share(share)


def _space(s: Report) -> Iterator[Metric]:
    yield _gauge("kvfs_capacity_bytes", "Bytes the tier may hold", s["capacity"])
    yield _gauge("kvfs_used_bytes", "Bytes held (file sizes in 4 KiB blocks)", s["used"])
    if "pinned_bytes" in s:
        yield _gauge("kvfs_pinned_bytes", "Bytes eviction may not take (pinned)", s["pinned_bytes"])
    chunks = sum(ns["chunks"] for ns in s["namespaces"])
    yield _gauge("kvfs_chunks", "Chunk files in the tier (not the namespaces' config.json)", chunks)
    try:
        st = os.statvfs(s["backing"])  # this thread's wait, never the event loop's
    except OSError as err:
        log.warning("/metrics: statvfs of the backing directory: %s", err)
    else:
        yield _gauge(
            "kvfs_backing_free_bytes",
            "Bytes free for kvfs on the backing filesystem (df's Avail), shared with others",
            st.f_bavail * st.f_frsize,
        )
        yield _gauge(
            "kvfs_backing_size_bytes",
            "Size of the backing filesystem",
            st.f_blocks * st.f_frsize,
        )
    buffer = s["write_buffer"]
    yield _gauge("kvfs_write_buffer_bytes", "Memory held by files being written", buffer["used"])
    yield _gauge(
        "kvfs_write_buffer_limit_bytes",
        "Memory files being written may hold (--write-buffer); writers wait beyond it",
        buffer["capacity"],
    )


def _activity(s: Report) -> Iterator[Metric]:
    counters = s["counters"]
    yield _counter("kvfs_reads", "Files opened for reading", counters["reads"])
    yield _counter(
        "kvfs_reads_cached_open",
        "Of those, backing files opened without a trip to the I/O pool (path in the kernel's "
        "caches)",
        counters["cached_opens"],
    )
    yield _counter(
        "kvfs_read_bytes", "Bytes read from the backing store and verified", counters["bytes_read"]
    )
    yield _counter("kvfs_publishes", "Files published (written whole)", counters["publishes"])
    yield _counter(
        "kvfs_renames_missed",
        "Stores' temp files whose rename did not come within --rename-wait (published under "
        "their temp names)",
        counters["renames_missed"],
    )
    yield _counter("kvfs_written_bytes", "Bytes published", counters["bytes_written"])
    yield _counter(
        "kvfs_publish_conflicts",
        "--shared: publishes that found another host's file with other bytes under their name "
        "(that file kept)",
        counters["publish_conflicts"],
    )
    yield _counter(
        "kvfs_shared_found",
        "--shared: names another host made that a lookup found on the backing directory",
        counters["fell_through"],
    )
    yield _counter(
        "kvfs_shared_gone",
        "--shared: files another host removed that this index still had (a miss at open)",
        counters["gone_elsewhere"],
    )
    yield _by_reason(
        "kvfs_publish_failures",
        "Files their writer closed that were not published, by reason (the writer was told)",
        PublishFailure,
        counters["publish_failures"],
    )
    lookups = CounterMetricFamily(
        "kvfs_lookups",
        "Chunks opened for reading (hit), lookups of chunk names no store followed (miss)",
        labels=["result"],
    )
    for result in ("hit", "miss"):
        lookups.add_metric([result], s["lookups"][result])
    yield lookups
    yield _by_reason("kvfs_evictions", "Files evicted, by reason", EvictionReason, s["evictions"])
    yield _by_reason(
        "kvfs_evicted_bytes",
        "Bytes of the files evicted, by reason",
        EvictionReason,
        s["evicted_bytes"],
    )


def _health(s: Report) -> Iterator[Metric]:
    counters = s["counters"]
    yield _counter(
        "kvfs_checksum_failures",
        "Reads and scrubs that failed their checksum (the file was quarantined)",
        s["checksum_failures"],
    )
    yield _counter(
        "kvfs_quarantined", "Files moved to .kvfs/quarantine (corrupt)", counters["quarantined"]
    )
    yield _counter(
        "kvfs_quarantined_bytes", "Bytes of the files quarantined", counters["quarantined_bytes"]
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
    backlog = s["checksum_backlog"]
    yield _counter(
        "kvfs_checksums_deferred",
        "Files written O_DIRECT published before their checksum was taken",
        backlog["deferred"],
    )
    yield _counter(
        "kvfs_checksums_declared",
        "Files published with the checksum their writer declared (user.kvfs.checksum), not "
        "read back",
        counters["checksums_declared"],
    )
    yield _counter(
        "kvfs_checksums_sealed",
        "Of the files published before their checksum, those checksummed since",
        backlog["sealed"],
    )
    yield GaugeMetricFamily(
        "kvfs_checksum_backlog_bytes",
        "Bytes of published files still waiting for their checksum",
        value=backlog["waiting_bytes"],
    )


def _queues_and_namespaces(s: Report) -> Iterator[Metric]:
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


def _share(share: dict[str, Any]) -> Iterator[Metric]:
    """--shared: the share's one capacity as this host sees it from the journals."""
    yield _gauge(
        "kvfs_share_used_bytes",
        "--shared: bytes the whole share holds (from every host's journal; 4 KiB blocks)",
        share["used"],
    )
    yield _gauge("kvfs_share_files", "--shared: files the whole share holds", share["files"])
    yield _gauge(
        "kvfs_share_lease_holder",
        "--shared: 1 while this host holds the sweep lease (it evicts for the share)",
        1 if share["lease_holder"] else 0,
    )
    yield _gauge(
        "kvfs_share_journal_lag_seconds",
        "--shared: seconds since this host last read the other hosts' journals",
        share["journal_lag_seconds"],
    )
    yield _gauge(
        "kvfs_share_hosts",
        "--shared: other hosts whose journals this host reads",
        len(share["hosts"]),
    )
    yield _counter(
        "kvfs_share_journal_skipped_lines",
        "--shared: journal lines skipped as corrupt or hostile (failed checksum or syntax)",
        share["skipped_lines"],
    )
    yield _counter(
        "kvfs_share_leases_taken",
        "--shared: times this host took the sweep lease",
        share["leases_taken"],
    )
    yield _counter(
        "kvfs_share_swept",
        "--shared: chunks this host evicted for the share as the lease holder",
        share["swept"],
    )
    yield _counter(
        "kvfs_share_admission_waits",
        "--shared: publishes that waited for the sweeper to make room in the share",
        share["admission_waits"],
    )
    yield _counter(
        "kvfs_share_journal_stalls",
        "--shared: journal or lease operations that outlived --io-timeout",
        share["stalls"],
    )


def _by_reason(
    name: str,
    documentation: str,
    reasons: type[EvictionReason] | type[PublishFailure],
    counts: dict[Any, int],
) -> CounterMetricFamily:
    """A counter with a sample for every reason, 0 or not (a dashboard's series exist)."""
    family = CounterMetricFamily(name, documentation, labels=["reason"])
    for reason in reasons:
        family.add_metric([reason.value], counts.get(reason, 0))
    return family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
