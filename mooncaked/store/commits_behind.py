"""Single puts whose commit overlaps the next put's transfer (StoreClientConfig.commit_behind).

A put's commit may name only bytes that have landed, so a put is a write round trip and then a
commit round trip. With commit_behind, put() returns once its bytes are in place and its commit is
on the wire (on the master's fast path, ahead of any later call of this client: its own gets and
exists see the object), and the commit's answer is collected here while the next put's bytes move.
What was guaranteed stays so (nothing half-written is ever visible: the commit still follows the
write), but put() no longer says the master took the object: a commit it refuses (its place lapsed,
or the master restarted) is logged, counted (`put`, `lost`) and returned by `flush()`.

A put of immutable bytes goes further (`add_landing`): it returns once they are handed to the data
plane, and the owner's acknowledgement is awaited here too; its commit is sent when every copy
acknowledged, and never before the commits of the puts made before it. A write that fails then is
lost the same way. Until its commit is on the wire, the client's other calls wait (`sent()`), so
they still see every put that returned before them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store.errors import StoreError

logger = logging.getLogger(__name__)

MAX_BEHIND = 64  # commits in flight at most; the next put waits for the oldest beyond this


class CommitsBehind:
    def __init__(self, limit: int = MAX_BEHIND) -> None:
        self.limit = limit
        self._tasks: deque[asyncio.Task[None]] = deque()
        self._lost: list[str] = []
        self._last_sent: asyncio.Future[None] | None = None  # done once the latest landing put's commit is sent

    def __len__(self) -> int:
        return sum(not t.done() for t in self._tasks)

    async def add(self, key: str, reply: Awaitable[store_pb2.BatchPutEndReply], settled: Callable[[bool], None]) -> None:
        """Collect `reply` in the background; `settled(committed)` runs once it came (or failed)."""
        await self._keep(asyncio.ensure_future(self._settle(key, reply, settled)))

    async def add_landing(self, key: str, acks: list[Awaitable[object]],
                          commit: Callable[[], Awaitable[Awaitable[store_pb2.BatchPutEndReply]]],
                          settled: Callable[[bool], None], failed: Callable[[BaseException], Awaitable[None]]) -> None:
        """A put whose bytes may still be landing: `commit()` is awaited (it sends the commit and gives its
        reply's awaitable) once every ack came and the puts before it sent theirs; `failed(error)` instead
        when a write failed."""
        if (self._last_sent is None or self._last_sent.done()) and all(_went_well(a) for a in acks):
            await self.add(key, await commit(), settled)  # nothing to wait for: sent now, as a plain commit behind
            return
        before, sent = self._last_sent, asyncio.get_running_loop().create_future()
        self._last_sent = sent
        task = asyncio.ensure_future(self._land(key, acks, before, sent, commit, settled, failed))
        task.add_done_callback(lambda _: sent.done() or sent.set_result(None))  # even if cancelled before it ran
        await self._keep(task)
        # one turn of the loop: a caller putting back to back would otherwise never let it read the acks
        # that came, send the commits they free, or top the places up, until it runs out of something
        await asyncio.sleep(0)

    async def _land(self, key: str, acks: list[Awaitable[object]], before: asyncio.Future[None] | None,
                    sent: asyncio.Future[None], commit: Callable[[], Awaitable[Awaitable[store_pb2.BatchPutEndReply]]],
                    settled: Callable[[bool], None], failed: Callable[[BaseException], Awaitable[None]]) -> None:
        reply = None
        error: BaseException | None = None
        try:
            for ack in acks:  # every one, even after an error: nothing may still land once the place is back
                try:
                    await ack
                except Exception as e:  # noqa: BLE001 - the write's error, whatever its type, loses the put
                    error = error or e
            if before is not None:
                await before
            if error is None:
                try:
                    reply = await commit()
                except StoreError as e:  # no way to the master now
                    error = e
        finally:
            if not sent.done():
                sent.set_result(None)
        if reply is None:
            assert error is not None
            self._lost.append(key)
            await failed(error)
            return
        await self._settle(key, reply, settled)

    async def sent(self) -> None:
        """Wait until every landing put's commit is on the wire: a call made after this sees them all."""
        last = self._last_sent
        if last is not None and not last.done():
            await asyncio.shield(last)

    async def _keep(self, task: asyncio.Task[None]) -> None:
        self._tasks.append(task)
        while self._tasks and self._tasks[0].done():
            self._tasks.popleft()
        if len(self._tasks) > self.limit:
            await self._tasks.popleft()

    async def _settle(self, key: str, reply: Awaitable[store_pb2.BatchPutEndReply],
                      settled: Callable[[bool], None]) -> None:
        try:
            r = await reply
            ok = bool(r.reserved_ok) and r.reserved_ok[0]
            why = "the master did not know its place (it restarted, or the place lapsed)"
        except StoreError as e:
            ok, why = False, str(e)
        if not ok:
            logger.warning("store put of %s: its commit failed after put() returned (%s); it is not stored", key, why)
            self._lost.append(key)
        settled(ok)

    async def flush(self) -> list[str]:
        """Wait for every commit in flight; the keys whose commit failed since the last flush."""
        while self._tasks:
            await self._tasks.popleft()
        lost, self._lost = self._lost, []
        return lost


def _went_well(ack: Awaitable[object]) -> bool:
    """An acknowledgement already in, without an error."""
    return isinstance(ack, asyncio.Future) and ack.done() and not ack.cancelled() and ack.exception() is None
