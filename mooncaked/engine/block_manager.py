"""Paged-KV block accounting: refcounts, a free list in LRU order, and the prefix cache.

Full blocks are content-addressed by their chain hash (``mooncaked.hashing``) and shared
between sequences. A freed block keeps its hash until it is actually reused (lazy
eviction), so a later request with the same prefix can pick it up again; the free list
is an LRU so the coldest cached blocks are recycled first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from mooncaked.hashing import block_local_hash, chain_hash

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVEvent:
    """A change to the cached set, for the conductor's prefix index."""

    kind: str  # "stored" | "removed"
    block_hashes: tuple[int, ...]


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    hash_seed: int = 0
    enable_prefix_caching: bool = True
    record_events: bool = False
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[int, int] = field(init=False)  # chain hash -> block id
    events: list[KVEvent] = field(init=False, default_factory=list)
    hits: int = 0
    queries: int = 0

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ---------------------------------------------------------------------
    def _take_free(self) -> Block:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self.record_events:
                    self.events.append(KVEvent("removed", (block.hash,)))
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, or None when there is no room (the caller decides to preempt)."""
        if n > len(self._free):
            return None
        return [self._take_free().block_id for _ in range(n)]

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free.pop(block_id)
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; tail blocks go to the LRU front so they are reused first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None  # cached: stays findable, recycled in LRU order

    # -- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks at the start of ``token_ids`` (at most ``max_blocks``).

        Returns (block ids, chain hashes); the blocks are referenced for the caller.
        """
        if not self.enable_prefix_caching:
            return [], []
        found: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(parent, block_local_hash(tokens, self.hash_seed), self.hash_seed)
            self.queries += 1
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self.hits += 1
            found.append(block_id)
            hashes.append(h)
            parent = h
        for block_id in found:
            self._acquire(block_id)
        return found, hashes

    def cached_prefix_len(self, hashes: list[int]) -> int:
        """How many of these chain hashes are cached here, from the first; for routing decisions."""
        n = 0
        for h in hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    def commit_full_block(self, block_id: int, chain: int, token_ids: tuple[int, ...]) -> int:
        """Publish a block whose tokens are all computed; returns the block id that now holds it.

        If the same content is already cached in another block, the sequence keeps its own
        copy and the cache keeps the older one (no copy, no event).
        """
        block = self.blocks[block_id]
        block.hash = chain
        block.token_ids = token_ids
        if self.enable_prefix_caching and chain not in self._cached:
            self._cached[chain] = block_id
            if self.record_events:
                self.events.append(KVEvent("stored", (chain,)))
        return block_id

    def acquire_cached(self, hashes: list[int]) -> list[int]:
        """Reference the cached blocks of the leading run of these chain hashes (lent to a peer that
        reads their KV: referenced, they are not recycled); ``release`` gives them back. No hit counted."""
        found: list[int] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        for block_id in found:
            self._acquire(block_id)
        return found

    def cached_hashes(self) -> list[int]:
        """Every chain hash findable in the cache now (a snapshot for a conductor that registers us)."""
        return list(self._cached)

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)
