"""What a request waits on instead of failing: a request's time budget, a backoff, and a wake-up.

A request that finds no decode KV room now, or whose only decode instance was just lost, waits
and asks again rather than answering 503 (conductor/core.py). Waiting is bounded by the
request's own deadline (gRPC's); a request without one (the HTTP front) waits at most
``REQUEST_WAIT_S``. Waiters sleep on ``Changes`` — woken when the registry changes (an instance
registers, comes back, reports freed KV) or when this conductor sees blocks freed (a stream
ends) — with a backoff as the fallback, so "room again" is noticed at once without polling hard.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# the longest a request without a deadline of its own waits for decode room or a lost decode
REQUEST_WAIT_S = 300.0


class Changes:
    """Wakes every waiter once per ``notify``; a waiter that misses a notify sleeps its timeout."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        """Until the next ``notify`` or ``timeout_s``, whichever comes first."""
        if timeout_s <= 0:
            return
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


@dataclass
class Backoff:
    """Growing sleeps between tries: ``first_s``, doubling, at most ``max_s``."""

    first_s: float = 0.05
    max_s: float = 1.0
    _next: float = 0.0

    @property
    def started(self) -> bool:
        return self._next > 0

    def next(self) -> float:
        self._next = self.first_s if self._next == 0 else min(self.max_s, self._next * 2)
        return self._next


@dataclass
class Deadline:
    """A request's time budget. ``client_s``: the deadline the client set (absolute, clock time),
    if any; waiting is bounded by it, or by ``REQUEST_WAIT_S`` from the start without one."""

    client_s: float | None
    clock: Callable[[], float] = time.monotonic
    started_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started_s = self.started_s or self.clock()

    @classmethod
    def within(cls, left_s: float | None, clock: Callable[[], float] = time.monotonic) -> "Deadline":
        """A budget of ``left_s`` seconds from now (None: the client set no deadline)."""
        now = clock()
        return cls(None if left_s is None else now + left_s, clock, now)

    def client_left_s(self) -> float | None:
        """Seconds to the client's deadline, None without one."""
        return None if self.client_s is None else max(0.0, self.client_s - self.clock())

    @property
    def wait_until_s(self) -> float:
        return self.client_s if self.client_s is not None else self.started_s + REQUEST_WAIT_S

    def left(self) -> float:
        """Seconds this request may still wait."""
        return max(0.0, self.wait_until_s - self.clock())

    def client_left(self, default_s: float) -> float:
        """A call's timeout: ``default_s``, shortened to the client's deadline when it has one."""
        if self.client_s is None:
            return default_s
        return max(0.001, min(default_s, self.client_s - self.clock()))

    def waited(self) -> float:
        return self.clock() - self.started_s
