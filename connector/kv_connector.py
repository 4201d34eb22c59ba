"""The connector in one process: the scheduler side (TieringManager) and the workers' transfer
engines (one per TP rank, all in this process), wired together for an engine that runs both in
one place, and for the end-to-end check, the interop tests and the benchmarks.

Per request and step, an engine calls ``lookup`` (how many leading chunks can come from the
host tier; RETRY: ask again next step), ``load`` the hits into device blocks it allocates
then, computes the rest, ``store`` the new full chunks from their device blocks, and ``step``
at the end of the step. ``step`` returns the transfers that finished: a store's device blocks
may be freed, a load's blocks hold their KV.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfs.config import ConfigError
from kvfs.connector.config import ConnectorConfig
from kvfs.connector.host_memory import host_tensor, pin, unpin
from kvfs.connector.manager import PrefixLookup, TieringManager
from kvfs.connector.metrics import ConnectorMetrics
from kvfs.connector.transfer import TransferEngine, TransferResult
from kvfs.geometry import ChunkLayout, ModelGeometry
from kvfs.host_region import HostRegion
from kvfs.run_config import KVCacheGroupConfig, RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    job_id: int
    kind: str  # "store" or "load"
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    success: bool
    sources: tuple[str, ...] = ()  # loads: the tier each chunk came from


@dataclass
class _Pending:
    kind: str
    keys: list[bytes]
    block_ids: list[int]
    request_id: str
    sources: list[str]


def run_config_for(layout: ChunkLayout, model_name: str, tokens_per_hash: int) -> RunConfig:
    """The namespace vLLM's FileMapper gives these canonical chunks: the same digest, so vLLM
    engines and kvfs's connector share files."""
    geometry = layout.geometry
    return RunConfig(
        model_name=model_name,
        tokens_per_hash=tokens_per_hash,
        blocks_per_file=geometry.blocks_per_chunk,
        dtype=geometry.groups[0].dtype,
        kv_cache_groups=tuple(
            KVCacheGroupConfig(g.tokens_per_block, g.layer_names) for g in geometry.groups
        ),
        tp_size=layout.tp_size,
        parallel_agnostic=layout.parallel_agnostic,
        replicated_layout=layout.replicated_layout,
        canonical_format=layout.canonical_format,
    )


class KVConnector:
    def __init__(
        self,
        extra_config: Mapping[str, Any],
        geometry: ModelGeometry,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
        model_name: str,
        instance: str,
        tokens_per_hash: int = 16,
        kv_layout: str = "NHD",
        metrics: ConnectorMetrics | None = None,
    ) -> None:
        config = ConnectorConfig.from_extra_config(extra_config)
        if config.blocks_per_chunk != geometry.blocks_per_chunk:
            raise ConfigError(
                f"blocks_per_chunk: {config.blocks_per_chunk}, the geometry has "
                f"{geometry.blocks_per_chunk}"
            )
        # one mapping per TP rank (a single mapping: TP=1)
        ranks = [kv_caches] if isinstance(kv_caches, Mapping) else list(kv_caches)
        layout = ChunkLayout(geometry, len(ranks), kv_layout)
        slots = config.cpu_bytes_to_use // layout.chunk_bytes
        if slots == 0:
            raise ConfigError(
                f"cpu_bytes_to_use: {config.cpu_bytes_to_use} bytes hold no chunk of "
                f"{layout.chunk_bytes} bytes"
            )
        self.layout = layout
        self.run_config = run_config_for(layout, model_name, tokens_per_hash)
        self.region = HostRegion.create(instance, slots, layout.chunk_bytes, geometry.fingerprint())
        self._host = host_tensor(self.region)
        self._pinned = False
        try:
            self._pinned = pin(self._host)
            self.engines: list[TransferEngine] = []
            try:
                for rank, kv in enumerate(ranks):
                    self.engines.append(TransferEngine(layout, kv, self._host, rank))
                self.manager = TieringManager(config, self.run_config, self.region.view, metrics)
            except BaseException:
                self._shutdown_engines()
                raise
        except BaseException:
            self._release_host()
            raise
        self._next_job = 0
        self._pending: dict[int, _Pending] = {}
        self._results: dict[int, list[TransferResult]] = {}  # ranks that reported, per job

    @property
    def engine(self) -> TransferEngine:
        """Rank 0's engine (the only one at TP=1)."""
        return self.engines[0]

    @property
    def metrics(self) -> ConnectorMetrics:
        return self.manager.metrics

    def lookup(self, keys: Sequence[bytes], request_id: str) -> PrefixLookup:
        return self.manager.lookup_prefix(keys, request_id)

    def load(
        self, keys: Sequence[bytes], block_ids: Sequence[int], request_id: str, group: int = 0
    ) -> int:
        """Copy chunks the lookup found into device blocks (blocks_per_chunk per chunk)."""
        plan = self.manager.prepare_load(keys)
        try:
            job = self._submit("load", keys, block_ids, plan.slots, request_id, group)
        except BaseException:
            self.manager.complete_load(keys)
            raise
        self._pending[job].sources = plan.sources
        return job

    def store(
        self, keys: Sequence[bytes], block_ids: Sequence[int], request_id: str, group: int = 0
    ) -> int | None:
        """Copy new chunks from their device blocks into the host tier (and on to the others).
        None if nothing is copied: every key is there already, or the host tier is full."""
        bpc = self.layout.blocks_per_chunk
        slots = self.manager.prepare_store(keys)
        if not slots:
            return None
        chosen = [i for i, key in enumerate(keys) if key in slots]
        blocks = [block_ids[i * bpc + b] for i in chosen for b in range(bpc)]
        new = [keys[i] for i in chosen]
        try:
            return self._submit("store", new, blocks, [slots[k] for k in new], request_id, group)
        except BaseException:
            self.manager.complete_store(new, request_id, success=False)
            raise

    def _submit(
        self,
        kind: str,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        slots: list[int],
        request_id: str,
        group: int,
    ) -> int:
        self._next_job += 1
        job = self._next_job
        for engine in self.engines:
            submit = engine.submit_load if kind == "load" else engine.submit_store
            submit(job, group, slots, block_ids)
        self._pending[job] = _Pending(kind, list(keys), list(block_ids), request_id, [])
        return job

    def step(self) -> list[Finished]:
        """End of a scheduler step: account for finished copies, start promotions."""
        finished = []
        for result in self._finished_jobs():
            pending = self._pending.pop(result.job_id)
            if pending.kind == "store":
                self.manager.complete_store(pending.keys, pending.request_id, result.success)
            else:
                self.manager.complete_load(pending.keys)
            direction = "store" if pending.kind == "store" else "load"
            self.manager.record_device_transfer(direction, result.bytes, result.seconds)
            finished.append(
                Finished(
                    result.job_id,
                    pending.kind,
                    tuple(pending.keys),
                    tuple(pending.block_ids),
                    result.success,
                    tuple(pending.sources),
                )
            )
        self.manager.on_schedule_end()
        return finished

    def _finished_jobs(self) -> list[TransferResult]:
        """Jobs every rank has finished, each as one result (failed if any rank failed)."""
        done = []
        for engine in self.engines:
            for result in engine.get_finished():
                reports = self._results.setdefault(result.job_id, [])
                reports.append(result)
                if len(reports) == len(self.engines):
                    del self._results[result.job_id]
                    failed = [r for r in reports if not r.success]
                    done.append(
                        failed[0]
                        if failed
                        else TransferResult(
                            result.job_id,
                            True,
                            sum(r.bytes for r in reports),
                            max(r.seconds for r in reports),
                        )
                    )
        return done

    def wait(self, job_ids: Sequence[int]) -> None:
        for engine in self.engines:
            engine.wait(job_ids)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.manager.touch(keys)

    def finish_request(self, request_id: str) -> None:
        self.manager.on_request_finished(request_id)

    def drain(self) -> list[Finished]:
        """Wait until every copy submitted so far is done, to the device, host and tiers."""
        self.wait(list(self._pending))
        finished = self.step()
        self.manager.drain()
        return finished

    def close(self) -> None:
        """Finish every copy in flight, stop the tiers, and release the host region. The
        region is released only once nothing can still copy into or out of it."""
        try:
            self.drain()
        finally:
            try:
                self._shutdown_engines()
            finally:
                try:
                    self.manager.shutdown()
                finally:
                    self._release_host()

    def _shutdown_engines(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    def _release_host(self) -> None:
        if self._pinned:
            unpin(self._host)
            self._pinned = False
        self.region.close()
