"""vLLM 0.33.0's canonical chunk layout (``canonical_format`` "v1-nhd" / "v1-hnd"), computed
without vLLM: where every (layer, block) page sits in a chunk, and which bytes of it each
tensor-parallel rank contributes. The connector's copies follow it; tests check it against
vLLM's own ``CanonicalPageMapping``s and files (tests/test_vllm_interop.py).

Device KV is vLLM 0.33's packed form, one tensor per layer of logical shape
``(num_blocks, kv heads, tokens, 2 * head_size)`` (K and V adjacent per head and token), kept
in memory token-major (NHD, vLLM's LBNHC) or head-major (HND, LBHNC). A page is one layer's
block with every rank's heads gathered, so TP=1, 2 and 4 write identical bytes:

- attention (full or sliding window): NHD ``[token][kv head][K|V]``, HND
  ``[kv head][token][K|V]``, all KV heads of the model. With fewer KV heads than ranks, each
  head is replicated on tp/heads ranks.
- MLA: ``[token][latent]``, replicated on every rank.
- Mamba: vLLM's opaque layout, rank r's state at r x its size; its bytes depend on the
  topology, so its namespace is not parallel-agnostic.

A chunk (``blocks_per_chunk`` blocks of one KV-cache group) has one area per canonical
tensor: vLLM's hybrid planner makes layer t of every group share device tensor t, so tensor t
is "the t-th layer of each group". Area t holds ``blocks_per_chunk`` pages of the largest
page among its layers, block-major. The chunk is vLLM's host row: the worker's device bytes
per block (every tensor, every rank's copy) x blocks_per_chunk, rounded up to 4 KiB. What a
group does not use is zeroed, so files are deterministic (vLLM leaves stale bytes there).

Replicated bytes are written by one of the ranks that hold them, chosen by chunk slot.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

ALIGNMENT = 4096
# vLLM's canonical_format_id per device layout (canonical_mapping.py, format version 1)
KV_LAYOUTS = {"NHD": "v1-nhd", "HND": "v1-hnd"}

# KV-cache dtypes, by torch name, and their element sizes.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class GeometryError(ValueError):
    """A model geometry, or a tensor or region measured against one, is not valid."""


class LayerKind(Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"

    @classmethod
    def parse(cls, value: str | LayerKind) -> LayerKind:
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(kind.value for kind in cls)
            raise GeometryError(f"layer type {value!r}: choose one of {accepted}") from None

    @property
    def is_attention(self) -> bool:
        return self in (LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW)


@dataclass(frozen=True)
class GroupGeometry:
    """One KV-cache group: layers of one kind sharing a block table.

    ``num_kv_heads`` counts the model's KV heads (all ranks); ``head_size`` is the head dim for
    attention and the latent width for MLA; ``state_bytes`` is one Mamba layer's state per
    block, all ranks together; ``sliding_window`` is in tokens.
    """

    kind: LayerKind
    layer_names: tuple[str, ...]
    tokens_per_block: int
    dtype: str = "bfloat16"
    num_kv_heads: int = 0
    head_size: int = 0
    sliding_window: int | None = None
    state_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayerKind.parse(self.kind))
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        where = f"group of {self.kind.value} layers"
        if not self.layer_names or len(set(self.layer_names)) != len(self.layer_names):
            raise GeometryError(f"{where}: layer_names must be distinct and not empty")
        if self.tokens_per_block <= 0:
            raise GeometryError(f"{where}: tokens_per_block must be positive")
        if self.dtype not in DTYPE_BYTES:
            raise GeometryError(
                f"{where}: dtype {self.dtype!r}: choose one of {', '.join(DTYPE_BYTES)}"
            )
        if self.kind.is_attention and (self.num_kv_heads <= 0 or self.head_size <= 0):
            raise GeometryError(f"{where}: num_kv_heads and head_size must be positive")
        if self.kind is LayerKind.MLA and self.head_size <= 0:
            raise GeometryError(f"{where}: head_size (the latent width) must be positive")
        if self.kind is LayerKind.MAMBA and self.state_bytes <= 0:
            raise GeometryError(f"{where}: state_bytes must be positive")
        if (self.kind is LayerKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise GeometryError(f"{where}: sliding_window is set for sliding-window groups only")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise GeometryError(f"{where}: sliding_window must be positive")

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """One layer's block, every rank's share."""
        tokens, elem = self.tokens_per_block, self.element_bytes
        if self.kind.is_attention:
            return 2 * self.num_kv_heads * tokens * self.head_size * elem
        if self.kind is LayerKind.MLA:
            return tokens * self.head_size * elem
        return self.state_bytes


@dataclass(frozen=True)
class ModelGeometry:
    groups: tuple[GroupGeometry, ...]
    blocks_per_chunk: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise GeometryError("a model geometry needs at least one KV-cache group")
        if self.blocks_per_chunk <= 0:
            raise GeometryError("blocks_per_chunk must be positive")
        names = [name for group in self.groups for name in group.layer_names]
        if len(set(names)) != len(names):
            raise GeometryError("a layer belongs to more than one group")

    def fingerprint(self) -> str:
        """Identifies the byte layout: equal for equal geometries, in any process."""
        described = json.dumps(asdict(self), sort_keys=True, default=lambda v: v.value)
        return hashlib.sha256(described.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Run:
    """``length`` bytes at ``page_offset`` in a page are this rank's, at ``local_offset`` in
    its own copy of the block (the device block rearranged to the page's order)."""

    page_offset: int
    local_offset: int
    length: int


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of each page of a group."""

    runs: tuple[Run, ...]
    local_page_bytes: int  # the rank's own bytes per page
    local_heads: int  # attention: KV heads on this rank
    first_head: int  # attention: the first of them
    holders: int  # ranks holding these same bytes (1: not replicated)
    holder_index: int  # this rank among them

    def writes(self, slot: int) -> bool:
        """Whether this rank writes replicated bytes into chunk ``slot``."""
        return slot % self.holders == self.holder_index


def canonical_format_id(kv_layout: str) -> str:
    """vLLM's name for the canonical bytes of a device layout ("NHD" -> "v1-nhd")."""
    try:
        return KV_LAYOUTS[kv_layout]
    except KeyError:
        raise GeometryError(
            f"kv_layout {kv_layout!r}: choose one of {', '.join(KV_LAYOUTS)}"
        ) from None


class ChunkLayout:
    """Offsets and sizes of the canonical chunk for one model geometry, device layout and
    tensor-parallel size (the row size depends on it where bytes are replicated)."""

    def __init__(self, geometry: ModelGeometry, tp_size: int = 1, kv_layout: str = "NHD") -> None:
        self.geometry = geometry
        self.blocks_per_chunk = geometry.blocks_per_chunk
        self.tp_size = tp_size
        self.kv_layout = kv_layout
        self.canonical_format = canonical_format_id(kv_layout)
        groups = geometry.groups
        # As vLLM's build_offloading_config decides: Mamba pages are topology-specific, and an
        # all-MLA model keeps one copy of its replicated latent per row.
        self.parallel_agnostic = all(g.kind is not LayerKind.MAMBA for g in groups)
        self.replicated_layout = self.parallel_agnostic and all(
            g.kind is LayerKind.MLA for g in groups
        )
        tensors = max(len(g.layer_names) for g in groups)
        self.area_pages = [
            max(g.page_bytes for g in groups if t < len(g.layer_names)) for t in range(tensors)
        ]
        self.area_offsets = [
            sum(self.area_pages[:t]) * self.blocks_per_chunk for t in range(tensors)
        ]
        local = [  # a rank's device bytes per block of tensor t
            max(
                self.rank_share(g, tp_size, 0).local_page_bytes
                for g, spec in enumerate(groups)
                if t < len(spec.layer_names)
            )
            for t in range(tensors)
        ]
        copies = 1 if self.replicated_layout else tp_size
        row = sum(local) * copies * self.blocks_per_chunk
        self.chunk_bytes = -(-row // ALIGNMENT) * ALIGNMENT

    def group(self, group: int) -> GroupGeometry:
        try:
            return self.geometry.groups[group]
        except IndexError:
            raise GeometryError(
                f"group {group}: the geometry has {len(self.geometry.groups)} groups"
            ) from None

    def used_ranges(self, group: int) -> list[tuple[int, int]]:
        """The byte ranges of a chunk this group's pages fill (the rest is zeroed)."""
        spec, bpc = self.group(group), self.blocks_per_chunk
        return [
            (self.area_offsets[i], self.area_offsets[i] + bpc * spec.page_bytes)
            for i in range(len(spec.layer_names))
        ]

    def group_bytes(self, group: int) -> int:
        """Bytes of a chunk this group's pages fill."""
        return sum(end - start for start, end in self.used_ranges(group))

    def page_offset(self, group: int, layer: int | str, block: int) -> int:
        """Offset of (layer, block) in a chunk of ``group``; ``layer`` by index or name."""
        spec = self.group(group)
        index = spec.layer_names.index(layer) if isinstance(layer, str) else layer
        if not 0 <= index < len(spec.layer_names) or not 0 <= block < self.blocks_per_chunk:
            raise GeometryError(f"(layer {layer}, block {block}) is not in a chunk of {group}")
        return self.area_offsets[index] + block * spec.page_bytes

    def rank_share(self, group: int, tp_size: int, rank: int) -> RankShare:
        """Which bytes of every page of ``group`` rank ``rank`` of ``tp_size`` contributes."""
        spec = self.group(group)
        if tp_size <= 0 or not 0 <= rank < tp_size:
            raise GeometryError(f"rank {rank} is not in a tensor-parallel group of {tp_size}")
        page = spec.page_bytes
        if spec.kind is LayerKind.MLA:
            return RankShare((Run(0, 0, page),), page, 0, 0, tp_size, rank)
        if spec.kind is LayerKind.MAMBA:
            if spec.state_bytes % tp_size:
                raise GeometryError(
                    f"Mamba state of {spec.state_bytes} bytes does not split over {tp_size} ranks"
                )
            part = spec.state_bytes // tp_size
            return RankShare((Run(rank * part, 0, part),), part, 0, 0, 1, 0)
        heads = spec.num_kv_heads
        if heads >= tp_size:
            if heads % tp_size:
                raise GeometryError(f"{heads} KV heads do not split over {tp_size} ranks")
            local, holders = heads // tp_size, 1
        else:
            if tp_size % heads:
                raise GeometryError(f"{heads} KV heads do not replicate over {tp_size} ranks")
            local, holders = 1, tp_size // heads
        first_head = (rank // holders) * local
        tokens = spec.tokens_per_block
        entry = 2 * spec.head_size * spec.element_bytes  # one head's K|V for one token
        if self.kv_layout == "HND":  # [head][token][K|V]: the rank's heads are one run
            runs: tuple[Run, ...] = (Run(first_head * tokens * entry, 0, local * tokens * entry),)
        else:  # [token][head][K|V]: one run per token
            runs = tuple(
                Run((n * heads + first_head) * entry, n * local * entry, local * entry)
                for n in range(tokens)
            )
        return RankShare(runs, local * tokens * entry, local, first_head, holders, rank % holders)

    def row_runs(self, group: int, share: RankShare) -> list[Run]:
        """A rank's runs over a whole chunk of ``group``: ``page_offset`` is in the chunk,
        ``local_offset`` in the rank's pages laid out contiguously (layer, block, local page).
        Adjacent runs are merged: at TP=1 each area is a single run."""
        spec = self.group(group)
        merged: list[Run] = []
        for layer in range(len(spec.layer_names)):
            for block in range(self.blocks_per_chunk):
                page = layer * self.blocks_per_chunk + block
                for run in share.runs:
                    chunk_offset = self.page_offset(group, layer, block) + run.page_offset
                    local_offset = page * share.local_page_bytes + run.local_offset
                    last = merged[-1] if merged else None
                    if (
                        last is not None
                        and last.page_offset + last.length == chunk_offset
                        and last.local_offset + last.length == local_offset
                    ):
                        merged[-1] = Run(
                            last.page_offset, last.local_offset, last.length + run.length
                        )
                    else:
                        merged.append(Run(chunk_offset, local_offset, run.length))
        return merged
