"""Keeps the prefix index's pool holder (`POOL_HOLDER`) equal to what the Mooncake Store holds.

The store master is the one source of truth about the pool, so the conductor follows its
`WatchPool` stream rather than hearing of pool blocks from the engines that wrote them (who
never learn of evictions, removals or a dead segment). The stream opens with a snapshot of
every committed object, then carries each change: stored (with the medium a reader finds it
on: "dram", or "lmdb", which the policies count as slow) or removed. Keys are
"model_id/block_hash"; other models' keys are ignored.

Losing the stream (master restart, network) drops the pool's blocks from the index: with
the master gone nobody can look them up, and a restarted master holds only what its
segments re-report. The watch resubscribes with backoff; the new snapshot is the whole truth.
Only the stream's own deadline (it is reopened every `STREAM_DEADLINE_S`, like every call
here it has one) keeps the blocks until the new snapshot replaces them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from mooncaked.conductor import metrics
from mooncaked.conductor.prefix_index import POOL_HOLDER, PrefixIndex
from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.rpc import CHANNEL_OPTIONS, RECONNECT_OPTIONS
from mooncaked.security import Security
from mooncaked.store.master_link import MasterLink

log = logging.getLogger(__name__)

STREAM_DEADLINE_S = 600.0
"""The stream is reopened (with a fresh snapshot) this often even when nothing broke."""
RETRY_S = 0.2
MAX_RETRY_S = 5.0
_STORED, _REMOVED = store_pb2.PoolEvent.KIND_STORED, store_pb2.PoolEvent.KIND_REMOVED


class PoolWatch:
    """`run()` forever (a background task); `close()` after cancelling it."""

    def __init__(self, store: str, model_id: str, index: PrefixIndex, *,
                 stream_deadline_s: float = STREAM_DEADLINE_S, retry_s: float = RETRY_S,
                 max_retry_s: float = MAX_RETRY_S, security: Security | None = None) -> None:
        self.store = store
        self.prefix = f"{model_id}/"
        self.index = index
        self.stream_deadline_s = stream_deadline_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        # one master: a plain stub; masters under HA (`etcd://...` or a list): the link follows the leader
        self.link = self.channel = MasterLink(store, security, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.stub = self.link.stub
        self._moved = asyncio.Event()  # a new leader: resubscribe now, not after the backoff
        self.link.on_change(lambda _address: self._moved.set())
        self.synced = False  # the current stream's snapshot is applied
        self.epoch = 0  # the master's, as of the last snapshot
        self.subscriptions = 0
        self.ignored_keys = 0  # keys not of the form "model_id/hash" for this model
        self._holding = False  # the index may hold pool blocks (something to drop on a loss)

    async def run(self) -> None:
        pause = self.retry_s
        failures = 0
        followed = False  # a master that is not up yet at start (`--role all` starts both at once) is no news
        while True:
            try:
                await self._follow()
                why, expected = "the master ended the stream (stopping?)", False
            except grpc.aio.AioRpcError as e:
                expected = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.synced
                why = f"{e.code().name}: {e.details()}"
            except Exception as e:  # noqa: BLE001 - a bug here must not end the watch; it is logged
                log.exception("pool watch on %s failed", self.store)
                why, expected = f"{type(e).__name__}: {e}", False
            if self.synced:
                pause, failures, followed = self.retry_s, 0, True
            dropped = self._lost(keep=expected)
            if expected:
                log.debug("pool event stream reached its %.0fs deadline; resubscribing", self.stream_deadline_s)
                continue
            failures += 1
            warn = failures == (1 if followed else 3)
            log.log(logging.WARNING if warn else logging.INFO,
                    "no pool events from store master %s (%s)%s; resubscribing in %.1fs (attempt %d)", self.store,
                    why, "; the pool's blocks left the prefix index" if dropped else "", pause, failures)
            try:  # a new leader (under HA) ends the wait
                await asyncio.wait_for(self._moved.wait(), pause)
                pause = self.retry_s
            except asyncio.TimeoutError:
                pause = min(2 * pause, self.max_retry_s)
            self._moved.clear()

    async def _follow(self) -> None:
        """One subscription: replace what the index holds for the pool by the snapshot, then follow."""
        call = self.stub.WatchPool(store_pb2.WatchPoolRequest(key_prefix=self.prefix), timeout=self.stream_deadline_s)
        self.subscriptions += 1
        first = True
        try:
            async for msg in call:
                if first:
                    self._drop()  # a fresh snapshot is the whole truth
                    first = False
                self.apply(msg)
                if msg.snapshot_done:
                    self.synced = True
                    self.epoch = msg.master_epoch
                    metrics.POOL_WATCH_UP.set(1)
                    log.info("following the pool at store master %s (epoch %d)", self.link.address or self.store,
                             msg.master_epoch)
        finally:
            call.cancel()

    def apply(self, msg: store_pb2.PoolEvents) -> None:
        """Apply one message's events to the index, in order."""
        for e in msg.events:
            hashes = self._hashes(e.keys)
            if not hashes:
                continue
            if e.kind == _STORED:  # where the pool holds them at best now: replaces what the index had
                self.index.stored(POOL_HOLDER, hashes, e.medium or "dram", replace=True)
                self._holding = True
                metrics.POOL_EVENTS.labels("stored").inc(len(hashes))
            elif e.kind == _REMOVED:  # gone from the pool (evicted, removed, its segment lost): every medium
                self.index.removed(POOL_HOLDER, hashes, e.medium)
                metrics.POOL_EVENTS.labels("removed").inc(len(hashes))
            else:
                log.warning("pool event of unknown kind %d for %d keys ignored", e.kind, len(hashes))

    def _hashes(self, keys: Iterable[str]) -> list[int]:
        """Block hashes of this model's keys ("model_id/123"); anything else is counted and skipped."""
        out = []
        n = len(self.prefix)
        for key in keys:
            tail = key[n:]
            if key.startswith(self.prefix) and tail.isascii() and tail.isdigit():
                out.append(int(tail))
            else:
                self.ignored_keys += 1
        return out

    def _lost(self, keep: bool) -> bool:
        """The stream ended; True when the pool's blocks were dropped from the index."""
        if self.synced:
            metrics.POOL_WATCH_LOSSES.inc()
        self.synced = False
        metrics.POOL_WATCH_UP.set(0)
        return False if keep else self._drop()

    def _drop(self) -> bool:
        if not self._holding:
            return False
        self.index.drop_instance(POOL_HOLDER)
        self._holding = False
        return True

    async def close(self) -> None:
        metrics.POOL_WATCH_UP.set(0)
        await self.channel.close()
