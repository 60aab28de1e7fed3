"""A token bucket that paces sending, to emulate a slower network in benchmarks."""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
"""Paced payloads go out in pieces this big so the rate is smooth."""


class TokenBucket:
    """rate bytes/s with a burst of about 10 ms of traffic (at least one chunk).

    Taking more than is in the bucket leaves it in debt and sleeps the debt
    off, so concurrent senders share the rate instead of each getting it.
    """

    def __init__(self, rate_bytes_per_s: float) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        self.capacity = max(float(CHUNK_BYTES), self.rate * 0.01)
        self._tokens = self.capacity
        self._last = time.monotonic()

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)
