"""The StoreMaster over real gRPC on loopback, with real clients in this process: statuses for
bad input (and the master keeps serving), stale puts, leases, placement, DRAM checksums."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch
from prometheus_client import REGISTRY
from store_helpers import client, start

from mooncaked.proto.mooncake.v1 import common_pb2, store_pb2, store_pb2_grpc, transfer_pb2
from mooncaked.store import checksum

KiB = 1024
pytestmark = pytest.mark.timeout(60)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_bad_input_gets_clear_statuses_and_the_master_keeps_serving():
    runner, addr = await start(max_object_bytes=1 << 20)
    owner = await client(addr, "owner", dram_bytes=256 * KiB)
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = store_pb2_grpc.StoreMasterStub(ch)

            async def status(call, request) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(request, timeout=5)
                return e.value.code(), e.value.details()

            C = grpc.StatusCode
            code, msg = await status(stub.PutStart, store_pb2.PutStartRequest(key="m/1", size=-4))
            assert code == C.INVALID_ARGUMENT and "must be positive" in msg
            code, msg = await status(stub.PutStart, store_pb2.PutStartRequest(key="m/1", size=300 * KiB))
            assert code == C.INVALID_ARGUMENT and "larger than" in msg
            code, msg = await status(stub.PutStart, store_pb2.PutStartRequest(key="", size=10))
            assert code == C.INVALID_ARGUMENT and "key" in msg
            code, msg = await status(stub.PutEnd, store_pb2.PutEndRequest(key="never-started"))
            assert code == C.FAILED_PRECONDITION and "without a PutStart" in msg
            code, msg = await status(stub.GetReplicas, store_pb2.GetReplicasRequest(key="unknown"))
            assert code == C.NOT_FOUND and "unknown" in msg
            code, msg = await status(stub.PutStart, store_pb2.PutStartRequest(key="m/2", size=10,
                                                                              preferred_segment="dead/dram"))
            assert code == C.FAILED_PRECONDITION and "not a mounted DRAM segment" in msg
            code, msg = await status(stub.UnmountSegment, store_pb2.UnmountSegmentRequest(client_id="x",
                                                                                          segment="dead/dram"))
            assert code == C.NOT_FOUND and "not mounted" in msg
            code, _ = await status(stub.TaskDone, store_pb2.TaskDoneRequest(client_id="ghost"))
            assert code == C.FAILED_PRECONDITION
            code, _ = await status(stub.MountSegment, store_pb2.MountSegmentRequest(
                client_id="x", segment=transfer_pb2.SegmentInfo(name="s", medium="tape", nbytes=10)))
            assert code == C.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Tasks(store_pb2.TasksRequest(client_id="ghost"), timeout=5):
                    pass
            assert e.value.code() == C.FAILED_PRECONDITION
            # fill the pool with uncommitted puts: the next is RESOURCE_EXHAUSTED
            for i in range(4):
                await stub.PutStart(store_pb2.PutStartRequest(key=f"fill/{i}", size=64 * KiB), timeout=5)
            code, msg = await status(stub.PutStart, store_pb2.PutStartRequest(key="more", size=64 * KiB))
            assert code == C.RESOURCE_EXHAUSTED and "retry" in msg
            for i in range(4):
                await stub.PutRevoke(store_pb2.PutRevokeRequest(key=f"fill/{i}"), timeout=5)
            # still serving: an ordinary round trip works
            data = os.urandom(10 * KiB)
            assert await owner.put("m/ok", data)
            assert await owner.get("m/ok") == data
            assert await owner.get("unknown") is None
            assert metric("mooncaked_store_segment_capacity_bytes", segment="owner/dram", medium="dram") == 256 * KiB
            assert metric("mooncaked_store_segment_used_bytes", segment="owner/dram", medium="dram") >= 10 * KiB
    finally:
        await owner.close()
        await runner.stop()


async def test_stale_put_start_is_discarded_and_the_key_is_free_again():
    runner, addr = await start(put_timeout_s=0.3)
    owner = await client(addr, "owner", dram_bytes=256 * KiB)
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = store_pb2_grpc.StoreMasterStub(ch)
            first = await stub.PutStart(store_pb2.PutStartRequest(key="k", size=200 * KiB, checksum=1), timeout=5)
            assert len(first.replicas) == 1
            again = await stub.PutStart(store_pb2.PutStartRequest(key="k", size=200 * KiB, checksum=1), timeout=5)
            assert again.exists and not again.replicas  # in progress: a second writer skips
            await asyncio.sleep(0.6)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PutEnd(store_pb2.PutEndRequest(key="k"), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "discarded" in e.value.details()
            stats = await stub.PoolStats(store_pb2.PoolStatsRequest(), timeout=5)
            assert [s.used for s in stats.segments] == [0]  # its place was freed
        data = os.urandom(200 * KiB)
        assert await owner.put("k", data) and await owner.get("k") == data
    finally:
        await owner.close()
        await runner.stop()


async def test_an_object_being_read_is_not_evicted_until_its_lease_lapses():
    runner, addr = await start(lease_s=1.0, high_watermark=0.5)
    owner = await client(addr, "owner", dram_bytes=512 * KiB)  # no LMDB: evicted objects are dropped
    reader = await client(addr, "reader")
    try:
        blobs = {f"m/{i}": os.urandom(32 * KiB) for i in range(24)}
        assert all(await reader.batch_put(list(blobs.items())[:6]))
        assert await reader.get("m/0") == blobs["m/0"]  # lease on the oldest object
        for i in range(6, 24):
            assert await reader.put(f"m/{i}", blobs[f"m/{i}"])
        assert await reader.exist("m/0"), "a leased object was evicted"
        assert not await reader.exist("m/1"), "the LRU object without a lease should have gone"
        await asyncio.sleep(1.2)
        for i in range(24, 40):
            assert await reader.put(f"m/{i}", os.urandom(32 * KiB))
        assert not await reader.exist("m/0"), "once its lease lapsed, the object is evictable"
        assert metric("mooncaked_store_evictions_total", medium="dram", action="drop") > 0
    finally:
        await reader.close()
        await owner.close()
        await runner.stop()


async def test_replicas_land_on_distinct_segments_and_survive_one_segment_going():
    runner, addr = await start(replicas=2)
    owners = [await client(addr, f"o{i}", dram_bytes=1024 * KiB) for i in range(3)]
    try:
        blobs = {f"m/{i}": os.urandom(48 * KiB) for i in range(20)}  # 2 copies: 64% of the pool
        assert all(await owners[0].batch_put(list(blobs.items())))
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = store_pb2_grpc.StoreMasterStub(ch)
            reply = await stub.BatchGetReplicas(store_pb2.BatchGetReplicasRequest(keys=list(blobs)), timeout=5)
            assert len(reply.objects) == 20
            for obj in reply.objects:
                segs = [r.segment for r in obj.replicas]
                assert len(segs) == 2 and len(set(segs)) == 2, segs
                assert obj.checksum == checksum(blobs[obj.key])
            used = [s.used for s in (await stub.PoolStats(store_pb2.PoolStatsRequest(), timeout=5)).segments]
            assert max(used) - min(used) <= 2 * 48 * KiB, f"placement should spread by free space: {used}"
        await owners[2].close()  # unmount one segment: every object keeps a copy
        owners.pop()
        got = await owners[1].batch_get(list(blobs))
        assert got == list(blobs.values())
    finally:
        for c in owners:
            await c.close()
        await runner.stop()


@pytest.mark.parametrize("backend", ["tcp", "auto"])  # auto: the copy is read straight out of shared memory
async def test_a_corrupt_dram_copy_is_a_miss_removed_and_counted(backend: str):
    runner, addr = await start()
    owner = await client(addr, "owner", dram_bytes=256 * KiB, transfer_backend=backend)
    reader = await client(addr, "reader", transfer_backend=backend)
    try:
        data = os.urandom(16 * KiB)
        assert await reader.put("m/x", data)
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = store_pb2_grpc.StoreMasterStub(ch)
            rep = (await stub.GetReplicas(store_pb2.GetReplicasRequest(key="m/x"), timeout=5)).object.replicas[0]
        owner.dram.tensor[rep.offset + 100] ^= 0xFF
        before = metric("mooncaked_store_checksum_failures_total", tier="dram")
        assert await reader.get("m/x") is None
        assert metric("mooncaked_store_checksum_failures_total", tier="dram") == before + 1
        assert not await reader.exist("m/x")
    finally:
        await reader.close()
        await owner.close()
        await runner.stop()


async def test_puts_and_gets_through_shared_memory_match_the_staged_path():
    """Over backend auto a caller's bytes go straight into the owner's segment and come straight
    back as bytes; tensors (and the tcp client) take the staging area. Each reads what the others wrote."""
    runner, addr = await start()
    owner = await client(addr, "owner", dram_bytes=1 << 20, transfer_backend="auto")
    shm = await client(addr, "shm", transfer_backend="auto")
    tcp = await client(addr, "tcp", transfer_backend="tcp")
    try:
        blobs = {f"s/{i}": os.urandom(9 * KiB + i) for i in range(6)}
        kinds = [bytes, bytearray, memoryview]
        shm_sent = metric("mooncaked_transfer_sent_bytes_total", backend="shm")
        for i, (k, v) in enumerate(blobs.items()):
            assert await (shm if i % 2 else tcp).put(k, kinds[i % 3](v))
        assert metric("mooncaked_transfer_sent_bytes_total", backend="shm") - shm_sent == sum(
            len(v) for i, v in enumerate(blobs.values()) if i % 2)
        t = torch.arange(1024, dtype=torch.float32)
        assert await shm.put("s/tensor", t)
        for c in (shm, tcp):
            for k, v in blobs.items():
                assert await c.get(k) == v
            keys = [*blobs, "s/missing", "s/tensor"]
            got = await c.batch_get(keys)
            assert got[:len(blobs)] == list(blobs.values()) and got[len(blobs)] is None
            assert got[-1] == bytes(t.numpy())
            out = torch.empty(1024, dtype=torch.float32)
            assert await c.get_into("s/tensor", out) and torch.equal(out, t)
    finally:
        for c in (tcp, shm, owner):
            await c.close()
        await runner.stop()


async def test_a_get_copies_from_the_last_seen_place_and_keeps_only_the_committed_bytes():
    """hints.py: a client that put an object copies it from that place while the master answers its
    lookup, and keeps the copy only when it hashes to the checksum the master answers. A place whose
    key was removed and put again elsewhere gives a stale copy: never served, never counted as corrupt."""
    runner, addr = await start()
    owner = await client(addr, "owner", dram_bytes=1 << 20, transfer_backend="auto")
    # the early copy during the lookup, not the owner's index (owner_index.py), which needs no lookup
    writer = await client(addr, "writer", transfer_backend="auto", owner_reads=False)
    other = await client(addr, "other", transfer_backend="auto")
    try:
        a, b, a2 = (os.urandom(32 * KiB) for _ in range(3))
        assert await writer.put("h/a", a) and await writer.put("h/b", b)
        used = metric("mooncaked_store_client_hinted_reads_total", outcome="used")
        stale = metric("mooncaked_store_client_hinted_reads_total", outcome="stale")
        failures = metric("mooncaked_store_checksum_failures_total", tier="dram")
        assert await writer.get("h/a") == a
        assert metric("mooncaked_store_client_hinted_reads_total", outcome="used") == used + 1

        # another client replaces h/a (its old place stays leased, so the new bytes land elsewhere)
        assert await other.remove(["h/a"]) == 1
        assert await other.put("h/a", a2)
        assert await writer.batch_get(["h/a", "h/b"]) == [a2, b]
        assert metric("mooncaked_store_client_hinted_reads_total", outcome="stale") == stale + 1
        assert metric("mooncaked_store_client_hinted_reads_total", outcome="used") == used + 2  # h/b
        assert metric("mooncaked_store_checksum_failures_total", tier="dram") == failures
        assert await writer.get("h/a") == a2  # the lookup refreshed the hint: used again
        assert metric("mooncaked_store_client_hinted_reads_total", outcome="used") == used + 3

        # a removed key is a miss even though its old place still holds intact bytes
        assert await other.remove(["h/b"]) == 1
        assert await writer.get("h/b") is None
        assert await writer.exist("h/a")
    finally:
        for c in (other, writer, owner):
            await c.close()
        await runner.stop()


async def test_a_client_whose_first_start_failed_starts_on_a_later_try():
    """An engine retries start() while the master comes up (`--role all` starts them together): the
    regions and LMDB tier of the failed try are kept, not registered twice."""
    from cluster import free_port
    from mooncaked.store import StoreClient, StoreClientConfig, StoreError

    port = free_port()  # below the ephemeral range: nothing takes it before the master starts on it
    c = StoreClient(StoreClientConfig(master=f"127.0.0.1:{port}", client_id="early", dram_bytes=256 * KiB,
                                      rpc_timeout_s=0.5, ping_interval_s=0.2))
    with pytest.raises(StoreError):
        await c.start()  # no master yet
    runner, addr = await start(port=port)
    try:
        for _ in range(100):  # as the engine role does: the channel reconnects after its backoff
            try:
                await c.start()
                break
            except StoreError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the client never started once the master was up")
        data = os.urandom(8 * KiB)
        assert await c.put("e/1", data) and await c.get("e/1") == data
    finally:
        await c.close()
        await runner.stop()


async def test_a_client_started_just_after_a_master_restart_finds_it_at_once():
    """Another client of this process found the master gone a moment ago and waits out its reconnect
    backoff: a new client's first call is not failed by that connection's last error (rpc.py)."""
    from mooncaked.store import StoreUnavailable

    runner, addr = await start()
    port = int(addr.rsplit(":", 1)[1])
    early = await client(addr, "early", fast_path=False)
    runner2 = late = None
    try:
        await runner.stop(0)
        with pytest.raises(StoreUnavailable):
            await early.exist("k")  # its connection is now in backoff
        runner2, _ = await start(port=port)
        late = await client(addr, "late", dram_bytes=256 * KiB)  # a Describe at once: no retry here
        assert await late.put("k", b"v") and await late.get("k") == b"v"
    finally:
        for c in (late, early):
            if c is not None:
                await c.close()
        if runner2 is not None:
            await runner2.stop(0)


async def test_a_client_that_never_reads_its_tasks_stream_is_dropped_not_buffered_forever():
    """The master queues each DRAM owner's journal (and tier tasks) for its Tasks stream. A client that
    mounts a segment and never reads that stream must not grow the master's memory without bound:
    past the cap it is dropped like a silent one, and everyone else is served on."""
    runner, addr = await start()
    runner.service.max_queued_tasks = 3
    writer = await client(addr, "writer", dram_bytes=256 * KiB)
    try:
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = store_pb2_grpc.StoreMasterStub(ch)
            seg = transfer_pb2.SegmentInfo(name="silent/dram", medium="dram", nbytes=256 * KiB,
                                           endpoint=common_pb2.TransferEndpoint(address="127.0.0.1:9", backend="tcp",
                                                                                region="dram"))
            await stub.MountSegment(store_pb2.MountSegmentRequest(client_id="silent", segment=seg), timeout=5)
            for i in range(20):  # each commit on its segment journals to it; one message per flush
                placed = await stub.PutStart(store_pb2.PutStartRequest(key=f"j/{i}", size=64,
                                                                       preferred_segment="silent/dram"), timeout=5)
                assert placed.replicas[0].segment == "silent/dram"
                await stub.PutEnd(store_pb2.PutEndRequest(key=f"j/{i}", checksum=1), timeout=5)
                await asyncio.sleep(0.03)  # past the journal's flush: a message each
                if "silent" not in runner.service.master.clients:
                    break
            assert "silent" not in runner.service.master.clients, "the client that never read was not dropped"
            assert "silent/dram" not in runner.service.master.segments
            assert await writer.put("after", os.urandom(4 * KiB)), "the master stopped serving others"
            assert await writer.get("after") is not None
    finally:
        await writer.close()
        await runner.stop()
