"""vLLM 0.33.0's OffloadingConnector, both sides, on CPU: the engine half of the interop tests.

``Engine`` builds what vLLM's engine core and workers build, from vLLM's own code, for a tiny
local model (a ``config.json`` only: no weights, no tokenizer, no network):

* a real ``VllmConfig`` per worker rank, with ``OffloadingConnector`` as the KV connector and
  vLLM's ``TieringOffloadingSpec`` loaded through ``spec_module_path`` (``tests.vllm_cpu_spec``,
  whose worker copies on CPU with vLLM's own copy plans), its built-in ``fs`` secondary tier
  writing to ``root_dir``, and ``"canonical_layout": true``;
* a hybrid model: four attention layers, even ones sliding-window (``SLIDING_WINDOW`` tokens),
  odd ones full attention, so two KV-cache groups that overlay one another in memory, planned by
  vLLM (``get_global_kv_cache_groups``, ``get_kv_cache_configs``,
  ``generate_scheduler_kv_cache_config``);
* the scheduler process: vLLM's ``Scheduler`` with the connector's scheduler side, fed real
  ``Request``s hashed with vLLM's block hasher, producing real ``SchedulerOutput``s;
* TP workers: one ``OffloadingConnector`` (worker role) per rank, each with its own KV cache from
  ``vllm.v1.worker.utils.allocate_kv_cache`` in the chosen layout (``NHD`` = ``LBNHC``, ``HND`` =
  ``LBHNC``) holding ``HEADS // tp`` heads. All ranks share one engine id, so they open the same
  ``/dev/shm`` host region as vLLM's workers do. Their outputs are merged by vLLM's
  ``KVOutputAggregator``, as the executor merges them.

``device="cuda"`` puts the KV cache on the GPU (tools/gpu_check.py ``--vllm-spec``: vLLM's own
CUDA worker); the CPU specs of tests/vllm_cpu_spec.py need ``"cpu"``.

Each step runs the scheduler, then every worker's connector calls in the order of vLLM's
``KVConnectorModelRunnerMixin._get_kv_connector_output`` (no model forward: the "model" samples
EOS at once), then ``Scheduler.update_from_output``.

The KV cache starts filled with deterministic random bytes that depend only on the layer, the
block id and the head, never on TP: ``Engine.block_kv`` reassembles all heads of a block from
the ranks' shards, so engines of different TP can be compared block for block.

Use::

    with Engine(root, model_dir, tp=2, layout="HND") as engine:
        stored = engine.store(PROMPT)        # device -> host -> fs; returns block ids, files
        loaded = engine.load(PROMPT)         # zero device KV and host region, fs -> host -> device
"""

from __future__ import annotations

import importlib
import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VLLM_VERSION = "0.33.0"
BLOCK_SIZE = 16  # tokens per block (= tokens per hash)
HEADS = 4  # KV heads of the whole model
HEAD_SIZE = 8
NUM_LAYERS = 4
SLIDING_WINDOW = 32  # tokens, for the even layers
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
EOS = 2
MAX_MODEL_LEN = 512  # tokens; the KV cache holds num_blocks * BLOCK_SIZE
LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}

# The tiny model: only what ModelConfig and transformers read (architecture, sizes).
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HEADS * 2 * HEAD_SIZE,
    "intermediate_size": 128,
    "num_attention_heads": HEADS * 2,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}

# vLLM names this harness uses that are not part of a stable API (vLLM 0.33.0), beyond those of
# tests.vllm_cpu_spec.PRIVATE_NAMES. Tests skip, naming what is missing, when one is gone.
ENGINE_NAMES = {
    "vllm.v1.core.kv_cache_planning": ("get_global_kv_cache_groups", "get_kv_cache_configs"),
    "vllm.v1.core.kv_cache_utils": (
        "generate_scheduler_kv_cache_config",
        "get_request_block_hasher",
        "init_none_hash",
    ),
    "vllm.v1.worker.utils": ("allocate_kv_cache",),
    "vllm.v1.kv_cache_layout": ("KVCacheLayout",),
    "vllm.distributed.kv_transfer.kv_connector.utils": ("KVOutputAggregator",),
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping": (
        "canonical_format_id",
    ),
    "vllm.v1.kv_offload.tiering.fs.manager": ("FileSystemTierManager",),
}


def unavailable() -> str | None:
    """Why this harness cannot run on the installed vLLM, or None when it can."""
    try:
        import einops  # noqa: F401  (vLLM's llama module imports it; requirements/vllm.txt)
        import vllm
    except ImportError as e:
        return f"needs vLLM {VLLM_VERSION} and its test requirements: {e}"
    if vllm.__version__ != VLLM_VERSION:
        return f"pinned to vLLM {VLLM_VERSION}, found {vllm.__version__}"
    try:
        from tests import vllm_cpu_spec
    except ImportError as e:
        return f"vLLM {vllm.__version__} lacks a name tests/vllm_cpu_spec.py imports: {e}"
    missing = vllm_cpu_spec.missing_private_names()
    for module_name, names in ENGINE_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    if missing:
        return f"vLLM {vllm.__version__} lacks what the harness uses: {', '.join(missing)}"
    return None


def write_tiny_model(directory: Path) -> Path:
    """A model directory holding only config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return directory


@dataclass
class RequestRun:
    """What one request did: its device block ids per KV-cache group (as the scheduler
    allocated them), how many prompt tokens the connector loaded (0 on a first store), and the
    chunk files it added under the fs tier's root (sorted)."""

    block_ids: tuple[list[int], ...]
    loaded_tokens: int
    files: list[Path]


class Engine:
    """vLLM's scheduler and ``tp`` workers with the OffloadingConnector; see the module doc."""

    def __init__(
        self,
        root_dir: str | Path,
        model_dir: Path,
        *,
        tp: int = 1,
        layout: str = "NHD",
        blocks_per_chunk: int = 2,
        num_blocks: int = 64,
        host_chunks: int = 32,
        seed: int = 0,
        extra_config: dict[str, Any] | None = None,
        device: str = "cpu",
    ) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        assert HEADS % tp == 0, "the harness shards heads evenly"
        self.root_dir = Path(root_dir)
        self.tp = tp
        self.layout = LAYOUTS.get(layout, layout)
        self.layout_name = {v: k for k, v in LAYOUTS.items()}.get(self.layout, layout)
        self.blocks_per_chunk = blocks_per_chunk
        if extra_config is not None:
            assert extra_config.get("blocks_per_chunk", blocks_per_chunk) == blocks_per_chunk
        self.engine_id = f"kvfs-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        dtype = torch.bfloat16
        # host region size: room for host_chunks rows (a generous row: every layer, all heads)
        row = 2 * BLOCK_SIZE * HEAD_SIZE * dtype.itemsize * HEADS * NUM_LAYERS * blocks_per_chunk
        default: dict[str, Any] = {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "tests.vllm_cpu_spec",
            "canonical_layout": True,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(root_dir), "n_read_threads": 2, "n_write_threads": 2}
            ],
        }
        # extra_config: another spec's config instead (the host size and chunk size stay the
        # engine's unless it gives them)
        self.extra_config: dict[str, Any] = {
            "cpu_bytes_to_use": host_chunks * row,
            "blocks_per_chunk": blocks_per_chunk,
            **(default if extra_config is None else extra_config),
        }

        def vllm_config(rank: int) -> Any:
            config = VllmConfig(
                model_config=ModelConfig(
                    model=str(model_dir),
                    dtype="bfloat16",
                    seed=0,
                    skip_tokenizer_init=True,
                    max_model_len=MAX_MODEL_LEN,
                ),
                cache_config=CacheConfig(
                    block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True
                ),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=4,
                    max_num_batched_tokens=MAX_MODEL_LEN,
                    max_model_len=MAX_MODEL_LEN,
                    enable_chunked_prefill=True,
                    is_encoder_decoder=False,
                ),
                kv_transfer_config=KVTransferConfig(
                    kv_connector="OffloadingConnector",
                    kv_role="kv_both",
                    engine_id=self.engine_id,
                    kv_connector_extra_config=json.loads(json.dumps(self.extra_config)),
                ),
                device_config=DeviceConfig(device),
                parallel_config=ParallelConfig(tensor_parallel_size=tp),
            )
            config.parallel_config.rank = rank
            # What a GPU engine core does and the CPU platform does not: keep the hybrid KV
            # cache manager on, and resolve the KV cache layout (resolve_kv_cache_layout).
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
            config.cache_config.kv_cache_layout = self.layout
            return config

        self.configs = [vllm_config(rank) for rank in range(tp)]
        specs = {
            name: (
                SlidingWindowSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=HEADS // tp,
                    head_size=HEAD_SIZE,
                    dtype=dtype,
                    sliding_window=SLIDING_WINDOW,
                )
                if i % 2 == 0
                else FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=HEADS // tp,
                    head_size=HEAD_SIZE,
                    dtype=dtype,
                )
            )
            for i, name in enumerate(LAYER_NAMES)
        }
        page = max(spec.page_size_bytes for spec in specs.values())
        groups = get_global_kv_cache_groups(self.configs[0], [specs] * tp)
        worker_configs = get_kv_cache_configs(
            self.configs[0], [specs] * tp, [page * len(specs) * num_blocks] * tp, groups
        )
        self.kv_cache_config = worker_configs[0]
        for config in self.configs:
            config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks

        self.scheduler = Scheduler(
            vllm_config=self.configs[0],
            kv_cache_config=generate_scheduler_kv_cache_config(worker_configs),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.configs[0]),
            block_size=BLOCK_SIZE,
        )
        self.workers: list[Any] = []
        self.kv: list[dict[str, torch.Tensor]] = []  # per rank: layer -> [B, H/tp, N, 2D] view
        try:
            for rank, config in enumerate(self.configs):
                worker = OffloadingConnector(config, KVConnectorRole.WORKER, worker_configs[rank])
                self.workers.append(worker)
                kv = allocate_kv_cache(
                    worker_configs[rank], torch.device(device), KVCacheLayout[self.layout]
                )
                self._fill(kv, rank, seed)
                worker.register_kv_caches(kv)
                self.kv.append(kv)
        except Exception:
            self.close()
            raise
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._requests = 0

    # -- the KV cache ---------------------------------------------------------------------------

    def _fill(self, kv: dict[str, torch.Tensor], rank: int, seed: int) -> None:
        """Random bits, the same for every TP: rank r gets heads [r*H/tp, (r+1)*H/tp) of a
        whole-model tensor per layer (layers overlaying one memory get the last one's)."""
        local = HEADS // self.tp
        for i, name in enumerate(LAYER_NAMES):
            tensor = kv[name]
            generator = torch.Generator().manual_seed(seed * 1000 + i)
            whole = torch.randint(
                -(2**15), 2**15, (tensor.shape[0], HEADS, *tensor.shape[2:]), generator=generator
            ).to(torch.int16)
            tensor.view(torch.int16).copy_(whole[:, rank * local : (rank + 1) * local])

    def block_kv(self, layer: str, block_id: int) -> torch.Tensor:
        """All heads of one device block of one layer, [H, N, 2D] as int16 (bf16 bits: random
        bits hold NaNs, which torch.equal would call unequal)."""
        return torch.cat([kv[layer][block_id].view(torch.int16).cpu() for kv in self.kv])

    def snapshot(self) -> dict[str, torch.Tensor]:
        """All heads of every block, per layer: [B, H, N, 2D] int16 copies."""
        return {
            name: torch.cat([kv[name].view(torch.int16).cpu() for kv in self.kv], dim=1).clone()
            for name in LAYER_NAMES
        }

    def canonical_tensors(self) -> list[tuple[str, ...]]:
        """The layers of each canonical KV tensor, in vLLM's order: layers whose views share
        memory form one tensor, numbered by first appearance walking the groups' layers
        (``offloading/worker.py:register_kv_caches``)."""
        tensors: dict[int, list[str]] = {}
        for layers in self.group_layers:
            for layer in layers:
                tensors.setdefault(self.kv[0][layer].data_ptr(), []).append(layer)
        return [tuple(layers) for layers in tensors.values()]

    @property
    def canonical_page_bytes(self) -> int:
        """One block of one layer, all heads: [N][H][K‖V] (NHD) or [H][N][K‖V] (HND)."""
        return BLOCK_SIZE * HEADS * 2 * HEAD_SIZE * torch.bfloat16.itemsize

    @property
    def used_chunk_bytes(self) -> int:
        """The bytes of a chunk file that carry KV: one area per canonical tensor. vLLM pads
        the rest of the host row (up to 4 KiB alignment, or unused copies) without zeroing it."""
        return len(self.canonical_tensors()) * self.blocks_per_chunk * self.canonical_page_bytes

    def canonical_chunk(
        self, group: int, block_ids: Sequence[int], kv: dict[str, torch.Tensor] | None = None
    ) -> bytes:
        """What a chunk of ``group`` holding device blocks ``block_ids`` must contain, computed
        here from the KV (``snapshot()`` or the live cache) independently of vLLM's code, as
        docs/research/vllm-plugins.md §1.2-1.3 describe vLLM's canonical format: for each
        canonical tensor, the group's layer in it, for each block, its canonical page."""
        kv = kv if kv is not None else self.snapshot()
        pages = []
        for tensor_layers in self.canonical_tensors():
            [layer] = [name for name in tensor_layers if name in self.group_layers[group]]
            for block_id in block_ids:
                page = kv[layer][block_id]  # [H, N, 2D]
                if self.layout == "LBNHC":
                    page = page.permute(1, 0, 2)
                pages.append(page.contiguous().numpy().tobytes())
        return b"".join(pages)

    def zero_kv(self) -> None:
        for kv in self.kv:
            for tensor in kv.values():
                tensor.zero_()

    def zero_host_region(self) -> None:
        """Zero the shared host region (every row), so a load can only be served by the fs
        tier."""
        region = self.manager.primary_tier.get_kv_memoryview()
        region.cast("B")[:] = bytes(region.nbytes)

    # -- vLLM objects ---------------------------------------------------------------------------

    @property
    def manager(self) -> Any:
        """The scheduler side's TieringOffloadingManager."""
        return self.scheduler.connector.connector_scheduler.manager

    @property
    def fs_tier(self) -> Any:
        """The one secondary tier under the manager: vLLM's FileSystemTierManager (or
        kvfs's KvfsTier, a subclass)."""
        [tier] = self.manager.secondary_tiers
        return tier

    @property
    def group_layers(self) -> list[tuple[str, ...]]:
        """The layer names of each KV-cache group, in group order."""
        return [tuple(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]

    def is_sliding(self, group: int) -> bool:
        """Whether a KV-cache group is the sliding-window one."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        return isinstance(spec, SlidingWindowSpec)

    def block_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """vLLM's block hashes of a prompt (its hasher, on a throwaway Request)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request("hash", list(tokens), SamplingParams(max_tokens=1), None)
        return [bytes(h) for h in self.block_hasher(request)]

    def expected_chunk_files(self, tokens: Sequence[int]) -> dict[int, list[Path]]:
        """Per group: the path vLLM's FileMapper gives each full chunk of ``tokens``."""
        from vllm.v1.kv_offload.base import make_offload_key

        hashes = self.block_hashes(tokens)
        bpc = self.blocks_per_chunk
        return {
            group: [
                Path(self.fs_tier.file_mapper.get_file_name(make_offload_key(hashes[last], group)))
                for last in range(bpc - 1, len(hashes), bpc)
            ]
            for group in range(len(self.group_layers))
        }

    def chunk_files(self) -> list[Path]:
        """Every chunk file under the root, sorted."""
        return sorted(self.root_dir.rglob("*.bin"))

    def config_json(self) -> dict[str, Any]:
        [path] = self.root_dir.glob("*/config.json")
        result: dict[str, Any] = json.loads(path.read_text())
        return result

    # -- running requests ----------------------------------------------------------------------

    def _step(self) -> Any:
        from vllm.forward_context import ForwardContext
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        req_ids = list(out.num_scheduled_tokens)
        outputs = []
        for worker in self.workers:  # KVConnectorModelRunnerMixin._get_kv_connector_output
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(context)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[[EOS] for _ in req_ids],
                    kv_connector_output=kv_output,
                )
            )
        self.scheduler.update_from_output(out, self.aggregator.aggregate(outputs))
        return out

    def _busy(self) -> bool:
        """The engine core's keep-stepping test: requests, or connector work in flight (stores,
        cascades to the fs tier, a reset's flush)."""
        return bool(self.scheduler.has_requests())

    def run(self, tokens: Sequence[int], timeout: float = 30) -> RequestRun:
        """Serve one request for ``tokens`` (one output token), then step until every store
        and cascade it started has finished: its chunks are on the fs tier."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._requests += 1
        req_id = f"req-{self._requests}"
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, EOS)
        self.scheduler.add_request(
            Request(req_id, list(tokens), params, None, block_hasher=self.block_hasher)
        )
        before = set(self.chunk_files())
        block_ids: tuple[list[int], ...] = ()
        loaded = 0
        deadline = time.monotonic() + timeout
        while self._busy() or not block_ids:
            assert time.monotonic() < deadline, f"{req_id} not done after {timeout}s"
            out = self._step()
            for new in out.scheduled_new_reqs:
                if new.req_id == req_id:
                    loaded = new.num_computed_tokens
                    block_ids = tuple(list(g) for g in new.block_ids)
            time.sleep(0.001)
        return RequestRun(block_ids, loaded, [f for f in self.chunk_files() if f not in before])

    def store(self, tokens: Sequence[int]) -> RequestRun:
        """A first request for ``tokens``: its KV goes device → host region → fs."""
        return self.run(tokens)

    def load(self, tokens: Sequence[int]) -> RequestRun:
        """The same prompt again after forgetting it everywhere but the fs tier: vLLM's
        prefix cache and host tier are reset, the device KV and host region zeroed, so what
        the request finds comes fs → host → device."""
        assert self.scheduler.reset_prefix_cache(reset_connector=True)
        deadline = time.monotonic() + 30
        while self._busy():  # the reset's flush reaches the workers, their reports come back
            assert time.monotonic() < deadline, "cache reset not flushed after 30s"
            self._step()
        self.zero_kv()
        self.zero_host_region()
        return self.run(tokens)

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.workers = []
        connector = getattr(self, "scheduler", None) and self.scheduler.connector
        if connector is not None:
            connector.shutdown()
            self.scheduler.connector = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
