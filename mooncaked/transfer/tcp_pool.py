"""The tcp path to one peer: a pool of persistent connections, batches striped.

A batch's ops are spread over the peer's connections, biggest first onto
the least loaded, so a big batch keeps every connection busy (and, on a real
NIC, the flows' protocol work lands on several cores). Each connection
pipelines its share. A single op (one put/get) takes the least loaded
connection and, if that one is idle, goes onto the wire synchronously with
no lock, task or gather. A connection that failed is dropped and the next
submit opens a fresh one. With a cluster secret each connection proves it
(handshake.py) before the pool hands it out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerInfo, PeerUnavailableError, TransferError, TransferOp, parse_address
from mooncaked.transfer.conn_guard import CLIENT_IDLE_CLOSE_S
from mooncaked.transfer.handshake import HANDSHAKE_TIMEOUT_S, authenticated, open_socket
from mooncaked.transfer.ratelimit import TokenBucket
from mooncaked.transfer.tcp_client import ClientConnection, WireOp, stripe
from mooncaked.transfer.wire import Op, decode_info

if TYPE_CHECKING:  # regions.py imports torch; the transfer I/O process (io_worker.py) runs without it
    from mooncaked.transfer.regions import RegionTable

logger = logging.getLogger(__name__)


class PeerPool:
    """Up to `size` persistent connections to one peer, opened on demand."""

    def __init__(self, peer: str, size: int, connect_timeout_s: float, limiter: TokenBucket | None,
                 token: bytes | None = None, idle_s: float = CLIENT_IDLE_CLOSE_S) -> None:
        self.peer = peer
        self.size = size
        self._connect_timeout_s = connect_timeout_s
        self._limiter = limiter
        self._token = token
        self._idle_s = idle_s  # a connection idle this long is retired (tcp_client.py)
        self.conns: list[ClientConnection] = []
        self._retired: set[ClientConnection] = set()  # idle ones no longer handed out; they close themselves
        self._lock = asyncio.Lock()

    def _forget(self, conn: ClientConnection) -> None:
        if conn in self.conns:
            self.conns.remove(conn)
        self._retired.discard(conn)

    async def _connect(self) -> ClientConnection:
        host, port = parse_address(self.peer)
        loop = asyncio.get_running_loop()
        factory = lambda: ClientConnection(self.peer, self._limiter, self._forget, self._idle_s)  # noqa: E731
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._token is None:
                    _, conn = await loop.create_connection(factory, host, port)
                else:
                    sock = await authenticated(await open_socket(host, port), self._token, f"transfer peer {self.peer}",
                                               HANDSHAKE_TIMEOUT_S)
                    try:
                        _, conn = await loop.create_connection(factory, sock=sock)
                    except BaseException:
                        sock.close()
                        raise
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

    def ready(self, want: int | None = None) -> list[ClientConnection] | None:
        """The connections if `want` (default: all) are open and none is being
        opened, else None. The steady state, answered without the lock or a
        coroutine; the list is live: use it before awaiting anything."""
        conns = self.conns
        if len(conns) < min(want or self.size, self.size) or self._lock.locked() or any(c.gone for c in conns):
            return None
        return conns

    async def connections(self, want: int | None = None) -> list[ClientConnection]:
        """The open connections, topped up to `want` (default: all `size`).

        Raises PeerUnavailableError only if not a single one can be had.
        """
        conns = self.ready(want)
        if conns is not None:
            return list(conns)
        async with self._lock:
            self._retired.update(c for c in self.conns if c.gone and not c.closed)
            self.conns = [c for c in self.conns if not c.gone]
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
        for conn in [*self.conns, *self._retired]:
            conn.abort(PeerUnavailableError(f"transfer engine closed its connection to {self.peer}"))
        self.conns.clear()
        self._retired.clear()


async def run_ops(pool: PeerPool, ops: list[WireOp], timeout_s: float) -> list[BaseException | bytes | None]:
    """Run ops against one peer; one result per op (None/bytes or the error).

    Never raises for an op's failure: the caller decides how to report a
    batch. Cancellation aborts the connections that had ops in flight.
    """
    conns = await pool.connections()
    lanes = stripe([op.length for op in ops], [c.outstanding_bytes for c in conns])  # others' unanswered bytes count
    results: list[BaseException | bytes | None] = [None] * len(ops)
    busy = [(c, lane) for c, lane in zip(conns, lanes, strict=True) if lane]
    if len(busy) == 1:  # e.g. one connection per peer: no task and no gather for a single lane
        await _run_lane(busy[0][0], busy[0][1], ops, timeout_s, results)
    else:
        await asyncio.gather(*(_run_lane(c, lane, ops, timeout_s, results) for c, lane in busy))
    return results


async def _run_lane(
    conn: ClientConnection,
    lane: list[int],
    ops: list[WireOp],
    timeout_s: float,
    results: list[BaseException | bytes | None],
) -> None:
    if len(lane) == 1:
        results[lane[0]] = await _run_one(conn, ops[lane[0]], timeout_s)
        return
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


async def _run_one(conn: ClientConnection, op: WireOp, timeout_s: float,
                   meanwhile: Callable[[], object] | None = None) -> BaseException | bytes | None:
    """One op on one connection: its result or error (handed over by _send_one).
    `meanwhile` runs once the request is handed over, while the peer works."""
    sent: list[asyncio.Future[bytes | None]] = []
    try:
        await _send_one(conn, op, timeout_s, sent)
        if meanwhile is not None:
            meanwhile()
        return await sent[0]
    except TransferError as e:
        return e
    except BaseException:
        if sent:  # the request is on the wire: its answer would land in memory the caller gave up on
            conn.abort(PeerUnavailableError(f"a transfer to {conn.peer} was cancelled mid-flight"))
        raise


def _wire_op(regions: RegionTable, op: TransferOp) -> WireOp:
    """The request for a TransferOp; payload/dest are views of the local region."""
    view = regions.lookup(op.local_region, op.local_offset, op.length).slice_view(op.local_offset, op.length)
    write = op.op == "write"
    return WireOp(
        Op.WRITE if write else Op.READ,
        op.remote_region.encode("utf-8"),
        op.remote_offset,
        op.length,
        payload=view if write else None,
        dest=None if write else view,
    )


async def run_tcp(
    pool: PeerPool, regions: RegionTable, ops: list[TransferOp], timeout_s: float
) -> list[BaseException | None]:
    """Move TransferOps over tcp; one outcome per op (None or its error)."""
    if len(ops) == 1:
        return [await run_one_tcp(pool, regions, ops[0], timeout_s)]
    outcomes = await run_ops(pool, [_wire_op(regions, op) for op in ops], timeout_s)
    results: list[BaseException | None] = [o if isinstance(o, BaseException) else None for o in outcomes]
    metrics.count_initiated("tcp", ops, [r is None for r in results])
    return results


async def run_one_tcp(pool: PeerPool, regions: RegionTable, op: TransferOp, timeout_s: float) -> BaseException | None:
    """One TransferOp over tcp (a single put/get): its outcome, as run_tcp
    gives for a batch of one, without the batch's lists and striping."""
    error = await run_one_wire(pool, _wire_op(regions, op), timeout_s)
    metrics.count_initiated("tcp", (op,), (error is None,))
    return error


async def run_one_wire(pool: PeerPool, wire: WireOp, timeout_s: float,
                       meanwhile: Callable[[], object] | None = None) -> BaseException | None:
    """One request on the least loaded connection: None or its error (see _run_one for `meanwhile`)."""
    outcome = await _run_one(await _least_loaded(pool), wire, timeout_s, meanwhile)
    return outcome if isinstance(outcome, BaseException) else None


async def hand_over(pool: PeerPool, wire: WireOp, timeout_s: float) -> asyncio.Future[bytes | None]:
    """One request handed to the least loaded connection, not waited for: its answer's future (it
    carries the op's TransferError). For payloads nobody can change meanwhile (a `bytes` object's):
    the transport may still be reading it after this returns."""
    sent: list[asyncio.Future[bytes | None]] = []
    await _send_one(await _least_loaded(pool), wire, timeout_s, sent)
    return sent[0]


async def _least_loaded(pool: PeerPool) -> ClientConnection:
    conns = pool.ready() or await pool.connections()
    return min(conns, key=_outstanding) if len(conns) > 1 else conns[0]


async def _send_one(conn: ClientConnection, op: WireOp, timeout_s: float,
                    sent: list[asyncio.Future[bytes | None]]) -> None:
    """Hand one op to the connection: at once when it is idle (no lock, no coroutine), else queued
    behind the sender in the middle. Its future lands in `sent` as soon as anything went out."""
    future = conn.send_now(op, timeout_s)
    if future is None:  # another sender is mid-way, or paced: queue behind it
        await conn.send([op], timeout_s, sent)
    else:
        sent.append(future)


def _outstanding(conn: ClientConnection) -> int:
    return conn.outstanding_bytes


async def fetch_info(pool: PeerPool, timeout_s: float) -> PeerInfo:
    """Ask the peer who it is and which regions it serves (the control query)."""
    conn = (await pool.connections(want=1))[0]
    futures: list[asyncio.Future[bytes | None]] = []
    await conn.send([WireOp(Op.INFO, b"", 0, 0)], timeout_s, futures)
    return decode_info(await futures[0] or b"")
