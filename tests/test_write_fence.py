"""The write fence (issue 12): a prefill writes into a decode's reserved blocks only while its own
renewal of that reservation is fresh, so a prefill the conductor gave up on (stopped, cut off,
stuck) never writes into blocks the decode freed at their TTL and handed to another request.

In-process (inproc_cluster.py): real engines, real transfer engines on loopback. The decode's
reservation lives 0.6 s unrenewed; the prefill's renewals reach the decode through a link that
can be cut, and the prefill's engine thread is slowed per layer, as a stopped process would be.
"""

from __future__ import annotations

import time

import pytest

from inproc_cluster import Cluster
from mooncaked.conductor.engine_link import ABORTED, CANCELLED, DEADLINE, UNAVAILABLE, EngineError
from mooncaked.engine import SamplingParams
from mooncaked.instance import metrics
from mooncaked.instance.local_link import LocalEngineLink

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(20, 60))
TTL_S = 0.6  # the fence then stays open 0.4 s after each renewal (a margin of a third of the TTL)


class CutRenewals(LocalEngineLink):
    """The decode's link as the prefill sees it: renewals answer ``answers`` times, then fail."""

    def __init__(self, worker, answers: int) -> None:
        super().__init__(worker)
        self.answers = answers
        self.renewals = 0

    async def renew(self, request_id, timeout_s):
        self.renewals += 1
        if self.renewals > self.answers:
            raise EngineError(UNAVAILABLE, "cut off")
        return await super().renew(request_id, timeout_s)


@pytest.fixture
async def cluster(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder)
    yield c
    await c.close()


def _fenced() -> float:
    return metrics.PUSHES_FENCED._value.get()


async def _pair(cluster: Cluster):
    """A prefill and a decode whose reservations live TTL_S unrenewed."""
    p1 = await cluster.serve("p1", "prefill")
    d1 = await cluster.serve("d1", "decode")
    d1.worker.decoder.ttl_s = TTL_S
    return p1, d1


def _stall(p1) -> None:
    """The engine thread stalls before each layer's push, as a stopped process."""
    inner = p1.engine.layer_hook

    def stalled(layer, seqs):
        time.sleep(0.5)
        inner(layer, seqs)

    p1.engine.layer_hook = stalled


async def _reserve(d1, rid: str, params: SamplingParams):
    target = await d1.reserve(rid, PROMPT, params, 5.0)
    target.engine_address = "inproc:d1"
    return target


async def test_a_prefill_whose_renewals_lapse_writes_no_more_and_fails(cluster):
    p1, d1 = await _pair(cluster)
    params = SamplingParams(max_tokens=4)
    cut = CutRenewals(d1.worker, answers=1)  # the renewal before the prefill starts, then nothing
    p1.worker.peers = lambda address: cut
    inner = p1.engine.layer_hook
    _stall(p1)
    target = await _reserve(d1, "r1", params)
    before = _fenced()
    with pytest.raises(EngineError) as err:
        await p1.prefill("r1", PROMPT, params, target, 30.0)
    assert err.value.kind == ABORTED, err.value
    assert "was not renewed" in err.value.detail and "cut off" in err.value.detail, err.value.detail
    assert _fenced() == before + 1
    assert cut.renewals >= 2
    # the same instance serves the next request, its renewals answered
    p1.engine.layer_hook = inner
    p1.worker.peers = cluster.fabric.get
    target = await _reserve(d1, "r2", params)
    result = await p1.prefill("r2", PROMPT, params, target, 30.0)
    assert result.first_token_id >= 0 and _fenced() == before + 1


async def test_a_prefill_that_renews_too_late_itself_is_a_deadline_not_the_decodes_fault(cluster, monkeypatch):
    """Every renewal the prefill sends is answered, but its keeper stalls (as an overloaded process's event
    loop does): the fence closes all the same, and the failure is DEADLINE (retried on another prefill),
    not ABORTED, which would have the conductor mark a healthy decode dead."""
    import asyncio

    from mooncaked.instance.write_fence import WriteFence

    async def stalled_keep(self) -> None:
        await asyncio.Event().wait()  # never renews: the loop it runs on does not get to it

    monkeypatch.setattr(WriteFence, "keep", stalled_keep)
    p1, d1 = await _pair(cluster)
    params = SamplingParams(max_tokens=4)
    _stall(p1)
    target = await _reserve(d1, "r4", params)
    before = _fenced()
    with pytest.raises(EngineError) as err:
        await p1.prefill("r4", PROMPT, params, target, 30.0)
    assert err.value.kind == DEADLINE, err.value
    assert "too late" in err.value.detail and "was not renewed" in err.value.detail, err.value.detail
    assert _fenced() == before + 1


async def test_a_pull_that_outlasts_one_renewal_keeps_the_fence_open(cluster):
    """The prefill renews from the moment it takes the request, so its pulls (here slowed past a whole
    TTL) cannot close the fence before the first byte is pushed."""
    import asyncio

    p1, d1 = await _pair(cluster)
    params = SamplingParams(max_tokens=4)
    fetch = p1.worker.prefiller.fetch
    inner = fetch.prepare

    async def slow_prepare(*a, **k):
        await asyncio.sleep(2 * TTL_S)  # a pull from a busy peer
        return await inner(*a, **k)

    fetch.prepare = slow_prepare
    target = await _reserve(d1, "r5", params)
    before = _fenced()
    result = await p1.prefill("r5", PROMPT, params, target, 30.0)
    assert result.first_token_id >= 0 and _fenced() == before


async def test_a_reservation_the_decode_no_longer_holds_is_not_written_at_all(cluster):
    p1 = await cluster.serve("p1", "prefill")
    d1 = await cluster.serve("d1", "decode")
    params = SamplingParams(max_tokens=4)
    target = await _reserve(d1, "r3", params)
    await d1.abort("r3", 5.0)  # freed: its blocks may be someone else's by now
    computed = p1.engine.stats().prefill_tokens_computed
    with pytest.raises(EngineError) as err:
        await p1.prefill("r3", PROMPT, params, target, 30.0)
    assert err.value.kind == CANCELLED and "no longer holds" in err.value.detail, err.value
    assert p1.engine.stats().prefill_tokens_computed == computed  # refused before computing or pushing
