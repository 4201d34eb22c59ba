"""Per-namespace reports from the index: what each model's cache holds, answered from memory.

vLLM's fs tier writes `<root>/<model>_<digest>/config.json` (the run configuration) and the
chunks under the sibling `<root>/<model>_<digest>_r<rank>/`. A namespace here is a directory at
the root; a data directory `X_r<N>` takes its model, dtype and tokens per chunk from `X`'s
config.json. Any other directory at the root is a namespace too, with what the index knows.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from kvfs import vllm_layout
from kvfs.control_protocol import NamespaceReport
from kvfs.index import Index, Node

CONFIG_MAX_BYTES = 1 << 20  # a real config.json is a few hundred bytes


def parse_config(data: bytes) -> dict[str, Any] | None:
    """What the reports need from a namespace's config.json, validated; None if unusable.

    The file is written by whoever can write to the mount, so it is untrusted: it may be huge,
    nested 200,000 deep or hold a string where a number belongs. Only the three fields kvfs
    uses are kept, each of the type it must have.
    """
    if len(data) > CONFIG_MAX_BYTES:
        return None
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    return {
        "model_name": _text(config.get("model_name")),
        "dtype": _text(config.get("dtype")),
        "tokens_per_chunk": _tokens_per_chunk(config),
    }


def _text(value: object) -> str | None:
    return value[:200] if isinstance(value, str) else None


def _count(value: object) -> int | None:
    """A positive integer (bool is not one), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32:
        return value
    return None


def _tokens_per_chunk(config: dict[str, Any]) -> int | None:
    """blocks per file x tokens per block (of the first KV-cache group)."""
    blocks = _count(config.get("blocks_per_file")) or _count(config.get("gpu_blocks_per_file"))
    groups = config.get("kv_cache_groups")
    per_block = None
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        first = groups[0]
        per_block = _count(first.get("tokens_per_block")) or _count(first.get("block_size"))
    per_block = (
        per_block or _count(config.get("tokens_per_hash")) or _count(config.get("hash_block_size"))
    )
    return (blocks or 1) * per_block if per_block else None


def is_namespace_config(node: Node) -> bool:
    """A config.json directly in a directory at the root."""
    parent = node.parent
    return (
        node.name == vllm_layout.CONFIG_NAME
        and parent is not None
        and parent.parent is not None
        and (parent.parent.parent is None)
    )


def config_for(index: Index, top: Node) -> dict[str, Any] | None:
    if top.meta is not None:
        return top.meta
    owner = vllm_layout.config_dir_of(top.name)
    if owner is not None:
        sibling = index.child(index.root, owner[0])
        if sibling is not None and sibling.meta is not None:
            return sibling.meta
    return None


def tokens_per_chunk(config: dict[str, Any] | None) -> int | None:
    return config.get("tokens_per_chunk") if config else None


def top_level(node: Node) -> Node | None:
    """The directory at the root that holds ``node`` (None for the root itself)."""
    while node.parent is not None and node.parent.parent is not None:
        node = node.parent
    return node if node.parent is not None else None


def _iso(ns: int) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec="seconds") if ns else None


def summary(index: Index, top: Node) -> dict[str, Any]:
    """What the index knows of one namespace, without a walk."""
    config = config_for(index, top) or {}
    per_chunk = tokens_per_chunk(config)
    chunks = top.tree_files - (1 if top.meta is not None else 0)  # not its config.json
    return {
        "namespace": top.name.decode(errors="replace"),
        "model": config.get("model_name"),
        "dtype": config.get("dtype"),
        "tokens_per_chunk": per_chunk,
        "chunks": chunks,
        "bytes": top.tree_bytes,
        "tokens": chunks * per_chunk if per_chunk else None,
    }


def groups(index: Index) -> dict[bytes, list[Node]]:
    """The directories at the root by namespace: a model's config directory ``X`` with its data
    directories ``X_r<rank>``, so one model is one namespace; any other directory alone."""
    assert index.root.children is not None
    tops = [node for _, node in sorted(index.root.children.items()) if node.is_dir]
    grouped: dict[bytes, list[Node]] = {}
    for top in tops:
        belongs = vllm_layout.config_dir_of(top.name)
        owner = belongs[0] if belongs else top.name
        if owner != top.name and index.child(index.root, owner) is None:
            owner = top.name  # a data directory whose config directory is gone
        grouped.setdefault(owner, []).append(top)
    return grouped


def namespaces(
    index: Index, lookups: dict[int, Counter[str]], walk: bool
) -> Iterator[NamespaceReport]:
    """One report per namespace (see `groups`). ``walk`` adds what needs every file (reads,
    pinned bytes, oldest and newest read of the chunks read at least once); without it the
    report is O(directories at the root)."""
    for name, tops in groups(index).items():
        parts = [summary(index, top) for top in tops]
        first = next((p for p in parts if p["model"]), parts[0])
        per_chunk = first["tokens_per_chunk"]
        counts: Counter[str] = Counter()
        for top in tops:
            counts += lookups.get(top.ino, Counter())
        asked = counts["hit"] + counts["miss"]
        ranks = sorted(b[1] for t in tops if (b := vllm_layout.config_dir_of(t.name)))
        chunks = sum(p["chunks"] for p in parts)
        report: NamespaceReport = {
            "namespace": name.decode(errors="replace"),
            "directories": [p["namespace"] for p in parts],
            "ranks": ranks,
            "model": first["model"],
            "dtype": first["dtype"],
            "tokens_per_chunk": per_chunk,
            "chunks": chunks,
            "bytes": sum(p["bytes"] for p in parts),
            # Every rank holds its shard of the same tokens: count them once.
            "tokens": max(p["chunks"] for p in parts) * per_chunk if per_chunk else None,
            "lookups": asked,
            "hit_rate": counts["hit"] / asked if asked else None,
        }
        if walk:
            files = [f for top in tops for f in index.walk_files(top)]
            read = [f for f in files if f.hits and not is_namespace_config(f)]
            report["reads"] = sum(f.hits for f in read)
            report["pinned_bytes"] = sum(f.size for f in files if index.pinned(f))
            # last_read_ns of a chunk never read is its write time (for eviction): not a read.
            report["oldest_read"] = _iso(min(f.last_read_ns for f in read)) if read else None
            report["newest_read"] = _iso(max(f.last_read_ns for f in read)) if read else None
        yield report
