"""End to end on a real model: multi-turn conversations served by a tiny transformer through
the kvfs connector, with the host tier and the fs tier on a kvfs mount.

Conversations take turns (each turn: everything so far, a new user message, a reply that
becomes part of the next prompt), interleaved so that the device cache (a small block budget)
has evicted a conversation by its next turn, and the host tier (smaller than all of them)
has evicted some: their prefixes come back from the host tier, the fs tier on the mount, or
are recomputed. Every prompt is also computed from scratch on a cache of its own; the logits
of every position the connector path computed must equal the full recompute's exactly.

    python -m tools.e2e_tiny_model [--conversations 8] [--turns 4] [--root DIR] [--settle] [--json]

Without ``--root`` it mounts a fresh kvfs in a temporary directory (and unmounts it after).
``--settle`` finishes every store before the next request (as the think time between a
conversation's turns would): then every stored prefix must come back, so a recompute of one is
a defect, not a slow disk (without it, stores still under way may hold every host slot, and the
host tier then refuses new ones, as a cache may).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from tools.scratch_mount import temporary_mount
from tools.tiny_model import TinyEngine, TinyModel


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    torch.set_num_threads(1)  # the same kernels for every call, and quiet on shared machines
    model = TinyModel(seed=args.seed, device=args.device)
    tokens_per_chunk = args.blocks_per_chunk * model.shape.tokens_per_block
    longest = args.first_prompt + args.turns * (args.user_tokens + args.reply_tokens)
    chunks_each = -(-longest // tokens_per_chunk)
    # The device holds about two conversations, the host tier about half of them.
    device_blocks = (2 * chunks_each + 2) * args.blocks_per_chunk
    chunk_bytes = model.geometry(args.blocks_per_chunk).groups[0].page_bytes * (
        model.shape.layers * args.blocks_per_chunk
    )
    host_bytes = max(1, args.conversations // 2) * chunks_each * -(-chunk_bytes // 4096) * 4096
    config = {
        "cpu_bytes_to_use": host_bytes,
        "blocks_per_chunk": args.blocks_per_chunk,
        "eviction_policy": args.eviction_policy,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    engine = TinyEngine(
        model, device_blocks, args.blocks_per_chunk, config, f"e2e-{uuid.uuid4().hex[:8]}"
    )
    reference = model.new_cache(-(-longest // model.shape.tokens_per_block) + 1)
    rng = random.Random(args.seed)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    totals = dict.fromkeys(
        ("tokens_from_device", "tokens_from_host", "tokens_from_fs", "tokens_recomputed"), 0
    )
    identical, requests, new_tokens, mismatches = True, 0, 0, []
    try:
        for turn in range(args.turns):
            for conversation in range(args.conversations):
                user = args.first_prompt if turn == 0 else args.user_tokens
                prompt = history[conversation] + [
                    rng.randrange(model.shape.vocab) for _ in range(user)
                ]
                if args.settle:
                    engine.drain()
                served = engine.serve(f"c{conversation}t{turn}", prompt)
                full = model.prefill(
                    prompt, 0, range(len(reference[model.layer_names[0]])), reference
                )
                if not torch.equal(full[served.start :], served.logits):
                    identical = False
                    mismatches.append(f"conversation {conversation} turn {turn}")
                for key in totals:
                    totals[key] += getattr(served, key)
                new_tokens += user
                requests += 1
                reply = [rng.randrange(model.shape.vocab) for _ in range(args.reply_tokens)]
                history[conversation] = prompt + reply
                new_tokens += args.reply_tokens if turn < args.turns - 1 else 0
        metrics = engine.connector.metrics.hit_ratios() if engine.connector else {}
    finally:
        engine.close()
    return {
        "logits_identical": identical,
        **totals,
        "tokens_new": new_tokens,
        "requests": requests,
        "hit_ratio": {tier: round(ratio, 3) for tier, ratio in metrics.items()},
        "mismatches": mismatches,
        "config": {
            "conversations": args.conversations,
            "turns": args.turns,
            "blocks_per_chunk": args.blocks_per_chunk,
            "device_blocks": device_blocks,
            "host_bytes": host_bytes,
            "chunk_bytes": chunk_bytes,
            "root": str(root),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-prompt", type=int, default=512, help="tokens")
    parser.add_argument("--user-tokens", type=int, default=128, help="per later turn")
    parser.add_argument("--reply-tokens", type=int, default=32, help="per turn")
    parser.add_argument("--blocks-per-chunk", type=int, default=2)
    parser.add_argument("--eviction-policy", default="lru", choices=("lru", "arc"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--root", type=Path, help="fs tier directory (default: a fresh kvfs mount)")
    parser.add_argument("--settle", action="store_true", help="finish stores between requests")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfs-e2e-") as tmp:
        mount = nullcontext(args.root) if args.root else temporary_mount(Path(tmp))
        with mount as root:
            result = run(args, root)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        same = result["logits_identical"]
        print(f"{result['requests']} requests, logits identical to a full recompute: {same}")
        for key in (
            "tokens_from_device",
            "tokens_from_host",
            "tokens_from_fs",
            "tokens_recomputed",
            "tokens_new",
        ):
            print(f"  {key:<20} {result[key]:>8}")
        print(f"  hit ratio per tier   {result['hit_ratio']}")
    return 0 if result["logits_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
