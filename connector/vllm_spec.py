"""kvfs as vLLM 0.33.0's offloading spec, loaded by ``spec_module_path``:

    {"spec_name": "KvfsOffloadingSpec", "spec_module_path": "kvfs.connector.vllm_spec",
     "cpu_bytes_to_use": 10737418240, "canonical_layout": true, "root_dir": "/mnt/kv-cache"}

It is vLLM's own TieringOffloadingSpec (host tier in the shared ``/dev/shm`` region, LRU or
ARC, vLLM's cascade, vLLM's CUDA copy worker) whose first secondary tier is always ``KvfsTier``
(kvfs/connector/vllm_tier.py) on the kvfs mount at ``root_dir``: one spec name gives host
memory -> mount, with the mount's capacity, checksums and deadlines and one batched lookup
per scheduler step. Why vLLM's host tier and not kvfs's connector/manager.py: see
docs/research/vllm-plugins.md §7.

Keys beyond vLLM's own (``VLLM_KEYS``): ``root_dir`` (required: the mount, or a directory on
it), ``n_read_threads`` / ``n_write_threads`` (the tier's I/O threads, default 16 each), and
``secondary_tiers`` (more tiers after the mount, as in TieringOffloadingSpec). Any other key
is refused, so a misspelt one fails at start instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TIER = {"type": "KvfsTier", "module_path": "kvfs.connector.vllm_tier"}
# The kv_connector_extra_config keys vLLM 0.33.0's OffloadingConnector and TieringOffloadingSpec
# read (offloading/config.py, scheduler.py, kv_offload/base.py, cpu/spec.py, tiering/spec.py).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "cpu_bytes_to_use",
        "blocks_per_chunk",
        "block_size",
        "canonical_layout",
        "eviction_policy",
        "cache_policy_module_path",
        "max_tracker_size",
        "tier_poll_interval_s",
        "backpressure",
        "offload_prompt_only",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
        "store_threshold",
    }
)
TIER_KEYS = ("root_dir", "n_read_threads", "n_write_threads")


def tiering_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The TieringOffloadingSpec config this spec's config stands for: ``KvfsTier`` on
    ``root_dir`` first, then any ``secondary_tiers`` given. Raises ValueError, naming the key,
    for an unknown key or a value of the wrong type."""
    unknown = sorted(set(extra_config) - VLLM_KEYS - set(TIER_KEYS) - {"secondary_tiers"})
    if unknown:
        raise ValueError(
            f"KvfsOffloadingSpec: unknown kv_connector_extra_config key(s) {unknown}; "
            f"kvfs reads {list(TIER_KEYS)} and 'secondary_tiers', vLLM {sorted(VLLM_KEYS)}"
        )
    root = extra_config.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ValueError(
            "KvfsOffloadingSpec needs 'root_dir' in kv_connector_extra_config: the path of "
            f"a kvfs mount or a directory on it (got {root!r})"
        )
    tier: dict[str, Any] = {**TIER, "root_dir": root}
    for key in TIER_KEYS[1:]:
        if key in extra_config:
            value = extra_config[key]
            if type(value) is not int or value < 1:
                raise ValueError(
                    f"KvfsOffloadingSpec: {key!r} must be an integer >= 1, not {value!r}"
                )
            tier[key] = value
    more = extra_config.get("secondary_tiers", [])
    if not isinstance(more, list) or not all(isinstance(t, dict) for t in more):
        raise ValueError(
            "KvfsOffloadingSpec: 'secondary_tiers' (tiers after the kvfs mount) must be a "
            f"list of tier configurations (dicts), not {more!r}"
        )
    config = {k: v for k, v in extra_config.items() if k not in TIER_KEYS}
    config["secondary_tiers"] = [tier, *(dict(t) for t in more)]
    return config


class KvfsOffloadingSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec with the kvfs mount as its first secondary tier."""

    def __init__(self, config: OffloadingConfig) -> None:
        # Built in the scheduler and in every worker: only the config is checked here; the
        # mount is checked where the tier is made (the scheduler's get_manager).
        expanded = tiering_config(config.extra_config)
        super().__init__(dataclasses.replace(config, extra_config=expanded))

    @classmethod
    def _get_secondary_tiers(
        cls, extra_config: dict[str, Any]
    ) -> list[tuple[dict[str, Any], type[SecondaryTierManager]]]:
        # vLLM's metrics code calls the classmethods with the user's config, not the expanded one.
        return super()._get_secondary_tiers(tiering_config(extra_config))
