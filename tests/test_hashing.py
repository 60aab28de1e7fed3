import struct

import numpy as np
import pytest
import xxhash

from mooncaked.hashing import block_hashes, block_local_hash, chain_hash


def _reference(tokens: list[int], bs: int, seed: int) -> list[int]:
    """DESIGN §4 written out independently: LE u32 token bytes, LE u64 pair chaining."""
    out, prev = [], None
    for i in range(len(tokens) // bs):
        data = b"".join(struct.pack("<I", t) for t in tokens[i * bs : (i + 1) * bs])
        local = xxhash.xxh3_64(data, seed=seed).intdigest()
        prev = local if prev is None else xxhash.xxh3_64(struct.pack("<Q", prev) + struct.pack("<Q", local), seed=seed).intdigest()
        out.append(prev)
    return out


@pytest.mark.parametrize("seed", [0, 1234])
def test_chain_matches_the_standard(seed):
    tokens = list(np.random.default_rng(0).integers(0, 2**31, 37))
    tokens = [int(t) for t in tokens]
    assert block_hashes(tokens, 8, seed) == _reference(tokens, 8, seed)
    assert len(block_hashes(tokens, 8, seed)) == 4  # the partial 5th block is not hashed


def test_chain_continues_and_depends_on_prefix():
    tokens = list(range(32))
    full = block_hashes(tokens, 8)
    assert block_hashes(tokens[16:], 8, parent=full[1]) == full[2:]
    other = block_hashes([999] + tokens[1:], 8)
    assert all(a != b for a, b in zip(full, other))  # a change in block 0 changes every later hash
    assert chain_hash(None, block_local_hash(tokens[:8])) == full[0]


def test_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0)
