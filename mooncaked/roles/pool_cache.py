"""A prefill instance's use of the Mooncake Store as a second-level prefix cache.

Before computing a prompt: find the longest chain of its block hashes in the pool and,
when that reaches past what the local cache holds, pull those blocks into fresh KV blocks
(the engine then computes only the rest). After computing: write each new full block
back to the pool in the background. The conductor's prefix index learns of pool blocks
from the store master (WatchPool), which also sees them leave; nothing is reported here.
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.engine import Engine
from mooncaked.hashing import block_hashes
from mooncaked.tasks import spawn
from mooncaked.store import StoreError

log = logging.getLogger(__name__)

MAX_WRITEBACKS = 4  # concurrent background puts


class PoolCache:
    def __init__(self, store, engine: Engine, model_id: str) -> None:
        self.store = store
        self.engine = engine
        self.model_id = model_id
        self.bs = engine.config.block_size
        self.seed = engine.config.hash_seed
        self._writing = asyncio.Semaphore(MAX_WRITEBACKS)

    def keys(self, hashes: list[int]) -> list[str]:
        return [f"{self.model_id}/{h}" for h in hashes]

    async def fetch_prefix(self, prompt: list[int]) -> list[int]:
        """KV blocks now holding the prompt's longest prefix from the pool, or [] when the local
        cache holds as much (the engine's own prefix match then applies)."""
        hashes = block_hashes(prompt, self.bs, self.seed)[: (len(prompt) - 1) // self.bs]
        if not hashes:
            return []
        local = self.engine.block_manager.cached_prefix_len(hashes)
        keys = self.keys(hashes)
        try:
            n = await self.store.longest_prefix(keys)
        except StoreError as e:
            log.warning("pool lookup failed, computing the prompt: %s", e)
            return []
        if n <= local:
            return []
        blocks = await self.engine.call(self.engine.reserve, n * self.bs)
        if not blocks:
            return []
        pool = self.engine.runner.kv.pool
        try:
            ok = await self.store.batch_get_into(keys[:n], [pool[:, :, b] for b in blocks])
        except StoreError as e:
            log.warning("pool read failed, computing the prompt: %s", e)
            ok = []
        got = next((i for i, good in enumerate(ok) if not good), len(ok))
        if got <= local:
            await self.engine.call(self.engine.unreserve, blocks)
            return []
        if got < len(blocks):
            await self.engine.call(self.engine.unreserve, blocks[got:])
        log.debug("pulled %d prefix blocks from the pool (local cache had %d)", got, local)
        return blocks[:got]

    def write_back(self, prompt: list[int], block_table: list[int], skip: int) -> None:
        """Copy the prompt's full blocks (past the first ``skip``, which came from the pool) and
        put them in the background. Call while the blocks are still held."""
        hashes = block_hashes(prompt, self.bs, self.seed)
        pool = self.engine.runner.kv.pool
        items = [(key, pool[:, :, block_table[j]].clone()) for j, key in enumerate(self.keys(hashes)) if j >= skip]
        if items:
            spawn(self._put(items), "pool-write-back")

    async def _put(self, items) -> None:
        async with self._writing:
            try:
                ok = await self.store.batch_put(items)
            except StoreError as e:
                log.warning("pool write-back of %d blocks failed: %s", len(items), e)
                return
        if not all(ok):
            log.debug("pool write-back: %d of %d blocks found no room", ok.count(False), len(items))
