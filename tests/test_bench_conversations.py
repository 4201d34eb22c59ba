"""tools/bench_conversations.py at its smallest: it runs, and its rows say what the issue asks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tools.bench_conversations import PROFILES


def test_the_conversation_benchmark_runs_and_reports(tmp_path: Path) -> None:
    plot = tmp_path / "plot.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench_conversations",
            "--pools",
            "3",
            "--turns",
            "2",
            "--device-conversations",
            "1",
            "--host-conversations",
            "2",
            "--configs",
            "no offload",
            "host + kvfs",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            "--plot",
            str(plot),
            "--repeats",
            "2",
            "--settle",
            "0",
            "--cpu-latency",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)["rows"]
    # each configuration twice, the second time in the reverse order
    assert [(r["config"], r["repeat"]) for r in rows] == [
        ("no offload", 0),
        ("host + kvfs", 0),
        ("host + kvfs", 1),
        ("no offload", 1),
    ]
    for row in rows:
        assert {
            "config",
            "conversations",
            "tokens_per_s",
            "hit_ratio",
            "ttft_p50",
            "ttft_p99",
        } <= row.keys()
        assert abs(sum(row["hit_ratio"].values()) - 1) < 1e-3
        assert row["cpu_latency_us"] <= 7  # held for the run (another holder may ask less)
    offload, plain = rows[1], rows[0]
    assert plain["hit_ratio"]["recomputed"] == 1.0  # 3 conversations on a device for 1
    # Which tier serves a prefix, and how much of it, depends on how far the asynchronous
    # cascade got (timing: a loaded machine drops cascades rather than queue them); that
    # offloaded KV replaced some recompute and the mount took the cascade does not.
    assert offload["hit_ratio"]["recomputed"] < 1.0 and offload["bytes"]["fs_store"] > 0
    assert plot.stat().st_size > 10_000


def test_profiles_state_their_kv_size_and_cost() -> None:
    l4 = PROFILES["llama3.1-8b-l4"]
    assert l4.kv_bytes_per_token == 128 << 10  # Llama-3.1-8B: 32 x 2 x 8 x 128 x 2 bytes
    short, long = l4.prefill_seconds(0, 1000), l4.prefill_seconds(40_000, 41_000)
    assert 0.2 < short < 0.35 and long > short  # ~3.7K tok/s at the start; attention adds up
