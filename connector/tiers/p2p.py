"""The p2p tier: fetch chunks from other engines' host tiers, and serve ours to them.

Control: ZMQ, vLLM 0.33.0's p2p protocol (``kvfs/p2p_protocol.py``): every engine binds a
ROUTER at ``host:port``; to talk to a peer it connects a DEALER whose identity is its own
``host:port`` (so the peer can dial back), one msgpack dict per message. Data: NIXL (UCX),
pushed by the engine that holds the chunk, straight into the asker's host rows.

- **Handshake.** Each side sends ``connect`` (its NIXL metadata, its host region, row size,
  config fingerprint and hash seed) and checks the other's: a peer with another row size,
  fingerprint or seed is refused (logged with the reason, counted, disconnected, not dialled
  again for ``refused_retry_s``) before any byte moves. ``connect_ack`` means "I registered
  your memory": only then are lookups sent to a peer.
- **Lookup** (asker). The first ``lookup`` of a key queues it; at the end of the step one
  ``lookup`` message per peer and request carries the step's keys; the answer is HIT as soon
  as a peer has it, MISS once every ready peer said no or ``lookup_timeout_s`` passed. A lost,
  slow or refused peer is a miss, never a wait past the timeout.
- **Fetch** (asker). ``submit_load`` sends one ``fetch`` per peer (the keys and the host slots
  the manager allocated); the peer writes them with NIXL and answers ``transfer_done``. A
  fetch not done after ``load_timeout_s`` is aborted (``abort_fetch``); the job is reported
  only once no write can land any more (done, abort acknowledged, or the peer gone).
- **Serving** (holder). At the end of each step (``serve_peers``) the tier answers queued
  ``lookup`` messages from the host tier and pins the hits for that lookup round; a
  ``fetch`` of pinned keys starts a NIXL write; pins go at the write's end, the request's
  end (empty ``fetch``), the peer's loss, or after ``serve_timeout_s``.
- **Hostile input.** Bad msgpack, wrong types, unknown message types, oversize key lists
  (``kvfs/p2p_protocol.py`` bounds), messages from an engine that never said ``connect``: the
  message is dropped and counted; a connected peer that sends one is disconnected.

Everything runs on the scheduler's thread, in ``lookup``, ``on_schedule_end``,
``serve_peers`` and ``get_finished_jobs``, without blocking: an engine answers its peers as
often as it steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq
import zmq.utils.monitor

from kvfs import p2p_protocol as proto
from kvfs.config import ConfigError
from kvfs.connector.nixl_data import NixlData
from kvfs.connector.tiers.base import (
    HostAccess,
    JobResult,
    LookupResult,
    MetricSpec,
    SecondaryTier,
    TierContext,
    TransferJob,
)
from kvfs.keys import DEFAULT_NONE_HASH_SEED

log = logging.getLogger(__name__)

_PEER_ID = re.compile(r"^[A-Za-z0-9_.\-\[\]:]{1,255}:\d{1,5}$")
# A connection that was up and went down (a peer that never comes up is caught by the
# handshake timeout: a connect that fails closes its socket too, and is retried).
_FATAL_EVENTS = zmq.EVENT_DISCONNECTED
for _name in ("EVENT_HANDSHAKE_FAILED_PROTOCOL", "EVENT_HANDSHAKE_FAILED_NO_DETAIL"):
    _FATAL_EVENTS |= getattr(zmq, _name, 0)


def _peer_id(address: str) -> str:
    if not isinstance(address, str) or not _PEER_ID.match(address):
        raise ValueError(f"peer {address!r} is not HOST:PORT")
    return address


@dataclass
class _Probe:
    """What one peer said about the keys of one request, in the current round."""

    round_seq: int = 0
    probes: dict[bytes, bool | None] = field(default_factory=dict)
    asked_at: dict[bytes, float] = field(default_factory=dict)
    unsent: list[bytes] = field(default_factory=list)
    open: bool = False  # the peer holds lookup state no fetch has closed


@dataclass
class _Fetch:
    job_id: int
    peer: str
    kv_request_id: str
    round_seq: int
    keys: list[bytes]
    deadline: float
    aborted_at: float | None = None


@dataclass
class _Load:
    keys: list[bytes]
    pending: set[tuple[str, str, int]]
    loaded: list[bytes] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Supply:
    """Serving side: one lookup round of one asker's request, and the pins it holds."""

    slots: dict[bytes, int] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)
    demanded: bool = False
    transfer: int | None = None
    aborted: bool = False


@dataclass
class _Peer:
    id: str
    dealer: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    opened: float
    configured: bool
    registered: bool = False  # we registered its memory: we may write to it
    ready: bool = False  # it acked our connect: we may send it requests
    dead: str | None = None
    dead_at: float | None = None
    probes: dict[str, _Probe] = field(default_factory=dict)  # kv_request_id ->
    lookups: list[tuple[str, list[bytes], int]] = field(default_factory=list)  # to serve
    supply: dict[tuple[str, int], _Supply] = field(default_factory=dict)


class P2PTier(SecondaryTier):
    medium = "P2P"
    accepts_stores: ClassVar[bool] = False

    def __init__(
        self,
        host_view: memoryview,
        context: TierContext,
        port: int,
        host: str = "127.0.0.1",
        peers: Sequence[str] = (),
        lookup_timeout_s: float = 1.0,
        load_timeout_s: float = 10.0,
        handshake_timeout_s: float = 10.0,
        heartbeat_s: float = 1.0,
        serve_timeout_s: float = 60.0,
        reconnect_s: float = 2.0,
        refused_retry_s: float = 60.0,
        accept_unknown_peers: bool = True,
        hash_seed: str | None = None,
        backends: Sequence[str] | None = None,
    ) -> None:
        super().__init__(host_view, context)
        where = f"secondary_tiers[{context.name}]"
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ConfigError(f"{where}.port: {port!r} is not a TCP port (1-65535)")
        for name, value in (
            ("lookup_timeout_s", lookup_timeout_s),
            ("load_timeout_s", load_timeout_s),
            ("handshake_timeout_s", handshake_timeout_s),
            ("heartbeat_s", heartbeat_s),
            ("serve_timeout_s", serve_timeout_s),
            ("reconnect_s", reconnect_s),
            ("refused_retry_s", refused_retry_s),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}.{name}: {value!r} is not a positive number of seconds")
        if not isinstance(host, str) or not host:
            raise ConfigError(f"{where}.host: {host!r} is not an address")
        if isinstance(peers, str) or not isinstance(peers, Sequence):
            raise ConfigError(f"{where}.peers: {peers!r} is not a list of HOST:PORT")
        self.local_id = f"{host}:{port}"
        try:
            self._configured = [_peer_id(p) for p in peers]
        except ValueError as err:
            raise ConfigError(f"{where}.peers: {err}") from None
        if self.local_id in self._configured:
            raise ConfigError(f"{where}.peers: {self.local_id} is this engine itself")
        if hash_seed is not None and not isinstance(hash_seed, str):
            raise ConfigError(f"{where}.hash_seed: {hash_seed!r} is not a string")
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.serve_timeout_s = float(serve_timeout_s)
        self.reconnect_s = float(reconnect_s)
        self.refused_retry_s = float(refused_retry_s)
        self.accept_unknown_peers = bool(accept_unknown_peers)
        self._heartbeat_ms = max(1, int(heartbeat_s * 1000))
        self.hash_seed = (
            hash_seed
            if hash_seed is not None
            else os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
        )
        self.fingerprint = proto.fingerprint(context.run_config.fields())
        self._m = context.metrics

        try:
            self._data = NixlData(host_view, list(backends) if backends else None)
        except ImportError as err:
            raise ConfigError(f"{where}: {err} (install kvfs[p2p])") from None
        self._ctx = zmq.Context()
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._heartbeat(self._router)
            self._router.setsockopt(zmq.MAXMSGSIZE, proto.MAX_MESSAGE_BYTES)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://{host}:{port}")
        except Exception as err:
            self._ctx.destroy(linger=0)
            self._data.close()
            if isinstance(err, zmq.ZMQError):
                raise ConfigError(f"{where}: cannot listen on {self.local_id}: {err}") from None
            raise
        self._peers: dict[str, _Peer] = {}
        self._retry_at: dict[str, float] = {}  # peer -> when it may be dialled again
        self._monitors = 0
        self._host: HostAccess | None = None
        self._fetches: dict[tuple[str, str, int], _Fetch] = {}
        self._loads: dict[int, _Load] = {}
        self._finished: list[JobResult] = []
        self._unpin: list[bytes] = []  # pins to release once host access is at hand
        self._closed = False
        self._closing = False
        self._poll()

    @classmethod
    def metric_definitions(cls) -> dict[str, MetricSpec]:
        return {
            "peers": MetricSpec("gauge", "Peers with a completed handshake"),
            "refused": MetricSpec(
                "counter", "Peers refused at the handshake (fingerprint, hash seed, row size)"
            ),
            "peers_lost": MetricSpec("counter", "Peer sessions that ended (lost, timed out)"),
            "malformed": MetricSpec(
                "counter", "Messages dropped: not msgpack, malformed, or from an unknown peer"
            ),
            "lookup_hits": MetricSpec("counter", "Chunks a peer had"),
            "lookup_misses": MetricSpec("counter", "Chunks no peer had"),
            "lookup_timeouts": MetricSpec("counter", "Chunk lookups a peer did not answer in time"),
            "fetched": MetricSpec("counter", "Chunks fetched from peers"),
            "fetch_failures": MetricSpec("counter", "Chunk fetches that failed or timed out"),
            "served": MetricSpec("counter", "Chunks written to peers"),
            "serve_lookups": MetricSpec("counter", "Chunk lookups answered for peers"),
        }

    def _count(self, name: str, amount: float = 1) -> None:
        metric = self._m.get(name)
        if metric is not None and amount:
            metric.inc(amount)

    # -- sockets ----------------------------------------------------------------------------

    def _heartbeat(self, sock: zmq.Socket[bytes]) -> None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 5 * self._heartbeat_ms)

    def _open(self, peer_id: str, configured: bool) -> _Peer:
        host, port = peer_id.rsplit(":", 1)
        dealer = self._ctx.socket(zmq.DEALER)
        self._heartbeat(dealer)
        dealer.identity = self.local_id.encode()
        dealer.setsockopt(zmq.SNDHWM, 1000)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, proto.MAX_MESSAGE_BYTES)
        address = f"inproc://kvfs-p2p-monitor-{id(self)}-{self._monitors}"
        self._monitors += 1
        dealer.monitor(address, _FATAL_EVENTS)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.connect(address)
        dealer.connect(f"tcp://{host}:{port}")
        peer = _Peer(peer_id, dealer, monitor, time.monotonic(), configured)
        self._peers[peer_id] = peer
        self._send(
            peer,
            proto.connect(
                self.local_id,
                self._data.metadata,
                self._data.base_addr,
                self._data.num_rows,
                self._data.row_bytes,
                self.fingerprint,
                self.hash_seed,
            ),
        )
        return peer

    def _send(self, peer: _Peer, message: dict[str, Any]) -> None:
        if peer.dead is not None:
            return
        try:
            peer.dealer.send(proto.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as err:  # queue full (a peer that does not read) or closed
            self._kill(peer, f"send failed: {err}")

    def _kill(self, peer: _Peer, reason: str, refused: bool = False) -> None:
        """End a peer's session: its lookups are misses, its fetches fail once no write can
        land, its pins go once no write reads them. Not dialled again for a while."""
        if peer.dead is not None:
            return
        peer.dead = reason
        peer.dead_at = time.monotonic()
        level = logging.ERROR if refused else logging.INFO if self._closing else logging.WARNING
        log.log(level, "p2p %s: peer %s: %s", self.local_id, peer.id, reason)
        if refused:
            self._count("refused")
        elif peer.ready or peer.registered:
            self._count("peers_lost")
        # Tell it why we go (a refused peer learns it at once, not by its own timeout).
        with contextlib.suppress(zmq.ZMQError):
            peer.dealer.send(proto.encode({proto.TYPE: proto.DISCONNECT}), zmq.NOBLOCK)
        self._retry_at[peer.id] = time.monotonic() + (
            self.refused_retry_s if refused else self.reconnect_s
        )

    def _reap(self, peer: _Peer) -> None:
        """Close a dead peer once no write of ours to it is in flight (or, for a write that
        never ends, after ``load_timeout_s``: the asker has given up on it by then)."""
        if self._data.inflight(peer.id):
            assert peer.dead_at is not None
            if time.monotonic() - peer.dead_at < self.load_timeout_s:
                return
            self._data.forget(peer.id)
        for supply in peer.supply.values():
            self._unpin.extend(supply.slots)
        peer.supply.clear()
        for fetch_key, fetch in list(self._fetches.items()):
            if fetch.peer == peer.id:
                self._settle(fetch_key, False)
        self._data.remove_peer(peer.id)
        peer.monitor.close(linger=0)
        peer.dealer.close(linger=200)  # let the disconnect go out
        del self._peers[peer.id]

    # -- the poll loop ----------------------------------------------------------------------

    def _poll(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        for peer_id in self._configured:
            if peer_id not in self._peers and self._retry_at.get(peer_id, 0.0) <= now:
                self._open(peer_id, configured=True)
        self._receive()
        for peer in list(self._peers.values()):
            if peer.dead is None:
                self._check_monitor(peer)
            if (
                peer.dead is None
                and not peer.ready
                and now - peer.opened > self.handshake_timeout_s
            ):
                self._kill(peer, f"no handshake within {self.handshake_timeout_s:g}s")
        self._poll_transfers()
        self._check_fetch_deadlines(now)
        self._expire_supply(now)
        for peer in list(self._peers.values()):
            if peer.dead is not None:
                self._reap(peer)
        self._release_pins()
        ready = sum(1 for p in self._peers.values() if p.ready and p.dead is None)
        if "peers" in self._m:
            self._m["peers"].set(ready)

    def _check_monitor(self, peer: _Peer) -> None:
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(peer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as err:
                self._kill(peer, f"monitor: {err}")
                return
            if event["event"] & _FATAL_EVENTS:
                self._kill(peer, "connection lost")
                return

    def _receive(self) -> None:
        for _ in range(10000):  # bounded per poll: a flood cannot hold the scheduler
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as err:
                log.warning("p2p %s: receive: %s", self.local_id, err)
                return
            if len(frames) != 2:
                self._count("malformed")
                continue
            sender = frames[0].decode("utf-8", "replace")
            peer = self._peers.get(sender)
            try:
                message = proto.decode(frames[1])
            except proto.ProtocolError as err:
                self._count("malformed")
                if peer is not None and peer.dead is None:
                    self._kill(peer, f"protocol error: {err}")
                else:
                    log.warning("p2p %s: dropped a message from %r: %s", self.local_id, sender, err)
                continue
            kind = message[proto.TYPE]
            if peer is not None and peer.dead is not None:
                continue  # a straggler from a session that has ended
            if peer is None:
                if kind == proto.CONNECT:
                    peer = self._accept(sender)
                elif kind != proto.DISCONNECT and sender not in self._retry_at:
                    self._count("malformed")  # from an engine that never said connect
                if peer is None:
                    continue
            try:
                self._dispatch(peer, kind, message)
            except proto.ProtocolError as err:
                self._count("malformed")
                self._kill(peer, f"protocol error: {err}")

    def _accept(self, sender: str) -> _Peer | None:
        """A session for an engine that says ``connect``; its message is checked next (a
        peer refused before is checked again: the check is cheap, and it learns at once)."""
        if not _PEER_ID.match(sender) or sender == self.local_id:
            log.warning("p2p %s: connect from a bad identity %r", self.local_id, sender)
            self._count("malformed")
            return None
        if not self.accept_unknown_peers and sender not in self._configured:
            log.warning("p2p %s: connect from %s, not a configured peer", self.local_id, sender)
            self._count("malformed")
            return None
        return self._open(sender, configured=sender in self._configured)

    def _dispatch(self, peer: _Peer, kind: str, message: dict[str, Any]) -> None:
        if kind == proto.CONNECT:
            if peer.registered:
                raise proto.ProtocolError("a second connect")
            reason = proto.check_compatible(
                message, self._data.row_bytes, self.fingerprint, self.hash_seed
            )
            if reason is not None:
                self._kill(peer, f"refused: {reason}", refused=True)
                return
            try:
                self._data.add_peer(
                    peer.id,
                    message["agent_metadata"],
                    message["base_addr"],
                    message["num_blocks"],
                    message["block_len"],
                )
            except Exception as err:
                self._kill(peer, f"cannot register its memory: {err}", refused=True)
                return
            peer.registered = True
            self._send(peer, {proto.TYPE: proto.CONNECT_ACK, "peer_id": self.local_id})
        elif kind == proto.CONNECT_ACK:
            if not peer.ready:
                peer.ready = True
                log.info("p2p %s: peer %s ready", self.local_id, peer.id)
        elif kind == proto.DISCONNECT:
            self._kill(peer, "peer disconnected")
        elif kind == proto.LOOKUP:
            if not peer.registered:
                raise proto.ProtocolError("lookup before connect")
            if len(peer.lookups) > 1024:
                raise proto.ProtocolError("more than 1024 lookups queued")
            peer.lookups.append((message["kv_request_id"], message["keys"], message["round_seq"]))
        elif kind == proto.LOOKUP_RESP:
            self._on_lookup_resp(peer, message["kv_request_id"], message["keys"], message["hits"])
        elif kind == proto.FETCH:
            if not peer.registered:
                raise proto.ProtocolError("fetch before connect")
            self._on_fetch(
                peer,
                message["kv_request_id"],
                message["keys"],
                message["block_indexes"],
                message["round_seq"],
            )
        elif kind == proto.TRANSFER_DONE:
            key = (peer.id, message["kv_request_id"], message["round_seq"])
            if key in self._fetches:
                self._settle(key, message["success"])
        elif kind == proto.ABORT_ACK:
            key = (peer.id, message["kv_request_id"], message["round_seq"])
            if key in self._fetches:
                self._settle(key, False)
        elif kind == proto.ABORT_FETCH:
            self._on_abort(peer, message["kv_request_id"], message["round_seq"])

    # -- asking -----------------------------------------------------------------------------

    def _kv_id(self, request_id: str) -> str:
        """The request's id on the wire: unique among the engines that ask one server."""
        return f"{request_id}@{self.local_id}"

    def _ready_peers(self) -> list[_Peer]:
        return [p for p in self._peers.values() if p.ready and p.dead is None]

    def lookup(self, key: bytes, request_id: str) -> LookupResult:
        peers = self._ready_peers()
        if not peers:
            return LookupResult.MISS
        kv_id = self._kv_id(request_id)
        now = time.monotonic()
        waiting = False
        for peer in peers:
            probe = peer.probes.setdefault(kv_id, _Probe())
            if key not in probe.probes:
                probe.probes[key] = None
                probe.asked_at[key] = now
                probe.unsent.append(key)
                waiting = True
                continue
            answer = probe.probes[key]
            if answer is True:
                self._count("lookup_hits")
                return LookupResult.HIT
            if answer is None:
                if now - probe.asked_at[key] < self.lookup_timeout_s:
                    waiting = True
                else:
                    probe.probes[key] = False  # a late answer is not waited for
                    self._count("lookup_timeouts")
        if waiting:
            return LookupResult.RETRY
        self._count("lookup_misses")
        return LookupResult.MISS

    def _on_lookup_resp(self, peer: _Peer, kv_id: str, keys: list[bytes], hits: list[bool]) -> None:
        probe = peer.probes.get(kv_id)
        if probe is None:
            return  # a request that finished meanwhile
        for key, hit in zip(keys, hits, strict=True):
            if key in probe.probes and probe.probes[key] is None:
                probe.probes[key] = hit

    def on_schedule_end(self) -> None:
        self._poll()
        for peer in self._ready_peers():
            for kv_id, probe in peer.probes.items():
                if not probe.unsent:
                    continue
                probe.open = True
                for start in range(0, len(probe.unsent), proto.MAX_KEYS):
                    self._send(
                        peer,
                        {
                            proto.TYPE: proto.LOOKUP,
                            "kv_request_id": kv_id,
                            "keys": probe.unsent[start : start + proto.MAX_KEYS],
                            "round_seq": probe.round_seq,
                        },
                    )
                probe.unsent = []

    def submit_store(self, job: TransferJob) -> None:
        # The manager sends no stores here (accepts_stores is False); one that comes anyway
        # is done: the host tier is what peers read.
        self._finished.append(JobResult(job.job_id, True, seconds=0.0))

    def submit_load(self, job: TransferJob) -> None:
        kv_id = self._kv_id(job.request_id)
        by_peer: dict[str, tuple[list[bytes], list[int]]] = {}
        peers = self._ready_peers()
        for key, slot in zip(job.keys, job.slots, strict=True):
            for peer in peers:
                probe = peer.probes.get(kv_id)
                if probe is not None and probe.probes.get(key) is True:
                    keys, slots = by_peer.setdefault(peer.id, ([], []))
                    keys.append(key)
                    slots.append(int(slot))
                    break
        load = _Load(list(job.keys), set())
        deadline = time.monotonic() + self.load_timeout_s
        for peer_id, (keys, slots) in by_peer.items():
            peer = self._peers[peer_id]
            probe = peer.probes[kv_id]
            round_seq = probe.round_seq
            # A fetch closes the peer's lookup round: what it pinned for the round and we do
            # not fetch is released there; later lookups of the request start a new round.
            probe.round_seq += 1
            probe.probes.clear()
            probe.asked_at.clear()
            probe.unsent.clear()
            probe.open = False
            fetch_key = (peer_id, kv_id, round_seq)
            self._fetches[fetch_key] = _Fetch(job.job_id, peer_id, kv_id, round_seq, keys, deadline)
            load.pending.add(fetch_key)
            self._send(
                peer,
                {
                    proto.TYPE: proto.FETCH,
                    "kv_request_id": kv_id,
                    "keys": keys,
                    "block_indexes": slots,
                    "round_seq": round_seq,
                },
            )
        self._loads[job.job_id] = load
        if not load.pending:
            self._finish_load(job.job_id)

    def _settle(self, fetch_key: tuple[str, str, int], success: bool) -> None:
        fetch = self._fetches.pop(fetch_key)
        load = self._loads.get(fetch.job_id)
        if load is None:
            return
        load.pending.discard(fetch_key)
        if success:
            load.loaded += fetch.keys
            self._count("fetched", len(fetch.keys))
        else:
            self._count("fetch_failures", len(fetch.keys))
        if not load.pending:
            self._finish_load(fetch.job_id)

    def _finish_load(self, job_id: int) -> None:
        load = self._loads.pop(job_id)
        ok = len(load.loaded) == len(load.keys)
        self._finished.append(
            JobResult(job_id, ok, None if ok else load.loaded, time.perf_counter() - load.started)
        )

    def _check_fetch_deadlines(self, now: float) -> None:
        for fetch in list(self._fetches.values()):
            peer = self._peers.get(fetch.peer)
            if peer is None:
                continue
            if fetch.aborted_at is None and now > fetch.deadline:
                # Not reported yet: the peer may still be writing into the slots.
                fetch.aborted_at = now
                log.warning(
                    "p2p %s: fetch from %s not done in %gs: aborting",
                    self.local_id,
                    peer.id,
                    self.load_timeout_s,
                )
                self._send(
                    peer,
                    {
                        proto.TYPE: proto.ABORT_FETCH,
                        "kv_request_id": fetch.kv_request_id,
                        "round_seq": fetch.round_seq,
                    },
                )
            elif fetch.aborted_at is not None and now - fetch.aborted_at > self.load_timeout_s:
                self._kill(peer, "abort not acknowledged")  # the session ends; then it fails

    def get_finished_jobs(self) -> list[JobResult]:
        self._poll()
        finished, self._finished = self._finished, []
        return finished

    def on_request_finished(self, request_id: str) -> None:
        kv_id = self._kv_id(request_id)
        for peer in self._peers.values():
            probe = peer.probes.pop(kv_id, None)
            if probe is not None and probe.open and peer.ready:
                # The terminal empty fetch: the peer releases what it pinned for us.
                self._send(
                    peer,
                    {
                        proto.TYPE: proto.FETCH,
                        "kv_request_id": kv_id,
                        "keys": [],
                        "block_indexes": [],
                        "round_seq": probe.round_seq,
                    },
                )

    # -- serving ----------------------------------------------------------------------------

    def serve_peers(self, host: HostAccess) -> None:
        self._host = host
        self._poll()
        for peer in list(self._peers.values()):
            lookups, peer.lookups = peer.lookups, []
            for kv_id, keys, round_seq in lookups:
                if peer.dead is not None:
                    break
                supply = peer.supply.get((kv_id, round_seq))
                if supply is None:
                    supply = peer.supply[(kv_id, round_seq)] = _Supply()
                if supply.demanded:
                    hits = [False] * len(keys)  # the round is closed: nothing more is pinned
                else:
                    wanted = [k for k in dict.fromkeys(keys) if k not in supply.slots]
                    supply.slots.update(host.pin_ready(wanted))
                    hits = [k in supply.slots for k in keys]
                self._count("serve_lookups", len(keys))
                self._send(
                    peer,
                    {
                        proto.TYPE: proto.LOOKUP_RESP,
                        "kv_request_id": kv_id,
                        "keys": keys,
                        "hits": hits,
                    },
                )
        self._release_pins()

    def _on_fetch(
        self, peer: _Peer, kv_id: str, keys: list[bytes], rows: list[int], round_seq: int
    ) -> None:
        if not keys:  # the asker's request ended: release every round not being written
            for (kid, rnd), held in list(peer.supply.items()):
                if kid == kv_id and held.transfer is None:
                    self._unpin.extend(held.slots)
                    del peer.supply[(kid, rnd)]
            return
        supply = peer.supply.get((kv_id, round_seq))
        if supply is not None and supply.demanded:
            raise proto.ProtocolError(f"a second fetch for {kv_id} round {round_seq}")
        limit = self._data.peer_rows(peer.id)
        if (
            supply is None
            or any(k not in supply.slots for k in keys)
            or any(r >= limit for r in rows)
            or len(set(rows)) != len(rows)
        ):
            # Not pinned for this round (never looked up, or released), or rows outside the
            # asker's region: nothing is written.
            self._send(peer, self._done(kv_id, round_seq, False))
            if supply is not None:
                self._unpin.extend(supply.slots)
                del peer.supply[(kv_id, round_seq)]
            return
        supply.demanded = True
        try:
            supply.transfer = self._data.write(peer.id, [supply.slots[k] for k in keys], rows)
        except Exception as err:
            log.warning("p2p %s: write to %s failed: %s", self.local_id, peer.id, err)
            self._send(peer, self._done(kv_id, round_seq, False))
            self._unpin.extend(supply.slots)
            del peer.supply[(kv_id, round_seq)]
            return
        self._count("served", len(keys))

    @staticmethod
    def _done(kv_id: str, round_seq: int, success: bool) -> dict[str, Any]:
        return {
            proto.TYPE: proto.TRANSFER_DONE,
            "kv_request_id": kv_id,
            "success": success,
            "round_seq": round_seq,
        }

    def _on_abort(self, peer: _Peer, kv_id: str, round_seq: int) -> None:
        supply = peer.supply.get((kv_id, round_seq))
        if supply is not None and supply.transfer is not None:
            supply.aborted = True  # acknowledged when the write has ended
            return
        if supply is not None:
            self._unpin.extend(supply.slots)
            del peer.supply[(kv_id, round_seq)]
        self._send(
            peer, {proto.TYPE: proto.ABORT_ACK, "kv_request_id": kv_id, "round_seq": round_seq}
        )

    def _poll_transfers(self) -> None:
        done, failed = self._data.poll()
        if not done and not failed:
            return
        ended = {t: True for t in done} | {t: False for t in failed}
        for peer in self._peers.values():
            for (kv_id, round_seq), supply in list(peer.supply.items()):
                if supply.transfer not in ended:
                    continue
                success = ended[supply.transfer]
                self._unpin.extend(supply.slots)
                del peer.supply[(kv_id, round_seq)]
                if supply.aborted:
                    message = {
                        proto.TYPE: proto.ABORT_ACK,
                        "kv_request_id": kv_id,
                        "round_seq": round_seq,
                    }
                else:
                    message = self._done(kv_id, round_seq, success)
                self._send(peer, message)

    def _expire_supply(self, now: float) -> None:
        for peer in self._peers.values():
            for round_key, supply in list(peer.supply.items()):
                if supply.transfer is None and now - supply.since > self.serve_timeout_s:
                    self._unpin.extend(supply.slots)
                    del peer.supply[round_key]

    def _release_pins(self) -> None:
        if self._unpin and self._host is not None:
            pins, self._unpin = self._unpin, []
            self._host.unpin(pins)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self) -> None:
        """Wait until no fetch of ours is outstanding (each ends: done, aborted, or its peer
        gone, within about twice ``load_timeout_s``)."""
        while self._loads and not self._closed:
            self._poll()
            time.sleep(0.002)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closing = True
        for peer in list(self._peers.values()):
            self._kill(peer, "shutting down")
        deadline = time.monotonic() + 3.0
        while self._data.inflight() and time.monotonic() < deadline:
            self._poll_transfers()
            time.sleep(0.002)
        for peer in list(self._peers.values()):
            for supply in peer.supply.values():
                self._unpin.extend(supply.slots)
            peer.supply.clear()
            peer.monitor.close(linger=0)
            peer.dealer.close(linger=0)
        self._peers.clear()
        self._release_pins()
        self._closed = True
        self._router.close(linger=0)
        self._ctx.destroy(linger=0)
        self._data.close()
