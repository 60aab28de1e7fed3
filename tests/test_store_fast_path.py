"""The master's fast path (framed StoreMaster messages on a plain socket) against the real
master: the same answers and statuses as gRPC, clients use it and fall back to gRPC when it is
off, garbage closes only its connection, a silent peer is a deadline, a restart reconnects."""

from __future__ import annotations

import asyncio
import os
import sys
import socket

import pytest
from store_helpers import client

from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc
from mooncaked.store import Policy
from mooncaked.store.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StoreError,
    StoreUnavailable,
)
from mooncaked.store.fast_channel import FastChannel
from mooncaked.store.fast_wire import HEADER, HELLO, REQUEST
from mooncaked.store.master import RESERVED_PREFIX
from mooncaked.store.master_runner import MasterRunner

KiB = 1024
pytestmark = pytest.mark.timeout(60)



async def test_fast_path_answers_bad_input_with_the_same_typed_errors_as_grpc():
    runner = MasterRunner(Policy(max_object_bytes=1 << 20), "127.0.0.1:0", tick_s=0.05)
    port = await runner.start()
    addr = f"127.0.0.1:{port}"
    owner = await client(addr, "owner", dram_bytes=256 * KiB)
    fast = await FastChannel.connect("127.0.0.1", runner.service.fast_path_port, 5)
    slow = await client(addr, "grpc-only", fast_path=False)
    cases = [
        ("PutStart", store_pb2.PutStartRequest(key="m/1", size=-4), InvalidArgument, "must be positive"),
        ("PutStart", store_pb2.PutStartRequest(key="m/1", size=300 * KiB), InvalidArgument, "larger than"),
        ("PutStart", store_pb2.PutStartRequest(key="", size=10), InvalidArgument, "key"),
        ("PutEnd", store_pb2.PutEndRequest(key="never-started"), FailedPrecondition, "without a PutStart"),
        ("GetReplicas", store_pb2.GetReplicasRequest(key="unknown"), NotFound, "unknown"),
        ("BatchPutEnd", store_pb2.BatchPutEndRequest(keys=["a", "b"], checksums=[1]), InvalidArgument,
         "1 checksums for 2 keys"),
        ("UnmountSegment", store_pb2.UnmountSegmentRequest(client_id="x", segment="dead/dram"), NotFound,
         "not mounted"),
    ]
    try:
        for method, request, error, text in cases:
            with pytest.raises(error) as on_fast:
                await fast.call(method, request, 5)
            with pytest.raises(error) as on_grpc:
                await slow.calls.call(method, request)
            assert text in str(on_fast.value) and text in str(on_grpc.value), (method, on_fast.value)
        with pytest.raises(StoreError, match="UNIMPLEMENTED.*no unary StoreMaster method 'Tasks'"):
            await fast.call_raw("Tasks", b"", 5)
        with pytest.raises(InvalidArgument, match="undecodable"):
            await fast.call_raw("PutStart", b"\xff\xff\xff", 5)
        # a put through one path is read through the other, checksum given at PutEnd
        data = os.urandom(100 * KiB)
        assert await owner.put("m/ok", data)
        assert await slow.get("m/ok") == data
        assert await slow.put("m/ok2", data[:KiB])
        assert await owner.get("m/ok2") == data[:KiB]
        reply = await fast.call("Describe", store_pb2.DescribeRequest(), 5)
        assert reply.fast_path_port == runner.service.fast_path_port and reply.master_epoch == runner.master.epoch
        assert owner.calls.fast is not None and slow.calls.fast is None
    finally:
        fast.close()
        await slow.close()
        await owner.close()
        await runner.stop()


async def test_clients_use_grpc_when_the_master_has_no_fast_path():
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05, fast_path_port=None)
    port = await runner.start()
    c = await client(f"127.0.0.1:{port}", "c", dram_bytes=1 << 20)
    try:
        async with __import__("grpc").aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            described = await store_pb2_grpc.StoreMasterStub(ch).Describe(store_pb2.DescribeRequest(), timeout=5)
        assert described.fast_path_port == 0
        data = os.urandom(5000)
        assert await c.put("k", data)
        assert await c.get("k") == data
        assert c.calls.fast is None
    finally:
        await c.close()
        await runner.stop()


def _raw_connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_garbage_on_the_fast_port_closes_only_that_connection():
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05)
    port = await runner.start()
    fast_port = runner.service.fast_path_port
    c = await client(f"127.0.0.1:{port}", "c", dram_bytes=1 << 20)
    loop = asyncio.get_running_loop()
    try:
        assert await c.put("before", b"x" * 100)
        bad_greeting = await loop.run_in_executor(None, _raw_connect, fast_port)
        bad_greeting.sendall(b"GET / HTTP/1.1\r\n\r\n")
        wrong_kind = await loop.run_in_executor(None, _raw_connect, fast_port)
        wrong_kind.sendall(HELLO + HEADER.pack(0, 7, 0, 0, 1, 0))
        too_big = await loop.run_in_executor(None, _raw_connect, fast_port)
        too_big.sendall(HELLO + HEADER.pack(1 << 30, REQUEST, 4, 0, 1, 0))
        for s in (bad_greeting, wrong_kind, too_big):
            assert await loop.run_in_executor(None, _closed_by_peer, s)
            s.close()
        assert await c.get("before") == b"x" * 100  # the master keeps serving, on the fast path
        assert c.calls.fast is not None and not c.calls.fast.closed
    finally:
        await c.close()
        await runner.stop()


async def test_a_silent_master_is_a_deadline_not_a_hang():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        channel = await FastChannel.connect("127.0.0.1", silent.getsockname()[1], 5)
        with pytest.raises(StoreUnavailable, match="no answer within 0.3s"):
            await channel.call("Exist", store_pb2.ExistRequest(key="k"), 0.3)
        channel.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await channel.call("Exist", store_pb2.ExistRequest(key="k"), 0.3)
    finally:
        silent.close()


async def test_a_restarted_master_is_found_again_on_its_new_fast_port():
    first = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05)
    port = await first.start()
    c = await client(f"127.0.0.1:{port}", "c", dram_bytes=1 << 20, rpc_timeout_s=2.0)
    try:
        assert await c.put("a", b"1" * 64)
        old_fast = c.calls.fast
        await first.stop()
        with pytest.raises(StoreUnavailable):
            await c.exist("a")
        second = MasterRunner(Policy(), f"127.0.0.1:{port}", tick_s=0.05)
        await second.start()
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while True:  # the client's remount and the fast path's retry pause both pass within seconds
                try:
                    if await c.put("b", b"2" * 64):
                        break
                except StoreError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "client never reached the restarted master"
                await asyncio.sleep(0.1)
            assert await c.get("b") == b"2" * 64
            # gRPC carries the calls until the fast path's retry pause ends; then a new channel opens
            while c.calls.fast is old_fast or c.calls.fast is None or c.calls.fast.closed:
                assert await c.exist("b")
                assert asyncio.get_running_loop().time() < deadline, "the fast path never came back"
                await asyncio.sleep(0.1)
            assert await c.get("b") == b"2" * 64
        finally:
            await c.close()
            await second.stop()
    finally:
        await first.stop()


def reserved(runner: MasterRunner) -> int:
    return sum(k.startswith(RESERVED_PREFIX) for k in runner.master.objects)


async def test_single_puts_go_into_places_reserved_ahead_and_give_them_back_at_close():
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05)
    port = await runner.start()
    addr = f"127.0.0.1:{port}"
    owner = await client(addr, "owner", dram_bytes=8 << 20)
    writer = await client(addr, "writer", reserve_ahead_bytes=64 * KiB)  # 8 places of 8 KiB
    plain = await client(addr, "plain", reserve_ahead_bytes=0)
    try:
        data = [os.urandom(8 * KiB) for _ in range(20)]
        assert await writer.put("k0", data[0])
        assert reserved(runner) == 8, "the first put reserves its own place and 8 ahead"
        for i in range(1, 5):
            assert await writer.put(f"k{i}", data[i])
            assert 7 <= reserved(runner) <= 8, "each put takes one place and a refill of 1/8 is asked at once"
        deadline = asyncio.get_running_loop().time() + 5
        while reserved(runner) != 8:  # the last refill lands in the background
            assert asyncio.get_running_loop().time() < deadline, f"stock stuck at {reserved(runner)} places"
            await asyncio.sleep(0.01)
        for i in range(5, 20):
            assert await writer.put(f"k{i}", data[i])
        assert await writer.put("k3", data[3]), "a key already in the pool is a success; its place goes back"
        for i in range(20):
            assert await plain.get(f"k{i}") == data[i]
        assert await plain.put("p", data[0]) and reserved(runner) <= 8
        before = reserved(runner)
        await plain.close()
        assert reserved(runner) == before, "a client that reserves nothing gives nothing back"
        await writer.close()
        assert reserved(runner) == 0, "close gives every reserved place back"
    finally:
        await owner.close()
        await runner.stop()


async def test_reserved_places_of_a_restarted_master_are_dropped_and_puts_go_on():
    first = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05)
    port = await first.start()
    addr = f"127.0.0.1:{port}"
    owner = await client(addr, "owner", dram_bytes=4 << 20, rpc_timeout_s=2.0)
    writer = await client(addr, "writer", rpc_timeout_s=2.0, reserve_ahead_bytes=64 * KiB)
    second: MasterRunner | None = None
    try:
        assert await writer.put("a", b"1" * 8 * KiB) and reserved(first) == 8
        await first.stop()
        second = MasterRunner(Policy(), f"127.0.0.1:{port}", tick_s=0.05)
        await second.start()
        deadline = asyncio.get_running_loop().time() + 20
        while "owner/dram" not in second.master.segments:  # the owner remounts after its next ping
            assert asyncio.get_running_loop().time() < deadline, "owner never remounted"
            await asyncio.sleep(0.05)
        while True:
            try:
                if await writer.put("b", b"2" * 8 * KiB):
                    break
            except StoreError:
                pass
            assert asyncio.get_running_loop().time() < deadline, "puts never worked again"
            await asyncio.sleep(0.1)
        assert await writer.get("b") == b"2" * 8 * KiB
        assert all(o.committed for k, o in second.master.objects.items() if not k.startswith(RESERVED_PREFIX))
    finally:
        await writer.close()
        await owner.close()
        if second is not None:
            await second.stop()
        await first.stop()


async def test_an_unreachable_fast_port_leaves_the_client_on_grpc():
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05)
    port = await runner.start()
    await runner.fast_path.close()  # Describe still names the port; nothing listens there any more
    c = await client(f"127.0.0.1:{port}", "c", dram_bytes=1 << 20)
    loop = asyncio.get_running_loop()
    try:
        for i in range(20):
            assert await c.put(f"k{i}", b"x" * 1000)
            assert await c.get(f"k{i}") == b"x" * 1000
        assert c.calls.fast is None and c.calls.retry_at > loop.time(), "a failed opening must back off"
    finally:
        await c.close()
        await runner.stop()


@pytest.mark.parametrize("unix", [True, False])
async def test_a_client_on_the_masters_host_takes_the_unix_socket_else_tcp(unix: bool):
    runner = MasterRunner(Policy(), "127.0.0.1:0", tick_s=0.05, fast_path_unix=unix)
    port = await runner.start()
    addr = f"127.0.0.1:{port}"
    owner = await client(addr, "owner", dram_bytes=1 << 20)
    try:
        assert (runner.service.fast_path_unix != "") == (unix and sys.platform == "linux")
        assert await owner.put("k", b"v" * 100) and await owner.get("k") == b"v" * 100
        assert owner.calls.fast is not None and not owner.calls.fast.closed
        expected = f"unix:{runner.service.fast_path_unix}" if runner.service.fast_path_unix else \
            f"127.0.0.1:{runner.service.fast_path_port}"
        assert owner.calls.fast.address == expected
        if runner.service.fast_path_unix:  # the socket answers raw frames like the TCP port does
            fast = await FastChannel.connect("127.0.0.1", 0, 5, unix=runner.service.fast_path_unix)
            try:
                assert (await fast.call("Exist", store_pb2.ExistRequest(key="k"), 5)).exists
            finally:
                fast.close()
        with pytest.raises(StoreUnavailable, match="unix:@nobody-listens"):
            await FastChannel.connect("127.0.0.1", 0, 5, unix="@nobody-listens")
    finally:
        await owner.close()
        await runner.stop()
