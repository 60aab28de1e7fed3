"""Where one put and one get of our KV pool spend their time over TCP (`bench_store.py --phases`).

The bench layout (a master process, an owner process that lends DRAM over backend tcp, a driver
that lends nothing), and in the driver each phase of a single-object op timed alone with
`perf_counter`, p50 over the objects: the master round trips (a lookup, a commit), the data-plane round trips (one read, one write of the object), the checksum (of bytes
not touched since they were made, as a caller's fresh KV block, and of bytes just received),
the copy into the staging area and out of it as `bytes` (a put is also done by hand, phase by
phase, into places reserved ahead, as put() does); one read by key from the owner (no master:
owner_server.py); and the whole ops, interleaved object by object in rotating order so that a
loaded machine slows them alike: a get by key from the owner (the client knows it from its put),
the same into a contiguous tensor (read straight into it: no `bytes` made), a get with a location
hint but owner reads off (the read from the last-seen place overlaps the lookup: reads.py), and a
get with neither (lookup, then read). The phases of one
op add up to more than the op where they overlap; the sum of the serial ones is shown too.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

MiB = 1 << 20


def _p50_us(samples: list[float]) -> float:
    return round(1e6 * statistics.median(samples), 1)


def _driver(pipe: Any, master: str, n: int, size: int) -> None:
    import torch
    import uvloop

    from bench_store import payloads
    from mooncaked.proto.mooncake.v1 import store_pb2
    from mooncaked.store import StoreClient, StoreClientConfig
    from mooncaked.store.dram_segment import STAGING_REGION
    from mooncaked.store.metrics import OWNER_GETS
    from mooncaked.store.owner_link import OwnerRead
    from mooncaked.store.owner_wire import SERVED
    from mooncaked.store.records import checksum
    from mooncaked.transfer import TransferOp

    async def main() -> dict[str, Any]:
        client = StoreClient(StoreClientConfig(master=master, client_id="phases-driver", transfer_backend="tcp"))
        await client.start()
        staging = client.staging
        assert staging is not None
        data, fresh = payloads(n, size), payloads(n, size)
        keys = [f"phases/{i}" for i in range(n)]
        for i in range(8):  # warm up connections and the places reserved ahead
            await client.put(f"warm/{i}", data[i])
            await client.get(f"warm/{i}")
        t: dict[str, list[float]] = {name: [] for name in (
            "put", "put_checksum_cold", "put_stage_copy", "put_write_rtt", "put_commit_rtt", "get_owner",
            "get_into_owner", "get_hinted_early", "get_no_hint", "get_lookup_rtt", "get_read_rtt", "get_owner_rtt",
            "get_checksum_warm", "get_bytes_copy")}

        def timed(name: str, fn, *args):  # noqa: ANN001, ANN202 - a local helper
            s = time.perf_counter()
            out = fn(*args)
            t[name].append(time.perf_counter() - s)
            return out

        for k, d in zip(keys, data):
            s = time.perf_counter()
            assert await client.put(k, d)
            t["put"].append(time.perf_counter() - s)
        # a put by hand, phase by phase: places reserved ahead (as put() keeps them), then per object
        # checksum, copy into staging, write to the owner, commit
        places: list[Any] = []
        async with staging.lease([size]) as (off,):
            for i, d in enumerate(fresh):
                if not places:
                    reply = await client.calls.call("ReservePlaces", store_pb2.ReservePlacesRequest(
                        client_id="phases-driver", size=size, count=32))
                    places = list(reply.reservations)
                place = places.pop()
                rep = place.replicas[0]
                csum = timed("put_checksum_cold", checksum, d)
                timed("put_stage_copy", staging.stage, off, d)
                s = time.perf_counter()
                await client.transfer.submit([TransferOp("write", STAGING_REGION, off, rep.endpoint.address,
                                                         rep.endpoint.region, rep.offset, size)])
                t["put_write_rtt"].append(time.perf_counter() - s)
                s = time.perf_counter()
                await client.calls.call("BatchPutEnd", store_pb2.BatchPutEndRequest(
                    reserved=[store_pb2.ReservedPut(reservation=place.id, key=f"byhand/{i}", checksum=csum)]))
                t["put_commit_rtt"].append(time.perf_counter() - s)
        if places:
            await client.calls.call("BatchPutEnd", store_pb2.BatchPutEndRequest(
                revoke_reservations=[p.id for p in places]))
        await client.remove([f"byhand/{i}" for i in range(n)])
        into = torch.empty(size, dtype=torch.uint8)
        reader = client._reader
        assert reader is not None
        owners = reader.owners
        hits = OWNER_GETS.labels("hit")
        hits_before = hits._value.get()

        async def get_owner(k: str, d: bytes) -> None:
            assert await client.get(k) == d

        async def get_into_owner(k: str, d: bytes) -> None:
            assert await client.get_into(k, into)

        async def get_hinted_early(k: str, d: bytes) -> None:
            reader.owners = None
            try:
                assert await client.get(k) == d
            finally:
                reader.owners = owners

        async def get_no_hint(k: str, d: bytes) -> None:
            hint = client._hints.pick([k])
            client._hints.forget([k])
            reader.owners = None
            try:
                assert await client.get(k) == d
            finally:
                reader.owners = owners
            if hint:  # as it was: the next object's variants see the same hints
                client._hints._by_key[k] = hint[0][1]

        await asyncio.sleep(0.05)  # the owner's journal has the last puts
        variants = [get_owner, get_into_owner, get_hinted_early, get_no_hint]
        for i, (k, d) in enumerate(zip(keys, data)):  # interleaved, in rotating order: load hits all alike
            for v in variants[i % 4:] + variants[:i % 4]:
                s = time.perf_counter()
                await v(k, d)
                t[v.__name__].append(time.perf_counter() - s)
        async with staging.lease([size]) as (off,):
            for k in keys:
                s = time.perf_counter()
                found = await client.calls.call("BatchGetReplicas",
                                                store_pb2.BatchGetReplicasRequest(keys=[k], client_id="phases-driver"))
                t["get_lookup_rtt"].append(time.perf_counter() - s)
                rep = found.objects[0].replicas[0]
                s = time.perf_counter()
                await client.transfer.submit([TransferOp("read", STAGING_REGION, off, rep.endpoint.address,
                                                         rep.endpoint.region, rep.offset, size)])
                t["get_read_rtt"].append(time.perf_counter() - s)
                hint = client._hints.pick([k])[0][1]
                s = time.perf_counter()
                assert await owners.read(hint.key_server, [OwnerRead(k, size, hint.checksum, staging.slice(off, size))]) \
                    == [SERVED]
                t["get_owner_rtt"].append(time.perf_counter() - s)
                timed("get_checksum_warm", checksum, staging.slice(off, size))
                timed("get_bytes_copy", bytes, staging.slice(off, size))
        owner_hits = hits._value.get() - hits_before
        await client.remove(keys)
        await client.close()
        p50 = {name: _p50_us(v) for name, v in t.items()}
        p50["owner_hits_of_owner_gets"] = round(owner_hits / (2 * n), 3)  # the share served by the owner
        p50["put_serial_sum"] = round(p50["put_checksum_cold"] + p50["put_stage_copy"] + p50["put_write_rtt"]
                                      + p50["put_commit_rtt"], 1)
        p50["get_serial_sum"] = round(p50["get_lookup_rtt"] + p50["get_read_rtt"] + p50["get_checksum_warm"]
                                      + p50["get_bytes_copy"], 1)
        return p50

    try:
        pipe.send(uvloop.run(main()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


def run(n: int, size: int, reps: int) -> dict[str, Any]:
    """p50 µs per phase, the median over `reps` layouts (each a fresh master, owner and driver)."""
    from bench_store import run_our_layout

    runs = [run_our_layout(_driver, (n, size), "tcp", 2 * n * size + 64 * MiB) for _ in range(reps)]
    return {name: round(statistics.median(r[name] for r in runs), 1) for name in runs[0]}
