"""The fs tier: chunk files in a directory, the kvfs mount first among them.

Its files are vLLM's: ``<root>/<model>_<digest>_r0/<hex[:3]>/<hex[3:5]>_g<group>/<hex>.bin``
and ``<root>/<model>_<digest>/config.json``, from the run configuration, each file one chunk
written by temp name and rename, so vLLM's own fs tier and this one share a directory both
ways. Every chunk is one open, one write or read, one close (``kvfs.chunk_io``), with O_DIRECT
when a probe at start shows the directory takes it.

Loads and stores run on two thread groups, reads first (a load is on a request's critical
path, a store is background), neither starving (``kvfs.io_queues``). Lookups are batched per
scheduler step on a thread of their own and check each file's size too, so a file of another
configuration never counts as a hit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from kvfs import chunk_io
from kvfs.config import ConfigError
from kvfs.connector.tiers.async_lookup import AsyncLookup
from kvfs.connector.tiers.base import (
    JobResult,
    LookupResult,
    MetricSpec,
    SecondaryTier,
    TierContext,
    TierEvent,
    TransferJob,
)
from kvfs.io_queues import DualQueuePool, Queue

log = logging.getLogger(__name__)


class _LoadFailed(Exception):
    def __init__(self, loaded: int, error: OSError) -> None:
        super().__init__(str(error))
        self.loaded = loaded


class FsTier(SecondaryTier):
    medium = "STORAGE"

    def __init__(
        self,
        host_view: memoryview,
        context: TierContext,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        o_direct: bool | None = None,
        miss_ttl_s: float = 1.0,
    ) -> None:
        super().__init__(host_view, context)
        for key, value in (
            ("n_read_threads", n_read_threads),
            ("n_write_threads", n_write_threads),
        ):
            if not 1 <= value <= 256:
                raise ConfigError(f"secondary_tiers[{context.name}].{key}: between 1 and 256")
        self.root = root_dir.rstrip("/") or "/"
        config = context.run_config
        config_path = config.config_path(self.root)
        try:
            os.makedirs(os.path.dirname(config_path), exist_ok=True)
            chunk_io.store(config_path, config.config_json().encode())  # atomic, only if absent
        except OSError as err:
            raise ConfigError(f"secondary_tiers[{context.name}].root_dir: {err}") from err
        supported = chunk_io.probe_o_direct(os.path.dirname(config_path))
        if o_direct and not supported:
            raise ConfigError(f"secondary_tiers[{context.name}].o_direct: {self.root} refuses it")
        self.o_direct = supported if o_direct is None else o_direct
        if not self.o_direct:
            log.info("fs tier %s: buffered I/O at %s", context.name, self.root)
        self._pool = DualQueuePool(n_read_threads, n_write_threads, name=f"kvfs-{context.name}")
        self._lookups = AsyncLookup(self._present, context.name, miss_ttl_s)
        self._finished: deque[tuple[TransferJob, JobResult, list[bytes]]] = deque()
        self._in_flight = 0
        self._idle = threading.Condition()
        self._events: list[TierEvent] = []
        if (gauge := context.metrics.get("o_direct")) is not None:
            gauge.set(int(self.o_direct))

    @classmethod
    def metric_definitions(cls) -> dict[str, MetricSpec]:
        return {
            "o_direct": MetricSpec("gauge", "1 if chunk files are read and written with O_DIRECT"),
            "files_checked": MetricSpec("counter", "Chunk files a lookup checked for"),
            "io_errors": MetricSpec("counter", "Chunk stores and loads that failed"),
        }

    def path(self, key: bytes) -> str:
        return self.context.run_config.chunk_path(self.root, key)

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key: bytes, request_id: str) -> LookupResult:
        present = self._lookups.lookup(key)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    def _present(self, keys: list[bytes]) -> list[bool]:
        found = []
        for key in keys:
            try:
                found.append(os.stat(self.path(key)).st_size == self.context.chunk_bytes)
            except OSError:
                found.append(False)
        if (counter := self.context.metrics.get("files_checked")) is not None:
            counter.inc(len(keys))
        return found

    def on_schedule_end(self) -> None:
        self._lookups.flush()

    # -- transfers --------------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        self._submit(Queue.WRITE, job, lambda: self._store(job))

    def submit_load(self, job: TransferJob) -> None:
        self._submit(Queue.READ, job, lambda: self._load(job))

    def _submit(self, queue: Queue, job: TransferJob, work: Callable[[], list[bytes]]) -> None:
        started = time.perf_counter()

        def done(moved: list[bytes] | None, error: BaseException | None) -> None:
            seconds = time.perf_counter() - started
            if error is None:
                result = JobResult(job.job_id, True, seconds=seconds)
            else:
                loaded = error.loaded if isinstance(error, _LoadFailed) else 0
                log.debug("fs tier %s: job %d failed: %s", self.name, job.job_id, error)
                result = JobResult(job.job_id, False, list(job.keys[:loaded]), seconds)
            with self._idle:
                self._finished.append((job, result, moved or []))
                self._in_flight -= 1
                self._idle.notify_all()

        with self._idle:
            self._in_flight += 1
        self._pool.submit(queue, work, done)

    def _store(self, job: TransferJob) -> list[bytes]:
        """Write each chunk; the keys newly written (the others were there already)."""
        written = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if chunk_io.store(self.path(key), self.slot(slot), self.o_direct):
                written.append(key)
        return written

    def _load(self, job: TransferJob) -> list[bytes]:
        """Read chunks in order, stopping at the first that fails: a request can use only
        the prefix before it."""
        for i, (key, slot) in enumerate(zip(job.keys, job.slots, strict=True)):
            try:
                chunk_io.load_into(self.path(key), self.slot(slot), self.o_direct)
            except OSError as err:
                raise _LoadFailed(i, err) from err
        return list(job.keys)

    def get_finished_jobs(self) -> list[JobResult]:
        results = []
        with self._idle:
            finished, self._finished = list(self._finished), deque()
        for job, result, moved in finished:
            if not result.success:
                if (counter := self.context.metrics.get("io_errors")) is not None:
                    counter.inc()
                if job.is_promotion:  # what failed to load is a miss from now on
                    self._lookups.mark(job.keys[len(result.successful_keys or ()) :], False)
            elif not job.is_promotion:
                self._lookups.mark(job.keys, True)
                if moved:
                    self._events.append(TierEvent(tuple(moved), removed=False))
            results.append(result)
        return results

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        self._pool.shutdown()
        self._lookups.shutdown()
