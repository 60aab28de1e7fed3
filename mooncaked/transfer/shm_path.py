"""The shm path: ops to a peer on this host become memmoves into its segments.

The peer's regions and segment names come from the control query; a segment
is mapped once and kept. Before each batch the segments it touches are
checked to still be the owner's (the trailer word in our own mapping, see
shm.py), so a dropped or re-made region is noticed and looked up again
instead of being written into a dead mapping.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerInfo, TransferError, TransferOp, UnknownRegionError, check_bounds
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.host import host_id
from mooncaked.transfer.shm import Attachment, ShmAttachments, shm_available

logger = logging.getLogger(__name__)

Copy = tuple[int, int, int]  # (dst address, src address, nbytes)
INLINE_COPY_BYTES = 4 * 1024 * 1024
"""Batches above this are copied by worker threads, not on the event loop."""
MIN_PIECE_BYTES = 1024 * 1024


def copy_all(copies: list[Copy]) -> None:
    """memmove each range; ctypes releases the GIL while copying.

    memmove in our own threads rather than torch's copy_: its OpenMP team
    spin-waits at barriers, which collapses when another process holds a
    core (measured on 2 busy cores: 0.6 GB/s with 2 threads vs 4+ with one).
    Raw addresses keep the per-op cost low; the caller holds the tensors
    that own the memory until the copies are done.
    """
    for dst, src, n in copies:
        ctypes.memmove(dst, src, n)


def split_copies(copies: list[Copy], parts: int) -> list[list[Copy]]:
    """Cut the copies into `parts` groups of about equal bytes (big copies are
    cut into pieces of at least MIN_PIECE_BYTES) so threads can share them."""
    total = sum(n for _, _, n in copies)
    piece = max(MIN_PIECE_BYTES, -(-total // parts))
    groups: list[list[Copy]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for dst, src, n in copies:
        for start in range(0, n, piece):
            k = loads.index(min(loads))
            size = min(piece, n - start)
            groups[k].append((dst + start, src + start, size))
            loads[k] += size
    return [g for g in groups if g]


class ShmPath:
    """Copies for one engine; strict (backend "shm") refuses what auto hands to tcp."""

    def __init__(self, regions: RegionTable, strict: bool, copy_threads: int) -> None:
        self._regions = regions
        self._strict = strict
        self._copy_threads = copy_threads
        self._pool: ThreadPoolExecutor | None = None
        self._attachments = ShmAttachments()
        self._host_id = host_id()
        self._shm_ok = shm_available()  # asked once: two syscalls per batch otherwise

    def same_host(self, info: PeerInfo) -> bool:
        return info.host_id == self._host_id and self._shm_ok

    async def run(
        self, peer: str, ops: list[TransferOp], info: PeerInfo, refresh: Callable[[], Awaitable[PeerInfo]]
    ) -> tuple[list[BaseException | None], list[int]]:
        """Copy what can go through shared memory.

        Returns one outcome per op and the indices of the ops left for tcp
        (auto only: peer elsewhere, region not in shm, or mapping failed).
        """
        outcomes: list[BaseException | None] = [None] * len(ops)
        if not self.same_host(info):
            if self._strict:
                raise TransferError(
                    f"backend 'shm' needs peer {peer} on this host, but it runs on {info.host_id}; "
                    "use backend 'auto' or 'tcp'"
                )
            return outcomes, list(range(len(ops)))
        names = [ops[0].remote_region] if len(ops) == 1 else {op.remote_region for op in ops}
        if self._stale(info, names):
            info = await refresh()
        copies: list[Copy] = []
        keep: list[torch.Tensor] = []  # owners of the memory behind the raw addresses
        left: list[int] = []
        done: list[TransferOp] = []  # what went through shm (or failed here), for the metrics
        oks: list[bool] = []
        for i, op in enumerate(ops):
            try:
                mapped = self._map(peer, op.remote_region, op.remote_offset, op.length, info)
            except TransferError as e:
                outcomes[i] = e
                done.append(op)
                oks.append(False)
                continue
            if mapped is None:
                left.append(i)
                continue
            local = self._regions.lookup(op.local_region, op.local_offset, op.length)
            keep += (local.flat, mapped.tensor)
            local_at = local.info.address + op.local_offset  # info.address is flat's data_ptr
            remote_at = mapped.address + op.remote_offset
            if op.op == "write":
                copies.append((remote_at, local_at, op.length))
            else:
                copies.append((local_at, remote_at, op.length))
            done.append(op)
            oks.append(True)
        await self._copy(copies)  # `keep` holds the memory until here
        if done:
            metrics.count_initiated("shm", done, oks)
        return outcomes, left

    async def peer_bytes(
        self, peer: str, region: str, offset: int, length: int, info: PeerInfo,
        refresh: Callable[[], Awaitable[PeerInfo]],
    ) -> memoryview | None:
        """The peer's bytes [offset, +length) of `region` as mapped here, for one copy to or from a
        caller's buffer; None when shm cannot reach them (another host, a region not in shm, a
        mapping that failed): the caller then takes the staged path. Checked like `run` checks."""
        if not self.same_host(info):
            return None
        if self._stale(info, (region,)):
            info = await refresh()
        mapped = self._map(peer, region, offset, length, info)
        return None if mapped is None else mapped.view[offset : offset + length]

    def _stale(self, info: PeerInfo, names: Iterable[str]) -> bool:
        """Whether a region is unknown or its segment is gone (drop those mappings)."""
        stale = False
        for name in names:
            region = info.regions.get(name)
            if region is None:
                stale = True
            elif region.shm_name and not self._attachments.alive(region.shm_name):
                self._attachments.drop(region.shm_name)
                stale = True
        return stale

    def _map(self, peer: str, region: str, offset: int, length: int, info: PeerInfo) -> Attachment | None:
        """The peer's segment holding [offset, +length) of `region`, checked; None to hand the op to tcp."""
        remote = info.regions.get(region)
        if remote is None:
            raise UnknownRegionError(f"peer {peer}: remote region {region!r} is not registered")
        if remote.shm_name is None:
            if self._strict:
                raise TransferError(
                    f"peer {peer}: region {region!r} is not in shared memory "
                    "(registered, not alloc_region'ed); use backend 'auto' or 'tcp'"
                )
            return None
        check_bounds("remote", f"{peer}/{region}", remote.nbytes, offset, length)
        try:
            return self._attachments.get(remote.shm_name, remote.nbytes)
        except TransferError:
            if self._strict:
                raise
            return None  # a failed path is retried on the next

    async def _copy(self, copies: list[Copy]) -> None:
        """Small batches inline; big ones spread over the copy threads."""
        if sum(n for _, _, n in copies) <= INLINE_COPY_BYTES:
            copy_all(copies)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="transfer-copy")
        loop = asyncio.get_running_loop()
        groups = split_copies(copies, self._copy_threads)
        await asyncio.gather(*(loop.run_in_executor(self._pool, copy_all, g) for g in groups))

    def close(self) -> None:
        self._attachments.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
