"""When the conductor may answer generation: "ready means ready".

A cluster starts with its conductor up before its engines have loaded the model. A request
that arrives in that window should wait for a prefill and a decode instead of failing, but a
conductor left without engines must not hold requests forever. The rule, in one place:

- **ready**: at least one prefill and one decode instance are serving now;
- **starting**: not ready, none has *ever* been ready, and the conductor is younger than
  ``ready_timeout_s``. A request waits (for the gate, for the window's end, or for its own
  deadline, whichever comes first) and then routes as usual;
- **unavailable**: otherwise. Requests are refused at once (UNAVAILABLE / 503), as when the
  instances of a cluster that was ready go away later: the wait is for startup only.

The gate opens on the registry's changes (``note``, called when an instance registers,
heartbeats or is undrained), not by polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

READY, STARTING, UNAVAILABLE = "ready", "starting", "unavailable"


class _Registry(Protocol):
    def available(self, role: str) -> list: ...


class ReadyGate:
    """Tracks the startup window and wakes the requests that wait in it."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._window_ends = clock() + timeout_s
        self._opened = asyncio.Event()  # set once, the first time a prefill and a decode serve

    @staticmethod
    def serving(registry: _Registry) -> bool:
        return bool(registry.available("prefill")) and bool(registry.available("decode"))

    def note(self, registry: _Registry) -> None:
        """Call after the registry changed: opens the gate the first time the cluster is ready."""
        if not self._opened.is_set() and self.serving(registry):
            log.info("a prefill and a decode instance serve: requests flow")
            self._opened.set()

    def starting(self) -> bool:
        """True while a request without instances should wait rather than be refused."""
        return not self._opened.is_set() and self._clock() < self._window_ends

    def state(self, registry: _Registry) -> str:
        if self.serving(registry):
            return READY
        return STARTING if self.starting() else UNAVAILABLE

    async def wait(self, limit_s: float | None = None) -> bool:
        """While starting, wait until the gate opens, the window ends, or ``limit_s`` (the request's
        own time left) passes. True when the gate is open."""
        if self._opened.is_set():
            return True
        left = self._window_ends - self._clock()
        if limit_s is not None:
            left = min(left, limit_s)
        if left > 0:
            try:
                await asyncio.wait_for(self._opened.wait(), left)
            except asyncio.TimeoutError:
                pass
        return self._opened.is_set()
