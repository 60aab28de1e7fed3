"""Noticing that the store master was lost and replaced, so that a writer's last puts are not forgotten.

recent_writes.py keeps a client's last puts on other clients' DRAM: a master lost before its journal
batch reached their owner leaves the writer the only one who knows them. A client that lends DRAM
learns of a new master when its ping finds one and remounts; one that lends nothing never pings, and
used to learn nothing (a master restarted within 10 ms of a put lost that object, and a restart that
took longer than KEEP_S let the records age out first). So every client does this: from the moment
the master is suspected lost (its fast path broke, a call found it unavailable, a ping failed), the
records stop ageing, and the master is asked who it is (Describe) every interval until one answers.
A new epoch (a restart, a new leader): the writes are re-reported to it. The same one: it lost
nothing (its journal goes out as usual), and the records age again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mooncaked.store.master_link import MasterLink
from mooncaked.store.recent_writes import RecentWrites
from mooncaked.tasks import spawn

logger = logging.getLogger(__name__)


class MasterWatch:
    """Watches for a new master while `recent` holds writes the old one may not have journaled.

    `epoch()` is the master epoch the client follows now; `report()` re-reports the recent writes
    (and returns once they are taken, refused, or given up on)."""

    def __init__(self, link: MasterLink, recent: RecentWrites, epoch: Callable[[], int],
                 report: Callable[[], Awaitable[None]], client_id: str, interval_s: float, timeout_s: float) -> None:
        self.link = link
        self.recent = recent
        self.epoch = epoch
        self.report = report
        self.client_id = client_id
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    @property
    def watching(self) -> bool:
        return self._task is not None and not self._task.done()

    def suspect(self) -> None:
        """The master may be gone: hold the recent writes and find out (once at a time)."""
        if self.watching or not len(self.recent):
            return
        self.recent.freeze()
        self._task = spawn(self._watch(self.epoch()), f"store-watch-{self.client_id}")

    async def _watch(self, before: int) -> None:
        try:
            while True:
                try:
                    _, reply = await self.link.describe(self.timeout_s)
                    break
                except Exception as e:  # noqa: BLE001 - down, restarting, no leader yet: ask again
                    logger.debug("store client %s: the master does not answer yet (%s)", self.client_id, e)
                    await asyncio.sleep(self.interval_s)
            if reply.master_epoch != before:
                logger.info("store client %s: a new store master (epoch %d, was %d); re-reporting %d recent writes",
                            self.client_id, reply.master_epoch, before, len(self.recent))
                await self.report()
        finally:
            self.recent.thaw()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


__all__ = ["MasterWatch"]
