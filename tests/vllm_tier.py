"""Drive vLLM 0.33.0's own FileSystemTierManager: a minimal spec and a scheduler's loop."""

from __future__ import annotations

import mmap
import os
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


def minimal_spec(
    model: str = "kvfs-test/tiny-model",
    blocks_per_chunk: int = 1,
    tp_size: int = 1,
    layer_names: tuple[str, ...] = ("layers.0", "layers.1"),
) -> Any:
    """The fields of an OffloadingSpec that the fs tier reads, and nothing else."""
    return SimpleNamespace(
        blocks_per_chunk=blocks_per_chunk,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
        config=SimpleNamespace(
            model=SimpleNamespace(name=model, dtype="bfloat16"),
            cache=SimpleNamespace(tokens_per_hash=16),
            groups=[SimpleNamespace(tokens_per_block=16, layer_names=list(layer_names))],
            parallel=SimpleNamespace(
                tp_size=tp_size,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                rank=0,
                is_parallelism_agnostic=True,
            ),
            canonical_layout=False,
            kv_cache_layout=None,
            replicated_layout=False,
        ),
    )


class HostRegion:
    """A page-aligned host region of fixed-size rows, like vLLM's primary tier."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self._mmap = mmap.mmap(-1, rows * row_bytes)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(rows, row_bytes)
        self.view = memoryview(self.array)


class Tier:
    """One FileSystemTierManager plus the scheduler-side polling around it."""

    def __init__(
        self,
        root: str,
        region: HostRegion,
        o_direct: bool | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """vLLM's fs tier, or the tier ``config`` names ({"type", "module_path", ...}), built
        by vLLM's own factory as TieringOffloadingSpec builds its secondary tiers."""
        if config is None:
            self.fs = FileSystemTierManager(
                minimal_spec(),
                region.view,
                "fs",
                root_dir=root,
                n_read_threads=4,
                n_write_threads=4,
            )
        else:
            config = {**config, "root_dir": root, "n_read_threads": 4, "n_write_threads": 4}
            self.fs = SecondaryTierFactory.create_secondary_tier(
                config, region.view, minimal_spec()
            )
        if o_direct is not None and not o_direct:
            self.fs._use_o_direct = False  # what vLLM does after a failed probe
        self._job = 0
        self.ctx = ReqContext(req_id="req-0")

    @property
    def uses_o_direct(self) -> bool:
        return bool(self.fs._use_o_direct)

    def path(self, key: OffloadKey) -> str:
        return str(self.fs.file_mapper.get_file_name(key))

    def _run(self, keys: list[OffloadKey], slots: list[int], promotion: bool) -> JobResult:
        self._job += 1
        job = TransferJob(
            job_id=self._job,
            keys=keys,
            chunk_ids=np.array(slots),
            is_promotion=promotion,
            req_context=self.ctx,
        )
        (self.fs.submit_load if promotion else self.fs.submit_store)(job)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for result in self.fs.get_finished_jobs():
                if result.job_id == job.job_id:
                    return result
            time.sleep(0.005)
        raise AssertionError(f"job {job.job_id} did not finish")

    def store(self, keys: list[OffloadKey], slots: list[int]) -> JobResult:
        return self._run(keys, slots, promotion=False)

    def load(self, keys: list[OffloadKey], slots: list[int]) -> JobResult:
        return self._run(keys, slots, promotion=True)

    def lookup(self, keys: list[OffloadKey]) -> list[LookupResult]:
        """Ask until no answer is RETRY, flushing at the end of each 'step' as vLLM does."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            results = [self.fs.lookup(key, self.ctx) for key in keys]
            if LookupResult.RETRY not in results:
                return results
            self.fs.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            time.sleep(0.005)
        raise AssertionError("lookups still RETRY after 30s")

    def close(self) -> None:
        self.fs.shutdown()


def new_keys(count: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(32), 0) for _ in range(count)]
