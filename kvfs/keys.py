"""vLLM's prefix-cache keys, bit for bit: chained block hashes and offload keys (vLLM 0.33.0).

A block hash fingerprints a whole prefix: ``hash((parent_hash, tuple(block_tokens),
extra_keys))``, with the first block's parent the seed hash ``NONE_HASH = hash(seed)``. Hashes
are taken every ``tokens_per_hash`` tokens. An offload chunk covers ``tokens_per_chunk`` tokens
of one KV-cache group and is keyed by the hash of its last block plus the group index as four
big-endian bytes; the chunk's file name is that hash in hex.

The seed follows vLLM: ``PYTHONHASHSEED`` when set; otherwise the fixed ``"vllm-none-hash"``
for the cryptographic algorithms, so that every process computes the same keys, and a random
one per process for xxhash, whose keys then can be shared only with a common PYTHONHASHSEED.

A block's extra keys are vLLM's, in its order: the LoRA adapter on every block; each multimodal
item the block overlaps, with its offset relative to the block start (negative once the item
began in an earlier block); the cache salt on the first block; and the SHA-256 of the block's
prompt-embedding rows on every block once a request has prompt embeddings.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import operator
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import cbor2
import xxhash

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    # numpy's stubs make ndarray a Buffer only from Python 3.12
    EmbedsBuffer: TypeAlias = Buffer | np.ndarray[Any, Any]

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


EmbedsDigest: TypeAlias = Callable[[int, int], bytes]
"""The digest vLLM keys prompt embeddings ``[start, end)`` by: SHA-256 of those rows' bytes."""


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One multimodal item's placeholder tokens, as vLLM's ``MultiModalFeatureSpec`` has them:
    its ``identifier`` (the encoder-cache hash, LoRA-prefixed under a LoRA; not ``mm_hash``)
    and ``mm_position``'s ``offset`` and ``length`` in the prompt."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        # numpy ints would pickle apart from vLLM's Python ints
        object.__setattr__(self, "offset", operator.index(self.offset))
        object.__setattr__(self, "length", operator.index(self.length))
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"{self}: needs offset >= 0 and length > 0")

    @property
    def end(self) -> int:
        return self.offset + self.length


def embeds_digest(embeds: EmbedsBuffer) -> EmbedsDigest:
    """vLLM's per-block digest of prompt embeddings held in a C-contiguous buffer whose first
    axis is positions (a ``(positions, hidden)`` numpy array, ``tensor.numpy()``; bfloat16 as
    ``tensor.view(torch.int16).numpy()``, same bytes). The dtype is hashed as stored, as vLLM
    does. kvfs never imports torch: for a GPU tensor pass your own ``EmbedsDigest``, e.g.
    ``lambda s, e: hashlib.sha256(vllm.v1.utils.tensor_data(t[s:e])).digest()``."""
    view = memoryview(cast("Buffer", embeds))  # an ndarray is one at runtime on 3.11 too
    shape = view.shape or ()
    if len(shape) < 2 or not view.c_contiguous:
        # a flat buffer's positions are unknown: memoryview(b).cast("B", (positions, row_bytes))
        raise ValueError(
            f"prompt embeddings: need a C-contiguous (positions, ...) buffer, got shape {shape}"
        )
    row = view.nbytes // shape[0] if shape[0] else 0
    flat = view.cast("B") if row else memoryview(b"")  # zero-size views cannot be cast
    return lambda start, end: hashlib.sha256(flat[start * row : end * row]).digest()


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
        mm: Sequence[Placeholder] = (),
        prompt_embeds: EmbedsBuffer | EmbedsDigest | None = None,
    ) -> list[bytes]:
        """The hash of every full block of ``tokens``; ``known`` are the hashes of a prefix
        already hashed (multi-turn: the previous turn's), which are kept, not recomputed.

        ``tokens`` are vLLM's ``all_token_ids``: 0 where the prompt is given as embeddings.
        ``lora`` is (adapter name, adapter path), ``cache_salt`` a per-tenant salt, ``mm`` the
        request's multimodal placeholders (non-overlapping, in any order) and
        ``prompt_embeds`` its prompt embeddings (see ``embeds_digest``) or their digest."""
        items = sorted(mm, key=lambda p: p.offset)
        for before, after in itertools.pairwise(items):
            if before.end > after.offset:
                raise ValueError(f"multimodal placeholders overlap: {before}, {after}")
        digest = (
            embeds_digest(prompt_embeds)
            if prompt_embeds is not None and not callable(prompt_embeds)
            else prompt_embeds
        )
        lora_keys = [("lora", *lora)] if lora else []
        hashes = list(known)
        parent = hashes[-1] if hashes else self.none_hash
        size = self.tokens_per_hash
        resume = len(hashes) * size
        # the first item still open at a block's start (vLLM's resume does the same bisect)
        first = bisect.bisect_right([p.end for p in items], resume)
        for start in range(resume, len(tokens) - size + 1, size):
            end = start + size
            extra: list[Any] = list(lora_keys)
            for item in itertools.islice(items, first, None):
                if item.offset >= end:
                    break
                extra.append(("mm", item.identifier, item.offset - start))
            while first < len(items) and items[first].end <= end:
                first += 1
            if start == 0 and cache_salt:
                extra.append(("cache_salt", cache_salt))
            if digest is not None:
                extra.append(("prompt_embeds", digest(start, end)))
            block = tuple(map(int, tokens[start:end]))  # numpy ints pickle apart
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
