"""Pinned staging for a GPU engine (store/pinned.py): an engine on a GPU asks for it; without CUDA the
client warns and runs pageable; on a GPU, gets into and puts from GPU tensors move the right bytes."""

from __future__ import annotations

import logging

import pytest
import torch

import store_helpers as sh
from mooncaked.config import WorkerConfig
from mooncaked.store import StoreClientConfig


def test_a_gpu_engine_asks_for_pinned_staging():
    for device, want in (("cpu", False), ("cuda", True), ("cuda:1", True)):
        cfg = WorkerConfig(role="prefill", name="p1", store="127.0.0.1:1", device=device)
        assert StoreClientConfig.from_worker(cfg).pin_staging is want, device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is missing")
async def test_without_cuda_pinned_staging_is_a_warning_not_a_failure(caplog):
    caplog.set_level(logging.WARNING, "mooncaked.store.pinned")
    async with sh.pool(("owner", {"dram_bytes": 1 << 20}), ("gpu", {"pin_staging": True})) as (_, (owner, gpu)):
        assert gpu._unpin is None
        assert "CUDA is not available" in caplog.text
        assert await gpu.put("k", b"x" * 4096)
        assert await gpu.get("k") == b"x" * 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA device")
async def test_gpu_tensors_through_pinned_staging():
    async with sh.pool(("owner", {"dram_bytes": 4 << 20}), ("gpu", {"pin_staging": True})) as (_, (owner, gpu)):
        assert gpu._unpin is not None
        src = [torch.randn(4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        assert all(await gpu.batch_put([(f"k{i}", t) for i, t in enumerate(src)]))
        out = [torch.empty_like(t) for t in src]
        assert all(await gpu.batch_get_into([f"k{i}" for i in range(8)], out))
        assert all(torch.equal(a, b) for a, b in zip(src, out))
