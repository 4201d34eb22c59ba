"""Validated configuration of a mount, and the size syntax the command line accepts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvfs.eviction import POLICIES

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is accepted."""


def parse_size(text: str, key: str = "size") -> int:
    """Parse ``4096``, ``512K``, ``1.5G``, ``2TiB`` into bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{key}: {text!r} is not a size (bytes, or a number with K/M/G/T)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def parse_capacity(text: str, filesystem_bytes: int) -> int:
    """A size (see parse_size) or a percentage of the backing filesystem, e.g. ``80%``."""
    if text.strip().endswith("%"):
        try:
            percent = float(text.strip()[:-1])
        except ValueError:
            percent = -1
        if not 0 < percent <= 100:
            raise ConfigError(f"--capacity: {text!r} is not a percentage between 0 and 100")
        return int(filesystem_bytes * percent / 100)
    return parse_size(text, "--capacity")


def _mount_name(mountpoint: Path) -> str:
    return str(mountpoint.absolute()).strip("/").replace("/", "_") or "root"


def default_backing_dir(mountpoint: Path) -> Path:
    """One backing directory per mountpoint, so two default mounts never share one."""
    return Path("/var/cache/kvfs") / _mount_name(mountpoint)


def daemon_log(mountpoint: Path) -> Path:
    """The daemon's log: never on the backing store, which may be the thing that hangs."""
    return Path("/var/log/kvfs") / f"{_mount_name(mountpoint)}.log"


@dataclass(frozen=True)
class MountConfig:
    """Everything the daemon needs to serve one mount."""

    mountpoint: Path
    backing: Path
    # Bytes of not-yet-published file data the daemon holds; writers wait beyond it.
    write_buffer_bytes: int = 1 << 30
    read_threads: int = 8
    write_threads: int = 4
    # No request waits longer than this on the backing store (None: wait forever).
    io_timeout: float | None = 30.0
    # Bytes the tier may hold: a size, or a percentage of the backing filesystem.
    capacity: str = "90%"
    eviction: str = "lru"
    # Prometheus /metrics on this port (None: off); KV events on this ZMQ address (None: off).
    metrics_port: int | None = None
    events: str | None = None
    # How long the kernel may cache names, misses and attributes. Safe to make long: every
    # change goes through the daemon, which invalidates what it changes behind the kernel.
    cache_timeout: float = 3600.0

    def __post_init__(self) -> None:
        if self.write_buffer_bytes < 1 << 20:
            raise ConfigError("write_buffer_bytes: must be at least 1M")
        for key in ("read_threads", "write_threads"):
            if not 1 <= getattr(self, key) <= 256:
                raise ConfigError(f"{key}: must be between 1 and 256")
        if self.io_timeout is not None and self.io_timeout <= 0:
            raise ConfigError("io_timeout: must be a positive number of seconds")
        if self.cache_timeout < 0:
            raise ConfigError("cache_timeout: must be zero or more seconds")
        parse_capacity(self.capacity, 1 << 40)  # the syntax; the daemon resolves percentages
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ConfigError("metrics_port: must be a TCP port (1-65535)")
        if self.events is not None and "://" not in self.events:
            raise ConfigError(f"events: {self.events!r} is not a ZMQ address (tcp://HOST:PORT)")
        if self.eviction not in POLICIES:
            raise ConfigError(f"eviction: {self.eviction!r} is not one of {', '.join(POLICIES)}")
