"""`kvfs ls`, `du`, `stat`, `top`, `evict`: reports from the running daemon, through its mount.

Everything comes from the daemon's own files in the mount (`.kvfs/usage.json`,
`.kvfs/namespaces.json`) and from xattrs, never from walking the tree, so the answers are fast
on a million chunks and exactly what the daemon counts.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from kvfs import control_protocol as proto
from kvfs import mountctl


class InspectError(RuntimeError):
    """The path is not (in) a kvfs mount; the message says so."""


def mount_of(path: Path) -> Path:
    target = path.absolute()
    for mount in sorted(mountctl.kvfs_mounts(), key=len, reverse=True):
        top = Path(mount)
        if target == top or top in target.parents:
            return top
    raise InspectError(f"{target} is not in a kvfs mount")


def report(mount: Path, walk: bool) -> proto.Report:
    with open(proto.report_path(mount_of(mount), walk), "rb") as f:
        data: proto.Report = json.loads(f.read())
        return data


def human(size: float | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(size) < 1024 or unit == "T":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return str(size)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def ago(iso: str | None, now: float) -> str:
    """``12s ago``, ``5m ago``, ``3h ago``, ``2d ago``; ``never`` for no time."""
    if iso is None:
        return "never"
    seconds = max(0.0, now - datetime.fromisoformat(iso).timestamp())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def ls(mount: Path) -> tuple[Mapping[str, Any], str]:
    """One row per namespace (a model's config directory and its ``_r<rank>`` data
    directories); model, dtype and each directory are in ``--json``."""
    data = report(mount, walk=True)
    rows = [
        [
            "NAMESPACE",
            "RANKS",
            "CHUNKS",
            "SIZE",
            "PINNED",
            "TOKENS",
            "READS",
            "HIT RATE",
            "LAST READ",
        ]
    ]
    for ns in data["namespaces"]:
        rate = ns["hit_rate"]
        rows.append(
            [
                ns["namespace"],
                str(len(ns["ranks"])),
                str(ns["chunks"]),
                human(ns["bytes"]),
                human(ns["pinned_bytes"]) if ns["pinned_bytes"] else "-",
                str(ns["tokens"] if ns["tokens"] is not None else "-"),
                str(ns["reads"]),
                f"{rate:.1%}" if rate is not None else "-",
                ago(ns["newest_read"], data["time"]),
            ]
        )
    return data, table(rows)


def du(mount: Path) -> tuple[Mapping[str, Any], str]:
    data = report(mount, walk=False)
    capacity, used = data["capacity"], data["used"]
    # What a writer can still get: the mount's statfs caps the capacity's room by what the
    # backing disk has left (other data may share it), as `df` shows.
    st = os.statvfs(mount_of(mount))
    free = st.f_bavail * st.f_frsize
    lines = [
        f"{human(used)} of {human(capacity)} used ({used / capacity:.1%}), "
        f"{data['files']} files, {human(free)} free, "
        f"{human(data['pinned_bytes'])} pinned"
    ]
    rows = [["NAMESPACE", "CHUNKS", "BYTES", "SHARE"]]
    for ns in data["namespaces"]:
        share = ns["bytes"] / used if used else 0
        rows.append([ns["namespace"], str(ns["chunks"]), human(ns["bytes"]), f"{share:.1%}"])
    return {**data, "free": free}, "\n".join([*lines, table(rows)])


def stat(path: Path) -> tuple[dict[str, Any], str]:
    mount_of(path)
    st = os.stat(path)
    data: dict[str, Any] = {
        "path": str(path.absolute()),
        "size": st.st_size,
        "blocks": st.st_blocks,
    }
    for name in os.listxattr(path):
        if name.startswith(proto.PREFIX):
            value = os.getxattr(path, name).decode(errors="replace")
            data[name.removeprefix(proto.PREFIX)] = int(value) if value.isdigit() else value
    text = "\n".join(f"{key:>12}: {value}" for key, value in data.items())
    return data, text


def evict(
    mount: Path, namespace: str | None, older_than: float | None, dry_run: bool = False
) -> tuple[dict[str, Any], str]:
    """Evict a namespace (all its directories), one of its directories, or what was not read
    for ``older_than`` seconds (or, ``dry_run``, count what would go); say what went, and why
    nothing did when nothing did."""
    top = mount_of(mount)
    if namespace is None:
        requests = [f"older-than={older_than}"]
    else:
        name = namespace_name(top, namespace)
        known = report(top, walk=False)["namespaces"]
        group = next((n for n in known if n["namespace"] == name), None)
        requests = [f"namespace={d}" for d in (group["directories"] if group else [name])]
    files = size = 0
    for request in requests:
        request_id = secrets.token_hex(8)  # its outcome is read back under this name
        asked = {"request": request, "id": request_id, "dry_run": dry_run}
        try:
            os.setxattr(top, proto.EVICT, json.dumps(asked).encode())
        except FileNotFoundError:
            raise InspectError(
                f"no namespace {namespace!r} in {top} (`kvfs ls` lists them)"
            ) from None
        outcome = json.loads(os.getxattr(top, proto.EVICTED + request_id))
        files, size = files + outcome["files"], size + outcome["bytes"]
    used = report(top, walk=False)["used"]
    data = {"requests": requests, "dry_run": dry_run, "files": files, "bytes": size, "used": used}
    verb = "would evict" if dry_run else "evicted"
    text = f"{verb} {files} files ({human(size)}); {human(used)} used now"
    pinned = [
        r.removeprefix("namespace=")
        for r in requests
        if r.startswith("namespace=")
        and os.getxattr(top / r.removeprefix("namespace="), proto.PINNED) == b"1"
    ]
    if pinned:  # issue 14, item 5: say why chunks stayed
        data["pinned"] = pinned
        text += f" ({', '.join(pinned)} is pinned: its chunks stay; setfattr -n user.kvfs.pin -v 0)"
    return data, text


def namespace_name(top: Path, given: str) -> str:
    """A namespace as the operator may write it: its name, ``name/``, or its path (absolute, or
    relative to here) in the mount. Raises InspectError for anything else (globs included)."""
    path = Path(given)
    if path.is_absolute() or os.sep in given.rstrip(os.sep) or (Path.cwd() / path).exists():
        target = (Path.cwd() / path).absolute()
        if target.parent != top:
            raise InspectError(f"{given!r} is not a namespace: a directory at the top of {top}")
        return target.name
    name = given.rstrip(os.sep)
    if not name or any(c in name for c in "*?["):
        raise InspectError(f"{given!r} is not a namespace name (no globs; `kvfs ls` lists them)")
    return name


def rates(previous: proto.Report, current: proto.Report) -> dict[str, float]:
    """Per-second rates of the daemon's counters between two reports."""
    span = current["time"] - previous["time"] or 1.0

    def delta(now: Mapping[str, Any], before: Mapping[str, Any], key: str) -> float:
        return float(now.get(key, 0) - before.get(key, 0)) / span

    counters = (current["counters"], previous["counters"])
    lookups = (current["lookups"], previous["lookups"])
    evicted = sum(current["evictions"].values()) - sum(previous["evictions"].values())
    return {
        "reads": delta(*counters, "reads"),
        "bytes_read": delta(*counters, "bytes_read"),
        "writes": delta(*counters, "publishes"),
        "bytes_written": delta(*counters, "bytes_written"),
        "hits": delta(*lookups, "hit"),
        "misses": delta(*lookups, "miss"),
        "evictions": evicted / span,
    }


def top(mount: Path, interval: float, count: int | None, as_json: bool = False) -> None:
    """A live view: rates since the previous sample, and the current queues and usage."""
    previous = report(mount, walk=False)
    shown = 0
    while count is None or shown < count:
        time.sleep(interval)
        current = report(mount, walk=False)
        r, q = rates(previous, current), current["queues"]
        if as_json:  # one object per line
            print(
                json.dumps(
                    {
                        "time": current["time"],
                        "rates": r,
                        "queues": q,
                        "used": current["used"],
                        "capacity": current["capacity"],
                    }
                ),
                flush=True,
            )
        else:
            print(
                f"{time.strftime('%H:%M:%S')}  reads {r['reads']:7.1f}/s "
                f"{human(r['bytes_read'])}/s  writes {r['writes']:7.1f}/s "
                f"{human(r['bytes_written'])}/s  hits {r['hits']:7.1f}/s  "
                f"misses {r['misses']:7.1f}/s  evictions {r['evictions']:5.1f}/s  "
                f"queues r{q['read']['waiting']}+{q['read']['running']} "
                f"w{q['write']['waiting']}+{q['write']['running']}  "
                f"used {human(current['used'])}/{human(current['capacity'])}",
                flush=True,
            )
        previous = current
        shown += 1
