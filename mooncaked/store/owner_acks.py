"""The master's side of owner reads by key (owner_server.py): which owners serve, how their journal
batches are numbered, and who waits for an owner to acknowledge one.

A Remove must not be answered while an owner could still serve a removed key from its journal:
it waits until every owner the keys left acknowledged the batch that says so, or until that
owner's serve window has certainly run out (the caller's timeout).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


class OwnerAcks:
    """Per client: the last journal batch number sent, the last that took keys away, the last acknowledged."""

    def __init__(self) -> None:
        self.serving: set[str] = set()  # clients that serve reads by key
        self.left: set[str] = set()  # clients with "left" journal entries not sent yet
        self.seq: dict[str, int] = {}
        self._left_seq: dict[str, int] = {}
        self._acked: dict[str, int] = {}
        self._waiters: dict[str, list[tuple[int, asyncio.Future[None]]]] = {}

    def mounted(self, client_id: str, key_server: str) -> None:
        if key_server:
            self.serving.add(client_id)

    def dropped(self, client_id: str) -> None:
        """It is unknown now: its next Ping closes its window, and its remount starts numbering again
        (a waiter for it runs out with the window)."""
        self.serving.discard(client_id)
        self.left.discard(client_id)
        for d in (self.seq, self._left_seq, self._acked):
            d.pop(client_id, None)

    def number(self, client_id: str, takes_keys_away: bool) -> int:
        """The next batch's number for this client."""
        seq = self.seq[client_id] = self.seq.get(client_id, 0) + 1
        if takes_keys_away:
            self._left_seq[client_id] = seq
        return seq

    def unacked(self) -> list[tuple[str, int]]:
        """(client, batch) for every serving owner that has not acknowledged its last batch taking keys away."""
        return [(c, seq) for c, seq in self._left_seq.items()
                if c in self.serving and self._acked.get(c, 0) < seq]

    def acked(self, client_id: str, seq: int) -> None:
        if seq <= self._acked.get(client_id, 0):
            return
        self._acked[client_id] = seq
        waiters = self._waiters.get(client_id)
        if not waiters:
            return
        keep = []
        for want, fut in waiters:
            if want <= seq:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((want, fut))
        self._waiters[client_id] = keep

    async def wait(self, waits: list[tuple[str, int]], timeout_s: float, reply: T) -> T:
        """`reply` once each (client, batch) is acknowledged, or after `timeout_s` (their windows ran out)."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[None]] = []
        for client_id, seq in waits:
            fut = loop.create_future()
            self._waiters.setdefault(client_id, []).append((seq, fut))
            futs.append(fut)
        try:
            await asyncio.wait(futs, timeout=timeout_s)
        finally:
            for client_id, _ in waits:
                left = [(s, f) for s, f in self._waiters.get(client_id, []) if not f.done() and f not in futs]
                if left:
                    self._waiters[client_id] = left
                else:
                    self._waiters.pop(client_id, None)
        return reply
