"""Shared-memory and auto path choice, in one process (the two-process shm
round trip lives in test_transfer.py): which path carries which op, stale
segments, and that /dev/shm is left clean."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import uvloop
from prometheus_client import REGISTRY

from mooncaked.transfer import TransferEngine, TransferError, TransferOp, UnknownRegionError
from mooncaked.transfer.shm_path import INLINE_COPY_BYTES

MiB = 1024 * 1024


def shm_names() -> set[str]:
    """This process's segments (names carry the pid), so other suites' don't count."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"mooncaked-{os.getpid()}-")}


def sent(backend: str) -> float:
    return REGISTRY.get_sample_value("mooncaked_transfer_sent_bytes_total", {"backend": backend}) or 0.0


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def clean_shm() -> object:
    before = shm_names()
    yield before
    assert shm_names() == before, "shm segments leaked"


@pytest.mark.timeout(60)
def test_auto_uses_shm_for_shm_regions_and_tcp_for_the_rest(clean_shm: object) -> None:
    async def body() -> None:
        a, b = TransferEngine(backend="auto"), TransferEngine(backend="auto")
        addr = await b.start()
        try:
            src_t = rand_bytes(2 * INLINE_COPY_BYTES, 1)
            src = a.register("src", src_t)  # the local side may be plain memory
            assert src.shm_name is None
            dst = b.alloc_region("dst", 2 * INLINE_COPY_BYTES)
            plain = torch.zeros(MiB, dtype=torch.uint8)
            b.register("plain", plain)
            shm0, tcp0 = sent("shm"), sent("tcp")
            n = 2 * INLINE_COPY_BYTES  # above the inline limit: copied in a worker thread
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, n)])
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 1000)])  # small: inline
            await a.submit([TransferOp("write", "src", 0, addr, "plain", 0, MiB)])
            assert sent("shm") - shm0 == n + 1000
            assert sent("tcp") - tcp0 == MiB
            assert torch.equal(dst, src_t[:n]) and torch.equal(plain, src_t[:MiB])
        finally:
            await a.close()
            await b.close()

    uvloop.run(body())


@pytest.mark.timeout(60)
def test_reregistered_remote_region_is_followed(clean_shm: object) -> None:
    async def body() -> None:
        a, b = TransferEngine(backend="shm"), TransferEngine(backend="shm")
        addr = await b.start()
        try:
            src = a.alloc_region("src", MiB)
            src.copy_(rand_bytes(MiB, 2))
            old = b.alloc_region("dst", MiB)
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, MiB)])
            assert torch.equal(old, src)
            b.unregister("dst")
            with pytest.raises(UnknownRegionError, match="'dst'"):
                await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 10)])
            new = b.alloc_region("dst", 2 * MiB)
            await a.submit([TransferOp("write", "src", 0, addr, "dst", MiB, MiB)])
            assert torch.equal(new[MiB:], src)  # into the new segment, not the dead one
        finally:
            await a.close()
            await b.close()

    uvloop.run(body())


@pytest.mark.timeout(60)
def test_segments_are_unlinked_on_unregister_and_close(clean_shm: set[str]) -> None:
    async def body() -> None:
        engine = TransferEngine(backend="shm")
        await engine.start()
        engine.alloc_region("a", MiB)
        engine.alloc_region("b", 3 * 4096 + 1)
        assert len(shm_names() - clean_shm) == 2
        with pytest.raises(TransferError, match="already registered"):
            engine.alloc_region("a", MiB)  # the segment made for it must not linger
        assert len(shm_names() - clean_shm) == 2
        engine.unregister("a")
        assert len(shm_names() - clean_shm) == 1
        await engine.close()
        await engine.close()  # idempotent

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_shm_backend_needs_peer_regions_in_shm(clean_shm: object) -> None:
    async def body() -> None:
        a, b = TransferEngine(backend="shm"), TransferEngine(backend="tcp")
        addr = await b.start()
        try:
            a.alloc_region("src", 4096)
            b.alloc_region("dst", 4096)  # a tcp engine allocates ordinary memory
            with pytest.raises(TransferError, match="not in shared memory"):
                await a.submit([TransferOp("read", "src", 0, addr, "dst", 0, 4096)])
        finally:
            await a.close()
            await b.close()

    uvloop.run(body())


def received(backend: str) -> float:
    return REGISTRY.get_sample_value("mooncaked_transfer_received_bytes_total", {"backend": backend}) or 0.0


@pytest.mark.timeout(60)
def test_write_from_and_read_bytes_copy_caller_buffers_once_through_shm(clean_shm: object) -> None:
    """A single put/get's bytes need no registered region on this host; a read elsewhere says so
    (None) and moves nothing, and bad ranges are refused like submit() refuses them."""

    async def body() -> None:
        a, b = TransferEngine(backend="auto"), TransferEngine(backend="auto")
        addr = await b.start()
        tcp_only = TransferEngine(backend="tcp")
        try:
            dst = b.alloc_region("dst", MiB)
            plain = torch.zeros(4096, dtype=torch.uint8)
            b.register("plain", plain)
            payload = bytes(rand_bytes(1000, 7).numpy())
            shm_sent, shm_got = sent("shm"), received("shm")
            assert await a.write_from(payload, addr, "dst", 4096)
            assert bytes(dst[4096:5096].numpy()) == payload
            assert await a.write_from(bytearray(b"xy"), addr, "dst", 0)
            assert await a.write_from(memoryview(torch.arange(4, dtype=torch.int32).numpy()), addr, "dst", 8)
            assert bytes(dst[8:24].numpy()) == bytes(torch.arange(4, dtype=torch.int32).numpy())
            got = await a.read_bytes(addr, "dst", 4096, 1000)
            assert type(got) is bytes and got == payload
            assert sent("shm") - shm_sent == 1000 + 2 + 16 and received("shm") - shm_got == 1000
            # not in shared memory, or no shm path at all: tcp sends the caller's bytes as they are
            # (test_transfer_single_op.py); a read cannot land in a caller's bytes, the caller stages
            assert await a.write_from(payload[:16], addr, "plain", 0) and bytes(plain[:16].numpy()) == payload[:16]
            assert await a.read_bytes(addr, "plain", 0, 16) is None
            assert await tcp_only.write_from(payload[:16], addr, "dst", 0) and bytes(dst[:16].numpy()) == payload[:16]
            assert await tcp_only.read_bytes(addr, "dst", 0, 16) is None
            assert sent("shm") - shm_sent == 1000 + 2 + 16, "the last two went over tcp"
            with pytest.raises(TransferError, match="out of bounds|exceeds|outside"):
                await a.write_from(payload, addr, "dst", MiB - 10)
            with pytest.raises(TransferError, match="positive length"):
                await a.read_bytes(addr, "dst", 0, 0)
            with pytest.raises(TransferError, match="positive length"):
                await a.read_bytes(addr, "dst", -1, 10)
            with pytest.raises(UnknownRegionError, match="'nope'"):
                await a.read_bytes(addr, "nope", 0, 10)
        finally:
            await tcp_only.close()
            await a.close()
            await b.close()

    uvloop.run(body())
