"""End to end on a real (tiny) model: prefixes reloaded from the host tier and from the fs tier
on a kvfs mount give exactly the logits of a full recompute."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from tests.conftest import Mount
from tools.tiny_model import TinyEngine, TinyModel


def test_e2e_tiny_model_serves_every_tier_with_identical_logits() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.e2e_tiny_model",
            "--conversations",
            "6",
            "--turns",
            "3",
            "--first-prompt",
            "256",
            "--user-tokens",
            "64",
            "--settle",  # what was stored is found: no slow disk makes the host tier refuse
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["logits_identical"] and result["requests"] == 18
    assert result["tokens_from_host"] > 0 and result["tokens_from_fs"] > 0
    assert result["tokens_recomputed"] == result["tokens_new"], "a stored prefix was recomputed"


def serve_twice_with_corruption(
    root: Path, backing: Path, settle: Callable[[], None] = lambda: None
) -> tuple[bool, int]:
    """Serve a conversation's first turn, flip a byte in every stored chunk file (in the
    backing store), drop the host tier, serve the second turn: (logits identical to a full
    recompute, tokens that came from the fs tier)."""
    torch.set_num_threads(1)
    model = TinyModel(seed=1)
    config = {
        "cpu_bytes_to_use": 1 << 20,
        "blocks_per_chunk": 1,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    engine = TinyEngine(model, 64, 1, config, f"test-{uuid.uuid4().hex[:8]}")
    try:
        rng = random.Random(3)
        first = [rng.randrange(512) for _ in range(160)]
        engine.serve("t0", first)
        engine.drain()
        settle()  # every chunk published where the flips below can find it
        for path in backing.rglob("*.bin"):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))
        engine.connector.manager.reset()  # type: ignore[union-attr]
        engine.device_cache = type(engine.device_cache)(64, 1)  # and the device forgets too
        second = first + [rng.randrange(512) for _ in range(40)]
        served = engine.serve("t1", second)
        reference = model.new_cache(16)
        full = model.prefill(second, 0, range(16), reference)
        return torch.equal(full[served.start :], served.logits), served.tokens_from_fs
    finally:
        engine.close()


def test_a_corrupt_chunk_changes_the_logits_on_a_plain_directory(tmp_path: Path) -> None:
    identical, from_fs = serve_twice_with_corruption(tmp_path, tmp_path)
    assert from_fs > 0 and not identical, "the check did not see a flipped byte"


def test_the_mount_turns_a_corrupt_chunk_into_a_recompute(kv_mount: Mount) -> None:
    root = kv_mount.path / f"corrupt-{uuid.uuid4().hex[:6]}"
    backing = kv_mount.backing / root.name
    identical, from_fs = serve_twice_with_corruption(root, backing, kv_mount.settle)
    assert identical and from_fs == 0  # checksums failed the loads: recomputed, never served
