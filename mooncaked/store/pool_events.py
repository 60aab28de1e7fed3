"""Fan-out of the master's pool events to `WatchPool` subscribers (prefix indexes: the conductor).

The state machine reports each change through `hooks.pool_event`, on the hot put/get path,
so `add` only appends the keys to the current run (consecutive keys of one kind and medium)
and, for the first one, schedules a flush; with nobody subscribed it does nothing. A flush,
`FLUSH_S` later, turns the runs into `PoolEvents` messages (per key prefix, split so no
message is huge) and queues them for each subscriber: one message per subscriber per flush
however many puts and evictions happened meanwhile.

Queues are bounded: a subscriber `max_queued` messages behind is cut off with a logged
reason; it resubscribes and starts over from a fresh snapshot, so a stuck reader never makes
the master buffer without bound. A new subscriber's snapshot is taken at the instant it joins
(after flushing what is pending to the others), so it sees every later event exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store import metrics
from mooncaked.store.records import PoolEventKind

if TYPE_CHECKING:
    from mooncaked.store.master import StoreMaster

logger = logging.getLogger(__name__)

FLUSH_S = 0.02
"""Events are batched this long before they go out (the conductor learns of a put ~20 ms later)."""
MAX_QUEUED = 1000
"""Messages a subscriber may lag behind (~20 s of flushes) before it is cut off."""
MAX_KEYS_PER_MESSAGE = 8192
"""Keys per message, so a snapshot of millions of objects streams in pieces of ~0.3 MB."""

_KINDS = {"stored": store_pb2.PoolEvent.KIND_STORED, "removed": store_pb2.PoolEvent.KIND_REMOVED}


@dataclass(eq=False)
class Subscriber:
    """One WatchPool stream: its key filter and the messages waiting for it (None ends the stream)."""

    peer: str
    prefix: str
    queue: asyncio.Queue[store_pb2.PoolEvents | None] = field(default_factory=asyncio.Queue)
    dropped: str = ""  # why the hub cut it off ("" while it is subscribed or ended normally)


class PoolEventHub:
    """The service's half of the `pool_event` hook: batches events and fans them out."""

    def __init__(self, master: StoreMaster, flush_s: float = FLUSH_S, max_queued: int = MAX_QUEUED,
                 max_keys: int = MAX_KEYS_PER_MESSAGE) -> None:
        self._master = master
        self._flush_s = flush_s
        self._max_queued = max_queued
        self._max_keys = max_keys
        self._subs: list[Subscriber] = []
        self._runs: list[tuple[PoolEventKind, str, list[str]]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def add(self, kind: PoolEventKind, keys: Sequence[str], medium: str) -> None:
        """Record events (cheap: an append); they go out at the next flush."""
        if not self._subs:
            return
        if self._runs and self._runs[-1][0] == kind and self._runs[-1][1] == medium:
            self._runs[-1][2].extend(keys)
        else:
            self._runs.append((kind, medium, list(keys)))
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self._flush_s, self.flush)
            except RuntimeError:  # no loop (a master driven by hand): deliver now
                self.flush()

    def flush(self) -> None:
        """Queue what was recorded since the last flush for every subscriber."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        runs, self._runs = self._runs, []
        if not runs:
            return
        built: dict[str, list[store_pb2.PoolEvents]] = {}
        for sub in list(self._subs):
            msgs = built.get(sub.prefix)
            if msgs is None:
                msgs = built[sub.prefix] = list(self._messages(runs, sub.prefix))
            if sub.queue.qsize() + len(msgs) > self._max_queued:
                self._drop(sub, f"it fell {sub.queue.qsize()} messages behind (at most {self._max_queued} wait)")
                continue
            for msg in msgs:
                sub.queue.put_nowait(msg)
                for e in msg.events:
                    metrics.POOL_EVENTS.labels("stored" if e.kind == store_pb2.PoolEvent.KIND_STORED
                                               else "removed").inc(len(e.keys))

    def subscribe(self, prefix: str, peer: str) -> tuple[Subscriber, Iterator[store_pb2.PoolEvents]]:
        """Join: the snapshot (as of now, built lazily while it is sent) and the queue of what follows."""
        self.flush()  # pending events are the others' news; the newcomer's snapshot already holds them
        objects = self._master.objects
        dram = [k for k, o in objects.items() if o.medium == "dram" and k.startswith(prefix)]
        lmdb = [k for k, o in objects.items() if o.medium == "lmdb" and k.startswith(prefix)]
        sub = Subscriber(peer, prefix)
        self._subs.append(sub)
        metrics.POOL_WATCHERS.set(len(self._subs))
        logger.info("pool watcher %s subscribed (prefix %r): snapshot of %d objects in DRAM, %d on LMDB only",
                    peer, prefix, len(dram), len(lmdb))
        return sub, self._snapshot(dram, lmdb)

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            metrics.POOL_WATCHERS.set(len(self._subs))
            logger.info("pool watcher %s left", sub.peer)

    def close(self) -> None:
        """End every stream (the master is stopping); watchers reconnect to its successor."""
        self.flush()
        for sub in self._subs:
            sub.queue.put_nowait(None)
        self._subs.clear()
        metrics.POOL_WATCHERS.set(0)

    def _drop(self, sub: Subscriber, why: str) -> None:
        logger.warning("cutting off pool watcher %s: %s; it resubscribes for a fresh snapshot", sub.peer, why)
        metrics.POOL_WATCHERS_DROPPED.inc()
        self.unsubscribe(sub)
        sub.dropped = why
        while not sub.queue.empty():  # what it has not read is moot: it starts over from a snapshot
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    def _snapshot(self, dram: list[str], lmdb: list[str]) -> Iterator[store_pb2.PoolEvents]:
        epoch = self._master.epoch
        yield from self._messages([("stored", "dram", dram), ("stored", "lmdb", lmdb)], "")
        yield store_pb2.PoolEvents(snapshot_done=True, master_epoch=epoch)

    def _messages(self, runs: Sequence[tuple[PoolEventKind, str, list[str]]],
                  prefix: str) -> Iterator[store_pb2.PoolEvents]:
        """The runs' keys under `prefix`, in order, at most `max_keys` per message."""
        epoch = self._master.epoch
        events: list[store_pb2.PoolEvent] = []
        n = 0
        for kind, medium, keys in runs:
            if prefix:
                keys = [k for k in keys if k.startswith(prefix)]
            start = 0
            while start < len(keys):
                take = min(len(keys) - start, self._max_keys - n)
                events.append(store_pb2.PoolEvent(kind=_KINDS[kind], keys=keys[start:start + take], medium=medium))
                n += take
                start += take
                if n >= self._max_keys:
                    yield store_pb2.PoolEvents(events=events, master_epoch=epoch)
                    events, n = [], 0
        if events:
            yield store_pb2.PoolEvents(events=events, master_epoch=epoch)
