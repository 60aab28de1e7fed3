"""Prometheus series of the KV pool, for the master and the clients.

prometheus-client keeps one process-wide registry, so the series are declared here once;
a process running a master and clients (the `all` role, tests) adds to the same series,
told apart by their labels.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from prometheus_client import Counter, Gauge

logger = logging.getLogger(__name__)

# master
SEGMENT_CAPACITY = Gauge("mooncaked_store_segment_capacity_bytes", "Bytes a segment lends to the pool.",
                         ["segment", "medium"])
SEGMENT_USED = Gauge("mooncaked_store_segment_used_bytes", "Bytes of a segment holding objects.",
                     ["segment", "medium"])
SEGMENT_OBJECTS = Gauge("mooncaked_store_segment_objects", "Object copies on a segment.", ["segment", "medium"])
OBJECTS = Gauge("mooncaked_store_objects", "Committed objects the master knows.")
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


_segment_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}


def segment_changed(name: str, medium: str, capacity: int, used: int, objects: int) -> None:
    children = _segment_children.get((name, medium))
    if children is None:
        children = _segment_children[name, medium] = tuple(
            g.labels(name, medium) for g in (SEGMENT_CAPACITY, SEGMENT_USED, SEGMENT_OBJECTS))
    for child, value in zip(children, (capacity, used, objects)):
        child.set(value)


def segment_gone(name: str, medium: str) -> None:
    _segment_children.pop((name, medium), None)
    for gauge in (SEGMENT_CAPACITY, SEGMENT_USED, SEGMENT_OBJECTS):
        try:
            gauge.remove(name, medium)
        except KeyError:
            pass
