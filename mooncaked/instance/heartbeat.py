"""What an instance tells its conductors, as plain records (``conductor/engine_link.py``): each
heartbeat carries its load, its state, and the KV events and decode step times since the last; a
conductor that has just registered it gets a snapshot of every block it caches, so a conductor
started or restarted later knows the cache as well as one that saw every event.

Conductors side by side each keep the whole picture, so every one gets every KV event: the
instance's events are drained once per beat and fanned out (``HeartbeatFeed``), each conductor's
backlog kept until that conductor has acknowledged it. ``roles/membership.py`` only puts these
records on the wire, one loop per conductor.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mooncaked.conductor.engine_link import REMOVED, STORED, DecodeSample, Heartbeat, InstanceLoad, KVEvent
from mooncaked.instance.worker import Worker

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 100_000
MAX_DECODE_SAMPLES = 64  # per heartbeat: the cost model wants recent steps, not a long history
_MEDIUM = {"cpu": "dram"}  # where an instance's KV cache lives, by its device (anything else: GPU memory)

Snapshot = Callable[[], Awaitable[list[KVEvent]]]


def instance_load(worker: Worker) -> InstanceLoad:
    """The instance's load as its conductors see it: the engine's counters and its prefill queue."""
    s, queued = worker.load()
    return InstanceLoad(
        queued_prefill_tokens=queued, running_requests=s.num_running, waiting_requests=s.num_waiting,
        free_kv_blocks=s.num_free_blocks, total_kv_blocks=s.num_blocks, prefix_hit_blocks=s.prefix_hit_blocks,
        prefix_query_blocks=s.prefix_query_blocks, prefill_tokens_computed=s.prefill_tokens_computed,
        prompt_tokens_cached=s.prompt_tokens_cached, decode_tokens=s.decode_tokens,
        cached_kv_blocks=s.num_cached_blocks, preemptions=s.num_preemptions)


class InstanceHeartbeat:
    """One instance's heartbeats and cache snapshots."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.medium = _MEDIUM.get(worker.engine.runner.device.type, "hbm")

    def beat(self) -> Heartbeat:
        """Load and state as of now, and the KV events and decode step times since the last call."""
        engine = self.worker.engine
        events = [KVEvent(STORED if e.kind == "stored" else REMOVED, list(e.block_hashes), self.medium,
                          self.worker.name) for e in engine.block_manager.drain_events()]
        samples = [DecodeSample(r.decodes, r.decode_context, r.seconds)
                   for r in engine.drain_step_log() if r.decodes and not r.prefill_tokens]
        return Heartbeat(self.worker.name, instance_load(self.worker), self.worker.state(), events,
                         samples[-MAX_DECODE_SAMPLES:], self.worker.drain_seq)

    async def snapshot(self) -> list[KVEvent]:
        """Every block cached now, for a conductor that has just registered us (on the engine thread:
        the block manager is not thread-safe)."""
        engine = self.worker.engine
        hashes = await engine.call(engine.block_manager.cached_hashes)
        return [KVEvent(STORED, hashes, self.medium, self.worker.name)] if hashes else []


@dataclass
class Backlog:
    """What one conductor has not yet acknowledged. ``live`` while it knows us: an unregistered
    conductor collects nothing (it gets a snapshot when it registers us)."""

    conductor: str
    live: bool = False
    events: list[KVEvent] = field(default_factory=list)
    samples: list[DecodeSample] = field(default_factory=list)
    dropping: bool = False  # the bound was hit; said once until the backlog drains
    dropped: int = 0  # events dropped from the front, ever (so an acknowledgement counts only what is left)
    dropped_at_send: int = 0


class HeartbeatFeed:
    """The instance's heartbeat shared by its conductors: each pull drains the instance's new KV events
    and decode samples once and appends them to every live conductor's backlog."""

    def __init__(self, produce: Callable[[], Heartbeat], snapshot: Snapshot | None = None,
                 max_pending_events: int = MAX_PENDING_EVENTS) -> None:
        self._produce = produce
        self._snapshot = snapshot
        self.max_pending_events = max_pending_events
        self.backlogs: list[Backlog] = []

    def subscribe(self, conductor: str) -> Backlog:
        backlog = Backlog(conductor)
        self.backlogs.append(backlog)
        return backlog

    def _pull(self) -> Heartbeat:
        hb = self._produce()
        for b in self.backlogs:
            if not b.live:
                continue
            b.events.extend(hb.events)
            b.samples.extend(hb.decode_samples)
            del b.samples[:-MAX_DECODE_SAMPLES]
            if len(b.events) > self.max_pending_events:
                if not b.dropping:
                    log.warning("dropping %d KV events unsent to conductor %s (it does not acknowledge them)",
                                len(b.events) - self.max_pending_events, b.conductor)
                b.dropping = True
                b.dropped += len(b.events) - self.max_pending_events
                del b.events[:-self.max_pending_events]
        hb.events = []
        hb.decode_samples = []
        return hb

    def beat(self, backlog: Backlog) -> Heartbeat:
        """This conductor's heartbeat: load and state as of now, its whole backlog of events (events not
        yet acknowledged go out again, so its index misses nothing) and the decode samples since its last."""
        hb = self._pull()
        hb.events = list(backlog.events)
        hb.decode_samples = list(backlog.samples)  # samples go once: a lost one only thins the cost model
        backlog.samples.clear()
        backlog.dropped_at_send = backlog.dropped
        return hb

    def acknowledged(self, backlog: Backlog, sent: Heartbeat) -> None:
        del backlog.events[:max(0, len(sent.events) - (backlog.dropped - backlog.dropped_at_send))]
        if not backlog.events:
            backlog.dropping = False

    def forget(self, backlog: Backlog) -> None:
        """The conductor no longer knows us: what it missed is in the snapshot at the next registration."""
        backlog.live = False
        backlog.events.clear()
        backlog.samples.clear()
        backlog.dropping = False

    async def resync(self, backlog: Backlog) -> None:
        """The conductor has just registered us (and dropped what it knew of our cache): its backlog
        becomes a snapshot of the cache, then every event after the snapshot began. Events that happened
        between the pull and the snapshot are in both, harmlessly: the index treats stored/removed as
        set operations, so replaying them after the snapshot ends where the engine is."""
        self._pull()  # what came before goes to the others; this conductor starts from here
        self.forget(backlog)
        backlog.live = True
        if self._snapshot is None:
            return
        try:
            snapshot = await self._snapshot()
        except Exception:  # a broken snapshot costs the conductor cache knowledge, never membership
            log.exception("could not snapshot the cache for conductor %s", backlog.conductor)
            return
        backlog.events[:0] = snapshot
