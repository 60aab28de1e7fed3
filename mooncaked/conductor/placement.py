"""Getting a request onto a decode and a prefill instance: reserve KV on D, prefill on P.

No room on the decode instance now: wait for room, within the request's deadline (with an SLO,
refuse early when the forecast wait breaks it). Its only decode instance just lost: wait for one
to (re)register. A failed instance: retry elsewhere, ``max_attempts`` times. While the cluster
starts, wait for it. Every failure arrives as an ``EngineError`` kind; what reaches the client
is a typed error of ``errors.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from mooncaked.conductor.decode_lease import DecodeLease, abort_on, end_attempt
from mooncaked.conductor.engine_link import (ABORTED, CANCELLED, DEAD, DEADLINE, ELASTIC_ALONE, EXHAUSTED, INVALID,
                                             NOT_FOUND, OUT_OF_RANGE, PRECONDITION, UNAVAILABLE, EngineError,
                                             PrefillPlan, PrefillResult, Reservation)
from mooncaked.conductor.errors import DeadlineExceeded, NoInstance, OutOfRange, PeerFailed, Rejected
from mooncaked.conductor.prefix_index import PrefixIndex
from mooncaked.conductor.readiness import ReadyGate
from mooncaked.conductor.registry import Instance, Registry
from mooncaked.conductor.router import Route, SchedulerState, pick, predict_kv_wait
from mooncaked.conductor.views import ElasticDecision
from mooncaked.conductor.waiting import Backoff, Deadline
from mooncaked.engine import SamplingParams
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

PREFILL_TIMEOUT_S = 600.0
RESERVE_TIMEOUT_S = 10.0
RETRYABLE = {UNAVAILABLE, DEADLINE, EXHAUSTED, CANCELLED}
# kinds a prefill handler itself answers: it has ended, so its KV pushes have stopped (instance/prefill.py)
HANDLER_ENDED = {ABORTED, INVALID, PRECONDITION, OUT_OF_RANGE, NOT_FOUND, EXHAUSTED}
# after losing its last decode instance, requests wait this long for it (or another) to register
LOST_DECODE_WAIT_S = 30.0


class Placement:
    def __init__(self, registry: Registry, index: PrefixIndex, scheduler: SchedulerState, gate: ReadyGate,
                 heartbeat_interval_s: float, max_attempts: int, sees_pool: Callable[[], bool] = lambda: True) -> None:
        self.registry = registry
        self.sees_pool = sees_pool  # whether the prefix index follows the pool: else plans allow a pool fallback
        self.index = index
        self.scheduler = scheduler
        self.gate = gate
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_attempts = max_attempts

    async def place(self, rid: str, ids: list[int], params: SamplingParams, hashes: list[int],
                    deadline: Deadline) -> tuple[Instance, DecodeLease, PrefillResult]:
        """Reserve KV on a decode instance, then prefill on a prefill instance (which writes the KV
        there). The returned lease renews the reservation until the decode takes it over."""
        tried: set[str] = set()  # failed prefill instances, and decode instances the prompt can never fit
        full: set[str] = set()  # decode instances without room now: another may have some
        full_route: tuple[Route, str] | None = None  # the last "no room" answer
        failures = 0
        last_error, last_peer = "", ""
        last_kind: str | None = None
        alone = False  # an elastic prefill failed: the retries plan no helpers
        backoff = Backoff()
        await self._wait_until_ready(deadline)
        while True:
            if failures >= self.max_attempts:
                raise PeerFailed(f"gave up after {self.max_attempts} attempts: {last_error}", last_peer)
            if deadline.client_s is not None and deadline.left() <= 0:
                raise DeadlineExceeded("the request's deadline passed before a prefill and decode instance took it"
                                       + (f" (last failure: {last_error})" if last_error else ""))
            try:
                route = pick(self.registry, self.index, hashes, len(ids), tried | full, state=self.scheduler,
                             max_tokens=params.max_tokens, request_id=rid)
            except Rejected as e:
                # prediction-based early rejection: refuse before any prefill is spent
                raise Rejected(f"rejected early ({e.reason}): {e}", e.reason) from None
            except NoInstance as e:
                if e.role == "decode" and full_route is not None and full:
                    # every decode instance that serves is out of room now: wait for some to free
                    await self._wait_for_room(*full_route, len(ids), deadline, backoff)
                    full.clear()
                    continue
                if await self._wait_for_lost(e.role, deadline):
                    continue
                if last_kind == OUT_OF_RANGE:
                    raise OutOfRange(last_error) from None
                raise NoInstance(self._no_instance(e, deadline, last_error), e.role) from None
            prefill = route.prefill
            # counted from the pick: an instance with a prefill on its way is lent to no other prompt
            prefill.inflight += 1
            if route.helpers:
                # a scored prompt runs alone: a lent helper's share of layers has no logits to score with
                route = self._alone(route, rid) if params.scored else self._lend(route, rid, alone)
            try:
                decode = route.decode
                # one engine-side id per attempt: a late call of an abandoned attempt (its reservation left to
                # expire on a decode, its Abort) touches nothing of the next, even on the same instances
                eid = f"{rid}.{uuid.uuid4().hex[:8]}"
                try:
                    reserved = await self._reserve(decode, eid, ids, params, deadline)
                except EngineError as e:
                    if e.kind == EXHAUSTED:  # "no room now": try the others, then wait
                        full.add(decode.name)
                        full_route = (route, e.detail)
                        continue
                    last_kind, last_error, last_peer = e.kind, f"{decode.name}: {e.detail}", decode.name
                    if e.kind == OUT_OF_RANGE:  # this decode can never hold the prompt
                        tried.add(decode.name)
                        continue
                    if e.kind not in RETRYABLE:
                        raise PeerFailed(e.detail, decode.name, e.kind) from None
                    if e.kind in (UNAVAILABLE, DEADLINE):
                        self.registry.mark_lost(decode, f"Reserve failed: {e.kind}")
                    failures += 1
                    continue
                reserved.engine_address = decode.address  # the prefill renews it there while it writes
                lease = DecodeLease(decode, eid, reserved)
                lease.start()
                plan = route.plan(self.registry.find)
                if route.helpers and (plan is None or not plan.helpers
                                      or self.scheduler.backlog(prefill.name).seconds(time.monotonic()) > 0):
                    # a helper left, or work reached the lead while the decode reserved: no pipeline
                    log.debug("%s runs alone on %s: a helper left or the lead got work meanwhile", rid,
                              route.prefill.name)
                    route = self._alone(route, rid)
                    plan = route.plan(self.registry.find)
                if plan is not None and not self.sees_pool():
                    plan.pool_fallback = True
                self.scheduler.routed(rid, route, len(ids), params.max_tokens, hashes)
                done = False
                started = time.monotonic()
                try:
                    result = await self._prefill(prefill, eid, ids, params, reserved,
                                                 deadline.client_left(PREFILL_TIMEOUT_S), plan)
                    done = True
                    if result.deviations.get(ELASTIC_ALONE):  # its helpers failed: the lead's time alone
                        self.scheduler.pipelines.pop(rid, None)
                    self.scheduler.prefill_done(rid, prefill.name, result.computed_tokens, result.cached_tokens,
                                                result.compute_s or None)
                    if result.push_bytes and result.push_s > 0:
                        self.scheduler.observe_transfer(prefill.name, "remote", result.push_bytes, result.push_s)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("%s", _route_trace(rid, route, len(ids), result, time.monotonic() - started))
                    return prefill, lease, result
                except asyncio.CancelledError:
                    # the client went away: stop the prefill, then (once it acknowledged) free the decode blocks
                    spawn(end_attempt(prefill, lease, eid, prefill_ended=False), f"end-{eid}")
                    raise
                except EngineError as e:
                    # in the background: a hung prefill instance must not hold up the retry
                    spawn(end_attempt(prefill, lease, eid, prefill_ended=e.kind in HANDLER_ENDED), f"end-{eid}")
                    last_kind, last_error, last_peer = e.kind, f"{prefill.name}: {e.detail}", prefill.name
                    if e.kind == ABORTED:
                        # the KV push to the decode instance failed: it is likely gone; route again
                        log.warning("KV push of %s to %s failed: %s", rid, decode.name, e.detail)
                        self.registry.mark_lost(decode, f"KV push failed: {e.detail}")
                        last_error, last_peer = f"{decode.name}: {e.detail}", decode.name
                        failures += 1
                        continue
                    if e.kind not in RETRYABLE:
                        raise PeerFailed(e.detail, prefill.name, e.kind) from None
                    log.warning("prefill of %s on %s failed (%s); retrying elsewhere", rid, prefill.name, e.kind)
                    # which of an elastic prefill's machines failed is not told: the lead is marked lost as a static
                    # group's head is (until its next heartbeat), and the retries run alone
                    alone = alone or bool(route.helpers)
                    if e.kind == UNAVAILABLE:
                        self.registry.mark_lost(prefill, e.detail or "unavailable")
                    tried.add(prefill.name)
                    failures += 1
                finally:
                    if not done:
                        self.scheduler.prefill_done(rid, prefill.name, cached=False)
            finally:
                prefill.inflight -= 1
                self.registry.give_back(rid)  # the lead's prefill ended: its helpers take work again

    def _lend(self, route: Route, rid: str, alone: bool) -> Route:
        """Lend an elastic route's helpers to ``rid`` from the pick until the lead's prefill ends; when
        that cannot be (a retry, a helper taken or gone meanwhile), the route without them."""
        if not alone and self.registry.lend(route.helpers, rid):
            return route
        log.debug("%s runs alone on %s: its helpers %s could not be lent%s", rid, route.prefill.name,
                  ",".join(route.helpers), " (a retry)" if alone else "")
        return self._alone(route, rid)

    def _alone(self, route: Route, rid: str) -> Route:
        """The route without helpers, booked for the lead's time alone (``ElasticDecision.alone``)."""
        self.registry.give_back(rid)
        decision = route.decision
        if isinstance(decision, ElasticDecision):
            decision = decision.alone()
        return dataclasses.replace(route, decision=decision)

    async def _prefill(self, prefill: Instance, eid: str, ids: list[int], params: SamplingParams,
                       target: Reservation, timeout_s: float, plan: PrefillPlan | None) -> PrefillResult:
        """The prefill call, given up (UNAVAILABLE) once ``prefill`` is counted dead while another
        prefill instance serves: a stopped or cut-off process sends no heartbeats, but its
        connection may stay open, and the call would wait for its deadline (up to
        PREFILL_TIMEOUT_S) instead of being retried there at once."""
        stages = self.registry.stage_addresses(prefill)
        if stages is None:  # a CPP group that lost a stage since it was picked
            raise EngineError(UNAVAILABLE, f"{prefill.name}'s pipeline group is missing a stage")
        task = asyncio.ensure_future(prefill.link.prefill(eid, ids, params, target, timeout_s, plan, stages or None))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_interval_s)
                if done:
                    return task.result()
                if prefill.state == DEAD and any(p is not prefill for p in self.registry.available("prefill")):
                    raise EngineError(UNAVAILABLE, f"{prefill.name} stopped sending heartbeats mid-prefill")
        finally:
            if not task.done():
                task.cancel()  # cancels the call on the engine's side too

    async def _reserve(self, decode: Instance, eid: str, ids: list[int], params: SamplingParams,
                       deadline: Deadline) -> Reservation:
        try:
            return await decode.link.reserve(eid, ids, params, deadline.client_left(RESERVE_TIMEOUT_S))
        except asyncio.CancelledError:
            # the Reserve may still land: the Abort frees it, or refuses it if it comes later
            spawn(abort_on(decode, eid), f"abort-{eid}")
            raise

    async def _wait_for_room(self, route: Route, why: str, prompt_len: int, deadline: Deadline,
                             backoff: Backoff) -> None:
        """The decode instance has no KV room now: sleep until blocks may have freed (a stream ended, a
        heartbeat reports more free), then route again. Ends the request when its deadline passes, or
        (with an SLO) when the forecast wait breaks the TTFT SLO."""
        policy = self.scheduler.policy
        if policy.early_rejection and policy.enforce_slo:
            wait = predict_kv_wait(self.scheduler, route.decode, prompt_len)
            ttft = deadline.waited() + (wait or 0.0) + (route.decision.predicted_ttft_s if route.decision else 0.0)
            if wait is not None and ttft > policy.slo.ttft_s:
                raise Rejected(f"rejected early (kv_wait): {route.decode.name} is forecast to have KV room for "
                               f"{prompt_len} tokens in {wait:.1f} s; time to first token {ttft:.1f} s would "
                               f"break the {policy.slo.ttft_s:.1f} s SLO", "kv_wait")
        left = deadline.left()
        if left <= 0:
            message = f"waited {deadline.waited():.1f} s for decode KV room, in vain: {why}"
            if deadline.client_s is not None:
                raise DeadlineExceeded(message)
            raise Rejected(message)
        if not backoff.started:
            log.info("no decode KV room for a %d-token prompt now (%s); waiting", prompt_len, why)
        await self.registry.changes.wait(min(backoff.next(), left))

    async def _wait_for_lost(self, role: str, deadline: Deadline) -> bool:
        """No decode instance serves, but one was lost moments ago: wait (bounded) for it to come back
        or another to register. True: route again. A restarted instance registers in seconds; one
        gone for ``LOST_DECODE_WAIT_S`` is not waited for."""
        if role != "decode" or not self.registry.lost_since("decode", LOST_DECODE_WAIT_S):
            return False
        left = deadline.left()
        if left <= 0:
            return False
        await self.registry.changes.wait(min(1.0, left))
        return True

    def _no_instance(self, e: NoInstance, deadline: Deadline, last_error: str) -> str:
        msg = str(e)
        lost = [i for i in self.registry.instances.values() if i.role == e.role and i.state == DEAD]
        if lost:
            now = time.monotonic()
            msg += " (" + ", ".join(f"{i.name} lost {now - i.dead_since:.0f} s ago" if i.dead_since else
                                     f"{i.name} dead" for i in lost) + f"; waited {deadline.waited():.1f} s)"
        return msg + (f" (after failures: {last_error})" if last_error else "")

    async def _wait_until_ready(self, deadline: Deadline) -> None:
        """While the cluster starts (no prefill and decode have served yet, and the conductor is
        younger than ready_timeout_s), wait for them instead of refusing: bounded by the window and
        by the request's own deadline. After the window routing answers "no instance" at once, as it
        does when a ready cluster loses its instances."""
        if not self.gate.starting():
            return
        if not await self.gate.wait(deadline.client_left_s()) and self.gate.starting():
            raise DeadlineExceeded("the cluster is still starting: no prefill and decode instance served "
                                   "before the request's deadline")


def _route_trace(rid: str, route: Route, prompt_len: int, result: PrefillResult, took_s: float) -> str:
    """One line per placed request at DEBUG: what the policy predicted against what the prefill did, so an
    operator (or ``tools/replay_vs_sim.py``) can see where the cost model errs."""
    d = route.decision
    predicted = (f"predicted queue {d.predicted_ttft_s - d.predicted_prefill_s:.3f} s + prefill "
                 f"{d.predicted_prefill_s:.3f} s, reuse {d.local_blocks}+{d.reuse_blocks - d.local_blocks} blocks"
                 if d is not None else "no prediction")
    lent = f" with helpers {','.join(route.helpers)}" if route.helpers else ""
    return (f"route {rid}: {prompt_len} tokens -> {route.prefill.name}{lent}/{route.decode.name}; {predicted}; "
            f"took {took_s:.3f} s (compute {result.compute_s:.3f} s, cached {result.cached_tokens}, "
            f"computed {result.computed_tokens}, pulled {result.pulled_blocks} from {result.pulled_from or '-'})")
