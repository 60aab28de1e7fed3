"""A prefill's KV push into a decode's blocks, over a real transfer engine pair on loopback: the bytes
land where the decode's blocks are, one submission for a small step, one per layer for a big one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mooncaked.engine.kv_cache import KVLayout
from mooncaked.engine.step_records import StepSeq
from mooncaked.instance.kv_push import KV_REGION, SMALL_STEP_TOKENS, KVPush
from mooncaked.transfer import TransferEngine
from mooncaked.transfer import io_transport
from mooncaked.transfer.io_transport import IoProcessTransport
from transfer_helpers import run_uv

LAYERS, BLOCK, HEADS, DIM = 3, 16, 2, 8


def pools(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, 2, blocks, BLOCK, HEADS, DIM)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)), torch.zeros(shape)


async def push_steps(tokens: int, steps: list[tuple[int, int]], last_layer: int = LAYERS - 1,
                     layerwise: bool = True, io_process: bool = False) -> tuple[KVPush, torch.Tensor, torch.Tensor,
                                                                                 list[int], list[int]]:
    """Push a ``tokens``-token prompt computed in ``steps`` (start, count) in order; returns the push, both
    pools and both block lists. ``io_process``: the prefill's engine as mooncaked's engines run by default,
    its KV in memory its I/O process maps."""
    blocks = -(-tokens // BLOCK)
    src, dst = pools(2 * blocks + 1)
    a, b = TransferEngine(io_process=io_process), TransferEngine()
    await a.start()
    addr = await b.start()
    try:
        if io_process:
            kv = a.alloc_region(KV_REGION, src.numel() * src.element_size()).view(src.dtype).view(src.shape)
            src = kv.copy_(src)
        else:
            a.register(KV_REGION, src)
        b.register(KV_REGION, dst)
        local = list(range(blocks))
        remote = list(range(blocks + 1, 2 * blocks + 1))  # elsewhere in the decode's pool
        push = KVPush(a, asyncio.get_running_loop(), KVLayout.of(src), KVLayout.of(dst), addr, remote, tokens,
                      layerwise=layerwise)

        def engine_thread() -> None:  # the engine's layer hook runs on the engine's thread
            for start, n in steps:
                step = StepSeq("r", local, start, n, start + n == tokens, last_layer)
                for layer in range(last_layer + 1):
                    push.on_layer(layer, step)

        await asyncio.to_thread(engine_thread)
        await push.wait(20)
        return push, src, dst, local, remote
    finally:
        await a.close()
        await b.close()


async def push_one_step(tokens: int, last_layer: int = LAYERS - 1) -> tuple[KVPush, torch.Tensor, torch.Tensor,
                                                                               list[int], list[int]]:
    """Push ``tokens`` tokens computed in one step."""
    return await push_steps(tokens, [(0, tokens)], last_layer)


def landed(src: torch.Tensor, dst: torch.Tensor, local: list[int], remote: list[int], tokens: int,
           layers: range) -> bool:
    """Whether the first ``tokens`` of each layer in ``layers`` are in the decode's blocks."""
    got = dst[:, :, remote].flatten(2, 3)[:, :, :tokens]
    want = src[:, :, local].flatten(2, 3)[:, :, :tokens]
    return all(torch.equal(got[i], want[i]) for i in layers)


@pytest.mark.timeout(60)
def test_a_small_step_pushes_every_layer_in_one_submission_after_its_last():
    push, src, dst, local, remote = run_uv(push_one_step(SMALL_STEP_TOKENS - 3))
    assert len(push.tasks) == 1
    assert push.complete and landed(src, dst, local, remote, SMALL_STEP_TOKENS - 3, range(LAYERS))


@pytest.mark.timeout(60)
def test_a_big_step_pushes_each_layer_as_it_is_computed():
    push, src, dst, local, remote = run_uv(push_one_step(SMALL_STEP_TOKENS + 5))
    assert len(push.tasks) == LAYERS
    assert push.complete and landed(src, dst, local, remote, SMALL_STEP_TOKENS + 5, range(LAYERS))


@pytest.mark.timeout(60)
def test_a_small_step_that_runs_some_layers_pushes_them_after_the_last_it_runs():
    """An elastic stage's step ends at its own last layer: what it computed goes out there."""
    push, src, dst, local, remote = run_uv(push_one_step(10, last_layer=1))
    assert len(push.tasks) == 1
    assert landed(src, dst, local, remote, 10, range(2))
    assert not torch.any(dst[2])  # the layer it did not run is not pushed


@pytest.mark.timeout(60)
def test_push_after_prefill_sends_the_whole_prompt_once_after_its_last_step():
    tokens = 2 * SMALL_STEP_TOKENS + 10  # chunks big enough to push layer by layer, were it layer-wise
    push, src, dst, local, remote = run_uv(push_steps(tokens, [(0, SMALL_STEP_TOKENS + 5),
                                                               (SMALL_STEP_TOKENS + 5, SMALL_STEP_TOKENS + 5)],
                                                      layerwise=False))
    assert len(push.tasks) == 1
    assert push.complete and landed(src, dst, local, remote, tokens, range(LAYERS))


@pytest.mark.timeout(60)
def test_a_big_layer_goes_through_the_engines_io_process(monkeypatch):
    """A layer over MIN_SHARE_BYTES: the I/O process sends it (mooncaked's engines run one by default)."""
    handed: list[int] = []  # bytes of each batch handed to the child (the real method runs)
    real_run = IoProcessTransport._run

    async def counted(self, child, peer, ops, timeout_s):
        handed.append(sum(op.length for op in ops))
        return await real_run(self, child, peer, ops, timeout_s)

    monkeypatch.setattr(IoProcessTransport, "_run", counted)
    monkeypatch.setattr(io_transport, "MIN_SHARE_BYTES", 2 * 1024 * 1024)  # a bulk share at this test's scale
    tokens = 16 * 1024 + 5  # each layer's K and V: 2 x 16,389 x 2 heads x 8 dims x 4 bytes, just over 2 MiB
    push, src, dst, local, remote = run_uv(push_steps(tokens, [(0, tokens)], io_process=True))
    assert len(push.tasks) == LAYERS
    assert push.complete and landed(src, dst, local, remote, tokens, range(LAYERS))
    assert handed == [2 * tokens * HEADS * DIM * 4] * LAYERS
