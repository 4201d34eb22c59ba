"""A tiny decoder-only transformer that serves prompts through a paged KV cache, with prefix
caching keyed by vLLM's block hash and the kvfs connector behind it.

The model: random weights from a fixed seed, RMSNorm, rotary positions, grouped-query
attention, SwiGLU; the KV cache is paged (blocks of ``tokens_per_block`` tokens, bf16, vLLM's
NHD layout) and sized by a block budget small enough to force evictions.

Prefill runs block by block: each block's queries attend to the keys of every earlier block,
read back from the paged cache, and its own. So a block's KV and logits are a function of
the tokens alone, computed by the same operations on tensors of the same shapes whichever
way the earlier blocks got into the cache (computed now, kept on the device, or loaded from a
tier): a reload that restores every byte gives exactly the logits of a full recompute, and
one wrong byte does not.

The engine caches whole chunks (``blocks_per_chunk`` blocks) on the device, least recently
used out first, and asks the connector for the chunks after its own hits.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvfs.connector.kv_connector import KVConnector
from kvfs.geometry import GroupGeometry, LayerKind, ModelGeometry
from kvfs.keys import BlockHasher, chunk_keys


@dataclass(frozen=True)
class ModelShape:
    vocab: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    ffn: int = 128
    tokens_per_block: int = 16

    @property
    def width(self) -> int:
        return self.heads * self.head_size


class TinyModel:
    def __init__(
        self, shape: ModelShape = ModelShape(), seed: int = 0, device: str = "cpu"
    ) -> None:
        self.shape = shape
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        s = shape

        def weight(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, generator=gen) / math.sqrt(dims[0])).to(self.device)

        self.embed = torch.randn(s.vocab, s.width, generator=gen).to(self.device)
        kv = s.kv_heads * s.head_size
        self.blocks = [
            {
                "wq": weight(s.width, s.width),
                "wk": weight(s.width, kv),
                "wv": weight(s.width, kv),
                "wo": weight(s.width, s.width),
                "w1": weight(s.width, s.ffn),
                "w3": weight(s.width, s.ffn),
                "w2": weight(s.ffn, s.width),
            }
            for _ in range(s.layers)
        ]
        self.lm_head = weight(s.width, s.vocab)
        self.layer_names = tuple(f"model.layers.{i}.self_attn" for i in range(s.layers))
        half = s.head_size // 2
        self._inv_freq = (1.0 / 10000 ** (torch.arange(half) / half)).to(self.device)

    def geometry(self, blocks_per_chunk: int) -> ModelGeometry:
        s = self.shape
        group = GroupGeometry(
            LayerKind.FULL_ATTENTION,
            self.layer_names,
            s.tokens_per_block,
            "bfloat16",
            num_kv_heads=s.kv_heads,
            head_size=s.head_size,
        )
        return ModelGeometry((group,), blocks_per_chunk)

    def new_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        s = self.shape
        # vLLM 0.33's packed view, (blocks, kv heads, tokens, K|V), kept token-major (NHD)
        shape = (num_blocks, s.tokens_per_block, s.kv_heads, 2 * s.head_size)
        return {
            name: torch.zeros(shape, dtype=torch.bfloat16, device=self.device).permute(0, 2, 1, 3)
            for name in self.layer_names
        }

    def prefill(
        self,
        tokens: Sequence[int],
        start: int,
        block_table: Sequence[int],
        cache: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Logits of positions start.. of ``tokens``; positions before ``start`` must already
        be in the cache blocks of ``block_table``. ``start`` is a multiple of the block size."""
        size = self.shape.tokens_per_block
        assert start % size == 0 and start < len(tokens)
        out = []
        for first in range(start, len(tokens), size):
            block = torch.tensor(tokens[first : first + size], device=self.device)
            out.append(self._block(block, first, block_table[: first // size + 1], cache))
        return torch.cat(out)

    def _block(
        self, tokens: torch.Tensor, first: int, table: Sequence[int], cache: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        s = self.shape
        n = len(tokens)
        positions = torch.arange(first, first + n, device=self.device)
        blocks = torch.tensor(list(table), device=self.device)
        x = self.embed[tokens]
        mask = positions[:, None] >= torch.arange(first + n, device=self.device)[None, :]
        for name, w in zip(self.layer_names, self.blocks, strict=True):
            h = _rms(x)
            q = self._rope((h @ w["wq"]).view(n, s.heads, s.head_size), positions)
            k = self._rope((h @ w["wk"]).view(n, s.kv_heads, s.head_size), positions)
            v = (h @ w["wv"]).view(n, s.kv_heads, s.head_size)
            layer = cache[name]
            d = s.head_size
            layer[table[-1], :, :n, :d] = k.transpose(0, 1).to(torch.bfloat16)
            layer[table[-1], :, :n, d:] = v.transpose(0, 1).to(torch.bfloat16)
            kv = layer[blocks].transpose(1, 2).float()  # (blocks, T, kv heads, K|V)
            keys = kv[..., :d].reshape(-1, s.kv_heads, d)[: first + n]
            values = kv[..., d:].reshape(-1, s.kv_heads, d)[: first + n]
            repeat = s.heads // s.kv_heads
            keys = keys.repeat_interleave(repeat, dim=1).transpose(0, 1)
            values = values.repeat_interleave(repeat, dim=1).transpose(0, 1)
            scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / math.sqrt(s.head_size)
            attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
            x = x + attn.transpose(0, 1).reshape(n, s.width) @ w["wo"]
            h = _rms(x)
            x = x + (torch.nn.functional.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]
        return _rms(x) @ self.lm_head

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self._inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b = x[..., ::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class Served:
    """One prompt served: where its tokens came from, and the logits it computed."""

    start: int  # first position computed
    logits: torch.Tensor
    tokens_from_device: int = 0
    tokens_from_host: int = 0
    tokens_from_fs: int = 0
    tokens_recomputed: int = 0
    seconds: float = 0.0
    steps_waited: int = 0
    sources: dict[str, int] = field(default_factory=dict)


class DeviceCache:
    """Device blocks in units of one chunk, cached by chunk key, least recently used out."""

    def __init__(self, num_blocks: int, blocks_per_chunk: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.units = num_blocks // blocks_per_chunk
        self._cached: dict[bytes, int] = {}  # key -> unit
        self._key_of: dict[int, bytes] = {}
        self._refs = [0] * self.units
        self._free: OrderedDict[int, None] = OrderedDict((u, None) for u in range(self.units))

    def blocks(self, unit: int) -> list[int]:
        return list(range(unit * self.blocks_per_chunk, (unit + 1) * self.blocks_per_chunk))

    def hits(self, keys: Sequence[bytes]) -> list[int]:
        """Units of the leading keys cached here, referenced for the caller."""
        units = []
        for key in keys:
            unit = self._cached.get(key)
            if unit is None:
                break
            units.append(unit)
        for unit in units:
            self.ref(unit)
        return units

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(
                f"{count} chunk units wanted, {len(self._free)} free: raise the budget"
            )
        units = []
        for _ in range(count):
            unit, _ = self._free.popitem(last=False)  # least recently used
            if (key := self._key_of.pop(unit, None)) is not None:
                del self._cached[key]  # evicted from the device
            self._refs[unit] = 1
            units.append(unit)
        return units

    def ref(self, unit: int) -> None:
        if self._refs[unit] == 0:
            del self._free[unit]
        self._refs[unit] += 1

    def release(self, unit: int) -> None:
        self._refs[unit] -= 1
        if self._refs[unit] == 0:
            self._free[unit] = None  # most recently used end

    def register(self, unit: int, key: bytes) -> None:
        if key not in self._cached and unit not in self._key_of:
            self._cached[key] = unit
            self._key_of[unit] = key


class TinyEngine:
    """Serves prompts one at a time: device prefix cache, then the connector, then compute."""

    def __init__(
        self,
        model: TinyModel,
        device_blocks: int,
        blocks_per_chunk: int,
        connector_config: dict | None,
        instance: str,
    ) -> None:
        self.model = model
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = blocks_per_chunk * model.shape.tokens_per_block
        self.cache = model.new_cache(device_blocks)
        self.device_cache = DeviceCache(device_blocks, blocks_per_chunk)
        self.hasher = BlockHasher("sha256_cbor", model.shape.tokens_per_block)
        self.connector = (
            KVConnector(
                connector_config,
                model.geometry(blocks_per_chunk),
                self.cache,
                "kvfs-test/tiny-transformer",
                instance,
                tokens_per_hash=model.shape.tokens_per_block,
            )
            if connector_config is not None
            else None
        )
        self._storing: dict[int, list[int]] = {}  # store job -> units it keeps referenced

    def serve(self, request_id: str, tokens: Sequence[int]) -> Served:
        started = time.perf_counter()
        hashes = self.hasher.block_hashes(tokens)
        keys = chunk_keys(hashes, 0, self.chunk_tokens, self.model.shape.tokens_per_block)
        keys = keys[: (len(tokens) - 1) // self.chunk_tokens]  # always compute the last token
        units = self.device_cache.hits(keys)
        on_device = len(units)
        loaded, sources, waited = self._load(request_id, keys[on_device:])
        reused = on_device + len(loaded)
        tail = -(-len(tokens) // self.chunk_tokens) - reused
        units += loaded + self.device_cache.allocate(tail)
        for unit, key in zip(units[:reused], keys, strict=False):
            self.device_cache.register(unit, key)
        table = [block for unit in units for block in self.device_cache.blocks(unit)]
        start = reused * self.chunk_tokens
        logits = self.model.prefill(tokens, start, table, self.cache)
        all_keys = chunk_keys(hashes, 0, self.chunk_tokens, self.model.shape.tokens_per_block)
        computed = list(range(reused, len(all_keys)))  # the full chunks computed now
        for index in computed:
            self.device_cache.register(units[index], all_keys[index])
        self._store(request_id, [all_keys[i] for i in computed], [units[i] for i in computed])
        for unit in units:
            self.device_cache.release(unit)
        if self.connector is not None:
            self.connector.finish_request(request_id)
        by_tier = {source: sources.count(source) * self.chunk_tokens for source in set(sources)}
        return Served(
            start=start,
            logits=logits,
            tokens_from_device=on_device * self.chunk_tokens,
            tokens_from_host=by_tier.get("host", 0),
            tokens_from_fs=sum(v for k, v in by_tier.items() if k != "host"),
            tokens_recomputed=len(tokens) - start,
            seconds=time.perf_counter() - started,
            steps_waited=waited,
            sources=by_tier,
        )

    def _load(self, request_id: str, keys: list[bytes]) -> tuple[list[int], list[str], int]:
        """Ask the connector for ``keys`` (waiting out RETRY step by step) and load the hits
        into newly allocated units: (units, source of each, steps waited)."""
        if self.connector is None or not keys:
            return [], [], 0
        steps = 0
        while (found := self.connector.lookup(keys, request_id)).retry:
            self.step()
            steps += 1
            time.sleep(0.0005)
        if not found.hits:
            return [], [], steps
        units = self.device_cache.allocate(found.hits)
        blocks = [block for unit in units for block in self.device_cache.blocks(unit)]
        job = self.connector.load(keys[: found.hits], blocks, request_id)
        self.connector.wait([job])
        [done] = [f for f in self.step() if f.job_id == job]
        if not done.success:  # the blocks hold nothing usable: recompute them
            for unit in units:
                self.device_cache.release(unit)
            return [], [], steps
        return units, list(done.sources), steps

    def _store(self, request_id: str, keys: list[bytes], units: list[int]) -> None:
        if self.connector is None or not keys:
            return
        blocks = [block for unit in units for block in self.device_cache.blocks(unit)]
        job = self.connector.store(keys, blocks, request_id)
        if job is not None:
            for unit in units:
                self.device_cache.ref(unit)  # the copy reads them: not reused before it ends
            self._storing[job] = units

    def step(self) -> list:
        if self.connector is None:
            return []
        finished = self.connector.step()
        for done in finished:
            for unit in self._storing.pop(done.job_id, []):
                self.device_cache.release(unit)
        return finished

    def drain(self) -> None:
        """Every store and load finished (the device units of stores released)."""
        if self.connector is not None:
            self.connector.engine.wait(list(self._storing))
            self.step()
            self.connector.drain()

    def close(self) -> None:
        if self.connector is not None:
            self.drain()
            self.connector.close()
