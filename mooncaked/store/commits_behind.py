"""Single puts whose commit overlaps the next put's transfer (StoreClientConfig.commit_behind).

A put's commit may name only bytes that have landed, so a put is a write round trip and then a
commit round trip. With commit_behind, put() returns once its bytes are in place and its commit is
on the wire (on the master's fast path, ahead of any later call of this client: its own gets and
exists see the object), and the commit's answer is collected here while the next put's bytes move.
What was guaranteed stays so (nothing half-written is ever visible: the commit still follows the
write), but put() no longer says the master took the object: a commit it refuses (its place lapsed,
or the master restarted) is logged, counted (`put`, `lost`) and returned by `flush()`.
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

    def __len__(self) -> int:
        return sum(not t.done() for t in self._tasks)

    async def add(self, key: str, reply: Awaitable[store_pb2.BatchPutEndReply], settled: Callable[[bool], None]) -> None:
        """Collect `reply` in the background; `settled(committed)` runs once it came (or failed)."""
        self._tasks.append(asyncio.ensure_future(self._settle(key, reply, settled)))
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
