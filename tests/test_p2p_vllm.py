"""kvfs's p2p tier against vLLM 0.33.0's own (``P2PSecondaryTierManager``, unmodified, with
its ZMQ transport and NIXL transport): each fetches chunks from the other, byte-exact, and a
vLLM engine of another model is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvfs.connector.nixl_data import nixl_unavailable
from tests.conftest import free_port
from tests.p2p_engine import Engine, VllmPeer, chunks

REASON = nixl_unavailable()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(REASON is not None, reason=f"NIXL cannot load: {REASON}"),
]


@pytest.fixture
def made() -> Iterator[list[Any]]:
    engines: list[Any] = []
    yield engines
    for engine in reversed(engines):
        engine.close()


def test_the_fingerprint_is_vllms(made: list[Any]) -> None:
    vllm = VllmPeer(free_port())
    made.append(vllm)
    kvfs = Engine(free_port())
    made.append(kvfs)
    assert kvfs.tier.fingerprint == vllm.tier._data.config_fingerprint
    assert kvfs.tier.hash_seed == vllm.tier._get_hash_seed()
    other = Engine(free_port(), model="kvfs-test/another-model")
    made.append(other)
    assert other.tier.fingerprint != vllm.tier._data.config_fingerprint


def test_kvfs_fetches_from_vllm(made: list[Any]) -> None:
    vllm = VllmPeer(free_port())
    made.append(vllm)
    held = chunks(11, 4)
    vllm.put(held)
    kvfs = Engine(free_port(), [vllm.id])
    made.append(kvfs)
    kvfs.ready_with(vllm)
    keys = list(held)
    found, _ = kvfs.ask(keys, "r1", vllm)
    assert found.hits == 4
    assert kvfs.read(keys) == list(held.values())
    assert (
        kvfs.manager.metrics.registry.get_sample_value(
            "kvfs_connector_chunks_served_total", {"tier": "p2p"}
        )
        == 4
    )
    # a key vLLM does not hold is a miss; the request's end releases vLLM's pins
    found, _ = kvfs.ask(list(chunks(12, 1)), "r2", vllm)
    assert found.hits == 0
    for request in ("r1", "r2"):
        kvfs.manager.on_request_finished(request)
    for _ in range(20):
        kvfs.step()
        vllm.step()
    assert vllm.sees(kvfs.id), "vLLM dropped the session"
    assert kvfs.metric("malformed") == 0


def test_vllm_fetches_from_kvfs(made: list[Any]) -> None:
    kvfs = Engine(free_port())
    made.append(kvfs)
    held = chunks(13, 3)
    kvfs.put(held)
    vllm = VllmPeer(free_port())
    made.append(vllm)
    keys = list(held)
    ctx = vllm.context("q1", kvfs.id)  # vLLM dials the kvfs engine named by the request
    answers = vllm.ask(keys, ctx, kvfs)
    assert [a.name for a in answers] == ["HIT"] * 3
    result = vllm.load(keys, [5, 6, 9], ctx, kvfs)
    assert result.success
    assert [vllm.region.array[row].tobytes() for row in (5, 6, 9)] == list(held.values())
    vllm.tier.on_request_finished(ctx)
    for _ in range(20):
        vllm.step()
        kvfs.step()
    assert kvfs.manager.host.busy_slots == 0, "kvfs kept the pins of vLLM's lookup"
    assert kvfs.metric("served") == 3 and kvfs.metric("malformed") == 0
    # and a key kvfs lacks is a miss for vLLM
    ctx = vllm.context("q2", kvfs.id)
    answers = vllm.ask(list(chunks(14, 1)), ctx, kvfs)
    assert [a.name for a in answers] == ["MISS"]


def test_a_vllm_engine_of_another_model_is_refused(made: list[Any]) -> None:
    kvfs = Engine(free_port())
    made.append(kvfs)
    held = chunks(15, 2)
    kvfs.put(held)
    vllm = VllmPeer(free_port(), model="kvfs-test/another-model")
    made.append(vllm)
    ctx = vllm.context("q", kvfs.id)
    answers = vllm.ask(list(held), ctx, kvfs)
    assert [a.name for a in answers] == ["MISS"] * 2  # refused: vLLM gives up at once
    assert kvfs.metric("refused") >= 1 and kvfs.metric("served") == 0
    assert kvfs.manager.host.busy_slots == 0
