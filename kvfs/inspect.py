"""`kvfs ls`, `du`, `stat`, `top`, `evict`: reports from the running daemon, through its mount.

Everything comes from the daemon's own files in the mount (`.kvfs/usage.json`,
`.kvfs/namespaces.json`) and from xattrs, never from walking the tree, so the answers are fast
on a million chunks and exactly what the daemon counts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

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


def report(mount: Path, walk: bool) -> dict[str, Any]:
    name = "namespaces.json" if walk else "usage.json"
    with open(mount_of(mount) / ".kvfs" / name, "rb") as f:
        return json.loads(f.read())  # type: ignore[no-any-return]


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


def ls(mount: Path) -> tuple[dict[str, Any], str]:
    data = report(mount, walk=True)
    rows = [
        [
            "NAMESPACE",
            "MODEL",
            "DTYPE",
            "TOK/CHUNK",
            "CHUNKS",
            "BYTES",
            "TOKENS",
            "HIT RATE",
            "OLDEST READ",
            "NEWEST READ",
        ]
    ]
    for ns in data["namespaces"]:
        rate = ns["hit_rate"]
        rows.append(
            [
                ns["namespace"],
                str(ns["model"] or "-"),
                str(ns["dtype"] or "-"),
                str(ns["tokens_per_chunk"] or "-"),
                str(ns["chunks"]),
                human(ns["bytes"]),
                str(ns["tokens"] if ns["tokens"] is not None else "-"),
                f"{rate:.1%}" if rate is not None else "-",
                ns["oldest_read"] or "-",
                ns["newest_read"] or "-",
            ]
        )
    return data, table(rows)


def du(mount: Path) -> tuple[dict[str, Any], str]:
    data = report(mount, walk=False)
    capacity, used = data["capacity"], data["used"]
    # What a writer can still get: the mount's statfs caps the capacity's room by what the
    # backing disk has left (other data may share it), as `df` shows.
    st = os.statvfs(mount_of(mount))
    data["free"] = st.f_bavail * st.f_frsize
    lines = [
        f"{human(used)} of {human(capacity)} used ({used / capacity:.1%}), "
        f"{data['files']} files, {human(data['free'])} free"
    ]
    rows = [["NAMESPACE", "CHUNKS", "BYTES", "SHARE"]]
    for ns in data["namespaces"]:
        share = ns["bytes"] / used if used else 0
        rows.append([ns["namespace"], str(ns["chunks"]), human(ns["bytes"]), f"{share:.1%}"])
    return data, "\n".join([*lines, table(rows)])


def stat(path: Path) -> tuple[dict[str, Any], str]:
    mount_of(path)
    st = os.stat(path)
    data: dict[str, Any] = {
        "path": str(path.absolute()),
        "size": st.st_size,
        "blocks": st.st_blocks,
    }
    for name in os.listxattr(path):
        if name.startswith("user.kvfs."):
            value = os.getxattr(path, name).decode(errors="replace")
            data[name.removeprefix("user.kvfs.")] = int(value) if value.isdigit() else value
    text = "\n".join(f"{key:>12}: {value}" for key, value in data.items())
    return data, text


def evict(
    mount: Path, namespace: str | None, older_than: float | None
) -> tuple[dict[str, Any], str]:
    top = mount_of(mount)
    if namespace is not None:
        namespace = namespace_name(top, namespace)
    before = report(top, walk=False)
    request = f"namespace={namespace}" if namespace is not None else f"older-than={older_than}"
    try:
        os.setxattr(top, "user.kvfs.evict", request.encode())
    except FileNotFoundError:
        raise InspectError(f"no namespace {namespace!r} in {top}") from None
    after = report(top, walk=False)
    freed = before["used"] - after["used"]
    files = before["files"] - after["files"]
    data = {"request": request, "files": files, "bytes": freed, "used": after["used"]}
    text = f"evicted {files} files ({human(freed)}); {human(after['used'])} used now"
    if namespace is not None and os.getxattr(top / namespace, "user.kvfs.pinned") == b"1":
        data["pinned"] = True  # issue 14, item 5: say why nothing went
        text += f" ({namespace} is pinned: its chunks stay; setfattr -n user.kvfs.pin -v 0)"
    elif namespace is not None and not files and (top / namespace / "config.json").exists():
        chunks = sorted(p.name for p in top.glob(f"{namespace}_r*") if p.is_dir())
        where = ", ".join(chunks) or "none yet"
        text += f" ({namespace} holds the model's config.json; its chunks: {where})"
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


def rates(previous: dict[str, Any], current: dict[str, Any]) -> dict[str, float]:
    """Per-second rates of the daemon's counters between two reports."""
    span = current["time"] - previous["time"] or 1.0

    def delta(group: str, key: str) -> float:
        return float(current[group].get(key, 0) - previous[group].get(key, 0)) / span

    evicted = sum(current["evictions"].values()) - sum(previous["evictions"].values())
    return {
        "reads": delta("counters", "reads"),
        "bytes_read": delta("counters", "bytes_read"),
        "writes": delta("counters", "publishes"),
        "bytes_written": delta("counters", "bytes_written"),
        "hits": delta("lookups", "hit"),
        "misses": delta("lookups", "miss"),
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
