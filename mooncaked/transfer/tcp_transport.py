"""The tcp transport: ops go to the peer's port over its pool of persistent connections.

Always present in an engine, whatever the backend: besides carrying ops (backends tcp and
auto), its connections carry the control query (INFO) that the other transports read a peer's
regions from. The wire work is tcp_pool.py / tcp_client.py; this module only keeps one pool
per peer and speaks the Transport interface.
"""

from __future__ import annotations

import logging
import asyncio
from collections.abc import Awaitable, Callable

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerInfo, TransferError, TransferOp
from mooncaked.transfer.ratelimit import TokenBucket
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.tcp_client import WireOp
from mooncaked.transfer.tcp_pool import PeerPool, fetch_info, hand_over, run_one_tcp, run_one_wire, run_tcp
from mooncaked.transfer.transport import Outcome, Transport
from mooncaked.transfer.wire import Op

logger = logging.getLogger(__name__)


class TcpTransport(Transport):
    """One pool of `conns_per_peer` connections per peer, opened on demand."""

    label = "tcp"

    def __init__(self, regions: RegionTable, conns_per_peer: int, connect_timeout_s: float,
                 limiter: TokenBucket | None, token: bytes | None, idle_s: float) -> None:
        self._regions = regions
        self._conns_per_peer = conns_per_peer
        self._connect_timeout_s = connect_timeout_s
        self._limiter = limiter
        self._token = token
        self._idle_s = idle_s
        self._pools: dict[str, PeerPool] = {}

    def pool(self, peer: str) -> PeerPool:
        pool = self._pools.get(peer)
        if pool is None:
            pool = PeerPool(peer, self._conns_per_peer, self._connect_timeout_s, self._limiter, self._token,
                            self._idle_s)
            self._pools[peer] = pool
        return pool

    async def fetch_info(self, peer: str, timeout_s: float) -> PeerInfo:
        """The control query: who the peer is and which regions it serves."""
        return await fetch_info(self.pool(peer), timeout_s)

    async def submit(self, peer: str, ops: list[TransferOp], timeout_s: float) -> list[Outcome]:
        return list(await run_tcp(self.pool(peer), self._regions, ops, timeout_s))

    async def submit_one(self, op: TransferOp, timeout_s: float) -> Outcome:
        """Straight to a connection, no per-batch lists (a failure to connect is the op's error)."""
        try:
            return await run_one_tcp(self.pool(op.peer), self._regions, op, timeout_s)
        except TransferError as e:
            return e

    async def write_from(self, src: memoryview, peer: str, region: str, offset: int, timeout_s: float,
                         meanwhile: Callable[[], object] | None = None) -> bool:
        """Zero copy on this side: the caller's buffer goes to the kernel as it is, with no staging
        copy; `meanwhile` runs while the peer receives it. The buffer must stay unchanged until
        this returns (until then the kernel may still be reading it)."""
        wire = _write_of(src, region, offset)
        if wire is None:
            return False
        try:
            error = await run_one_wire(self.pool(peer), wire, timeout_s, meanwhile)
        except TransferError as e:  # could not connect
            error = e
        metrics.count_op(self.label, "write", "initiator", error is None, sent=0 if error else src.nbytes)
        if error is not None:
            raise error
        return True

    async def send_from(self, src: memoryview, peer: str, region: str, offset: int,
                        timeout_s: float) -> Awaitable[object] | None:
        """The request with the caller's bytes handed to the connection, the peer's answer not waited
        for: its future. The bytes must be immutable (uvloop may still be sending from them)."""
        wire = _write_of(src, region, offset)
        if wire is None:
            return None
        try:
            future = await hand_over(self.pool(peer), wire, timeout_s)
        except TransferError:  # could not connect
            metrics.count_op(self.label, "write", "initiator", False)
            raise
        size = src.nbytes

        def count(f: asyncio.Future[bytes | None]) -> None:
            ok = not f.cancelled() and f.exception() is None
            metrics.count_op(self.label, "write", "initiator", ok, sent=size if ok else 0)

        future.add_done_callback(count)
        return future

    def outgoing_connections(self) -> dict[str, int]:
        return {p: len(pool.conns) for p, pool in self._pools.items()}

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _write_of(src: memoryview, region: str, offset: int) -> WireOp | None:
    """The write request carrying a caller's bytes; None for no bytes (the staged path says what is wrong)."""
    if src.nbytes == 0:
        return None
    if offset < 0:
        raise TransferError(f"write of {src.nbytes} bytes at {offset}: need an offset >= 0")
    return WireOp(Op.WRITE, region.encode("utf-8"), offset, src.nbytes, payload=src)
