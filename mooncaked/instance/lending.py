"""KV lent to a peer: the lender's side of a plan's "pull from peer P1".

A prefill instance told to take a prompt's prefix from P1 asks P1 to lend the blocks of that
hash chain: P1 references its cached blocks of the chain's leading run (referenced, they are not
recycled) under a short lease and answers their block ids, its transfer endpoint and KV layout;
the borrower reads them straight out of P1's KV region (``peer_pull.py``), then releases the loan.
A borrower that never releases (it died) loses the loan when the lease ends. Lending is allowed
while draining: a draining instance's hot prefixes are exactly what its peers should take over.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncaked.conductor.engine_link import EXHAUSTED, UNAVAILABLE, EngineError, Loan
from mooncaked.instance.metrics import LENT_BLOCKS

if TYPE_CHECKING:
    from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

MIN_LEASE_S = 0.5
MAX_LEASE_S = 60.0  # a borrower cannot pin our blocks for longer than this
MAX_LOANS = 1024  # loans held at once; more are refused (EXHAUSTED) until some end


@dataclass
class _Lent:
    blocks: list[int]
    expires: float
    borrower: str


class Lender:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.loans: dict[str, _Lent] = {}

    async def lend(self, block_hashes: list[int], lease_s: float, borrower: str = "") -> Loan:
        """Pin the cached blocks of the chain's leading run for ``lease_s`` (clamped); possibly none."""
        if self.engine.driver_failure is not None:
            raise EngineError(UNAVAILABLE, f"{self.worker.name}'s engine stopped; it lends nothing")
        if len(self.loans) >= MAX_LOANS:
            raise EngineError(EXHAUSTED, f"{self.worker.name} has {len(self.loans)} loans out; ask again later")
        lease = min(max(lease_s, MIN_LEASE_S), MAX_LEASE_S) if math.isfinite(lease_s) else MIN_LEASE_S
        bm = self.engine.block_manager
        hashes = list(block_hashes[: bm.num_blocks])
        blocks = await self.engine.call(bm.acquire_cached, hashes) if hashes else []
        loan_id = uuid.uuid4().hex
        if blocks:
            self.loans[loan_id] = _Lent(blocks, time.monotonic() + lease, borrower)
            LENT_BLOCKS.inc(len(blocks))
        log.debug("lent %d of %d blocks to %s for %.1fs", len(blocks), len(hashes), borrower or "a peer", lease)
        return Loan(loan_id, blocks, self.worker.endpoint(), self.worker.layout, lease)

    async def release(self, loan_id: str) -> bool:
        lent = self.loans.pop(loan_id, None)
        if lent is None:
            return False
        await self.engine.call(self.engine.unreserve, lent.blocks)
        return True

    async def expire(self, now: float) -> None:
        """Loans whose borrower never released them (it died, or its Release was lost) are taken back."""
        for loan_id, lent in list(self.loans.items()):
            if lent.expires < now and self.loans.pop(loan_id, None) is not None:
                await self.engine.call(self.engine.unreserve, lent.blocks)
                log.warning("loan of %d blocks to %s expired unreleased; taken back", len(lent.blocks),
                            lent.borrower or "a peer")
