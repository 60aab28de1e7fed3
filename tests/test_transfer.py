"""The data plane over real sockets and real processes: tcp backend, errors,
deadlines, garbage on the port, and the two-process tcp and shm paths.

Most tests run on both uvloop (what the daemons use) and the stdlib loop.
Child processes are spawned, never forked (big buffers + fork = CoW faults).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import pytest
import torch
import uvloop
from prometheus_client import REGISTRY
from transfer_helpers import PeerProcess, closed_port, digest, rand_bytes, run_uv

from mooncaked.transfer import (
    OutOfBoundsError,
    PeerUnavailableError,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferTimeoutError,
    UnknownRegionError,
)
from mooncaked.transfer.wire import MAGIC, REQ, VERSION, Op

T = TypeVar("T")
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
MiB = 1024 * 1024


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Awaitable[T]], T]:
    def _run(coro: Awaitable[T]) -> T:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            return runner.run(coro)  # type: ignore[arg-type]

    return _run





def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0



async def pair(**kw: Any) -> tuple[TransferEngine, TransferEngine, str]:
    a, b = TransferEngine(**kw), TransferEngine(**kw)
    await a.start()
    return a, b, await b.start()


# -- one process ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_write_read_roundtrip_same_loop(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair()
        try:
            n = 3 * MiB + 17
            src = a.alloc_region("src", n)
            src.copy_(rand_bytes(n, 1))
            back = a.alloc_region("back", n)
            b.alloc_region("dst", n)
            # a registered tensor of another dtype is addressed by its bytes
            bf = torch.randn(1000, 3, dtype=torch.bfloat16)
            info = a.register("bf16", bf)
            assert info.nbytes == bf.numel() * 2 and info.name == "bf16"
            cuts = [0, 1, 4096, 65536 + 3, MiB, n - bf.numel() * 2, n]
            spans = zip(cuts, cuts[1:], strict=False)
            writes = [TransferOp("write", "src", s, addr, "dst", s, e - s) for s, e in spans]
            await a.submit(writes + [TransferOp("write", "bf16", 0, addr, "dst", n - info.nbytes, info.nbytes)])
            await a.submit([TransferOp("read", "back", 0, addr, "dst", 0, n)])
            expect = src.clone()
            expect[n - info.nbytes :] = bf.view(-1).view(torch.uint8)
            assert torch.equal(back, expect)
            # zero-length ops are legal no-ops
            await a.submit([TransferOp("write", "src", 5, addr, "dst", 5, 0)])
        finally:
            await a.close()
            await b.close()

    run(body())


@pytest.mark.timeout(60)
def test_batch_striped_over_connections(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair(connections_per_peer=4)
        try:
            slot, nops = 64 * 1024, 256
            src = a.alloc_region("src", slot * nops)
            src.copy_(rand_bytes(src.numel(), 2))
            back = a.alloc_region("back", slot * nops)
            dst = b.alloc_region("dst", 2 * slot * nops)
            dst[slot * nops :].copy_(rand_bytes(slot * nops, 3))
            g = torch.Generator().manual_seed(4)
            perm = torch.randperm(nops, generator=g).tolist()
            sizes = torch.randint(1, slot + 1, (nops,), generator=g).tolist()
            ops = [TransferOp("write", "src", i * slot, addr, "dst", perm[i] * slot, sizes[i]) for i in range(nops)]
            # reads of the other half ride in the same batch
            ops += [
                TransferOp("read", "back", i * slot, addr, "dst", (nops + i) * slot, slot) for i in range(nops)
            ]
            await a.submit(ops)
            for i in range(nops):
                s = sizes[i]
                assert torch.equal(dst[perm[i] * slot : perm[i] * slot + s], src[i * slot : i * slot + s]), i
            assert torch.equal(back, dst[slot * nops :])
            stats = b.stats()
            assert stats.incoming_connections == 4
            assert sum(stats.ops_per_incoming_connection) == 2 * nops
            assert min(stats.ops_per_incoming_connection) > nops // 4, stats  # striped, not piled on one
            assert a.stats().outgoing_connections == {addr: 4}
        finally:
            await a.close()
            await b.close()

    run(body())


@pytest.mark.timeout(60)
def test_remote_errors_are_typed_and_server_keeps_serving(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair(connections_per_peer=1)
        try:
            src = a.alloc_region("src", MiB)
            src.copy_(rand_bytes(MiB, 5))
            dst = b.alloc_region("dst", MiB)
            with pytest.raises(UnknownRegionError, match=f"{addr}.*'nope'"):
                await a.submit([TransferOp("write", "src", 0, addr, "nope", 0, 1000)])
            with pytest.raises(OutOfBoundsError, match="dst.*outside its 1048576 bytes"):
                await a.submit([TransferOp("write", "src", 0, addr, "dst", MiB - 10, 11)])
            with pytest.raises(OutOfBoundsError, match="dst"):
                await a.submit([TransferOp("read", "src", 0, addr, "dst", MiB, 1)])
            # a bad op in a batch fails alone; its payload is drained so the good ops around it land
            batch = [
                TransferOp("write", "src", 0, addr, "dst", 0, 4096),
                TransferOp("write", "src", 4096, addr, "dst", MiB - 100, 4096),  # out of bounds
                TransferOp("write", "src", 8192, addr, "dst", 8192, 4096),
                TransferOp("read", "src", 0, addr, "ghost", 0, 10),  # unknown
            ]
            with pytest.raises(OutOfBoundsError) as info:
                await a.submit(batch)
            assert any("1 more of the 4 ops" in note for note in info.value.__notes__)
            assert torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[8192:12288], src[8192:12288])
            assert not dst[4096:8192].any()
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, MiB)])
            assert torch.equal(dst, src)
            assert b.stats().incoming_connections == 1  # the same connection carried it all
        finally:
            await a.close()
            await b.close()

    run(body())


@pytest.mark.timeout(60)
def test_local_errors_fail_before_any_io(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a = TransferEngine()
        a.alloc_region("src", 1000)
        peer = f"127.0.0.1:{closed_port()}"
        with pytest.raises(UnknownRegionError, match="local region 'nah'"):
            await a.submit([TransferOp("write", "nah", 0, peer, "dst", 0, 1)])
        with pytest.raises(OutOfBoundsError, match="local region 'src'"):
            await a.submit([TransferOp("read", "src", 999, peer, "dst", 0, 2)])
        with pytest.raises(TransferError, match="unknown kind"):
            await a.submit([TransferOp("copy", "src", 0, peer, "dst", 0, 1)])  # type: ignore[arg-type]
        with pytest.raises(TransferError, match="already registered"):
            a.alloc_region("src", 10)
        assert a.stats().outgoing_connections == {}
        await a.close()

    run(body())


def _garbage_cases() -> dict[str, bytes]:
    def req(**kw: int) -> bytes:
        f = {"magic": MAGIC, "version": VERSION, "op": Op.WRITE, "name_len": 3, "length": 10, "offset": 0}
        f.update(kw)
        return REQ.pack(f["magic"], f["version"], f["op"], f["name_len"], 1, f["offset"], f["length"], b"dst")

    return {
        "bad magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100),
        "unsupported version": req(version=VERSION + 7),
        "unknown op": req(op=77),
        "absurd range": req(length=1 << 62),
        "bad region name length": req(name_len=500),
    }


@pytest.mark.timeout(60)
def test_garbage_bytes_close_the_connection_only(
    run: Callable[[Awaitable[None]], None], caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        a, b, addr = await pair()
        host, port = addr.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        try:
            a.alloc_region("src", 4096)
            b.alloc_region("dst", 4096)
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 4096)])  # pool is warm
            for reason, junk in _garbage_cases().items():
                with socket.create_connection((host, int(port)), timeout=5) as raw:
                    raw.setblocking(False)
                    await loop.sock_sendall(raw, junk)
                    try:  # closed = EOF, or a reset when junk was left unread
                        got = await asyncio.wait_for(loop.sock_recv(raw, 100), 5)
                    except ConnectionResetError:
                        got = b""
                    assert got == b"", f"{reason}: server answered {got!r} instead of closing"
                assert reason in caplog.text, reason
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 4096)])
            await a.submit([TransferOp("read", "src", 0, addr, "dst", 0, 4096)])
        finally:
            await a.close()
            await b.close()

    with caplog.at_level(logging.WARNING, logger="mooncaked.transfer.tcp_server"):
        run(body())


@pytest.mark.timeout(60)
def test_a_connection_closed_for_garbage_goes_even_if_its_peer_never_takes_the_answers_owed(
    run: Callable[[Awaitable[None]], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncaked.transfer import conn_guard
    from mooncaked.transfer.wire import pack_request

    monkeypatch.setattr(conn_guard, "CLOSE_FLUSH_S", 0.5)

    async def body() -> None:
        engine = TransferEngine()
        host, port = (await engine.start()).rsplit(":", 1)
        try:
            engine.alloc_region("src", 256 * 1024)
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes little, and never reads
            raw.connect((host, int(port)))
            server = engine._server
            for _ in range(500):
                conns = [c for c in server.connections if c._peer.endswith(f":{raw.getsockname()[1]}")]
                if conns:
                    break
                await asyncio.sleep(0.01)
            conn = conns[0]
            conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            reads = b"".join(pack_request(Op.READ, i, b"src", 0, 256 * 1024) for i in range(1, 9))
            raw.sendall(reads + b"GET / HTTP/1.1\r\n\r\n" + bytes(100))  # 2 MiB of answers owed, then garbage
            for _ in range(500):
                if conn not in server.connections:
                    break
                await asyncio.sleep(0.01)
            assert conn not in server.connections, "a closed connection waits for ever on a peer that never reads"
            raw.close()
        finally:
            await engine.close()

    run(body())


@pytest.mark.timeout(60)
def test_peer_down_fails_fast_and_blackhole_hits_deadline(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair(connections_per_peer=1)
        blackhole = socket.create_server(("127.0.0.1", 0))  # accepts (kernel backlog), never answers
        hole = f"127.0.0.1:{blackhole.getsockname()[1]}"
        try:
            a.alloc_region("src", 8 * MiB)
            b.alloc_region("dst", 8 * MiB)
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailableError, match="cannot connect"):
                await a.submit([TransferOp("write", "src", 0, f"127.0.0.1:{closed_port()}", "dst", 0, 10)])
            assert time.monotonic() - t0 < 2
            for op, length in (("read", 10), ("write", 8 * MiB)):  # waiting for an answer; stuck sending
                t0 = time.monotonic()
                with pytest.raises(TransferTimeoutError, match="deadline"):
                    await a.submit([TransferOp(op, "src", 0, hole, "dst", 0, length)], timeout_s=0.5)  # type: ignore[arg-type]
                assert time.monotonic() - t0 < 3
            assert a.stats().outgoing_connections[hole] == 0  # aborted, nothing left in flight
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 8 * MiB)])  # engine still fine
        finally:
            blackhole.close()
            await a.close()
            await b.close()

    run(body())


@pytest.mark.timeout(60)
def test_cancelled_submit_aborts_and_engine_recovers(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair(connections_per_peer=1)
        blackhole = socket.create_server(("127.0.0.1", 0))
        hole = f"127.0.0.1:{blackhole.getsockname()[1]}"
        try:
            a.alloc_region("src", 16 * MiB)
            b.alloc_region("dst", 16 * MiB)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(a.submit([TransferOp("write", "src", 0, hole, "dst", 0, 16 * MiB)]), 0.3)
            assert a.stats().outgoing_connections[hole] == 0
            await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 16 * MiB)])
        finally:
            blackhole.close()
            await a.close()
            await b.close()

    run(body())


@pytest.mark.timeout(60)
def test_peer_restart_on_same_port_is_retried(run: Callable[[Awaitable[None]], None]) -> None:
    async def body() -> None:
        a, b, addr = await pair()
        port = int(addr.rsplit(":", 1)[1])
        src = a.alloc_region("src", 4096)
        src.copy_(rand_bytes(4096, 9))
        b.alloc_region("dst", 4096)
        op = TransferOp("write", "src", 0, addr, "dst", 0, 4096)
        await a.submit([op])
        await b.close()
        with pytest.raises(PeerUnavailableError):
            await a.submit([op])
        b2 = TransferEngine(port=port)
        assert await b2.start() == addr
        dst = b2.alloc_region("dst", 4096)
        await a.submit([op])  # the pool dropped the dead connections and reconnects
        assert torch.equal(dst, src)
        await a.close()
        await b2.close()

    run(body())


@pytest.mark.timeout(60)
def test_rate_limit_paces_both_directions() -> None:
    async def body() -> None:
        rate = 8e6
        a, b = TransferEngine(rate_limit_bytes_per_s=rate), TransferEngine(rate_limit_bytes_per_s=rate)
        addr = await b.start()
        try:
            src = a.alloc_region("src", 2 * MiB)
            src.copy_(rand_bytes(2 * MiB, 6))
            dst = b.alloc_region("dst", 2 * MiB)
            expected = 2 * MiB / rate
            for op in ("write", "read"):  # read: the serving side (b) paces
                t0 = time.monotonic()
                await a.submit([TransferOp(op, "src", 0, addr, "dst", 0, 2 * MiB)])  # type: ignore[arg-type]
                took = time.monotonic() - t0
                assert 0.8 * expected < took < expected + 2, (op, took)
            assert torch.equal(src, dst)
        finally:
            await a.close()
            await b.close()

    run_uv(body())


@pytest.mark.timeout(60)
def test_deadline_bounds_stalls_not_long_pipelines() -> None:
    """A batch that moves steadily may take many times timeout_s in total."""

    async def body() -> None:
        rate = 4e6
        a = TransferEngine(rate_limit_bytes_per_s=rate, connections_per_peer=1)
        b = TransferEngine(rate_limit_bytes_per_s=rate)
        addr = await b.start()
        try:
            a.alloc_region("src", 4 * MiB)
            b.alloc_region("dst", 4 * MiB)
            blk = 256 * 1024  # ~65 ms each at 4 MB/s; the whole batch ~1 s
            for op in ("read", "write"):
                t0 = time.monotonic()
                ops = [TransferOp(op, "src", o, addr, "dst", o, blk) for o in range(0, 4 * MiB, blk)]  # type: ignore[arg-type]
                await a.submit(ops, timeout_s=0.4)
                assert time.monotonic() - t0 > 0.8, op  # really longer than the deadline
        finally:
            await a.close()
            await b.close()

    run_uv(body())


@pytest.mark.timeout(60)
def test_metrics_count_bytes_by_backend() -> None:
    async def body() -> None:
        a, b, addr = await pair()
        a.alloc_region("src", 100_000)
        b.alloc_region("dst", 100_000)
        sent0 = sample("mooncaked_transfer_sent_bytes_total", backend="tcp")
        recv0 = sample("mooncaked_transfer_received_bytes_total", backend="tcp")
        write_ok = {"backend": "tcp", "op": "write", "role": "initiator", "result": "ok"}
        ok0 = sample("mooncaked_transfer_ops_total", **write_ok)
        await a.submit([TransferOp("write", "src", 0, addr, "dst", 0, 100_000)])
        await a.submit([TransferOp("read", "src", 0, addr, "dst", 0, 30_000)])
        # one process holds both ends: sent = write (a) + read served (b); received likewise
        assert sample("mooncaked_transfer_sent_bytes_total", backend="tcp") - sent0 == 130_000
        assert sample("mooncaked_transfer_received_bytes_total", backend="tcp") - recv0 == 130_000
        assert sample("mooncaked_transfer_ops_total", **write_ok) == ok0 + 1
        await a.close()
        await b.close()

    run_uv(body())


# -- two processes ---------------------------------------------------------------
def _peer_main(pipe: Connection, backend: str, nbytes: int) -> None:
    """A transfer peer in its own process, driven over a pipe."""

    async def main() -> None:
        engine = TransferEngine(backend=backend)
        regions = {"dst": engine.alloc_region("dst", nbytes), "plain": torch.zeros(4096, dtype=torch.uint8)}
        engine.register("plain", regions["plain"])
        pipe.send(await engine.start())
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, pipe.recv)
            if cmd == "stop":
                break
            if cmd == "digest":
                name, off, n = args
                pipe.send(digest(regions[name][off : off + n]))
            elif cmd == "served":
                pipe.send(sum(engine.stats().ops_per_incoming_connection))
        await engine.close()

    uvloop.run(main())


def Peer(backend: str, nbytes: int) -> PeerProcess:  # noqa: N802 - reads as the handle it makes
    return PeerProcess(_peer_main, backend, nbytes)


def shm_names(pid: int) -> set[str]:
    """Segments made by process pid (names carry it), so other suites' don't count."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"mooncaked-{pid}-")}


@pytest.mark.timeout(90)
def test_tcp_roundtrip_between_two_processes() -> None:
    n = 8 * MiB
    peer = Peer("tcp", n)

    async def body() -> None:
        engine = TransferEngine()
        try:
            src = engine.alloc_region("src", n)
            src.copy_(rand_bytes(n, 7))
            back = engine.alloc_region("back", n)
            blk = 128 * 1024
            await engine.submit([TransferOp("write", "src", o, peer.address, "dst", o, blk) for o in range(0, n, blk)])
            assert peer.ask("digest", "dst", 0, n) == digest(src)  # the bytes are in the peer's memory
            await engine.submit([TransferOp("read", "back", o, peer.address, "dst", o, blk) for o in range(0, n, blk)])
            assert torch.equal(back, src)
        finally:
            await engine.close()

    try:
        run_uv(body())
    finally:
        peer.stop()


@pytest.mark.timeout(90)
def test_shm_roundtrip_between_two_processes_without_leaks() -> None:
    n = 8 * MiB
    peer = Peer("shm", n)
    assert len(shm_names(peer.proc.pid)) == 1  # the peer's "dst"; "plain" is ordinary memory

    async def body() -> None:
        engine = TransferEngine(backend="shm")
        try:
            src = engine.alloc_region("src", n)
            src.copy_(rand_bytes(n, 8))
            back = engine.alloc_region("back", n)
            shm0 = sample("mooncaked_transfer_sent_bytes_total", backend="shm")
            tcp0 = sample("mooncaked_transfer_sent_bytes_total", backend="tcp")
            blk = MiB
            await engine.submit([TransferOp("write", "src", o, peer.address, "dst", o, blk) for o in range(0, n, blk)])
            assert peer.ask("digest", "dst", 0, n) == digest(src)
            await engine.submit([TransferOp("read", "back", 0, peer.address, "dst", 0, n)])
            assert torch.equal(back, src)
            assert sample("mooncaked_transfer_sent_bytes_total", backend="shm") - shm0 == n
            assert sample("mooncaked_transfer_sent_bytes_total", backend="tcp") == tcp0
            assert peer.ask("served") == 1  # only the info query went over tcp
            with pytest.raises(OutOfBoundsError, match="dst"):
                await engine.submit([TransferOp("write", "src", 0, peer.address, "dst", n - 1, 2)])
            with pytest.raises(TransferError, match="not in shared memory"):
                await engine.submit([TransferOp("write", "src", 0, peer.address, "plain", 0, 4096)])
        finally:
            await engine.close()

    try:
        run_uv(body())
    finally:
        peer.stop()
    assert shm_names(peer.proc.pid) == set() and shm_names(os.getpid()) == set()
