"""vLLM 0.33.0's fs-tier names, both ways: the one place kvfs knows them.

    <root>/<model>_<digest>/config.json                                  a namespace's config
    <root>/<model>_<digest>_r<rank>/<hex[:3]>/<hex[3:5]>_g<group>/<hex>.bin   one chunk
    <final name>_<u63>.tmp                    a store's temp file, renamed over the final name
    .o_direct_probe_<u63>.tmp                 the O_DIRECT probe at start

``<model>`` is the model name with ``/`` as ``_``; ``<digest>`` the first 12 hex of the run
configuration's sha256 (kvfs.run_config); ``<hex>`` the block hash (32 or 64 hex digits).
Names are bytes where the daemon reads them from the kernel, str where engines build paths.
"""

from __future__ import annotations

import random
import re

CONFIG_FILE = "config.json"
CONFIG_NAME = CONFIG_FILE.encode()

_DATA_DIR = re.compile(rb"^(?P<config_dir>.+)_r(?P<rank>\d+)$")
_CHUNK = re.compile(rb"^([0-9a-f]{32}|[0-9a-f]{64})\.bin$")
_GROUP = re.compile(rb"_g(\d+)$")
_STORE_TEMP = rb".+\.bin_\d+\.tmp"  # temp_name's
_STORE_TEMP_NAME = re.compile(_STORE_TEMP)
_ENGINE_TEMP = re.compile(rb"^(?:" + _STORE_TEMP + rb"|\.o_direct_probe_\d+\.tmp)$")


def namespace(model_name: str, digest: str) -> str:
    """The config directory's name."""
    return f"{model_name.replace('/', '_')}_{digest}"


def data_dir(namespace: str, rank: int) -> str:
    """The chunks' directory of one rank, a sibling of the config directory."""
    return f"{namespace}_r{rank}"


def config_dir_of(data_dir: bytes) -> tuple[bytes, int] | None:
    """The config directory and rank a data directory's name belongs to; None for another."""
    match = _DATA_DIR.match(data_dir)
    return (match["config_dir"], int(match["rank"])) if match else None


def chunk_relpath(block_hash_hex: str, group: int) -> str:
    """A chunk's path under its data directory."""
    h = block_hash_hex
    return f"{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def is_chunk(name: bytes) -> bool:
    """A chunk file's name (``block_of`` without decoding it: every first-time miss asks)."""
    return _CHUNK.match(name) is not None


def block_of(name: bytes, parent_name: bytes) -> tuple[bytes, int | None] | None:
    """The block hash and KV-cache group of a chunk file name; None for any other file."""
    match = _CHUNK.match(name)
    if match is None:
        return None
    group = _GROUP.search(parent_name)
    return bytes.fromhex(match[1].decode()), int(group[1]) if group else None


def temp_name(path: str) -> str:
    """Where a store writes before its rename."""
    return f"{path}_{random.randint(0, 2**63 - 1)}.tmp"


def o_direct_probe_name() -> str:
    return f".o_direct_probe_{random.randint(0, 2**63 - 1)}.tmp"


def is_store_temp(name: bytes) -> bool:
    """A store's temp file (``temp_name``): renamed to the chunk's name once closed."""
    return _STORE_TEMP_NAME.fullmatch(name) is not None


def is_engine_temp(name: bytes) -> bool:
    """A store's temp file or a probe. An engine never reopens one, so any left at mount time
    belongs to a writer that died."""
    return _ENGINE_TEMP.match(name) is not None
