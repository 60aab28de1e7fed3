"""Places reserved ahead for single-object puts (ReservePlaces), kept per object shape.

Why: a put is PutStart, the write and PutEnd — three round trips, two of them to the master.
With a place reserved ahead it is the write and one commit. KV blocks of a model all have one
size, so a writer keeps a few places of that size and refills in the background when it runs
low. A place is used within half the master's timeout (after which the master may discard it),
and the whole stock is dropped when the master changes (its places are unknown to a new one).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_SHAPES = 4  # distinct (size, replicas, preferred) stocks kept; the oldest goes first


@dataclass(frozen=True, slots=True)
class Shape:
    size: int
    replicas: int
    preferred: str


@dataclass(slots=True)
class Place:
    reservation: int
    replicas: list[Any]  # store_pb2.Replica: where each copy's bytes go
    use_by: float  # loop time after which it is not used (the master may discard it)


class Places:
    """The stock of reserved places of one client, per shape."""

    def __init__(self) -> None:
        self.epoch = 0  # the master's epoch the stock belongs to
        self._stock: collections.OrderedDict[Shape, collections.deque[Place]] = collections.OrderedDict()

    def take(self, shape: Shape, now: float) -> Place | None:
        stock = self._stock.get(shape)
        while stock:
            place = stock.popleft()
            if place.use_by > now:
                return place
        return None

    def count(self, shape: Shape) -> int:
        return len(self._stock.get(shape, ()))

    def add(self, shape: Shape, places: list[Place]) -> list[int]:
        """Keep places; returns reservations to give back (a stock pushed out by a new shape)."""
        give_back: list[int] = []
        stock = self._stock.get(shape)
        if stock is None:
            if len(self._stock) >= MAX_SHAPES:
                _, old = self._stock.popitem(last=False)
                give_back = [p.reservation for p in old]
            stock = self._stock[shape] = collections.deque()
        stock.extend(places)
        return give_back

    def drain(self) -> list[int]:
        """Every reservation held, removed from the stock (to give back at close)."""
        out = [p.reservation for stock in self._stock.values() for p in stock]
        self._stock.clear()
        return out

    def follow(self, epoch: int) -> None:
        """The master now answering has this epoch: a stock from another master is unknown to it."""
        if epoch != self.epoch:
            self.forget()
            self.epoch = epoch

    def forget(self) -> None:
        """Drop the stock without giving it back (the master that made it is gone)."""
        if self._stock:
            logger.info("dropping %d reserved places: the store master changed",
                        sum(len(s) for s in self._stock.values()))
        self._stock.clear()
