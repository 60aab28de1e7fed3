"""Prometheus series of the KV pool, for the master and the clients.

prometheus-client keeps one process-wide registry, so the series are declared here once;
a process running a master and clients (tests) adds to the same series, told apart by their
labels. A role's /metrics page shows only its side (MASTER_SERIES or CLIENT_SERIES,
role_metrics.py): an engine's page saying `mooncaked_store_is_leader 0` would read as a standby master.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from mooncaked.store.master import StoreMaster

logger = logging.getLogger(__name__)


class MasterGauges:
    """Per-segment capacity, use and copies, and the committed objects, read from the masters at scrape time.

    A collector rather than gauges set on every change: allocation, free and commit are the master's
    hot path, and a gauge write per change costs about as much as the change itself. It also follows a
    master replaced by a new one (a standby that took over starts from nothing).
    """

    def __init__(self) -> None:
        self._masters: weakref.WeakSet[StoreMaster] = weakref.WeakSet()

    def watch(self, master: StoreMaster) -> None:
        self._masters.add(master)

    def unwatch(self, master: StoreMaster) -> None:
        self._masters.discard(master)

    def describe(self) -> list[Any]:
        return []  # no fixed series: the registry does not check these names against others

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = [GaugeMetricFamily(name, doc, labels=["segment", "medium"]) for name, doc in (
            ("mooncaked_store_segment_capacity_bytes", "Bytes a segment lends to the pool."),
            ("mooncaked_store_segment_used_bytes", "Bytes of a segment holding objects."),
            ("mooncaked_store_segment_objects", "Complete object copies on a segment (readers can get them)."))]
        objects = GaugeMetricFamily("mooncaked_store_objects", "Committed objects the master knows.")
        committed = 0
        for master in list(self._masters):
            committed += master.catalog.committed
            for seg in list(master.segments.values()):
                for family, value in zip(families, (seg.capacity, seg.used, seg.held)):
                    family.add_metric([seg.name, seg.medium], value)
        objects.add_metric([], committed)
        yield from families
        yield objects


# master
MASTERS = MasterGauges()
REGISTRY.register(MASTERS)  # type: ignore[arg-type]
LOOKUPS = Counter("mooncaked_store_lookups", "GetReplicas answers, by result.", ["result"])
EVICTIONS = Counter("mooncaked_store_evictions", "Copies removed to make room: dropped, or demoted to LMDB.",
                    ["medium", "action"])
PROMOTIONS = Counter("mooncaked_store_promotions", "LMDB objects copied back to DRAM for a read, by result.",
                     ["result"])
DEAD_CLIENTS = Counter("mooncaked_store_dead_clients", "Clients whose segments were unmounted for silence.")
STALE_PUTS = Counter("mooncaked_store_stale_puts", "PutStarts discarded because no PutEnd came in time.")
POOL_EVENTS = Counter("mooncaked_store_pool_events",
                      "Keys sent to WatchPool subscribers in live pool events (summed over subscribers), by kind.",
                      ["kind"])
POOL_WATCHERS = Gauge("mooncaked_store_pool_watchers", "WatchPool subscribers connected now.")
POOL_WATCHERS_DROPPED = Counter("mooncaked_store_pool_watchers_dropped",
                                "WatchPool subscribers cut off for falling too far behind.")

# client
CLIENT_OPS = Counter("mooncaked_store_client_ops", "Client puts and gets, by result.", ["op", "result"])
CLIENT_BYTES = Counter("mooncaked_store_client_bytes", "Object bytes a client put or got.", ["op"])
CHECKSUM_FAILURES = Counter("mooncaked_store_checksum_failures",
                            "Reads whose bytes did not match the object's checksum (served as a miss).",
                            ["tier"])
HINTED_READS = Counter("mooncaked_store_client_hinted_reads",
                       "Gets that copied from an object's last-seen place during the lookup: the copy used, "
                       "or stale (its place was reused; read again from the lookup).", ["outcome"])
OWNER_READS = Counter("mooncaked_store_owner_reads",
                      "Reads by key this client served as a DRAM owner (owner_server.py), by outcome: served, "
                      "not_held (removed, moved or re-put: the reader asks the master), window_closed.", ["outcome"])
OWNER_GETS = Counter("mooncaked_store_client_owner_gets",
                     "Gets this client asked an object's owner for directly, by outcome: hit, fallback (the owner "
                     "did not serve it, or its bytes failed the checksum: read through the master), index (served "
                     "on the owner's host from its shared-memory index, no round trip).", ["outcome"])
TIER_TASKS = Counter("mooncaked_store_tier_tasks", "Tier moves a client carried out.", ["kind", "result"])


@functools.cache
def client_op(op: str, result: str) -> Any:
    """The labelled child, looked up once (a put or get counts on the hot path)."""
    return CLIENT_OPS.labels(op, result)


@functools.cache
def lookup(result: str) -> Any:
    return LOOKUPS.labels(result)


@functools.cache
def client_bytes(op: str) -> Any:
    return CLIENT_BYTES.labels(op)


@functools.cache
def hinted_read(outcome: str) -> Any:
    return HINTED_READS.labels(outcome)


@functools.cache
def owner_read(outcome: str) -> Any:
    return OWNER_READS.labels(outcome)


@functools.cache
def owner_get(outcome: str) -> Any:
    return OWNER_GETS.labels(outcome)


# high availability (leadership.py, fencing.py, master_link.py)
IS_LEADER = Gauge("mooncaked_store_is_leader", "1 while this store master leads (or runs alone, without etcd), "
                  "0 while it stands by.")
LEADER_CHANGES = Counter("mooncaked_store_leader_changes",
                         "Times this master took the leadership (elected) or lost it (deposed, resigned).",
                         ["change"])
REFUSED_CALLS = Counter("mooncaked_store_refused_calls",
                        "Calls a master refused UNAVAILABLE: as a standby, or as a leader whose etcd lease was "
                        "unconfirmed (fenced writes).", ["why"])
OBJECTS_REBUILT = Counter("mooncaked_store_objects_rebuilt",
                          "Objects a master learned again from its clients' re-reports after it took over or "
                          "restarted.")
FAILOVER_SECONDS = Histogram("mooncaked_store_failover_seconds",
                             "Client side: from the first call the old store master failed to the first answer of "
                             "the new leader.", buckets=(0.1, 0.25, 0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20))
LEADER_FOLLOWS = Counter("mooncaked_store_client_leader_changes",
                         "Times a client (engine, conductor) moved to a new store master leader.")

# what a role's page shows (role_metrics.py): the master's side and a client's (engines, the conductor)
MASTER_SERIES = (MASTERS, LOOKUPS, EVICTIONS, PROMOTIONS, DEAD_CLIENTS, STALE_PUTS, POOL_EVENTS,
                 POOL_WATCHERS, POOL_WATCHERS_DROPPED, IS_LEADER, LEADER_CHANGES, REFUSED_CALLS, OBJECTS_REBUILT)
CLIENT_SERIES = (CLIENT_OPS, CLIENT_BYTES, CHECKSUM_FAILURES, HINTED_READS, OWNER_READS, OWNER_GETS, TIER_TASKS,
                 FAILOVER_SECONDS, LEADER_FOLLOWS)
