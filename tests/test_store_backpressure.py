"""One peer cannot take a store server over by the requests it sends (guarded_conn.py): the master's
fast path and an owner's reads by key stop reading a peer whose answers pile up unread, and answer
at most a turn's worth of one connection's requests before the event loop serves the others; the
fast path reads no more of a connection with MAX_RUNNING calls waiting.

Real master, real clients, real sockets on loopback; the flooding peer is a raw socket in a thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import pytest
from store_helpers import ask, client, held, owner_process, pool, start

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.store import service
from mooncaked.store.fast_path import MAX_RUNNING
from mooncaked.store.fast_wire import HEADER, HELLO, REPLY, pack_request
from mooncaked.store.guarded_conn import MAX_PER_TURN, WRITE_HIGH
from mooncaked.store.owner_wire import KeyRequest
from mooncaked.store.owner_wire import pack_request as owner_request

pytestmark = pytest.mark.timeout(90)
KiB = 1024
GIVE_UP_S = 20.0  # a server that never holds the flooder off: the flood ends here (and the test fails)
HELD_S = 1.0  # how long the flood goes on once the server holds it off (its memory must not grow meanwhile)


class Flood(threading.Thread):
    """Sends `frame` over and over on a connection and never reads, until told to stop."""

    def __init__(self, port: int, greeting: bytes, frame: bytes) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(greeting)
        self.data = memoryview(frame * 512)
        self.sent = 0
        self.stop = threading.Event()

    def run(self) -> None:
        self.sock.setblocking(False)
        t0 = time.monotonic()
        while not self.stop.is_set() and time.monotonic() - t0 < GIVE_UP_S:
            try:
                self.sent += self.sock.send(self.data[self.sent % len(self.data):])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                return

    def local_port(self) -> int:
        return self.sock.getsockname()[1]


async def flooded(flood: Flood, conn, meanwhile) -> int:  # noqa: ANN001 - the server's protocol object
    """Run the flood until the server holds the flooder off (its answers unread), then HELD_S more, doing
    `meanwhile()` (another client's calls) all along; the most answers the server queued for it."""
    flood.start()
    worst, held_at, loop = 0, None, asyncio.get_running_loop()
    while flood.is_alive():
        await meanwhile()
        worst = max(worst, conn._transport.get_write_buffer_size())
        if held_at is None and "answers" in conn._holds:
            held_at = loop.time()
        if held_at is not None and loop.time() - held_at > HELD_S:
            assert "answers" in conn._holds and not conn._transport.is_reading()  # still held off
            flood.stop.set()
        await asyncio.sleep(0.01)
    assert held_at is not None, f"the server took the flood without holding it off: {flood.sent} bytes in {GIVE_UP_S}s"
    return worst


async def conn_of(connections: set, port: int):  # noqa: ANN201 - the server's protocol object for our socket
    """The server side of the connection from our local `port`, once the server has accepted it."""
    for _ in range(500):
        found = [c for c in connections if c._peer.endswith(f":{port}")]
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no connection from port {port} among {[c._peer for c in connections]}")


async def test_a_peer_that_never_reads_its_answers_stalls_only_itself_on_the_masters_fast_path():
    runner, addr = await start()
    other = await client(addr, "other", dram_bytes=256 * KiB)
    try:
        flood = Flood(runner.fast_path.port, HELLO,
                      pack_request(1, "PoolStats", 5000, store_pb2.PoolStatsRequest().SerializeToString()))
        conn = await conn_of(runner.fast_path.connections, flood.local_port())
        puts = 0

        async def meanwhile() -> None:  # the others are served all along
            nonlocal puts
            puts += 1
            assert await other.put(f"k{puts % 7}", os.urandom(4 * KiB))
            assert await other.get(f"k{puts % 7}") is not None

        worst = await flooded(flood, conn, meanwhile)
        # what it holds for the flooder: one write buffer, plus the turn in progress when it filled
        assert worst <= WRITE_HIGH + MAX_PER_TURN * 256, worst
        assert await other.get("k0") is not None
        flood.sock.close()
    finally:
        await other.close()
        await runner.stop()


async def test_a_peer_that_never_reads_its_answers_stalls_only_itself_on_an_owners_reads_by_key():
    clients = ("owner", dict(dram_bytes=1 << 20)), ("reader", {})
    async with pool(*clients) as (_, (owner, reader)):
        data = os.urandom(16 * KiB)
        assert await reader.put("b/a", data)
        await held(owner, "b/a")
        port = int(owner.owner_server.address.rsplit(":", 1)[1])
        flood = Flood(port, b"", owner_request(KeyRequest(1, "absent", 4096, 1)))
        conn = await conn_of(owner.owner_server.connections, flood.local_port())

        async def meanwhile() -> None:
            assert await reader.get("b/a") == data

        worst = await flooded(flood, conn, meanwhile)
        assert worst <= conn.write_high + MAX_PER_TURN * 64, worst
        flood.sock.close()


async def greeted(runner, rcvbuf: int = 0):  # noqa: ANN001, ANN201
    """A raw socket to the master's fast path that said hello, and the master's side of it."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", runner.fast_path.port))
    sock.sendall(HELLO)
    conn = await conn_of(runner.fast_path.connections, sock.getsockname()[1])
    for _ in range(200):
        if conn._greeted:
            break
        await asyncio.sleep(0.01)
    assert conn._greeted
    return sock, conn


async def test_one_connection_gets_a_turns_worth_of_answers_then_waits_for_the_others():
    runner, _ = await start()
    try:
        sock, conn = await greeted(runner)
        answered = []
        reply = conn._reply

        def counting(call_id: int, answer: tuple[int, bytes]) -> None:
            answered.append(call_id)
            reply(call_id, answer)

        conn._reply = counting
        n = 10 * MAX_PER_TURN + 5
        body = store_pb2.PoolStatsRequest().SerializeToString()
        conn.data_received(b"".join(pack_request(i, "PoolStats", 5000, body) for i in range(1, n + 1)))
        assert len(answered) == MAX_PER_TURN  # this turn's share; the rest wait, reading paused
        assert not conn._transport.is_reading()
        turns = 0
        while len(answered) < n and turns < 100:
            before = len(answered)
            await asyncio.sleep(0)
            assert len(answered) - before <= MAX_PER_TURN
            turns += 1
        assert answered == list(range(1, n + 1))
        assert conn._transport.is_reading()  # all answered: reading again
        sock.settimeout(10)
        got = bytearray()
        ids = []
        while len(ids) < n:  # the answers, in order, each a whole PoolStats reply
            got += sock.recv(1 << 16)
            while len(got) >= HEADER.size:
                size, kind, status, _, call_id, _ = HEADER.unpack_from(got)
                if len(got) < HEADER.size + size:
                    break
                assert kind == REPLY and status == 0
                store_pb2.PoolStatsReply.FromString(bytes(got[HEADER.size:HEADER.size + size]))
                ids.append(call_id)
                del got[:HEADER.size + size]
        assert ids == list(range(1, n + 1))
        sock.close()
    finally:
        await runner.stop()


async def test_a_connection_closed_for_garbage_goes_even_if_its_peer_never_takes_the_answers_owed(monkeypatch):
    from mooncaked.transfer import conn_guard

    monkeypatch.setattr(conn_guard, "CLOSE_FLUSH_S", 0.5)
    runner, _ = await start()
    try:
        sock, conn = await greeted(runner, rcvbuf=4096)  # takes little, and never reads
        # the kernel holds little of what the master sends it, so answers stay owed in the process
        conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        body = store_pb2.PoolStatsRequest().SerializeToString()
        frames = b"".join(pack_request(i, "PoolStats", 5000, body) for i in range(1, 2001))
        conn.data_received(frames + b"\xff" * 64)  # ~50 KB of answers owed (under the high mark), then garbage
        for _ in range(500):
            if conn not in runner.fast_path.connections:
                break
            await asyncio.sleep(0.01)
        assert conn._closed
        assert conn not in runner.fast_path.connections, "a closed connection waits for ever on a peer that never reads"
        sock.close()
    finally:
        await runner.stop()


async def test_a_connection_with_max_running_calls_waiting_is_read_no_further_until_they_end(monkeypatch):
    """Removes wait for an owner that cannot acknowledge (stopped): once MAX_RUNNING of one connection's
    calls wait, the master reads no more of it; others are served meanwhile, and every call is answered
    once the owner's window runs out."""
    monkeypatch.setattr(service, "SERVE_WINDOW_S", 1.5)
    runner, addr = await start(client_ttl_s=60.0)  # the master keeps the stopped owner mounted
    proc = owner_process(addr, "stopped")
    writer = await client(addr, "writer")
    sock = None
    try:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, proc.stdout.readline) == "ready\n"
        n = MAX_RUNNING + MAX_PER_TURN + 7
        assert all(await writer.batch_put([(f"r/{i}", os.urandom(1 * KiB)) for i in range(n)]))
        async with asyncio.timeout(10):  # its journal (in order) holds the last key, so all of them
            while await ask(proc, f"r/{n - 1}") != "held":
                await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)
        sock, conn = await greeted(runner)
        frames = b"".join(pack_request(i + 1, "Remove", 10_000,
                                       store_pb2.RemoveRequest(keys=[f"r/{i}"]).SerializeToString()) for i in range(n))
        sock.sendall(frames)
        most, held_at = 0, None
        async with asyncio.timeout(10):
            while held_at is None:
                most = max(most, len(conn._tasks))
                if "running" in conn._holds:
                    held_at = loop.time()
                await asyncio.sleep(0)
        assert len(conn._tasks) == MAX_RUNNING and not conn._transport.is_reading()
        assert conn._frames == MAX_RUNNING  # the rest wait unread
        assert await writer.pool_stats() is not None  # another connection is served meanwhile
        assert await writer.exist(f"r/{n - 1}")  # (a put would go to the stopped owner's DRAM, the only one)
        while conn._tasks:
            most = max(most, len(conn._tasks))
            await asyncio.sleep(0.005)
        assert most <= MAX_RUNNING, most
        sock.settimeout(10)
        got, removed = bytearray(), {}
        while len(removed) < n:  # every call answered, each key removed once
            got += sock.recv(1 << 16)
            while len(got) >= HEADER.size:
                size, kind, status, _, call_id, _ = HEADER.unpack_from(got)
                if len(got) < HEADER.size + size:
                    break
                assert kind == REPLY and status == 0, bytes(got[HEADER.size:HEADER.size + size])
                removed[call_id] = store_pb2.RemoveReply.FromString(bytes(got[HEADER.size:HEADER.size + size])).removed
                del got[:HEADER.size + size]
        assert sorted(removed) == list(range(1, n + 1)) and set(removed.values()) == {1}
        assert loop.time() - held_at > 0.5  # they waited for the window, not for an acknowledgement
    finally:
        if sock is not None:
            sock.close()
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        await writer.close()
        await runner.stop()
