"""vLLM 0.33.0's TieringOffloadingSpec with a worker that copies on CPU tensors.

vLLM's own worker (``CPUOffloadingWorker``, ``vllm/v1/kv_offload/cpu/gpu_worker.py``) asserts
CUDA/XPU device tensors and copies through CUDA streams with ``ops.swap_blocks_batch``
(``vllm._C``), and ``CPUOffloadingSpec.get_worker`` refuses a non-CUDA platform. Everything
else of vLLM's offloading path runs on CPU as shipped. This spec replaces only that last step:

* the host region is vLLM's ``SharedOffloadRegion`` (``/dev/shm/vllm_offload_<engine_id>``),
  opened by every TP rank as ``TieringOffloadingSpec.create_worker`` opens it, with vLLM's
  canonical (``create_next_canonical_view``) or per-worker (``create_next_worker_view``) views;
* the copy descriptors (source pointer, destination pointer, size) are computed by vLLM's
  ``SingleDirectionOffloadingHandler`` itself: ``_build_copy_plan`` from each layer's
  ``CanonicalPageMapping``, ``_fill_canonical_ops`` / ``_fill_direct_ops``, the sub-block
  skips of ``transfer_async`` and the writer rotation of ``_filter_writer_blocks``;
* only executing them differs: ``ctypes.memmove`` per descriptor, synchronously, where vLLM
  launches ``swap_blocks_batch`` on a stream.

So the bytes that land in the host region, and from there in the fs tier's files, are vLLM's.
Loaded through ``spec_module_path`` exactly as an out-of-tree spec is::

    {"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "tests.vllm_cpu_spec", ...}

``CpuKvfsOffloadingSpec`` is kvfs's ``KvfsOffloadingSpec`` (kvfs/connector/vllm_spec.py) with
the same CPU worker and nothing else changed: on a GPU the spec runs vLLM's CUDA worker as is.

Pinned to vLLM 0.33.0: it reads private names of ``gpu_worker`` (``PRIVATE_NAMES``), which
tests check before use (``missing_private_names``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvfs.connector.vllm_spec import KvfsOffloadingSpec

# What this module uses of vLLM beyond its public classes (present in vLLM 0.33.0).
PRIVATE_NAMES = {
    "vllm.v1.kv_offload.cpu.gpu_worker": (
        "SingleDirectionOffloadingHandler._fill_canonical_ops",
        "SingleDirectionOffloadingHandler._fill_direct_ops",
        "SingleDirectionOffloadingHandler._filter_writer_blocks",
        "SingleDirectionOffloadingHandler._estimate_max_copy_ops",
        "_build_copy_plan",
        "_canonical_block_sizes",
        "compute_sub_block_ptrs",
    ),
    "vllm.v1.kv_offload.tiering.spec": ("TieringOffloadingSpec._validate_canonical_refs",),
}


def missing_private_names() -> list[str]:
    """The private vLLM names this harness needs that the installed vLLM lacks."""
    import importlib

    missing = []
    for module_name, names in PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        for dotted in names:
            owner: Any = module
            for part in dotted.split("."):
                owner = getattr(owner, part, None)
            if owner is None:
                missing.append(f"{module_name}.{dotted}")
    return missing


class CpuCopyHandler(gpu_worker.SingleDirectionOffloadingHandler):
    """One direction (device → host or host → device) of vLLM's handler, on CPU tensors.

    ``__init__`` sets the attributes ``SingleDirectionOffloadingHandler.__init__`` sets, with the
    same shape checks minus the device assert and without streams or events; ``transfer_async``
    is vLLM's loop (group sizes, block indices, sub-block skips) filling the descriptors with
    vLLM's ``_fill_group_ops``, then runs them with memmove."""

    def __init__(
        self,
        device_tensors: list[torch.Tensor],
        host_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        to_host: bool,
        canonical_layout: bool,
    ) -> None:
        assert len(device_tensors) == len(host_tensors) > 0
        canonical_bytes = (
            gpu_worker._canonical_block_sizes(layer_refs_per_group, len(device_tensors))
            if canonical_layout
            else None
        )
        for t_idx, (device, host) in enumerate(zip(device_tensors, host_tensors, strict=True)):
            assert device.dtype == host.dtype == torch.int8
            assert device.ndim == host.ndim == 2
            assert device.device.type == host.device.type == "cpu"
            per_block = device.shape[1] if canonical_bytes is None else canonical_bytes[t_idx]
            assert host.shape[1] == per_block * blocks_per_chunk
        self.src_tensors = device_tensors if to_host else host_tensors
        self.dst_tensors = host_tensors if to_host else device_tensors
        self.gpu_to_cpu = to_host
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if to_host else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if to_host else 1
        self._canonical_copy_plans = (
            [
                [gpu_worker._build_copy_plan(ref, to_host) for ref in refs]
                for refs in layer_refs_per_group
            ]
            if canonical_layout
            else None
        )
        self._fill_group_ops = (
            self._fill_canonical_ops if canonical_layout else self._fill_direct_ops
        )
        scratch = device_tensors[0].shape[0] if canonical_layout else 0
        self._scratch_bases_src = np.empty(scratch, dtype=np.uint64)
        self._scratch_bases_dst = np.empty(scratch, dtype=np.uint64)
        self.finished: list[TransferResult] = []

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        device_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(device_spec, GPULoadStoreSpec)
        group_sizes, block_indices = device_spec.group_sizes, device_spec.block_indices
        assert len(group_sizes) == len(block_indices) == len(self.layer_refs_per_group)

        capacity = max(self._estimate_max_copy_ops(group_sizes), 1)
        srcs = np.empty(capacity, dtype=np.int64)
        dsts = np.empty(capacity, dtype=np.int64)
        sizes = np.empty(capacity, dtype=np.int64)
        src_offset = dst_offset = op_idx = num_bytes = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(group_sizes, block_indices, strict=True)
        ):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_count = cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_count = cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            op_idx, group_bytes = self._fill_group_ops(
                g_idx,
                group_src=src_spec.block_ids[src_offset : src_offset + src_count],
                group_dst=dst_spec.block_ids[dst_offset : dst_offset + dst_count],
                group_size=group_size,
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=srcs,
                all_dst=dsts,
                all_sizes=sizes,
                op_idx=op_idx,
            )
            num_bytes += group_bytes
            src_offset += src_count
            dst_offset += dst_count
        assert src_offset == len(src_spec.block_ids)
        assert dst_offset == len(dst_spec.block_ids)
        for src, dst, size in zip(
            srcs[:op_idx].view(np.uint64).tolist(),
            dsts[:op_idx].view(np.uint64).tolist(),
            sizes[:op_idx].tolist(),
            strict=True,
        ):
            ctypes.memmove(dst, src, size)
        self.finished.append(TransferResult(job_id, True, num_bytes, 0.0))
        return True

    def take_finished(self) -> list[TransferResult]:
        finished, self.finished = self.finished, []
        return finished


class CpuOffloadingWorker(OffloadingWorker):
    """``CPUOffloadingWorker`` on CPU: the same region views, two ``CpuCopyHandler``s."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
        canonical_layout: bool,
    ) -> None:
        self.region: SharedOffloadRegion | None = region
        canonical_bytes = (
            gpu_worker._canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
            if canonical_layout
            else None
        )
        device_tensors, host_tensors = [], []
        for t_idx, cache in enumerate(kv_caches.tensors):
            device_tensors.append(cache.tensor.view(torch.int8).view(-1, cache.page_size_bytes))
            host_tensors.append(
                region.create_next_canonical_view(canonical_bytes[t_idx] * blocks_per_chunk)
                if canonical_bytes is not None
                else region.create_next_worker_view(cache.page_size_bytes * blocks_per_chunk)
            )
        args = (device_tensors, host_tensors, blocks_per_chunk, kv_caches.group_data_refs)
        self._store = CpuCopyHandler(*args, to_host=True, canonical_layout=canonical_layout)
        self._load = CpuCopyHandler(*args, to_host=False, canonical_layout=canonical_layout)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._store.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._load.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._store.take_finished() + self._load.take_finished()

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy ran inside submit_*

    def shutdown(self) -> None:
        if self.region is not None:
            self._store.src_tensors.clear()
            self._store.dst_tensors.clear()
            self._load.src_tensors.clear()
            self._load.dst_tensors.clear()
            self.region.cleanup()
            self.region = None


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (primary host tier + secondary tiers, scheduler side
    untouched) whose worker copies on CPU. ``create_worker`` is ``TieringOffloadingSpec``'s
    with ``CpuOffloadingWorker`` in place of ``CPUOffloadingWorker``."""

    _cpu_worker: CpuOffloadingWorker | None = None

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CpuOffloadingWorker:  # type: ignore[override]
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            if self.config.canonical_layout:
                self._validate_canonical_refs(kv_caches)
            return CpuOffloadingWorker(
                kv_caches, self.blocks_per_chunk, region, self.config.canonical_layout
            )
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # CPUOffloadingSpec.get_worker, without its CUDA/XPU platform check
        if self._cpu_worker is None:
            self._cpu_worker = self.create_worker(kv_caches)
        return self._cpu_worker


class CpuKvfsOffloadingSpec(KvfsOffloadingSpec, CpuTieringOffloadingSpec):
    """kvfs's KvfsOffloadingSpec, its worker the CPU one above: the MRO puts
    ``CpuTieringOffloadingSpec.get_worker`` / ``create_worker`` before vLLM's, and
    ``KvfsOffloadingSpec`` defines neither, so everything else is kvfs's spec unchanged."""
