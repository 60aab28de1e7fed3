"""A store client's put path: into places reserved ahead (one commit), or PutStart / write / PutEnd.

Bytes move only through `transfer/`: a caller's bytes go straight from their buffer where the data
plane can (one memcpy over shared memory), tensors and the rest through the staging area; every
object is checksummed (XXH3-64) before its commit names it, and a commit names only objects whose
every byte landed, so nothing half-written is ever visible. A batch put into places reserved ahead
commits each group of objects once its bytes landed, while the next group's bytes move; with
commit_behind a single put's commit does too (commits_behind.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store import metrics
from mooncaked.store.commits_behind import CommitsBehind
from mooncaked.store.dram_journal import DramJournal
from mooncaked.store.dram_segment import STAGING_REGION, Staging, nbytes_of
from mooncaked.store.errors import NoRoom
from mooncaked.store.hints import Hints
from mooncaked.store.lmdb_tier import LmdbTier, LmdbWrite
from mooncaked.store.master_calls import MasterCalls
from mooncaked.store.places_ahead import PlacesAhead
from mooncaked.store.reads import PIPELINE_GROUP, chunks, settle
from mooncaked.store.recent_writes import RecentWrites
from mooncaked.store.records import checksum
from mooncaked.store.reservations import Place, Shape
from mooncaked.transfer import TransferEngine, TransferError, TransferOp

if TYPE_CHECKING:
    from mooncaked.store.client import StoreClientConfig

logger = logging.getLogger(__name__)

Data = bytes | bytearray | memoryview | torch.Tensor


class Writer:
    """Puts of one client. `own_dram` names the client's DRAM segment ("" when it lends none): a copy
    there is journaled at once; copies on others' DRAM are kept to re-report to a new master."""

    def __init__(self, config: StoreClientConfig, transfer: TransferEngine, staging: Staging, calls: MasterCalls,
                 ahead: PlacesAhead, behind: CommitsBehind, hints: Hints, journal: DramJournal,
                 recent_writes: RecentWrites, own_dram: str, lmdb: LmdbTier | None,
                 lmdb_thread: ThreadPoolExecutor) -> None:
        self.config = config
        self.transfer = transfer
        self.staging = staging
        self.calls = calls
        self.ahead = ahead
        self.behind = behind
        self.hints = hints
        self.journal = journal
        self.recent_writes = recent_writes
        self.own_dram = own_dram
        self.lmdb = lmdb
        self.lmdb_thread = lmdb_thread

    async def put(self, key: str, data: Data, *, soft_pin: bool = False) -> bool:
        """Store one object; True when it is in the pool (now or already), False when there was no room.

        Into a place reserved ahead when one is at hand (the write and one commit); else, or when
        that fails for a reason a fresh PutStart may not have, the batch path (PutStart, write, PutEnd).
        """
        if self.config.reserve_ahead_bytes > 0:
            done = await self._put_reserved(key, data, soft_pin)
            if done is not None:
                return done
        return (await self.batch_put([(key, data)], soft_pin=soft_pin))[0]

    async def _put_reserved(self, key: str, data: Data, soft_pin: bool) -> bool | None:
        """One put into a reserved place; None to take the batch path instead (no place, no room, or
        the place was unknown to the master)."""
        size = nbytes_of(data)
        if size <= 0 or not self.staging.fits([size]):
            return None  # the batch path says what is wrong
        shape = self._shape(size)
        place = self.ahead.take(shape)
        reserving = None if place is not None else await self.ahead.reserve_for_a_put(shape)
        # a caller's bytes are checksummed as they are: while the master reserves, if it does; else
        # while they travel (_write_place)
        csum = None if reserving is None or isinstance(data, torch.Tensor) else checksum(data)
        if reserving is not None:
            try:
                place = self.ahead.first_of(shape, await reserving)
            except NoRoom:
                return None
            if place is None:
                return None
        fast = self.calls.open_fast_now()
        if self.config.commit_behind and isinstance(data, bytes) and fast is not None:
            return await self._put_behind(key, data, place, csum, soft_pin)
        try:
            csum = await self._write_place(data, size, place, csum)
        except TransferError as e:
            await self._write_failed(key, place, e)
            return False
        end = _commit_request(place, key, csum, soft_pin)
        if self.config.commit_behind and fast is not None and not fast.closed:  # ordered before our next call
            done_csum = csum
            await self.behind.sent()  # after the commits of the puts before it
            await self.behind.add(key, fast.send("BatchPutEnd", end, self.config.rpc_timeout_s),
                                  lambda ok: self._settled(key, place, size, done_csum, ok))
            return True
        await self.behind.sent()
        reply = await self.calls.call("BatchPutEnd", end)
        if not reply.reserved_ok or not reply.reserved_ok[0]:
            self.ahead.places.forget()  # the master did not know the place: it restarted, or the place lapsed
            return None
        self._settled(key, place, size, csum, True)
        return True

    async def _put_behind(self, key: str, data: bytes, place: Place, csum: int | None, soft_pin: bool) -> bool:
        """A single put of immutable bytes with commit_behind: it returns once they are handed to the data
        plane (transfer.send_from; checksummed while they travel); each copy's acknowledgement and then
        the commit follow behind, while the caller's next put moves (commits_behind.py)."""
        size = len(data)
        acks: list[Awaitable[object]] = []
        staged: list[store_pb2.Replica] = []
        try:
            for rep in place.replicas:
                ack = await self.transfer.send_from(data, rep.endpoint.address, rep.endpoint.region, rep.offset,
                                                    self.config.transfer_timeout_s)
                if ack is None:
                    staged.append(rep)
                else:
                    acks.append(ack)
            if csum is None:
                csum = checksum(data)
            if staged:
                await self._write_staged(data, size, staged, csum)
        except TransferError as e:
            await asyncio.gather(*acks, return_exceptions=True)  # nothing of ours may land in a place given back
            await self._write_failed(key, place, e)
            return False
        end = _commit_request(place, key, csum, soft_pin)
        done_csum = csum  # an int by now, for the callback
        await self.behind.add_landing(key, acks, lambda: self.calls.send("BatchPutEnd", end),
                                      lambda ok: self._settled(key, place, size, done_csum, ok),
                                      lambda e: self._write_failed(key, place, e))
        return True

    def _shape(self, size: int) -> Shape:
        """The stock of places reserved ahead a put of `size` bytes takes from."""
        return Shape(size, self.config.replicas, self.own_dram if self.config.prefer_local else "")

    async def _write_failed(self, key: str, place: Place, error: BaseException) -> None:
        logger.warning("store put of %s failed on the data plane (%s); giving its place back", key, error)
        await self.ahead.give_back([place.reservation])
        metrics.client_op("put", "failed").inc()

    def _settled(self, key: str, place: Place, size: int, csum: int, ok: bool) -> None:
        """A single put's commit was answered (ok: taken)."""
        if not ok:
            self.ahead.places.forget()  # the master did not know the place: it restarted, or the place lapsed
            metrics.client_op("put", "lost").inc()
            return
        self._committed(key, place.replicas, size, csum)
        metrics.client_op("put", "ok").inc()
        metrics.client_bytes("put").inc(size)

    async def _write_place(self, data: Data, size: int, place: Place, csum: int | None) -> int:
        """Write one object into every copy of its place; returns its checksum (`csum` when given).

        A caller's bytes go to each copy straight from their buffer where the data plane can
        (transfer.write_from: shared memory, one memcpy; in-process tcp, no copy on this side),
        checksummed while the first copy travels when `csum` is not given yet. Tensors, and copies
        the data plane cannot reach that way (rdma, the tcp I/O process), go through the staging area.
        """
        staged = place.replicas
        if not isinstance(data, torch.Tensor):
            sums = [] if csum is None else [csum]

            def hash_meanwhile() -> None:
                if not sums:
                    sums.append(checksum(data))

            staged = [rep for rep in place.replicas
                      if not await self.transfer.write_from(data, rep.endpoint.address, rep.endpoint.region,
                                                            rep.offset, self.config.transfer_timeout_s, hash_meanwhile)]
            if not staged:
                return sums[0] if sums else checksum(data)
            csum = sums[0] if sums else None
        return await self._write_staged(data, size, staged, csum)

    async def _write_staged(self, data: Data, size: int, replicas: list[store_pb2.Replica], csum: int | None) -> int:
        """Write one object into these copies through the staging area; returns its checksum."""
        async with self.staging.lease([size]) as (off,):
            self.staging.stage(off, data)
            if csum is None:
                csum = checksum(self.staging.slice(off, size))
            ops = [TransferOp("write", STAGING_REGION, off, rep.endpoint.address, rep.endpoint.region, rep.offset, size)
                   for rep in replicas]
            await self.transfer.submit(ops, timeout_s=self.config.transfer_timeout_s)
        return csum

    async def batch_put(self, items: Sequence[tuple[str, Data]], *, soft_pin: bool = False) -> list[bool]:
        """Store many objects with one PutStart/PutEnd round trip per staging-area's worth.

        Objects that found no room are retried for up to `no_room_retry_s` while the master
        moves older objects to LMDB; what still finds none is reported False (a cache may drop).
        """
        await self.behind.sent()  # commits in put order
        out = [False] * len(items)
        todo = list(range(len(items)))
        if self.config.reserve_ahead_bytes > 0 and items:
            for i, done in enumerate(await self._put_reserved_many(items, soft_pin)):
                if done is not None:
                    out[i] = done
            todo = [i for i in todo if not out[i]]
        deadline = asyncio.get_running_loop().time() + self.config.no_room_retry_s
        pause = 0.02
        while True:
            for chunk in self._chunks([nbytes_of(items[i][1]) for i in todo]):
                results = await self._put_chunk([items[todo[j]] for j in chunk], soft_pin)
                for j, ok in zip(chunk, results):
                    out[todo[j]] = ok
            todo = [i for i in todo if not out[i]]
            if not todo or asyncio.get_running_loop().time() + pause > deadline:
                return out
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def _put_reserved_many(self, items: Sequence[tuple[str, Data]], soft_pin: bool) -> list[bool | None]:
        """The items that find a place reserved ahead, written and committed pipelined (see
        _write_and_commit); None for the others (the PutStart path takes them)."""
        results: list[bool | None] = [None] * len(items)
        sizes = [nbytes_of(d) for _, d in items]
        taken: list[tuple[int, Place]] = []
        for i, size in enumerate(sizes):
            if size <= 0 or not self.staging.fits([size]):
                continue  # the PutStart path says what is wrong
            place = self.ahead.take(self._shape(size))
            if place is not None:
                taken.append((i, place))
        for chunk in self._chunks([sizes[i] for i, _ in taken]):
            part = [taken[j] for j in chunk]
            for (i, _), ok in zip(part, await self._write_and_commit(items, part, sizes, soft_pin)):
                results[i] = ok
        return results

    async def _write_and_commit(self, items: Sequence[tuple[str, Data]], part: list[tuple[int, Place]],
                                sizes: list[int], soft_pin: bool) -> list[bool | None]:
        """Write objects into their reserved places in groups of PIPELINE_GROUP, each group's bytes
        moving while the next is staged and hashed, and commit each group as soon as its bytes are in
        place, while later groups still move (a commit names only objects whose every byte landed).
        True: committed; False: the write failed (its places given back); None: the master did not
        know the place (the PutStart path tries again)."""
        out: list[bool | None] = [False] * len(part)
        sums = [0] * len(part)
        groups = [list(range(s, min(s + PIPELINE_GROUP, len(part)))) for s in range(0, len(part), PIPELINE_GROUP)]
        commits: list[tuple[list[int], Awaitable[store_pb2.BatchPutEndReply]]] = []
        async with self.staging.lease([sizes[i] for i, _ in part]) as offsets:
            writes: list[asyncio.Future] = []
            try:
                for g in groups:
                    ops = []
                    for j in g:
                        (i, place), off = part[j], offsets[j]
                        self.staging.stage(off, items[i][1])
                        sums[j] = checksum(self.staging.slice(off, sizes[i]))
                        ops += [TransferOp("write", STAGING_REGION, off, r.endpoint.address, r.endpoint.region,
                                           r.offset, sizes[i]) for r in place.replicas]
                    writes.append(asyncio.ensure_future(self.transfer.submit(ops, self.config.transfer_timeout_s)))
                    await asyncio.sleep(0)  # its bytes go onto the wire while the next group is staged
                for g, writing in zip(groups, writes):
                    try:
                        await writing
                    except TransferError as e:
                        logger.warning("store put of %d objects failed on the data plane (%s); giving their places "
                                       "back", len(g), e)
                        await self.ahead.give_back([part[j][1].reservation for j in g])
                        continue
                    end = store_pb2.BatchPutEndRequest(reserved=[store_pb2.ReservedPut(
                        reservation=part[j][1].reservation, key=items[part[j][0]][0], checksum=sums[j],
                        soft_pin=soft_pin) for j in g])
                    commits.append((g, await self.calls.send("BatchPutEnd", end)))
            finally:  # cancelled: nothing may read the staging area once it is given back
                await settle(writes)
        replies = await asyncio.gather(*(c for _, c in commits), return_exceptions=True)
        for (g, _), reply in zip(commits, replies):
            if isinstance(reply, BaseException):
                raise reply
            for j, ok in zip(g, reply.reserved_ok):
                i, place = part[j]
                if not ok:  # the master did not know the place: it restarted, or the place lapsed
                    self.ahead.places.forget()
                    out[j] = None
                    continue
                out[j] = True
                self._committed(items[i][0], place.replicas, sizes[i], sums[j])
                metrics.client_bytes("put").inc(sizes[i])
        for ok in out:
            if ok is not None:
                metrics.client_op("put", "ok" if ok else "failed").inc()
        return out

    async def _put_chunk(self, items: Sequence[tuple[str, Data]], soft_pin: bool) -> list[bool]:
        sizes = [nbytes_of(d) for _, d in items]
        async with self.staging.lease(sizes) as offsets:
            pref = self.own_dram if self.config.prefer_local else ""
            req = store_pb2.BatchPutStartRequest(items=[
                store_pb2.PutStartRequest(key=k, size=n, replicas=self.config.replicas, preferred_segment=pref,
                                          soft_pin=soft_pin)
                for (k, _), n in zip(items, sizes)], client_id=self.config.client_id)
            placing = await self.calls.send("BatchPutStart", req)
            # while the master places them: gather the bytes and hash them (the checksums go with PutEnd)
            sums = []
            for (_, data), off, size in zip(items, offsets, sizes):
                self.staging.stage(off, data)
                sums.append(checksum(self.staging.slice(off, size)))
            reply = await placing
            ok = [it.exists for it in reply.items]
            writing = [i for i, it in enumerate(reply.items) if it.replicas]
            bad = await self._write_placed(reply, writing, items, offsets, sizes, sums)
        good = [i for i in writing if i not in bad]
        if writing:
            end = store_pb2.BatchPutEndRequest(keys=[items[i][0] for i in good], checksums=[sums[i] for i in good],
                                               revoke_keys=[items[i][0] for i in writing if i in bad])
            done = await self.calls.call("BatchPutEnd", end)
            if done.committed < len(good):  # the master that placed them is gone (restarted, or a new leader)
                logger.warning("store put of %d objects: the master committed %d (it did not place them: a "
                               "restart or a new leader); reporting them not stored", len(good), done.committed)
                good = []
            for i in good:
                ok[i] = True
                self._committed(items[i][0], reply.items[i].replicas, sizes[i], sums[i])
        for i, good_one in enumerate(ok):
            metrics.client_op("put", "ok" if good_one else "no_room" if i not in bad else "failed").inc()
            if good_one and i in writing:
                metrics.client_bytes("put").inc(sizes[i])
        return ok

    def _committed(self, key: str, replicas: Sequence[store_pb2.Replica], size: int, csum: int) -> None:
        """A put of ours is in the pool: note where its DRAM copy is (a location hint), and journal a
        copy on our own DRAM at once. The master's journal batch for it comes up to JOURNAL_FLUSH_S
        later; a master lost in between would otherwise forget an object it had committed."""
        dram = next((r for r in replicas if r.medium != "lmdb"), None)
        if dram is not None:
            self.hints.note(key, dram, size, csum)
        for r in replicas:
            if r.segment == self.own_dram:
                self.journal.note(key, r.offset, size, csum)
            elif r.medium == "dram":
                self.recent_writes.note(r.segment, key, r.offset, size, csum)

    async def _write_placed(self, reply: store_pb2.BatchPutStartReply, writing: list[int],
                            items: Sequence[tuple[str, Data]], offsets: list[int], sizes: list[int],
                            sums: list[int]) -> set[int]:
        """Write the staged objects where the master placed them: DRAM copies through transfer/, a place
        on our own LMDB tier (no DRAM had room) into it, both at once. Returns the items that failed."""
        own_lmdb = f"{self.config.client_id}/lmdb"
        ops: list[TransferOp] = []
        remote: list[int] = []  # items with a DRAM copy to write
        local: list[int] = []  # items placed on our LMDB tier
        bad: set[int] = set()
        for i in writing:
            for rep in reply.items[i].replicas:
                if rep.medium != "lmdb":
                    ops.append(TransferOp("write", STAGING_REGION, offsets[i], rep.endpoint.address,
                                          rep.endpoint.region, rep.offset, sizes[i]))
                    if not remote or remote[-1] != i:
                        remote.append(i)
                elif rep.segment == own_lmdb and self.lmdb is not None:
                    local.append(i)
                else:  # only the writer can store on an LMDB tier
                    logger.warning("store put of %s: placed on LMDB tier %s, which is not ours; revoking it",
                                   items[i][0], rep.segment)
                    bad.add(i)
        storing = None
        if local:
            assert self.lmdb is not None
            writes = [LmdbWrite(items[i][0], self.staging.slice(offsets[i], sizes[i]), sums[i]) for i in local]
            storing = asyncio.get_running_loop().run_in_executor(self.lmdb_thread, self.lmdb.write_many, writes)
        try:
            if ops:
                try:
                    await self.transfer.submit(ops, timeout_s=self.config.transfer_timeout_s)
                except TransferError as e:
                    bad.update(remote)
                    logger.warning("store put of %d objects failed on the data plane (%s); revoking them",
                                   len(remote), e)
        finally:
            if storing is not None:  # the staged bytes stay leased until LMDB has them
                for i, err in zip(local, await storing):
                    if err:
                        logger.warning("store put of %s on our LMDB tier failed (%s); revoking it", items[i][0], err)
                        bad.add(i)
        return bad

    def _chunks(self, sizes: Sequence[int]) -> list[list[int]]:
        """Indices grouped so each group fits the staging area."""
        return chunks(self.staging, sizes)


def _commit_request(place: Place, key: str, csum: int, soft_pin: bool) -> store_pb2.BatchPutEndRequest:
    """The commit of one put into a place reserved ahead."""
    return store_pb2.BatchPutEndRequest(reserved=[store_pb2.ReservedPut(reservation=place.reservation, key=key,
                                                                        checksum=csum, soft_pin=soft_pin)])


__all__ = ["Data", "Writer"]
