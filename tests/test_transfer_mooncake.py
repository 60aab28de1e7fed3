"""The rdma adapter (Mooncake's Transfer Engine): a clear error where it
cannot run, and, where the package is installed, the same adapter driven
end to end over Mooncake's own TCP transport (backend "mooncake-tcp")."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
import uvloop

from mooncaked.transfer import (
    BackendUnavailableError,
    OutOfBoundsError,
    TransferEngine,
    TransferError,
    TransferOp,
    UnknownRegionError,
)
from mooncaked.transfer.rdma import rdma_devices

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


@pytest.mark.timeout(30)
def test_rdma_backend_says_what_it_needs() -> None:
    if HAVE_MOONCAKE and rdma_devices():
        pytest.skip("this host has mooncake-transfer-engine and an RDMA device; nothing is missing")

    async def body() -> None:
        engine = TransferEngine(backend="rdma")
        with pytest.raises(
            BackendUnavailableError, match="rdma backend needs mooncake-transfer-engine and an RDMA device: "
        ):
            await engine.start()
        assert engine.address is None  # nothing was left listening
        await engine.close()

    uvloop.run(body())
    with pytest.raises(TransferError, match="unknown transfer backend 'udp'"):
        TransferEngine(backend="udp")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="Mooncake's RDMA transfer engine (mooncake-transfer-engine) is not installed")
def test_mooncake_tcp_adapter_roundtrip() -> None:
    async def body() -> None:
        a, b = TransferEngine(backend="mooncake-tcp"), TransferEngine(backend="mooncake-tcp")
        await a.start()
        addr = await b.start()
        try:
            n = 4 * 1024 * 1024
            src = a.alloc_region("src", n)
            src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            back = a.alloc_region("back", n)
            dst = b.alloc_region("dst", n)
            blk = 256 * 1024
            await a.submit([TransferOp("write", "src", o, addr, "dst", o, blk) for o in range(0, n, blk)])
            assert torch.equal(dst, src)
            await a.submit([TransferOp("read", "back", 0, addr, "dst", 0, n)])
            assert torch.equal(back, src)
            with pytest.raises(OutOfBoundsError, match="dst"):
                await a.submit([TransferOp("write", "src", 0, addr, "dst", n, 1)])
            with pytest.raises(UnknownRegionError, match="'nope'"):
                await a.submit([TransferOp("write", "src", 0, addr, "nope", 0, 1)])
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())
