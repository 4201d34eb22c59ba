"""Batched, asynchronous copies between paged KV tensors and host chunk slots.

One engine per worker (TP rank). The chunk layout is vLLM's canonical one (kvfs/geometry.py).
A store gathers the job's device blocks, layer by layer, into a device staging buffer already
in the canonical page order (one gather kernel per layer), then copies the rank's runs into the
host slots (at TP=1 one copy per area of a chunk) and rank 0 zeroes what the group leaves
unused. A load runs the same steps backwards.

With CUDA the copies go on two dedicated streams (stores, loads), ordered after the work
already queued on the caller's stream by an event, and each job records an event at its end:
submitting never waits for the device, and ``get_finished`` only queries events. The host
region must be pinned (``host_memory.pin``) for the copies to be DMA. Without CUDA, in one
worker thread per direction, each layer's pages go between the blocks and the host slots in
one indexed copy, without staging (``_direct_copy``).

Contract with the caller (vLLM's worker contract): submit on the stream that wrote the blocks
(the copies are ordered after what it has queued); a stored job's device blocks stay untouched
until the job is reported finished, and may be freed at once then; a load is submitted only
for chunks already in the host slots, into device blocks allocated just before, and they are
valid once the job is reported finished. A job that fails is reported with success False; its
slots (store) or blocks (load) hold partial data and must be dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfs.geometry import ChunkLayout, GeometryError, GroupGeometry, LayerKind, Run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    bytes: int
    seconds: float
    error: str | None = None


@dataclass
class _GroupPlan:
    spec: GroupGeometry
    canon: list[torch.Tensor]  # per layer: view (num_blocks, *local page), canonical order
    runs: list[Run]  # this rank's runs over a chunk
    writes: Callable[[int], bool]  # does this rank write chunk slot s (replicated bytes)
    local_page_bytes: int
    num_blocks: int
    # per layer: this rank's part of that layer's pages in every host slot, a view of the host
    # region (num_slots, blocks per chunk, *local page), in canon's words; empty when staged
    host_pages: list[torch.Tensor]
    gaps: list[tuple[int, int]]  # chunk byte ranges the group does not use (zeroed on store)


@dataclass
class _Job:
    job_id: int
    bytes: int
    pending: _Pending
    keep: list[Any] = field(default_factory=list)  # tensors the device still reads or writes


class _Pending:
    """A job's work in flight on a lane."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def outcome(self) -> tuple[float, BaseException | None]:
        """(seconds the work took, its error); only once done."""
        raise NotImplementedError


class _CudaPending(_Pending):
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start, self._end = start, end

    def done(self) -> bool:
        return bool(self._end.query())

    def wait(self) -> None:
        self._end.synchronize()

    def outcome(self) -> tuple[float, BaseException | None]:
        return self._start.elapsed_time(self._end) / 1e3, None


class _ThreadPending(_Pending):
    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.exception()

    def outcome(self) -> tuple[float, BaseException | None]:
        error = self._future.exception()
        return (0.0 if error else self._future.result()), error


class _Failed(_Pending):
    def __init__(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return

    def outcome(self) -> tuple[float, BaseException | None]:
        return 0.0, self._error


class _Lane:
    """Where one direction's copies run: a CUDA stream, or a worker thread on CPU."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = (
            None if self._stream else ThreadPoolExecutor(1, thread_name_prefix=f"kvfs-{name}")
        )
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        self._scratch = [empty, empty]

    def scratch(self, staging: int, gather: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers reused by every job of this lane, grown to the largest asked for. Jobs of a
        lane run one after the other (one stream, or one thread), so reuse is safe, and the
        process neither allocates device memory per job nor faults in fresh host pages."""
        for i, size in enumerate((staging, gather)):
            if self._scratch[i].numel() < size:
                self._scratch[i] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._scratch[0], self._scratch[1]

    def submit(self, work: Callable[[], None]) -> _Pending:
        if self._stream is None:
            assert self._thread is not None
            return _ThreadPending(self._thread.submit(_timed, work))
        queued = torch.cuda.Event()
        # The caller's stream: what it queued on these blocks (the forward pass) comes first.
        queued.record(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(queued)
            start.record(self._stream)
            try:
                work()
            except BaseException as err:
                self._stream.synchronize()  # nothing of the failed job may still be running
                return _Failed(err)
            end.record(self._stream)
        return _CudaPending(start, end)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        elif self._stream is not None:
            self._stream.synchronize()


def _timed(work: Callable[[], None]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


class TransferEngine:
    """Device <-> host copies for rank ``rank`` of the layout's ``tp_size``.

    ``kv_caches`` maps every layer of the geometry to its paged tensor on this rank:

    - attention: vLLM's packed view (num_blocks, local_heads, tokens_per_block, 2 * head_size),
      in memory token-major for the layout's NHD, head-major for HND (any strides with the
      last dimension contiguous: vLLM's ``allocate_kv_cache`` views are taken as they are)
    - MLA: (num_blocks, tokens_per_block, latent width), every rank the whole latent
    - Mamba: (num_blocks, ...), this rank's state bytes per block, contiguous

    ``host`` is the host region as a uint8 tensor of shape (num_slots, chunk_bytes).
    """

    def __init__(
        self,
        layout: ChunkLayout,
        kv_caches: Mapping[str, torch.Tensor],
        host: torch.Tensor,
        rank: int = 0,
        scratch_bytes: int = 64 << 20,
        staged: bool | None = None,
    ) -> None:
        if host.dtype != torch.uint8 or host.dim() != 2 or host.device.type != "cpu":
            raise GeometryError("host must be a uint8 CPU tensor of shape (num_slots, chunk_bytes)")
        if host.shape[1] != layout.chunk_bytes:
            raise GeometryError(
                f"host slots hold {host.shape[1]} bytes; this geometry's chunk is "
                f"{layout.chunk_bytes} bytes"
            )
        known = {n for g in layout.geometry.groups for n in g.layer_names}
        if missing := sorted(known - kv_caches.keys()):
            raise GeometryError(f"kv_caches has no tensor for layers {missing}")
        if extra := sorted(kv_caches.keys() - known):
            raise GeometryError(f"kv_caches has layers the geometry does not describe: {extra}")
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1:
            raise GeometryError(f"kv_caches are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.layout = layout
        self.host = host
        self.tp_size, self.rank = layout.tp_size, rank
        self._scratch_bytes = scratch_bytes  # staging per lane: jobs go in pieces this big
        # Staging batches a job into a few large DMA copies; on CPU tensors, where device and
        # host memory are one, each layer's pages are copied straight to their places instead.
        self.staged = self.device.type != "cpu" if staged is None else staged
        if not self.staged and self.device.type != "cpu":
            raise GeometryError("copies without staging need the KV cache in CPU memory")
        self._plans = [
            self._plan(layout, g, kv_caches, layout.kv_layout)
            for g in range(len(layout.geometry.groups))
        ]
        self._stores = _Lane(self.device, "store")
        self._loads = _Lane(self.device, "load")
        self._jobs: dict[int, _Job] = {}

    def _plan(
        self, layout: ChunkLayout, group: int, kv_caches: Mapping[str, torch.Tensor], order: str
    ) -> _GroupPlan:
        spec = layout.group(group)
        share = layout.rank_share(group, self.tp_size, self.rank)
        canon = [
            _canonical_view(
                spec, name, kv_caches[name], share.local_heads, share.local_page_bytes, order
            )
            for name in spec.layer_names
        ]
        blocks = {view.shape[0] for view in canon}
        if len(blocks) != 1:
            raise GeometryError(f"the {spec.kind.value} layers have different block counts")
        word = canon[0].dtype
        inner = canon[0].shape[-1]
        bpc = layout.blocks_per_chunk

        def host_pages(layer: int) -> torch.Tensor:
            first = layout.page_offset(group, layer, 0)
            slots = self.host.shape[0]
            pages = self.host[:, first : first + bpc * spec.page_bytes].view(slots, bpc, -1)
            if spec.kind.is_attention:
                heads = slice(share.first_head, share.first_head + share.local_heads)
                tokens, kv_heads = spec.tokens_per_block, spec.num_kv_heads
                if order == "HND":
                    return pages.view(word).view(slots, bpc, kv_heads, tokens, inner)[:, :, heads]
                return pages.view(word).view(slots, bpc, tokens, kv_heads, inner)[:, :, :, heads]
            if spec.kind is LayerKind.MLA:
                return pages.view(word).view(slots, bpc, spec.tokens_per_block, inner)
            run = share.runs[0]
            return pages[..., run.page_offset : run.page_offset + run.length].view(word)

        edges = [0, *(x for r in layout.used_ranges(group) for x in r), layout.chunk_bytes]
        gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if a < b]
        return _GroupPlan(
            spec=spec,
            canon=canon,
            runs=layout.row_runs(group, share),
            writes=share.writes,
            local_page_bytes=share.local_page_bytes,
            num_blocks=blocks.pop(),
            # (staged copies never view the host region so: it need not be word-aligned)
            host_pages=[] if self.staged else [host_pages(layer) for layer in range(len(canon))],
            gaps=gaps,
        )

    # -- submitting -------------------------------------------------------------------------

    def submit_store(
        self, job_id: int, group: int, slots: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Copy chunks from device blocks into host ``slots``: chunk i is
        ``block_ids[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]``."""
        plan, slots, idx = self._validate(job_id, group, slots, block_ids)
        lane = self._stores
        if self.rank == 0:  # deterministic files: vLLM's reused rows keep stale bytes here
            for slot in slots:
                for start, end in plan.gaps:
                    self.host[slot, start:end].zero_()
        writing = sum(1 for s in slots if plan.writes(s))

        def direct() -> None:
            written = [c for c, s in enumerate(slots) if plan.writes(s)]
            if written:
                chosen = torch.tensor(written)
                blocks = idx.view(len(slots), -1).index_select(0, chosen).flatten()
                rows = torch.tensor([slots[c] for c in written])
                self._direct_copy(lane, plan, rows, blocks, to_host=True)

        def work() -> None:
            index = idx.to(self.device, non_blocking=True)
            for part, blocks, staging, gathered in self._batches(lane, plan, slots, index):
                for layer, canon in enumerate(plan.canon):
                    torch.index_select(canon, 0, blocks, out=gathered)
                    pages = staging[:, layer].view(canon.dtype)
                    pages.copy_(gathered.view(pages.shape))
                flat = staging.view(len(part), -1)
                mine = [i for i, s in enumerate(part) if plan.writes(s)]
                rows = [self.host[part[i]] for i in mine]
                self._copy_runs(plan.runs, rows, [flat[i] for i in mine], to_host=True)

        moved = writing * sum(run.length for run in plan.runs)
        self._start(job_id, moved, lane, work if self.staged else direct, [idx])

    def submit_load(
        self, job_id: int, group: int, slots: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Copy chunks from host ``slots`` into device blocks (laid out as in submit_store)."""
        plan, slots, idx = self._validate(job_id, group, slots, block_ids)
        lane = self._loads

        def direct() -> None:
            self._direct_copy(lane, plan, torch.tensor(slots), idx, to_host=False)

        def work() -> None:
            index = idx.to(self.device, non_blocking=True)
            for part, blocks, staging, gathered in self._batches(lane, plan, slots, index):
                rows = [self.host[s] for s in part]
                flat = staging.view(len(part), -1)
                self._copy_runs(plan.runs, rows, list(flat), to_host=False)
                for layer, canon in enumerate(plan.canon):
                    pages = staging[:, layer].view(canon.dtype)
                    gathered.view(pages.shape).copy_(pages)
                    canon.index_copy_(0, blocks, gathered)

        moved = len(slots) * sum(run.length for run in plan.runs)
        self._start(job_id, moved, lane, work if self.staged else direct, [idx])

    @staticmethod
    def _direct_copy(
        lane: _Lane, plan: _GroupPlan, rows: torch.Tensor, blocks: torch.Tensor, to_host: bool
    ) -> None:
        """Chunks between device blocks and host slots ``rows`` (``blocks``: each chunk's in
        turn) where both are in CPU memory: one indexed copy per layer and direction, its
        pages gathered into the lane's scratch first (Python builds no view per page). The
        scratch is reused, not allocated per layer: fresh pages cost a fault each (a store of
        48 chunks here faulted 24,576 of them)."""
        _, scratch = lane.scratch(0, len(blocks) * max(canon[0].nbytes for canon in plan.canon))
        for canon, host in zip(plan.canon, plan.host_pages, strict=True):
            words = scratch[: len(blocks) * canon[0].nbytes].view(canon.dtype)
            gathered = words.view(len(blocks), *canon.shape[1:])
            per_chunk = gathered.unflatten(0, (len(rows), -1))
            if to_host:
                torch.index_select(canon, 0, blocks, out=gathered)
                host.index_copy_(0, rows, per_chunk)
            else:
                torch.index_select(host, 0, rows, out=per_chunk)
                canon.index_copy_(0, blocks, gathered)

    def _batches(
        self, lane: _Lane, plan: _GroupPlan, slots: list[int], index: torch.Tensor
    ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The job in pieces that fit the lane's scratch: (the piece's slots, its block ids,
        staging (chunks, layers, blocks, local page), one layer's gathered pages)."""
        bpc, layers, page = self.layout.blocks_per_chunk, len(plan.canon), plan.local_page_bytes
        per_chunk = layers * bpc * page
        step = max(1, self._scratch_bytes // per_chunk)
        staging_buf, gather_buf = lane.scratch(step * per_chunk, step * bpc * page)
        for first in range(0, len(slots), step):
            part = slots[first : first + step]
            n = len(part)
            staging = staging_buf[: n * per_chunk].view(n, layers, bpc, page)
            words = gather_buf[: n * bpc * page].view(plan.canon[0].dtype)
            gathered = words.view(n * bpc, *plan.canon[0].shape[1:])
            yield part, index[first * bpc : (first + n) * bpc], staging, gathered

    def _validate(
        self, job_id: int, group: int, slots: Sequence[int], block_ids: Sequence[int]
    ) -> tuple[_GroupPlan, list[int], torch.Tensor]:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        if not 0 <= group < len(self._plans):
            raise ValueError(f"group {group}: the geometry has {len(self._plans)} groups")
        plan = self._plans[group]
        slots = [int(s) for s in slots]
        blocks = [int(b) for b in block_ids]
        if not slots:
            raise ValueError("a transfer needs at least one chunk")
        if len(blocks) != len(slots) * self.layout.blocks_per_chunk:
            raise ValueError(
                f"{len(slots)} chunks of {self.layout.blocks_per_chunk} blocks need "
                f"{len(slots) * self.layout.blocks_per_chunk} block ids, not {len(blocks)}"
            )
        if len(set(slots)) != len(slots) or not all(0 <= s < self.host.shape[0] for s in slots):
            raise ValueError(f"slots must be distinct and within 0..{self.host.shape[0] - 1}")
        if len(set(blocks)) != len(blocks) or not all(0 <= b < plan.num_blocks for b in blocks):
            raise ValueError(f"block ids must be distinct and within 0..{plan.num_blocks - 1}")
        idx = torch.tensor(blocks, dtype=torch.int64)
        if self.device.type == "cuda":
            idx = idx.pin_memory()
        return plan, slots, idx

    def _start(
        self, job_id: int, moved: int, lane: _Lane, work: Callable[[], None], keep: list[Any]
    ) -> None:
        self._jobs[job_id] = _Job(job_id, moved, lane.submit(work), keep)

    @staticmethod
    def _copy_runs(
        runs: list[Run], rows: list[torch.Tensor], chunks: list[torch.Tensor], to_host: bool
    ) -> None:
        """Every run of every chunk between a host row and the chunk's staging bytes."""
        host_parts, staged_parts = [], []
        for row, chunk in zip(rows, chunks, strict=True):
            for run in runs:
                host_parts.append(row[run.page_offset : run.page_offset + run.length])
                staged_parts.append(chunk[run.local_offset : run.local_offset + run.length])
        if to_host:
            _copy_all(host_parts, staged_parts)
        else:
            _copy_all(staged_parts, host_parts)

    # -- completion -------------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call; never waits."""
        finished = [job for job in self._jobs.values() if job.pending.done()]
        return [self._report(job) for job in finished]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs are done; they are still reported by get_finished."""
        for job_id in job_ids:
            if (job := self._jobs.get(job_id)) is not None:
                job.pending.wait()

    def _report(self, job: _Job) -> TransferResult:
        del self._jobs[job.job_id]
        seconds, error = job.pending.outcome()
        if error is not None:
            log.warning("transfer job %d failed: %s", job.job_id, error)
            return TransferResult(job.job_id, False, 0, seconds, str(error))
        return TransferResult(job.job_id, True, job.bytes, seconds)

    def shutdown(self) -> None:
        self._stores.shutdown()
        self._loads.shutdown()


def _canonical_view(
    spec: GroupGeometry,
    name: str,
    tensor: torch.Tensor,
    local_heads: int,
    local_page_bytes: int,
    order: str,
) -> torch.Tensor:
    """The layer's tensor as (num_blocks, *page) in canonical byte order: a view, so a gather
    from it writes canonical pages and a scatter into it writes the device's order. Its dtype
    is a plain word as wide as the contiguous inner bytes allow: the copies move bytes, and
    wide words are faster (on CPU, a uint8 gather in a worker thread is 20x slower)."""
    tokens = spec.tokens_per_block
    if spec.kind is LayerKind.MAMBA:
        if not tensor.is_contiguous() or tensor.dim() < 1:
            raise GeometryError(f"layer {name}: a Mamba state tensor must be contiguous")
        flat = tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
        if flat.shape[1] != local_page_bytes:
            raise GeometryError(
                f"layer {name}: {flat.shape[1]} state bytes per block on this rank, "
                f"the geometry says {local_page_bytes}"
            )
        return flat.view(_word(flat.shape[1]))
    dtype = getattr(torch, spec.dtype)
    if tensor.dtype != dtype:
        raise GeometryError(f"layer {name}: dtype {tensor.dtype}, the geometry says {dtype}")
    if spec.kind is LayerKind.MLA:
        want: tuple[int, ...] = (tokens, spec.head_size)
    else:
        want = (local_heads, tokens, 2 * spec.head_size)
    if tensor.dim() != 1 + len(want) or tuple(tensor.shape[1:]) != want:
        raise GeometryError(
            f"layer {name}: shape {tuple(tensor.shape)}, expected (num_blocks, "
            f"{', '.join(map(str, want))}) for {spec.kind.value}"
        )
    if tensor.stride(-1) != 1:
        raise GeometryError(f"layer {name}: the head dimension must be contiguous")
    if spec.kind is LayerKind.MLA:
        return tensor.view(_word(spec.head_size * spec.element_bytes))
    raw = tensor.view(_word(2 * spec.head_size * spec.element_bytes))
    # the logical (block, head, token) view in the page's order: token-major for NHD
    return raw.permute(0, 2, 1, 3) if order == "NHD" else raw


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Pairwise copies, asynchronous between device and pinned host memory. Within one device
    the loop runs in C++ (``_foreach_copy_``); across devices there are few copies, one per
    chunk at TP=1, each a DMA of its own."""
    if not targets:
        return
    if targets[0].device == sources[0].device:
        torch._foreach_copy_(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source, non_blocking=True)


def _word(inner_bytes: int) -> torch.dtype:
    for dtype in (torch.int64, torch.int32, torch.int16):
        if inner_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8
