"""CUDA graphs of the decode step (engine/cuda_graphs.py): the batch sizes captured everywhere; on a GPU
with flash-attn, graph replays give the eager path's greedy tokens, at batch sizes that need padding too."""

from __future__ import annotations

import pytest
import torch

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.attention import flash_unavailable_reason
from mooncaked.engine.cuda_graphs import graph_batch_sizes
from tiny_models import random_prompts

REASON = flash_unavailable_reason("cuda", 256)


def test_batch_sizes_cover_every_batch_up_to_the_limit():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(100)[-2:] == [96, 100]
    for limit in (1, 3, 16, 40, 100):
        sizes = graph_batch_sizes(limit)
        assert all(any(b >= n for b in sizes) for n in range(1, limit + 1)) and max(sizes) == limit


def test_a_cpu_engine_captures_no_graph(tiny_model_factory):
    _, folder = tiny_model_factory("llama")
    assert Engine.from_pretrained(folder, block_size=4, kv_cache_bytes=8 << 20).runner.graphs is None


@pytest.mark.skipif(REASON is not None, reason=f"CUDA graphs not testable here: {REASON}")
def test_graph_replays_give_the_eager_tokens(tiny_model_factory):
    _, folder = tiny_model_factory("llama", torch.bfloat16)
    kw = dict(device="cuda", dtype=torch.bfloat16, block_size=256, kv_cache_bytes=64 << 20, max_num_seqs=16,
              attention_backend="flash")
    graphed = Engine.from_pretrained(folder, **kw)
    eager = Engine.from_pretrained(folder, cuda_graphs=False, **kw)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for n in (1, 3, 5, 16):  # 3 and 5 replay the graphs of 4 and 8, their extra rows copies of the first
        prompts = random_prompts([7 + 37 * i for i in range(n)], seed=70 + n)
        before = graphed.runner.graphs.replays
        got = [o.token_ids for o in graphed.generate(prompts, params)]
        assert graphed.runner.graphs.replays > before
        want = [o.token_ids for o in eager.generate(prompts, params)]
        assert got == want, n
