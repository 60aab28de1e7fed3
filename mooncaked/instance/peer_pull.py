"""The borrower's side of "pull from peer P1": read lent blocks out of P1's KV cache.

P1 lends the blocks of a hash chain (``lending.py``); we read every layer's K and V of each
straight from P1's KV region into fresh blocks of ours over the transfer engine (runs of
consecutive block ids on both sides go as one op), then release the loan. Every step has a
deadline; a lender that cannot be asked, holds fewer blocks, or whose read fails leaves the
rest to be computed, with the reason: a stalled lender costs STALL_GRACE_S to ask, and a read a
grace plus its bytes at a floor rate (transfer/deadlines.py), not a bulk transfer's timeout. The
read's deadline is well inside the lease, and a
failed read leaves nothing in flight (``TransferEngine.submit``), so no byte lands in a block
after we have given it back.
"""

from __future__ import annotations

import logging

from mooncaked.conductor.engine_link import EngineError, EngineLink
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.instance.kv_push import KV_REGION
from mooncaked.tasks import spawn
from mooncaked.transfer import TransferEngine, TransferError, TransferOp
from mooncaked.transfer.deadlines import STALL_GRACE_S, read_deadline

log = logging.getLogger(__name__)

LEND_TIMEOUT_S = STALL_GRACE_S  # a small call: a lender this slow to answer is cheaper to compute around
LOAN_LEASE_S = 20.0
READ_TIMEOUT_S = 10.0  # at most half the lease
RELEASE_TIMEOUT_S = 2.0


def read_ops(local: KVLayout, remote: KVLayout, peer: str, remote_blocks: list[int],
             local_blocks: list[int], layers: tuple[int, int] | None = None) -> list[TransferOp]:
    """Ops that copy whole blocks (every layer, or ``layers`` [first, end), K and V) from the peer's
    blocks into ours."""
    runs: list[tuple[int, int, int]] = []  # (remote first, local first, blocks)
    for r, lo in zip(remote_blocks, local_blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == lo:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, lo, 1))
    ops = []
    for layer in range(*(layers or (0, local.num_layers))):
        for kv in (0, 1):
            for r, lo, n in runs:
                ops.append(TransferOp("read", KV_REGION, local.offset(layer, kv, lo), peer, KV_REGION,
                                      remote.offset(layer, kv, r), n * local.block_bytes))
    return ops


async def pull_from_peer(transfer: TransferEngine, layout: KVLayout, lender: EngineLink | None, borrower: str,
                         hashes: list[int], blocks: list[int]) -> tuple[int, str]:
    """Fill ``blocks`` with the lender's KV of these chained blocks: how many leading ones arrived, and
    why the rest did not ("" when all did)."""
    if lender is None:
        return 0, "peer_unknown"
    try:
        loan = await lender.lend(hashes, LOAN_LEASE_S, LEND_TIMEOUT_S, borrower)
    except EngineError as e:
        log.warning("the lender of %d blocks could not lend them (%s); computing them", len(hashes), e)
        return 0, "peer_unavailable"
    try:
        n = min(len(loan.block_ids), len(blocks))
        if n == 0:
            return 0, "peer_missing"
        why = layout.compatible(loan.layout)
        if why:
            log.warning("a lender's KV layout does not match ours (%s); computing %d blocks", why, n)
            return 0, "peer_layout"
        ops = read_ops(layout, loan.layout, loan.endpoint.address, loan.block_ids[:n], blocks[:n])
        try:
            nbytes = sum(op.length for op in ops)
            await transfer.submit(ops, timeout_s=read_deadline(nbytes, min(READ_TIMEOUT_S, loan.lease_s / 2)))
        except TransferError as e:
            log.warning("reading %d lent blocks from %s failed (%s); computing them", n, loan.endpoint.address, e)
            return 0, "peer_read_failed"
        return n, "" if n == len(hashes) else "peer_missing"
    finally:
        if loan.block_ids:
            spawn(_release(lender, loan.loan_id), f"release-loan-{loan.loan_id[:8]}")


async def _release(lender: EngineLink, loan_id: str) -> None:
    """Best effort: a loan not released ends with its lease."""
    try:
        await lender.release(loan_id, RELEASE_TIMEOUT_S)
    except EngineError as e:
        log.info("releasing loan %s failed (%s); it ends with its lease", loan_id[:8], e)
