"""The tcp transport's I/O-process mode (TransferEngine(io_process=True)): the socket work runs in a
child process over the engine's shared-memory regions. Real processes and real sockets on loopback:
bytes land both ways through the child, remote errors keep their types, the cluster secret is
proved by the child, deadlines and cancellation reach it, a killed child fails the batches in
flight with a clear error (not a hang) and the next submit starts a fresh one, and the child follows
its engine on close and on the engine's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest
import torch
import uvloop
from transfer_helpers import rand_bytes, run_uv

from mooncaked.transfer import io_transport, io_worker
from mooncaked.transfer import (
    OutOfBoundsError,
    PeerUnavailableError,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferTimeoutError,
    UnknownRegionError,
)

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(autouse=True)
def _small_shares_go_to_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests move 4-8 MiB shares: route them through the child as bigger ones are (the engines' own
    threshold, io_transport.MIN_SHARE_BYTES, is where the hop stops costing on an idle host)."""
    monkeypatch.setattr(io_transport, "MIN_SHARE_BYTES", 2 * MiB)
SECRET = b"io-process-test-secret"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _shm_files() -> list[str]:
    return os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []


def _wait_gone(pid: int) -> None:
    """Until the process is gone (reaped or a zombie of a dead parent); the test's timeout bounds it."""
    while _alive(pid):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not ours (its parent died): gone once only a zombie is left
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] == "Z":
                        return
            except FileNotFoundError:
                return
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_bytes_land_both_ways_through_the_io_process_with_typed_errors() -> None:
    async def body() -> None:
        io = TransferEngine(io_process=True, token=SECRET)
        peer = TransferEngine(token=SECRET)
        addr = await peer.start()
        await io.start()
        try:
            pid = io.stats().io_process_pid
            assert pid is not None and pid != os.getpid() and _alive(pid)
            with open(f"/proc/{pid}/cmdline", "rb") as f:  # what ps shows: what it is, whose (proc_title.py)
                assert f.read().rstrip(b"\0") == f"mooncaked transfer-io (of pid {os.getpid()})".encode()
            n = 8 * MiB
            src = io.alloc_region("src", n)
            src.copy_(rand_bytes(n, 1))
            back = io.alloc_region("back", n)
            dst = peer.alloc_region("dst", n)
            await io.submit([TransferOp("write", "src", o, addr, "dst", o, 2 * MiB) for o in range(0, n, 2 * MiB)])
            assert torch.equal(dst, src)
            # its regions are memfds the child maps (handed over by descriptor), not files in /dev/shm that a
            # killed engine would leave behind
            assert not [f for f in _shm_files() if f.startswith(f"mooncaked-{os.getpid()}-")]
            with open(f"/proc/{pid}/maps") as f:
                assert f.read().count("memfd:mooncaked-region") >= 2
            # many small reads: more than one window of requests ahead of their answers on a connection
            await io.submit([TransferOp("read", "back", o, addr, "dst", o, 4 * KiB) for o in range(0, n, 4 * KiB)])
            assert torch.equal(back, src)
            back.zero_()
            good = TransferOp("read", "back", 0, addr, "dst", 0, 4 * MiB)  # big enough a share for the child
            with pytest.raises(UnknownRegionError, match="'nope'"):
                await io.submit([TransferOp("write", "src", 0, addr, "nope", 0, 16), good])
            assert torch.equal(back[: 4 * MiB], src[: 4 * MiB])  # the batch's good op still ran
            with pytest.raises(OutOfBoundsError, match="dst"):
                await io.submit([TransferOp("write", "src", 0, addr, "dst", n - 1, 16), good])
            # a caller's own tensor is not in shared memory: the in-process tcp transport carries it
            plain = rand_bytes(MiB, 2)
            io.register("plain", plain)
            await io.submit([TransferOp("write", "plain", 0, addr, "dst", 0, MiB)])
            assert torch.equal(dst[:MiB], plain)
            # and a caller's bytes go as they are, in-process, with no staging (a single pool put's path)
            assert await io.write_from(bytes(src[:MiB].numpy()), addr, "dst", MiB)
            ack = await io.send_from(bytes(src[MiB:2 * MiB].numpy()), addr, "dst", 2 * MiB)
            assert ack is not None
            await ack
            assert torch.equal(dst[MiB:2 * MiB], src[:MiB]) and torch.equal(dst[2 * MiB:3 * MiB], src[MiB:2 * MiB])
            assert io.stats().io_process_pid == pid  # one child served it all
        finally:
            await io.close()
            await peer.close()
        _wait_gone(pid)
        assert not _alive(pid)

    run_uv(body())


@pytest.mark.timeout(120)
def test_the_io_process_proves_the_secret_and_refuses_a_peer_without_it() -> None:
    async def body() -> None:
        io = TransferEngine(io_process=True, token=SECRET)
        wrong = TransferEngine(token=b"another-secret")
        none = TransferEngine()
        addr_wrong, addr_none = await wrong.start(), await none.start()
        await io.start()
        try:
            io.alloc_region("src", 4 * MiB)
            wrong.alloc_region("dst", 4 * MiB)
            none.alloc_region("dst", 4 * MiB)
            with pytest.raises(PeerUnavailableError, match="secret"):
                await io.submit([TransferOp("write", "src", 0, addr_wrong, "dst", 0, 4 * MiB)])
            with pytest.raises(PeerUnavailableError, match="handshake"):
                await io.submit([TransferOp("write", "src", 0, addr_none, "dst", 0, 4 * MiB)])
        finally:
            await io.close()
            await wrong.close()
            await none.close()

    run_uv(body())


@dataclass
class Rig:
    """An io_process engine with an 8 MiB source, a live peer with an 8 MiB region, and a blackhole
    (a port that accepts in the kernel's backlog and never answers)."""

    io: TransferEngine
    addr: str
    hole: str
    src: torch.Tensor
    dst: torch.Tensor


@contextlib.asynccontextmanager
async def rig(seed: int) -> AsyncIterator[Rig]:
    io = TransferEngine(io_process=True, connections_per_peer=1)
    peer = TransferEngine()
    addr = await peer.start()
    await io.start()
    blackhole = socket.create_server(("127.0.0.1", 0))
    try:
        src = io.alloc_region("src", 8 * MiB)
        src.copy_(rand_bytes(8 * MiB, seed))
        yield Rig(io, addr, f"127.0.0.1:{blackhole.getsockname()[1]}", src, peer.alloc_region("dst", 8 * MiB))
    finally:
        blackhole.close()
        await io.close()
        await peer.close()


@pytest.mark.timeout(120)
def test_deadline_and_cancel_reach_the_io_process() -> None:
    async def body() -> None:
        async with rig(3) as r:
            for op in (TransferOp("read", "src", 0, r.hole, "dst", 0, 8 * MiB),
                       TransferOp("write", "src", 0, r.hole, "dst", 0, 8 * MiB)):  # waiting for an answer; stuck sending
                with pytest.raises(TransferTimeoutError, match="deadline"):
                    await r.io.submit([op], timeout_s=0.5)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(r.io.submit([TransferOp("write", "src", 0, r.hole, "dst", 0, 8 * MiB)]), 0.3)
            await r.io.submit([TransferOp("write", "src", 0, r.addr, "dst", 0, 8 * MiB)])  # the engine still works
            assert torch.equal(r.dst, r.src)

    run_uv(body())


STUCK_BATCHES = 40  # more than the one pool of 32 threads had, and than one peer's MAX_PEER_THREADS


@pytest.mark.timeout(120)
def test_batches_stuck_on_a_stalled_peer_do_not_hold_up_another_peers() -> None:
    """More batches to a peer that never answers than the I/O process has threads for: a healthy peer's
    write must still go (before, one pool of threads served every peer and this write waited for the
    stuck batches' deadline)."""
    assert STUCK_BATCHES > io_worker.MAX_PEER_THREADS

    async def body() -> None:
        async with rig(6) as r:
            stuck = [asyncio.ensure_future(r.io.submit([TransferOp("write", "src", 0, r.hole, "dst", 0, 2 * MiB)],
                                                       timeout_s=90)) for _ in range(STUCK_BATCHES)]
            await asyncio.sleep(0.5)  # every stuck batch reaches the child first
            try:  # a hang guard, not a timing: the stuck batches wait 90 s
                await asyncio.wait_for(r.io.submit([TransferOp("write", "src", 0, r.addr, "dst", 0, 8 * MiB)]), 45)
            finally:
                assert not any(f.done() for f in stuck), "a stuck batch ended: the write above proves nothing"
                for f in stuck:
                    f.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
            assert torch.equal(r.dst, r.src)

    run_uv(body())


@pytest.mark.timeout(120)
def test_a_killed_io_process_fails_the_batch_in_flight_and_a_fresh_one_takes_over() -> None:
    async def body() -> None:
        async with rig(4) as r:
            pid = r.io.stats().io_process_pid
            assert pid is not None
            stuck = asyncio.ensure_future(r.io.submit([TransferOp("write", "src", 0, r.hole, "dst", 0, 8 * MiB)],
                                                      timeout_s=600))
            await asyncio.sleep(0.2)  # let the command reach the child (a kill before it arrives fails it all the same)
            assert not stuck.done()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(PeerUnavailableError, match=f"I/O process {pid} exited"):
                await stuck  # the pytest timeout would catch a hang
            # a small share stays in-process (the hop would cost more than it moves): no child needed
            await r.io.submit([TransferOp("write", "src", 0, r.addr, "dst", 0, 64 * KiB)])
            assert torch.equal(r.dst[: 64 * KiB], r.src[: 64 * KiB])
            assert r.io.stats().io_process_pid is None
            await r.io.submit([TransferOp("write", "src", 0, r.addr, "dst", 0, 8 * MiB)])
            assert torch.equal(r.dst, r.src)
            fresh = r.io.stats().io_process_pid
            assert fresh is not None and fresh != pid

    run_uv(body())


def _engine_that_dies(pipe: Connection) -> None:
    async def main() -> None:
        io = TransferEngine(io_process=True)
        await io.start()
        pipe.send(io.stats().io_process_pid)
        await asyncio.sleep(3600)  # killed by the test

    uvloop.run(main())


@pytest.mark.timeout(120)
def test_the_io_process_follows_its_engine_when_the_engine_dies() -> None:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_engine_that_dies, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(60), "the engine process did not start"
    pid = parent.recv()
    assert _alive(pid)
    proc.kill()
    proc.join(10)
    _wait_gone(pid)


def test_io_process_and_a_rate_limit_are_refused_together() -> None:
    with pytest.raises(TransferError, match="does not pace"):
        TransferEngine(io_process=True, rate_limit_bytes_per_s=1e6)
