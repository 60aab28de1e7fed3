"""TransferEngine: register memory, submit batches, hand each peer's share to its transports.

The engine owns the region table, the tcp server that serves it (and answers the control
query), the peers' directory and a chain of transports (backends.py; transport.py is the
interface). It validates every op locally before any byte moves, runs each peer's share of a
batch concurrently down the chain (a transport answers LEFT for what the next one should
carry), and reports the first failure (with a note counting the others) only after every op
has finished or been aborted, so a failed submit leaves nothing in flight.

Given the cluster secret (`token`), every tcp connection in and out opens with the handshake of
handshake.py, and the control query (INFO) is answered only after it; its answer names regions,
sizes and shm segments, and raw memory addresses only when a transport needs peers to know them
(rdma).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import torch

from mooncaked.transfer.api import (
    BACKENDS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    EngineStats,
    PeerInfo,
    RegionInfo,
    TransferError,
    TransferOp,
)
from mooncaked.transfer.backends import Wiring, chain
from mooncaked.transfer.conn_guard import ConnLimits
from mooncaked.transfer.handshake import check_token
from mooncaked.transfer.peers import PeerDirectory
from mooncaked.transfer.private_memory import create_private
from mooncaked.transfer.ratelimit import TokenBucket
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.host import host_id
from mooncaked.transfer.shm import create_segment, shm_available
from mooncaked.transfer.shm_files import remove_orphans
from mooncaked.transfer.tcp_server import TcpServer
from mooncaked.transfer.tcp_transport import TcpTransport
from mooncaked.transfer.transport import LEFT, Outcome, Transport

logger = logging.getLogger(__name__)


class TransferEngine:
    """One process's endpoint of the data plane; see docs/architecture.md (transfer/)."""

    def __init__(
        self,
        backend: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        connections_per_peer: int = 4,
        rate_limit_bytes_per_s: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        token: bytes | None = None,
        limits: ConnLimits | None = None,
        io_process: bool = False,
    ) -> None:
        """`token`: the cluster secret every peer must prove (None: no handshake, for loopback
        clusters); `limits`: the incoming connections' cap and timeouts (conn_guard.ConnLimits);
        `io_process`: the ops this engine starts over tcp run in a dedicated I/O process
        (io_transport.py; its regions are then allocated in shared memory), so a busy event loop
        does not starve them."""
        if backend not in BACKENDS:
            raise TransferError(f"unknown transfer backend {backend!r}; choose one of {BACKENDS}")
        if connections_per_peer < 1:
            raise TransferError(f"connections_per_peer must be >= 1, got {connections_per_peer}")
        self.backend = backend
        self._host = host
        self._port = port
        self._timeout_s = timeout_s
        limiter = TokenBucket(rate_limit_bytes_per_s) if rate_limit_bytes_per_s else None
        token = check_token(token)
        self._regions = RegionTable()
        limits = limits or ConnLimits()  # peers are assumed to run with the same
        self._server = TcpServer(self._regions, self.peer_info, limiter, token, limits)
        self._tcp = TcpTransport(self._regions, connections_per_peer, connect_timeout_s, limiter, token,
                                 limits.client_idle_s)
        self._peers = PeerDirectory(self._tcp.fetch_info)
        io_config = None
        if io_process and limiter is not None:
            raise TransferError("the transfer I/O process does not pace: give io_process or rate_limit_bytes_per_s, "
                                "not both")
        if io_process:
            io_config = {"connections_per_peer": connections_per_peer, "connect_timeout_s": connect_timeout_s,
                         "idle_s": limits.client_idle_s, "token": token, "rate_limit_bytes_per_s": rate_limit_bytes_per_s}
        wiring = Wiring(self._regions, self._peers, self._tcp, host, io_config)
        self._transports: list[Transport] = chain(backend, wiring)
        self._shared_memory = any(t.shared_memory for t in self._transports)
        self._private_memory = any(t.private_memory for t in self._transports)
        self._host_id = host_id()
        self.address: str | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> str:
        """Serve incoming transfers; returns this endpoint's "host:port"."""
        self._check_open()
        if self.address is not None:
            return self.address
        for transport in self._transports:
            await transport.start(self._regions)  # raises if a backend cannot work here
        if self._shared_memory and shm_available():
            remove_orphans()  # what a killed engine on this host left in /dev/shm (shm_files.py)
        host, port = await self._server.start(self._host, self._port)
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("transfer engine (%s) serving on %s", self.backend, self.address)
        return self.address

    async def close(self) -> None:
        """Stop serving, drop connections and mappings, unlink our shm segments."""
        if self._closed:
            return
        self._closed = True
        await self._server.close()
        await self._tcp.close()
        for name in self._regions.names():
            self.unregister(name)
        for transport in self._transports:
            await transport.close()
        logger.info("transfer engine %s closed", self.address)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed; make a new one")

    # -- memory --------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> RegionInfo:
        """Expose a contiguous CPU tensor's bytes to peers under `name`."""
        region = self._regions.add(name, tensor)
        for transport in self._transports:
            transport.register(region)
        return region.info

    def alloc_region(self, name: str, nbytes: int) -> torch.Tensor:
        """Allocate, prefault and register `nbytes`; returns a uint8 tensor.

        When a transport wants it (backend shm/auto) the memory is a POSIX shm segment, so a peer
        on this host maps the same pages and a transfer is one memcpy; else, with the tcp I/O process,
        a memfd that process maps (private_memory.py).
        """
        if nbytes <= 0:
            raise TransferError(f"region size must be positive, got {nbytes}")
        if self._shared_memory and shm_available():
            segment = create_segment(nbytes)
            try:
                region = self._regions.add(name, segment.tensor, segment.shm_name, segment.unlink)
            except BaseException:
                segment.unlink()
                raise
        elif self._private_memory:
            fd, mapping = create_private(nbytes)
            try:
                memory = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
                region = self._regions.add(name, memory, on_release=lambda: os.close(fd), fd=fd)
            except BaseException:
                os.close(fd)
                raise
        else:
            region = self._regions.add(name, torch.zeros(nbytes, dtype=torch.uint8))
        for transport in self._transports:
            transport.register(region)
        return region.tensor

    def unregister(self, name: str) -> None:
        region = self._regions.remove(name)
        for transport in self._transports:
            transport.unregister(region)

    def info(self) -> PeerInfo:
        """What peers learn about this engine through the control query."""
        regions = {i.name: i for i in self._regions.infos()}
        return PeerInfo(self._host_id, regions, self._session())

    def peer_info(self) -> PeerInfo:
        """What the control query answers a peer: `info` less what the peer cannot use. Region base
        addresses (where our memory sits, which helps an exploit) go only to rdma peers, who name
        raw addresses in their one-sided ops; tcp and shm peers address regions by name."""
        info = self.info()
        if info.rdma_session is not None:
            return info
        return PeerInfo(info.host_id, {n: replace(r, address=0) for n, r in info.regions.items()}, None)

    def _session(self) -> str | None:
        return next((t.session for t in self._transports if t.session is not None), None)

    def stats(self) -> EngineStats:
        conns = list(self._server.connections)
        outgoing: dict[str, int] = {}
        for transport in {id(t): t for t in (self._tcp, *self._transports)}.values():
            outgoing.update(transport.outgoing_connections())
        return EngineStats(
            incoming_connections=len(conns),
            ops_per_incoming_connection=[c.ops_served for c in conns],
            outgoing_connections=outgoing,
            io_process_pid=next((t.pid for t in self._transports if t.pid is not None), None),
        )

    # -- transfers -----------------------------------------------------------
    async def submit(self, batch: Sequence[TransferOp], timeout_s: float | None = None) -> None:
        """Run every op of the batch; returns when all bytes are in place.

        Ops are checked locally first (nothing moves if one is malformed).
        On failure raises the first op's TransferError once every other op
        has finished or been aborted. Ops of one batch run concurrently, so
        overlapping ranges have no defined order.
        """
        self._check_open()
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        by_peer: dict[str, list[int]] = {}
        for i, op in enumerate(batch):
            if op.op not in ("write", "read"):
                raise TransferError(f"op {i}: unknown kind {op.op!r}; use 'write' or 'read'")
            self._regions.lookup(op.local_region, op.local_offset, op.length, where="local")
            if op.remote_offset < 0 or op.length < 0:
                raise TransferError(f"op {i}: negative remote offset or length")
            by_peer.setdefault(op.peer, []).append(i)
        if len(batch) == 1:
            error = await self._carry_one(batch[0], timeout)
            if error is not None:
                raise error
            return
        results: list[BaseException | None] = [None] * len(batch)
        if len(by_peer) == 1:
            # one peer: run it in this task; a gather would add a task and loop turns
            [(peer, idxs)] = by_peer.items()
            await self._submit_peer(peer, idxs, batch, timeout, results)
        elif by_peer:
            await asyncio.gather(*(self._submit_peer(p, ix, batch, timeout, results) for p, ix in by_peer.items()))
        _raise_first(results)

    async def write_from(self, data: bytes | bytearray | memoryview, peer: str, remote_region: str,
                         remote_offset: int, timeout_s: float | None = None,
                         meanwhile: Callable[[], object] | None = None) -> bool:
        """Move a caller's bytes (in no registered region) into a peer's region without staging
        them: through shared memory, one memcpy; over in-process tcp, the caller's buffer handed to
        the kernel as it is. True when done; then `meanwhile` (e.g. the bytes' checksum) was called
        once, while the peer received them where the transport waits for it (with the tcp I/O process,
        the in-process tcp transport sends them). False, with nothing moved, where the carrying
        transport cannot (rdma, shm to a region not in shared memory): stage the bytes in a registered
        region and submit() instead."""
        self._check_open()
        src = memoryview(data).cast("B")
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        for transport in self._transports:
            done = await transport.write_from(src, peer, remote_region, remote_offset, timeout, meanwhile)
            if done is not LEFT:
                return bool(done)
        return False

    async def send_from(self, data: bytes, peer: str, remote_region: str, remote_offset: int,
                        timeout_s: float | None = None) -> Awaitable[object] | None:
        """Like write_from, but returns once the bytes are handed over, with the awaitable of the
        peer's acknowledgement (it raises the write's TransferError; a transport that moves the bytes
        at once, shared memory, raises from the call itself): the caller overlaps the wait
        with its next work. Only for `bytes` (immutable: over tcp the kernel may still be reading
        them after this returns). None, with nothing moved, where write_from would say False."""
        self._check_open()
        if not isinstance(data, bytes):
            raise TypeError(f"send_from takes bytes (immutable), not {type(data).__name__}: use write_from")
        src = memoryview(data)
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        for transport in self._transports:
            ack = await transport.send_from(src, peer, remote_region, remote_offset, timeout)
            if ack is not LEFT:
                return ack  # type: ignore[return-value]
        return None

    async def read_bytes(self, peer: str, remote_region: str, remote_offset: int, length: int,
                         timeout_s: float | None = None) -> bytes | None:
        """A peer's bytes on this host as a new bytes object, copied once out of its segment; None,
        with nothing read, when shared memory cannot reach them (then stage and submit())."""
        self._check_open()
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        for transport in self._transports:
            data = await transport.read_bytes(peer, remote_region, remote_offset, length, timeout)
            if data is not None:
                return data
        return None

    async def _carry_one(self, op: TransferOp, timeout: float) -> BaseException | None:
        """A batch of one (every single-object put/get): its error, if any. Runs in the caller's
        task with no per-batch lists; a transport's TransferError is the op's error."""
        for transport in self._transports:
            try:
                outcome = await transport.submit_one(op, timeout)
            except TransferError as e:
                return e
            if outcome is not LEFT:
                return outcome  # type: ignore[return-value]
        return _uncarried(op)

    async def _submit_peer(
        self,
        peer: str,
        idxs: list[int],
        batch: Sequence[TransferOp],
        timeout: float,
        results: list[BaseException | None],
    ) -> None:
        """Run one peer's ops down the chain; fill in results, never raise."""
        todo = idxs
        for transport in self._transports:
            ops = [batch[i] for i in todo]
            try:
                outcomes: list[Outcome] = await transport.submit(peer, ops, timeout)
            except TransferError as e:
                outcomes = [e] * len(ops)
            left: list[int] = []
            for i, outcome in zip(todo, outcomes, strict=True):
                if outcome is LEFT:
                    left.append(i)
                else:
                    results[i] = outcome  # type: ignore[assignment]
            if not left:
                return
            todo = left
        for i in todo:
            results[i] = _uncarried(batch[i])


def _uncarried(op: TransferOp) -> TransferError:
    """No transport of the chain took the op: a chain whose last transport leaves ops is a bug."""
    return TransferError(f"no transport of this engine can carry a {op.op} to {op.peer}/{op.remote_region}")


def _raise_first(results: list[BaseException | None]) -> None:
    """Raise the first op's error, noting how many others failed too."""
    errors = [r for r in results if r is not None]
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more of the {len(results)} ops in this batch failed too")
        raise first
