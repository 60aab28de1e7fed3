"""Gets by key from an object's owner (store/owner_server.py, owner_link.py), against a real master
and real clients on loopback: one round trip with no master, never a removed or re-put object, a
stalled owner's window closing before a Remove is answered, and the cluster secret."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest
from store_helpers import ask, client, held, metric, owner_process, pool, start, until

from mooncaked.security import Security
from mooncaked.store import Policy, StoreClient, StoreClientConfig
from mooncaked.store import service
from mooncaked.store.errors import StoreUnavailable
from mooncaked.store.owner_wire import REPLY, KeyRequest, pack_request
from mooncaked.store.records import checksum
from mooncaked.store.master_runner import MasterRunner

KiB = 1024
pytestmark = pytest.mark.timeout(90)


def owner_gets(outcome: str) -> float:
    return metric("mooncaked_store_client_owner_gets_total", outcome=outcome)


def lookups() -> float:
    return sum(metric("mooncaked_store_lookups_total", result=r) for r in ("hit", "miss"))


async def test_a_get_whose_owner_is_known_is_served_by_the_owner_without_the_master():
    clients = ("owner", dict(dram_bytes=1 << 20)), ("writer", {}), ("reader", {})
    async with pool(*clients) as (runner, (owner, writer, reader)):
        a, b = os.urandom(64 * KiB), os.urandom(48 * KiB)
        assert await writer.put("o/a", a) and await writer.put("o/b", b)
        await held(owner, "o/a")
        await held(owner, "o/b")
        hits, asked = owner_gets("hit"), lookups()
        assert await writer.get("o/a") == a  # the writer knows the owner from its put
        assert await writer.batch_get(["o/a", "o/b"]) == [a, b]
        assert owner_gets("hit") == hits + 3 and lookups() == asked  # no lookup at the master
        assert await reader.get("o/b") == b  # the reader learns the owner from this lookup...
        assert lookups() == asked + 1
        assert await reader.get("o/b") == b  # ...and asks it directly next time
        assert lookups() == asked + 1 and owner_gets("hit") == hits + 4
        obj = runner.master.objects["o/b"]  # the owner reports what it served with its next ping: the LRU
        await until(lambda: obj.hits >= 2, "o/b read by key, counted at the master")  # its lookup, and one ping


async def test_put_then_remove_through_the_master_then_get_misses():
    """Remove is answered once the owner took the key out of its journal: a get by key right after misses,
    and so does the master's path."""
    clients = ("owner", dict(dram_bytes=1 << 20)), ("writer", {}), ("other", {})
    async with pool(*clients) as (_, (owner, writer, other)):
        a = os.urandom(32 * KiB)
        assert await writer.put("r/a", a)
        await held(owner, "r/a")
        assert await writer.get("r/a") == a
        assert await other.remove(["r/a"]) == 1  # not through the writer: its own hint stays
        assert owner.journal.find("r/a") is None  # the owner acknowledged before the Remove was answered
        fallbacks = owner_gets("fallback")
        assert await writer.get("r/a") is None
        assert owner_gets("fallback") == fallbacks + 1  # the owner said it does not hold it; the master agreed


async def test_an_object_put_again_with_other_bytes_is_never_served_as_the_old_one():
    clients = ("owner", dict(dram_bytes=1 << 20)), ("reader", {}), ("other", {})
    async with pool(*clients) as (_, (owner, reader, other)):
        a, a2 = os.urandom(32 * KiB), os.urandom(32 * KiB)
        assert await other.put("p/a", a)
        await held(owner, "p/a")
        assert await reader.get("p/a") == a  # the reader now knows p/a's owner and checksum
        assert await other.remove(["p/a"]) == 1
        assert await other.put("p/a", a2)
        await held(owner, "p/a")
        assert await reader.get("p/a") == a2  # the owner refuses the old checksum; the master names the new one
        assert await reader.get("p/a") == a2  # and by key from then on


async def test_concurrent_gets_by_key_each_get_their_own_bytes():
    """Single gets by key share one connection per owner and land one after another in its scratch
    buffer: each is checked and copied out before the next answer's bytes arrive."""
    clients = ("owner", dict(dram_bytes=64 << 20)), ("writer", {})  # room for each size's places reserved ahead
    async with pool(*clients) as (_, (owner, writer)):
        objs = {f"c/{i}": os.urandom((i + 1) * 24 * KiB + i) for i in range(12)}  # sizes differ: the buffer grows
        for k, v in objs.items():
            assert await writer.put(k, v)
            await held(owner, k)
        hits = owner_gets("hit")
        got = await asyncio.gather(*(writer.get(k) for k in reversed(objs)))
        assert got == list(reversed(objs.values()))
        assert owner_gets("hit") == hits + len(objs)


async def test_bytes_that_fail_their_checksum_are_never_returned_by_key():
    """The owner serves what its DRAM holds; when that is not what the reader expects (the place was
    rewritten while sent, or corrupted), the reader's checksum refuses it and the master's path decides
    (here it finds the copy corrupt too: a miss, and the object is dropped)."""
    clients = ("owner", dict(dram_bytes=1 << 20)), ("writer", {})
    async with pool(*clients) as (_, (owner, writer)):
        a = os.urandom(40 * KiB)
        assert await writer.put("x/a", a)
        await held(owner, "x/a")
        offset = owner.journal.find("x/a")[0]
        owner.dram.view[offset + 100] ^= 0xFF  # behind the journal's back: the served bytes are wrong
        fallbacks, hits = owner_gets("fallback"), owner_gets("hit")
        assert await writer.get("x/a") is None
        assert owner_gets("fallback") == fallbacks + 1 and owner_gets("hit") == hits
        assert not await writer.exist("x/a")  # the master's read failed its checksum too: dropped


async def test_a_batch_get_of_bytes_is_read_into_the_bytes_returned_not_through_staging():
    """Objects wanted as bytes land in the bytes the get returns, hashed as they land: a batch four times
    the reader's staging area is still served whole by the owner, in one round trip."""
    clients = ("owner", dict(dram_bytes=8 << 20)), ("writer", dict(staging_bytes=64 * KiB))
    async with pool(*clients) as (_, (owner, writer)):
        objs = {f"s/{i}": os.urandom(48 * KiB) for i in range(5)}
        for k, v in objs.items():
            assert await writer.put(k, v)
            await held(owner, k)
        hits, asked = owner_gets("hit"), lookups()
        assert await writer.batch_get(list(objs)) == list(objs.values())
        assert owner_gets("hit") == hits + len(objs) and lookups() == asked  # through staging: 1 of 5 fits


async def test_in_a_batch_get_of_bytes_one_bad_object_fails_only_itself():
    """One object's bytes no longer match its checksum: the batch's other objects are served by the owner;
    that one is refused as it lands, and the master's path finds it corrupt too (a miss)."""
    clients = ("owner", dict(dram_bytes=1 << 20)), ("writer", {})
    async with pool(*clients) as (_, (owner, writer)):
        objs = {f"y/{i}": os.urandom(40 * KiB) for i in range(3)}
        for k, v in objs.items():
            assert await writer.put(k, v)
            await held(owner, k)
        owner.dram.view[owner.journal.find("y/1")[0] + 7] ^= 0xFF
        fallbacks, hits = owner_gets("fallback"), owner_gets("hit")
        assert await writer.batch_get(list(objs)) == [objs["y/0"], None, objs["y/2"]]
        assert owner_gets("hit") == hits + 2 and owner_gets("fallback") == fallbacks + 1


async def test_a_stalled_owner_cannot_serve_a_key_removed_while_it_was_stopped(monkeypatch):
    """The owner is stopped (SIGSTOP) and cannot acknowledge; the Remove is answered only once the owner's
    window has run out. Resumed, the owner refuses the key before it has even applied the batch."""
    monkeypatch.setattr(service, "SERVE_WINDOW_S", 0.6)
    runner, addr = await start(client_ttl_s=60.0)  # the master keeps it mounted: only the window protects
    proc = owner_process(addr, "stalled")
    writer = await client(addr, "writer")
    other = await client(addr, "other")
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline) == "ready\n"
        a = os.urandom(32 * KiB)
        assert await writer.put("s/a", a)
        async with asyncio.timeout(10):
            while await ask(proc, "s/a") != "held":
                await asyncio.sleep(0.01)
        assert await writer.get("s/a") == a
        assert owner_gets("hit") >= 1
        proc.send_signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert await other.remove(["s/a"]) == 1
        assert loop.time() - t >= 0.6  # no acknowledgement came: it waited the window out
        proc.send_signal(signal.SIGCONT)
        assert await writer.get("s/a") is None
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        for c in (other, writer):
            await c.close()
        await runner.stop()


async def test_an_owner_that_lost_its_master_stops_serving_by_key(monkeypatch):
    monkeypatch.setattr(service, "SERVE_WINDOW_S", 0.4)
    runner, addr = await start()
    owner = await client(addr, "owner", dram_bytes=1 << 20)
    writer = await client(addr, "writer")
    try:
        a = os.urandom(16 * KiB)
        assert await writer.put("w/a", a)
        await held(owner, "w/a")
        assert owner.owner_server.window.open()
        await runner.stop()
        await until(lambda: not owner.owner_server.window.open(), "window closed")
        fallbacks = owner_gets("fallback")
        with pytest.raises(StoreUnavailable):  # the owner refuses; the master's path has no master
            await writer.get("w/a")
        assert owner_gets("fallback") == fallbacks + 1
    finally:
        for c in (writer, owner):
            await c.close()


def _raw_request(address: str, key: str, size: int, csum: int) -> bytes:
    """What a peer that skips the handshake gets back for a well-formed request (until the owner closes)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(pack_request(KeyRequest(1, key, size, csum)) * 8)
        got = b""
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return got


async def secured_client(master: str, name: str, token: bytes, **kw) -> StoreClient:
    c = StoreClient(StoreClientConfig(master=master, client_id=name, ping_interval_s=0.2, **kw),
                    security=Security(token=token))
    await c.start()
    return c


async def test_with_a_cluster_secret_only_peers_that_prove_it_are_served():
    """Master, owner and readers share a secret: a reader is served by key; a peer that skips the
    handshake gets no byte of the object; a reader whose secret the owner refuses reads through the master."""
    secret = os.urandom(32).hex().encode()  # a token file's text
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05, security=Security(token=secret))
    addr = f"127.0.0.1:{await runner.start()}"
    owner = await secured_client(addr, "owner", secret, dram_bytes=1 << 20)
    writer = await secured_client(addr, "writer", secret)
    wrong = await secured_client(addr, "wrong", secret)
    wrong._owner_links.token = os.urandom(32).hex().encode()  # right toward the master, wrong toward the owner
    try:
        a = os.urandom(16 * KiB)
        assert await writer.put("t/a", a)
        await held(owner, "t/a")
        hits = owner_gets("hit")
        assert await writer.get("t/a") == a
        assert owner_gets("hit") == hits + 1
        assert await wrong.get("t/a") == a  # the lookup: it learns the owner
        assert await wrong.get("t/a") == a  # its owner read fails the handshake: the master's path again
        assert owner_gets("hit") == hits + 1
        got = await asyncio.get_running_loop().run_in_executor(
            None, _raw_request, owner.owner_server.address, "t/a", len(a), checksum(a))
        assert a not in got and len(got) <= REPLY.size + 64  # a challenge at most; never the object
    finally:
        for c in (wrong, writer, owner):
            await c.close()
        await runner.stop()


async def test_bad_frames_close_the_connection_and_the_owner_serves_on():
    clients = ("owner", dict(dram_bytes=1 << 20)), ("writer", {})
    async with pool(*clients) as (_, (owner, writer)):
        a = os.urandom(16 * KiB)
        assert await writer.put("b/a", a)
        await held(owner, "b/a")
        host, port = owner.owner_server.address.rsplit(":", 1)

        def garbage() -> bytes:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(b"\x00" * 64)  # a zero-length key
                return s.recv(1 << 16)

        assert await asyncio.get_running_loop().run_in_executor(None, garbage) == b""
        hits = owner_gets("hit")
        assert await writer.get("b/a") == a
        assert owner_gets("hit") == hits + 1


async def test_an_owner_serves_reads_by_key_on_the_port_it_is_given_and_a_busy_one_is_one_clear_line():
    from cluster import free_port

    from mooncaked.startup import StartupError

    port = free_port()
    runner, addr = await start()
    try:
        owner = await client(addr, "owner", dram_bytes=1 << 20, owner_reads_port=port)
        reader = await client(addr, "reader")
        try:
            assert owner.owner_server.address == f"127.0.0.1:{port}"
            data = os.urandom(16 * KiB)
            assert await reader.put("p/a", data)
            await held(owner, "p/a")
            hits = owner_gets("hit")
            assert await reader.get("p/a") == data
            assert owner_gets("hit") == hits + 1  # served by key, on that port
            second = StoreClient(StoreClientConfig(master=addr, client_id="second", dram_bytes=1 << 20,
                                                   owner_reads_port=port))
            with pytest.raises(StartupError, match=f"--store-reads-port 127.0.0.1:{port} is already in use"):
                await second.start()
            await second.close()
        finally:
            await reader.close()
            await owner.close()
    finally:
        await runner.stop()


async def test_a_reader_polling_for_answers_gets_the_same_whole_checked_bytes():
    """owner_read_spin_us: answers received on the caller's thread before the loop takes over, from an owner in a
    process of its own (one in the reader's loop could not answer while it polls). Single gets, a batch,
    concurrent gets on one connection, an object of several MiB. The bytes land through the protocol's own
    buffer_updated, hashed as they land, as without polling (a bad one: test_bytes_that_fail_their_checksum_…)."""
    runner, addr = await start()
    proc = owner_process(addr, "owner", dram_bytes=16 << 20)
    writer = await client(addr, "writer", reserve_ahead_bytes=0)
    reader = await client(addr, "reader", owner_read_spin_us=2000)
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline) == "ready\n"
        objs = {f"s/{i}": os.urandom((i + 1) * 40 * KiB + i) for i in range(6)}
        objs["s/big"] = os.urandom(4 << 20)  # many reads, all in the spin while bytes keep coming
        for k, v in objs.items():
            assert await writer.put(k, v)
            async with asyncio.timeout(10):
                while await ask(proc, k) != "held":
                    await asyncio.sleep(0.01)
        for k, v in objs.items():
            assert await reader.get(k) == v  # learns each owner (the master's path)
        hits = owner_gets("hit")
        assert [await reader.get(k) for k in objs] == list(objs.values())
        assert await reader.batch_get(list(objs)) == list(objs.values())
        assert await asyncio.gather(*(reader.get(k) for k in reversed(objs))) == list(reversed(objs.values()))
        # by the owner, polled for (a read late on a loaded machine goes through the master instead, by design)
        assert owner_gets("hit") - hits >= len(objs)
    finally:
        proc.kill()
        proc.wait(10)
        for c in (reader, writer):
            await c.close()
        await runner.stop()


async def test_a_polling_reader_hands_an_answer_it_began_to_the_event_loop(monkeypatch):
    """The spin's budget passes with half an answer in: the connection's event loop reads the rest into the
    same bytes. The owner is a wire-level one on a thread of its own, stalling mid-body on cue; the spin's
    budget leaves that thread ample time to answer on a loaded machine."""
    import threading

    from mooncaked.store import owner_link
    from mooncaked.store.owner_link import OwnerLinks
    from mooncaked.store.owner_wire import REQUEST, SERVED

    monkeypatch.setattr(owner_link, "GRACE_S", 30.0)  # the read's deadline: past the spin's budget

    body = os.urandom(256 * KiB)
    rest = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def owner() -> None:
        conn, _ = listener.accept()
        with conn:
            head = conn.recv(REQUEST.size, socket.MSG_WAITALL)
            klen, req_id, size, _ = REQUEST.unpack(head)
            conn.recv(klen, socket.MSG_WAITALL)
            conn.sendall(REPLY.pack(req_id, SERVED, size) + body[:size // 2])
            rest.wait(10)
            conn.sendall(body[size // 2:])
            conn.recv(1)  # until the reader closes

    thread = threading.Thread(target=owner, daemon=True)
    thread.start()
    links = OwnerLinks(None, timeout_s=30.0, spin_s=0.5)
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        read = asyncio.ensure_future(links.read_bytes(address, "k", len(body), checksum(body)))
        await until(lambda: address in links._conns and links._conns[address]._sock is not None, "the spin ran")
        conn = links._conns[address]
        assert conn._bpos == len(body) // 2 and not read.done()  # taken in while it spun; the rest is the loop's
        rest.set()
        assert await asyncio.wait_for(read, 5) == body
    finally:
        links.close()  # the loop closes the connection: the owner thread's last recv returns then
        listener.close()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
