"""The p2p tier's control messages: vLLM 0.33.0's p2p protocol, checked hard.

vLLM's p2p tier (``vllm/v1/kv_offload/tiering/p2p/session/protocol.py``) sends msgpack dicts
over ZMQ, each with a ``"type"``; kvfs sends and accepts exactly those, so a kvfs engine and
a vLLM engine can fetch from each other:

====================  =======================================================================
``connect``           ``peer_id`` str, ``agent_metadata`` bytes (NIXL), ``base_addr`` int,
                      ``num_blocks`` int, ``block_len`` int (row bytes),
                      ``config_fingerprint`` str, ``hash_seed`` str
``connect_ack``       ``peer_id`` str
``disconnect``        (nothing)
``lookup``            ``kv_request_id`` str, ``keys`` [bytes], ``round_seq`` int
``lookup_resp``       ``kv_request_id`` str, ``keys`` [bytes], ``hits`` [bool]
``fetch``             ``kv_request_id`` str, ``keys`` [bytes], ``block_indexes`` [int] (the
                      asker's host rows), ``round_seq`` int; empty lists end the request
``transfer_done``     ``kv_request_id`` str, ``success`` bool, ``round_seq`` int
``abort_fetch``       ``kv_request_id`` str, ``round_seq`` int
``abort_ack``         ``kv_request_id`` str, ``round_seq`` int
====================  =======================================================================

The fingerprint is vLLM's: the first 16 hex of sha256 over the run config's JSON (the fields
vLLM's FileMapper writes to config.json, sorted, compact), so two engines agree exactly when
their chunk files would share a namespace. The hash seed is the seed of the chained block
hashes (``PYTHONHASHSEED`` or vLLM's fixed default); peers whose seeds differ would exchange
keys that name different tokens.

Everything here is pure Python (msgpack, no torch): :func:`decode` turns hostile bytes into a
:class:`ProtocolError`, never into an exception of another kind or an unbounded allocation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import msgpack

TYPE = "type"

CONNECT = "connect"
CONNECT_ACK = "connect_ack"
DISCONNECT = "disconnect"
LOOKUP = "lookup"
LOOKUP_RESP = "lookup_resp"
FETCH = "fetch"
TRANSFER_DONE = "transfer_done"
ABORT_FETCH = "abort_fetch"
ABORT_ACK = "abort_ack"

MESSAGE_TYPES = frozenset(
    {
        CONNECT,
        CONNECT_ACK,
        DISCONNECT,
        LOOKUP,
        LOOKUP_RESP,
        FETCH,
        TRANSFER_DONE,
        ABORT_FETCH,
        ABORT_ACK,
    }
)

# Bounds on what one message may carry. A real lookup names the chunks of one scheduler step
# (thousands at most); past these a message is refused, not parsed.
MAX_MESSAGE_BYTES = 16 << 20
MAX_KEYS = 65536
MAX_KEY_BYTES = 256
MAX_ID_CHARS = 1024
MAX_METADATA_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A message that is not a valid p2p message: the peer is broken or hostile."""


def fingerprint(run_config_fields: Mapping[str, Any]) -> str:
    """vLLM's config fingerprint: sha256 of the run config's compact sorted JSON, 16 hex."""
    if not run_config_fields:
        return ""
    canonical = json.dumps(run_config_fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def encode(message: Mapping[str, Any]) -> bytes:
    data: bytes = msgpack.packb(dict(message), use_bin_type=True)
    return data


def decode(data: bytes) -> dict[str, Any]:
    """One message from the wire, validated; ProtocolError says what is wrong with it."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes (limit {MAX_MESSAGE_BYTES})")
    try:
        message = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_METADATA_BYTES,
            max_bin_len=MAX_METADATA_BYTES,
            max_array_len=MAX_KEYS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as err:  # msgpack raises many kinds (ExtraData, ValueError, ...)
        raise ProtocolError(f"not msgpack: {type(err).__name__}: {err}") from None
    validate(message)
    assert isinstance(message, dict)
    return message


def _str(message: dict[str, Any], key: str, limit: int = MAX_ID_CHARS) -> None:
    value = message.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{key}: expected str, got {type(value).__name__}")
    if len(value) > limit:
        raise ProtocolError(f"{key}: {len(value)} characters (limit {limit})")


def _int(message: dict[str, Any], key: str, positive: bool = False) -> None:
    value = message.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
        raise ProtocolError(f"{key}: expected a {'positive' if positive else 'non-negative'} int")
    if value >= 1 << 64:
        raise ProtocolError(f"{key}: {value} is out of range")


def _keys(message: dict[str, Any], key: str = "keys") -> None:
    keys = message.get(key)
    if not isinstance(keys, list):
        raise ProtocolError(f"{key}: expected list, got {type(keys).__name__}")
    if len(keys) > MAX_KEYS:
        raise ProtocolError(f"{key}: {len(keys)} keys (limit {MAX_KEYS})")
    for item in keys:
        if not isinstance(item, bytes) or not 0 < len(item) <= MAX_KEY_BYTES:
            raise ProtocolError(f"{key}: {type(item).__name__} is not a key (bytes)")


def validate(message: Any) -> None:
    """Raise ProtocolError unless ``message`` is one of the protocol's messages, well formed."""
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a map, got {type(message).__name__}")
    kind = message.get(TYPE)
    if kind not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    if kind == CONNECT:
        _str(message, "peer_id")
        metadata = message.get("agent_metadata")
        if not isinstance(metadata, bytes) or not metadata:
            raise ProtocolError("agent_metadata: expected non-empty bytes")
        _int(message, "base_addr")
        _int(message, "num_blocks", positive=True)
        _int(message, "block_len", positive=True)
        _str(message, "hash_seed")
        if "config_fingerprint" in message:
            _str(message, "config_fingerprint")
    elif kind == CONNECT_ACK:
        _str(message, "peer_id")
    elif kind in (LOOKUP, LOOKUP_RESP, FETCH):
        _str(message, "kv_request_id")
        _keys(message)
        if kind != LOOKUP_RESP:
            _int(message, "round_seq")
        if kind == LOOKUP_RESP:
            hits = message.get("hits")
            if not isinstance(hits, list) or len(hits) != len(message["keys"]):
                raise ProtocolError("hits: expected a list of bools as long as keys")
            if not all(isinstance(hit, bool) for hit in hits):
                raise ProtocolError("hits: expected bools")
        if kind == FETCH:
            indexes = message.get("block_indexes")
            if not isinstance(indexes, list) or len(indexes) != len(message["keys"]):
                raise ProtocolError("block_indexes: expected a list of ints as long as keys")
            for index in indexes:
                if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                    raise ProtocolError(f"block_indexes: invalid index {index!r}")
    elif kind in (TRANSFER_DONE, ABORT_FETCH, ABORT_ACK):
        _str(message, "kv_request_id")
        _int(message, "round_seq")
        if kind == TRANSFER_DONE and not isinstance(message.get("success"), bool):
            raise ProtocolError("success: expected bool")


def connect(
    peer_id: str,
    agent_metadata: bytes,
    base_addr: int,
    num_blocks: int,
    block_len: int,
    config_fingerprint: str,
    hash_seed: str,
) -> dict[str, Any]:
    return {
        TYPE: CONNECT,
        "peer_id": peer_id,
        "agent_metadata": agent_metadata,
        "base_addr": base_addr,
        "num_blocks": num_blocks,
        "block_len": block_len,
        "config_fingerprint": config_fingerprint,
        "hash_seed": hash_seed,
    }


def check_compatible(
    message: Mapping[str, Any], block_len: int, config_fingerprint: str, hash_seed: str
) -> str | None:
    """Why a peer's ``connect`` is refused (None: compatible). As vLLM: the row size, the
    fingerprint (when both sides have one) and the hash seed must match."""
    if message["block_len"] != block_len:
        return f"block_len mismatch: peer {message['block_len']}, local {block_len}"
    remote = message.get("config_fingerprint", "")
    if remote and config_fingerprint and remote != config_fingerprint:
        return (
            f"config fingerprint mismatch: peer {remote!r}, local {config_fingerprint!r} "
            "(another model, dtype, block size or layout)"
        )
    if message["hash_seed"] != hash_seed:
        return (
            f"hash seed mismatch: peer {message['hash_seed']!r}, local {hash_seed!r} "
            "(set the same PYTHONHASHSEED on every peer, or none)"
        )
    return None
