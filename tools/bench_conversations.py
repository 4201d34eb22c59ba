"""The seed's benchmark: prompt throughput as the conversation pool outgrows device and host memory.

The workload is the seed's, scaled down 16x in tokens: multi-turn conversations with a 12K-token
first prompt (768 here), 4K new tokens per turn (256), 8 turns, prefill only, and as many
requests in flight as the device holds conversations (the seed: 64 of 64). Device, host and
storage capacities are scaled together: the device holds ``--device-conversations`` whole
conversations, the host tier twice as many (it also holds what the device holds: every new
chunk is stored to it), the fs tier all. So as the pool grows the three regimes appear:
everything fits on the device; the host tier holds the overflow; past both knees only storage
keeps the prefixes.

Configurations, run side by side: no offload (the device prefix cache alone); the host tier
only; host + fs tier on a plain directory; host + fs tier on a kvfs mount (backed by a
directory on the same disk).

Prefill compute comes from a named cost profile (``--profile``): the model's FLOPs per token
(2 x parameters, plus 4 x layers x hidden x context for attention) on the GPU's dense BF16 peak
at a stated MFU, and the model's KV bytes per token. The engine sleeps for each step's compute
time, so every byte of I/O is real and runs concurrently: device blocks are CPU tensors of the
profile's exact KV size, copied by the transfer engine into the host region in /dev/shm, and
the fs tier writes and reads real chunk files (O_DIRECT where the directory takes it).

    python -m tools.bench_conversations [--pools 2 4 6 8 12 16 24] [--json] [--plot FILE]

It prints prompt tokens/s, per-tier hit ratios (shares of prompt tokens), TTFT p50/p99 and
bytes moved per tier, and the ratios the targets ask for past the host knee.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvfs import control_protocol, cpu_latency
from kvfs.connector.kv_connector import KVConnector
from kvfs.geometry import GroupGeometry, LayerKind, ModelGeometry
from kvfs.keys import BlockHasher, chunk_keys
from tools.scratch_mount import temporary_mount
from tools.tiny_model import DeviceCache

SCALE = 16  # tokens of the seed's workload per token here


@dataclass(frozen=True)
class CostProfile:
    name: str
    source: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    peak_flops: float  # dense BF16
    mfu: float

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # K and V, bf16

    def prefill_seconds(self, start: int, end: int) -> float:
        """Compute time of positions start..end-1 of one prompt."""
        n = end - start
        attention = 4 * self.layers * self.hidden * (start + end - 1) * n / 2
        return (2 * self.params * n + attention) / (self.peak_flops * self.mfu)


LLAMA_8B = dict(params=8.03e9, layers=32, hidden=4096, kv_heads=8, head_dim=128)
_LLAMA_SOURCE = (
    "meta-llama/Llama-3.1-8B config.json (32 layers, hidden 4096, 8 KV heads of 128: "
    "128 KiB of KV per token); "
)
PROFILES = {
    "llama3.1-8b-l4": CostProfile(
        "Llama-3.1-8B on one NVIDIA L4",
        _LLAMA_SOURCE + "NVIDIA L4 datasheet: 121 TFLOPS dense BF16; 50% MFU assumed",
        peak_flops=121e12,
        mfu=0.5,
        **LLAMA_8B,  # type: ignore[arg-type]
    ),
    "llama3.1-8b-h100": CostProfile(
        "Llama-3.1-8B on one NVIDIA H100 SXM",
        _LLAMA_SOURCE + "NVIDIA H100 datasheet: 989 TFLOPS dense BF16; 50% MFU assumed",
        peak_flops=989e12,
        mfu=0.5,
        **LLAMA_8B,  # type: ignore[arg-type]
    ),
}


@dataclass(frozen=True)
class Workload:
    first_prompt: int = 12_288 // SCALE
    per_turn: int = 4_096 // SCALE
    turns: int = 8
    tokens_per_block: int = 16
    step_tokens: int = 8_192 // SCALE  # prefill tokens one engine step computes

    @property
    def longest(self) -> int:
        return self.first_prompt + (self.turns - 1) * self.per_turn

    @property
    def blocks_per_conversation(self) -> int:
        return -(-self.longest // self.tokens_per_block)


@dataclass
class Request:
    conversation: int
    turn: int
    tokens: list[int]
    keys: list[bytes]
    admitted: float
    phase: str = "lookup"
    units: list[int] = field(default_factory=list)
    on_device: int = 0
    device_checked: bool = False
    load_job: int | None = None
    computed: int = 0
    sources: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"c{self.conversation}t{self.turn}"


@dataclass
class RunResult:
    config: str
    conversations: int
    seconds: float
    prompt_tokens: int
    tokens: dict[str, int]
    ttfts: list[float]
    bytes_moved: dict[str, int]
    daemon_cpu: float | None = None  # kvfs daemon CPU seconds per second of the run

    def row(self) -> dict[str, Any]:
        ttfts = sorted(self.ttfts)
        return {
            "config": self.config,
            "conversations": self.conversations,
            "tokens_per_s": round(self.prompt_tokens / self.seconds, 1),
            "hit_ratio": {k: round(v / self.prompt_tokens, 4) for k, v in self.tokens.items()},
            "ttft_p50": round(statistics.median(ttfts), 4),
            "ttft_p99": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
            "bytes": self.bytes_moved,
            "seconds": round(self.seconds, 2),
            **({"daemon_cpu": round(self.daemon_cpu, 2)} if self.daemon_cpu is not None else {}),
        }


class SimEngine:
    """A scheduler loop with a device prefix cache and the connector; compute is slept."""

    def __init__(
        self,
        profile: CostProfile,
        workload: Workload,
        device_blocks: int,
        connector_config: dict[str, Any] | None,
    ) -> None:
        self.profile, self.workload = profile, workload
        names = tuple(f"model.layers.{i}.self_attn" for i in range(profile.layers))
        t = workload.tokens_per_block
        group = GroupGeometry(
            LayerKind.FULL_ATTENTION, names, t, "bfloat16", profile.kv_heads, profile.head_dim
        )
        # vLLM 0.33's packed view (blocks, heads, tokens, K|V), token-major in memory (NHD)
        shape = (device_blocks, t, profile.kv_heads, 2 * profile.head_dim)
        self.kv = {
            name: torch.zeros(shape, dtype=torch.bfloat16).permute(0, 2, 1, 3) for name in names
        }
        self.device = DeviceCache(device_blocks, 1)
        self.connector = (
            KVConnector(
                connector_config,
                ModelGeometry((group,)),
                self.kv,
                "bench/llama-3.1-8b",
                f"bench-{uuid.uuid4().hex[:8]}",
                tokens_per_hash=t,
            )
            if connector_config is not None
            else None
        )
        self.hasher = BlockHasher("sha256_cbor", t)
        self._storing: dict[int, list[int]] = {}

    def run(
        self,
        config: str,
        conversations: int,
        concurrency: int,
        turns: Sequence[tuple[int, int]] | None = None,
    ) -> RunResult:
        """Every turn of ``conversations`` conversations, each after the one before; or, with
        ``turns``, just those (conversation, turn) pairs (tools/bench_fleet.py deals them)."""
        w, t = self.workload, self.workload.tokens_per_block
        streams = {c: self._stream(c) for c in range(conversations)}
        if turns is not None:
            streams = {c: self._stream(c) for c, _ in turns}
        hashes = {c: self.hasher.block_hashes(s) for c, s in streams.items()}
        waiting: deque[tuple[int, int]] = deque(
            ((c, 0) for c in range(conversations)) if turns is None else turns
        )
        active: list[Request] = []
        totals = dict.fromkeys(("device", "host", "fs", "recomputed"), 0)
        ttfts: list[float] = []
        prompt_tokens = 0
        started = time.perf_counter()
        while waiting or active:
            while waiting and len(active) < concurrency:
                c, turn = waiting.popleft()
                length = w.first_prompt + turn * w.per_turn
                keys = chunk_keys(hashes[c][: length // t], 0, t, t)
                active.append(Request(c, turn, streams[c][:length], keys, time.perf_counter()))
            for request in active:
                if request.phase == "lookup":
                    self._lookup(request)
            cost = self._compute([r for r in active if r.phase == "compute"])
            if cost:
                time.sleep(cost)
            for request in [r for r in active if r.phase == "done"]:
                active.remove(request)
                ttfts.append(time.perf_counter() - request.admitted)
                prompt_tokens += len(request.tokens)
                totals["device"] += request.on_device * t
                for source in request.sources:
                    totals["host" if source == "host" else "fs"] += t
                totals["recomputed"] += (
                    len(request.tokens) - (request.on_device + len(request.sources)) * t
                )
                if turns is None and request.turn + 1 < w.turns:
                    waiting.append((request.conversation, request.turn + 1))
            self._step(active)
            if not cost:
                time.sleep(0.0005)  # every request waits on I/O: let it run
        seconds = time.perf_counter() - started
        # The bytes: every store the run began, each tier's included (the cascades still in
        # flight at its end, untimed: on a loaded machine the fs tier's had not finished one).
        self.flush()
        return RunResult(
            config, conversations, seconds, prompt_tokens, totals, ttfts, self._bytes()
        )

    def _stream(self, conversation: int) -> list[int]:
        return _tokens(conversation, self.workload.longest)

    def flush(self) -> None:
        """Wait until every store has reached every tier (and free the blocks it held)."""
        if self.connector is None:
            return
        for done in self.connector.drain():
            for unit in self._storing.pop(done.job_id, []):
                self.device.release(unit)

    def _lookup(self, request: Request) -> None:
        t = self.workload.tokens_per_block
        usable = request.keys[: (len(request.tokens) - 1) // t]  # compute the last token
        if not request.device_checked:
            request.units = self.device.hits(usable)
            request.on_device = len(request.units)
            request.device_checked = True
        hits = 0
        if self.connector is not None and request.on_device < len(usable):
            found = self.connector.lookup(usable[request.on_device :], request.id)
            if found.retry:
                return
            hits = found.hits
        total = -(-len(request.tokens) // t)
        if not self.device.can_allocate(total - request.on_device):
            return  # device memory is busy (stores still reading blocks): wait a step
        loaded = self.device.allocate(hits)
        request.units += loaded + self.device.allocate(total - request.on_device - hits)
        request.computed = (request.on_device + hits) * t
        if hits:
            assert self.connector is not None
            keys = usable[request.on_device : request.on_device + hits]
            request.load_job = self.connector.load(keys, loaded, request.id)
            request.phase = "load"
        else:
            request.phase = "compute"

    def _compute(self, computing: list[Request]) -> float:
        """One step's prefill, first come first served within the token budget."""
        budget, cost = self.workload.step_tokens, 0.0
        for request in computing:
            n = min(budget, len(request.tokens) - request.computed)
            if n <= 0:
                break
            cost += self.profile.prefill_seconds(request.computed, request.computed + n)
            request.computed += n
            budget -= n
            if request.computed == len(request.tokens):
                self._finish(request)
        return cost

    def _finish(self, request: Request) -> None:
        t = self.workload.tokens_per_block
        full = len(request.tokens) // t
        for unit, key in zip(request.units[:full], request.keys, strict=False):
            self.device.register(unit, key)
        first_new = request.on_device + len(request.sources)
        new_units = request.units[first_new:full]
        if self.connector is not None and new_units:
            job = self.connector.store(request.keys[first_new:full], new_units, request.id)
            if job is not None:
                for unit in new_units:
                    self.device.ref(unit)
                self._storing[job] = new_units
            self.connector.finish_request(request.id)
        for unit in request.units:
            self.device.release(unit)
        request.phase = "done"

    def _step(self, active: list[Request]) -> None:
        if self.connector is None:
            return
        loads = {r.load_job: r for r in active if r.phase == "load"}
        for done in self.connector.step():
            for unit in self._storing.pop(done.job_id, []):
                self.device.release(unit)
            if (request := loads.get(done.job_id)) is not None:
                request.sources = list(done.sources) if done.success else []
                if not done.success:  # recompute what the load could not restore
                    request.computed = request.on_device * self.workload.tokens_per_block
                request.phase = "compute"

    def _bytes(self) -> dict[str, int]:
        if self.connector is None:
            return {}
        registry = self.connector.metrics.registry
        moved = {}
        for tier in ("host", "fs"):
            for direction in ("store", "load"):
                value = registry.get_sample_value(
                    "kvfs_connector_transfer_bytes_total", {"tier": tier, "direction": direction}
                )
                if value:
                    moved[f"{tier}_{direction}"] = int(value)
        return moved

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _tokens(conversation: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(conversation)
    return torch.randint(0, 128_000, (length,), generator=gen).tolist()


CONFIGS = ("no offload", "host only", "host + plain dir", "host + kvfs")


@contextmanager
def fs_root(
    config: str, work: Path, mount_options: list[str], settle: float
) -> Iterator[Path | None]:
    """The fs tier's directory for a configuration, emptied after the run."""
    run = work / uuid.uuid4().hex[:8]
    run.mkdir(parents=True)
    if config in ("host + kvfs", "host + plain dir"):
        # ext4 here allocates no inode freed in the last seconds (30 while its table block is
        # dirty, 5 once written): a run that creates chunk files right after the last one's
        # thousands went scans past them at every create (perf: recently_deleted).
        os.sync()
        time.sleep(settle)
    try:
        if config == "host + kvfs":
            with temporary_mount(run, *mount_options) as mnt:
                yield mnt
        elif config == "host + plain dir":
            (run / "plain").mkdir()
            yield run / "plain"
        else:
            yield None
    finally:
        shutil.rmtree(run, ignore_errors=True)


def run_one(
    config: str, pool: int, args: argparse.Namespace, profile: CostProfile, workload: Workload
) -> RunResult:
    chunk = profile.kv_bytes_per_token * workload.tokens_per_block
    per_conversation = workload.blocks_per_conversation
    # Room for the conversations, and for the blocks new chunks pin until they are stored.
    pinned = args.device_conversations * (workload.per_turn // workload.tokens_per_block + 1)
    device_blocks = args.device_conversations * per_conversation + pinned
    with fs_root(config, args.workdir, args.mount_options.split(), args.settle) as root:
        extra: dict[str, Any] | None = None
        if config != "no offload":
            extra = {"cpu_bytes_to_use": args.host_conversations * per_conversation * chunk}
            if root is not None:
                extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(root)}]
        engine = SimEngine(profile, workload, device_blocks, extra)
        daemon = int(os.getxattr(root, control_protocol.PID)) if config == "host + kvfs" else None
        before = _cpu_seconds(daemon)
        try:
            result = engine.run(config, pool, args.device_conversations)
        finally:
            engine.close()
        if daemon is not None:  # the mount daemon's share of a core while it served the run
            result.daemon_cpu = (_cpu_seconds(daemon) - before) / result.seconds
        return result


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, profile: CostProfile) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tokens = median_tokens(rows)
    for config in CONFIGS:
        points = sorted((pool, t) for (c, pool), t in tokens.items() if c == config)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=config)
    for knee, label in (
        (args.device_conversations, "device full"),
        (args.host_conversations, "host full"),  # it holds the device's chunks too
    ):
        ax.axvline(knee, color="grey", linestyle=":", linewidth=1)
        ax.text(knee, ax.get_ylim()[1] * 0.97, f" {label}", fontsize=8, va="top", color="grey")
    ax.set_xlabel("conversations in the pool")
    ax.set_ylabel("prompt tokens / s")
    ax.set_title(f"Multi-turn prefill throughput ({profile.name}, workload / {SCALE})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def median_tokens(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """Tokens/s per configuration and pool: the median of its runs (``--repeats``)."""
    runs: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        runs.setdefault((r["config"], r["conversations"]), []).append(r["tokens_per_s"])
    return {key: statistics.median(values) for key, values in runs.items()}


def summary(rows: list[dict[str, Any]], knee: int) -> dict[str, Any]:
    """Past the host knee: host + kvfs vs host only and vs host + plain directory."""
    by = median_tokens(rows)
    past = sorted({r["conversations"] for r in rows if r["conversations"] > knee})
    against = {"kvfs_vs_host_only": "host only", "kvfs_vs_plain_dir": "host + plain dir"}
    ratios = {
        pool: {
            name: round(by[("host + kvfs", pool)] / by[(config, pool)], 3)
            for name, config in against.items()
            if (config, pool) in by
        }
        for pool in past
        if ("host + kvfs", pool) in by
    }
    return {pool: found for pool, found in ratios.items() if found}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama3.1-8b-l4")
    parser.add_argument("--pools", type=int, nargs="+", default=[2, 4, 6, 8, 12, 16, 24])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--device-conversations", type=int, default=4, help="and requests in flight"
    )
    # The host tier holds what is on the device too (every new chunk is stored there): its
    # knee is at its own capacity, here twice the device's, as in the seed (64, then 128).
    parser.add_argument("--host-conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/kvfs-bench"))
    parser.add_argument(
        "--mount-options",
        default="",
        help="more options of the kvfs mount (default: none, the mount's own defaults: kvfs's "
        "own session with passthrough reads where --session auto may take it)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration per pool, in the given order and then reversed, and "
        "so on; the summary and the plot take the median (default: %(default)s)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=6.0,
        help="seconds to wait after a sync before a configuration with an fs tier, so that "
        "the files deleted before it do not slow its creates (default: %(default)s)",
    )
    parser.add_argument(
        "--cpu-latency",
        type=int,
        metavar="MICROSECONDS",
        help="hold a CPU latency request for the whole run, every target measured under it "
        "(kvfs mount's --cpu-latency; 0: idle CPUs poll); default: the machine's as it is",
    )
    # (no default file: a run of a few pools must not overwrite the whole sweep's plot)
    parser.add_argument("--plot", default="", help="PNG of the results ('' for none)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--replot", type=Path, help="summarise and plot a --json output again")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    workload = Workload(turns=args.turns)
    torch.set_num_threads(1)
    rows = json.loads(args.replot.read_text())["rows"] if args.replot else []
    with cpu_latency.held(args.cpu_latency):
        bound = None if args.replot else cpu_latency.current()  # (what holds: this, tuned...)
        for pool in [] if args.replot else args.pools:
            for repeat in range(args.repeats):
                # Forward, then reversed: what runs second on a busy machine runs slower.
                for config in args.configs[:: -1 if repeat % 2 else 1]:
                    result = run_one(config, pool, args, profile, workload).row()
                    rows.append({**result, "repeat": repeat, "cpu_latency_us": bound})
                    if not args.json:
                        print(_line(result), flush=True)
    knee = args.host_conversations
    ratios = summary(rows, knee)
    if args.plot:
        plot(rows, args, profile)
    if args.json:
        print(
            json.dumps(
                {"profile": profile.__dict__, "rows": rows, "past_host_knee": ratios}, indent=2
            )
        )
    else:
        print(f"\nprofile: {profile.name}: {profile.source}")
        print(f"past the host knee ({knee} conversations): {ratios}")
        print(f"CPU latency bound: {rows[0].get('cpu_latency_us') if rows else None} us")
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def _line(r: dict[str, Any]) -> str:
    hits = " ".join(f"{k}={v:.2f}" for k, v in r["hit_ratio"].items())
    moved = " ".join(f"{k}={v / 2**30:.1f}G" for k, v in r["bytes"].items())
    if "daemon_cpu" in r:
        moved += f"  daemon {r['daemon_cpu']:.2f} cores"
    return (
        f"{r['config']:<17} {r['conversations']:>3} conv  {r['tokens_per_s']:>8.0f} tok/s  "
        f"ttft p50 {r['ttft_p50']:.2f}s p99 {r['ttft_p99']:.2f}s  {hits}  {moved}"
    )


if __name__ == "__main__":
    sys.exit(main())
