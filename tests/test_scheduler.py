"""Scheduling decisions on the CPU without a model: budget, chunking, admission, preemption."""

from mooncaked.engine.block_manager import BlockManager
from mooncaked.engine.sampling_params import SamplingParams
from mooncaked.engine.scheduler import Scheduler
from mooncaked.engine.sequence import Sequence, SeqStatus


def _seq(rid: str, n: int, tokens: list[int] | None = None) -> Sequence:
    """A sequence whose prompt is its own (unless ``tokens``): prompts sharing blocks change admission."""
    base = 1 + 1000 * (sum(map(ord, rid)) % 97)
    return Sequence(rid, tokens or list(range(base, base + n)), SamplingParams(max_tokens=100, ignore_eos=True))


def _run_step(sched: Scheduler, plan, token: int = 7) -> None:
    """What the engine does after the model ran: advance, commit, append sampled tokens."""
    for s in plan.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.commit_full_blocks(s.seq)
        if samples:
            s.seq.output_token_ids.append(token)


def test_token_budget_chunks_long_prompts_and_keeps_decodes_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq("a", 3), _seq("b", 25)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 3), ("b", 7)]
    _run_step(sched, plan)
    plan = sched.schedule()
    # a decodes (1 token) while b's prefill continues with the rest of the budget
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert not plan.scheduled[1].samples
    _run_step(sched, plan)
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.scheduled[1].samples


def test_admission_bounded_by_seqs_and_blocks():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(_seq(str(i), 4))
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and len(sched.waiting) == 1  # max_num_seqs
    sched2 = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched2.add(_seq("big", 9))  # needs 3 blocks
    sched2.add(_seq("next", 4))  # needs 1 more: no room, waits
    plan = sched2.schedule()
    assert [s.seq.request_id for s in plan.scheduled] == ["big"]
    assert sched2.waiting[0].request_id == "next"


def test_preemption_by_recompute_when_blocks_run_out():
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = _seq("a", 3), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())  # each holds 2 blocks; pool is full
    assert bm.num_free_blocks == 0
    plan = sched.schedule()
    # a's 4th token needs no new block (3 prompt + 1 out fits 2 blocks)... one more step does
    _run_step(sched, plan)
    plan = sched.schedule()
    assert [s.request_id for s in plan.preempted] == ["b"]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert [s.seq.request_id for s in plan.scheduled] == ["a"]
    assert sched.waiting[0] is b
    # b keeps its generated tokens and recomputes them with the prompt when readmitted
    assert len(b.output_token_ids) == 2


def test_finish_releases_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = _seq("a", 6)
    sched.add(a)
    sched.schedule()
    assert bm.num_free_blocks == 6
    sched.finish(a, "abort")
    assert bm.num_free_blocks == 8 and a.finished and not sched.has_work()


def test_a_prompt_whose_prefix_another_is_computing_waits_and_then_hits_it():
    """Two prompts sharing 3 blocks arrive together: the second is not admitted while the first
    computes those blocks (it would compute them twice), the one behind it is; once the first has
    committed them, the second is admitted with them from the prefix cache."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    shared = list(range(500, 512))  # 3 blocks of 4
    a = _seq("a", 0, shared + [1, 2])
    b = _seq("b", 0, shared + [3, 4, 5])
    other = _seq("other", 3)
    for s in (a, b, other):
        sched.add(s)
    plan = sched.schedule()  # a takes the whole budget (8 of its 14 tokens)
    assert [x.seq.request_id for x in plan.scheduled] == ["a"]
    _run_step(sched, plan)
    plan = sched.schedule()  # a goes on (6 tokens); b waits, keeping its place; other is admitted
    assert [x.seq.request_id for x in plan.scheduled] == ["a", "other"]
    assert [x.request_id for x in sched.waiting] == ["b"]
    _run_step(sched, plan)  # a has computed all 12 shared tokens: its blocks are committed
    plan = sched.schedule()
    assert "b" in [x.seq.request_id for x in plan.scheduled]
    assert b.num_cached_tokens == len(shared)  # the prefix came from the cache, not computed again


def test_without_the_wait_both_would_compute_the_prefix():
    """The same two prompts, the first already past the shared blocks: no wait, a cache hit at once;
    and a prompt sharing less than one block with a running one is never held back."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _seq("a", 0, list(range(500, 514)))
    sched.add(a)
    _run_step(sched, sched.schedule())
    near = _seq("near", 0, [500, 501, 502, 999, 1000])  # 3 shared tokens: less than a block
    b = _seq("b", 0, list(range(500, 512)) + [7])
    sched.add(near)
    sched.add(b)
    plan = sched.schedule()
    assert {x.seq.request_id for x in plan.scheduled} == {"a", "near", "b"}
    assert b.num_cached_tokens == 12 and near.num_cached_tokens == 0


def _plan(sched: Scheduler) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in sched.schedule().scheduled]


def test_a_prompt_joins_a_step_holding_another_only_within_the_pack_tokens():
    """Every prompt in a step waits for the whole step: a CPU, whose step cost is mostly per token,
    packs a second prompt only while the step's prefill stays small; a prompt alone gets the budget."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=256, pack_tokens=32)
    for rid in ("a", "b"):
        sched.add(_seq(rid, 150))
    assert _plan(sched) == [("a", 150)]  # b would have delayed a by 106 tokens of compute

    tiny = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=256, pack_tokens=32)
    for rid, n in (("p", 10), ("q", 10), ("r", 10), ("s", 10), ("t", 1)):
        tiny.add(_seq(rid, n))
    assert _plan(tiny) == [("p", 10), ("q", 10), ("r", 10)]  # s would make 40; t waits its turn behind s

    small_first = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=256, pack_tokens=32)
    small_first.add(_seq("small", 10))
    small_first.add(_seq("big", 150))
    assert _plan(small_first) == [("small", 10)]


def test_decodes_do_not_count_against_the_pack_tokens_and_a_long_prompt_still_chunks():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, pack_tokens=8)
    sched.add(_seq("d", 8))
    _run_step(sched, sched.schedule())  # d now decodes
    sched.add(_seq("long", 100))
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("d", 1), ("long", 63)]
    _run_step(sched, plan)
    sched.add(_seq("next", 4))
    plan = sched.schedule()  # long's last 37 tokens are prefill: next waits for them
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("d", 1), ("long", 37)]
    _run_step(sched, plan)
    assert _plan(sched) == [("d", 1), ("long", 1), ("next", 4)]


def test_without_pack_tokens_a_step_packs_up_to_its_budget():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=256)
    for rid in ("a", "b"):
        sched.add(_seq(rid, 150))
    assert _plan(sched) == [("a", 150), ("b", 106)]
