"""The run configuration that names a cache namespace, computed as vLLM 0.33.0's FileMapper does.

Chunks of one model configuration live under ``<root>/<model>_<digest>_r<rank>/`` and its
configuration under ``<root>/<model>_<digest>/config.json``, where ``<digest>`` is the first 12
hex of the sha256 of the fields below as compact, key-sorted JSON. A run whose bytes are the
same under any parallelism (``parallel_agnostic``, the only mode vLLM's fs tier uses when the
layout allows it) has its tp/pp/pcp/dcp sizes forced to 1 and rank to 0, so every topology
shares one namespace.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvfs import vllm_layout
from kvfs.keys import split_offload_key

DIGEST_HEX = 12


@dataclass(frozen=True)
class KVCacheGroupConfig:
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class RunConfig:
    model_name: str
    tokens_per_hash: int
    blocks_per_file: int
    dtype: str
    kv_cache_groups: tuple[KVCacheGroupConfig, ...] = ()
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    parallel_agnostic: bool = True
    replicated_layout: bool = False
    # Names a byte format other than vLLM's direct layout (vLLM: "v1-nhd" etc.); None: direct.
    canonical_format: str | None = None
    inference_engine: str = "vllm"

    def fields(self) -> dict[str, Any]:
        """What vLLM hashes and writes to config.json, key for key."""
        agnostic = self.parallel_agnostic
        fields: dict[str, Any] = {
            "model_name": self.model_name,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file,
            "tp_size": 1 if agnostic else self.tp_size,
            "pp_size": 1 if agnostic else self.pp_size,
            "pcp_size": 1 if agnostic else self.pcp_size,
            "dcp_size": 1 if agnostic else self.dcp_size,
            "dtype": str(self.dtype),
            "kv_cache_groups": [
                {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
                for g in self.kv_cache_groups
            ],
            "inference_engine": self.inference_engine,
        }
        if not agnostic:
            fields["parallel_agnostic"] = False
        if self.replicated_layout:
            fields["replicated_layout"] = True
        if self.canonical_format is not None:
            fields["canonical_format"] = self.canonical_format
        return fields

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DIGEST_HEX]

    @property
    def namespace(self) -> str:
        """The config directory's name: ``<model with / as _>_<digest>``."""
        return vllm_layout.namespace(self.model_name, self.digest)

    @property
    def data_dir(self) -> str:
        """The chunks' directory, a sibling of the config directory."""
        return vllm_layout.data_dir(self.namespace, 0 if self.parallel_agnostic else self.rank)

    def config_json(self) -> str:
        """config.json's text, as vLLM writes it (json.dump, indent 2, sorted, no newline)."""
        return json.dumps(self.fields(), indent=2, sort_keys=True)

    def config_path(self, root: str) -> str:
        return f"{root}/{self.namespace}/{vllm_layout.CONFIG_FILE}"

    def chunk_path(self, root: str, key: bytes) -> str:
        """``<root>/<data_dir>/<hex[:3]>/<hex[3:5]>_g<group>/<hex>.bin`` for an OffloadKey."""
        return f"{root}/{self.data_dir}/{self.chunk_name(key)}"

    @staticmethod
    def chunk_name(key: bytes) -> str:
        """An OffloadKey's path under the data directory."""
        block_hash, group = split_offload_key(key)
        return vllm_layout.chunk_relpath(block_hash.hex(), group)
