"""Tiers of a user's own, loaded by module_path ("module_path": "tests.oot_tiers")."""

from __future__ import annotations

import threading

from kvfs.connector.tiers.base import LookupResult, MetricSpec, TransferJob
from kvfs.connector.tiers.memory import MemoryTier


class RecordingTier(MemoryTier):
    """The memory tier, counting what it is asked to do in a metric of its own."""

    @classmethod
    def metric_definitions(cls) -> dict[str, MetricSpec]:
        return {"jobs": MetricSpec("counter", "Jobs this tier was given")}

    def submit_store(self, job: TransferJob) -> None:
        self.context.metrics["jobs"].inc()
        super().submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.context.metrics["jobs"].inc()
        super().submit_load(job)


class HangingTier(MemoryTier):
    """A store whose lookups never come back (a stalled NFS server, say)."""

    def lookup(self, key: bytes, request_id: str) -> LookupResult:
        return LookupResult.RETRY


class SlowTier(MemoryTier):
    """Stores finish only when the test lets them (a tier that fell behind)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = threading.Event()
        self._held: list[TransferJob] = []

    def submit_store(self, job: TransferJob) -> None:
        self._held.append(job)

    def get_finished_jobs(self):  # type: ignore[no-untyped-def]
        if self.release.is_set():
            for job in self._held:
                super().submit_store(job)
            self._held = []
        return super().get_finished_jobs()


class StuckLoadTier(MemoryTier):
    """Loads that never finish (a read stuck on a hung server)."""

    def submit_load(self, job: TransferJob) -> None:
        return  # never reported: the manager's deadline must free the request
