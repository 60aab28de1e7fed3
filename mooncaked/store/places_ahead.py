"""Keeping a client's stock of places reserved ahead full: how many of a shape, refills, giving back.

reservations.py holds the stock; this asks the master for it (ReservePlaces) in small steps in the
background, so a single put finds a place at hand and waits for one commit only (writes.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store.errors import StoreError
from mooncaked.store.master_calls import MasterCalls
from mooncaked.store.records import PLACE_USE_S
from mooncaked.store.reservations import Place, Places, Shape
from mooncaked.tasks import spawn

logger = logging.getLogger(__name__)

MAX_AHEAD = 64  # most places of one shape kept
REFILL_STEPS = 8  # a refill tops up about 1/8 of the places kept


class PlacesAhead:
    """Places reserved ahead for one client's single puts, `ahead_bytes`' worth per object shape."""

    def __init__(self, calls: MasterCalls, places: Places, client_id: str, ahead_bytes: int) -> None:
        self.calls = calls
        self.places = places
        self.client_id = client_id
        self.ahead_bytes = ahead_bytes
        self._refilling: dict[Shape, asyncio.Task] = {}

    def take(self, shape: Shape) -> Place | None:
        """A place of this shape still usable, if one is in stock (and a refill asked for when it runs low)."""
        place = self.places.take(shape, asyncio.get_running_loop().time())
        if place is not None:
            self.refill_soon(shape)  # now: the master reserves while this put writes, not during its commit
        return place

    async def reserve_for_a_put(self, shape: Shape) -> Awaitable[store_pb2.ReservePlacesReply]:
        """Out of stock: ask for a few places now (a big reservation holds the master up; the rest come
        in the background). Hand the reply to `first_of`."""
        return await self.calls.send("ReservePlaces", self.request(shape, 1 + self.refill_step(shape), True))

    def first_of(self, shape: Shape, reply: store_pb2.ReservePlacesReply) -> Place | None:
        """The place for the put that asked (reserve_for_a_put); the others go into stock."""
        places = self.stock(reply)
        if not places:
            return None
        self.places.add(shape, places[1:])
        self.refill_soon(shape)
        return places[0]

    def ahead(self, shape: Shape) -> int:
        """How many places of this shape to keep: ahead_bytes' worth, within [2, 64]."""
        return max(2, min(MAX_AHEAD, self.ahead_bytes // shape.size))

    def refill_step(self, shape: Shape) -> int:
        return max(1, self.ahead(shape) // REFILL_STEPS)

    def request(self, shape: Shape, count: int, for_a_put: bool = False) -> store_pb2.ReservePlacesRequest:
        return store_pb2.ReservePlacesRequest(client_id=self.client_id, size=shape.size, count=count,
                                              replicas=shape.replicas, preferred_segment=shape.preferred,
                                              first_for_a_put=for_a_put)

    def stock(self, reply: store_pb2.ReservePlacesReply) -> list[Place]:
        """The places of a ReservePlaces reply, usable for half the master's timeout."""
        self.places.follow(reply.master_epoch)
        use_by = asyncio.get_running_loop().time() + min(reply.timeout_s / 2, PLACE_USE_S)
        return [Place(r.id, list(r.replicas), use_by) for r in reply.reservations]

    def refill_soon(self, shape: Shape) -> None:
        """Top the stock up in the background, a few places at a time (one refill per shape at a time).

        Small steps, asked for at once (on the fast path the request is written before this
        returns): the master reserves in one go, so a big refill, or one sent behind a commit,
        would hold up the next commit; a few places are reserved while a put is still writing."""
        ahead = self.ahead(shape)
        have = self.places.count(shape)
        if have > ahead - self.refill_step(shape) or shape in self._refilling:
            return
        request = self.request(shape, ahead - have)
        fast = self.calls.open_fast_now()
        sent = fast.send("ReservePlaces", request, self.calls.timeout_s) if fast is not None else None
        task = spawn(self._refill(shape, request, sent), f"store-reserve-{self.client_id}")
        self._refilling[shape] = task
        task.add_done_callback(lambda _: self._refilling.pop(shape, None))

    async def _refill(self, shape: Shape, request: store_pb2.ReservePlacesRequest,
                      sent: Awaitable[store_pb2.ReservePlacesReply] | None) -> None:
        try:
            reply = await sent if sent is not None else await self.calls.call("ReservePlaces", request)
        except StoreError as e:  # no room now, master away: single puts take the batch path meanwhile
            logger.debug("store client %s: could not reserve places ahead: %s", self.client_id, e)
            return
        await self.give_back(self.places.add(shape, self.stock(reply)))

    async def give_back(self, reservations: list[int]) -> None:
        if not reservations:
            return
        try:
            await self.calls.call("BatchPutEnd", store_pb2.BatchPutEndRequest(revoke_reservations=reservations))
        except StoreError as e:  # the master discards them after its timeout anyway
            logger.info("store client %s: could not give back %d reserved places: %s", self.client_id,
                        len(reservations), e)

    async def close(self) -> None:
        """Stop refilling and give the whole stock back."""
        refills = list(self._refilling.values())
        for t in refills:
            t.cancel()
        await asyncio.gather(*refills, return_exceptions=True)
        await self.give_back(self.places.drain())


__all__ = ["MAX_AHEAD", "REFILL_STEPS", "PlacesAhead"]
