"""What the master's deciders (placement, eviction, tiering) tell it to do, as plain records.

Why records: a decider only reads the catalog and says what should change; the master applies
each decision through the catalog's public operations, so every change to the metadata takes
one path (the one an HA op log hooks). Deciders are generators: a decision is applied before
the decider resumes, because the next one depends on the room the last one made. (Not frozen:
a frozen dataclass costs four times as much to build, and one is built on every put's hot path;
nobody changes one once built.)
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeVar, Union

from mooncaked.store.records import ObjectMeta, Replica, Segment, TaskKind

T = TypeVar("T")


@dataclass(slots=True)
class Place:
    """A new object's copy goes on `segment` (which has room for `size` bytes: its allocator picks
    the offset when the master applies this)."""

    segment: Segment
    size: int


@dataclass(slots=True)
class Evict:
    """A copy leaves a full segment: dropped at once, or demoted (copied `to` its owner's LMDB tier
    first; the DRAM bytes stay until the owner reports the copy done)."""

    obj: ObjectMeta
    replica: Replica
    segment: Segment
    how: Literal["drop", "demote"] = "drop"
    to: Segment | None = None


@dataclass(slots=True)
class DropPlace:
    """A place reserved ahead is given up: it holds no data (its writer falls back to a plain put)."""

    obj: ObjectMeta


@dataclass(slots=True)
class TierMove:
    """Order `source`'s owner to copy `replica` of `obj` to segment `to` (which has room for it)."""

    kind: TaskKind  # "promote" | "persist" | "demote"
    obj: ObjectMeta
    replica: Replica
    source: Segment
    to: Segment


@dataclass(slots=True)
class Complete:
    """A tier task wrote this copy: it is readable now (`lease`: a read lease to grant with it, 0: none)."""

    obj: ObjectMeta
    replica: Replica
    lease: int = 0


@dataclass(slots=True)
class Drop:
    """A copy goes (not an eviction: a failed move's target, or the source a finished move replaced).
    `send_delete=False`: its owner has dropped the LMDB value already."""

    obj: ObjectMeta
    replica: Replica
    send_delete: bool = True


@dataclass(slots=True)
class DeleteValue:
    """An LMDB value nobody's metadata names (its object went while it was being written): delete it."""

    segment: Segment
    key: str
    size: int


Decision = Union[Place, Evict, DropPlace, TierMove, Complete, Drop, DeleteValue]
Decisions = Generator[Decision, None, T]
"""A decider: yields decisions (each applied before it resumes) and returns its answer."""
