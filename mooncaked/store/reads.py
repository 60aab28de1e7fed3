"""The get path of a store client: look keys up, move their bytes, check them, hand them over.

Over TCP, an object whose owner, size and checksum the client knows is first asked of that owner
by key (owner_server.py, owner_link.py): one round trip and no master; what the owner does not
serve, and every other object, takes the master's path below.

Three things keep the master's path short over TCP as well as over shared memory:

- Early copies (hints.py). When the client knows where an object sat, it reads it from there
  while the master's lookup is in flight, and keeps the bytes only if they hash to the
  checksum the lookup answers. Over shared memory that is one memcpy; over TCP it is a read
  from the owner, one round trip that overlaps the master's. The master stays the authority:
  a key it does not answer is a miss whatever the early copy holds. A read toward an owner the
  lookup does not name (it may be dead or stalled) is given EARLY_GRACE_S more, then cancelled
  (the transfer engine drops a connection whose answer would land in memory given up on).
- Pipelined reads. A batch's objects move in groups of PIPELINE_GROUP, all in flight at once;
  each group is checked and handed over as soon as it lands, while later groups still move.
- Short deadlines (transfer/deadlines.py). A read from one copy is given up after a grace plus its
  bytes at a floor rate (never more than the client's transfer timeout): a stalled owner (paused,
  swapping, its host gone) costs its readers a miss, which an engine computes, not a wait as long
  as the transfer timeout. An owner whose read timed out is not read from for STALLED_FOR_S (its
  other copies are read, or it is a miss); the master drops a dead one's copies meanwhile.
- Zero copy into the caller's tensor. get_into of a contiguous CPU tensor registers that
  tensor with the transfer engine for the read, so the socket (or the shared-memory copy)
  writes straight into it; other tensors, and `bytes` results, land in the staging area.
  When such a read fails its checksum the tensor holds those bytes and the get says False.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store import metrics
from mooncaked.store.dram_segment import STAGING_REGION, Staging, nbytes_of
from mooncaked.store.errors import InvalidArgument
from mooncaked.store.hints import Hint
from mooncaked.store.owner_index import IndexView
from mooncaked.store.owner_link import REWRITTEN, SCRATCH_MAX_BYTES, OwnerLinks, OwnerRead
from mooncaked.store.owner_wire import NOT_HELD, SERVED
from mooncaked.store.records import checksum
from mooncaked.transfer import TransferEngine, TransferError, TransferOp
from mooncaked.transfer.api import TransferTimeoutError
from mooncaked.transfer.deadlines import read_deadline

logger = logging.getLogger(__name__)

PIPELINE_GROUP = 4  # objects per group of a pipelined read: small enough to overlap, big enough to stripe
REGISTER_PER_READ = ("tcp", "shm", "auto")  # registering is a table entry there; rdma pins memory (too dear per read)
EARLY_GRACE_S = 0.05  # how long an early read toward an owner the lookup does not name may still land
STALLED_FOR_S = 3.0  # an owner whose read timed out is not read from this long
_into_names = itertools.count()


@dataclass(slots=True)
class Landing:
    """Where one object's bytes are read to: the staging area at `offset`, or (region not staging) the
    caller's own tensor registered under `region`. `view` is those bytes."""

    region: str
    offset: int
    view: memoryview | bytes


@dataclass(slots=True)
class GetCall:
    """One get's results: `out` for bytes gets, `outs` for gets into tensors; `got` for both."""

    keys: Sequence[str]
    index: dict[str, int]
    got: list[bool]
    out: list[bytes | None] | None = None
    outs: Sequence[torch.Tensor] | None = None


class Reader:
    """Moves the bytes of a StoreClient's gets (the client asks the master; this reads and checks)."""

    def __init__(self, transfer: TransferEngine, staging: Staging, timeout_s: float,
                 remove: Callable[[list[str]], Awaitable[int]], owners: OwnerLinks | None = None) -> None:
        self.owners = owners  # reads by key from the owners (None: off)
        self.transfer = transfer
        self.staging = staging
        self.timeout_s = timeout_s
        self._remove = remove
        self._stalled_until: dict[str, float] = {}  # owner's transfer address -> loop time it is skipped until

    # -- deadlines ----------------------------------------------------------------------------------
    def deadline(self, nbytes: int) -> float:
        """How long a read of `nbytes` from one copy may take before it is given up."""
        return read_deadline(nbytes, self.timeout_s)

    def live(self, address: str) -> bool:
        """Whether an owner is read from (not skipped after a read from it timed out)."""
        return asyncio.get_running_loop().time() >= self._stalled_until.get(address, 0.0)

    async def _read_from(self, peer: str, ops: list[TransferOp], what: str, level: int = logging.WARNING) -> bool:
        """Read from one owner within the deadline its bytes allow; False when that failed (logged at
        `level`), and an owner that timed out is skipped for STALLED_FOR_S."""
        try:
            await self.transfer.submit(ops, timeout_s=self.deadline(sum(op.length for op in ops)))
            return True
        except TransferError as e:
            logger.log(level, "store get: %s of %d objects from %s failed (%s)", what, len(ops), peer, e)
            if isinstance(e, TransferTimeoutError):
                if self.live(peer):
                    logger.warning("store reads from %s timed out; reading other copies (or computing) for %gs",
                                   peer, STALLED_FOR_S)
                self._stalled_until[peer] = asyncio.get_running_loop().time() + STALLED_FOR_S
            return False

    # -- early copies -------------------------------------------------------------------------------
    async def start_early(self, call: GetCall, hinted: list[tuple[str, Hint]],
                          stack: AsyncExitStack) -> Early:
        """Start reading the hinted objects from their last-seen places (the lookup is in flight)."""
        early = Early()
        rest: list[tuple[str, Hint]] = []
        for key, h in hinted:
            if not self.live(h.address):  # its owner timed out lately: the lookup decides
                continue
            data = None
            if call.out is not None:  # bytes wanted: a copy shared memory reaches comes back as bytes
                try:
                    data = await self.transfer.read_bytes(h.address, h.region, h.offset, h.size, self.deadline(h.size))
                except TransferError as e:  # the holder is gone, or its region changed: the lookup decides
                    logger.debug("store get of %s: no early copy from its last place (%s)", key, e)
                    continue
            if data is not None:
                early.copies[key] = (h, Landing("", 0, data))
            else:
                rest.append((key, h))
        if not rest:
            return early
        staged = [j for j, (k, h) in enumerate(rest) if self._in_place(call, k, h.size) is None]
        fit = {staged[j] for j in self._fitting([rest[i][1].size for i in staged])}
        rest = [r for j, r in enumerate(rest) if j in fit or j not in staged]  # the others wait for the lookup
        landings = await self.landings(call, [k for k, _ in rest], [h.size for _, h in rest], stack)
        by_peer: dict[str, list[tuple[str, Hint, Landing]]] = {}
        for (key, h), landing in zip(rest, landings):
            by_peer.setdefault(h.address, []).append((key, h, landing))
        for address, items in by_peer.items():  # per owner, in groups: each is checked as soon as it lands
            for s in range(0, len(items), PIPELINE_GROUP):
                group = items[s:s + PIPELINE_GROUP]
                ops = [TransferOp("read", ld.region, ld.offset, h.address, h.region, h.offset, h.size)
                       for _, h, ld in group]
                # a stale hint fails as a matter of course: only logged for debugging
                read = self._read_from(address, ops, "early copy", logging.DEBUG)
                early.reads.append((address, group, asyncio.ensure_future(read)))
        stack.push_async_callback(early.settle)  # nothing lands in a landing after it is given back
        return early

    async def keep_early(self, call: GetCall, objs: list, early: Early) -> list:
        """Serve the objects whose early copy hashes to the checksum the master just answered (those
        are the committed bytes); returns the others, to read from the master's answer. A copy that
        does not match is stale (its place was reused), not corrupt: it is dropped, not counted."""
        by_key = {o.key: o for o in objs}
        named = {r.endpoint.address for o in objs for r in o.replicas}
        served: set[str] = set()
        for key, (h, landing) in early.copies.items():  # copied out of shared memory already
            self._keep(call, by_key.get(key), h, landing, served)
        for address, items, task in early.reads:
            if address in named or task.done():
                ok = await task  # an owner the master names as live: it answers within the transfer deadline
            else:  # the master did not name it: maybe dead or stalled; a live one answers within the grace
                await asyncio.wait([task], timeout=EARLY_GRACE_S)
                ok = task.done() and task.result()
                await settle([task])
            if ok:
                for key, h, landing in items:
                    self._keep(call, by_key.get(key), h, landing, served)
        return [o for o in objs if o.key not in served]

    def _keep(self, call: GetCall, o: store_pb2.ObjectReplicas | None, h: Hint, landing: Landing,
              served: set[str]) -> None:
        """Hand an early copy over if the master answered its key with the checksum it hashes to."""
        if o is None:  # the master does not know the key (any more): a miss, whatever the copy holds
            return
        if h.size == o.size and checksum(landing.view) == o.checksum:
            self.hand_over(call, o, landing)
            served.add(o.key)
            metrics.hinted_read("used").inc()
        else:
            metrics.hinted_read("stale").inc()

    # -- reads the owner's shared-memory index vouches for (owner_index.py) ---------------------------
    async def from_index(self, call: GetCall, vouched: list[tuple[str, Hint, IndexView, tuple[int, int]]]) -> set[str]:
        """Copy objects an owner on this host lists in its index, as last seen: served when the bytes hash
        to the checksum and the entry is unchanged after the copy, with the owner's window still open.
        Returns the keys served; the others take the master's path."""
        served: set[str] = set()
        async with AsyncExitStack() as stack:
            early = await self.start_early(call, [(k, h) for k, h, _, _ in vouched], stack)
            landed = dict(early.copies)
            for _, items, task in early.reads:  # shared memory: each is a copy, done at once
                if await task:
                    landed.update((key, (h, landing)) for key, h, landing in items)
            for key, h, view, (slot, seq) in vouched:
                got = landed.get(key)
                if got is None or checksum(got[1].view) != h.checksum or not view.still(slot, seq):
                    continue
                if self.hand_over(call, h, got[1], key):
                    view.touch(slot)
                    served.add(key)
        metrics.owner_get("index").inc(len(served))
        return served

    # -- reads by key from the owners -------------------------------------------------------------
    def _into_new_bytes(self, call: GetCall, size: int) -> bool:
        """Whether an owner's answer lands in the new bytes object the get returns (OwnerLinks.read with no
        `into`): when the caller wants bytes, up to the size such a read takes. No staging is used, but
        the limit is every get's (an object over the staging area is refused, whichever path it takes)."""
        return call.out is not None and size <= SCRATCH_MAX_BYTES and self.staging.fits([size])

    async def from_owners(self, call: GetCall, picked: list[tuple[str, Hint]]) -> tuple[set[str], set[str]]:
        """Ask each object's owner for it by key, with the size and checksum last seen (owner_server.py):
        one round trip, no master. Returns the keys served (their bytes checked) and the keys whose
        owner no longer holds them as last seen (their hints are stale); the rest go to the master.

        Where: an object wanted as bytes lands in the new bytes object returned, hashed as it lands
        (as a single get's: no staging, no copy); one wanted in a contiguous CPU tensor, in the tensor;
        any other in the staging area."""
        assert self.owners is not None
        staged = [j for j, (k, h) in enumerate(picked)
                  if not self._into_new_bytes(call, h.size) and self._in_place(call, k, h.size) is None]
        fit = {staged[j] for j in self._fitting([picked[i][1].size for i in staged])}
        picked = [p for j, p in enumerate(picked) if j in fit or j not in staged]
        served: set[str] = set()
        gone: set[str] = set()
        if not picked:
            return served, gone
        async with AsyncExitStack() as stack:
            landed = [j for j, (_, h) in enumerate(picked) if not self._into_new_bytes(call, h.size)]
            landings = dict(zip(landed, await self.landings(call, [picked[j][0] for j in landed],
                                                            [picked[j][1].size for j in landed], stack, register=False)))
            by_owner: dict[str, list[int]] = {}
            for j, (_, h) in enumerate(picked):
                by_owner.setdefault(h.key_server, []).append(j)
            addresses = list(by_owner)
            asks = [self.owners.read(a, [OwnerRead(picked[j][0], picked[j][1].size, picked[j][1].checksum,
                                                   landings[j].view if j in landings else None)  # type: ignore[arg-type]
                                         for j in by_owner[a]]) for a in addresses]
            results: list[list[int | bytes] | BaseException]
            if len(asks) == 1:  # the usual case: no task (a task costs a turn of the loop to start and to end)
                try:
                    results = [await asks[0]]
                except TransferError as e:
                    results = [e]
            else:
                tasks = [asyncio.ensure_future(a) for a in asks]
                try:
                    results = await asyncio.gather(*tasks, return_exceptions=True)
                finally:  # cancelled: the links drop what is still in flight before the landings go back
                    await settle(tasks)
            for a, statuses in zip(addresses, results):
                if isinstance(statuses, BaseException):
                    if not isinstance(statuses, TransferError):
                        raise statuses
                    logger.debug("store get: owner %s not asked by key (%s)", a, statuses)
                    continue
                for j, status in zip(by_owner[a], statuses):
                    key, h = picked[j]
                    if type(status) is bytes:  # landed in new bytes and matched the checksum as it landed
                        if self.hand_over(call, h, Landing("", 0, status), key):
                            served.add(key)
                    elif status in (NOT_HELD, REWRITTEN):
                        gone.add(key)
                    elif status == SERVED:
                        if checksum(landings[j].view) == h.checksum:
                            if self.hand_over(call, h, landings[j], key):
                                served.add(key)
                        else:  # its place was rewritten while the owner sent it: the master decides
                            gone.add(key)
        metrics.owner_get("fallback").inc(len(picked) - len(served))
        metrics.owner_get("hit").inc(len(served))
        return served, gone

    async def one_from_owner(self, key: str, h: Hint) -> tuple[bytes | None, bool]:
        """from_owners for one object wanted as bytes, with no more than it needs (a single get's
        path: no staging, owner_link.read_bytes): its bytes, or None and whether its owner no longer
        holds it as last seen."""
        assert self.owners is not None
        try:
            got = await self.owners.read_bytes(h.key_server, key, h.size, h.checksum)
        except TransferError as e:
            logger.debug("store get: owner %s not asked by key (%s)", h.key_server, e)
            got = -1
        if type(got) is bytes:
            metrics.owner_get("hit").inc()
            metrics.client_bytes("get").inc(h.size)
            return got, False
        metrics.owner_get("fallback").inc()
        return None, got in (REWRITTEN, NOT_HELD)  # the hint is stale

    # -- reads from the master's answer ----------------------------------------------------------
    async def read_direct(self, call: GetCall, objs: list) -> list:
        """Read what shared memory reaches straight into `call.out`; returns the objects left."""
        left, corrupt = [], []
        for o in objs:
            rep = o.replicas[0]
            try:
                data = await self.transfer.read_bytes(rep.endpoint.address, rep.endpoint.region, rep.offset, o.size,
                                                      self.deadline(o.size))
            except TransferError as e:
                logger.info("store get of %s: shared-memory read failed (%s); reading through staging", o.key, e)
                data = None
            if data is None:
                left.append(o)
            elif self.intact(o, data):
                self.hand_over(call, o, Landing("", 0, data))
            else:
                corrupt.append(o.key)
        if corrupt:
            await self._remove(corrupt)
        return left

    async def read(self, call: GetCall, objs: list) -> None:
        """Read objects in staging-sized chunks; in each, groups of PIPELINE_GROUP all in flight,
        each checked and handed over as soon as it lands."""
        in_place = [o for o in objs if self._in_place(call, o.key, o.size) is not None]
        staged = [o for o in objs if self._in_place(call, o.key, o.size) is None]
        pieces = [in_place] if in_place else []  # read into the caller's tensors: no staging room needed
        pieces += [[staged[j] for j in c] for c in chunks(self.staging, [o.size for o in staged])]
        for chunk_objs in pieces:
            corrupt: list[str] = []
            async with AsyncExitStack() as stack:
                landings = await self.landings(call, [o.key for o in chunk_objs], [o.size for o in chunk_objs], stack)
                groups = [list(range(s, min(s + PIPELINE_GROUP, len(chunk_objs))))
                          for s in range(0, len(chunk_objs), PIPELINE_GROUP)]
                if len(groups) == 1:
                    done = [await self._read_group(chunk_objs, landings, groups[0])]
                    self._check(call, chunk_objs, landings, done[0], corrupt)
                else:
                    tasks = [asyncio.ensure_future(self._read_group(chunk_objs, landings, g)) for g in groups]
                    try:
                        for task in tasks:
                            self._check(call, chunk_objs, landings, await task, corrupt)
                    finally:  # cancelled: nothing may land in a landing once it is given back
                        await settle(tasks)
            if corrupt:
                await self._remove(corrupt)

    async def _read_group(self, objs: list, landings: list[Landing], group: list[int]) -> list[int]:
        """Read a group from each object's first live copy, each owner's part on its own (one stalled
        owner fails only its objects); a failed read is retried once on the object's next live copy.
        Returns the objects read (one with no live copy left is a miss)."""
        todo, read = group, []
        last: dict[int, int] = {}  # object -> the index of the copy read last
        for _ in range(2):
            by_peer: dict[str, list[int]] = {}
            ops: dict[int, TransferOp] = {}
            for j in todo:
                reps = objs[j].replicas
                k = next((i for i in range(last.get(j, -1) + 1, len(reps)) if self.live(reps[i].endpoint.address)),
                         None)
                if k is not None:
                    last[j], rep = k, reps[k]
                    ops[j] = TransferOp("read", landings[j].region, landings[j].offset, rep.endpoint.address,
                                        rep.endpoint.region, rep.offset, objs[j].size)
                    by_peer.setdefault(rep.endpoint.address, []).append(j)
            if not by_peer:
                break
            peers = list(by_peer)
            parts = [self._read_from(p, [ops[j] for j in by_peer[p]], "read") for p in peers]
            if len(parts) == 1:  # the usual case: no task
                oks = [await parts[0]]
            else:
                tasks = [asyncio.ensure_future(x) for x in parts]
                try:
                    oks = await asyncio.gather(*tasks)
                finally:  # cancelled: nothing may land in a landing once it is given back
                    await settle(tasks)
            todo = []
            for p, ok in zip(peers, oks):
                (read if ok else todo).extend(by_peer[p])
            if not todo:
                break
        return read

    def _check(self, call: GetCall, objs: list, landings: list[Landing], done: list[int], corrupt: list[str]) -> None:
        for j in done:
            o = objs[j]
            if self.intact(o, landings[j].view):
                self.hand_over(call, o, landings[j])
            else:
                corrupt.append(o.key)

    # -- landings and hand-over -----------------------------------------------------------------
    async def landings(self, call: GetCall, keys: Sequence[str], sizes: Sequence[int],
                       stack: AsyncExitStack, register: bool = True) -> list[Landing]:
        """Where each object is read to: a caller's contiguous CPU tensor of the right size (registered
        with the transfer engine until `stack` closes, unless `register` is False: owner reads land
        through a memoryview), else the staging area (leased until `stack` closes)."""
        landings: list[Landing | None] = [None] * len(keys)
        staged = []
        for j, (key, size) in enumerate(zip(keys, sizes)):
            t = self._in_place(call, key, size)
            if t is not None:
                view = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
                if not register:
                    landings[j] = Landing("", 0, view)
                    continue
                name = f"store-into-{next(_into_names)}"
                info = self.transfer.register(name, t)
                stack.callback(self._unregister, name)
                landings[j] = Landing(info.name, 0, view)
            else:
                staged.append(j)
        if staged:
            offsets = await stack.enter_async_context(self.staging.lease([sizes[j] for j in staged]))
            for j, off in zip(staged, offsets):
                landings[j] = Landing(STAGING_REGION, off, self.staging.slice(off, sizes[j]))
        return landings  # type: ignore[return-value]

    def _in_place(self, call: GetCall, key: str, size: int) -> torch.Tensor | None:
        """The caller's tensor for `key` when the read can land in it directly."""
        t = call.outs[call.index[key]] if call.outs is not None else None
        if (t is not None and self.transfer.backend in REGISTER_PER_READ and t.device.type == "cpu"
                and t.is_contiguous() and nbytes_of(t) == size):
            return t
        return None

    def _fitting(self, sizes: Sequence[int]) -> list[int]:
        """The leading objects whose early copies fit the staging area at once (the lookup is not held up)."""
        taken: list[int] = []
        for j, size in enumerate(sizes):
            if not self.staging.fits([*(sizes[i] for i in taken), size]):
                break
            taken.append(j)
        return taken

    def _unregister(self, name: str) -> None:
        try:
            self.transfer.unregister(name)
        except TransferError:  # the engine closed meanwhile
            pass

    @staticmethod
    def intact(obj: store_pb2.ObjectReplicas, data: object) -> bool:
        """Whether bytes read match the object's checksum (a mismatch is logged and counted)."""
        if checksum(data) == obj.checksum:
            return True
        metrics.CHECKSUM_FAILURES.labels(obj.replicas[0].medium or "dram").inc()
        logger.error("store object %s failed its checksum after a read; dropping it (a miss)", obj.key)
        return False

    def hand_over(self, call: GetCall, o: store_pb2.ObjectReplicas | Hint, landing: Landing, key: str = "") -> bool:
        """A checked object's bytes into a get's results (`key` when `o` is a hint); False if they do not fit."""
        key = key or o.key  # type: ignore[union-attr]
        i = call.index[key]
        if call.out is not None:
            call.out[i] = landing.view if isinstance(landing.view, bytes) else bytes(landing.view)
        elif call.outs is not None and landing.region == STAGING_REGION:
            t = call.outs[i]
            if nbytes_of(t) != o.size:
                logger.warning("store object %s has %d bytes but its output tensor %d; treating it as a miss",
                               key, o.size, nbytes_of(t))
                return False
            self.staging.unstage(landing.offset, t)
        call.got[i] = True
        metrics.client_bytes("get").inc(o.size)
        return True


class Early:
    """A get's early copies: done ones by key (with the hint they were read from), and reads in flight
    per owner address."""

    def __init__(self) -> None:
        self.copies: dict[str, tuple[Hint, Landing]] = {}
        self.reads: list[tuple[str, list[tuple[str, Hint, Landing]], asyncio.Future[bool]]] = []

    async def settle(self) -> None:
        """Stop what is still in flight (its connection is dropped) before the landings are given back."""
        await settle([t for _, _, t in self.reads])


async def settle(tasks: Sequence[asyncio.Future]) -> None:
    """Cancel what is still running and wait until it has stopped (the transfer engine drops a
    connection whose answer would land in, or whose request reads, memory given back)."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def chunks(staging: Staging, sizes: Sequence[int]) -> list[list[int]]:
    """Indices grouped so each group fits the staging area."""
    groups: list[list[int]] = [[]]
    for i, size in enumerate(sizes):
        if size <= 0:
            raise InvalidArgument(f"object {i} of the batch is empty: store only non-empty objects")
        if not staging.fits([size]):
            raise InvalidArgument(f"an object of {size} bytes exceeds the {staging.nbytes}-byte staging "
                                  "area; raise staging_bytes")
        if not staging.fits([sizes[j] for j in groups[-1]] + [size]):
            groups.append([])
        groups[-1].append(i)
    return [g for g in groups if g]
