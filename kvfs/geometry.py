"""The canonical host layout of a chunk: where every (layer, block) page sits, and which bytes
of it each tensor-parallel rank contributes.

A chunk is ``blocks_per_chunk`` consecutive blocks of one KV-cache group, all of the group's
layers. Its bytes are the group's pages, layer-major then block:

    page(layer i, block b) at offset (i * blocks_per_chunk + b) * page_bytes

and the chunk size is the largest group's, rounded up to 4 KiB (one size for every file of a
configuration, as vLLM's fs tier needs; a smaller group leaves the tail unused). A page holds
one layer's block with every rank's share gathered, so TP=1, 2 and 4 write identical bytes:

- attention (full or sliding window): ``[K|V][kv head][token][head dim]``, all KV heads of the
  model. A rank holding heads h0..h1 contributes two runs, its K heads and its V heads. With
  fewer KV heads than ranks, each head is replicated on tp/heads ranks.
- MLA: ``[token][latent]``, the compressed latent (kv_lora_rank + rope dims), replicated on
  every rank.
- Mamba: the layer's state for the block as one fixed-size byte run, split evenly, rank r
  contributing the r-th part.

Replicated bytes are written by one of the ranks that hold them, chosen by chunk slot so that
the work spreads; every rank reads them back. For attention the page is vLLM's canonical HND
page (K then V, heads, tokens), whatever order the device keeps the heads and tokens in.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum

ALIGNMENT = 4096
# Names this byte layout in the run configuration (vLLM's canonical_format field), so its
# chunks never share a namespace with vLLM's own layouts, whose bytes differ.
CANONICAL_FORMAT = "kvfs-v1"

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


class ChunkLayout:
    """Offsets and sizes of the canonical chunk for one model geometry."""

    def __init__(self, geometry: ModelGeometry) -> None:
        self.geometry = geometry
        self.blocks_per_chunk = geometry.blocks_per_chunk
        used = max(self.group_bytes(g) for g in range(len(geometry.groups)))
        self.chunk_bytes = -(-used // ALIGNMENT) * ALIGNMENT

    def group(self, group: int) -> GroupGeometry:
        try:
            return self.geometry.groups[group]
        except IndexError:
            raise GeometryError(
                f"group {group}: the geometry has {len(self.geometry.groups)} groups"
            ) from None

    def group_bytes(self, group: int) -> int:
        """Bytes of a chunk this group uses (the rest, up to chunk_bytes, is padding)."""
        spec = self.group(group)
        return len(spec.layer_names) * self.blocks_per_chunk * spec.page_bytes

    def page_offset(self, group: int, layer: int | str, block: int) -> int:
        """Offset of (layer, block) in a chunk of ``group``; ``layer`` by index or name."""
        spec = self.group(group)
        index = spec.layer_names.index(layer) if isinstance(layer, str) else layer
        if not 0 <= index < len(spec.layer_names) or not 0 <= block < self.blocks_per_chunk:
            raise GeometryError(f"(layer {layer}, block {block}) is not in a chunk of {group}")
        return (index * self.blocks_per_chunk + block) * spec.page_bytes

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
        head_bytes = spec.tokens_per_block * spec.head_size * spec.element_bytes
        half = local * head_bytes  # the rank's K (or V) heads
        runs = tuple(Run((kv * heads + first_head) * head_bytes, kv * half, half) for kv in (0, 1))
        return RankShare(runs, 2 * half, local, first_head, holders, rank % holders)

    def row_runs(self, group: int, share: RankShare) -> list[Run]:
        """A rank's runs over a whole chunk of ``group``: ``page_offset`` is in the chunk,
        ``local_offset`` in the rank's pages laid out contiguously (layer, block, local page).
        Adjacent runs are merged: at TP=1 a chunk is a single run."""
        spec = self.group(group)
        pages = len(spec.layer_names) * self.blocks_per_chunk
        merged: list[Run] = []
        for page in range(pages):
            for run in share.runs:
                chunk_offset = page * spec.page_bytes + run.page_offset
                local_offset = page * share.local_page_bytes + run.local_offset
                last = merged[-1] if merged else None
                if (
                    last is not None
                    and last.page_offset + last.length == chunk_offset
                    and last.local_offset + last.length == local_offset
                ):
                    merged[-1] = Run(last.page_offset, last.local_offset, last.length + run.length)
                else:
                    merged.append(Run(chunk_offset, local_offset, run.length))
        return merged
