"""Executing a prefill's plan before it computes: which leading blocks it takes from where.

With a plan (the conductor's policy decided): the first ``reuse_blocks`` blocks from the
instance's own prefix cache, the next ``pull_blocks`` from the pool or a peer's KV cache
(``pool_cache.py``, ``peer_pull.py``). What is in the own cache is always taken (free); what
the plan says to reuse or pull and cannot be had is computed and counted by reason
(``mooncaked_plan_deviations_total``); nothing else is pulled, so the policy's choice (say,
never to pull) is what happens. Without a plan (an older conductor), or when the conductor
cannot see the pool and its plan pulls nothing (``pool_fallback``), the instance decides as it
always did: its own cache, or the pool's run when that is longer.

The blocks handed to the engine (``Prepared.imported``) are held for it; ``give_back`` returns
them if the request never starts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncaked.conductor.engine_link import POOL, PrefillPlan
from mooncaked.hashing import block_hashes
from mooncaked.instance import metrics
from mooncaked.instance.peer_pull import pull_from_peer
from mooncaked.tasks import spawn

if TYPE_CHECKING:
    from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What goes into the engine with the request, and what that amounted to.

    ``imported``: KV blocks holding the prompt's first ``len(imported)`` blocks, held for the engine
    (empty: it matches its own prefix cache itself). Of those, ``local_blocks`` came from the own
    cache, ``pulled_blocks`` from ``pulled_from``."""

    imported: list[int] = field(default_factory=list)
    local_blocks: int = 0
    pulled_blocks: int = 0
    pulled_from: str = ""
    deviations: dict[str, int] = field(default_factory=dict)


class PrefixFetch:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.engine = worker.engine

    async def prepare(self, prompt: list[int], plan: PrefillPlan | None, whole: bool = False) -> Prepared:
        """``whole``: the prompt is computed from its first token (a scored prompt: a reused block has no
        logits to score it with); what the plan named counts as computed instead (``prompt_logprobs``)."""
        w = self.worker
        bs = w.layout.block_size
        if whole:
            out = Prepared()
            named = 0 if plan is None else plan.reuse_blocks + plan.pull_blocks
            self._deviate(out, "prompt_logprobs", min(named, (len(prompt) - 1) // bs))
            return self._counted(out)
        pull = plan is not None and bool(plan.pull_blocks and plan.pull_from)
        if plan is None or (plan.pool_fallback and not pull and w.pool is not None):
            imported = await w.pool.fetch_prefix(prompt) if w.pool is not None else []
            if imported or plan is None:
                return Prepared(imported, 0, len(imported), POOL if imported else "")
        # at least one prompt token is computed: it yields the first token
        hashes = block_hashes(prompt, bs, self.engine.config.hash_seed)[: (len(prompt) - 1) // bs]
        want = min(plan.reuse_blocks + plan.pull_blocks, len(hashes))
        out = Prepared()
        if not pull:
            # nothing to pull: the engine takes its own cache's run (as long as it is) when admitting it
            local = await self.engine.call(self.engine.block_manager.cached_prefix_len, hashes[:want])
            self._deviate(out, "local_evicted", want - local)
            return self._counted(out)
        local_ids, fresh = await self.engine.call(self._take, prompt, want, len(hashes))
        out.local_blocks = len(local_ids)
        if fresh is None:  # no free KV blocks to pull into: the own run only
            self._deviate(out, "no_room", want - len(local_ids))
            out.imported = local_ids
            return self._counted(out)
        got, why = 0, ""
        if fresh:
            pulling = asyncio.ensure_future(self._pull(plan, hashes[len(local_ids):want], fresh))
            try:
                got, why = await asyncio.shield(pulling)
            except asyncio.CancelledError:
                # the caller left: the blocks go back once no byte can land in them any more
                spawn(self._drop_after(pulling, local_ids + fresh), "drop-pulled-blocks")
                raise
            if got < len(fresh):
                await self.engine.call(self.engine.unreserve, fresh[got:])
        out.imported = local_ids + fresh[:got]
        out.pulled_blocks, out.pulled_from = got, (plan.pull_from if got else "")
        self._deviate(out, why or "local_evicted", want - len(out.imported))  # none when the own run covers it
        if got:
            log.debug("took %d blocks from the own cache and %d from %s", len(local_ids), got, plan.pull_from)
        return self._counted(out)

    async def _pull(self, plan: PrefillPlan, hashes: list[int], blocks: list[int]) -> tuple[int, str]:
        w = self.worker
        if plan.pull_from == POOL:
            return await w.pool.fetch_into(hashes, blocks) if w.pool is not None else (0, "no_pool")
        lender = w.peers(plan.pull_address) if w.peers is not None and plan.pull_address else None
        return await pull_from_peer(w.transfer, w.layout, lender, w.name, hashes, blocks)

    async def _drop_after(self, pulling: asyncio.Future, blocks: list[int]) -> None:
        try:
            await pulling
        except Exception:  # noqa: BLE001 - the request is gone; only the blocks matter
            pass
        await self.engine.call(self.engine.unreserve, blocks)

    def _take(self, prompt: list[int], want: int, most: int) -> tuple[list[int], list[int] | None]:
        """Engine thread: the own cache's run (referenced; up to ``most`` blocks, it may hold more than
        planned) and fresh blocks for the rest of the first ``want`` (None: no room)."""
        bm = self.engine.block_manager
        local, _ = bm.match_prefix(prompt, most)
        fresh = bm.allocate(want - len(local)) if want > len(local) else []
        return local, fresh

    @staticmethod
    def _deviate(out: Prepared, reason: str, blocks: int) -> None:
        if blocks > 0:
            out.deviations[reason] = out.deviations.get(reason, 0) + blocks

    @staticmethod
    def _counted(out: Prepared) -> Prepared:
        metrics.deviated(out.deviations)
        if out.pulled_blocks:
            metrics.PLAN_BLOCKS.labels("pool" if out.pulled_from == POOL else "peer").inc(out.pulled_blocks)
        return out

    async def give_back(self, prepared: Prepared) -> None:
        """The request never reached the engine: the blocks held for it go back."""
        if prepared.imported:
            await self.engine.call(self.engine.unreserve, prepared.imported)
            prepared.imported = []
