"""Engines for the p2p tests: the connector's scheduler side (TieringManager) over a host
region of its own, with a ``p2p`` tier, and vLLM 0.33.0's own p2p tier beside it.

``Engine`` is one kvfs engine: ``put`` writes chunks into its host tier as a device store
would, ``ask`` runs lookups step by step (stepping its peers too, as their schedulers would),
``read`` pins what was found and returns its bytes. ``python -m tests.p2p_engine PORT PEER
SEED COUNT`` runs one in a process of its own (for kill -9): it puts ``COUNT`` chunks named
by ``SEED``, prints ``ready``, then steps until its stdin closes.

``VllmPeer`` is vLLM's ``P2PSecondaryTierManager`` with a host region, stepped as vLLM's
tiering manager steps it, its host tier (``ParentManager``) a dict of key -> row.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvfs.connector.config import ConnectorConfig
from kvfs.connector.manager import PrefixLookup, TieringManager
from kvfs.connector.tiers.p2p import P2PTier
from kvfs.run_config import KVCacheGroupConfig, RunConfig

MODEL = "kvfs-test/tiny-model"
LAYERS = ("layers.0", "layers.1")  # tests/vllm_tier.py's minimal_spec: the same namespace
ROW = 8192
SLOTS = 16


def run_config(model: str = MODEL) -> RunConfig:
    return RunConfig(
        model_name=model,
        tokens_per_hash=16,
        blocks_per_file=1,
        dtype="bfloat16",
        kv_cache_groups=(KVCacheGroupConfig(16, LAYERS),),
    )


def chunk(seed: int, index: int) -> tuple[bytes, bytes]:
    """A key (block hash + group 0, as vLLM's OffloadKey) and its ROW bytes."""
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    data = np.random.default_rng([seed, index]).integers(0, 256, ROW, dtype=np.uint8).tobytes()
    return digest + b"\0\0\0\0", data


def chunks(seed: int, count: int) -> dict[bytes, bytes]:
    return dict(chunk(seed, i) for i in range(count))


class Region:
    def __init__(self, rows: int = SLOTS, row: int = ROW) -> None:
        self._mmap = mmap.mmap(-1, rows * row)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(rows, row)
        self.view = memoryview(self.array)


class Engine:
    def __init__(
        self,
        port: int,
        peers: Sequence[str] = (),
        model: str = MODEL,
        slots: int = SLOTS,
        **tier: Any,
    ) -> None:
        self.region = Region(slots)
        self.id = f"127.0.0.1:{port}"
        config = ConnectorConfig.from_extra_config(
            {
                "cpu_bytes_to_use": slots * ROW,
                "lookup_timeout_s": 30,  # the tier's own timeout is the one under test
                "secondary_tiers": [{"type": "p2p", "port": port, "peers": list(peers), **tier}],
            }
        )
        self.manager = TieringManager(config, run_config(model), self.region.view)

    @property
    def tier(self) -> P2PTier:
        tier = self.manager.tiers[0]
        assert isinstance(tier, P2PTier)
        return tier

    def metric(self, name: str) -> float:
        value = self.manager.metrics.registry.get_sample_value(
            f"kvfs_tier_p2p_{name}" + ("" if name == "peers" else "_total"), {"tier": "p2p"}
        )
        return value or 0.0

    def step(self) -> None:
        self.manager.on_schedule_end()

    def put(self, data: dict[bytes, bytes]) -> None:
        keys = list(data)
        slots = self.manager.prepare_store(keys)
        assert slots is not None
        for key, slot in slots.items():
            self.region.array[slot] = np.frombuffer(data[key], dtype=np.uint8)
        self.manager.complete_store(keys, "put")

    def ready_with(self, *others: Any, timeout: float = 30) -> None:
        """Step until each of ``others`` (Engine or VllmPeer) and this engine see each other."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            for other in others:
                other.step()
            ready = {p.id for p in self.tier._ready_peers()}
            if all(o.id in ready and o.sees(self.id) for o in others):
                return
            time.sleep(0.005)
        raise AssertionError(f"{self.id}: no handshake with {[o.id for o in others]}")

    def sees(self, peer: str) -> bool:
        return any(p.id == peer for p in self.tier._ready_peers())

    def ask(
        self, keys: Sequence[bytes], request_id: str, *others: Any, timeout: float = 30
    ) -> tuple[PrefixLookup, float]:
        """Lookups, step after step, until no answer is RETRY: the answer and the seconds."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            found = self.manager.lookup_prefix(keys, request_id)
            if not found.retry:
                return found, time.monotonic() - started
            self.step()
            for other in others:
                other.step()
            time.sleep(0.002)
        raise AssertionError(f"lookups still RETRY after {timeout}s")

    def read(self, keys: Sequence[bytes]) -> list[bytes]:
        plan = self.manager.prepare_load(keys)
        try:
            return [self.region.array[slot].tobytes() for slot in plan.slots]
        finally:
            self.manager.complete_load(keys)

    def close(self) -> None:
        self.manager.shutdown()


# -- vLLM's own p2p tier ---------------------------------------------------------------------


def alias_nixl() -> None:
    """vLLM imports ``nixl._api``: the ``nixl`` meta package, which also pulls the CUDA 13
    wheel. With ``nixl-cu12`` alone, point the name at ``nixl_cu12`` (what the meta package
    does at import when it finds only that wheel)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        import nixl_cu12
        import nixl_cu12._api

        meta = types.ModuleType("nixl")
        meta._api = nixl_cu12._api  # type: ignore[attr-defined]
        meta.__path__ = []
        sys.modules["nixl"] = meta
        sys.modules["nixl._api"] = nixl_cu12._api
        del nixl_cu12


class VllmPeer:
    """vLLM 0.33.0's P2PSecondaryTierManager, as vLLM's tiering manager drives it."""

    def __init__(self, port: int, model: str = MODEL, slots: int = SLOTS) -> None:
        alias_nixl()
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.kv_offload.base import (
            LookupResult,
            ReqContext,
            RequestOffloadingContext,
            ScheduleEndContext,
        )
        from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob
        from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

        from tests.vllm_tier import minimal_spec

        init_none_hash(sha256)
        self.id = f"127.0.0.1:{port}"
        self.region = Region(slots)
        self.held: dict[bytes, int] = {}  # its host tier: key -> row
        spec = minimal_spec(model=model, layer_names=LAYERS)
        spec.config.parallel.data_parallel_index = 0
        self.tier = P2PSecondaryTierManager(
            spec, self.region.view, "p2p", host="127.0.0.1", port=port
        )
        self._ctx_cls = ReqContext
        self._end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self._lookup = LookupResult
        self.finished: list[Any] = []
        held, jobs = self.held, iter(range(10**6, 2 * 10**6))

        class Parent(ParentManager):
            def on_new_request(self, req_context: Any) -> Any:
                return RequestOffloadingContext()

            def lookup(self, key: Any, req_context: Any) -> Any:
                return LookupResult.HIT if bytes(key) in held else LookupResult.MISS

            def create_store_job(self, keys: Any, req_context: Any) -> Any:
                rows = np.array([held[bytes(k)] for k in keys])
                return TransferJob(next(jobs), list(keys), rows, False, req_context)

            def on_request_finished(self, req_context: Any) -> None:
                return None

        self.parent = Parent()

    def step(self) -> None:
        self.tier.serve_external_requests(self.parent)
        self.tier.on_schedule_end(self._end)
        self.finished += list(self.tier.get_finished_jobs())

    def sees(self, peer: str) -> bool:
        session = self.tier._sessions.get(peer)
        return session is not None and session.ready

    def put(self, data: dict[bytes, bytes]) -> None:
        for row, (key, value) in enumerate(data.items()):
            self.region.array[row] = np.frombuffer(value, dtype=np.uint8)
            self.held[key] = row

    def context(self, request_id: str, source: str) -> Any:
        host, port = source.rsplit(":", 1)
        ctx = self._ctx_cls(
            req_id=request_id,
            kv_transfer_params={
                "remote_kv_source": {
                    "kv_request_id": request_id,
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        self.tier.on_new_request(ctx)
        return ctx

    def ask(self, keys: Sequence[bytes], ctx: Any, *others: Any, timeout: float = 30) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answers = [self.tier.lookup(k, ctx) for k in keys]
            if self._lookup.RETRY not in answers:
                return answers
            self.step()
            for other in others:
                other.step()
            time.sleep(0.002)
        raise AssertionError("vLLM lookups still RETRY")

    def load(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int],
        ctx: Any,
        *others: Any,
        timeout: float = 30,
    ) -> Any:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(7, list(keys), np.array(rows), True, ctx)
        self.tier.submit_load(job)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            for other in others:
                other.step()
            for result in self.finished:
                if result.job_id == 7:
                    self.finished.remove(result)
                    return result
            time.sleep(0.002)
        raise AssertionError("vLLM load did not finish")

    def close(self) -> None:
        self.tier.shutdown()


def main(argv: Sequence[str]) -> None:
    port, peer, seed, count = int(argv[0]), argv[1], int(argv[2]), int(argv[3])
    engine = Engine(port, [peer] if peer != "-" else [])
    engine.put(chunks(seed, count))
    print("ready", flush=True)
    os.set_blocking(sys.stdin.fileno(), False)
    while True:
        engine.step()
        try:
            if sys.stdin.read() == "":
                break
        except (BlockingIOError, TypeError):
            pass
        time.sleep(0.002)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
