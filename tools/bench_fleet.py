"""A fleet of engines over one cache: conversations that move between engines keep their prefixes.

    python -m tools.bench_fleet [--engines 3] [--conversations 36] [--turns 6] [--json]
                                [--plot FILE] [--configs ...]

N engine processes (tools/bench_conversations.py's SimEngine: a device prefix cache, kvfs's
connector with a host tier and an fs tier, the prefill compute slept from the cost profile, all
I/O real) run the seed's multi-turn workload in rounds: round k is turn k of every conversation,
dealt to the engines, and the next round starts when every engine has finished its turns and
its stores have reached every tier. Where a turn runs:

  sticky  conversation c always on engine c mod N (a router with session affinity)
  moving  turn k of conversation c on engine (c + k) mod N (every turn on another engine)

Where the engines find chunks past their own host tier:

  alone   each engine its own kvfs mount over its own backing directory
  shared  each engine its own kvfs mount (``--shared host-<i>``) over one backing directory
  p2p     no fs tier: the other engines' host tiers, through the p2p tier (ZMQ + NIXL on
          loopback); an engine that has finished a round keeps serving its peers until all have

It prints, per configuration, the fleet's prompt tokens/s (all prompt tokens over the time of
all rounds, each round as long as its slowest engine) and hit ratio (the share of prompt tokens
not recomputed, by where they came from), then each configuration's ratios to the engines alone
with sticky conversations, all measured in one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from kvfs import control_protocol
from tools.bench_conversations import PROFILES, SimEngine, Workload

KVFS = [sys.executable, "-m", "kvfs.cli"]
CONFIGS = ("alone, sticky", "alone, moving", "shared, moving", "p2p, moving")


Turns = list[tuple[int, int]]  # (conversation, turn) pairs


def deal(conversations: int, turns: int, engines: int, moving: bool) -> list[list[Turns]]:
    """Per engine, per round, the turns it runs."""
    plan: list[list[Turns]] = [[[] for _ in range(turns)] for _ in range(engines)]
    for turn in range(turns):
        for c in range(conversations):
            plan[(c + turn) % engines if moving else c % engines][turn].append((c, turn))
    return plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiers(config: str, engines: int, roots: list[Path]) -> list[list[dict[str, Any]]]:
    """Each engine's secondary tiers."""
    if not config.startswith("p2p"):
        return [[{"type": "fs", "root_dir": str(root)}] for root in roots]
    ports = [free_port() for _ in range(engines)]
    return [
        [
            {
                "type": "p2p",
                "port": port,
                "peers": [f"127.0.0.1:{p}" for p in ports if p != port],
            }
        ]
        for port in ports
    ]


@contextmanager
def fleet_mounts(config: str, engines: int, work: Path, options: list[str]) -> Iterator[list[Path]]:
    """One kvfs mount per engine: over one shared backing directory, or each over its own;
    none for p2p."""
    if config.startswith("p2p"):
        yield []
        return
    run = work / uuid.uuid4().hex[:8]
    shared = config.startswith("shared")
    mounted: list[Path] = []
    try:
        for i in range(engines):
            mnt, backing = run / f"mnt{i}", run / ("backing" if shared else f"backing{i}")
            mnt.mkdir(parents=True)
            backing.mkdir(exist_ok=True)
            host = ["--shared", f"host-{i}"] if shared else []
            cmd = [*KVFS, "mount", str(mnt), "--backing", str(backing), *host, *options]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
            mounted.append(mnt)
        yield mounted
    finally:
        for mnt in mounted:
            if subprocess.run([*KVFS, "umount", str(mnt)], stdout=sys.stderr).returncode:
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        shutil.rmtree(run, ignore_errors=True)


def engine_main(
    index: int,
    secondary: list[dict[str, Any]],
    rounds: list[Turns],
    args: dict[str, Any],
    done: Any,
    results: Any,
) -> None:
    """One engine: its turns of each round, then its stores flushed, in step with the others
    (stepping its connector while it waits: a p2p tier serves its peers only then)."""
    os.dup2(2, 1)  # stdout is the report's (--json): NIXL and UCX log to it
    torch.set_num_threads(1)
    profile, workload = PROFILES[args["profile"]], Workload(turns=args["turns"])
    chunk = profile.kv_bytes_per_token * workload.tokens_per_block
    per_conversation = workload.blocks_per_conversation
    pinned = args["device_conversations"] * (workload.per_turn // workload.tokens_per_block + 1)
    device_blocks = args["device_conversations"] * per_conversation + pinned
    extra = {
        "cpu_bytes_to_use": args["host_conversations"] * per_conversation * chunk,
        "secondary_tiers": secondary,
    }
    engine = SimEngine(profile, workload, device_blocks, extra)
    seconds, tokens, prompt = [], Counter[str](), 0
    try:
        for k, turns in enumerate(rounds):
            wait_round(engine, done, args["engines"] * k)
            start = time.perf_counter()
            if turns:
                result = engine.run("fleet", 0, args["device_conversations"], turns)
                tokens.update(result.tokens)
                prompt += result.prompt_tokens
            engine.flush()  # the next round may run these conversations elsewhere
            for tier in secondary:  # and look for them there
                if tier["type"] == "fs":
                    settle(tier["root_dir"])
            seconds.append(time.perf_counter() - start)
            with done.get_lock():
                done.value += 1
        wait_round(engine, done, args["engines"] * len(rounds))  # the last round's peers
        results.put((index, seconds, dict(tokens), prompt, None))
    except BaseException as err:
        results.put((index, [], {}, 0, repr(err)))
        with done.get_lock():
            done.value = -1  # the others stop waiting for this engine
        raise
    finally:
        engine.close()


def settle(mount: str, timeout: float = 60) -> None:
    """Until the kvfs mount has published every chunk written through it: a publish ends a
    moment after the store's close() (at the last release), and other hosts find a chunk on
    the shared backing directory only then."""
    deadline = time.monotonic() + timeout
    while os.getxattr(mount, control_protocol.UNPUBLISHED) != b"0":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mount}: chunks still unpublished after {timeout} s")
        time.sleep(0.002)


def wait_round(engine: SimEngine, done: Any, finished: int) -> None:
    """Until every engine has finished the rounds before (``finished`` reports in all)."""
    while done.value < finished:
        if done.value < 0:
            raise RuntimeError("another engine failed")
        if engine.connector is not None:
            engine.connector.step()
        time.sleep(0.002)


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    plan = deal(args.conversations, args.turns, args.engines, config.endswith("moving"))
    ctx = mp.get_context("spawn")
    done, results = ctx.Value("i", 0), ctx.Queue()
    settings = {k: getattr(args, k) for k in ("profile", "turns", "device_conversations")}
    settings["engines"] = args.engines
    settings["host_conversations"] = args.host_conversations
    with ExitStack() as stack:
        roots = stack.enter_context(
            fleet_mounts(config, args.engines, args.workdir, args.mount_options.split())
        )
        secondary = tiers(config, args.engines, roots)
        engines = [
            ctx.Process(
                target=engine_main, args=(i, secondary[i], plan[i], settings, done, results)
            )
            for i in range(args.engines)
        ]
        for p in engines:
            p.start()
        reports = [results.get(timeout=args.timeout) for _ in engines]
        for p in engines:
            p.join()
    failed = [r[4] for r in reports if r[4]]
    if failed:
        raise RuntimeError(f"{config}: an engine failed: {failed[0]}")
    rounds = [max(r[1][k] for r in reports) for k in range(args.turns)]
    tokens: Counter[str] = Counter()
    for r in reports:
        tokens.update(r[2])
    prompt = sum(r[3] for r in reports)
    return {
        "config": config,
        "engines": args.engines,
        "conversations": args.conversations,
        "tokens_per_s": round(prompt / sum(rounds), 1),
        "hit_ratio": round(1 - tokens["recomputed"] / prompt, 4),
        # SimEngine counts every secondary tier's tokens as "fs"
        "sources": {
            ("p2p" if k == "fs" and config.startswith("p2p") else k): round(v / prompt, 4)
            for k, v in sorted(tokens.items())
        },
        "seconds": round(sum(rounds), 2),
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["config"] for r in rows]
    left.bar(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("fleet prompt tokens / s")
    right.bar(names, [r["hit_ratio"] for r in rows], color="tab:green")
    right.set_ylabel("hit ratio (prompt tokens not recomputed)")
    right.set_ylim(0, 1)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    r = rows[0]
    fig.suptitle(f"{r['engines']} engines, {r['conversations']} conversations", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=36, help="in the whole fleet")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama3.1-8b-l4")
    parser.add_argument("--device-conversations", type=int, default=4, help="per engine")
    parser.add_argument("--host-conversations", type=int, default=8, help="per engine")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/kvfs-bench-fleet"))
    parser.add_argument("--mount-options", default="", help="more kvfs mount options")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    parser.add_argument("--plot", default="", help="PNG of the results ('' for none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.engines < 2 or args.conversations < args.engines or args.turns < 2:
        parser.error("a fleet needs 2+ engines, a conversation per engine and 2+ turns")
    rows = []
    for config in args.configs:
        rows.append(run_config(config, args))
        if not args.json:
            r = rows[-1]
            print(
                f"{r['config']:<16} {r['tokens_per_s']:>9.0f} tok/s  hit ratio "
                f"{r['hit_ratio']:.2f}  {r['sources']}",
                flush=True,
            )
    base = next((r for r in rows if r["config"] == "alone, sticky"), None)
    ratios = {
        r["config"]: {
            "tokens_per_s": round(r["tokens_per_s"] / base["tokens_per_s"], 2),
            "hit_ratio": round(r["hit_ratio"] / base["hit_ratio"], 2),
        }
        for r in rows
        if base is not None and r is not base
    }
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": rows, "vs_alone_sticky": ratios}, indent=2))
    else:
        print(f"vs the engines alone, sticky: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
