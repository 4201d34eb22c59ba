"""Eviction policies against Belady's optimum on a multi-turn conversation trace.

    python -m tools.bench_eviction [--json] [--requests 3000] [--seed 0]

The trace, scaled to this machine (one chunk = 1K tokens, all chunks the same size):
  * a few shared system prompts (4 of 4K tokens) that every conversation starts with;
  * conversations whose first prompt is 12K tokens and each turn adds 4K (the seed's workload),
    8 turns, after which the conversation ends and a new one takes its place;
  * which conversation speaks next follows a Zipf law (s=1.0) over 64 live conversations.
Each request reads its whole prompt, chunk by chunk: a chunk in the cache is a hit, one that is
not is a miss and is stored. The policies are kvfs's own classes (kvfs.eviction), driven as the
daemon drives them; Belady's MIN (evict the chunk used furthest in the future) is optimal for
equal sizes. Capacities are fractions of the working set: the most chunks that are live at once
(read before and read again later), i.e. what a cache needs to miss only the first reads. The
target is the default policy at >= 0.9 of the optimum where the working set is 2x the capacity.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from collections.abc import Callable

from kvfs.eviction import POLICIES, EvictionPolicy, make_policy

TOKENS_PER_CHUNK = 1024
SYSTEM_PROMPTS, SYSTEM_CHUNKS = 4, 4
FIRST_PROMPT_CHUNKS, TURN_CHUNKS, TURNS = 12, 4, 8
LIVE_CONVERSATIONS = 64
ZIPF_S = 1.0
WORKING_SET_OVER_CAPACITY = (1.25, 2.0, 4.0, 8.0)


def make_trace(requests: int, seed: int) -> list[int]:
    """The chunk keys read, in order, request after request."""
    rng = random.Random(seed)
    ids = itertools.count()
    system = [[next(ids) for _ in range(SYSTEM_CHUNKS)] for _ in range(SYSTEM_PROMPTS)]

    def new_conversation() -> dict[str, object]:
        own = [next(ids) for _ in range(FIRST_PROMPT_CHUNKS - SYSTEM_CHUNKS)]
        return {"prefix": rng.choice(system) + own, "turn": 1}

    live = [new_conversation() for _ in range(LIVE_CONVERSATIONS)]
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(LIVE_CONVERSATIONS)]
    trace: list[int] = []
    for _ in range(requests):
        slot = rng.choices(range(LIVE_CONVERSATIONS), weights)[0]
        conversation = live[slot]
        prefix: list[int] = conversation["prefix"]  # type: ignore[assignment]
        trace.extend(prefix)
        conversation["turn"] = int(conversation["turn"]) + 1  # type: ignore[call-overload]
        if conversation["turn"] > TURNS:
            live[slot] = new_conversation()
        else:
            prefix.extend(next(ids) for _ in range(TURN_CHUNKS))  # answer + next question
    return trace


def working_set(trace: list[int]) -> int:
    """The most chunks live at once: between their first and their last read."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, key in enumerate(trace):
        first.setdefault(key, i)
        last[key] = i
    starts = sorted(first[k] for k in first if last[k] > first[k])
    ends = sorted(last[k] for k in first if last[k] > first[k])
    live = peak = j = 0
    for start in starts:
        live += 1
        while ends[j] < start:
            live -= 1
            j += 1
        peak = max(peak, live)
    return peak


def replay(trace: list[int], capacity: int, policy: EvictionPolicy) -> int:
    """Hits of a kvfs policy at ``capacity`` chunks."""
    held: set[int] = set()
    hits = 0
    never: Callable[[int], bool] = lambda key: False  # noqa: E731 - nothing pinned here
    for key in trace:
        if key in held:
            policy.access(key)
            hits += 1
            continue
        while len(held) >= capacity:
            victim = policy.evict(never)
            assert victim is not None
            held.discard(victim)
        policy.insert(key, 1)
        held.add(key)
    return hits


def belady(trace: list[int], capacity: int) -> int:
    """Hits of Belady's MIN: on a miss with a full cache, evict the key used furthest ahead."""
    next_use = [0] * len(trace)
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last.get(trace[i], len(trace))
        last[trace[i]] = i
    held: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), with stale entries skipped
    hits = 0
    for i, key in enumerate(trace):
        if key in held:
            hits += 1
        elif len(held) >= capacity:
            while True:
                neg_use, victim = heapq.heappop(heap)
                if held.get(victim) == -neg_use:
                    del held[victim]
                    break
        held[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trace = make_trace(args.requests, args.seed)
    ws = working_set(trace)
    rows = []
    for ratio in WORKING_SET_OVER_CAPACITY:
        capacity = max(1, int(ws / ratio))
        optimum = belady(trace, capacity)
        row: dict[str, object] = {
            "working_set_over_capacity": ratio,
            "capacity_chunks": capacity,
            "belady": optimum / len(trace),
        }
        for name in POLICIES:
            hits = replay(trace, capacity, make_policy(name))
            row[name] = hits / len(trace)
            row[f"{name}_vs_belady"] = hits / optimum if optimum else 1.0
        rows.append(row)
    report = {
        "accesses": len(trace),
        "distinct_chunks": len(set(trace)),
        "working_set_chunks": ws,
        "rows": rows,
        "default_policy": "lru",
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{len(trace)} chunk reads, {len(set(trace))} distinct chunks, working set {ws} chunks "
        "(byte hit ratios; equal sizes)"
    )
    print(
        f"{'WS/capacity':>12}{'capacity':>10}{'belady':>9}"
        + "".join(f"{n:>9}{n + '/opt':>12}" for n in POLICIES)
    )
    for row in rows:
        print(
            f"{row['working_set_over_capacity']:>12}{row['capacity_chunks']:>10}"
            f"{row['belady']:>9.3f}"
            + "".join(f"{row[n]:>9.3f}{row[n + '_vs_belady']:>12.2f}" for n in POLICIES)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
