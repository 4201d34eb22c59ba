"""The connector's configuration, shaped like vLLM's ``kv_connector_extra_config``.

    {"cpu_bytes_to_use": 10737418240, "blocks_per_chunk": 4, "eviction_policy": "arc",
     "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv-cache"}]}

Every key is checked; an error names the key and what it accepts. vLLM's routing keys
(``spec_name``, ``spec_module_path``) are accepted and ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfs.config import LOOPBACK, ConfigError, check_bind_address, parse_size
from kvfs.host_cache import HOST_POLICIES

_TIER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_IGNORED = {"spec_name", "spec_module_path"}


@dataclass(frozen=True)
class TierConfig:
    type: str
    name: str  # labels the tier's metrics and events
    module_path: str | None  # where a tier that is not built in lives
    options: dict[str, Any]  # the rest: the tier constructor's keywords
    index: int

    @property
    def where(self) -> str:
        return f"secondary_tiers[{self.index}]"


@dataclass(frozen=True)
class ConnectorConfig:
    cpu_bytes_to_use: int
    blocks_per_chunk: int = 1
    eviction_policy: str = "lru"
    secondary_tiers: tuple[TierConfig, ...] = ()
    # A tier lookup still unanswered after this long counts as a miss (a hung store must not
    # hold a request forever).
    lookup_timeout_s: float = 5.0
    # Chunks a tier may have waiting to be stored; past it new cascades to it are dropped.
    max_pending_stores: int = 1024
    # Publish KV events on this ZMQ address (None: keep them for take_events only).
    kv_events: str | None = None
    # Serve Prometheus /metrics on this port (None: the registry is only read in process), on
    # this address: loopback unless configured, as /metrics names models and tiers.
    metrics_port: int | None = None
    metrics_address: str = LOOPBACK
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        accepted = {
            "cpu_bytes_to_use",
            "blocks_per_chunk",
            "eviction_policy",
            "secondary_tiers",
            "lookup_timeout_s",
            "max_pending_stores",
            "kv_events",
            "metrics_port",
            "metrics_address",
        }
        unknown = sorted(set(extra) - accepted - _IGNORED)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r} "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
        if "cpu_bytes_to_use" not in extra:
            raise ConfigError("cpu_bytes_to_use: required (bytes of host memory for the host tier)")
        raw = extra["cpu_bytes_to_use"]
        size = parse_size(raw, "cpu_bytes_to_use") if isinstance(raw, str) else raw
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"cpu_bytes_to_use: {raw!r} is not a positive number of bytes")
        blocks = _positive_int(extra, "blocks_per_chunk", 1)
        policy = extra.get("eviction_policy", "lru")
        if policy not in HOST_POLICIES:
            raise ConfigError(
                f"eviction_policy: {policy!r} is not one of {', '.join(HOST_POLICIES)}"
            )
        timeout = extra.get("lookup_timeout_s", 5.0)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(f"lookup_timeout_s: {timeout!r} is not a positive number of seconds")
        events = extra.get("kv_events")
        if events is not None and (not isinstance(events, str) or "://" not in events):
            raise ConfigError(f"kv_events: {events!r} is not a ZMQ address (tcp://HOST:PORT)")
        port = extra.get("metrics_port")
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"metrics_port: {port!r} is not a TCP port (1-65535)")
        return cls(
            cpu_bytes_to_use=size,
            blocks_per_chunk=blocks,
            eviction_policy=policy,
            secondary_tiers=_tiers(extra.get("secondary_tiers", [])),
            lookup_timeout_s=float(timeout),
            max_pending_stores=_positive_int(extra, "max_pending_stores", 1024),
            kv_events=events,
            metrics_port=port,
            metrics_address=check_bind_address(
                extra.get("metrics_address", LOOPBACK), "metrics_address"
            ),
            extra=dict(extra),
        )


def _positive_int(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key}: {value!r} is not a positive integer")
    return value


def _tiers(raw: Any) -> tuple[TierConfig, ...]:
    if not isinstance(raw, list | tuple):
        raise ConfigError("secondary_tiers: a list of tier dicts, e.g. [{'type': 'fs', ...}]")
    tiers, names = [], set()
    for index, tier in enumerate(raw):
        where = f"secondary_tiers[{index}]"
        if not isinstance(tier, Mapping):
            raise ConfigError(f"{where}: {tier!r} is not a dict")
        options = dict(tier)
        kind = options.pop("type", None)
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{where}.type: required (fs, memory, or a class with module_path)")
        name = options.pop("name", kind if kind not in names else f"{kind}{index}")
        if not isinstance(name, str) or not _TIER_NAME.match(name) or name in names:
            raise ConfigError(
                f"{where}.name: {name!r} must be unique: a letter, then letters, digits, _"
            )
        names.add(name)
        module_path = options.pop("module_path", None)
        if module_path is not None and not isinstance(module_path, str):
            raise ConfigError(f"{where}.module_path: {module_path!r} is not a module name")
        tiers.append(TierConfig(kind, name, module_path, options, index))
    return tuple(tiers)
