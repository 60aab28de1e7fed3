"""Block accounting and the prefix cache, without a model."""

import pytest

from mooncaked.engine.block_manager import BlockManager
from mooncaked.hashing import block_hashes


def _commit(bm: BlockManager, blocks: list[int], tokens: list[int]) -> None:
    for j, h in enumerate(block_hashes(tokens, bm.block_size)):
        bm.commit_full_block(blocks[j], h, tuple(tokens[j * bm.block_size : (j + 1) * bm.block_size]))


def test_allocate_release_and_no_room():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(3)
    assert a is not None and bm.num_free_blocks == 1
    assert bm.allocate(2) is None  # "no room" is a value, not an exception
    bm.release(a)
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError):
        bm.release(a)


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=2, record_events=True)
    tokens = [5, 6, 7, 8, 9]
    blocks = bm.allocate(3)
    _commit(bm, blocks, tokens)
    assert [e.kind for e in bm.drain_events()] == ["stored", "stored"]
    found, hashes = bm.match_prefix(tokens + [1, 2], max_blocks=3)
    assert found == blocks[:2] and hashes == block_hashes(tokens, 2)
    assert bm.blocks[blocks[0]].ref_count == 2
    # a different second block stops the match after the first
    found2, _ = bm.match_prefix([5, 6, 0, 0], max_blocks=2)
    assert found2 == blocks[:1]
    bm.release(found2)
    bm.release(found)
    bm.release(blocks)
    assert bm.num_free_blocks == 8
    # freed but still cached: a later request finds them (lazy eviction)
    again, _ = bm.match_prefix(tokens, max_blocks=2)
    assert again == blocks[:2]
    bm.release(again)


def test_lru_recycles_coldest_cached_blocks_first_and_reports_removal():
    bm = BlockManager(num_blocks=4, block_size=1, record_events=True)
    old = bm.allocate(2)
    _commit(bm, old, [1, 2])
    new = bm.allocate(2)
    _commit(bm, new, [3, 4])
    bm.release(old)
    bm.release(new)
    bm.drain_events()
    # two fresh blocks must reuse the older prefix's blocks, the tail (block of token 2) first
    taken = bm.allocate(2)
    assert set(taken) == set(old)
    assert taken[0] == old[1]
    assert [e.kind for e in bm.drain_events()] == ["removed", "removed"]
    assert bm.match_prefix([1, 2], 2)[0] == []
    found, _ = bm.match_prefix([3, 4], 2)
    assert found == new


def test_hash_collision_is_checked_against_tokens():
    bm = BlockManager(num_blocks=2, block_size=2)
    b = bm.allocate(1)
    h = block_hashes([1, 2], 2)[0]
    bm.commit_full_block(b[0], h, (9, 9))  # same hash, different tokens: must not be served
    assert bm.match_prefix([1, 2, 3], 1)[0] == []
