"""The pool as real processes: the master as `run_store_role` in its own interpreter, an
owner engine's store client in a spawned process with a real LMDB folder, and this process
as a reader/writer. Persisting and promotion, client restart, master restart, a flipped byte
on disk, a killed client."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from cluster import free_port
from mooncaked.store import StoreClient, StoreClientConfig

KiB = 1024
SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(60)

_MASTER = ("import asyncio, sys\n"
           "from mooncaked.config import StoreConfig\n"
           "from mooncaked.roles.store_role import run_store_role\n"
           "sys.exit(asyncio.run(run_store_role(StoreConfig(**eval(sys.argv[1])))))\n")


class Master:
    """`run_store_role` in a child interpreter; its port read from the line it prints."""

    def __init__(self, port: int = 0, **settings: Any) -> None:
        settings = {"listen": f"127.0.0.1:{port}", "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5,
                    "store_lease_s": 1.0, "log_level": "INFO", **settings}
        self.proc = subprocess.Popen([sys.executable, "-c", _MASTER, repr(settings)], stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"gRPC on ([\d.]+):(\d+)", line)
        assert m, f"store role printed {line!r}"
        self.port = int(m.group(2))
        self.address = f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=15)


def _agent(conn: Connection, cfg: dict[str, Any]) -> None:
    """An engine's store client in its own process, driven over a pipe."""

    async def main() -> None:
        client = StoreClient(StoreClientConfig(**cfg))
        await client.start()
        conn.send("ready")
        loop = asyncio.get_running_loop()
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "close":
                await client.close()
                conn.send("closed")
                return
            if cmd == "done":
                conn.send(client.worker.done if client.worker else 0)
            if cmd == "remounts":
                conn.send(client.mounts.remounts)

    asyncio.run(main())


class Agent:
    def __init__(self, master: str, name: str, **cfg: Any) -> None:
        self.conn, child = SPAWN.Pipe()
        cfg = {"master": master, "client_id": name, "ping_interval_s": 0.2, **cfg}
        self.proc = SPAWN.Process(target=_agent, args=(child, cfg), daemon=True)
        self.proc.start()
        assert self.conn.poll(30), "store client process did not start"
        assert self.conn.recv() == "ready"

    def ask(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(20), f"no answer to {cmd}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.ask("close")
        self.proc.join(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


async def reader(master: str, **kw: Any) -> StoreClient:
    c = StoreClient(StoreClientConfig(master=master, client_id=f"reader-{os.getpid()}", get_batch_keys=8, **kw))
    await c.start()
    return c


def blobs(n: int, size: int = 64 * KiB, prefix: str = "m") -> dict[str, bytes]:
    return {f"{prefix}/{i:04d}": os.urandom(size) for i in range(n)}


async def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def lmdb_objects(c: StoreClient) -> int:
    stats = await c.pool_stats()
    return sum(s.objects for s in stats.segments if s.medium == "lmdb")


@pytest.fixture
def master():
    m = Master()
    yield m
    assert m.stop() == 0, "the store role exits 0 on SIGTERM"


async def test_small_dram_demotes_to_lmdb_and_serves_from_it(master, tmp_path):
    owner = Agent(master.address, "P1", dram_bytes=1024 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                  lmdb_bytes=32 * 1024 * KiB)
    c = await reader(master.address)
    try:
        data = blobs(48)  # 3 MiB into a 1 MiB DRAM tier
        assert all(await c.batch_put(list(data.items())))
        assert (await c.pool_stats()).objects == 48
        # each object was copied to LMDB after its commit (persisted), so leaving DRAM dropped a copy
        await wait_for(lambda: _lmdb_at_least(c, 48), what="every object to be on LMDB too")
        await wait_for(lambda: _idle(c), what="DRAM to fall under its high watermark")
        got = await c.batch_get(list(data))
        assert got == list(data.values()), "every object comes back, most of them through LMDB"
        assert (await c.pool_stats()).promotions >= 30
        assert await c.longest_prefix(list(data) + ["m/missing", "m/0000"]) == 48
    finally:
        await c.close()
        owner.close()


async def _idle(c: StoreClient) -> bool:
    stats = await c.pool_stats()
    dram = [s for s in stats.segments if s.medium == "dram"]
    return all(s.used <= 0.9 * s.capacity for s in dram)


@pytest.mark.timeout(150)  # its own wait for the remount is 60 s: that wait, not the file's 60 s, must say what hung
async def test_restarting_the_master_loses_nothing_on_lmdb(tmp_path):
    """Kill the master the moment the last put is committed: the owner's DRAM (512 KiB) holds the last
    objects, their copies to its LMDB tier are still being written, and the last commits' journal batch has
    not reached the owner. Every object still comes back: from the owner's LMDB tier and DRAM journal, and
    the last ones from the writer, which lends nothing and so has no ping to tell it of the new master
    (master_watch.py)."""
    port = free_port()
    master = Master(port)
    owner = Agent(master.address, "P1", dram_bytes=512 * KiB, lmdb_path=str(tmp_path / "lmdb"),
                  lmdb_bytes=32 * 1024 * KiB)
    c = await reader(master.address)
    try:
        data = blobs(40)
        assert all(await c.batch_put(list(data.items())))
        # no wait for the LMDB copies: an LMDB copy counts once written (PoolStats counts complete copies), so
        # a wait for all of them would kill the master after the race this test is about
        on_lmdb = await lmdb_objects(c)
        assert master.stop(signal.SIGKILL) != 0
        master = Master(port)
        # the new master starts (a Python process) and the owner re-registers with back-off: slow on a loaded host
        seen: list[int | str] = []  # what the master answered meanwhile (a failure's message says)

        async def back() -> bool:
            try:
                seen.append(sum(await c.batch_exist(list(data))))
                return seen[-1] == len(data)
            except Exception as e:  # noqa: BLE001 - the new master may not be up yet
                seen.append(repr(e)[:200])
                return False

        try:
            await wait_for(back, timeout=60.0, what="every object back at the new master")
        except AssertionError as e:
            raise AssertionError(f"{e}: wanted {len(data)} ({on_lmdb} on LMDB at the kill); the master's last "
                                 f"answers {seen[-3:]}; the owner remounted {owner.ask('remounts')} times") from None
        # the objects show at the master as the owner's mount lands; its count of remounts moves just after

        async def remounted() -> bool:
            return owner.ask("remounts") >= 1

        await wait_for(remounted, what="the owner to count its remount")
        present = [k for k, e in zip(data, await c.batch_exist(list(data))) if e]
        assert present == list(data)
        assert await c.batch_get(present) == list(data.values())
    finally:
        await c.close()
        owner.close()
        assert master.stop() == 0


async def _lmdb_at_least(c: StoreClient, n: int) -> bool:
    try:
        return await lmdb_objects(c) >= n
    except Exception:  # noqa: BLE001 - the new master may not be up yet
        return False


async def test_a_restarted_client_brings_back_its_objects_but_never_a_flipped_byte(master, tmp_path):
    """Stop an engine's client (it moves what only its DRAM holds to LMDB first), flip one byte of
    one LMDB value on disk, start it again on the same path: every other object is back in the
    pool, the damaged one is detected on read, never served, and removed."""
    cfg = dict(dram_bytes=512 * KiB, lmdb_path=str(tmp_path / "lmdb"), lmdb_bytes=32 * 1024 * KiB)
    owner = Agent(master.address, "P1", **cfg)
    c = await reader(master.address)
    try:
        data = blobs(40)
        assert all(await c.batch_put(list(data.items())))
        await wait_for(lambda: _lmdb_at_least(c, 40), what="every object to be persisted on LMDB")
        stats = await c.pool_stats()
        assert any(s.medium == "dram" and s.objects for s in stats.segments), "the newest still in DRAM too"
        owner.close()
        assert not any(await c.batch_exist(list(data))), "a stopped client's objects leave the pool"

        mdb = Path(cfg["lmdb_path"]) / "data.mdb"
        raw = bytearray(mdb.read_bytes())
        assert all(raw.find(v[1000:1064]) >= 0 for v in data.values()), "every object was written to LMDB"
        victim = "m/0007"
        raw[raw.find(data[victim][1000:1064]) + 17] ^= 0x01
        mdb.write_bytes(bytes(raw))

        owner = Agent(master.address, "P1", **cfg)
        assert all(await c.batch_exist(list(data))), "every object is back after the restart"
        assert await c.get(victim) is None, "a corrupt value must never be served"
        assert not await c.exist(victim), "the corrupt object is removed from the pool"
        rest = [k for k in data if k != victim]
        assert await c.batch_get(rest) == [data[k] for k in rest]
    finally:
        await c.close()
        owner.close()


async def test_a_dead_clients_segments_are_unmounted_and_its_objects_dropped(master):
    owner = Agent(master.address, "P1", dram_bytes=512 * KiB)
    c = await reader(master.address, no_room_retry_s=0.2)
    try:
        data = blobs(4, 16 * KiB)
        assert all(await c.batch_put(list(data.items())))
        assert all(await c.batch_exist(list(data)))
        owner.kill()
        await wait_for(lambda: _no_segments(c), timeout=6, what="the dead client's segments to go")
        assert not any(await c.batch_exist(list(data)))
        assert await c.get("m/0000") is None
        assert not await c.put("m/new", b"x" * 100)  # no segment left: no room, and no crash
    finally:
        await c.close()


async def test_an_owner_killed_mid_persist_brings_back_what_reached_lmdb_intact(master, tmp_path):
    """kill -9 of an engine while puts land on its DRAM and the master's persists to its LMDB tier are
    under way: what only its DRAM held is gone with it (volatile), but every object the master had on
    LMDB before the kill is back when the engine starts again on the same folder, with its own bytes."""
    cfg = dict(dram_bytes=16 * 1024 * KiB, lmdb_path=str(tmp_path / "lmdb"), lmdb_bytes=64 * 1024 * KiB)
    owner = Agent(master.address, "P1", **cfg)
    c = await reader(master.address, rpc_timeout_s=2.0, no_room_retry_s=0.2)
    data = blobs(192)
    keys = list(data)

    async def put_in_batches() -> None:
        for s in range(0, len(keys), 16):
            if not all(await c.batch_put([(k, data[k]) for k in keys[s:s + 16]])):
                return  # the owner is gone
            await asyncio.sleep(0.02)

    puts = asyncio.create_task(put_in_batches())
    try:
        await wait_for(lambda: _lmdb_at_least(c, 16), what="the first persists")
        on_lmdb = await lmdb_objects(c)
        owner.kill()
        await asyncio.gather(puts, return_exceptions=True)  # those after the kill fail: no room, or the owner gone
        await wait_for(lambda: _no_segments(c), timeout=6, what="the dead client's segments to go")
        assert not any(await c.batch_exist(keys))

        owner = Agent(master.address, "P1", **cfg)
        back = [k for k, there in zip(keys, await c.batch_exist(keys)) if there]
        assert len(back) >= on_lmdb > 0, f"{len(back)} back, {on_lmdb} were on LMDB at the kill"
        assert await c.batch_get(back) == [data[k] for k in back], "what came back has its own bytes"
    finally:
        puts.cancel()
        await c.close()
        owner.close()


async def _no_segments(c: StoreClient) -> bool:
    return not (await c.pool_stats()).segments


async def test_the_store_role_serves_health_and_stops_cleanly_on_sigterm():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc

    m = Master()
    try:
        async with grpc.aio.insecure_channel(m.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="mooncake.v1.StoreMaster"), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stats = await store_pb2_grpc.StoreMasterStub(ch).PoolStats(store_pb2.PoolStatsRequest(), timeout=5)
            assert stats.master_epoch and not stats.segments
    finally:
        assert m.stop() == 0
