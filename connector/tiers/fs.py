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

import errno
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfs import chunk_io
from kvfs import control_protocol as proto
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


@dataclass
class _Piece:
    moved: list[bytes]  # stored: newly written; loaded: read into their slots
    ok: bool


@dataclass
class _InFlight:
    job: TransferJob
    pieces: int  # not finished yet
    started: float
    moved: list[bytes] = field(default_factory=list)
    ok: bool = True


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
        fanout_chunks: int = 8,
    ) -> None:
        super().__init__(host_view, context)
        for key, value in (
            ("n_read_threads", n_read_threads),
            ("n_write_threads", n_write_threads),
        ):
            if not 1 <= value <= 256:
                raise ConfigError(f"secondary_tiers[{context.name}].{key}: between 1 and 256")
        if fanout_chunks <= 0:
            raise ConfigError(f"secondary_tiers[{context.name}].fanout_chunks: must be positive")
        self._fanout = fanout_chunks
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
        # On a kvfs mount, a step's lookups are one request answered from the daemon's index
        # (kvfs/control_protocol.py) instead of a stat per chunk, each a FUSE round trip.
        mount = proto.lookup_mount(self.root)
        self._mount_lookups = proto.LookupClient(mount) if mount is not None else None
        # ... and each store declares its chunk's checksum, which the mount then keeps instead
        # of reading the chunk back from its disk (O_DIRECT bytes pass the daemon by).
        self._declares = mount is not None
        self._data_dir = (
            os.path.relpath(os.path.join(os.path.realpath(self.root), config.data_dir), mount)
            if mount is not None
            else ""
        )
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
        if (counter := self.context.metrics.get("files_checked")) is not None:
            counter.inc(len(keys))
        if self._mount_lookups is not None:
            names = [self.context.run_config.chunk_name(key) for key in keys]
            try:
                return self._mount_lookups.ask(self._data_dir, names)
            except OSError as err:  # the mount is gone or refused: ask the files themselves
                log.warning("fs tier %s: batched lookup failed: %s", self.context.name, err)
        found = []
        for key in keys:
            try:
                found.append(os.stat(self.path(key)).st_size == self.context.chunk_bytes)
            except OSError:
                found.append(False)
        return found

    def on_schedule_end(self) -> None:
        self._lookups.flush()

    # -- transfers --------------------------------------------------------------------------

    def submit_store(self, job: TransferJob) -> None:
        self._submit(Queue.WRITE, job, self._store)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(Queue.READ, job, self._load)

    def _submit(
        self, queue: Queue, job: TransferJob, work: Callable[[TransferJob, range], _Piece]
    ) -> None:
        """Split the job into pieces of ``fanout_chunks`` for the pool's threads: one
        request's many chunks then load (or store) in parallel, not one after another."""
        size = self._fanout
        pieces = [range(i, min(i + size, len(job.keys))) for i in range(0, len(job.keys), size)]
        state = _InFlight(job, max(1, len(pieces)), time.perf_counter())
        with self._idle:
            self._in_flight += 1
        if not pieces:  # nothing to move: done, and reported like any job
            self._piece_done(state, _Piece([], True), None)
        for piece in pieces:
            self._pool.submit(
                queue,
                functools.partial(work, job, piece),
                functools.partial(self._piece_done, state),
            )

    def _piece_done(
        self, state: _InFlight, piece: _Piece | None, error: BaseException | None
    ) -> None:
        with self._idle:
            if error is not None or piece is None:
                log.warning("fs tier %s: job %d: %s", self.name, state.job.job_id, error)
                state.ok = False
            else:
                state.moved += piece.moved
                state.ok &= piece.ok
            state.pieces -= 1
            if state.pieces:
                return
            job = state.job
            seconds = time.perf_counter() - state.started
            if state.ok:
                result = JobResult(job.job_id, True, seconds=seconds)
            else:
                moved = set(state.moved)
                loaded = [k for k in job.keys if k in moved] if job.is_promotion else None
                result = JobResult(job.job_id, False, loaded, seconds)
            self._finished.append((job, result, state.moved))
            self._in_flight -= 1
            self._idle.notify_all()

    def _store(self, job: TransferJob, piece: range) -> _Piece:
        """Write each chunk of the piece; the keys newly written (others were there)."""
        written, ok = [], True
        for i in piece:
            try:
                data = self.slot(job.slots[i])
                if chunk_io.store(self.path(job.keys[i]), data, self.o_direct, self._declares):
                    written.append(job.keys[i])
            except OSError as err:
                log.debug("fs tier %s: store of %s: %s", self.name, job.keys[i].hex(), err)
                ok = False
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    break  # the rest would fail the same way
        return _Piece(written, ok)

    def _load(self, job: TransferJob, piece: range) -> _Piece:
        """Read each chunk of the piece; one that fails does not stop the others (each is
        a file of its own, and a miss only if it really failed)."""
        loaded, ok = [], True
        for i in piece:
            try:
                chunk_io.load_into(self.path(job.keys[i]), self.slot(job.slots[i]), self.o_direct)
            except OSError as err:
                log.debug("fs tier %s: load of %s: %s", self.name, job.keys[i].hex(), err)
                ok = False
                continue
            loaded.append(job.keys[i])
        return _Piece(loaded, ok)

    def get_finished_jobs(self) -> list[JobResult]:
        results = []
        with self._idle:
            finished, self._finished = list(self._finished), deque()
        for job, result, moved in finished:
            if not result.success:
                if (counter := self.context.metrics.get("io_errors")) is not None:
                    counter.inc()
                if job.is_promotion:  # what failed to load is a miss from now on
                    loaded = set(result.successful_keys or ())
                    self._lookups.mark([k for k in job.keys if k not in loaded], False)
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
        if self._mount_lookups is not None:
            self._mount_lookups.close()
