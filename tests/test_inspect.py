"""Inspection: xattrs and the kvfs ls/du/stat/top/evict reports tell the daemon's truth."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, kvfs
from tools import vllm_io

REPO = Path(__file__).resolve().parent.parent

CHUNK = 128 << 10
MODELS = {  # namespace -> (model, blocks per file, tokens per block, chunks stored)
    "llama_aaaaaaaaaaaa": ("org/llama", 2, 16, 7),
    "qwen_bbbbbbbbbbbb": ("org/qwen", 1, 32, 4),
}


def store_two_namespaces(mount: Mount) -> None:
    for ns, (model, blocks, per_block, count) in MODELS.items():
        (mount.path / ns).mkdir()
        config = {
            "model_name": model,
            "dtype": "bfloat16",
            "blocks_per_file": blocks,
            "kv_cache_groups": [{"tokens_per_block": per_block, "layer_names": ["l0"]}],
        }
        (mount.path / ns / "config.json").write_text(json.dumps(config))
        for key in range(count):
            vllm_io.store(
                vllm_io.chunk_path(str(mount.path), key, namespace=ns),
                vllm_io.chunk_bytes(key, CHUNK),
            )
    mount.settle()  # every chunk published (the kernel session publishes at the last release)


def test_xattrs_ls_du_and_stat_report_exact_counts(fresh_mount: Mount) -> None:
    store_two_namespaces(fresh_mount)
    for ns, (model, blocks, per_block, count) in MODELS.items():
        data = fresh_mount.path / f"{ns}_r0"
        assert os.getxattr(data, "user.kvfs.model") == model.encode()
        assert int(os.getxattr(data, "user.kvfs.chunks")) == count
        assert int(os.getxattr(data, "user.kvfs.bytes")) == count * CHUNK
        assert int(os.getxattr(data, "user.kvfs.tokens")) == count * blocks * per_block
        du = subprocess.run(["du", "-sb", str(data)], capture_output=True, text=True)
        assert int(du.stdout.split()[0]) == count * CHUNK
    report = json.loads(kvfs("ls", "--json", str(fresh_mount.path)).stdout)
    rows = {row["namespace"]: row for row in report["namespaces"]}
    assert set(rows) == set(MODELS)  # one row per model: its config dir and data dir together
    for ns, (model, blocks, per_block, count) in MODELS.items():
        row = rows[ns]
        assert row["directories"] == [ns, f"{ns}_r0"] and row["ranks"] == [0]
        assert (row["model"], row["dtype"], row["chunks"], row["bytes"]) == (
            model,
            "bfloat16",
            count,
            count * CHUNK + (fresh_mount.path / ns / "config.json").stat().st_size,
        )
        assert row["tokens_per_chunk"] == blocks * per_block
        assert row["tokens"] == count * blocks * per_block and row["reads"] == 0
    usage = json.loads(kvfs("du", "--json", str(fresh_mount.path)).stdout)
    assert usage["used"] == sum(c for *_, c in MODELS.values()) * CHUNK + 2 * 4096  # + configs

    # Reads show up as hits, in the chunk's xattrs and in the namespace's hit rate.
    before = rows["qwen_bbbbbbbbbbbb"]["lookups"]  # 0: a store's own lookups are not misses
    path = vllm_io.chunk_path(str(fresh_mount.path), 0, namespace="qwen_bbbbbbbbbbbb")
    for _ in range(3):
        vllm_io.load(path, CHUNK)
    missing = vllm_io.chunk_path(str(fresh_mount.path), 999, namespace="qwen_bbbbbbbbbbbb")
    assert not os.path.exists(missing)  # a chunk name asked for and never stored: a miss
    stat = json.loads(kvfs("stat", "--json", path).stdout)
    assert stat["hits"] == 3 and stat["size"] == CHUNK and stat["checksum"].startswith("xxh3")
    rows = {
        r["namespace"]: r
        for r in json.loads(kvfs("ls", "--json", str(fresh_mount.path)).stdout)["namespaces"]
    }
    qwen = rows["qwen_bbbbbbbbbbbb"]
    assert qwen["reads"] == 3 and qwen["lookups"] == before + 4  # 3 reads, 1 miss
    assert qwen["hit_rate"] == 3 / qwen["lookups"]
    assert qwen["newest_read"] is not None


def test_top_shows_the_rates_of_a_workload(fresh_mount: Mount) -> None:
    store_two_namespaces(fresh_mount)
    live = [sys.executable, "-m", "kvfs.cli", "top", str(fresh_mount.path), "--interval", "1"]
    text_view = subprocess.Popen([*live, "--count", "1"], stdout=subprocess.PIPE, text=True)
    json_view = subprocess.Popen(
        [*live, "--count", "2", "--json"], stdout=subprocess.PIPE, text=True
    )
    # Stores go on for as long as top samples, whenever its interpreter gets going.
    done = threading.Event()

    def workload() -> None:
        key = 100
        while not done.is_set():
            vllm_io.store(vllm_io.chunk_path(str(fresh_mount.path), key), b"x" * CHUNK)
            key += 1
            time.sleep(0.02)

    writer = threading.Thread(target=workload)
    writer.start()
    try:
        lines = [json.loads(line) for line in json_view.communicate(timeout=30)[0].splitlines()]
        text = text_view.communicate(timeout=30)[0]
    finally:
        done.set()
        writer.join()
    assert len(lines) == 2
    assert sum(line["rates"]["writes"] for line in lines) > 0
    assert lines[-1]["used"] >= lines[0]["used"] > 0 and set(lines[-1]["queues"]) == {
        "read",
        "write",
    }
    assert "writes" in text


def test_evict_a_namespace_and_by_age(fresh_mount: Mount) -> None:
    store_two_namespaces(fresh_mount)
    result = json.loads(
        kvfs(
            "evict", "--json", str(fresh_mount.path), "--namespace", "llama_aaaaaaaaaaaa_r0"
        ).stdout
    )
    assert result["files"] == 7 and result["bytes"] == 7 * CHUNK
    assert int(os.getxattr(fresh_mount.path / "llama_aaaaaaaaaaaa_r0", "user.kvfs.chunks")) == 0
    assert not os.access(
        vllm_io.chunk_path(str(fresh_mount.path), 0, namespace="llama_aaaaaaaaaaaa"), os.F_OK
    )
    time.sleep(1.1)
    fresh = vllm_io.chunk_path(str(fresh_mount.path), 50, namespace="qwen_bbbbbbbbbbbb")
    vllm_io.store(fresh, b"y" * CHUNK)
    result = json.loads(kvfs("evict", "--json", str(fresh_mount.path), "--older-than", "1s").stdout)
    assert result["files"] == 4  # the four old qwen chunks; config.json files never go
    assert (fresh_mount.path / "qwen_bbbbbbbbbbbb" / "config.json").exists()
    assert os.access(fresh, os.F_OK)
    missing = kvfs("evict", str(fresh_mount.path), "--namespace", "nope", check=False)
    assert missing.returncode == 2 and "no namespace" in missing.stderr


def test_mistakes_get_one_line_and_status_2_never_a_traceback(
    fresh_mount: Mount, tmp_path: Path
) -> None:
    """Issue 14, item 6: each of these printed a traceback (or was accepted)."""
    cases = [
        (("stat", str(fresh_mount.path / "nope")), "No such file or directory"),
        (("top", str(fresh_mount.path), "--interval", "-1"), "not a number above 0"),
        (("top", str(fresh_mount.path), "--count", "0"), "not a number above 0"),
        (("mount", str(tmp_path), "--capacity", "0"), "is less than 1M"),
        (("mount", str(tmp_path), "--capacity", "0%"), "not a percentage"),
    ]
    for args, words in cases:
        done = kvfs(*args, check=False)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert kvfs("stat", str(fresh_mount.path / ".kvfs" / "usage.json")).returncode == 0


def test_a_reader_that_stops_early_ends_the_command_quietly(fresh_mount: Mount) -> None:
    vllm_io.store(vllm_io.chunk_path(str(fresh_mount.path), 1), b"x" * 4096)
    done = subprocess.run(
        # `true` reads nothing and is gone before kvfs writes: every write meets EPIPE.
        f"{sys.executable} -m kvfs.cli ls {fresh_mount.path} | true",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0 and done.stderr == ""


def test_evict_says_what_it_did_and_why_not(fresh_mount: Mount) -> None:
    """Issue 14, item 5: an age without a unit, a glob, a trailing slash or a path, the
    config directory, a pinned namespace."""
    store_two_namespaces(fresh_mount)
    mnt = str(fresh_mount.path)
    for age in ("5", "1y", "-2h", "0s"):
        done = kvfs("evict", mnt, f"--older-than={age}", check=False)
        assert done.returncode == 2 and "unit" in done.stderr, (age, done.stderr)
    assert int(os.getxattr(fresh_mount.path, "user.kvfs.used")) > 0  # nothing went
    done = kvfs("evict", mnt, "--namespace", "llama*", check=False)
    assert done.returncode == 2 and "no globs" in done.stderr
    # A namespace is the model's config dir with its data dirs (config.json files stay).
    assert "evicted 7 files" in kvfs("evict", mnt, "--namespace", "llama_aaaaaaaaaaaa").stdout
    assert int(os.getxattr(fresh_mount.path / "llama_aaaaaaaaaaaa_r0", "user.kvfs.chunks")) == 0
    os.setxattr(fresh_mount.path / "qwen_bbbbbbbbbbbb_r0", "user.kvfs.pin", b"1")
    pinned = kvfs("evict", mnt, "--namespace", f"{mnt}/qwen_bbbbbbbbbbbb_r0/").stdout
    assert "evicted 0 files" in pinned and "is pinned" in pinned
    os.setxattr(fresh_mount.path / "qwen_bbbbbbbbbbbb_r0", "user.kvfs.pin", b"0")
    result = json.loads(kvfs("evict", "--json", mnt, "--namespace", "qwen_bbbbbbbbbbbb_r0/").stdout)
    assert result["files"] == 4
    assert json.loads(kvfs("evict", "--json", mnt, "--older-than", "1w").stdout)["files"] == 0


def test_the_hit_rate_counts_real_misses_only(fresh_mount: Mount) -> None:
    """Issue 14, item 3: a store's exists() check, its temp name and its mkdir -p steps were
    misses (50 stores and 3 real misses gave 159). Now: lookups of chunk names that no store
    of that name followed, and chunks opened for reading."""
    root = str(fresh_mount.path)
    for key in range(50):
        vllm_io.store(vllm_io.chunk_path(root, key), vllm_io.chunk_bytes(key, 4096))
    fresh_mount.settle()  # published: a read of one counts as a hit
    for key in (100, 101, 102):  # asked for, never stored
        assert not os.access(vllm_io.chunk_path(root, key), os.F_OK)
    for key in (1, 2):
        assert vllm_io.load(vllm_io.chunk_path(root, key), 4096) == vllm_io.chunk_bytes(key, 4096)
    usage = fresh_mount.usage()
    assert usage["lookups"] == {"hit": 2, "miss": 3}
    # No config.json was stored: the data directory is a namespace of its own.
    ns = {n["namespace"]: n for n in usage["namespaces"]}[f"{vllm_io.NAMESPACE}_r0"]
    assert (ns["lookups"], ns["hit_rate"]) == (5, 0.4)


def test_ls_shows_each_model_once_in_a_terminal_width(fresh_mount: Mount) -> None:
    """Issue 14, item 8: every model showed twice (its config dir with 0 chunks, and `_r0`),
    in 142 columns, with the write time as "last read" of chunks never read, and no reads."""
    store_two_namespaces(fresh_mount)
    path = vllm_io.chunk_path(str(fresh_mount.path), 1, namespace="qwen_bbbbbbbbbbbb")
    vllm_io.load(path, CHUNK)
    vllm_io.load(path, CHUNK)
    lines = kvfs("ls", str(fresh_mount.path)).stdout.splitlines()
    assert max(map(len, lines)) <= 100, lines
    header, *rows = (line.split() for line in lines)
    assert header[:7] == ["NAMESPACE", "RANKS", "CHUNKS", "SIZE", "PINNED", "TOKENS", "READS"]
    by_name = {row[0]: row for row in rows}
    assert set(by_name) == set(MODELS)
    assert by_name["llama_aaaaaaaaaaaa"][1:3] == ["1", "7"]
    assert by_name["llama_aaaaaaaaaaaa"][6] == "0" and lines[1].endswith("never")
    assert by_name["qwen_bbbbbbbbbbbb"][6] == "2" and lines[2].endswith("s ago")
    never_read = vllm_io.chunk_path(str(fresh_mount.path), 0, namespace="llama_aaaaaaaaaaaa")
    assert "user.kvfs.last_read" not in os.listxattr(never_read)
    assert "user.kvfs.last_read" in os.listxattr(path)


def test_pinned_bytes_are_visible(fresh_mount: Mount) -> None:
    """Issue 14, item 7: the effective pin had no column in `kvfs ls` and no total."""
    store_two_namespaces(fresh_mount)
    mnt = str(fresh_mount.path)
    one = vllm_io.chunk_path(mnt, 0, namespace="qwen_bbbbbbbbbbbb")
    os.setxattr(one, "user.kvfs.pin", b"1")
    os.setxattr(fresh_mount.path / "llama_aaaaaaaaaaaa_r0", "user.kvfs.pin", b"1")
    os.setxattr(
        fresh_mount.path
        / "llama_aaaaaaaaaaaa_r0"
        / os.listdir(fresh_mount.path / "llama_aaaaaaaaaaaa_r0")[0],
        "user.kvfs.pin",
        b"1",
    )  # counted once
    rows = {r["namespace"]: r for r in json.loads(kvfs("ls", "--json", mnt).stdout)["namespaces"]}
    assert rows["qwen_bbbbbbbbbbbb"]["pinned_bytes"] == CHUNK
    assert rows["llama_aaaaaaaaaaaa"]["pinned_bytes"] == 7 * CHUNK
    usage = json.loads(kvfs("du", "--json", mnt).stdout)
    assert usage["pinned_bytes"] == 8 * CHUNK
    assert "1.0M pinned" in kvfs("du", mnt).stdout
    os.setxattr(one, "user.kvfs.pin", b"0")
    os.unlink(vllm_io.chunk_path(mnt, 1, namespace="llama_aaaaaaaaaaaa"))
    assert json.loads(kvfs("du", "--json", mnt).stdout)["pinned_bytes"] == 6 * CHUNK


def test_evict_dry_run_says_what_would_go_and_evicts_nothing(fresh_mount: Mount) -> None:
    """Issue 14, item 5: there was no --dry-run; and the count came from usage before and
    after, so concurrent writers skewed it. Each request's outcome is now the daemon's own."""
    store_two_namespaces(fresh_mount)
    mnt = str(fresh_mount.path)
    os.setxattr(vllm_io.chunk_path(mnt, 0, namespace="qwen_bbbbbbbbbbbb"), "user.kvfs.pin", b"1")
    used = os.getxattr(fresh_mount.path, "user.kvfs.used")
    time.sleep(1.1)
    preview = json.loads(kvfs("evict", "--json", "--dry-run", mnt, "--older-than", "1s").stdout)
    assert preview["dry_run"] and (preview["files"], preview["bytes"]) == (10, 10 * CHUNK)
    assert "would evict 10 files" in kvfs("evict", "--dry-run", mnt, "--older-than", "1s").stdout
    assert os.getxattr(fresh_mount.path, "user.kvfs.used") == used  # nothing went
    done = json.loads(kvfs("evict", "--json", mnt, "--older-than", "1s").stdout)
    assert (done["files"], done["bytes"]) == (10, 10 * CHUNK)  # the pinned chunk stays
    for hostile in (b"namespace=x", b'{"request": "older-than=1", "id": "../x"}', b"[" * 60000):
        with pytest.raises(OSError) as err:
            os.setxattr(fresh_mount.path, "user.kvfs.evict", hostile)
        assert err.value.errno == errno.EINVAL
