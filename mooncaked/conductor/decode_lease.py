"""A request's KV reservation on a decode instance, held from Reserve until Decode or release.

The decode instance gives a reservation back when nobody renews it for its TTL (so a conductor
that died leaks nothing). The conductor therefore renews it for as long as the prefill that
writes into it runs — a prefill queued behind long prompts may take minutes — and stops once
Decode takes the request over. The blocks are given back (``release``) only when no push can
still write them: after the prefill's handler ended, or after the prefill instance acknowledged
an Abort; when neither can be known (the prefill instance is unreachable), renewal stops and
the decode instance frees them at the TTL.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from mooncaked.conductor.engine_link import EngineError, Reservation
from mooncaked.conductor.registry import Instance
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

MIN_RENEW_S = 0.2
CALL_TIMEOUT_S = 10.0  # Renew and Abort of a reservation
# an Abort on a prefill instance answers once the request's KV pushes stopped (its engine waits up to 10 s)
STOP_PREFILL_TIMEOUT_S = CALL_TIMEOUT_S + 5


@dataclass
class DecodeLease:
    decode: Instance
    request_id: str  # the engine-side id of this attempt
    reservation: Reservation
    _task: asyncio.Task | None = field(default=None, repr=False)

    def start(self) -> None:
        """Renew every third of the TTL the decode instance granted."""
        if self.reservation.ttl_s > 0:
            self._task = spawn(self._renew_forever(max(MIN_RENEW_S, self.reservation.ttl_s / 3)),
                               f"renew-{self.request_id}")

    def stop(self) -> None:
        """Stop renewing: Decode took the request over, or nothing may free the blocks but the TTL."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _renew_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                ttl = await self.decode.link.renew(self.request_id, min(CALL_TIMEOUT_S, every_s))
            except EngineError as e:
                log.warning("could not renew the reservation of %s on %s: %s", self.request_id, self.decode.name,
                            e.kind)
                continue
            if ttl is None:
                log.warning("the reservation of %s on %s is gone", self.request_id, self.decode.name)
                return

    async def release(self) -> None:
        """Give the blocks back now; call only once no push can still write them."""
        self.stop()
        try:
            await self.decode.link.abort(self.request_id, CALL_TIMEOUT_S)
        except EngineError as e:
            log.warning("could not release the reservation of %s on %s: %s (it expires on its own)",
                        self.request_id, self.decode.name, e.kind)


async def stop_prefill(prefill: Instance, request_id: str) -> bool:
    """Ask a prefill instance to stop a request; True once it acknowledged that its KV pushes ended."""
    try:
        reply = await prefill.link.abort(request_id, STOP_PREFILL_TIMEOUT_S)
    except EngineError as e:
        log.warning("could not stop %s on %s: %s", request_id, prefill.name, e.kind)
        return False
    return reply.ended


async def end_attempt(prefill: Instance | None, lease: DecodeLease | None, request_id: str,
                      prefill_ended: bool) -> None:
    """Free what a failed or cancelled attempt holds, in the only safe order: the prefill first
    (unless its handler is known to have ended), the decode blocks after it acknowledged."""
    if lease is None:
        return
    lease.stop()
    if not prefill_ended and prefill is not None:
        prefill_ended = await stop_prefill(prefill, request_id)
    if prefill_ended:
        await lease.release()
    else:
        log.warning("%s: its prefill on %s may still push; its blocks on %s are freed at their TTL", request_id,
                    prefill.name if prefill else "?", lease.decode.name)


async def abort_on(inst: Instance, request_id: str) -> None:
    """Abort a request on ``inst`` in the background (a Reserve that was cancelled may still land:
    the Abort frees it, or refuses it if it comes later)."""
    try:
        await inst.link.abort(request_id, CALL_TIMEOUT_S)
    except EngineError as e:
        log.warning("could not abort %s on %s: %s", request_id, inst.name, e.kind)
