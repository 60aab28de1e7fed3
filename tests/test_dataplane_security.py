"""The data plane with a cluster secret, tried as an attacker would: the transfer port and the
store master's fast path (TCP and Unix socket) move no byte for a connection that has not proven
the secret, refuse a wrong one, serve the right one; idle, stalled and half-sent connections are
closed; connections over the cap are refused without harming the others; INFO names no memory
address; shm segments are owner-only. Everything runs on real sockets on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest
import torch
from transfer_helpers import digest, rand_bytes, run_uv

from mooncaked.proto.mooncake.v1 import store_pb2
from mooncaked.security import Security
from mooncaked.store import Policy, StoreClient, StoreClientConfig
from mooncaked.store.errors import StoreUnavailable
from mooncaked.store.fast_channel import FastChannel
from mooncaked.store.fast_wire import HEADER, HELLO, MAX_REQUEST_BYTES, REQUEST, pack_request
from mooncaked.store.master_runner import MasterRunner
from mooncaked.transfer import PeerUnavailableError, TransferEngine, TransferError, TransferOp
from mooncaked.transfer.api import parse_address
from mooncaked.transfer.conn_guard import ConnLimits
from mooncaked.transfer.handshake import AUTH_MAGIC, CHALLENGE_BYTES, client_handshake, open_socket
from mooncaked.transfer.shm import ShmAttachments
from mooncaked.transfer.shm_files import SHM_DIR, SHM_PREFIX
from mooncaked.transfer.wire import REQ, RESP, Op, pack_request as pack_transfer

pytestmark = pytest.mark.timeout(120)
SECRET = b"0123456789abcdef-the-cluster-secret"
OTHER = b"0123456789abcdef-another-secret!!!"
N = 1 << 20
GUARD_S = 20.0  # a hang guard only: every close below happens within a second or so


async def _raw(address: str) -> socket.socket:
    host, port = parse_address(address)
    return await open_socket(host, port)


async def _read_all(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (or GUARD_S passes: closed False)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    try:
        async with asyncio.timeout(GUARD_S):
            while chunk := await loop.sock_recv(sock, 65536):
                got += chunk
    except TimeoutError:
        return bytes(got), False
    except ConnectionResetError:
        pass
    return bytes(got), True


async def _engines(**server_kw) -> tuple[TransferEngine, torch.Tensor, str]:
    server = TransferEngine(token=SECRET, **server_kw)
    kv = server.alloc_region("kv", N)
    kv.copy_(rand_bytes(N, 1))
    return server, kv, await server.start()


def test_a_connection_without_the_handshake_moves_no_byte() -> None:
    """WRITE, READ and INFO headers, valid but unauthenticated: nothing but the challenge comes
    back, the connection is closed, and the region is unchanged."""

    async def body() -> None:
        server, kv, address = await _engines()
        before = digest(kv)
        loop = asyncio.get_running_loop()
        try:
            attempts = {
                "write": pack_transfer(Op.WRITE, 1, b"kv", 0, 4096) + b"\xee" * 4096,
                "read": pack_transfer(Op.READ, 1, b"kv", 0, 4096),
                "info": pack_transfer(Op.INFO, 1, b"", 0, 0),
                "answer-sized junk": b"\x00" * 64 + pack_transfer(Op.INFO, 2, b"", 0, 0),
            }
            for what, request in attempts.items():
                sock = await _raw(address)
                try:
                    await loop.sock_sendall(sock, request)
                    got, closed = await _read_all(sock)
                finally:
                    sock.close()
                print(f"{what}: {len(got)} bytes back, closed={closed}")
                assert closed, f"{what}: the connection stayed open"
                assert len(got) == CHALLENGE_BYTES and got.startswith(AUTH_MAGIC), (what, got[:64])
                assert b"kv" not in got
            assert digest(kv) == before
            assert server.stats().incoming_connections == 0
        finally:
            await server.close()

    run_uv(body())


def test_a_wrong_secret_is_refused_and_the_right_one_works() -> None:
    async def body() -> None:
        server, kv, address = await _engines()
        before = digest(kv)
        wrong = TransferEngine(token=OTHER, connect_timeout_s=2)
        none = TransferEngine(connect_timeout_s=2)
        right = TransferEngine(token=SECRET)
        engines = (wrong, none, right)
        for e in engines:
            e.alloc_region("src", N).copy_(rand_bytes(N, 2))
            await e.start()
        write = [TransferOp("write", "src", 0, address, "kv", 0, N)]
        try:
            with pytest.raises(PeerUnavailableError, match="refused our cluster secret"):
                await wrong.submit(write)
            with pytest.raises(TransferError, match="requires the cluster secret"):
                await none.submit(write)
            assert digest(kv) == before
            await right.submit(write)  # the whole region, both ways
            assert torch.equal(kv, rand_bytes(N, 2))
            kv.copy_(rand_bytes(N, 3))
            await right.submit([TransferOp("read", "src", 0, address, "kv", 0, N)])
            assert digest(right._regions.lookup("src", 0, N).flat) == digest(rand_bytes(N, 3))
            # a secured engine will not talk to a peer that cannot prove the secret either
            open_peer = TransferEngine()
            open_peer.alloc_region("kv", 4096)
            open_address = await open_peer.start()
            quick = TransferEngine(token=SECRET, connect_timeout_s=1)
            quick.alloc_region("src", 4096)
            await quick.start()
            try:
                with pytest.raises(PeerUnavailableError):
                    await quick.submit([TransferOp("write", "src", 0, open_address, "kv", 0, 4096)])
            finally:
                await quick.close()
                await open_peer.close()
        finally:
            for e in engines:
                await e.close()
            await server.close()

    run_uv(body())


def test_shared_memory_peers_prove_the_secret_before_mapping() -> None:
    """backend auto between two engines on this host: the control query (over tcp, after the
    handshake) names the segment, then bytes move by memcpy."""

    async def body() -> None:
        server, kv, address = await _engines(backend="auto")
        client = TransferEngine(backend="auto", token=SECRET)
        client.alloc_region("src", N).copy_(rand_bytes(N, 4))
        await client.start()
        try:
            await client.submit([TransferOp("write", "src", 0, address, "kv", 0, N)])
            assert torch.equal(kv, rand_bytes(N, 4))
        finally:
            await client.close()
            await server.close()

    run_uv(body())


def test_info_answers_carry_no_memory_addresses() -> None:
    async def body() -> None:
        server, kv, address = await _engines(backend="auto")
        loop = asyncio.get_running_loop()
        sock = await _raw(address)
        try:
            await client_handshake(sock, SECRET, address)
            await loop.sock_sendall(sock, pack_transfer(Op.INFO, 7, b"", 0, 0))
            head = await loop.sock_recv(sock, RESP.size)
            body_len = int.from_bytes(head[-8:], "little")
            raw = b""
            while len(raw) < body_len:
                raw += await loop.sock_recv(sock, body_len - len(raw))
        finally:
            sock.close()
        print("INFO answer:", raw.decode())
        info = json.loads(raw)
        try:
            assert [r["name"] for r in info["regions"]] == ["kv"]
            assert all(r["address"] == 0 for r in info["regions"])
            assert str(kv.data_ptr()) not in raw.decode()
            assert info["rdma_session"] is None
            with open("/proc/sys/kernel/random/boot_id") as f:
                assert f.read().strip() not in raw.decode()
            assert server.info().regions["kv"].address == kv.data_ptr()  # kept locally, for rdma
        finally:
            await server.close()

    run_uv(body())


def test_idle_stalled_and_half_sent_connections_are_closed() -> None:
    limits = ConnLimits(handshake_timeout_s=0.3, idle_timeout_s=0.5, partial_timeout_s=0.5)

    async def body() -> None:
        server, kv, address = await _engines(limits=limits)
        before = digest(kv)
        loop = asyncio.get_running_loop()

        async def proven() -> socket.socket:
            sock = await _raw(address)
            await client_handshake(sock, SECRET, address)
            return sock

        try:
            cases: dict[str, socket.socket] = {"silent, no handshake": await _raw(address)}
            half_answer = await _raw(address)
            await loop.sock_sendall(half_answer, b"\x01" * 10)
            cases["half a handshake"] = half_answer
            cases["proven, then idle"] = await proven()
            half_header = await proven()
            await loop.sock_sendall(half_header, pack_transfer(Op.WRITE, 1, b"kv", 0, 4096)[: REQ.size // 2])
            cases["half a request header"] = half_header
            half_payload = await proven()
            await loop.sock_sendall(half_payload, pack_transfer(Op.WRITE, 1, b"kv", 0, 4096) + b"\xee" * 100)
            cases["half a payload"] = half_payload
            t0 = loop.time()
            results = await asyncio.gather(*(_read_all(s) for s in cases.values()))
            for (what, sock), (_, closed) in zip(cases.items(), results, strict=True):
                sock.close()
                print(f"{what}: closed={closed} (all within {loop.time() - t0:.2f}s)")
                assert closed, f"{what}: still open"
            assert server.stats().incoming_connections == 0
            # the engine keeps serving: a proper peer moves bytes
            peer = TransferEngine(token=SECRET)
            peer.alloc_region("src", N).copy_(rand_bytes(N, 5))
            await peer.start()
            try:
                await peer.submit([TransferOp("write", "src", 0, address, "kv", 0, N)])
            finally:
                await peer.close()
            assert digest(kv) != before and torch.equal(kv, rand_bytes(N, 5))
        finally:
            await server.close()

    run_uv(body())


def test_idle_pooled_connections_are_closed_by_their_client_first(caplog) -> None:
    """A client retires a pooled connection well inside the server's idle timeout, so the server
    never cuts one a request is about to go on: every submit after a pause succeeds."""
    limits = ConnLimits(idle_timeout_s=1.0)  # clients retire after 0.2 s, close within 0.4 s

    async def body() -> None:
        server, kv, address = await _engines(limits=limits)
        peer = TransferEngine(token=SECRET, limits=limits, connections_per_peer=2)
        src = peer.alloc_region("src", N)
        await peer.start()
        try:
            for seed, pause in ((8, 0.0), (9, 0.3), (10, 1.5), (11, 0.05)):
                await asyncio.sleep(pause)
                src.copy_(rand_bytes(N, seed))
                await peer.submit([TransferOp("write", "src", 0, address, "kv", 0, N // 2),
                                   TransferOp("write", "src", N // 2, address, "kv", N // 2, N // 2)])
                assert torch.equal(kv, rand_bytes(N, seed)), pause
            await asyncio.sleep(1.0)
            assert server.stats().incoming_connections == 0 and not peer.stats().outgoing_connections[address]
        finally:
            await peer.close()
            await server.close()

    with caplog.at_level("WARNING", logger="mooncaked.transfer.tcp_server"):
        run_uv(body())
    assert not [r for r in caplog.records if "idle" in r.getMessage()], "the server closed an idle connection"


def test_connections_over_the_cap_are_refused_without_harming_the_others() -> None:
    limits = ConnLimits(max_connections=4, max_unproven=2)

    async def body() -> None:
        server, kv, address = await _engines(limits=limits)
        loop = asyncio.get_running_loop()
        peer = TransferEngine(token=SECRET, connections_per_peer=2)
        src = peer.alloc_region("src", N)
        await peer.start()
        extra: list[socket.socket] = []
        try:
            await peer.submit([TransferOp("write", "src", 0, address, "kv", 0, 4096)] * 2)
            assert server.stats().incoming_connections == 2
            extra += [await _raw(address), await _raw(address)]  # two strangers: the handshake cap
            stranger = await _raw(address)
            got, closed = await _read_all(stranger)
            stranger.close()
            assert closed and got == b"", "a third stranger must be refused at once"
            await client_handshake(extra[0], SECRET, address)  # now 3 proven + 1 in the handshake
            await client_handshake(extra[1], SECRET, address)  # 4 proven: the cap
            fifth = await _raw(address)
            got, closed = await _read_all(fifth)
            fifth.close()
            assert closed and got == b"", "a fifth connection must be refused at once"
            for seed in (6, 7):  # the admitted ones keep working, both ways
                src.copy_(rand_bytes(N, seed))
                await peer.submit([TransferOp("write", "src", 0, address, "kv", 0, N)])
                assert torch.equal(kv, rand_bytes(N, seed))
            await loop.sock_sendall(extra[0], pack_transfer(Op.READ, 1, b"kv", 0, 16))
            head = await loop.sock_recv(extra[0], RESP.size)
            assert len(head) == RESP.size and head[5] == 0  # status OK
        finally:
            for s in extra:
                s.close()
            await peer.close()
            await server.close()

    run_uv(body())


def test_shm_segments_are_owner_only_and_planted_ones_are_refused(tmp_path) -> None:
    old = os.umask(0o277)  # a umask that would leave the owner unable to write
    try:
        engine = TransferEngine(backend="shm")
        engine.alloc_region("kv", 8192)
    finally:
        os.umask(old)
    name = engine.info().regions["kv"].shm_name
    assert name is not None
    mode = os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777
    print(f"segment {name}: mode {mode:04o}")
    assert mode == 0o600
    run_uv(engine.close())
    planted = f"{SHM_PREFIX}{os.getpid()}-planted"
    link = f"{SHM_PREFIX}{os.getpid()}-link"
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 8192)
    os.chmod(target, 0o600)
    attachments = ShmAttachments()
    try:
        with open(os.path.join(SHM_DIR, planted), "wb") as f:
            f.write(b"\0" * 8192)
        os.chmod(os.path.join(SHM_DIR, planted), 0o666)
        with pytest.raises(TransferError, match="mode 0666"):
            attachments.get(planted, 8192)
        os.symlink(target, os.path.join(SHM_DIR, link))
        with pytest.raises(TransferError, match="refusing shm segment"):
            attachments.get(link, 8192)
    finally:
        attachments.close()
        for n in (planted, link):
            if os.path.lexists(os.path.join(SHM_DIR, n)):
                os.unlink(os.path.join(SHM_DIR, n))


# -- the store master's fast path ---------------------------------------------------------------

async def _secured_master() -> tuple[MasterRunner, str]:
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05, security=Security(token=SECRET))
    port = await runner.start()
    return runner, f"127.0.0.1:{port}"


async def _store_client(master: str, name: str, token: bytes | None, **kw) -> StoreClient:
    c = StoreClient(StoreClientConfig(master=master, client_id=name, ping_interval_s=0.2, **kw),
                    security=Security(token=token))
    await c.start()
    return c


async def test_fast_path_without_the_handshake_moves_no_byte():
    runner, addr = await _secured_master()
    owner = await _store_client(addr, "owner", SECRET, dram_bytes=1 << 20)
    loop = asyncio.get_running_loop()
    try:
        assert await owner.put("k/1", b"x" * 1000)
        assert owner.calls.fast is not None and not owner.calls.fast.closed, "the secured client uses the fast path"
        remove = pack_request(1, "Remove", 1000, store_pb2.RemoveRequest(keys=["k/1"]).SerializeToString())
        stats = pack_request(2, "PoolStats", 1000, b"")
        for what, data in {"greeting and Remove": HELLO + remove, "answer-sized junk": b"\0" * 64 + HELLO + stats,
                           "greeting and PoolStats": HELLO + stats}.items():
            sock = await open_socket("127.0.0.1", runner.service.fast_path_port)
            try:
                await loop.sock_sendall(sock, data)
                got, closed = await _read_all(sock)
            finally:
                sock.close()
            print(f"fast path, {what}: {len(got)} bytes back, closed={closed}")
            assert closed and len(got) == CHALLENGE_BYTES and got.startswith(AUTH_MAGIC), what
        assert await owner.exist("k/1") and await owner.get("k/1") == b"x" * 1000
        assert len(runner.fast_path.connections) == 1  # the owner's, still serving
    finally:
        await owner.close()
        await runner.stop()


async def test_fast_path_refuses_a_wrong_secret_and_serves_the_right_one_on_tcp_and_unix():
    runner, addr = await _secured_master()
    port, unix = runner.service.fast_path_port, runner.service.fast_path_unix
    try:
        for where in ({"unix": unix} if unix else {}) | {"tcp": ""}:
            kw = {"unix": unix} if where == "unix" else {}
            with pytest.raises(StoreUnavailable, match="refused our cluster secret"):
                await FastChannel.connect("127.0.0.1", port, 5, token=OTHER, **kw)
            bare = await FastChannel.connect("127.0.0.1", port, 5, **kw)  # no secret: refused at the first call
            with pytest.raises(StoreUnavailable, match="requires the cluster secret|closed|lost|no answer"):
                await bare.call("PoolStats", store_pb2.PoolStatsRequest(), 2)
            bare.close()
            good = await FastChannel.connect("127.0.0.1", port, 5, token=SECRET, **kw)
            try:
                reply = await good.call("Describe", store_pb2.DescribeRequest(), 5)
                assert reply.fast_path_port == port, where
            finally:
                good.close()
        # a whole client with the secret: puts and gets on the fast path, bytes over secured transfer
        a = await _store_client(addr, "a", SECRET, dram_bytes=1 << 20)
        b = await _store_client(addr, "b", SECRET)
        try:
            data = os.urandom(200_000)
            assert await a.put("m/1", data)
            assert await b.get("m/1") == data
            assert b.calls.fast is not None and not b.calls.fast.closed
        finally:
            await b.close()
            await a.close()
    finally:
        await runner.stop()


async def test_fast_path_drops_oversized_half_sent_and_idle_connections():
    runner, addr = await _secured_master()
    runner.fast_path.limits = ConnLimits(handshake_timeout_s=0.3, idle_timeout_s=0.5, partial_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    port = runner.service.fast_path_port

    async def proven() -> socket.socket:
        sock = await open_socket("127.0.0.1", port)
        await client_handshake(sock, SECRET, "fast path")
        return sock

    try:
        cases = {"silent, no handshake": await open_socket("127.0.0.1", port)}
        cases["proven, no greeting"] = await proven()
        idle = await proven()
        await loop.sock_sendall(idle, HELLO)
        cases["greeted, then idle"] = idle
        claim = await proven()  # a claimed 60 MiB frame: refused from its header, nothing buffered
        await loop.sock_sendall(claim, HELLO + HEADER.pack(60 << 20, REQUEST, 6, 0, 1, 0) + b"Remove")
        cases["60 MiB claimed"] = claim
        half = await proven()  # a legal size, never finished
        await loop.sock_sendall(half, HELLO + HEADER.pack(MAX_REQUEST_BYTES - 100, REQUEST, 6, 0, 1, 0)
                                + b"Remove" + b"\0" * 1000)
        cases["half a frame"] = half
        results = await asyncio.gather(*(_read_all(s) for s in cases.values()))
        for (what, sock), (got, closed) in zip(cases.items(), results, strict=True):
            sock.close()
            print(f"fast path, {what}: closed={closed}, {len(got)} bytes back")
            assert closed, f"{what}: still open"
        assert not runner.fast_path.connections
        c = await _store_client(addr, "after", SECRET, dram_bytes=1 << 20)
        try:
            assert await c.put("after/1", b"y" * 100) and await c.get("after/1") == b"y" * 100
        finally:
            await c.close()
    finally:
        await runner.stop()


async def test_an_idle_fast_channel_closes_itself_before_the_master_would(caplog):
    runner, addr = await _secured_master()
    runner.fast_path.limits = ConnLimits(idle_timeout_s=1.0)
    port = runner.service.fast_path_port
    try:
        with caplog.at_level("WARNING", logger="mooncaked.store.fast_path"):
            channel = await FastChannel.connect("127.0.0.1", port, 5, token=SECRET, idle_s=0.2)
            await channel.call("PoolStats", store_pb2.PoolStatsRequest(), 5)
            await asyncio.sleep(1.0)
            assert channel.closed
            with pytest.raises(StoreUnavailable, match="closed"):
                await channel.call("PoolStats", store_pb2.PoolStatsRequest(), 5)
            assert not runner.fast_path.connections
        assert not [r for r in caplog.records if "idle" in r.getMessage()], "the master closed it first"
    finally:
        await runner.stop()


async def test_fast_path_connection_cap_refuses_extras_without_harming_others():
    runner, addr = await _secured_master()
    runner.fast_path.limits = ConnLimits(max_connections=2, max_unproven=1)
    port = runner.service.fast_path_port
    c = await _store_client(addr, "c", SECRET, dram_bytes=1 << 20)
    held: list[socket.socket] = []
    try:
        assert await c.put("c/1", b"z" * 100)  # opens the client's fast channel: 1 of 2
        held.append(await open_socket("127.0.0.1", port))  # a stranger: 1 of 1 in the handshake
        refused = await open_socket("127.0.0.1", port)
        got, closed = await _read_all(refused)
        refused.close()
        assert closed and got == b""
        await client_handshake(held[0], SECRET, "fast path")  # 2 of 2 proven
        refused = await open_socket("127.0.0.1", port)
        got, closed = await _read_all(refused)
        refused.close()
        assert closed and got == b""
        for i in range(20):
            assert await c.get("c/1") == b"z" * 100
        assert c.calls.fast is not None and not c.calls.fast.closed
    finally:
        for s in held:
            s.close()
        await c.close()
        await runner.stop()


async def test_a_request_over_the_fast_path_limit_goes_by_grpc():
    runner, addr = await _secured_master()
    c = await _store_client(addr, "big", SECRET, dram_bytes=1 << 20)
    try:
        assert await c.put("small/1", b"s" * 10)
        keys = [f"big/{i:04d}/" + "k" * 1000 for i in range(1200)]  # ~1.2 MB of keys
        assert await c.batch_exist(keys) == [False] * len(keys)
        assert c.calls.fast is not None and not c.calls.fast.closed  # the fast path stayed up for the rest
    finally:
        await c.close()
        await runner.stop()
