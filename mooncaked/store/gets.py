"""A store client's get path: where each object is asked for, in the cheapest way that is safe.

In order, per piece of keys (reads.py moves the bytes and checks every object's XXH3-64):
- an owner on this host that lists the object in its shared-memory index, exactly as we last saw
  it: copied with no round trip at all (owner_index.py);
- an owner we know (from our own put or an earlier lookup) that shared memory does not reach: asked
  by key, one round trip, no master (owner_server.py);
- the rest: looked up at the master (BatchGetReplicas), copying meanwhile from where the objects
  were last seen and keeping those copies only if the lookup's checksum matches (hints.py).
The master stays the authority on existence: an owner serves by key only inside the window the
master vouches for, and a failed or stale read falls back to the lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import torch

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store import metrics, owner_index
from mooncaked.store.commits_behind import CommitsBehind
from mooncaked.store.dram_segment import Staging
from mooncaked.store.errors import InvalidArgument
from mooncaked.store.hints import Hint, Hints
from mooncaked.store.master_calls import MasterCalls
from mooncaked.store.owner_index import IndexView, IndexViews
from mooncaked.store.owner_link import OwnerLinks
from mooncaked.store.reads import GetCall, Reader
from mooncaked.tasks import spawn

if TYPE_CHECKING:
    from mooncaked.store.client import StoreClientConfig

logger = logging.getLogger(__name__)


class Getter:
    """Gets of one client. `shm_host` is our host id when shared memory reaches holders on it ("" else);
    `own_key_server` where our own DRAM is served by key (never asked: we copy from it)."""

    def __init__(self, config: StoreClientConfig, calls: MasterCalls, reader: Reader, staging: Staging,
                 hints: Hints, behind: CommitsBehind, owner_links: OwnerLinks | None, indexes: IndexViews | None,
                 shm_host: str, own_key_server: str) -> None:
        self.config = config
        self.calls = calls
        self.reader = reader
        self.staging = staging
        self.hints = hints
        self.behind = behind
        self.owner_links = owner_links
        self.indexes = indexes
        self.shm_host = shm_host
        self.own_key_server = own_key_server

    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None on a miss (absent, unreachable or failing its checksum)."""
        await self.behind.sent()  # our puts that returned are visible to our own gets
        reader = self.reader
        if reader.owners is not None:  # by key from its owner, if we know it
            h = self.hints.get(key)
            # no staging used, but the same limit as every other get
            if h is not None and self._owner_serves(h) and self.staging.fits([h.size]):
                data, gone = await reader.one_from_owner(key, h)
                if data is not None:
                    metrics.client_op("get", "hit").inc()
                    return data
                if gone:
                    self.hints.forget((key,))
                out: list[bytes | None] = [None]
                await self._fetch(GetCall((key,), {key: 0}, [False], out=out), ask_owners=False)  # asked already
                return out[0]
        return (await self.batch_get([key]))[0]

    def _vouched(self, piece: list[str]) -> list[tuple[str, Hint, IndexView, tuple[int, int]]]:
        """The keys of `piece` an owner on this host lists in its index exactly as we last saw them."""
        assert self.indexes is not None
        out = []
        for key, h in self.hints.pick(piece):
            if h.shm_name and h.checksum and h.host_id == self.shm_host:
                view = self.indexes.get(owner_index.index_name(h.shm_name))
                token = view.vouch(key, h.offset, h.size, h.checksum) if view is not None else None
                if token is not None:
                    out.append((key, h, view, token))
        return out

    def _owner_serves(self, h: Hint) -> bool:
        """Whether a get by key from this hint's owner is worth asking (not ourselves; shared memory does
        not reach it, where the early copy is cheaper; not skipped after a failure)."""
        assert self.owner_links is not None
        return (bool(h.key_server) and bool(h.checksum) and h.key_server != self.own_key_server
                and (not self.shm_host or h.host_id != self.shm_host) and self.owner_links.reachable(h.key_server))

    async def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each object's bytes or None. A copy on this host is read straight into the returned bytes
        (one copy, transfer.read_bytes); the others, and reads that fail, go through staging."""
        out: list[bytes | None] = [None] * len(keys)
        await self._fetch(GetCall(keys, {k: i for i, k in enumerate(keys)}, [False] * len(keys), out=out))
        return out

    def _release_soon(self, lease: int, keys: list[str]) -> None:
        """Give a lease back without waiting for the answer (it only frees room sooner)."""
        request = store_pb2.BatchGetReplicasRequest(client_id=self.config.client_id, release_lease=lease,
                                                    release_keys=keys)

        async def send() -> None:
            try:
                await self.calls.call("BatchGetReplicas", request)
            except Exception as e:  # noqa: BLE001 - best effort (closing, master away): the lease lapses by itself
                logger.debug("store client %s: could not give a read lease back: %s", self.config.client_id, e)

        spawn(send(), f"store-release-{self.config.client_id}")

    async def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy the object into `out` (any layout, dtype or device; its bytes must equal the object's).
        A contiguous CPU tensor is read into directly (reads.py); on False its contents are undefined."""
        return (await self.batch_get_into([key], [out]))[0]

    async def batch_get_into(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Like get_into for many keys; one round trip to the master per piece, reads pipelined."""
        if len(keys) != len(outs):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output tensors")
        call = GetCall(keys, {k: i for i, k in enumerate(keys)}, [False] * len(keys), outs=outs)
        return await self._fetch(call)

    async def _fetch(self, call: GetCall, ask_owners: bool = True) -> list[bool]:
        """Look keys up and read them (reads.py moves, checks and hands the bytes over); objects whose
        owner we know are asked of it by key first (`ask_owners`)."""
        await self.behind.sent()
        reader, got, index = self.reader, call.got, call.index
        step = max(1, self.config.get_batch_keys)
        todo = list(call.keys)
        release: tuple[int, list[str]] = (0, [])  # the last piece's lease, when the master wants it back
        while todo:
            piece, todo = todo[:step], todo[step:]
            if self.indexes is not None:  # owners on this host that list it: no round trip at all
                vouched = self._vouched(piece)
                if vouched:
                    served = await reader.from_index(call, vouched)
                    piece = [k for k in piece if k not in served]
                    if not piece:
                        continue
            if ask_owners and reader.owners is not None:  # one round trip to the owners that hold what we know of
                piece = await self._from_owners(call, piece)
                if not piece:
                    continue
            req = store_pb2.BatchGetReplicasRequest(keys=piece, client_id=self.config.client_id,
                                                    release_lease=release[0], release_keys=release[1])
            hinted = self.hints.pick(req.keys)
            async with AsyncExitStack() as stack:  # what early copies landed in is held until they are served
                if hinted:  # copy from where the objects were last seen while the master answers (hints.py)
                    lookup = await self.calls.send("BatchGetReplicas", req)
                    early = await reader.start_early(call, hinted, stack)
                    reply = await lookup
                else:
                    reply = await self.calls.call("BatchGetReplicas", req)
                objs = [o for o in reply.objects if o.key in index and o.replicas]
                self.hints.note_objects(objs)
                if hinted:
                    objs = await reader.keep_early(call, objs, early)
            if call.out is not None:
                objs = await reader.read_direct(call, objs)
            await reader.read(call, objs)
            # DRAM is short: give this piece's lease back with the next request, so its copies make room
            release = (reply.lease_id, [o.key for o in reply.objects]) if reply.lease_id else (0, [])
            if reply.later_keys:  # what did not fit its owner's DRAM yet comes next, in chain order
                if not reply.objects:
                    break  # the master found no room at all before the deadline
                todo = list(reply.later_keys) + todo
        if release[0]:
            self._release_soon(*release)
        for ok in got:
            metrics.client_op("get", "hit" if ok else "miss").inc()
        return got

    async def _from_owners(self, call: GetCall, piece: list[str]) -> list[str]:
        """Get what we know the owner, size and checksum of from the owner by key (owner_server.py),
        unless shared memory reaches it (then the early copy is cheaper); returns the keys left."""
        assert self.owner_links is not None
        picked = [(k, h) for k, h in self.hints.pick(piece) if self._owner_serves(h)]
        if not picked:
            return piece
        served, gone = await self.reader.from_owners(call, picked)
        if gone:  # removed, moved or rewritten: no early copy from there either
            self.hints.forget(gone)
        return [k for k in piece if k not in served] if served else piece


__all__ = ["Getter"]
