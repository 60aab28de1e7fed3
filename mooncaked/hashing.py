"""Chained block hashes, the standard of Mooncake's KV-indexer API (DESIGN §4).

``local_i = XXH3_64(token ids of block i as little-endian u32, seed)``;
``seq_0 = local_0``; ``seq_i = XXH3_64(seq_{i-1} as LE u64 || local_i as LE u64, seed)``.
``seq_i`` names the whole prefix up to block i, so equal hashes mean equal prefixes
and an index keyed by them can speak with Mooncake's. Only full blocks are hashed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

DEFAULT_SEED = 0

_PAIR = struct.Struct("<QQ")


def block_local_hash(token_ids: Sequence[int], seed: int = DEFAULT_SEED) -> int:
    """XXH3-64 of one block's token ids laid out as little-endian u32."""
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def chain_hash(parent: int | None, local: int, seed: int = DEFAULT_SEED) -> int:
    """The prefix hash of a block given its parent's prefix hash (None for the first block)."""
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(_PAIR.pack(parent, local), seed=seed)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: int = DEFAULT_SEED,
    parent: int | None = None,
) -> list[int]:
    """Prefix hashes of every full block of ``token_ids``; a trailing partial block is skipped.

    ``parent`` continues an existing chain (the hash of the block before ``token_ids[0]``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ids = np.asarray(token_ids, dtype="<u4")
    hashes: list[int] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        local = xxhash.xxh3_64_intdigest(ids[start : start + block_size].tobytes(), seed=seed)
        parent = chain_hash(parent, local, seed)
        hashes.append(parent)
    return hashes
