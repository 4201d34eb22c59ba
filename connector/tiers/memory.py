"""An in-memory secondary tier: the smallest complete example of the contract.

It keeps up to ``capacity`` chunks in a dict, least recently used out first. Its copies are
memcpy-fast, so it does them on submit and reports the jobs at the next get_finished_jobs; a
tier whose I/O can block (disk, network) must hand copies to its own threads instead (see the
fs tier). ``fail_loads`` makes every load fail, for tests of the failure paths.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from kvfs.connector.tiers.base import (
    JobResult,
    LookupResult,
    SecondaryTier,
    TierContext,
    TierEvent,
    TransferJob,
)


class MemoryTier(SecondaryTier):
    medium = "CPU"

    def __init__(
        self,
        host_view: memoryview,
        context: TierContext,
        capacity: int = 1024,
        fail_loads: bool = False,
    ) -> None:
        super().__init__(host_view, context)
        if capacity <= 0:
            raise ValueError(f"capacity {capacity}: must hold at least one chunk")
        self.capacity = capacity
        self.fail_loads = fail_loads
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []

    def lookup(self, key: bytes, request_id: str) -> LookupResult:
        return LookupResult.HIT if key in self._chunks else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        stored, evicted = [], []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self._chunks:
                continue
            self._chunks[key] = bytes(self.slot(slot))
            stored.append(key)
            while len(self._chunks) > self.capacity:
                evicted.append(self._chunks.popitem(last=False)[0])
        self._events += [
            TierEvent(tuple(k), removed) for k, removed in ((stored, False), (evicted, True)) if k
        ]
        self._finished.append(JobResult(job.job_id, True, seconds=time.perf_counter() - started))

    def submit_load(self, job: TransferJob) -> None:
        started = time.perf_counter()
        loaded = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            chunk = None if self.fail_loads else self._chunks.get(key)
            if chunk is None:
                continue  # evicted since its lookup: that key failed, the others need not
            self.slot(slot)[:] = chunk
            self._chunks.move_to_end(key)
            loaded.append(key)
        ok = len(loaded) == len(job.keys)
        self._finished.append(
            JobResult(job.job_id, ok, None if ok else loaded, time.perf_counter() - started)
        )

    def get_finished_jobs(self) -> list[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self._chunks:
                self._chunks.move_to_end(key)

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def drain(self) -> None:
        return  # nothing is ever in flight
