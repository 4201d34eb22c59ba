"""Validated configuration of a mount, and the size syntax the command line accepts."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from kvfs.cpu_latency import NONE_US
from kvfs.eviction import POLICIES

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


SESSIONS = ("auto", "kernel", "pyfuse3")
VERIFY_MODES = ("every-read", "first-read")
IO_URING_MODES = ("auto", "off")


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
        capacity = int(filesystem_bytes * percent / 100)
    else:
        capacity = parse_size(text, "--capacity")
    if capacity < 1 << 20:  # a cache that can hold nothing is a mistake, not a choice
        raise ConfigError(f"--capacity: {text!r} is less than 1M ({capacity} bytes)")
    return capacity


# A host's name in a shared backing directory (--shared): a directory name under .kvfs/hosts.
_HOST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UMASK = re.compile(r"^(?:0o)?([0-7]{1,4})$", re.IGNORECASE)
_HOSTNAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")

# FUSE mount options an operator may add with ``-o``. Every other one is refused: kvfs sets
# fsname, subtype and noatime itself, and auto_unmount would turn a dead daemon into a bare
# directory on the root disk that engines then fill (docs/guide.md, "When the daemon dies").
FUSE_OPTIONS = ("allow_other", "allow_root", "default_permissions", "nodev", "noexec", "nosuid")

LOOPBACK = "127.0.0.1"


def parse_umask(text: str, key: str = "--umask") -> int:
    """``027``, ``0027`` or ``0o027`` into the umask kvfs applies to files created on a mount."""
    match = _UMASK.match(text.strip())
    value = int(match[1], 8) if match else -1
    if not 0 <= value <= 0o777:
        raise ConfigError(f"{key}: {text!r} is not an octal umask (e.g. 027)")
    return value


def parse_fuse_options(values: list[str]) -> tuple[str, ...]:
    """The ``-o`` options, each ``-o`` a comma-separated list as mount(8) takes them."""
    options: list[str] = []
    accepted = ", ".join(FUSE_OPTIONS)
    for value in values:
        for option in value.split(","):
            if option not in FUSE_OPTIONS:
                raise ConfigError(
                    f"-o {option or repr(option)}: not accepted (accepted: {accepted})"
                )
            if option not in options:
                options.append(option)
    return tuple(options)


def check_host_id(text: str, key: str = "--shared") -> str:
    """A host id for a shared backing directory: 1-64 of A-Z a-z 0-9 _ - (a directory name)."""
    if not _HOST_ID.match(text):
        raise ConfigError(f"{key}: {text!r} is not a host id (1-64 of A-Z, a-z, 0-9, _ and -)")
    return text


def check_bind_address(value: object, key: str) -> str:
    """An address to listen on: an IP address or a host name (default: loopback only).

    Listening beyond loopback is a choice the operator makes explicitly: /metrics names every
    model namespace and KV events reveal which prompts are cached.
    """
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if _HOSTNAME.match(value):
                return value
    raise ConfigError(f"{key}: {value!r} is not a metrics address (an IP address or host name)")


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
    # No request waits longer than this on the backing store. There is no "forever": a wait
    # with no end can leave clients unkillable in D state.
    io_timeout: float = 30.0
    # Bytes the tier may hold: a size, or a percentage of the backing filesystem.
    capacity: str = "90%"
    eviction: str = "lru"
    # Prometheus /metrics on this port (None: off), listening on this address (loopback unless
    # the operator says otherwise); KV events on this ZMQ address (None: off).
    metrics_port: int | None = None
    metrics_address: str = LOOPBACK
    events: str | None = None
    # FUSE options added on request (-o), from FUSE_OPTIONS: allow_other is never implied.
    fuse_options: tuple[str, ...] = ()
    # Permission bits removed from every file and directory created on the mount, whatever
    # mode the writer asks (vLLM asks 0644): chunks are model state, not for every user.
    file_umask: int = 0o027
    # The FUSE session: "pyfuse3" (libfuse, unprivileged mounts), "kernel" (kvfs speaks the
    # protocol on /dev/fuse itself, root, can pass reads through), "auto" (kernel where it may).
    session: str = "auto"
    # The kernel session's requests over FUSE-over-io_uring: "auto" where the kernel offers it
    # (module parameter fuse.enable_uring=Y), "off" to stay on /dev/fuse.
    io_uring: str = "auto"
    # Hold a CPU latency request (kvfs/cpu_latency.py) of this many microseconds while the
    # mount is served, so that an answer does not wait for an idle CPU to wake (None: off).
    cpu_latency_us: int | None = None
    # "first-read": a chunk is verified once (at its publish, or its first read), then read in
    # passthrough where the session has it, while its backing file stays as verified (the
    # scrub checks it again). "every-read": every read is served by the daemon and verified.
    verify: str = "first-read"
    # The background scrub re-reads every published file at this many bytes per second and
    # quarantines what fails its checksum (0: off); it is what checks chunks read in passthrough.
    scrub_bytes_per_second: int = 16 << 20
    # verify "first-read": bytes written past the page cache (O_DIRECT, passthrough) that may
    # be published before their checksum is taken: reading them back at the publish would
    # cost the disk a second trip while the writers wait on it. The sealer takes them when
    # the engine pauses its stores and loads (mount/sealer.py). 0: every such publish reads
    # its file back itself.
    checksum_backlog_bytes: int = 1 << 30
    # A store's temp file (<chunk>.bin_<digits>.tmp, vLLM's), closed and not yet renamed, waits
    # this long for its rename before its last release publishes it under the temp name: the
    # rename then publishes it under the chunk's name in one step (0: at once).
    rename_wait: float = 0.02
    # How long the kernel may cache names, misses and attributes. Safe to make long: every
    # change goes through the daemon, which invalidates what it changes behind the kernel.
    cache_timeout: float = 3600.0
    # Serve a backing directory shared with other daemons (other hosts), as this host id
    # (None: this daemon owns the backing directory alone). docs/research/fleet-design.md.
    shared: str | None = None
    # --shared: seconds the sweep lease lasts without a renew (renewed every third of it); a
    # killed holder is replaced within TTL + TTL/3. Hosts' clocks must differ by much less.
    lease_ttl: float = 10.0

    def __post_init__(self) -> None:
        if self.write_buffer_bytes < 1 << 20:
            raise ConfigError("write_buffer_bytes: must be at least 1M")
        for key in ("read_threads", "write_threads"):
            if not 1 <= getattr(self, key) <= 256:
                raise ConfigError(f"{key}: must be between 1 and 256")
        if not 0 < self.io_timeout < 1e6:
            raise ConfigError("io_timeout: must be a positive number of seconds")
        if self.scrub_bytes_per_second < 0:
            raise ConfigError("scrub_bytes_per_second: must be zero (off) or more")
        if self.checksum_backlog_bytes < 0:
            raise ConfigError("checksum_backlog_bytes: must be zero (off) or more")
        if not 0 <= self.rename_wait <= 10:
            raise ConfigError("rename_wait: must be 0 to 10 seconds")
        if self.cache_timeout < 0:
            raise ConfigError("cache_timeout: must be zero or more seconds")
        parse_capacity(self.capacity, 1 << 40)  # the syntax; the daemon resolves percentages
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ConfigError("metrics_port: must be a TCP port (1-65535)")
        check_bind_address(self.metrics_address, "metrics_address")
        parse_fuse_options(list(self.fuse_options))
        if self.session not in SESSIONS:
            raise ConfigError(f"session: {self.session!r} is not one of {', '.join(SESSIONS)}")
        if self.io_uring not in IO_URING_MODES:
            raise ConfigError(
                f"io-uring: {self.io_uring!r} is not one of {', '.join(IO_URING_MODES)}"
            )
        if self.cpu_latency_us is not None and not 0 <= self.cpu_latency_us <= NONE_US:
            raise ConfigError(f"cpu_latency: must be 0 to {NONE_US} microseconds")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify: {self.verify!r} is not one of {', '.join(VERIFY_MODES)}")
        if not 0 <= self.file_umask <= 0o777:
            raise ConfigError(f"file_umask: {self.file_umask:#o} is not a umask (0 to 0o777)")
        if self.events is not None and "://" not in self.events:
            raise ConfigError(f"events: {self.events!r} is not a ZMQ address (tcp://HOST:PORT)")
        if self.shared is not None:
            check_host_id(self.shared, "shared")
        if not 0.3 <= self.lease_ttl <= 3600:
            raise ConfigError("lease_ttl: must be between 0.3 and 3600 seconds")
        if self.eviction not in POLICIES:
            raise ConfigError(f"eviction: {self.eviction!r} is not one of {', '.join(POLICIES)}")
