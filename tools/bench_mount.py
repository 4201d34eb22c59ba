"""vLLM's fs-tier I/O pattern on the plain backing directory and through a kvfs mount, side by side.

    python -m tools.bench_mount [--json] [--repeats 3] [--total-mib 256] [--base DIR]
                                [--sessions pyfuse3,kernel,kernel-io-uring[,kernel-at-publish]]

For 2 MiB and 16 MiB chunks and 1, 4 and 16 threads it measures, on every target in the same
run (the plain directory, and a kvfs mount per FUSE session: ``pyfuse3`` serves and verifies
every read; ``kernel`` is kvfs's own /dev/fuse session with ``--verify first-read``, where the
kernel reads verified chunks straight from their backing files and an O_DIRECT store is
checksummed after its publish; ``kernel-io-uring`` the same over FUSE-over-io_uring (Linux
6.14+; the bench sets fuse.enable_uring for its mounts and puts it back); ``kernel-at-publish``,
if asked for, the same with the checksum read back by the publish itself):
  store      GB/s of exists → mkdir -p → O_EXCL temp → one write → close → rename
  cold_load  GB/s of open → one readv, the page cache dropped (the chunk stored a while ago)
  warm_load  GB/s of the same loads again, right after a first read
  restart_load  GB/s of the same loads after the daemon restarted, nothing cached (what a
             daemon finds at mount it verifies at the first open, served, before passthrough)
and, single-threaded as vLLM's lookup thread, access(F_OK) per second on just-stored keys
(lookup_hit) and on keys never seen (lookup_miss), the first time each name is asked and again
(``_repeat``: the kernel then answers from its entry cache). The same lookups go to the floors,
the least any FUSE daemon can do (C answering from memory), which show what a round trip through
the kernel itself costs on this machine: ``floor``, tools/fuse_floor.c (libfuse reading
/dev/fuse; where libfuse3's headers are at hand), and ``floor_uring``, tools/fuse_uring_floor.c
(FUSE-over-io_uring, a queue served on each CPU; where the kernel offers it: Linux 6.14+ with
fuse.enable_uring=Y). It prints medians over the repeats and mount/direct ratios; ``--json``
prints one object whose ``summary`` holds, per session, the median ratio per measure and the
daemon's CPU seconds per GB it moved (stores and loads), and each floor's lookup ratios, and
``cpu_latency_us`` the machine's CPU latency bound during the run (``--cpu-latency`` holds one
for the whole run, so every target is measured under it: kvfs/cpu_latency.py).

Every target uses O_DIRECT when vLLM's probe passes there, as vLLM would (``--o-direct`` overrides).
Run as root (it drops the page cache and mounts).

A store measure (``--total-mib``, 256 by default) is a burst: it fits the GiB of O_DIRECT chunks
a kernel-session mount lets wait for their checksums, which it reads back once the writers
pause. A sustained store load past that, where each publish reads its chunk back, is
tools/bench_vllm_tier.py's (and ``--total-mib 1024`` here shows it begin).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from kvfs import control_protocol, cpu_latency
from kvfs.mount.ring import ENABLE_URING, io_uring_offered
from tools import vllm_io

KVFS = [sys.executable, "-m", "kvfs.cli"]
SIZES_MIB = (2, 16)
THREADS = (1, 4, 16)
MEASURES = (
    "store",
    "cold_load",
    "warm_load",
    "restart_load",
    "lookup_hit",
    "lookup_miss",
    "lookup_hit_repeat",
    "lookup_miss_repeat",
)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class Target:
    """Where the chunks go: the plain directory, or a kvfs mount over a backing directory."""

    def __init__(
        self, name: str, root: Path, backing: Path | None = None, options: tuple[str, ...] = ()
    ) -> None:
        self.name, self.root, self.backing, self.options = name, root, backing, options
        root.mkdir(parents=True, exist_ok=True)
        if backing is not None:
            backing.mkdir(parents=True, exist_ok=True)
            self.mount()

    def mount(self) -> None:
        options = list(self.options)
        asks_ring = "--io-uring" in options and options[options.index("--io-uring") + 1] == "auto"
        over_ring = asks_ring and ENABLE_URING.exists()
        with io_uring_offered() if over_ring else nullcontext():
            subprocess.run(
                [*KVFS, "mount", str(self.root), "--backing", str(self.backing), *self.options],
                check=True,
                capture_output=True,
            )

    def unmount(self) -> None:
        if self.backing is not None:
            subprocess.run([*KVFS, "umount", str(self.root)], check=False, capture_output=True)

    def restart(self) -> None:
        """A daemon that never saw these chunks (kvfs restarted, or the plain directory after
        a reboot), and nothing cached."""
        if self.backing is not None:
            self.unmount()
        drop_caches()
        if self.backing is not None:
            self.mount()

    def daemon_cpu(self) -> float:
        """CPU seconds the mount's daemon has used (user and system, all its threads)."""
        if self.backing is None:
            return 0.0
        pid = int(os.getxattr(self.root, control_protocol.PID))
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def clear(self) -> None:
        for entry in self.root.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def run_threads(count: int, items: list[int], fn: Callable[[int], object]) -> float:
    """Seconds to apply fn to every item from ``count`` threads."""
    start = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        for _ in pool.map(fn, items):
            pass
    return time.perf_counter() - start


def measure_data(
    target: Target, size: int, threads: int, total: int, o_direct: bool, seed: int
) -> dict[str, float]:
    keys = [seed * 1_000_000 + i for i in range(max(threads, total // size))]
    data = mmap.mmap(-1, size)
    data.write(random.Random(seed).randbytes(size))  # one payload: we time I/O, not rng
    root = str(target.root)

    def store(key: int) -> None:
        vllm_io.store(vllm_io.chunk_path(root, key), data, o_direct)

    slots = threading.local()  # each thread reads into its own host slot, as vLLM does

    def load(key: int) -> None:
        if not hasattr(slots, "buf"):
            slots.buf = vllm_io.aligned(size)
            slots.buf.write(bytes(size))  # touched once, like a long-lived host region
        vllm_io.load_into(vllm_io.chunk_path(root, key), slots.buf, o_direct)

    gb = len(keys) * size / 1e9
    before = target.daemon_cpu()
    result = {"store": gb / run_threads(threads, keys, store)}
    drop_caches()
    result["cold_load"] = gb / run_threads(threads, keys, load)
    result["warm_load"] = gb / run_threads(threads, keys, load)
    cpu = target.daemon_cpu() - before
    target.restart()  # a new daemon: what it found at mount is verified at the first open
    before = target.daemon_cpu()
    result["restart_load"] = gb / run_threads(threads, keys, load)
    result["daemon_cpu_s"] = cpu + target.daemon_cpu() - before
    result["gb_moved"] = 4 * gb
    return result


def measure_lookups(target: Target, count: int, seed: int) -> dict[str, float]:
    root = str(target.root)
    hits = [vllm_io.chunk_path(root, seed * 1_000_000 + i) for i in range(count)]
    for path in hits:
        vllm_io.store(path, b"\0" * 4096)
    misses = [vllm_io.chunk_path(root, seed * 1_000_000 + count + i) for i in range(count)]
    out = {}
    for name, paths, expect in (("lookup_hit", hits, True), ("lookup_miss", misses, False)):
        for suffix in ("", "_repeat"):  # first time for these names, then again
            start = time.perf_counter()
            found = sum(os.access(p, os.F_OK) for p in paths)  # vLLM's batch lookup call
            out[name + suffix] = count / (time.perf_counter() - start)
            assert found == (count if expect else 0), f"{name}: {found} of {count}"
    return out


# The floors: the least a FUSE daemon can do for a lookup, in C, answering from memory. Each
# entry: its source beside this file and its link flags (raising where it cannot be built).
FLOORS: dict[str, tuple[str, Callable[[], list[bytes]]]] = {
    # libfuse's loop reading /dev/fuse, as every daemon did before io_uring
    "floor": (
        "fuse_floor.c",
        lambda: subprocess.run(
            ["pkg-config", "--cflags", "--libs", "fuse3"], check=True, capture_output=True
        ).stdout.split(),
    ),
    # FUSE-over-io_uring: a queue per CPU, each served on its CPU (fuse.enable_uring=Y only)
    "floor_uring": ("fuse_uring_floor.c", lambda: [b"-pthread"]),
}


@contextmanager
def floor_daemon(name: str, base: Path, quiet: bool) -> Iterator[Path | None]:
    """The floor ``name`` built and mounted on ``base/name``; None where it cannot be built or
    mounted (fuse_uring_floor.c exits where the kernel does not offer io_uring)."""
    source_name, link_flags = FLOORS[name]
    binary, mnt, source = base / name, base / f"{name}-mnt", Path(__file__).with_name(source_name)
    try:
        subprocess.run(["cc", "-O2", "-o", binary, source, *link_flags()], check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        log(f"no {name} measured: cannot build {source_name} ({err})", quiet)
        yield None
        return
    mnt.mkdir()
    with io_uring_offered() if name == "floor_uring" and ENABLE_URING.exists() else nullcontext():
        # in a session of its own, as `kvfs mount` starts kvfs's daemon: with the scheduler's
        # autogroups (on by default) a daemon outside its callers' session gets its callers
        # moved between CPUs on its answers, which costs a first-time miss several times over
        # (docs/benchmarks.md, session 22)
        daemon = subprocess.Popen([binary, mnt], start_new_session=True)
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt) and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        if not os.path.ismount(mnt):
            log(f"no {name} measured: {source_name} did not mount", quiet)
        yield mnt if os.path.ismount(mnt) else None
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False, capture_output=True)
        daemon.wait()


def measure_floor(root: Path, count: int, seed: int) -> dict[str, float]:
    """``measure_lookups`` on a floor daemon: its names need no store to exist."""
    out = {}
    for name, prefix, expect in (("lookup_hit", "h", True), ("lookup_miss", "m", False)):
        paths = [f"{root}/{prefix}{seed}-{i}" for i in range(count)]
        for suffix in ("", "_repeat"):
            start = time.perf_counter()
            found = sum(os.access(p, os.F_OK) for p in paths)
            out[name + suffix] = count / (time.perf_counter() - start)
            assert found == (count if expect else 0), f"floor {name}: {found} of {count}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per data measurement")
    parser.add_argument("--lookups", type=int, default=4000, help="keys per lookup measurement")
    parser.add_argument("--o-direct", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--base", type=Path, help="working directory (default: a temp dir)")
    parser.add_argument(
        "--cpu-latency",
        type=int,
        metavar="MICROSECONDS",
        help="hold a CPU latency request for the whole run, every target measured under it "
        "(kvfs mount's --cpu-latency; 0: idle CPUs poll); default: the machine's as it is",
    )
    parser.add_argument(
        "--sessions",
        default="pyfuse3,kernel,kernel-io-uring",
        help="kvfs sessions to measure (comma-separated)",
    )
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.base))
    direct = Target("direct", base / "direct")
    mounts = [
        Target(session, base / f"mnt-{session}", base / f"backing-{session}", SESSIONS[session])
        for session in args.sessions.split(",")
    ]
    targets = (direct, *mounts)
    stack = ExitStack()
    rows: list[dict[str, object]] = []
    try:
        stack.enter_context(cpu_latency.held(args.cpu_latency))
        bound = cpu_latency.current()
        floors = {name: stack.enter_context(floor_daemon(name, base, args.json)) for name in FLOORS}
        modes = {}
        for t in targets:
            probe = vllm_io.probe_o_direct(str(t.root))
            modes[t.name] = {"auto": probe, "on": True, "off": False}[args.o_direct]
        for repeat in range(args.repeats):
            for size_mib in SIZES_MIB:
                for threads in THREADS:
                    # each repeat the other way round: what one target leaves behind (the
                    # disk's discards of its cleared files, a read-back) lands on each in turn
                    for t in targets if repeat % 2 == 0 else targets[::-1]:
                        seed = hash((repeat, size_mib, threads)) % 1000
                        row = measure_data(
                            t, size_mib << 20, threads, args.total_mib << 20, modes[t.name], seed
                        )
                        rows.append(
                            {
                                "target": t.name,
                                "size_mib": size_mib,
                                "threads": threads,
                                "repeat": repeat,
                                **row,
                            }
                        )
                        t.clear()
                    log(f"repeat {repeat}: {size_mib} MiB x {threads} threads done", args.json)
            for t in targets:
                rows.append(
                    {
                        "target": t.name,
                        "repeat": repeat,
                        **measure_lookups(t, args.lookups, repeat + 1),
                    }
                )
                t.clear()
            for name, floor in floors.items():
                if floor is not None:
                    rows.append(
                        {
                            "target": name,
                            "repeat": repeat,
                            **measure_floor(floor, args.lookups, repeat + 1),
                        }
                    )
    finally:
        stack.close()
        for mount in mounts:
            mount.unmount()
        shutil.rmtree(base, ignore_errors=True)

    report = {"cpu_latency_us": bound, **summarise(rows, modes)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


# How each session is mounted: pyfuse3 as today; kvfs's own session with passthrough reads,
# what `kvfs mount` gives root by default (its O_DIRECT stores checksummed after the
# publish, when the writers pause: the read-back then competes with the loads measured
# next); and the same with each publish reading its file back before it returns
# (--checksum-backlog 0). kernel-every-read: every read served and verified, stores in
# passthrough that read their O_DIRECT bytes back at the publish.
SESSIONS = {
    "pyfuse3": ("--session", "pyfuse3"),
    "kernel-every-read": ("--session", "kernel", "--verify", "every-read", "--io-uring", "off"),
    "kernel": ("--session", "kernel", "--verify", "first-read", "--io-uring", "off"),
    # the same over FUSE-over-io_uring (offered to this mount for the run)
    "kernel-io-uring": ("--session", "kernel", "--verify", "first-read", "--io-uring", "auto"),
    "kernel-at-publish": (
        "--session",
        "kernel",
        "--verify",
        "first-read",
        "--checksum-backlog",
        "0",
    ),
}


def log(message: str, quiet: bool) -> None:
    print(message, file=sys.stderr if quiet else sys.stdout, flush=True)


def summarise(rows: list[dict[str, object]], modes: dict[str, bool]) -> dict[str, object]:
    """Medians per (measure, size, threads) and target, and each session's ratio to direct."""
    cells: dict[tuple[str, object, object], dict[str, float]] = {}
    for measure in MEASURES:
        groups: dict[tuple[object, object, str], list[float]] = {}
        for row in rows:
            if measure in row:
                key = (row.get("size_mib"), row.get("threads"), str(row["target"]))
                groups.setdefault(key, []).append(float(row[measure]))  # type: ignore[arg-type]
        for (size, threads, target), values in groups.items():
            cells.setdefault((measure, size, threads), {})[target] = statistics.median(values)
    sessions = sorted({str(row["target"]) for row in rows} - {"direct", *FLOORS})
    results = []
    for (measure, size, threads), by_target in cells.items():
        for session in [*sessions, *(f for f in FLOORS if f in by_target)]:
            results.append(
                {
                    "measure": measure,
                    "size_mib": size,
                    "threads": threads,
                    "session": session,
                    "direct": by_target["direct"],
                    "kvfs": by_target[session],
                    "ratio": by_target[session] / by_target["direct"],
                }
            )
    summary = {
        session: {
            **{
                m: statistics.median(
                    r["ratio"] for r in results if r["measure"] == m and r["session"] == session
                )
                for m in MEASURES
            },
            # What the daemon burns to move the bytes (passthrough moves them in the kernel).
            "daemon_cpu_s_per_gb": sum(_of(rows, session, "daemon_cpu_s"))
            / sum(_of(rows, session, "gb_moved")),
        }
        for session in sessions
    }
    floors = {f: [r for r in results if r["session"] == f] for f in FLOORS}
    for name, floor in floors.items():  # what a round trip through the kernel costs any daemon
        if floor:
            summary[name] = {r["measure"]: r["ratio"] for r in floor}
    return {
        "o_direct": modes,
        "sessions": {session: list(SESSIONS[session]) for session in sessions},
        "floors": {name: f"tools/{FLOORS[name][0]}" for name, floor in floors.items() if floor},
        "results": results,
        "summary": summary,
        "units": {m: "GB/s" if "load" in m or m == "store" else "lookups/s" for m in MEASURES},
    }


def _of(rows: list[dict[str, object]], target: str, key: str) -> list[float]:
    return [float(r[key]) for r in rows if r["target"] == target and key in r]  # type: ignore[arg-type]


def print_table(report: dict[str, Any]) -> None:
    print(f"O_DIRECT used: {report['o_direct']}; CPU latency bound: {report['cpu_latency_us']} us")
    header = f"{'measure':<12}{'chunk':>7}{'threads':>9}{'session':>12}{'direct':>10}{'kvfs':>10}"
    print(header + f"{'kvfs/direct':>13}")
    for r in report["results"]:
        chunk = f"{r['size_mib']} MiB" if r["size_mib"] else "-"
        threads = r["threads"] or 1
        print(
            f"{r['measure']:<12}{chunk:>7}{threads:>9}{r['session']:>12}{r['direct']:>10.3f}"
            f"{r['kvfs']:>10.3f}{r['ratio']:>13.2f}"
        )
    for session, ratios in report["summary"].items():
        line = f"median kvfs/direct, {session}: " + ", ".join(
            f"{m} {v:.2f}" for m, v in ratios.items() if m in MEASURES
        )
        if "daemon_cpu_s_per_gb" in ratios:
            line += f"; daemon CPU {ratios['daemon_cpu_s_per_gb']:.2f} s per GB moved"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
