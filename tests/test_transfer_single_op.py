"""The single-op path (one put/get = submit([one op])) against a real peer in
another process: bytes land, errors keep their types, dead peers and stalls
fail within the deadline, cancellation aborts, many concurrent single ops
share connections, and a dropped shm region is noticed across processes.

submit() runs a batch of one in the caller's task and, on tcp, hands the
request to an idle connection without its send lock, so these go through
that path; batches are covered by test_transfer.py. Processes are spawned.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
import uvloop
from transfer_helpers import PeerProcess, closed_port, digest, digest_bytes, rand_bytes, run_uv

from mooncaked.transfer import (
    OutOfBoundsError,
    PeerUnavailableError,
    TransferEngine,
    TransferOp,
    TransferTimeoutError,
    UnknownRegionError,
)
from mooncaked.transfer.shm import ShmAttachments
from mooncaked.transfer.shm_files import SHM_DIR, SHM_PREFIX

KiB, MiB = 1024, 1024 * 1024
SLOT = 512 * KiB  # the store's object size in the latency benchmark






def _peer_main(pipe: Connection, backend: str, nbytes: int) -> None:
    """A transfer peer in its own process, driven over a pipe."""

    async def main() -> None:
        engine = TransferEngine(backend=backend)
        regions = {"dst": engine.alloc_region("dst", nbytes)}
        pipe.send(await engine.start())
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, pipe.recv)
            if cmd == "stop":
                break
            if cmd == "digest":
                off, n = args
                pipe.send(digest(regions["dst"][off : off + n]))
            elif cmd == "fill":
                off, n, seed = args
                regions["dst"][off : off + n].copy_(rand_bytes(n, seed))
                pipe.send(True)
            elif cmd == "unregister":
                engine.unregister("dst")
                pipe.send(True)
            elif cmd == "realloc":
                regions["dst"] = engine.alloc_region("dst", args[0])
                pipe.send(True)
        await engine.close()

    uvloop.run(main())


def Peer(backend: str, nbytes: int) -> PeerProcess:  # noqa: N802 - reads as the handle it makes
    return PeerProcess(_peer_main, backend, nbytes)


@pytest.fixture(params=["tcp", "auto"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def peer(backend: str) -> Any:
    p = Peer(backend, 8 * MiB)
    yield p
    p.stop()


@pytest.mark.timeout(90)
def test_single_ops_land_and_read_back(backend: str, peer: Peer) -> None:
    async def body() -> None:
        engine = TransferEngine(backend=backend)
        try:
            src = engine.alloc_region("src", 4 * MiB)
            src.copy_(rand_bytes(src.numel(), 1))
            back = engine.alloc_region("back", 4 * MiB)
            for i, size in enumerate((SLOT, 1, 4 * KiB + 3, 64 * KiB, 2 * MiB)):  # around the answer-now size
                at = i * SLOT
                await engine.submit([TransferOp("write", "src", at, peer.address, "dst", at, size)])
                assert peer.ask("digest", at, size) == digest(src[at : at + size]), size
                await engine.submit([TransferOp("read", "back", at, peer.address, "dst", at, size)])
                assert torch.equal(back[at : at + size], src[at : at + size]), size
            await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, 0)])  # a legal no-op
            assert peer.ask("fill", 0, SLOT, 2)
            await engine.submit([TransferOp("read", "back", 0, peer.address, "dst", 0, SLOT)])
            assert digest(back[:SLOT]) == peer.ask("digest", 0, SLOT)
        finally:
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_single_op_errors_keep_their_types(backend: str, peer: Peer) -> None:
    async def body() -> None:
        engine = TransferEngine(backend=backend)
        try:
            src = engine.alloc_region("src", MiB)
            src.copy_(rand_bytes(MiB, 3))
            with pytest.raises(UnknownRegionError, match="'nope'"):
                await engine.submit([TransferOp("write", "src", 0, peer.address, "nope", 0, SLOT)])
            with pytest.raises(UnknownRegionError, match="'nope'"):
                await engine.submit([TransferOp("read", "src", 0, peer.address, "nope", 0, 10)])
            with pytest.raises(OutOfBoundsError, match="dst"):
                await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 8 * MiB - 10, 11)])
            with pytest.raises(UnknownRegionError, match="local region 'ghost'"):
                await engine.submit([TransferOp("write", "ghost", 0, peer.address, "dst", 0, 1)])
            # the path is still good after each failure
            await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, MiB)])
            assert peer.ask("digest", 0, MiB) == digest(src)
        finally:
            await engine.close()

    run_uv(body())


async def _errors_keep_their_types(write: Any, peer: Peer, data: bytes) -> None:
    """`write(data, peer, region, offset, timeout_s=...)` moves a caller's bytes and returns True once
    they landed: a bad region, an offset out of bounds and a dead peer fail with their own errors, and
    the path is still good after each."""
    with pytest.raises(UnknownRegionError, match="'nope'"):
        await write(data, peer.address, "nope", 0)
    with pytest.raises(OutOfBoundsError, match="dst"):
        await write(data, peer.address, "dst", 8 * MiB - 10)
    with pytest.raises(PeerUnavailableError):
        await write(data, f"127.0.0.1:{closed_port()}", "dst", 0, timeout_s=5)
    assert await write(data, peer.address, "dst", 0)
    assert peer.ask("digest", 0, SLOT) == digest_bytes(data)


@pytest.mark.timeout(90)
def test_write_from_sends_a_callers_bytes_without_staging(backend: str, peer: Peer) -> None:
    """write_from: the caller's bytes (bytes, bytearray, a tensor's memoryview) land in the peer's
    region with no registered region on this side (over tcp: handed to the kernel as they are),
    `meanwhile` runs once per write, errors keep their types and leave the path good; where the
    tcp ops go through the I/O process the in-process transport still sends them as they are (the child
    maps only registered regions: staging a single put's bytes for it would cost a copy)."""

    async def body() -> None:
        engine = TransferEngine(backend=backend)
        io_engine = TransferEngine(backend="tcp", io_process=True)
        try:
            calls = []
            for i, size in enumerate((1, 4 * KiB + 3, SLOT, 2 * MiB)):  # 2 MiB: more than one send
                data = bytes(rand_bytes(size, 10 + i).numpy())
                for j, src in enumerate((data, bytearray(data), memoryview(torch.frombuffer(bytearray(data),
                                                                                      dtype=torch.uint8).numpy()))):
                    at = (3 * i + j) * 64 * KiB if size < 2 * MiB else 4 * MiB
                    assert peer.ask("fill", at, size, 99)
                    assert await engine.write_from(src, peer.address, "dst", at, meanwhile=lambda: calls.append(1))
                    assert peer.ask("digest", at, size) == digest_bytes(data)
            assert len(calls) == 12, "meanwhile runs once per write"
            data = bytes(rand_bytes(SLOT, 5).numpy())
            await _errors_keep_their_types(engine.write_from, peer, data)
            assert peer.ask("fill", 0, SLOT, 99)
            assert await io_engine.write_from(data, peer.address, "dst", 0, meanwhile=lambda: calls.append(1))
            assert peer.ask("digest", 0, SLOT) == digest_bytes(data)
            assert len(calls) == 13, "written in-process: meanwhile ran once"
        finally:
            await io_engine.close()
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_send_from_hands_bytes_over_and_answers_with_the_peers_acknowledgement(backend: str, peer: Peer) -> None:
    """send_from: immutable bytes are handed over and the call returns before the peer answers; the
    awaitable it gives is the peer's acknowledgement, carrying the write's error with its type (shared
    memory copies at once: its errors come from the call). Many
    handed over back to back all land. Mutable buffers are refused (the kernel may still read them
    after the call); where tcp ops go through the I/O process the in-process transport hands them over."""

    async def body() -> None:
        engine = TransferEngine(backend=backend)
        io_engine = TransferEngine(backend="tcp", io_process=True)
        try:
            datas = [bytes(rand_bytes(SLOT, 40 + i).numpy()) for i in range(8)]
            acks = [await engine.send_from(d, peer.address, "dst", i * SLOT) for i, d in enumerate(datas)]
            assert all(a is not None for a in acks)
            for a in acks:
                await a
            for i, d in enumerate(datas):
                assert peer.ask("digest", i * SLOT, SLOT) == digest_bytes(d)
            if backend == "tcp":  # a stopped peer cannot answer, yet the call returns; the ack comes once it runs
                os.kill(peer.proc.pid, signal.SIGSTOP)
                try:
                    ack = await asyncio.wait_for(engine.send_from(datas[3], peer.address, "dst", 0), 5)
                    await asyncio.sleep(0.2)
                    assert not ack.done()
                finally:
                    os.kill(peer.proc.pid, signal.SIGCONT)
                await ack
                assert peer.ask("digest", 0, SLOT) == digest_bytes(datas[3])

            async def landed(data: bytes, *args: Any, **kw: Any) -> bool:
                """send_from, then its ack: errors come from the call (shm) or the ack (tcp)."""
                await (await engine.send_from(data, *args, **kw))
                return True

            await _errors_keep_their_types(landed, peer, datas[1])
            with pytest.raises(TypeError, match="bytearray"):
                await engine.send_from(bytearray(datas[0]), peer.address, "dst", 0)
            ack = await io_engine.send_from(datas[2], peer.address, "dst", 0)
            assert ack is not None
            await ack
            assert peer.ask("digest", 0, SLOT) == digest_bytes(datas[2])
        finally:
            await io_engine.close()
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_many_concurrent_single_ops(peer: Peer, backend: str) -> None:
    """Single ops from many tasks at once share the pool's connections: some
    find a connection idle, others queue behind a sender; all land."""

    async def body() -> None:
        for conns in (1, 4):
            engine = TransferEngine(backend=backend, connections_per_peer=conns)
            try:
                n = 16  # 16 x 512 KiB = the peer's 8 MiB
                src = engine.alloc_region("src", n * SLOT)
                src.copy_(rand_bytes(src.numel(), 4 + conns))
                back = engine.alloc_region("back", n * SLOT)
                writes = [TransferOp("write", "src", i * SLOT, peer.address, "dst", i * SLOT, SLOT) for i in range(n)]
                await asyncio.gather(*(engine.submit([op]) for op in writes))
                assert peer.ask("digest", 0, n * SLOT) == digest(src)
                reads = [TransferOp("read", "back", i * SLOT, peer.address, "dst", i * SLOT, SLOT) for i in range(n)]
                await asyncio.gather(*(engine.submit([op]) for op in reads))
                assert torch.equal(back, src)
            finally:
                await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_single_op_to_dead_or_stalled_peer_fails_in_time(backend: str) -> None:
    async def body() -> None:
        engine = TransferEngine(backend=backend, connections_per_peer=1, connect_timeout_s=2)
        blackhole = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never answers
        hole = f"127.0.0.1:{blackhole.getsockname()[1]}"
        try:
            engine.alloc_region("src", 4 * MiB)
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailableError, match="cannot connect"):
                await engine.submit([TransferOp("write", "src", 0, f"127.0.0.1:{closed_port()}", "dst", 0, SLOT)])
            assert time.monotonic() - t0 < 3
            # the engine's first question to a peer (tcp: the op itself; auto: the control query) hits the deadline
            waiting_for_answer = TransferOp("read", "src", 0, hole, "dst", 0, SLOT)
            stuck_sending = TransferOp("write", "src", 0, hole, "dst", 0, 4 * MiB)
            for op in (waiting_for_answer, stuck_sending):
                t0 = time.monotonic()
                with pytest.raises(TransferTimeoutError, match="deadline"):
                    await engine.submit([op], timeout_s=0.5)
                assert time.monotonic() - t0 < 3
            assert engine.stats().outgoing_connections[hole] == 0  # aborted, nothing left in flight
        finally:
            blackhole.close()
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_single_op_after_peer_died_raises_unavailable() -> None:
    """tcp only: over shm a killed peer's segment (never unlinked) still takes copies."""
    peer = Peer("tcp", 8 * MiB)

    async def body() -> None:
        engine = TransferEngine()
        try:
            engine.alloc_region("src", MiB)
            await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, SLOT)])
            peer.proc.kill()
            peer.proc.join(10)
            for kind in ("write", "read"):
                op = TransferOp(kind, "src", 0, peer.address, "dst", 0, SLOT)  # type: ignore[arg-type]
                t0 = time.monotonic()
                with pytest.raises(PeerUnavailableError):
                    await engine.submit([op], timeout_s=2)
                assert time.monotonic() - t0 < 4
        finally:
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_cancelled_single_read_aborts_its_connection() -> None:
    async def body() -> None:
        engine = TransferEngine(connections_per_peer=1)
        blackhole = socket.create_server(("127.0.0.1", 0))
        hole = f"127.0.0.1:{blackhole.getsockname()[1]}"
        try:
            engine.alloc_region("src", MiB)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(engine.submit([TransferOp("read", "src", 0, hole, "dst", 0, SLOT)]), 0.3)
            assert engine.stats().outgoing_connections[hole] == 0
        finally:
            blackhole.close()
            await engine.close()

    run_uv(body())


@pytest.mark.timeout(90)
def test_dropped_shm_region_of_another_process_is_noticed() -> None:
    """The peer drops its region (and makes a new one under the same name):
    the next single op must not land in the dead segment we still map."""
    peer = Peer("shm", 2 * MiB)

    async def body() -> None:
        engine = TransferEngine(backend="shm")
        try:
            src = engine.alloc_region("src", 2 * MiB)
            src.copy_(rand_bytes(2 * MiB, 6))
            await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, SLOT)])
            assert peer.ask("digest", 0, SLOT) == digest(src[:SLOT])
            assert peer.ask("unregister")
            with pytest.raises(UnknownRegionError, match="'dst'"):
                await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, SLOT)])
            assert peer.ask("realloc", MiB)
            await engine.submit([TransferOp("write", "src", SLOT, peer.address, "dst", 0, SLOT)])
            assert peer.ask("digest", 0, SLOT) == digest(src[SLOT : 2 * SLOT])  # in the new segment
            with pytest.raises(OutOfBoundsError, match="dst"):  # and with the new size
                await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", 0, 2 * MiB)])
        finally:
            await engine.close()

    try:
        run_uv(body())
    finally:
        peer.stop()


def test_segment_without_trailer_falls_back_to_its_name() -> None:
    """A segment made by an owner without the liveness trailer is still
    mapped, and its removal is noticed by asking the filesystem."""
    name = f"{SHM_PREFIX}{os.getpid()}-legacy"
    path = os.path.join(SHM_DIR, name)
    with open(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), "wb") as f:  # owner-only, as segments are
        f.write(b"\x07" * 10_000)
    attachments = ShmAttachments()
    try:
        att = attachments.get(name, 10_000)
        assert att.trailer is None and att.tensor.numel() == 10_000 and int(att.tensor[5]) == 7
        assert attachments.alive(name)
        os.unlink(path)
        assert not attachments.alive(name)
    finally:
        attachments.close()
        if os.path.exists(path):
            os.unlink(path)
