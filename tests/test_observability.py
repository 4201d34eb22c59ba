"""Prometheus /metrics and KV events on ZMQ, checked against a known workload."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvfs import __version__
from kvfs.config import MountConfig, daemon_log
from kvfs.mount.metrics import Latencies
from tests.conftest import Mount, flip_byte, free_port, kvfs, make_mount, small_filesystem
from tools import vllm_io

CHUNK = 128 << 10
DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana-kvfs.json"


def samples(port: int) -> list[Sample]:
    """Every sample /metrics serves now (no wait: it must be current when scraped)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(port: int) -> dict[str, float]:
    """The kvfs samples by ``name{label="value",...}`` (labels sorted; bare name if none)."""
    found = {}
    for sample in samples(port):
        if sample.name.startswith("kvfs_"):
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def scrape_until(port: int, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """Scrape until ``done`` (the background eviction sweep runs on after a store returns)."""
    deadline = time.monotonic() + 10
    while not done(found := scrape(port)):
        assert time.monotonic() < deadline, found
        time.sleep(0.01)
    return found


@contextmanager
def metered_mount(tmp_path: Path, *options: str) -> Iterator[tuple[Mount, int]]:
    """A mount of the test's own serving /metrics; yields it and the port."""
    port = free_port()
    mount = make_mount(tmp_path, "--metrics-port", str(port), *options)
    try:
        yield mount.start(), port
    finally:
        mount.stop()


@pytest.fixture
def observed_mount(tmp_path: Path) -> Iterator[tuple[Mount, int, int]]:
    events = free_port()
    with metered_mount(tmp_path, "--events", f"tcp://127.0.0.1:{events}") as (mount, metrics):
        yield mount, metrics, events


def test_metrics_deltas_match_a_known_workload(observed_mount: tuple[Mount, int, int]) -> None:
    mount, port, _ = observed_mount
    before = scrape(port)
    paths = [vllm_io.chunk_path(str(mount.path), k) for k in range(5)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
    mount.settle()  # published at the last release, which the kernel sends after close()
    stored = scrape(port)
    for path in paths[:3]:
        vllm_io.load(path, CHUNK)
    assert not os.access(vllm_io.chunk_path(str(mount.path), 99), os.F_OK)  # never stored
    opens, releases = (
        f'kvfs_operation_duration_seconds_count{{operation="{op}"}}' for op in ("open", "release")
    )
    # (a reader's RELEASE comes after its close() has returned)
    after = scrape_until(port, lambda found: found[releases] - stored[releases] >= 3)
    # Each counted once, whether the kernel session answered it inline or, needing I/O after
    # all, in a task.
    assert after[opens] - stored[opens] == 3 and after[releases] - stored[releases] == 3

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("kvfs_publishes_total") == 5
    assert delta("kvfs_written_bytes_total") == 5 * CHUNK
    assert delta("kvfs_reads_total") == 3
    session = mount.usage()["session"]
    # the kernel reads a chunk verified at its publish straight from its backing file
    default_verify = {f.name: f.default for f in dataclasses.fields(MountConfig)}["verify"]
    passed_through = session["passthrough"] and default_verify == "first-read"
    assert delta("kvfs_read_bytes_total") == (0 if passed_through else 3 * CHUNK)
    assert delta('kvfs_lookups_total{result="hit"}') == 3
    assert delta('kvfs_lookups_total{result="miss"}') == 1  # a store's own exists() is none
    assert after["kvfs_used_bytes"] == 5 * CHUNK and after["kvfs_chunks"] == 5
    if not session["passthrough"]:  # with it, the kernel writes the backing files itself
        assert delta('kvfs_operation_duration_seconds_count{operation="write"}') >= 5
    assert delta('kvfs_operation_duration_seconds_count{operation="create"}') == 5
    assert delta('kvfs_operation_duration_seconds_count{operation="flush"}') >= 5
    # Answered inline by the kernel session (no task of their own): still timed.
    assert delta('kvfs_operation_duration_seconds_count{operation="lookup"}') >= 6
    assert after["kvfs_capacity_bytes"] > 0 and "kvfs_checksum_failures_total" in after


def test_every_first_time_miss_is_counted_and_timed(
    observed_mount: tuple[Mount, int, int],
) -> None:
    """The kernel session answers most first-time misses without the interpreter (FastMisses,
    after Python's first in a directory): each is still a miss for the hit rate and a lookup
    in the latency histogram, and the root's misses leave the control directory alone."""
    mount, port, _ = observed_mount
    root = str(mount.path)
    vllm_io.store(vllm_io.chunk_path(root, 0), vllm_io.chunk_bytes(0, CHUNK))  # its directory
    mount.settle()
    for name in ("a", "b"):
        assert not (mount.path / name).exists()
    before = scrape(port)
    for key in range(1, 21):
        assert not os.access(vllm_io.chunk_path(root, key), os.F_OK)
    miss = 'kvfs_lookups_total{result="miss"}'
    lookup = 'kvfs_operation_duration_seconds_count{operation="lookup"}'
    # (a miss answered in C is timed just after its answer: a scrape may come in between)
    after = scrape_until(port, lambda found: found[lookup] - before[lookup] >= 20)
    assert after[miss] - before[miss] == 20
    assert mount.usage()["lookups"]["miss"] == 20


def test_the_latency_histogram_counts_each_request_in_the_first_bucket_that_holds_it() -> None:
    latencies = Latencies(["lookup", "open"])
    for seconds in (5e-6, 1e-5, 2e-5, 3.0, 100.0):  # a bound holds its own value ("le")
        latencies.of("lookup").observe(seconds)
    registry = CollectorRegistry()
    registry.register(latencies)
    samples = {
        (s.name, s.labels["operation"], s.labels.get("le")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    name = "kvfs_operation_duration_seconds"
    cumulative = {le: samples[(f"{name}_bucket", "lookup", le)] for le in ("1e-05", "5e-05")}
    assert cumulative == {"1e-05": 2, "5e-05": 3}
    assert samples[(f"{name}_bucket", "lookup", "30.0")] == 4
    assert (
        samples[(f"{name}_bucket", "lookup", "+Inf")] == samples[(f"{name}_count", "lookup", None)]
    )
    assert samples[(f"{name}_count", "lookup", None)] == 5
    assert samples[(f"{name}_sum", "lookup", None)] == pytest.approx(103.000035)
    assert samples[(f"{name}_count", "open", None)] == 0


def test_an_engine_checking_chunks_it_stored_asks_the_daemon_nothing(
    observed_mount: tuple[Mount, int, int],
) -> None:
    """vLLM's lookup is access(F_OK); on a root mount (no mode checks to make) the kernel
    answers it for a chunk it saw stored from its own caches, as a plain directory's would."""
    mount, port, _ = observed_mount
    paths = [vllm_io.chunk_path(str(mount.path), k) for k in range(5)]
    for key, path in enumerate(paths):
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
    mount.settle()
    asked = ("lookup", "getattr")
    before = scrape(port)
    assert all(os.access(path, os.F_OK) for path in paths)
    after = scrape(port)
    for operation in asked:
        name = f'kvfs_operation_duration_seconds_count{{operation="{operation}"}}'
        assert after.get(name, 0) == before.get(name, 0), operation


# -- issue 14, item 9: what a dashboard needs ------------------------------------------------


def test_metrics_are_current_when_scraped(observed_mount: tuple[Mount, int, int]) -> None:
    """Each scrape answers with the daemon's state of that moment, not a copy up to 1 s old."""
    mount, port, _ = observed_mount
    for round_ in range(3):
        before = scrape(port)
        path = vllm_io.chunk_path(str(mount.path), 100 + round_)
        vllm_io.store(path, vllm_io.chunk_bytes(round_, CHUNK))
        mount.settle()
        after = scrape(port)  # at once
        assert after["kvfs_publishes_total"] - before["kvfs_publishes_total"] == 1
        assert after["kvfs_chunks"] - before["kvfs_chunks"] == 1
        Path(path).unlink()
        assert scrape(port)["kvfs_chunks"] == before["kvfs_chunks"]


def test_kvfs_chunks_counts_chunk_files_not_namespace_configs(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, port, _ = observed_mount
    config_dir = mount.path / vllm_io.NAMESPACE  # vLLM: <model>_<digest>/config.json
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"model_name": "test/model"}))
    for key in range(3):
        vllm_io.store(vllm_io.chunk_path(str(mount.path), key), vllm_io.chunk_bytes(key, CHUNK))
    mount.settle()
    after = scrape(port)
    assert after["kvfs_chunks"] == 3  # the config.json is no chunk
    per_namespace = [v for k, v in after.items() if k.startswith("kvfs_namespace_chunks{")]
    assert sum(per_namespace) == 3


def test_no_label_value_has_a_space_and_reasons_are_snake_case(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, port, _ = observed_mount
    vllm_io.store(vllm_io.chunk_path(str(mount.path), 1), vllm_io.chunk_bytes(1, CHUNK))
    mount.settle()
    found = samples(port)
    for sample in found:
        for label, value in sample.labels.items():
            assert " " not in value, f"{sample.name}{{{label}={value!r}}}"
    reasons = {
        s.labels["reason"]
        for s in found
        if s.name in ("kvfs_evictions_total", "kvfs_evicted_bytes_total")
    }
    assert reasons == {"capacity", "watermark", "disk_full", "request"}
    failures = {s.labels["reason"] for s in found if s.name == "kvfs_publish_failures_total"}
    assert {"no_space", "io_error", "timeout", "too_large"} <= failures
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", r) for r in reasons | failures)


def test_a_failed_publish_is_counted_by_reason_and_logged_with_its_path(tmp_path: Path) -> None:
    with metered_mount(tmp_path, "--capacity", str(8 * CHUNK)) as (mount, port):
        os.setxattr(mount.path, "user.kvfs.pin", b"1")  # nothing may go: the ninth gets ENOSPC
        before = scrape(port)
        failed = []
        for key in range(12):
            path = vllm_io.chunk_path(str(mount.path), key)
            try:
                vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
            except OSError as err:
                assert err.errno == 28  # ENOSPC
                failed.append(path)
        mount.settle()
        after = scrape(port)
        log = daemon_log(mount.path).read_text()
    assert len(failed) == 4
    no_space = 'kvfs_publish_failures_total{reason="no_space"}'
    assert after[no_space] - before.get(no_space, 0) == 4
    assert after["kvfs_publishes_total"] - before["kvfs_publishes_total"] == 8
    # The log names what failed the way an operator finds it: the file's path, not an inode.
    rel = Path(failed[0]).relative_to(mount.path).parent
    lines = [line for line in log.splitlines() if "publish of" in line]
    assert lines and all(str(rel) in line and "no_space" in line for line in lines), lines
    assert not any(re.search(r"publish of inode \d+", line) for line in lines)


def test_a_file_larger_than_the_write_buffer_is_a_too_large_failure(tmp_path: Path) -> None:
    with metered_mount(tmp_path, "--write-buffer", "1M") as (mount, port):
        assert scrape(port)["kvfs_write_buffer_limit_bytes"] == 1 << 20
        path = vllm_io.chunk_path(str(mount.path), 1)
        try:
            vllm_io.store(path, vllm_io.chunk_bytes(1, 2 << 20))
        except OSError as err:
            assert err.errno == 27  # EFBIG
        else:  # a file the kernel writes itself (passthrough) takes no buffer
            pytest.skip("this session wrote the file in passthrough: no write buffer")
        mount.settle()
        assert scrape(port)['kvfs_publish_failures_total{reason="too_large"}'] == 1


def test_evictions_are_counted_in_files_and_bytes_by_reason(tmp_path: Path) -> None:
    with metered_mount(tmp_path, "--capacity", str(8 * CHUNK)) as (mount, port):
        for key in range(20):
            vllm_io.store(vllm_io.chunk_path(str(mount.path), key), vllm_io.chunk_bytes(key, CHUNK))
        mount.settle()
        # The sweep is done: down to the low watermark (90 %), every eviction counted.
        filled = scrape_until(
            port,
            lambda m: (
                m["kvfs_used_bytes"] <= 0.9 * 8 * CHUNK
                and m["kvfs_chunks"] + sum(v for k, v in m.items() if "evictions_total" in k) == 20
            ),
        )
        kvfs("evict", str(mount.path), "--namespace", f"{vllm_io.NAMESPACE}_r0")
        after = scrape(port)
    evicted = {
        reason: filled[f'kvfs_evictions_total{{reason="{reason}"}}']
        for reason in ("capacity", "watermark")
    }
    assert sum(evicted.values()) >= 12  # 20 stored, 8 fit (the sweep keeps fewer)
    for reason, count in evicted.items():
        assert filled[f'kvfs_evicted_bytes_total{{reason="{reason}"}}'] == count * CHUNK
    remaining = filled["kvfs_chunks"]
    assert remaining == 20 - sum(evicted.values())
    assert after['kvfs_evictions_total{reason="request"}'] == remaining
    assert after['kvfs_evicted_bytes_total{reason="request"}'] == remaining * CHUNK
    assert after["kvfs_chunks"] == 0 and after["kvfs_used_bytes"] == 0


def test_a_quarantine_is_counted_in_files_and_bytes(tmp_path: Path) -> None:
    # without the scrub, which could quarantine the chunk before the load (conftest's
    # unscrubbed_mount): its count is the same, the load's error not
    with metered_mount(tmp_path, "--scrub-rate", "0") as (mount, port):
        path = vllm_io.chunk_path(str(mount.path), 1)
        vllm_io.store(path, vllm_io.chunk(1, CHUNK), o_direct=True)
        flip_byte(str(mount.on_backing(path)))
        with pytest.raises(OSError):
            vllm_io.load(path, CHUNK, o_direct=True)
        after = scrape(port)
    assert after["kvfs_quarantined_total"] == 1
    assert after["kvfs_quarantined_bytes_total"] == CHUNK
    assert after["kvfs_checksum_failures_total"] == 1


def test_backing_free_bytes_and_build_info(tmp_path: Path) -> None:
    disk = tmp_path / "disk"  # the backing directory on a tmpfs of its own
    with small_filesystem(disk, "tmpfs", "size=64m"), metered_mount(disk) as (mount, port):
        vllm_io.store(vllm_io.chunk_path(str(mount.path), 1), vllm_io.chunk_bytes(1, CHUNK))
        mount.settle()
        found = scrape(port)
        st = os.statvfs(mount.backing)  # nothing else writes this tmpfs
        assert found["kvfs_backing_free_bytes"] == st.f_bavail * st.f_frsize
        assert found["kvfs_backing_size_bytes"] == st.f_blocks * st.f_frsize == 64 << 20
        session = mount.usage()["session"]
    info = {k: v for k, v in found.items() if k.startswith("kvfs_build_info{")}
    labels = (
        f'python="{platform.python_version()}",session="{session["name"]}",version="{__version__}"'
    )
    assert info == {f"kvfs_build_info{{{labels}}}": 1.0}


def _subscribe(port: int) -> zmq.Socket:  # type: ignore[type-arg]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ's slow joiner: a subscription takes a moment to reach the publisher
    return sub


def _events(sub: zmq.Socket, until: float) -> list[object]:  # type: ignore[type-arg]
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[object] = []
    sequences = []
    while time.monotonic() < until:
        if sub.poll(100):
            _topic, seq, payload = sub.recv_multipart()
            sequences.append(int.from_bytes(seq, "big"))
            events.extend(decoder.decode(payload).events)
    assert sequences == sorted(sequences)
    return events


def test_kv_events_decode_with_vllms_classes_and_name_every_chunk(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, _, port = observed_mount
    sub = _subscribe(port)
    keys = [0xABC0 + k for k in range(4)]
    paths = [vllm_io.chunk_path(str(mount.path), k) for k in keys]
    for key, path in zip(keys, paths, strict=True):
        vllm_io.store(path, vllm_io.chunk_bytes(key, CHUNK))
    mount.settle()  # each published (after its rename returned): evictable
    Path(paths[0]).unlink()  # purge one by hand
    kvfs("evict", str(mount.path), "--namespace", f"{vllm_io.NAMESPACE}_r0")  # and the rest
    events = _events(sub, time.monotonic() + 1.5)
    sub.close()
    hashes = [maybe_convert_block_hash(k.to_bytes(32, "big")) for k in keys]  # vLLM's encoding
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # Once each, under the final name only (not the temp name); in the order of their
    # publishes, which follow the renames in the background.
    assert sorted(stored) == sorted(hashes)
    assert sorted(removed) == sorted(hashes)
    assert {e.medium for e in events} == {"kvfs"}  # type: ignore[attr-defined]
    assert {e.group_idx for e in events} == {0}  # type: ignore[attr-defined]


def test_a_subscriber_that_stops_reading_never_slows_the_mount(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, _, port = observed_mount
    stalled = _subscribe(port)
    stalled.setsockopt(zmq.RCVHWM, 1)
    start = time.monotonic()
    for key in range(300):  # far more events than the stalled subscriber will take
        vllm_io.store(vllm_io.chunk_path(str(mount.path), key), b"z" * 4096)
    elapsed = time.monotonic() - start
    live = _subscribe(port)
    vllm_io.store(vllm_io.chunk_path(str(mount.path), 999), b"z" * 4096)
    events = _events(live, time.monotonic() + 1.0)
    stalled.close()
    live.close()
    assert elapsed < 60  # 300 stores went through while nobody read the events
    seen = [h for e in events for h in e.block_hashes]  # type: ignore[attr-defined]
    assert maybe_convert_block_hash((999).to_bytes(32, "big")) in seen  # still serves a reader


# -- the Grafana dashboard (docs/grafana-kvfs.json) ------------------------------------------

# PromQL's functions, aggregations and keywords: every other name in an expression is a metric.
PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile",
}  # fmt: skip
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The metrics a PromQL expression selects, each with its ``label="value"`` matchers."""
    found: list[tuple[str, dict[str, str]]] = [
        (name, {}) for name in re.findall(rf"label_values\(\s*({_NAME})", expr)
    ]
    expr = re.sub(r"label_values\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", "", expr)  # numbers (1e-3 is no name)
    for match in re.finditer(rf"({_NAME})\s*(\{{[^}}]*\}})?", expr):
        name, matchers = match[1], match[2] or ""
        if name in PROMQL_WORDS or expr[match.end() :].lstrip().startswith("("):
            continue  # a function or keyword
        labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers))  # = only, not =~ != !~
        found.append((name, labels))
    return found


def dashboard_queries(dashboard: dict[str, object]) -> list[tuple[str, str]]:
    """(where, expression) for every panel target, in rows too, and every template query."""
    queries = []

    def panels(items: list[dict[str, object]]) -> None:
        for panel in items:
            panels(panel.get("panels", []))  # type: ignore[arg-type]
            for target in panel.get("targets", []):  # type: ignore[attr-defined]
                queries.append((str(panel["title"]), target["expr"]))

    panels(dashboard["panels"])  # type: ignore[arg-type]
    for variable in dashboard.get("templating", {}).get("list", []):  # type: ignore[attr-defined]
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append((variable["name"], query["query"] if isinstance(query, dict) else query))
    return queries


def test_selectors_finds_metrics_and_not_functions_or_labels() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, operation) (rate(kvfs_op_bucket{job=~"$job"}'
        '[$__rate_interval]))) / on(instance) group_left kvfs_x{result="hit", reason!="a"} '
        "* 1e-3 + label_values(kvfs_build_info, instance)"
    )
    assert sorted(selectors(expr)) == [
        ("kvfs_build_info", {}),
        ("kvfs_op_bucket", {}),
        ("kvfs_x", {"result": "hit"}),
    ]


def test_every_grafana_panel_queries_metrics_a_mount_exports(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, port, _ = observed_mount
    vllm_io.store(vllm_io.chunk_path(str(mount.path), 1), vllm_io.chunk_bytes(1, CHUNK))
    mount.settle()
    vllm_io.load(vllm_io.chunk_path(str(mount.path), 1), CHUNK)
    exported = samples(port)
    names = {s.name for s in exported}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 15
    for where, expr in queries:
        found = selectors(expr)
        assert found, f"{where}: no metric in {expr!r}"
        for name, labels in found:
            assert name in names, f"{where}: {name} is not exported"
            matching = [
                s for s in exported if s.name == name and labels.items() <= s.labels.items()
            ]
            assert matching, f"{where}: no {name} sample has {labels}"


def test_the_guide_lists_every_metric_a_mount_exports_and_no_other(
    observed_mount: tuple[Mount, int, int],
) -> None:
    mount, port, _ = observed_mount
    vllm_io.store(vllm_io.chunk_path(str(mount.path), 1), vllm_io.chunk_bytes(1, CHUNK))
    mount.settle()
    guide = (DASHBOARD.parent / "guide.md").read_text()
    section = guide[guide.index("## Metrics") :].split("\n## ")[0]
    listed = set(re.findall(r"`(kvfs_[a-z_]+)", section))
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    families = [
        f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("kvfs_") and not f.name.endswith("_created")  # a histogram's start
    ]
    exported = {f.name + "_total" if f.type == "counter" else f.name for f in families}
    # kvfs_share_*: only --shared mounts export them (tests/test_shared.py checks those)
    assert {name for name in listed if not name.startswith("kvfs_share_")} == exported
