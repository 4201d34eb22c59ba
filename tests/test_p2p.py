"""The p2p tier over real ZMQ sockets and real NIXL agents (UCX, host memory, loopback).

Two engines exchange chunks byte-exact (connectors with device tensors; the scheduler side
alone), a peer with another fingerprint or hash seed is refused and counted, a stopped or
killed peer (a process of its own) costs at most the lookup timeout, and hostile messages are
dropped and counted while the tier goes on serving. vLLM 0.33.0's own p2p tier fetches from a
kvfs engine and the other way round (tests/test_p2p_vllm.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from kvfs import p2p_protocol as proto
from kvfs.config import ConfigError
from kvfs.connector.nixl_data import NixlData, nixl_unavailable
from tests import kv_model
from tests.conftest import free_port
from tests.p2p_engine import ROW, Engine, Region, chunks

REASON = nixl_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"NIXL cannot load: {REASON}")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[Engine] = []

    def make(port: int, peers: list[str], **options: Any) -> Engine:
        made.append(Engine(port, peers, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def pair(engines: Any, **options: Any) -> tuple[Engine, Engine]:
    pa, pb = free_port(), free_port()
    a = engines(pa, [f"127.0.0.1:{pb}"], **options)
    b = engines(pb, [f"127.0.0.1:{pa}"], **options)
    a.ready_with(b)
    return a, b


def test_two_connectors_exchange_chunks_byte_exact() -> None:
    """Device blocks of engine A -> A's host tier -> NIXL -> B's host tier -> B's device."""
    from tests.test_tiering import BPC, Harness

    pa, pb = free_port(), free_port()
    a = Harness(
        {
            "cpu_bytes_to_use": 8 << 20,
            "secondary_tiers": [{"type": "p2p", "port": pa, "peers": [f"127.0.0.1:{pb}"]}],
        }
    )
    b = Harness(
        {
            "cpu_bytes_to_use": 8 << 20,
            "secondary_tiers": [{"type": "p2p", "port": pb, "peers": [f"127.0.0.1:{pa}"]}],
        }
    )
    try:
        for tensor in b.kv.values():
            tensor.zero_()
        keys = a.keys(4)
        a.store(keys)  # blocks 0..7 of A, now in A's host tier
        deadline = time.monotonic() + 30
        tier = b.conn.manager.tiers[0]
        while not tier._ready_peers():  # before the handshake every lookup is a miss
            assert time.monotonic() < deadline, "no handshake"
            a.conn.step()
            b.conn.step()
            time.sleep(0.002)
        while True:  # both schedulers step; B asks until nothing is RETRY
            found = b.conn.lookup(keys, "req")
            if not found.retry:
                break
            assert time.monotonic() < deadline, "lookups still RETRY"
            a.conn.step()
            b.conn.step()
            time.sleep(0.002)
        assert found.hits == 4
        assert b.load(keys, first_block=10) == ("p2p",) * 4
        for name in ("attn.0", "attn.1"):  # group 0, the chunks stored
            loaded = b.kv[name][10 : 10 + 4 * BPC]
            assert kv_model.same_bytes(loaded, a.original[name][0 : 4 * BPC])
        b.conn.finish_request("req")
        for _ in range(20):
            a.conn.step()
            b.conn.step()
            time.sleep(0.002)
        assert a.conn.manager.host.busy_slots == 0, "the serving side keeps pins"
        assert b.conn.manager.host.busy_slots == 0
        registry = b.conn.metrics.registry
        assert registry.get_sample_value("kvfs_connector_chunks_served_total", {"tier": "p2p"}) == 4
        assert registry.get_sample_value("kvfs_tier_p2p_fetched_total", {"tier": "p2p"}) == 4
        assert registry.get_sample_value("kvfs_tier_p2p_peers", {"tier": "p2p"}) == 1
        served = a.conn.metrics.registry.get_sample_value(
            "kvfs_tier_p2p_served_total", {"tier": "p2p"}
        )
        assert served == 4
    finally:
        a.close()
        b.close()


def test_both_ways_several_requests_and_a_partial_prefix(engines: Any) -> None:
    a, b = pair(engines)
    on_a, on_b = chunks(1, 6), chunks(2, 3)
    a.put(on_a)
    b.put(on_b)
    keys_a = list(on_a)
    found, _ = b.ask(keys_a[:4], "r1", a)
    assert found.hits == 4
    assert b.read(keys_a[:4]) == [on_a[k] for k in keys_a[:4]]
    # A prefix that runs past what the peer holds stops at the first miss.
    missing = list(chunks(3, 1))
    found, _ = b.ask([*keys_a[4:], *missing, *keys_a[:1]], "r2", a)
    assert found.hits == 2
    found, _ = a.ask(list(on_b), "r3", b)
    assert found.hits == 3 and a.read(list(on_b)) == list(on_b.values())
    for engine, request in ((b, "r1"), (b, "r2"), (a, "r3")):
        engine.manager.on_request_finished(request)
    for _ in range(20):
        a.step()
        b.step()
    assert a.manager.host.busy_slots == b.manager.host.busy_slots == 0
    assert b.metric("lookup_misses") >= 1 and b.metric("fetched") == 6


@pytest.mark.parametrize("differs", ["model", "hash_seed"])
def test_a_peer_with_another_fingerprint_or_seed_is_refused(engines: Any, differs: str) -> None:
    pa, pb = free_port(), free_port()
    a = engines(pa, [f"127.0.0.1:{pb}"])
    other = {"model": "kvfs-test/another-model"} if differs == "model" else {"hash_seed": "42"}
    b = engines(pb, [f"127.0.0.1:{pa}"], **other)
    a.put(chunks(1, 2))
    deadline = time.monotonic() + 30
    while a.metric("refused") < 1 or b.metric("refused") < 1:  # each side refuses the other
        assert time.monotonic() < deadline, "no refusal"
        a.step()
        b.step()
        time.sleep(0.005)
    for _ in range(20):
        a.step()
        b.step()
    assert not a.tier._ready_peers() and not b.tier._ready_peers()
    assert a.metric("peers") == b.metric("peers") == 0
    found, seconds = b.ask(list(chunks(1, 2)), "r", a)
    assert found.hits == 0 and seconds < 1
    assert len(b.manager.host) == 0 and b.metric("fetched") == 0
    assert a.metric("served") == 0


def _spawn_peer(port: int, peer: str, seed: int, count: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.p2p_engine", str(port), peer, str(seed), str(count)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # NIXL logs to stdout first
        lines.append(line)
        if line.strip() == "ready" or len(lines) > 100:
            break
    assert lines and lines[-1].strip() == "ready", f"peer did not start: {lines!r}"
    return proc


def _stopped(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state in ("T", "t")


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while not _stopped(pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def peer_process() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: Any) -> subprocess.Popen[str]:
        procs.append(_spawn_peer(*args))
        return procs[-1]

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


TIMEOUT = 1.0
MARGIN = 3.0  # generous: a loaded 2-core CI machine


def test_a_stopped_then_killed_peer_costs_at_most_the_lookup_timeout(
    engines: Any, peer_process: Any
) -> None:
    mine, theirs = free_port(), free_port()
    # heartbeats slow enough that only the lookup timeout can end the stopped peer's lookups
    engine = engines(mine, [f"127.0.0.1:{theirs}"], lookup_timeout_s=TIMEOUT, heartbeat_s=3.0)
    proc = peer_process(theirs, f"127.0.0.1:{mine}", 5, 8)
    held = chunks(5, 8)
    keys = list(held)
    deadline = time.monotonic() + 30
    while not engine.tier._ready_peers():
        assert time.monotonic() < deadline, "no handshake with the peer process"
        engine.step()
        time.sleep(0.005)
    found, _ = engine.ask(keys[:2], "r1")
    assert found.hits == 2 and engine.read(keys[:2]) == [held[k] for k in keys[:2]]

    # A slow peer (stopped: it answers nothing): a miss within the lookup timeout.
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)
    found, seconds = engine.ask(keys[2:4], "r2")
    assert found.hits == 0 and TIMEOUT * 0.9 <= seconds < TIMEOUT + MARGIN
    assert engine.metric("lookup_timeouts") >= 1

    # Killed with a lookup outstanding: still a miss within the timeout, never a hang.
    engine.manager.lookup_prefix(keys[4:6], "r3")
    engine.step()  # the lookup is on its way
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found, seconds = engine.ask(keys[4:6], "r3")
    assert found.hits == 0 and seconds < TIMEOUT + MARGIN
    deadline = time.monotonic() + 30  # the session ends (connection lost or heartbeat)
    while engine.metric("peers_lost") < 1:
        assert time.monotonic() < deadline, "the lost peer was not noticed"
        engine.step()
        time.sleep(0.01)
    found, seconds = engine.ask(keys[6:], "r4")  # no peer: an immediate miss
    assert found.hits == 0 and seconds < 1
    assert engine.manager.host.busy_slots == 0

    # The peer comes back (a new process on the same port): the session is made again.
    peer_process(theirs, f"127.0.0.1:{mine}", 5, 8)
    deadline = time.monotonic() + 60
    while not engine.tier._ready_peers():
        assert time.monotonic() < deadline, "no handshake with the restarted peer"
        engine.step()
        time.sleep(0.01)
    found, _ = engine.ask(keys[6:], "r5")
    assert found.hits == 2 and engine.read(keys[6:]) == [held[k] for k in keys[6:]]


def test_a_peer_that_stops_mid_fetch_fails_the_load_and_frees_the_slots(
    engines: Any, peer_process: Any
) -> None:
    mine, theirs = free_port(), free_port()
    engine = engines(
        mine, [f"127.0.0.1:{theirs}"], lookup_timeout_s=TIMEOUT, load_timeout_s=TIMEOUT
    )
    proc = peer_process(theirs, f"127.0.0.1:{mine}", 6, 2)
    keys = list(chunks(6, 2))
    deadline = time.monotonic() + 30
    while not engine.tier._ready_peers():
        assert time.monotonic() < deadline
        engine.step()
        time.sleep(0.005)
    started = time.monotonic()
    while not engine.manager._promoting:  # the peer said HIT: the fetch goes at the next step
        found = engine.manager.lookup_prefix(keys, "r")
        assert found.retry and time.monotonic() - started < 30
        if not engine.manager._promoting:
            engine.step()
            time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)
    found, seconds = engine.ask(keys, "r", timeout=60)
    # fetch timeout, then the abort is not acknowledged either: the session ends, the load
    # fails, the chunks are misses and their slots free again
    assert found.hits == 0 and seconds < 3 * TIMEOUT + 5 + MARGIN
    assert engine.metric("fetch_failures") == 2
    assert engine.manager.host.busy_slots == 0 and len(engine.manager.host) == 0


class Hostile:
    """A raw ZMQ client at its own ROUTER address, speaking to the tier's ROUTER."""

    def __init__(self, target: str, identity: str | None = None) -> None:
        self.port = free_port()
        self.id = identity or f"127.0.0.1:{self.port}"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.identity = self.id.encode()
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://{target}")

    def send(self, message: Any) -> None:
        self.dealer.send(message if isinstance(message, bytes) else msgpack.packb(message))

    def receive(self, engine: Engine, kind: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            engine.step()
            try:
                _, data = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.005)
                continue
            message = proto.decode(data)
            if message["type"] == kind:
                return message
        raise AssertionError(f"no {kind} from the tier")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_malformed_and_hostile_messages_are_dropped_and_counted(engines: Any) -> None:
    a, b = pair(engines)
    held = chunks(7, 3)
    a.put(held)
    lookup = {"type": "lookup", "kv_request_id": "x", "keys": [b"k" * 36], "round_seq": 0}
    stranger = Hostile(a.id)
    hostile: list[Any] = [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "no-such-type"}),
        msgpack.packb({"type": "lookup", "kv_request_id": 5, "keys": "x", "round_seq": -1}),
        msgpack.packb({**lookup, "keys": [b"k" * 36] * (proto.MAX_KEYS + 1)}),
        msgpack.packb(lookup),  # well formed, from an engine that never said connect
        msgpack.packb(
            {
                "type": "connect",
                "peer_id": "x",
                "agent_metadata": "str",
                "base_addr": 0,
                "num_blocks": 1,
                "block_len": "big",
                "hash_seed": "s",
            }
        ),
    ]
    for message in hostile:
        stranger.send(message)
    stranger.dealer.send_multipart([b"two", b"frames"])
    bad_identity = Hostile(a.id, identity="not an address")
    bad_identity.send(proto.connect("x", b"meta", 0, 1, ROW, a.tier.fingerprint, a.tier.hash_seed))
    expected = len(hostile) + 2
    deadline = time.monotonic() + 30
    while a.metric("malformed") < expected:
        assert time.monotonic() < deadline, f"malformed: {a.metric('malformed')} < {expected}"
        a.step()
        time.sleep(0.005)
    # 17 MiB: ZMQ drops it (and the connection) before the tier sees it
    stranger.dealer.send(b"\0" * (proto.MAX_MESSAGE_BYTES + (1 << 20)))

    # A peer that completes the handshake, then misbehaves.
    region = Region(4)
    data = NixlData(region.view)
    rogue = Hostile(a.id)
    try:
        rogue.send(
            proto.encode(
                proto.connect(
                    rogue.id,
                    data.metadata,
                    data.base_addr,
                    4,
                    ROW,
                    a.tier.fingerprint,
                    a.tier.hash_seed,
                )
            )
        )
        rogue.receive(a, "connect_ack")
        keys = list(held)
        # a fetch of keys it never looked up, then rows outside its region: nothing written
        rogue.send(
            proto.encode(
                {
                    "type": "fetch",
                    "kv_request_id": "r",
                    "keys": keys[:1],
                    "block_indexes": [0],
                    "round_seq": 0,
                }
            )
        )
        assert rogue.receive(a, "transfer_done")["success"] is False
        rogue.send(proto.encode({**lookup, "kv_request_id": "r2", "keys": keys[:1]}))
        assert rogue.receive(a, "lookup_resp")["hits"] == [True]
        rogue.send(
            proto.encode(
                {
                    "type": "fetch",
                    "kv_request_id": "r2",
                    "keys": keys[:1],
                    "block_indexes": [99],
                    "round_seq": 0,
                }
            )
        )
        assert rogue.receive(a, "transfer_done")["success"] is False
        assert not region.array.any(), "a refused fetch wrote into the asker's memory"
        # wrong types from a connected peer: it is disconnected
        before = a.metric("malformed")
        rogue.send(
            msgpack.packb(
                {"type": "lookup_resp", "kv_request_id": "r", "keys": [1], "hits": ["yes"]}
            )
        )
        rogue.receive(a, "disconnect")
        assert a.metric("malformed") == before + 1
        for _ in range(10):
            a.step()
        assert a.manager.host.busy_slots == 0, "pins of a dropped peer were kept"
    finally:
        data.close()
        for client in (stranger, bad_identity, rogue):
            client.close()

    # Through all of it, the real peer is still served, byte-exact.
    found, _ = b.ask(list(held), "after", a)
    assert found.hits == 3 and b.read(list(held)) == list(held.values())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"port": None}, "missing a required argument: 'port'"),
        ({"port": "x"}, r"\.port: 'x' is not a TCP port"),
        ({"peers": "127.0.0.1:1"}, r"\.peers: '127.0.0.1:1' is not a list"),
        ({"peers": ["no-port"]}, r"\.peers: peer 'no-port' is not HOST:PORT"),
        ({"lookup_timeout_s": 0}, r"\.lookup_timeout_s: 0 is not a positive number"),
        ({"hash_seed": 5}, r"\.hash_seed: 5 is not a string"),
        ({"bogus": 1}, "unexpected keyword argument 'bogus'"),
    ],
)
def test_configuration_errors_name_the_key(options: dict[str, Any], message: str) -> None:
    options = {"port": free_port(), **options}
    if options["port"] is None:
        del options["port"]
    with pytest.raises(ConfigError, match=message):
        _engine_with(options)


def _engine_with(options: dict[str, Any]) -> None:
    from kvfs.connector.config import ConnectorConfig
    from kvfs.connector.manager import TieringManager
    from tests.p2p_engine import run_config

    config = ConnectorConfig.from_extra_config(
        {"cpu_bytes_to_use": 4 * ROW, "secondary_tiers": [{"type": "p2p", **options}]}
    )
    TieringManager(config, run_config(), Region(4).view).shutdown()


def test_a_port_in_use_is_a_configuration_error(engines: Any) -> None:
    port = free_port()
    engines(port, [])
    with pytest.raises(ConfigError, match="cannot listen"):
        _engine_with({"port": port})
