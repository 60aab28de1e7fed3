"""The tcp path to one peer: a pool of persistent connections, batches striped.

A batch's ops are spread over the peer's connections, biggest first onto
the least loaded, so a big batch keeps every connection busy (and, on a real
NIC, the flows' protocol work lands on several cores). Each connection
pipelines its share. A connection that failed is dropped and the next
submit opens a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerInfo, PeerUnavailableError, TransferError, TransferOp, parse_address
from mooncaked.transfer.ratelimit import TokenBucket
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.tcp_client import ClientConnection, WireOp
from mooncaked.transfer.wire import Op, decode_info

logger = logging.getLogger(__name__)


class PeerPool:
    """Up to `size` persistent connections to one peer, opened on demand."""

    def __init__(self, peer: str, size: int, connect_timeout_s: float, limiter: TokenBucket | None) -> None:
        self.peer = peer
        self.size = size
        self._connect_timeout_s = connect_timeout_s
        self._limiter = limiter
        self.conns: list[ClientConnection] = []
        self._lock = asyncio.Lock()

    def _forget(self, conn: ClientConnection) -> None:
        if conn in self.conns:
            self.conns.remove(conn)

    async def _connect(self) -> ClientConnection:
        host, port = parse_address(self.peer)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: ClientConnection(self.peer, self._limiter, self._forget), host, port
                )
        except TimeoutError as e:
            raise PeerUnavailableError(
                f"connecting to transfer peer {self.peer} timed out after {self._connect_timeout_s}s; "
                "check the address and that the peer is up"
            ) from e
        except OSError as e:
            raise PeerUnavailableError(
                f"cannot connect to transfer peer {self.peer}: {e.strerror or e}; "
                "check the address and that the peer is up"
            ) from e
        return conn

    async def connections(self, want: int | None = None) -> list[ClientConnection]:
        """The open connections, topped up to `want` (default: all `size`).

        Raises PeerUnavailableError only if not a single one can be had.
        """
        async with self._lock:
            self.conns = [c for c in self.conns if not c.closed]
            missing = min(want or self.size, self.size) - len(self.conns)
            if missing > 0:
                tasks = [asyncio.ensure_future(self._connect()) for _ in range(missing)]
                try:
                    await asyncio.wait(tasks)
                except BaseException:  # cancelled: close what got through, stop the rest
                    for t in tasks:
                        if t.done() and not t.cancelled() and t.exception() is None:
                            t.result().abort(PeerUnavailableError("connect was cancelled"))
                        t.cancel()
                    raise
                errors = [t.exception() for t in tasks if t.exception() is not None]
                self.conns += [t.result() for t in tasks if t.exception() is None]
                for e in errors:
                    if not self.conns or not isinstance(e, TransferError):
                        raise e  # type: ignore[misc]
            return list(self.conns)

    def close(self) -> None:
        for conn in list(self.conns):
            conn.abort(PeerUnavailableError(f"transfer engine closed its connection to {self.peer}"))
        self.conns.clear()


async def run_ops(pool: PeerPool, ops: list[WireOp], timeout_s: float) -> list[BaseException | bytes | None]:
    """Run ops against one peer; one result per op (None/bytes or the error).

    Never raises for an op's failure: the caller decides how to report a
    batch. Cancellation aborts the connections that had ops in flight.
    """
    conns = await pool.connections()
    load = [c.outstanding_bytes for c in conns]  # other submits' bytes count too
    lanes: list[list[int]] = [[] for _ in conns]
    for i in sorted(range(len(ops)), key=lambda i: -ops[i].length):
        k = load.index(min(load))
        load[k] += ops[i].length
        lanes[k].append(i)
    results: list[BaseException | bytes | None] = [None] * len(ops)
    await asyncio.gather(
        *(_run_lane(c, sorted(lane), ops, timeout_s, results) for c, lane in zip(conns, lanes, strict=True) if lane)
    )
    return results


async def _run_lane(
    conn: ClientConnection,
    lane: list[int],
    ops: list[WireOp],
    timeout_s: float,
    results: list[BaseException | bytes | None],
) -> None:
    futures: list[asyncio.Future[bytes | None]] = []
    try:
        await conn.send([ops[i] for i in lane], timeout_s, futures)
        for i, future in zip(lane, futures, strict=True):
            try:
                results[i] = await future
            except TransferError as e:
                results[i] = e
    except BaseException:
        if futures:  # requests of ours are on the wire: answers would land in memory the caller gave up on
            conn.abort(PeerUnavailableError(f"a transfer to {conn.peer} was cancelled mid-flight"))
        raise


async def run_tcp(
    pool: PeerPool, regions: RegionTable, ops: list[TransferOp], timeout_s: float
) -> list[BaseException | None]:
    """Move TransferOps over tcp; one outcome per op (None or its error)."""
    wire: list[WireOp] = []
    for op in ops:
        view = regions.lookup(op.local_region, op.local_offset, op.length).slice_view(op.local_offset, op.length)
        write = op.op == "write"
        wire.append(
            WireOp(
                Op.WRITE if write else Op.READ,
                op.remote_region.encode("utf-8"),
                op.remote_offset,
                op.length,
                payload=view if write else None,
                dest=None if write else view,
            )
        )
    outcomes = await run_ops(pool, wire, timeout_s)
    tally: Tally[tuple[str, bool]] = Tally()
    sent = received = 0
    results: list[BaseException | None] = []
    for op, outcome in zip(ops, outcomes, strict=True):
        ok = not isinstance(outcome, BaseException)
        results.append(None if ok else outcome)  # type: ignore[arg-type]
        tally[op.op, ok] += 1
        if ok and op.op == "write":
            sent += op.length
        elif ok:
            received += op.length
    metrics.count_batch("tcp", "initiator", tally, sent, received)
    return results


async def fetch_info(pool: PeerPool, timeout_s: float) -> PeerInfo:
    """Ask the peer who it is and which regions it serves (the control query)."""
    conn = (await pool.connections(want=1))[0]
    futures: list[asyncio.Future[bytes | None]] = []
    await conn.send([WireOp(Op.INFO, b"", 0, 0)], timeout_s, futures)
    return decode_info(await futures[0] or b"")
