"""Live ``pending_blocks``: the conductor counts the prompt blocks of prefills it routed and has not yet
seen cached, as the simulator counts a simulated instance's queued and running jobs (tools/sim), so
the ``mooncaked`` policy sees a prefix still being computed live as it does in simulation.

In-process (inproc_cluster.py): the conductor's core and real engine instances, no gRPC. A prefill
held before it starts is a request queued behind a long one; heartbeats are sent by hand (``beat``)
so the moment the KV events reach the prefix index is the test's to choose.

The same holds for load: a heartbeat sent while a prefill computed reports its prompt as queued; until a
heartbeat surely sent after the prefill returned, the conductor's own ledger is what is current.
"""

from __future__ import annotations

import asyncio

import pytest

from inproc_cluster import BLOCK, Cluster, HeldPrefill, Unreachable
from mooncaked.conductor.core import GenerateSpec
from mooncaked.conductor.engine_link import Heartbeat, InstanceLoad
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.router import SETTLE_HEARTBEATS, cluster_view
from mooncaked.engine import SamplingParams
from mooncaked.hashing import block_hashes

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(20, 60))  # 40 tokens: 10 full blocks
FOLLOW_UP = PROMPT + [70, 71, 72, 73, 74, 75, 76]  # the same 10 blocks and one more of its own


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[1]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def _views(c: Cluster, prompt: list[int]) -> dict[str, tuple[int, int]]:
    """(own_blocks, pending_blocks) of each prefill instance, as the policy sees them for ``prompt``."""
    hashes = block_hashes(prompt, BLOCK, c.conductor.hash_seed)
    view = cluster_view(c.conductor.registry, c.conductor.index, hashes, c.conductor.scheduler)
    return {p.name: (p.own_blocks, p.pending_blocks) for p in view.prefills}


async def _drain(c: Cluster, prompt: list[int], n: int = 2) -> list[int]:
    chunks = [x async for x in c.conductor.generate(GenerateSpec(token_ids=prompt, sampling=_params(n)))]
    return [t for x in chunks for t in x.token_ids]


async def test_routed_blocks_are_pending_until_the_heartbeats_report_them_cached(folder):
    c = Cluster(folder, make_policy("mooncaked_static"))
    try:
        p1 = await c.serve("p1", "prefill", cls=HeldPrefill)  # both cold: the tie goes to p1
        await c.serve("p2", "prefill")
        await c.serve("d1", "decode")
        assert _views(c, FOLLOW_UP) == {"p1": (0, 0), "p2": (0, 0)}
        first = asyncio.ensure_future(_drain(c, PROMPT))
        await p1.started.wait()
        # queued (held) on p1: its 10 blocks are in p1's cache by the time a request sent there now starts
        assert _views(c, FOLLOW_UP) == {"p1": (0, 10), "p2": (0, 0)}
        assert _views(c, [1, 2, 3, 4] + PROMPT) == {"p1": (0, 0), "p2": (0, 0)}  # a leading run only
        p1.go.set()
        assert len(await first) == 2
        # the prefill returned, but its KV events are not in the index yet: still pending, never held nowhere
        assert _views(c, FOLLOW_UP) == {"p1": (0, 10), "p2": (0, 0)}
        for _ in range(SETTLE_HEARTBEATS):
            await c.beat()
        assert _views(c, FOLLOW_UP) == {"p1": (10, 0), "p2": (0, 0)}
        assert not c.conductor.scheduler.pending["p1"].requests
    finally:
        await c.close()


async def test_a_failed_prefill_leaves_nothing_pending_and_the_retry_counts_where_it_ran(folder):
    c = Cluster(folder, make_policy("mooncaked_static"))
    try:
        c.join("p1", "prefill", Unreachable())  # gone: the prefill there fails, the retry goes to p2
        await c.serve("p2", "prefill")
        await c.serve("d1", "decode")
        assert len(await _drain(c, PROMPT)) == 2
        assert _views(c, FOLLOW_UP)["p2"] == (0, 10)  # ran on p2, not yet reported
        assert not c.conductor.scheduler.pending.get("p1") or not c.conductor.scheduler.pending["p1"].requests
        for _ in range(SETTLE_HEARTBEATS):
            await c.beat()
        assert _views(c, FOLLOW_UP)["p2"] == (10, 0)
    finally:
        await c.close()


async def test_a_heartbeat_older_than_a_finished_prefill_does_not_count_it_as_queued(folder):
    """The elastic CPP process test's flake: a follow-up to a long prompt went to a cold instance, because
    the lead's heartbeat from during its prefill still said 300 tokens were queued there."""
    c = Cluster(folder, make_policy("mooncaked_static"))
    try:
        p1 = await c.serve("p1", "prefill", cls=HeldPrefill)
        await c.serve("p2", "prefill")
        await c.serve("d1", "decode")
        total = c.layout.num_blocks

        def beat(name: str, **load: int) -> None:  # what the engine reports while it works
            c.conductor.heartbeat(Heartbeat(name, InstanceLoad(free_kv_blocks=total, total_kv_blocks=total, **load)))

        def loads() -> dict[str, tuple[int, int]]:
            hashes = block_hashes(FOLLOW_UP, BLOCK, c.conductor.hash_seed)
            view = cluster_view(c.conductor.registry, c.conductor.index, hashes, c.conductor.scheduler)
            return {**{p.name: (p.queued_tokens, p.queued_s > 0) for p in view.prefills},
                    **{d.name: (len(d.batch), 0) for d in view.decodes}}

        first = asyncio.ensure_future(_drain(c, PROMPT))
        await p1.started.wait()
        beat("p1", queued_prefill_tokens=len(PROMPT))
        beat("d1", running_requests=1)
        assert loads() == {"p1": (len(PROMPT), True), "p2": (0, False), "d1": (1, 0)}
        p1.go.set()
        assert len(await first) == 2
        # both heartbeats are older than the end of the work they count: the ledgers (empty now) hold
        assert loads() == {"p1": (0, False), "p2": (0, False), "d1": (0, 0)}
        for _ in range(SETTLE_HEARTBEATS - 1):
            beat("p1", queued_prefill_tokens=len(PROMPT))
            beat("d1", running_requests=1)
            assert loads() == {"p1": (0, False), "p2": (0, False), "d1": (0, 0)}  # may have left before the end
        # later reports count again (work this conductor did not route: another's, or from before a restart)
        beat("p1", queued_prefill_tokens=len(PROMPT))
        beat("d1", running_requests=1)
        assert loads() == {"p1": (len(PROMPT), True), "p2": (0, False), "d1": (1, 0)}
    finally:
        await c.close()


def test_the_ledger_settles_only_after_enough_heartbeats_and_forgets_a_restarted_instance():
    from mooncaked.conductor.router import PendingBlocks, SchedulerState

    p = PendingBlocks()
    p.add("a", (1, 2, 3))
    p.add("b", (1, 2, 9))
    assert p.run((1, 2, 3, 4)) == 3 and p.run((1, 2, 9)) == 3 and p.run((2, 1)) == 2 and p.run((7,)) == 0
    p.settle("a")
    for _ in range(SETTLE_HEARTBEATS - 1):
        p.heard()
    assert p.run((1, 2, 3)) == 3  # one heartbeat may have left before the blocks were cached
    p.heard()
    assert p.run((1, 2, 3)) == 2 and p.run((1, 2, 9)) == 3  # "b" still holds 1 and 2
    p.drop("b")
    assert not p.counts and not p.requests

    state = SchedulerState(make_policy("mooncaked_static"))
    state.pending["p1"] = PendingBlocks()
    state.pending["p1"].add("r", (5, 6))
    assert state.pending_run("p1", [5, 6, 7]) == 2 and state.pending_run("p2", [5]) == 0
    state.finished("r")  # never prefilled (the client left while it queued): dropped at once
    assert state.pending_run("p1", [5, 6]) == 0
    state.pending["p1"].add("s", (5,))
    state.forget("p1")  # restarted: reports its cache afresh
    assert state.pending_run("p1", [5]) == 0
