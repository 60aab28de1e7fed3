"""TransferEngine: register memory, submit batches, pick a path per peer.

The engine owns the region table, the tcp server that serves it, one
connection pool per peer, shm mappings of peers' segments and, for the rdma
backend, Mooncake's engine. It validates every op locally before any byte
moves, runs each peer's share of a batch concurrently, and reports the first
failure (with a note counting the others) only after every op has finished
or been aborted, so a failed submit leaves nothing in flight.

Given the cluster secret (`token`), every tcp connection in and out opens
with the handshake of handshake.py, and the control query (INFO) is answered
only after it; its answer names regions, sizes and shm segments, and raw
memory addresses only for the rdma backends, whose peers need them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch

from mooncaked.transfer import metrics
from mooncaked.transfer.api import (
    BACKENDS,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MOONCAKE_BACKENDS,
    EngineStats,
    PeerInfo,
    RegionInfo,
    TransferError,
    TransferOp,
)
from mooncaked.transfer.conn_guard import ConnLimits
from mooncaked.transfer.handshake import check_token
from mooncaked.transfer.ratelimit import TokenBucket
from mooncaked.transfer.rdma import MooncakeTransport
from mooncaked.transfer.regions import Region, RegionTable
from mooncaked.transfer.shm import create_segment, host_id, shm_available
from mooncaked.transfer.shm_path import ShmPath
from mooncaked.transfer.tcp_pool import PeerPool, fetch_info, run_one_tcp, run_tcp
from mooncaked.transfer.tcp_server import TcpServer

logger = logging.getLogger(__name__)


class TransferEngine:
    """One process's endpoint of the data plane; see DESIGN.md §6."""

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
    ) -> None:
        """`token`: the cluster secret every peer must prove (None: no handshake, for loopback
        clusters); `limits`: the incoming connections' cap and timeouts (conn_guard.ConnLimits)."""
        if backend not in BACKENDS:
            raise TransferError(f"unknown transfer backend {backend!r}; choose one of {BACKENDS}")
        if connections_per_peer < 1:
            raise TransferError(f"connections_per_peer must be >= 1, got {connections_per_peer}")
        self.backend = backend
        self._host = host
        self._port = port
        self._conns_per_peer = connections_per_peer
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._limiter = TokenBucket(rate_limit_bytes_per_s) if rate_limit_bytes_per_s else None
        self._token = check_token(token)
        self._regions = RegionTable()
        self._limits = limits or ConnLimits()  # peers are assumed to run with the same
        self._server = TcpServer(self._regions, self.peer_info, self._limiter, self._token, self._limits)
        self._pools: dict[str, PeerPool] = {}
        self._peer_infos: dict[str, PeerInfo] = {}
        self._host_id = host_id()
        copy_threads = max(1, min(4, os.cpu_count() or 1))
        self._shm = ShmPath(self._regions, backend == "shm", copy_threads) if backend in ("shm", "auto") else None
        self._rdma: MooncakeTransport | None = None
        self.address: str | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> str:
        """Serve incoming transfers; returns this endpoint's "host:port"."""
        if self._closed:
            raise TransferError("transfer engine is closed; make a new one")
        if self.address is not None:
            return self.address
        if self.backend in MOONCAKE_BACKENDS and self._rdma is None:
            protocol: Literal["rdma", "tcp"] = "rdma" if self.backend == "rdma" else "tcp"
            self._rdma = MooncakeTransport(self._host, protocol)  # raises if unavailable
            for info in self._regions.infos():
                self._rdma.register(info.address, info.nbytes)
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
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        for name in self._regions.names():
            self.unregister(name)
        if self._shm is not None:
            self._shm.close()
        self._rdma = None  # Mooncake's engine stops its threads when dropped
        logger.info("transfer engine %s closed", self.address)

    # -- memory --------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> RegionInfo:
        """Expose a contiguous CPU tensor's bytes to peers under `name`."""
        region = self._regions.add(name, tensor)
        self._rdma_register(region)
        return region.info

    def alloc_region(self, name: str, nbytes: int) -> torch.Tensor:
        """Allocate, prefault and register `nbytes`; returns a uint8 tensor.

        With backend shm/auto the memory is a POSIX shm segment, so a peer on
        this host maps the same pages and a transfer is one memcpy.
        """
        if nbytes <= 0:
            raise TransferError(f"region size must be positive, got {nbytes}")
        if self.backend in ("shm", "auto") and shm_available():
            segment = create_segment(nbytes)
            try:
                region = self._regions.add(name, segment.tensor, segment.shm_name, segment.unlink)
            except BaseException:
                segment.unlink()
                raise
        else:
            region = self._regions.add(name, torch.zeros(nbytes, dtype=torch.uint8))
        self._rdma_register(region)
        return region.tensor

    def unregister(self, name: str) -> None:
        region = self._regions.remove(name)
        if self._rdma is not None:
            self._rdma.unregister(region.info.address)

    def _rdma_register(self, region: Region) -> None:
        if self._rdma is not None:
            self._rdma.register(region.info.address, region.info.nbytes)

    def info(self) -> PeerInfo:
        """What peers learn about this engine through the control query."""
        regions = {i.name: i for i in self._regions.infos()}
        return PeerInfo(self._host_id, regions, self._rdma.session if self._rdma else None)

    def peer_info(self) -> PeerInfo:
        """What the control query answers a peer: `info` less what the peer cannot use. Region base
        addresses (where our memory sits, which helps an exploit) go only to rdma peers, who name
        raw addresses in their one-sided ops; tcp and shm peers address regions by name."""
        info = self.info()
        if self._rdma is not None:
            return info
        return PeerInfo(info.host_id, {n: replace(r, address=0) for n, r in info.regions.items()}, None)

    def stats(self) -> EngineStats:
        conns = list(self._server.connections)
        return EngineStats(
            incoming_connections=len(conns),
            ops_per_incoming_connection=[c.ops_served for c in conns],
            outgoing_connections={p: len(pool.conns) for p, pool in self._pools.items()},
        )

    # -- transfers -----------------------------------------------------------
    async def submit(self, batch: Sequence[TransferOp], timeout_s: float | None = None) -> None:
        """Run every op of the batch; returns when all bytes are in place.

        Ops are checked locally first (nothing moves if one is malformed).
        On failure raises the first op's TransferError once every other op
        has finished or been aborted. Ops of one batch run concurrently, so
        overlapping ranges have no defined order.
        """
        if self._closed:
            raise TransferError("transfer engine is closed; make a new one")
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
            error = await self._submit_one(batch[0], timeout)
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
                         remote_offset: int, timeout_s: float | None = None) -> bool:
        """Copy a caller's bytes (not in any registered region) straight into a peer's region on
        this host: one memcpy where staging would take two. False, with nothing moved, when the
        peer is not reachable through shared memory (backend tcp/rdma, another host, a region
        not in shm): stage the bytes in a registered region and submit() instead."""
        src = memoryview(data).cast("B")
        target = await self._peer_bytes("write", peer, remote_region, remote_offset, src.nbytes, timeout_s)
        if target is None:
            return False
        target[:] = src
        metrics.count_op("shm", "write", "initiator", True, sent=src.nbytes)
        return True

    async def read_bytes(self, peer: str, remote_region: str, remote_offset: int, length: int,
                         timeout_s: float | None = None) -> bytes | None:
        """A peer's bytes on this host as a new bytes object, copied once out of its segment; None,
        with nothing read, when shared memory cannot reach them (then stage and submit())."""
        source = await self._peer_bytes("read", peer, remote_region, remote_offset, length, timeout_s)
        if source is None:
            return None
        out = bytes(source)
        metrics.count_op("shm", "read", "initiator", True, received=length)
        return out

    async def _peer_bytes(self, kind: str, peer: str, region: str, offset: int, length: int,
                          timeout_s: float | None) -> memoryview | None:
        if self._closed:
            raise TransferError("transfer engine is closed; make a new one")
        if self._shm is None or self._rdma is not None:
            return None
        if offset < 0 or length <= 0:
            raise TransferError(f"{kind} of {length} bytes at {offset}: need a positive length and offset >= 0")
        timeout = timeout_s if timeout_s is not None else self._timeout_s
        info = await self._peer_info(peer, timeout)
        return await self._shm.peer_bytes(peer, region, offset, length, info,
                                          lambda: self._peer_info(peer, timeout, refresh=True))

    async def _submit_one(self, op: TransferOp, timeout: float) -> BaseException | None:
        """A batch of one (every single-object put/get): its error, if any.

        Runs in the caller's task with no per-batch lists; on the tcp backend
        it goes straight to the connection (a failure to connect is the op's
        error, as in _submit_peer).
        """
        if self.backend == "tcp":
            try:
                return await run_one_tcp(self._pool(op.peer), self._regions, op, timeout)
            except TransferError as e:
                return e
        results: list[BaseException | None] = [None]
        await self._submit_peer(op.peer, [0], (op,), timeout, results)
        return results[0]

    async def _submit_peer(
        self,
        peer: str,
        idxs: list[int],
        batch: Sequence[TransferOp],
        timeout: float,
        results: list[BaseException | None],
    ) -> None:
        """Run one peer's ops on its path; fill in results, never raise."""
        ops = [batch[i] for i in idxs]
        try:
            if self._rdma is not None:
                # asked afresh per batch: raw addresses of a region the peer dropped must not be reused
                info = await self._peer_info(peer, timeout, refresh=True)
                await self._rdma.submit(peer, ops, info, self._regions, timeout, self.backend)
                outcomes: list[BaseException | None] = [None] * len(ops)
            elif self.backend in MOONCAKE_BACKENDS:
                raise TransferError(f"backend {self.backend!r} is set up by start(); call it before submit()")
            elif self._shm is not None:
                info = await self._peer_info(peer, timeout)
                outcomes, left = await self._shm.run(
                    peer, ops, info, lambda: self._peer_info(peer, timeout, refresh=True)
                )
                if left:
                    rest = await run_tcp(self._pool(peer), self._regions, [ops[j] for j in left], timeout)
                    for j, outcome in zip(left, rest, strict=True):
                        outcomes[j] = outcome
            else:
                outcomes = await run_tcp(self._pool(peer), self._regions, ops, timeout)
        except TransferError as e:
            outcomes = [e] * len(ops)
        for i, outcome in zip(idxs, outcomes, strict=True):
            results[i] = outcome

    def _pool(self, peer: str) -> PeerPool:
        pool = self._pools.get(peer)
        if pool is None:
            pool = PeerPool(peer, self._conns_per_peer, self._connect_timeout_s, self._limiter, self._token,
                            self._limits.client_idle_s)
            self._pools[peer] = pool
        return pool

    async def _peer_info(self, peer: str, timeout: float, refresh: bool = False) -> PeerInfo:
        """The peer's host and regions, asked over tcp once and cached."""
        info = self._peer_infos.get(peer)
        if info is None or refresh:
            info = self._peer_infos[peer] = await fetch_info(self._pool(peer), timeout)
        return info


def _raise_first(results: list[BaseException | None]) -> None:
    """Raise the first op's error, noting how many others failed too."""
    errors = [r for r in results if r is not None]
    if errors:
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more of the {len(results)} ops in this batch failed too")
        raise first
