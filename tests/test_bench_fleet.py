"""tools/bench_fleet.py at its smallest: two engines, conversations that move between them.
What timing cannot change is asserted: which configurations keep the prefixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_shared_mount_and_p2p_keep_what_engines_alone_lose(tmp_path: Path) -> None:
    plot = tmp_path / "fleet.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench_fleet",
            "--engines",
            "2",
            "--conversations",
            "4",
            "--turns",
            "2",
            "--device-conversations",
            "1",
            "--host-conversations",
            "2",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["alone, sticky", "alone, moving", "shared, moving", "p2p, moving"]
    # Two turns: the second runs on the other engine when conversations move. Alone, it finds
    # nothing of the first turn; over one shared backing directory or from its peer's host
    # tier it finds the first turn's chunks.
    assert rows["alone, moving"]["sources"].get("fs", 0) == 0
    assert rows["shared, moving"]["sources"]["fs"] > 0
    assert rows["p2p, moving"]["sources"]["p2p"] > 0
    assert rows["shared, moving"]["hit_ratio"] > rows["alone, moving"]["hit_ratio"]
    assert rows["shared, moving"]["hit_ratio"] == rows["alone, sticky"]["hit_ratio"]
    assert set(report["vs_alone_sticky"]) == {"alone, moving", "shared, moving", "p2p, moving"}
    assert plot.stat().st_size > 0
