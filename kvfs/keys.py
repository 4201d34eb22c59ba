"""vLLM's prefix-cache keys, bit for bit: chained block hashes and offload keys (vLLM 0.33.0).

A block hash fingerprints a whole prefix: ``hash((parent_hash, tuple(block_tokens),
extra_keys))``, with the first block's parent the seed hash ``NONE_HASH = hash(seed)``. Hashes
are taken every ``tokens_per_hash`` tokens. An offload chunk covers ``tokens_per_chunk`` tokens
of one KV-cache group and is keyed by the hash of its last block plus the group index as four
big-endian bytes; the chunk's file name is that hash in hex.

The seed follows vLLM: ``PYTHONHASHSEED`` when set; otherwise the fixed ``"vllm-none-hash"``
for the cryptographic algorithms, so that every process computes the same keys, and a random
one per process for xxhash, whose keys then can be shared only with a common PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cbor2
import xxhash

log = logging.getLogger(__name__)

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
GROUP_BYTES = 4


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return bytes(cbor2.dumps(value, canonical=True))


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


# --prefix-caching-hash-algo: name -> (serialiser, digest, collision resistant)
HASH_ALGORITHMS: Mapping[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes], bool]] = {
    "sha256": (_pickled, _sha256, True),
    "sha256_cbor": (_cbor, _sha256, True),
    "xxhash": (_pickled, _xxh3_128, False),
    "xxhash_cbor": (_cbor, _xxh3_128, False),
}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    try:
        serialise, digest, _ = HASH_ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"hash algorithm {algorithm!r}: choose one of {', '.join(HASH_ALGORITHMS)}"
        ) from None
    return lambda value: digest(serialise(value))


def resolve_seed(algorithm: str, environ: Mapping[str, str] = os.environ) -> str:
    """The seed vLLM derives NONE_HASH from for ``algorithm`` in this environment."""
    if (seed := environ.get("PYTHONHASHSEED")) is not None:
        return seed
    if HASH_ALGORITHMS[algorithm][2]:
        return DEFAULT_NONE_HASH_SEED
    log.warning(
        "%s with no PYTHONHASHSEED: a random seed, so keys are not shared across processes",
        algorithm,
    )
    return os.urandom(32).hex()


class BlockHasher:
    """Chained block hashes of token sequences, as vLLM's prefix cache computes them."""

    def __init__(
        self, algorithm: str = "sha256", tokens_per_hash: int = 16, seed: str | None = None
    ) -> None:
        if tokens_per_hash <= 0:
            raise ValueError(f"tokens_per_hash: {tokens_per_hash} must be positive")
        self.algorithm = algorithm
        self.tokens_per_hash = tokens_per_hash
        self._hash = hash_function(algorithm)
        self.seed = resolve_seed(algorithm) if seed is None else seed
        self.none_hash = self._hash(self.seed)

    def block_hashes(
        self,
        tokens: Sequence[int],
        known: Sequence[bytes] = (),
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """The hash of every full block of ``tokens``; ``known`` are the hashes of a prefix
        already hashed (multi-turn: the previous turn's), which are kept, not recomputed.

        ``lora`` is (adapter name, adapter path) and ``cache_salt`` a per-tenant salt; they
        enter the extra keys exactly where vLLM puts them (multimodal inputs and prompt
        embeddings are not supported here)."""
        lora_keys = [("lora", *lora)] if lora else []
        hashes = list(known)
        parent = hashes[-1] if hashes else self.none_hash
        size = self.tokens_per_hash
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            extra: list[Any] = lora_keys + (
                [("cache_salt", cache_salt)] if start == 0 and cache_salt else []
            )
            block = tuple(map(int, tokens[start : start + size]))  # numpy ints pickle apart
            parent = self._hash((parent, block, tuple(extra) if extra else None))
            hashes.append(parent)
        return hashes


def make_offload_key(block_hash: bytes, group_idx: int) -> bytes:
    """vLLM's OffloadKey: the block hash, then the KV-cache group index (4 bytes, big-endian)."""
    return block_hash + group_idx.to_bytes(GROUP_BYTES, "big", signed=False)


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """(block hash, group index) of an OffloadKey."""
    return key[:-GROUP_BYTES], int.from_bytes(key[-GROUP_BYTES:], "big", signed=False)


def chunk_keys(
    block_hashes: Sequence[bytes], group_idx: int, tokens_per_chunk: int, tokens_per_hash: int
) -> list[bytes]:
    """The offload key of every full chunk of one group: the hash of its last block."""
    if tokens_per_chunk % tokens_per_hash:
        raise ValueError(
            f"tokens_per_chunk {tokens_per_chunk} is not a multiple of "
            f"tokens_per_hash {tokens_per_hash}"
        )
    per_chunk = tokens_per_chunk // tokens_per_hash
    return [
        make_offload_key(block_hashes[last], group_idx)
        for last in range(per_chunk - 1, len(block_hashes), per_chunk)
    ]
