"""The write fence: a prefill writes into a decode's reserved blocks only while the reservation surely lives.

The decode frees a reservation nobody renewed for its TTL. A prefill the conductor gave up on (it
looked dead: stopped, partitioned, overloaded) may still be running; were it to write after the
decode freed and reused the blocks, it would corrupt another request's KV. Writes are one-sided
(over shared memory the writer copies straight into the decode's mapping), so the fence sits at
the writer: the prefill renews the reservation itself at the decode's Engine every third of the
TTL while it pushes, and starts a write only before ``sent + ttl - margin`` of the last renewal
the decode confirmed (the decode's expiry is at least its receipt of that renewal plus the TTL,
which comes after ``sent``). A write started in time has ``margin`` seconds to land. The
conductor renews the same reservation while the request waits for a prefill; both only extend it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from mooncaked.conductor.engine_link import EngineError, EngineLink

log = logging.getLogger(__name__)

FENCE_MARGIN_S = 5.0  # at most; a third of the TTL when that is shorter
RENEW_TIMEOUT_S = 5.0


@dataclass
class WriteFence:
    """One prefill's fence on one decode reservation; ``link`` None or ``ttl_s`` 0: no fence."""

    link: EngineLink | None
    request_id: str
    ttl_s: float
    open_until: float = float("-inf")  # monotonic: no write starts at or after this
    gone: bool = False  # the decode no longer holds the reservation (aborted, expired, taken)
    last_error: str = ""

    @property
    def active(self) -> bool:
        return self.link is not None and self.ttl_s > 0

    @property
    def margin_s(self) -> float:
        return min(FENCE_MARGIN_S, self.ttl_s / 3)

    def allows(self) -> bool:
        """Whether a write may start now."""
        return not self.active or (not self.gone and time.monotonic() < self.open_until)

    def lapsed(self) -> bool:
        """Closed only because no renewal came in time: none failed and the decode still holds the blocks,
        so the prefill itself was too slow (a stalled process), not the decode gone."""
        return self.active and not self.gone and not self.last_error and time.monotonic() >= self.open_until

    def why_closed(self) -> str:
        if self.gone:
            return f"the decode no longer holds the reservation of {self.request_id}"
        return (f"the decode's reservation of {self.request_id} was not renewed within {self.ttl_s - self.margin_s:.0f}s"
                + (f" ({self.last_error})" if self.last_error else "") + "; it may be freed: no more writes")

    async def renew(self) -> bool:
        """Renew at the decode; True when it confirmed (the fence then stays open a TTL less the margin)."""
        assert self.link is not None
        sent = time.monotonic()
        try:
            ttl = await self.link.renew(self.request_id, min(RENEW_TIMEOUT_S, self.ttl_s / 3))
        except EngineError as e:
            self.last_error = f"{e.kind}: {e.detail}"
            log.warning("could not renew the reservation of %s at its decode: %s", self.request_id, self.last_error)
            return False
        if ttl is None:
            self.gone = True
            return False
        self.open_until = max(self.open_until, sent + ttl - self.margin_s)
        self.last_error = ""  # an earlier failure is no longer why the fence might close
        return True

    async def keep(self) -> None:
        """Renew every third of the TTL until cancelled (the prefill's pushes have stopped)."""
        while not self.gone:
            await asyncio.sleep(self.ttl_s / 3)
            await self.renew()
