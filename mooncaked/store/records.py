"""The master's records: segments, objects, their replicas, tier tasks, and the policy.

Records hold state; `catalog.py` is the only code that mutates them (a decision of `decisions.py`
names records it does not change).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from mooncaked.store.allocator import ByteBudget, ExtentAllocator

logger = logging.getLogger(__name__)

Medium = Literal["dram", "lmdb"]
MEDIA: tuple[str, ...] = ("dram", "lmdb")
TaskKind = Literal["demote", "promote", "delete", "persist"]
PoolEventKind = Literal["stored", "removed"]  # what pool watchers hear (service WatchPool)
MAX_KEY_BYTES = 1024
RESERVED_PREFIX = "\x00reserved/"  # internal keys of places reserved ahead (a NUL never starts a real key)
# A client writes into a place reserved ahead only this long after the master answered. A new
# leader (or a restarted master) does not know the places its predecessor handed out, so for
# FRESH_DRAM_HOLD_S after it takes over it places nothing new on DRAM: a late write into an old
# place can then never land on a new object's bytes (puts meanwhile go to the writer's LMDB tier).
PLACE_USE_S = 0.5
FRESH_DRAM_HOLD_S = PLACE_USE_S + 0.5  # + what a write begun at the last moment takes to land
# The same for one place the master drops itself (eviction gives up places ahead first): its bytes
# are free again only this long after, when no write of its writer can still land there.
DROPPED_PLACE_HOLD_S = FRESH_DRAM_HOLD_S


def checksum(data: object) -> int:
    """XXH3-64 of a buffer: what every object carries and every read checks."""
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]


Hasher = xxhash.xxh3_64


def checksum_stream() -> Hasher:
    """`checksum` fed piece by piece (update(), then intdigest()): the same figure."""
    return xxhash.xxh3_64()


@dataclass(frozen=True, slots=True)
class Policy:
    """How the master places, keeps and evicts; built once from the role's config."""

    replicas: int = 1
    lease_s: float = 5.0
    high_watermark: float = 0.9
    evict_fraction: float = 0.05  # each eviction round frees about this share of a segment
    client_ttl_s: float = 5.0  # a client silent this long is dead; its segments are unmounted
    put_timeout_s: float = 30.0  # a PutStart not ended by then is discarded
    task_timeout_s: float = 10.0  # a tier task not done by then has failed
    max_object_bytes: int = 256 << 20
    hot_hits: int = 3  # reads after which an object is soft-pinned (evicted last)
    # every object committed to the DRAM of an owner with an LMDB tier is also copied there in the
    # background: it outlives the process (even kill -9), and leaving DRAM then costs nothing
    persist: bool = True


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a peer reaches a segment's bytes on the data plane (mirrors TransferEndpoint)."""

    address: str = ""
    backend: str = "tcp"
    region: str = ""
    same_host_id: str = ""
    shm_name: str = ""
    key_server: str = ""  # where the owner serves committed objects by key (owner_server.py); "": it does not


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """What a client says when it lends memory."""

    name: str
    medium: str
    capacity: int
    endpoint: Endpoint = Endpoint()


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """An object a segment already holds, re-reported at a remount."""

    key: str
    offset: int
    size: int
    checksum: int


@dataclass(slots=True)
class Segment:
    """A mounted segment: its allocator and the keys with a copy here, least recently used first."""

    name: str
    owner: str
    medium: str
    capacity: int
    endpoint: Endpoint
    alloc: ExtentAllocator | ByteBudget
    keys: OrderedDict[str, None] = field(default_factory=OrderedDict)  # with copies being written
    leaving_bytes: int = 0  # bytes of copies being demoted away (freed when the task ends)
    held: int = 0  # complete copies here (what readers can get): the objects a status shows

    @property
    def used(self) -> int:
        return self.alloc.used


@dataclass(slots=True)
class Replica:
    """One copy; `complete` is False while its bytes are being written (put, demote, promote)."""

    segment: str
    offset: int
    size: int
    complete: bool = False


@dataclass(slots=True)
class ObjectMeta:
    """One key: its copies, checksum, lease and heat."""

    key: str
    size: int
    checksum: int
    replicas: list[Replica]
    committed: bool
    started_at: float
    soft_pin: bool = False
    lease_until: float = 0.0  # the latest read lease's end (what eviction looks at)
    leases: dict[int, float] | None = None  # lease id -> its end, while leases are live (0: anonymous;
    # -task id: a promotion's, for the readers waiting on it)
    hits: int = 0
    busy: int = 0  # tier tasks in flight; never evicted meanwhile
    promotion: int = 0  # task id of the promotion in flight, 0 if none
    medium: str = ""  # the medium pool watchers were last told ("": not announced, i.e. not readable)

    def replica_on(self, segment: str) -> Replica | None:
        for r in self.replicas:
            if r.segment == segment:
                return r
        return None


@dataclass(slots=True)
class Task:
    """A tier move the master ordered and the segments' owner carries out."""

    task_id: int
    kind: TaskKind
    client_id: str
    key: str
    size: int
    checksum: int
    src_segment: str
    src_offset: int
    dst_segment: str = ""
    dst_offset: int = 0
    deadline: float = 0.0


@dataclass(slots=True)
class Client:
    """A store client (an engine process) and the segments it lent."""

    client_id: str
    last_seen: float
    segments: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Placed:
    """A replica together with the segment it is on (the service needs the endpoint and medium)."""

    replica: Replica
    segment: Segment


@dataclass(frozen=True, slots=True)
class ObjectView:
    """What a reader gets: complete copies, checksum and the lease."""

    key: str
    size: int
    checksum: int
    replicas: list[Placed]
    lease_s: float


@dataclass(frozen=True, slots=True)
class PutPlan:
    """Where to write (or that the key is there already)."""

    replicas: list[Placed]
    exists: bool


@dataclass(frozen=True, slots=True)
class PromotionPending:
    """The object is only on LMDB; its owner is copying it to DRAM under this task."""

    task_id: int


@dataclass(frozen=True, slots=True)
class SegmentUse:
    name: str
    owner: str
    medium: str
    capacity: int
    used: int
    objects: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    segments: list[SegmentUse]
    objects: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    epoch: int
    clients: int
