"""The scheduler side of the connector: the host tier, and the secondary tiers behind it.

- Lookup asks the host tier, then each secondary tier in order. A chunk the host holds is a
  HIT; one a tier holds gets a host slot at once and is promoted at the end of the step (one
  load job per tier and request), the lookup answering RETRY until it is in host memory. A
  tier still finding out answers RETRY too, for at most ``lookup_timeout_s``, then it is a
  miss: a hung store delays a request, it never holds it.
- Store: the caller copies new chunks from the device into the slots ``prepare_store`` gives;
  ``complete_store`` makes them loadable and cascades them to every secondary tier. A tier
  with ``max_pending_stores`` chunks waiting gets no more until it catches up: the cascade is
  dropped (counted), never queued without bound, and never pins the whole host tier.
- A failed promotion frees its slots and the chunk is a miss at that tier from then on (until
  it is stored there again): failures are never retried in a loop.

Single-threaded: the caller (the scheduler) serialises calls.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from prometheus_client import start_http_server

from kvfs.connector.config import ConnectorConfig
from kvfs.connector.metrics import ConnectorMetrics
from kvfs.connector.tiers import create_tier, tier_class
from kvfs.connector.tiers.base import (
    HostAccess,
    LookupResult,
    SecondaryTier,
    TierContext,
    TransferJob,
)
from kvfs.host_cache import HostCache, Lookup
from kvfs.keys import split_offload_key
from kvfs.kv_events import EventPublisher
from kvfs.run_config import RunConfig

log = logging.getLogger(__name__)

HOST = "host"
HOST_MEDIUM = "CPU"
# How long a tier is not asked again for a chunk whose lookup or load timed out.
FAILURE_TTL_S = 60.0


@dataclass
class _Job:
    tier: int
    keys: list[bytes]
    promotion: bool


@dataclass(frozen=True)
class ConnectorEvent:
    keys: tuple[bytes, ...]
    medium: str  # "CPU" for the host tier, else the tier's medium
    tier: str  # "host" or the tier's name
    removed: bool


@dataclass(frozen=True)
class PrefixLookup:
    hits: int  # leading chunks readable from the host tier now
    retry: bool  # more may follow: ask again next step


@dataclass(frozen=True)
class LoadPlan:
    slots: list[int]  # host slot of each key, pinned until complete_load
    sources: list[str]  # the tier each chunk came from ("host" if it was there already)


class _HostAccess(HostAccess):
    def __init__(self, host: HostCache) -> None:
        self._host = host

    def pin_ready(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        ready = [k for k in dict.fromkeys(keys) if self._host.lookup(k) is Lookup.HIT]
        return dict(zip(ready, self._host.pin(ready), strict=True))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._host.unpin(keys)


class TieringManager:
    def __init__(
        self,
        config: ConnectorConfig,
        run_config: RunConfig,
        host_view: memoryview,
        metrics: ConnectorMetrics | None = None,
    ) -> None:
        self.config = config
        self.num_slots = len(host_view)  # (slots, chunk_bytes), contiguous: a row per slot
        self.chunk_bytes = host_view.nbytes // max(self.num_slots, 1)
        self.host = HostCache(self.num_slots, config.eviction_policy)
        self._host_access = _HostAccess(self.host)
        self.metrics = metrics or ConnectorMetrics()
        self.tiers: list[SecondaryTier] = []
        try:
            for tier in config.secondary_tiers:
                cls = tier_class(tier.type, tier.module_path, tier.where)
                context = TierContext(
                    tier.name,
                    run_config,
                    self.chunk_bytes,
                    self.metrics.tier_metrics(tier.type, tier.name, cls.metric_definitions()),
                )
                self.tiers.append(create_tier(cls, tier.options, host_view, context, tier.where))
            self._publisher = EventPublisher(config.kv_events) if config.kv_events else None
            self._http = (
                start_http_server(
                    config.metrics_port,
                    addr=config.metrics_address,
                    registry=self.metrics.registry,
                )[0]
                if config.metrics_port is not None
                else None
            )
        except BaseException:
            self._shutdown_tiers()
            raise
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._promoting: dict[bytes, tuple[int, float]] = {}  # key -> (tier, since)
        self._to_promote: dict[tuple[int, str], list[tuple[bytes, int]]] = {}
        self._source: OrderedDict[bytes, int] = OrderedDict()  # promoted, not loaded yet
        self._asking: dict[tuple[int, bytes], float] = {}  # (tier, key) -> first RETRY
        self._next_prune = 0.0  # when _asking next drops what nobody asked again
        self._failed: OrderedDict[tuple[int, bytes], float] = OrderedDict()  # -> skip until
        self._pending_stores = [0] * len(self.tiers)
        self._events: list[ConnectorEvent] = []

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key: bytes, request_id: str, keep: Collection[bytes] = ()) -> LookupResult:
        """Where ``key`` is; a promotion it starts evicts none of ``keep`` from the host tier."""
        state = self.host.lookup(key)
        now = time.monotonic()
        if state is Lookup.HIT:
            self.metrics.lookup(HOST, "hit")
            return LookupResult.HIT
        if state is Lookup.PENDING:
            promotion = self._promoting.get(key)
            if promotion is None:
                return LookupResult.HIT_PENDING  # being stored from the device
            source, started = promotion
            if now - started < self.config.lookup_timeout_s:
                return LookupResult.RETRY
            # A load that hangs: a miss for the request (its slot stays busy until it ends).
            self._remember_failure(source, key, now + FAILURE_TTL_S)
            self.metrics.lookup(self.tiers[source].name, "timeout", now - started)
            return LookupResult.MISS
        if not any((index, key) in self._asking for index in range(len(self.tiers))):
            self.metrics.lookup(HOST, "miss")  # once per miss, not once per step it waits
        for index, tier in enumerate(self.tiers):
            if self._failed.get((index, key), 0.0) > now:
                continue
            answer = tier.lookup(key, request_id)
            asked = self._asking.get((index, key))
            if answer in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                if asked is None:
                    self._asking[(index, key)] = now
                    return LookupResult.RETRY
                if now - asked < self.config.lookup_timeout_s:
                    return LookupResult.RETRY
                del self._asking[(index, key)]
                # Not asked again for a while: the next step moves on, a later one may retry.
                self._remember_failure(index, key, now + FAILURE_TTL_S)
                self.metrics.lookup(tier.name, "timeout", now - asked)
                continue
            self._asking.pop((index, key), None)
            waited = now - asked if asked is not None else 0.0
            if answer is LookupResult.MISS:
                self.metrics.lookup(tier.name, "miss", waited)
                continue
            self.metrics.lookup(tier.name, "hit", waited)
            return self._promote(index, key, request_id, keep)
        return LookupResult.MISS

    def _promote(
        self, tier: int, key: bytes, request_id: str, keep: Collection[bytes]
    ) -> LookupResult:
        allocation = self.host.allocate([key], keep)
        if allocation is None:
            self.metrics.refused.labels("load").inc()
            return LookupResult.MISS
        self._promoting[key] = (tier, time.monotonic())
        self._to_promote.setdefault((tier, request_id), []).append((key, allocation.slots[key]))
        return LookupResult.RETRY

    def lookup_prefix(self, keys: Sequence[bytes], request_id: str) -> PrefixLookup:
        """How many leading chunks of a request can be loaded now. Past the first chunk that
        is not ready it keeps asking (so one step batches every lookup and promotion of the
        request) and stops at the first miss. Promotions never evict the chunks found before
        them, so a prefix longer than the host tier ends where the tier is full instead of
        chasing itself. Load the hits before the next lookup of another request: that one's
        promotions may evict them."""
        hits, retry = 0, False
        before: set[bytes] = set()  # the chunks before this one: its promotion keeps them
        for key in keys:
            answer = self.lookup(key, request_id, before)
            before.add(key)
            if answer is LookupResult.MISS:
                break
            if answer is LookupResult.HIT and not retry:
                hits += 1
            else:
                retry = True
        return PrefixLookup(hits, retry)

    # -- loads ------------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin chunks that lookup found (HIT) for a copy to the device."""
        slots = self.host.pin(keys)
        sources = []
        for key in keys:
            tier = self._source.pop(key, None)
            sources.append(HOST if tier is None else self.tiers[tier].name)
        for source in sources:
            self.metrics.served.labels(source).inc()
        return LoadPlan(slots, sources)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.host.unpin(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Chunks used again (a device prefix hit): keep them hot in the host tier."""
        self.host.touch(keys)
        for tier in self.tiers:
            tier.touch(keys)

    # -- stores -----------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        """Host slots for the keys the host tier lacks (all or none: None when they do not
        fit beside the busy slots, and nothing changes)."""
        allocation = self.host.allocate(keys)
        if allocation is None:
            self.metrics.refused.labels("store").inc(len(keys))
            return None
        return allocation.slots

    def complete_store(self, keys: Sequence[bytes], request_id: str, success: bool = True) -> None:
        """The device copies into the slots are done: make them loadable, cascade them."""
        self.host.complete_write(keys, success)
        if not success or not keys:
            return
        for index, tier in enumerate(self.tiers):
            if not tier.accepts_stores:
                continue
            if self._pending_stores[index] + len(keys) > self.config.max_pending_stores:
                self.metrics.dropped.labels(tier.name).inc(len(keys))
                continue
            slots = self.host.pin(keys)
            job_id = next(self._job_ids)
            try:
                tier.submit_store(TransferJob(job_id, list(keys), slots, False, request_id))
            except Exception:
                log.exception("tier %s refused a store", tier.name)
                self.host.unpin(keys)
                self.metrics.failures.labels(tier.name, "store").inc()
                continue
            self._jobs[job_id] = _Job(index, list(keys), promotion=False)
            self._pending_stores[index] += len(keys)

    def record_device_transfer(self, direction: str, moved: int, seconds: float | None) -> None:
        """A device <-> host copy finished (the workers report these)."""
        self.metrics.transfer(HOST, direction, moved, seconds)

    # -- steps ------------------------------------------------------------------------------

    def on_schedule_end(self) -> None:
        """End of a scheduler step: finished jobs, then this step's promotions and lookups."""
        self._process_finished()
        for (index, request_id), entries in self._to_promote.items():
            job_id = next(self._job_ids)
            keys = [key for key, _ in entries]
            self._jobs[job_id] = _Job(index, keys, promotion=True)
            slots = [slot for _, slot in entries]
            try:
                self.tiers[index].submit_load(TransferJob(job_id, keys, slots, True, request_id))
            except Exception:
                log.exception("tier %s refused a load", self.tiers[index].name)
                del self._jobs[job_id]
                self._finish_promotion(index, keys, set())
        self._to_promote.clear()
        for tier in self.tiers:
            tier.serve_peers(self._host_access)
            tier.on_schedule_end()
        now = time.monotonic()
        if now >= self._next_prune:  # not every step: it holds the GIL the I/O threads want
            self._next_prune = now + self.config.lookup_timeout_s
            stale = now - 4 * self.config.lookup_timeout_s
            self._asking = {k: t for k, t in self._asking.items() if t > stale}
        if self._publisher is not None:
            self._publish()

    def _process_finished(self) -> None:
        for index, tier in enumerate(self.tiers):
            for result in tier.get_finished_jobs():
                job = self._jobs.pop(result.job_id, None)
                if job is None or job.tier != index:
                    log.warning(
                        "tier %s reported job %d it was not given", tier.name, result.job_id
                    )
                    continue
                direction = "load" if job.promotion else "store"
                if not result.success:
                    self.metrics.failures.labels(tier.name, direction).inc()
                if job.promotion:
                    done = set(job.keys if result.success else result.successful_keys or ())
                    self._finish_promotion(index, job.keys, done)
                    moved = len(done)
                else:
                    self.host.unpin(job.keys)
                    self._pending_stores[index] -= len(job.keys)
                    if result.success:
                        for key in job.keys:
                            self._failed.pop((index, key), None)
                    moved = len(job.keys) if result.success else 0
                self.metrics.transfer(
                    tier.name, direction, moved * self.chunk_bytes, result.seconds
                )
            self._events += [
                ConnectorEvent(e.keys, tier.medium, tier.name, e.removed)
                for e in tier.take_events()
            ]
        self._events += [
            ConnectorEvent(e.keys, HOST_MEDIUM, HOST, e.removed) for e in self.host.take_events()
        ]
        self.metrics.host_usage.set(len(self.host) / self.num_slots)
        self.metrics.host_busy.set(self.host.busy_slots / self.num_slots)

    def _finish_promotion(self, tier: int, keys: list[bytes], done: set[bytes]) -> None:
        loaded = [k for k in keys if k in done]
        failed = [k for k in keys if k not in done]
        self.host.complete_write(loaded, success=True)
        self.host.complete_write(failed, success=False)
        for key in keys:
            self._promoting.pop(key, None)
        for key in loaded:
            self._source[key] = tier
        while len(self._source) > 4 * self.num_slots:  # promoted, then never loaded
            self._source.popitem(last=False)
        for key in failed:
            self._remember_failure(tier, key, math.inf)

    def _remember_failure(self, tier: int, key: bytes, until: float) -> None:
        """The tier is skipped for this key until then, or until a store puts it there."""
        self._failed[(tier, key)] = until
        while len(self._failed) > 4 * self.num_slots:
            self._failed.popitem(last=False)

    def take_events(self) -> list[ConnectorEvent]:
        """Chunks stored in and removed from each tier since the last call."""
        self._process_finished()
        events, self._events = self._events, []
        return events

    def _publish(self) -> None:
        assert self._publisher is not None
        for event in self.take_events():
            by_group: dict[int, list[bytes]] = {}
            for key in event.keys:
                block_hash, group = split_offload_key(key)
                by_group.setdefault(group, []).append(block_hash)
            for group, hashes in by_group.items():
                if event.removed:
                    self._publisher.removed(hashes, group, event.medium, event.tier)
                else:
                    self._publisher.stored(hashes, group, 0, event.medium, event.tier)
        self._publisher.flush()

    # -- lifecycle --------------------------------------------------------------------------

    def on_request_finished(self, request_id: str) -> None:
        for tier in self.tiers:
            tier.on_request_finished(request_id)

    def drain(self) -> None:
        """Wait for every tier job to finish and account for it."""
        for tier in self.tiers:
            tier.drain()
        self._process_finished()

    def reset(self) -> list[bytes]:
        """Drop every host chunk no transfer uses (secondary tiers keep theirs)."""
        self.drain()
        return self.host.clear()

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self._shutdown_tiers()
            if self._publisher is not None:
                self._publisher.close()
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()

    def _shutdown_tiers(self) -> None:
        for tier in self.tiers:
            try:
                tier.shutdown()
            except Exception:
                log.exception("tier %s did not shut down cleanly", tier.name)
