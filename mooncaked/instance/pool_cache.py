"""A prefill instance's use of the Mooncake Store as a second-level prefix cache.

Before computing a prompt: read the blocks the plan pulls from the pool into fresh KV blocks
(``fetch_into``), or, with no plan, the pool's longest chain of the prompt's block hashes when it
reaches past what the local cache holds (``fetch_prefix``); the engine then computes only the
rest. After computing: write each new full block back to the pool in the background, a
replicated hot prefix with a soft pin. The conductor's prefix index learns of pool blocks from
the store master (WatchPool), which also sees them leave; nothing is reported here.
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.engine import Engine
from mooncaked.engine.stage import PipelineStage
from mooncaked.hashing import block_hashes
from mooncaked.store import StoreError
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

MAX_WRITEBACKS = 4  # concurrent background puts


def stage_pool_id(model_id: str, stage: PipelineStage) -> str:
    """The pool's key space of an engine's blocks: the model's, or for a CPP stage the model's layers
    it holds (``model@layers0-14``), so whole blocks and a stage's blocks never mix; the conductor's
    pool watch follows only the model's own keys."""
    if stage.count == 1:
        return model_id
    return f"{model_id}@layers{stage.first_layer}-{stage.end_layer - 1}"


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
        got, _ = await self.fetch_into(hashes[:n], blocks)
        if got <= local:
            await self.engine.call(self.engine.unreserve, blocks)
            return []
        if got < len(blocks):
            await self.engine.call(self.engine.unreserve, blocks[got:])
        log.debug("pulled %d prefix blocks from the pool (local cache had %d)", got, local)
        return blocks[:got]

    async def fetch_into(self, hashes: list[int], blocks: list[int]) -> tuple[int, str]:
        """Read the pool's objects of these chained blocks into ``blocks`` (engine KV blocks the caller
        holds): how many leading ones arrived, and why the rest did not ("" when all did)."""
        pool = self.engine.runner.kv.pool
        try:
            ok = await self.store.batch_get_into(self.keys(hashes), [pool[:, :, b] for b in blocks])
        except StoreError as e:
            log.warning("pool read of %d blocks failed, computing them: %s", len(hashes), e)
            return 0, "pool_failed"
        got = next((i for i, good in enumerate(ok) if not good), len(ok))
        return got, "" if got == len(hashes) else "pool_missing"

    def write_back(self, prompt: list[int], block_table: list[int], skip: int, pinned: int = 0) -> None:
        """Copy the prompt's full blocks and put them in the background: all but the first ``skip``
        (which came from the pool); the first ``pinned`` with a soft pin (a replicated hot prefix, evicted
        last). Call while the blocks are still held."""
        hashes = block_hashes(prompt, self.bs, self.seed)
        pool = self.engine.runner.kv.pool
        keys = self.keys(hashes)
        soft = [(keys[j], pool[:, :, block_table[j]].clone()) for j in range(skip, min(pinned, len(keys)))]
        rest = [(keys[j], pool[:, :, block_table[j]].clone()) for j in range(max(skip, pinned), len(keys))]
        if soft:
            spawn(self._put(soft, soft_pin=True), "pool-replicate")
        if rest:
            spawn(self._put(rest), "pool-write-back")

    async def _put(self, items, soft_pin: bool = False) -> None:
        async with self._writing:
            try:
                ok = await self.store.batch_put(items, soft_pin=soft_pin)
            except StoreError as e:
                log.warning("pool write-back of %d blocks failed: %s", len(items), e)
                return
        if not all(ok):
            log.debug("pool write-back: %d of %d blocks found no room", ok.count(False), len(items))
