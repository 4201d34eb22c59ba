"""Every option of a mount, declared once.

``kvfs mount``'s parser, the daemon's argv and the daemon's own parser, and the ``-o
NAME=VALUE,...`` lists of ``mount -t fuse.kvfs`` and fstab are all built from ``OPTIONS``, so an
option added here exists everywhere, with one help text that states its default and unit.
:class:`kvfs.config.MountConfig` stays the validated result: this module only turns text into
its fields and its fields back into text.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfs.config import (
    FUSE_OPTIONS,
    IO_URING_MODES,
    SESSIONS,
    VERIFY_MODES,
    ConfigError,
    MountConfig,
    check_bind_address,
    check_host_id,
    parse_fuse_options,
    parse_size,
    parse_umask,
)
from kvfs.eviction import POLICIES


def format_size(n: int) -> str:
    """Bytes as parse_size reads them back: the largest unit that divides exactly."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _seconds(text: str, key: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not a number of seconds") from None


def _whole(text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not a whole number") from None


def _text(text: str, key: str) -> str:
    return text  # MountConfig checks it (capacity's syntax, a choice, an address's scheme)


@dataclass(frozen=True)
class Option:
    """A mount option: ``--NAME VALUE`` on the command lines, ``NAME=VALUE`` in ``-o``.

    A value option sets the MountConfig field ``field``; ``parse`` turns the text into the
    field's value (raising ConfigError that names the option) and ``show`` turns it back, for
    the daemon's argv. A flag (``field`` None) takes no value.
    """

    name: str
    help: str
    field: str | None = None
    parse: Callable[[str, str], Any] = _text
    show: Callable[[Any], str] = str
    unit: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    daemon: bool = True  # passed on to the daemon (False: only the launcher reads it)

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    def default_text(self) -> str:
        if self.field is None:
            return "off"
        default = _DEFAULTS[self.field]
        if default is None:
            return "off"
        return f"{self.show(default)}{' ' + self.unit if self.unit else ''}"

    def full_help(self) -> str:
        return f"{self.help} (default {self.default_text()})"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MountConfig)}

OPTIONS: tuple[Option, ...] = (
    Option(
        "capacity",
        "bytes the tier may hold, with K/M/G/T, or a percentage of what it may have of the "
        "backing filesystem: what kvfs holds there plus what is free at mount; past it the "
        "least valuable chunks are evicted",
        field="capacity",
        metavar="SIZE|PCT%",
    ),
    Option(
        "eviction",
        "lru: least recently read first; s3fifo: scan-resistant; arc: adaptive (recency and "
        "frequency)",
        field="eviction",
        choices=tuple(sorted(POLICIES)),
    ),
    Option(
        "write-buffer",
        "memory for files being written, in bytes with K/M/G/T; writers wait beyond it",
        field="write_buffer_bytes",
        parse=parse_size,
        show=format_size,
        metavar="SIZE",
    ),
    Option(
        "io-timeout",
        "seconds a request may wait on the backing store before it fails with EIO (above 0)",
        field="io_timeout",
        parse=_seconds,
        show=lambda value: f"{value:g}",
        unit="s",
        metavar="SECONDS",
    ),
    Option(
        "scrub-rate",
        "bytes per second the background scrub re-reads and checks, with K/M/G (0 turns it "
        "off; a file counts as 256 KiB at least); it quarantines what fails its checksum",
        field="scrub_bytes_per_second",
        parse=parse_size,
        show=format_size,
        unit="per second",
        metavar="SIZE",
    ),
    Option(
        "checksum-backlog",
        "with --verify first-read: bytes written O_DIRECT in passthrough that may be "
        "published before their checksum is taken, with K/M/G (0: each publish reads its "
        "file back first); they are checksummed when the engine pauses its stores and loads "
        "(or after 5 s)",
        field="checksum_backlog_bytes",
        parse=parse_size,
        show=format_size,
        metavar="SIZE",
    ),
    Option(
        "rename-wait",
        "seconds a store's temp file (<chunk>.bin_<digits>.tmp), once closed, waits for its "
        "rename before its last release publishes it under the temp name (0: at once); the "
        "rename then publishes it under the chunk's name in one step (0-10)",
        field="rename_wait",
        parse=_seconds,
        show=lambda value: f"{value:g}",
        unit="s",
        metavar="SECONDS",
    ),
    Option(
        "cache-timeout",
        "seconds the kernel may cache names, misses and attributes (the daemon invalidates "
        "what it changes, so long is safe)",
        field="cache_timeout",
        parse=_seconds,
        show=lambda value: f"{value:g}",
        unit="s",
        metavar="SECONDS",
    ),
    Option(
        "read-threads",
        "threads that read the backing store (1-256)",
        field="read_threads",
        parse=_whole,
        metavar="N",
    ),
    Option(
        "write-threads",
        "threads that write the backing store (1-256)",
        field="write_threads",
        parse=_whole,
        metavar="N",
    ),
    Option(
        "umask",
        "octal permission bits removed from files and directories created on the mount, "
        "whatever mode the writer asks",
        field="file_umask",
        parse=parse_umask,
        show=lambda value: f"{value:03o}",
        metavar="OCTAL",
    ),
    Option(
        "metrics-port",
        "serve Prometheus /metrics on this TCP port",
        field="metrics_port",
        parse=_whole,
        metavar="PORT",
    ),
    Option(
        "metrics-address",
        "address /metrics listens on: this machine only unless told (0.0.0.0: every interface)",
        field="metrics_address",
        parse=lambda text, key: check_bind_address(text, key),
        metavar="ADDR",
    ),
    Option(
        "events",
        "publish KV events (vLLM's format) on this ZMQ address, e.g. tcp://127.0.0.1:5557 (a "
        "routable address exposes which prompts are cached to whoever can connect)",
        field="events",
        metavar="ADDRESS",
    ),
    Option(
        "session",
        "FUSE session: kernel (kvfs speaks FUSE on /dev/fuse; root; reads can pass through to "
        "the backing files), pyfuse3 (libfuse), auto (kernel for root on a local backing "
        "filesystem, else pyfuse3; the log says which and why)",
        field="session",
        choices=SESSIONS,
    ),
    Option(
        "io-uring",
        "kernel session: take requests over FUSE-over-io_uring where the kernel offers it "
        "(auto; Linux 6.14+ with fuse.enable_uring=Y: a first-time miss is answered on its "
        "caller's CPU, without the interpreter, 2-3x sooner; a request the daemon serves costs "
        "it a little more), or stay on /dev/fuse (off)",
        field="io_uring",
        choices=IO_URING_MODES,
    ),
    Option(
        "cpu-latency",
        "while the mount is served, hold a CPU latency request (/dev/cpu_dma_latency, root): "
        "idle CPUs stay in states that wake within this many microseconds, so a request's "
        "answer does not wait for its caller's CPU to wake (0: idle CPUs poll; a halted "
        "virtual CPU or a deep C-state takes 10-100 us, a round trip 5-20 us); it holds for "
        "the whole machine and costs its idle power",
        field="cpu_latency_us",
        parse=_whole,
        unit="us",
        metavar="MICROSECONDS",
    ),
    Option(
        "verify",
        "first-read: a chunk is checked at its publish or first read, then read in "
        "passthrough where the session has it until its backing file changes (the scrub "
        "checks it again); every-read: the daemon serves and checks every read",
        field="verify",
        choices=VERIFY_MODES,
    ),
    Option(
        "shared",
        "serve a backing directory that other kvfs daemons (other hosts) serve too, as this "
        "host id (1-64 of A-Z a-z 0-9 _ -, unique per backing directory): names the index "
        "lacks are looked up on the backing directory, misses are cached 1 s, a chunk another "
        "host published first is kept; --capacity bounds the whole share, one host at a time "
        "(the sweep lease) evicting its least recently read chunks",
        field="shared",
        parse=lambda text, key: check_host_id(text, key),
        metavar="HOST_ID",
    ),
    Option(
        "lease-ttl",
        "with --shared: seconds the share's sweep lease lasts unrenewed (renewed every third "
        "of it); a dead holder is replaced within TTL + TTL/3; keep it well above the hosts' "
        "clock skew (0.3-3600)",
        field="lease_ttl",
        parse=_seconds,
        show=lambda value: f"{value:g}",
        unit="s",
        metavar="SECONDS",
    ),
    Option(
        "foreground",
        "run the daemon in this process instead of detaching (for systemd: Type=notify)",
        daemon=False,
    ),
    Option(
        "supervise",
        "also start a supervisor that restarts the daemon in place if it dies (kill -9, "
        "crash), with a bounded backoff; kvfs umount stops it",
        daemon=False,
    ),
    Option("debug", "log every request"),
)

BY_NAME = {option.name: option for option in OPTIONS}
VALUES = tuple(option for option in OPTIONS if option.field is not None)
FLAGS = tuple(option for option in OPTIONS if option.field is None)

BACKING_HELP = "directory that holds the chunks (default /var/cache/kvfs/<mountpoint>)"
O_HELP = (
    "mount options as mount(8) takes them, comma-separated, repeatable: the FUSE options "
    f"{', '.join(FUSE_OPTIONS)} (default none: allow_other lets other users' processes, an "
    "engine running as another user, reach the mount), or NAME=VALUE and NAME for any option "
    "above (capacity=50%%,session=kernel,supervise)"
)

# What mount(8) and fstab pass that is mount(8)'s, not the filesystem's: dropped by the
# mount.fuse.kvfs helper (a kvfs mount is always read-write, and noatime anyway).
MOUNT8_OPTIONS = frozenset(
    ("rw", "defaults", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail")
) | frozenset(("_netdev", "atime", "noatime", "relatime", "async", "dev", "suid", "exec"))
MOUNT8_PREFIXES = ("x-", "comment=")


def add_arguments(parser: argparse.ArgumentParser, daemon: bool) -> None:
    """Add every option to ``parser``: the command line's (``daemon`` False) or the daemon's.

    Value options default to None, so what was given can be told from what was not; the
    defaults are MountConfig's (and the help says them).
    """
    for option in OPTIONS:
        if daemon and not option.daemon:
            continue
        if option.field is None:
            parser.add_argument(option.flag, action="store_true", help=option.full_help())
            continue
        parser.add_argument(
            option.flag,
            metavar=None if option.choices else option.metavar,
            choices=option.choices or None,
            help=option.full_help().replace("%", "%%"),  # argparse %-formats help texts
        )


def split_o(values: list[str], mount8: bool = False) -> tuple[dict[str, str], list[str]]:
    """The ``-o`` lists: NAME=VALUE settings and NAME flags of OPTIONS, and FUSE options.

    Anything else is refused with the accepted names; with ``mount8``, what mount(8) and fstab
    pass for themselves (nofail, _netdev, x-systemd.*...) is dropped first.
    """
    settings: dict[str, str] = {}
    fuse: list[str] = []
    for value in values:
        for item in value.split(","):
            name, has_value, text = item.partition("=")
            name = name.replace("_", "-") if not name.startswith("_") else name
            option = BY_NAME.get(name)
            if mount8 and (item in MOUNT8_OPTIONS or item.startswith(MOUNT8_PREFIXES)):
                continue
            if item in FUSE_OPTIONS:
                fuse.append(item)
            elif option is not None and bool(has_value) == (option.field is not None):
                text = text if has_value else "1"
                if settings.get(name, text) != text:
                    raise ConfigError(f"-o {name}: given twice ({settings[name]!r}, {text!r})")
                settings[name] = text
            else:
                raise ConfigError(f"-o {item or repr(item)}: not accepted ({_accepted()})")
    return settings, fuse


def join_o(settings: Mapping[str, str], fuse: list[str]) -> str:
    """What split_o took apart, as one ``-o`` list again."""
    items = [name if BY_NAME[name].field is None else f"{name}={v}" for name, v in settings.items()]
    return ",".join([*items, *fuse])


def _accepted() -> str:
    values = ", ".join(f"{o.name}=" for o in VALUES)
    flags = ", ".join(o.name for o in FLAGS)
    return f"accepted: {', '.join(FUSE_OPTIONS)}; {values}; {flags}"


def merged(args: argparse.Namespace, settings: Mapping[str, str]) -> dict[str, Any]:
    """The command line's values with the ``-o`` settings added; an option given both ways
    with different values is an error."""
    values: dict[str, Any] = {o.dest: getattr(args, o.dest, None) for o in OPTIONS}
    for name, text in settings.items():
        option = BY_NAME[name]
        given = values[option.dest]
        if option.field is None:
            values[option.dest] = True
        elif given is not None and given != text:
            raise ConfigError(f"{option.flag} {given} and -o {name}={text}: give it once")
        else:
            values[option.dest] = text
    return values


def config(
    mountpoint: Path, backing: Path, values: Mapping[str, Any], fuse: list[str]
) -> MountConfig:
    """The validated MountConfig for the given option texts (None: the default)."""
    fields: dict[str, Any] = {}
    for option in VALUES:
        text = values.get(option.dest)
        if text is not None and option.field is not None:
            fields[option.field] = option.parse(str(text), option.flag)
    return MountConfig(
        mountpoint=mountpoint, backing=backing, fuse_options=parse_fuse_options(fuse), **fields
    )


def daemon_argv(cfg: MountConfig, debug: bool = False) -> list[str]:
    """The daemon's options for a validated config, each one token (``--name=value``); the
    mountpoint and ``--backing`` are the launcher's to add."""
    argv = []
    for option in VALUES:
        value = getattr(cfg, option.field or "")
        if value is not None:
            argv.append(f"{option.flag}={option.show(value)}")
    argv += [f"--fuse-option={name}" for name in cfg.fuse_options]
    return [*argv, *(["--debug"] if debug else [])]
