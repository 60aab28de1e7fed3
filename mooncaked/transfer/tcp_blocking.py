"""The tcp client on blocking sockets, one thread per connection: the transfer I/O process's.

Measured under CPU contention (docs/performance.md, "Data plane"): an event loop moving the bytes
loses to a plain blocking `sendall`, and several blocking senders, one per connection, beat one.
A blocking send or receive releases the GIL and sleeps in the kernel until the socket has room,
so each connection's thread is its own runnable task, with no readiness round trips. This speaks
the same wire as tcp_client.py (wire.py) and proves the same cluster secret (handshake.py).

A lane (one connection's share of a batch) pipelines: it sends requests ahead of their answers up
to a window (WINDOW_OPS ops, WINDOW_BYTES of payload), then reads an answer, so a lane of many
reads cannot fill both directions' buffers and stall. Deadline: every blocking call on a
connection times out after the op's timeout_s, so a stalled peer is noticed within it while a long
pipeline that keeps moving is not cut short (the asyncio client's rule).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from mooncaked.transfer.api import (
    PeerUnavailableError,
    ProtocolError,
    TransferError,
    TransferTimeoutError,
    parse_address,
)
from mooncaked.transfer.handshake import HANDSHAKE_TIMEOUT_S, blocking_client_handshake
from mooncaked.transfer.tcp_client import WireOp, stripe
from mooncaked.transfer.wire import MAX_ERROR_BYTES, RESP, Op, Status, error_from_status, pack_request, unpack_response

logger = logging.getLogger(__name__)

WINDOW_OPS = 64
WINDOW_BYTES = 16 * 1024 * 1024
Result = BaseException | None


class BlockingConnection:
    """One connection, used by one lane at a time; `broken` ones are closed, never reused."""

    def __init__(self, peer: str, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.last_used = time.monotonic()
        self.broken = False
        self._ids = 0
        self._hdr = bytearray(RESP.size)

    def run(self, ops: list[WireOp], timeout_s: float) -> list[Result]:
        """Every op's outcome; a broken connection fails the ops it had not answered."""
        results: list[Result] = [None] * len(ops)
        sent = answered = outstanding = 0
        first_id = self._ids + 1
        try:
            self.sock.settimeout(timeout_s)
            while answered < len(ops):
                if sent < len(ops) and (sent == answered or (
                        sent - answered < WINDOW_OPS and outstanding + ops[sent].length <= WINDOW_BYTES)):
                    self._send(ops[sent])
                    outstanding += ops[sent].length
                    sent += 1
                else:
                    results[answered] = self._answer(ops[answered], first_id + answered)
                    outstanding -= ops[answered].length
                    answered += 1
        except TimeoutError:
            self._fail(results, answered, TransferTimeoutError(
                f"transfer peer {self.peer} did not complete an op within the {timeout_s}s deadline; "
                "the peer is stalled or the link too slow for it (raise timeout_s)"))
        except ProtocolError as e:
            logger.warning("closing transfer connection to %s: %s", self.peer, e)
            self._fail(results, answered, PeerUnavailableError(f"peer {self.peer} broke the protocol: {e}"))
        except OSError as e:
            self._fail(results, answered, PeerUnavailableError(
                f"connection to transfer peer {self.peer} was lost ({e.strerror or e}); "
                "the peer may have stopped; retry once it is back"))
        self.last_used = time.monotonic()
        return results

    def _fail(self, results: list[Result], answered: int, error: TransferError) -> None:
        self.broken = True
        for i in range(answered, len(results)):
            results[i] = error

    def _send(self, op: WireOp) -> None:
        self._ids += 1
        self.sock.sendall(pack_request(op.op, self._ids, op.name, op.offset, op.length))
        if op.op == Op.WRITE and op.length:
            assert op.payload is not None
            self.sock.sendall(op.payload)

    def _answer(self, op: WireOp, req_id: int) -> Result:
        self._recv_into(memoryview(self._hdr))
        status, got_id, body_len = unpack_response(self._hdr)
        if got_id != req_id:
            raise ProtocolError(f"response {got_id} out of order (expected {req_id})")
        if status != Status.OK:
            if body_len > MAX_ERROR_BYTES:
                raise ProtocolError(f"error message of {body_len} bytes")
            body = bytearray(body_len)
            self._recv_into(memoryview(body))
            return error_from_status(status, body.decode("utf-8", "replace"), self.peer)
        if op.op == Op.READ:
            if body_len != op.length or op.dest is None:
                raise ProtocolError(f"read answered with {body_len} bytes, asked {op.length}")
            self._recv_into(op.dest)
        elif body_len:
            raise ProtocolError(f"write ack with {body_len} body bytes")
        return None

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError("closed by peer")
            got += n

    def abort(self) -> None:
        """Wake a lane blocked on this connection (cancel, close): its calls fail at once."""
        self.broken = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


class BlockingPool:
    """Idle connections to one peer; a lane takes one or opens one. One retired for idleness is
    closed instead of used, so the server's longer idle timeout never cuts a connection in use."""

    def __init__(self, peer: str, connect_timeout_s: float, token: bytes | None, idle_s: float) -> None:
        self.peer = peer
        self._connect_timeout_s = connect_timeout_s
        self._token = token
        self._idle_s = idle_s
        self._idle: list[BlockingConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def checkout(self) -> BlockingConnection:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if now - conn.last_used < self._idle_s:
                    return conn
                conn.close()
        return self._connect()

    def checkin(self, conn: BlockingConnection) -> None:
        with self._lock:
            if conn.broken or self._closed:
                conn.close()
            else:
                self._idle.append(conn)

    def _connect(self) -> BlockingConnection:
        host, port = parse_address(self.peer)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout_s)
        except TimeoutError as e:
            raise PeerUnavailableError(
                f"connecting to transfer peer {self.peer} timed out after {self._connect_timeout_s}s; "
                "check the address and that the peer is up") from e
        except OSError as e:
            raise PeerUnavailableError(f"cannot connect to transfer peer {self.peer}: {e.strerror or e}; "
                                       "check the address and that the peer is up") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._token is not None:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                blocking_client_handshake(sock, self._token, f"transfer peer {self.peer}")
        except TimeoutError as e:
            sock.close()
            raise PeerUnavailableError(f"transfer peer {self.peer} did not complete the cluster-secret handshake "
                                       f"within {HANDSHAKE_TIMEOUT_S}s (does it run without a cluster secret?)") from e
        except OSError as e:
            sock.close()
            raise PeerUnavailableError(f"transfer peer {self.peer} dropped the handshake: {e}") from e
        except BaseException:
            sock.close()
            raise
        return BlockingConnection(self.peer, sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in self._idle:
                conn.close()
            self._idle.clear()


class BlockingBatch:
    """One batch striped over up to `lanes` connections of a pool, each lane on an executor thread;
    `on_done` gets every op's outcome once the last lane finished. `cancel` aborts its connections."""

    def __init__(self, pool: BlockingPool, ops: list[WireOp], timeout_s: float, lanes: int,
                 on_done: Callable[[list[Result]], None]) -> None:
        self._pool = pool
        self._ops = ops
        self._timeout_s = timeout_s
        self._lanes = [lane for lane in stripe([op.length for op in ops], [0] * max(1, min(lanes, len(ops)))) if lane]
        self._on_done = on_done
        self._results: list[Result] = [None] * len(ops)
        self._left = len(self._lanes)
        self._lock = threading.Lock()
        self._conns: set[BlockingConnection] = set()
        self.cancelled = False

    def start(self, executor: Executor) -> None:
        if not self._lanes:
            self._on_done([])
        for lane in self._lanes:
            executor.submit(self._run_lane, lane)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            conns = list(self._conns)
        for conn in conns:
            conn.abort()

    def _run_lane(self, lane: list[int]) -> None:
        try:
            outcomes = self._lane_outcomes(lane)
        except Exception as e:  # a bug, not a transfer failure: say so in every op and the log
            logger.exception("transfer I/O lane to %s failed", self._pool.peer)
            outcomes = [TransferError(f"transfer I/O process failed: {e!r}")] * len(lane)
        with self._lock:
            for i, outcome in zip(lane, outcomes, strict=True):
                self._results[i] = outcome
            self._left -= 1
            last = self._left == 0
        if last:
            self._on_done(self._results)

    def _lane_outcomes(self, lane: list[int]) -> list[Result]:
        if self.cancelled:
            return [TransferError("cancelled")] * len(lane)
        try:
            conn = self._pool.checkout()
        except TransferError as e:
            return [e] * len(lane)
        with self._lock:
            self._conns.add(conn)
            if self.cancelled:
                conn.abort()
        try:
            return conn.run([self._ops[i] for i in lane], self._timeout_s)
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._pool.checkin(conn)
