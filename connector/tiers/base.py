"""The secondary-tier interface: a store the host tier cascades every chunk to, and promotes
chunks from.

A secondary tier never sees device memory. It moves whole chunks between its storage and slots
of the host region, which it gets at construction as a memoryview of shape (slots, chunk
bytes); slot ``s`` is ``view[s]``, page-aligned, so a tier can do O_DIRECT I/O straight from it.

Threading: every method is called from the scheduler's thread (one at a time), and none may
block on I/O: ``submit_*`` queue work, ``get_finished_jobs`` reports what is done. A tier may
run its own threads, which touch only the slots of jobs in flight.

A job's slots are the tier's until the job is reported, and never after: store slots are
pinned (read them), load slots are allocated for it (write all of a key's bytes, or report
the key as not loaded). Every job is reported exactly once, success or not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from kvfs.run_config import RunConfig


class LookupResult(Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # present, not readable yet (being stored)
    RETRY = "retry"  # not known yet: ask again next scheduler step


@dataclass
class TransferJob:
    job_id: int
    keys: Sequence[bytes]
    slots: Sequence[int]  # host-region slot of each key
    is_promotion: bool  # True: tier -> host (load); False: host -> tier (store)
    request_id: str


@dataclass
class JobResult:
    job_id: int
    success: bool  # every key moved
    # Loads that partly failed: the keys whose slots hold their chunk (None: all or none).
    successful_keys: Sequence[bytes] | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class TierEvent:
    keys: tuple[bytes, ...]
    removed: bool


@dataclass(frozen=True)
class MetricSpec:
    """A metric a tier keeps; the connector registers it as ``kvfs_tier_<type>_<name>`` with
    the label ``tier`` and hands the tier the labelled child in ``context.metrics``."""

    kind: str  # "counter", "gauge" or "histogram"
    documentation: str
    buckets: tuple[float, ...] | None = None


class HostAccess(ABC):
    """The host tier, for a tier that serves other engines from it (p2p): pin the chunks it
    holds so that a transfer can read them, release them after. Scheduler thread only."""

    @abstractmethod
    def pin_ready(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """Pin those of ``keys`` that are readable in the host tier now; their slots."""

    @abstractmethod
    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release pins :meth:`pin_ready` took (once per key per pin)."""


@dataclass
class TierContext:
    """What every tier gets besides its own options."""

    name: str  # unique among the connector's tiers; labels its metrics and events
    run_config: RunConfig  # names the cache namespace (vLLM's digest and paths)
    chunk_bytes: int
    metrics: dict[str, Any] = field(default_factory=dict)


class SecondaryTier(ABC):
    medium: ClassVar[str] = "STORAGE"
    # False: the tier keeps no chunks of its own (p2p reads other engines' host tiers), so
    # the host tier does not cascade stores to it.
    accepts_stores: ClassVar[bool] = True

    def __init__(self, host_view: memoryview, context: TierContext) -> None:
        if host_view.ndim != 2 or (host_view.strides or (0,))[0] != context.chunk_bytes:
            raise ValueError("host_view must be (slots, chunk_bytes), a row per slot")
        self.host_view = host_view
        self.context = context
        self.name = context.name
        self._host_bytes = host_view.cast("B")

    def slot(self, index: int) -> memoryview:
        """Slot ``index`` of the host region, as a flat memoryview (no copy)."""
        size = self.context.chunk_bytes
        return self._host_bytes[index * size : (index + 1) * size]

    @classmethod
    def metric_definitions(cls) -> dict[str, MetricSpec]:
        return {}

    @abstractmethod
    def lookup(self, key: bytes, request_id: str) -> LookupResult:
        """HIT, MISS, or RETRY while the answer is being found out (never blocks)."""

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None:
        """Copy the chunks in ``job.slots`` into the tier (keys it holds may be skipped)."""

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None:
        """Copy the chunks of ``job.keys`` into ``job.slots``."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Jobs finished since the last call."""

    # -- hooks ------------------------------------------------------------------------------

    def on_schedule_end(self) -> None:
        """End of a scheduler step: send batched work (lookups) on its way."""
        return  # optional hook

    def serve_peers(self, host: HostAccess) -> None:
        """End of a scheduler step, before :meth:`on_schedule_end`: answer other engines'
        requests from the host tier (p2p). ``host`` is valid for the tier's lifetime, on the
        scheduler thread."""
        return  # optional hook

    def on_request_finished(self, request_id: str) -> None:
        """No more calls for this request will come; jobs may still be in flight."""
        return  # optional hook

    def touch(self, keys: Sequence[bytes]) -> None:
        """These chunks were used again (for the tier's own eviction)."""
        return  # optional hook

    def take_events(self) -> list[TierEvent]:
        """Chunks this tier stored or removed since the last call."""
        return []

    @abstractmethod
    def drain(self) -> None:
        """Block until every submitted job is finished (their results still come from
        get_finished_jobs); never abort a copy half done."""

    def shutdown(self) -> None:
        """Release threads and handles; called after drain."""
        return  # optional hook
