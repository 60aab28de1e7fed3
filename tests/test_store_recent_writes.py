"""A put on another engine's DRAM, committed just before the master went, is not forgotten: the
writer re-reports it (store/recent_writes.py) to the master that follows. Real master(s) on
loopback gRPC, real clients with DRAM segments in this process."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from store_helpers import client, start

from mooncaked.store import Policy
from mooncaked.store.errors import InvalidArgument, StoreUnavailable
from mooncaked.store.master import StoreMaster
from mooncaked.store.recent_writes import RecentWrites
from mooncaked.store.removed_keys import RemovedKeys
from mooncaked.store.records import Endpoint, ObjectRecord, SegmentSpec

KiB = 1024
pytestmark = pytest.mark.timeout(60)


def _dram(name: str, owner: str, capacity: int = 64 * KiB) -> SegmentSpec:
    return SegmentSpec(f"{owner}/{name}", "dram", capacity, Endpoint("127.0.0.1:9", "tcp", "dram", "", ""))


def test_the_master_takes_reported_writes_into_free_space_only():
    m = StoreMaster(Policy(persist=False))
    m.mount("owner", _dram("dram", "owner"), [ObjectRecord("known", 0, 1024, 7)])
    m.mount("writer", _dram("dram", "writer"))
    accepted, rejected, mounted = m.report_writes("writer", "owner/dram", [
        ObjectRecord("new", 4096, 1024, 1),       # free space: taken
        ObjectRecord("known", 8192, 1024, 7),     # the master knows this key already
        ObjectRecord("overlap", 512, 1024, 2),    # over the known object's bytes
    ])
    assert (accepted, rejected, mounted) == (1, ["known", "overlap"], True)
    assert m.objects["new"].committed and m.objects["new"].replicas[0].offset == 4096
    assert m.report_writes("writer", "gone/dram", [ObjectRecord("x", 0, 10, 1)]) == (0, [], False)
    with pytest.raises(InvalidArgument, match="caller's own"):
        m.report_writes("owner", "owner/dram", [ObjectRecord("y", 20000, 10, 1)])


def test_a_key_removed_at_the_new_master_is_not_brought_back_by_a_late_report():
    """A Remove of a key the master does not know yet (its owner has not remounted, its writer not
    re-reported) still counts: neither report brings it back while the note lasts; after a new commit
    of the key, reports of that new object are taken and those of the removed one still refused."""
    now = [0.0]
    m = StoreMaster(Policy(persist=False), clock=lambda: now[0])
    m.mount("writer", _dram("dram", "writer"))
    assert m.remove(["gone", "lmdb-gone", "again"]) == 0  # nothing known yet
    m.mount("owner", _dram("dram", "owner"), [ObjectRecord("gone", 0, 1024, 7), ObjectRecord("kept", 1024, 1024, 8)])
    assert set(m.objects) == {"kept"}
    m.mount("owner", SegmentSpec("owner/lmdb", "lmdb", 1 << 20, Endpoint("", "", "lmdb", "", "")),
            [ObjectRecord("lmdb-gone", 0, 1024, 9)])
    assert "lmdb-gone" not in m.objects
    assert m.report_writes("writer", "owner/dram", [ObjectRecord("gone", 8192, 1024, 7)])[:2] == (0, ["gone"])
    m.put_start("again", 1024, 3)
    m.put_end("again")
    m.remove(["again"])  # the owner's journal of this object may come back at a remount: refused
    assert m.report_writes("writer", "owner/dram", [ObjectRecord("again", 16384, 1024, 3)])[:2] == (0, ["again"])
    m.put_start("again", 1024, 4)
    m.put_end("again")  # committed anew: its own record is what a remount brings from now on
    assert not m.removed.holds("again", 4) and m.removed.holds("again", 3)
    m.catalog.forget(m.objects["again"])  # (as an eviction does) then late reports of both versions
    assert m.report_writes("writer", "owner/dram", [ObjectRecord("again", 16384, 1024, 3)])[:2] == (0, ["again"])
    assert m.report_writes("writer", "owner/dram", [ObjectRecord("again", 16384, 1024, 4)])[:2] == (1, [])
    now[0] = 1000.0  # long after: a report of "gone" is taken like any other
    assert m.report_writes("writer", "owner/dram", [ObjectRecord("gone", 32768, 1024, 7)])[:2] == (1, [])


def test_removed_keys_are_bounded_by_count_oldest_first():
    r = RemovedKeys(keep_s=60.0, max_keys=3, clock=lambda: 0.0)
    r.note(["a", "b", "c"])
    r.note(["a", "d"])  # "a" again is the newest; "b" is the oldest now and goes
    assert [k for k in "abcd" if r.holds(k, 0)] == ["a", "c", "d"] and len(r) == 3


def test_recent_writes_are_kept_for_a_while_and_settled_per_segment():
    now = [0.0]
    r = RecentWrites(keep_s=3.0, clock=lambda: now[0])
    r.note("a/dram", "k1", 0, 10, 1)
    now[0] = 2.0
    r.note("b/dram", "k2", 0, 10, 1)
    assert {s: [w.key for w in ws] for s, ws in r.by_segment().items()} == {"a/dram": ["k1"], "b/dram": ["k2"]}
    now[0] = 3.5  # k1 is older than keep_s: its journal batch went out long ago
    assert list(r.by_segment()) == ["b/dram"]
    r.settle("b/dram")
    assert not r.by_segment() and len(r) == 0


async def test_a_write_whose_journal_never_reached_the_owner_survives_a_master_restart():
    runner, addr = await start(persist=False)
    port = int(addr.rsplit(":", 1)[1])
    owner = await client(addr, "owner", dram_bytes=1024 * KiB)
    writer = await client(addr, "writer", dram_bytes=64 * KiB)  # less room: the pool places on the owner
    runner2 = None
    try:
        runner.service.journal = lambda *a: None  # the master dies before any journal batch goes out
        data = {f"w/{i}": os.urandom(16 * KiB) for i in range(5)}
        assert all(await writer.batch_put(list(data.items())))
        stats = await writer.pool_stats()
        on_owner = next(s.objects for s in stats.segments if s.name == "owner/dram")
        assert on_owner == len(data), "the pool placed the writes on the owner's DRAM"
        assert len(owner.journal) == 0 and len(writer.recent_writes) == len(data)

        await runner.stop(0)
        runner2, _ = await start(port=port, persist=False)
        await _all_back(writer, data)
        await asyncio.sleep(0.1)  # the new master journals them to their owner now
        assert len(owner.journal) == len(data)
    finally:
        await writer.close()
        await owner.close()
        if runner2 is not None:
            await runner2.stop(0)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "grpc"])
async def test_a_writer_that_lends_nothing_re_reports_after_a_restart_longer_than_its_records_last(fast_path):
    """The writer has no segment, so no ping tells it of the new master (master_watch.py does), and the
    master stays away three times longer than a record is kept: the records wait for it."""
    runner, addr = await start(persist=False)
    port = int(addr.rsplit(":", 1)[1])
    owner = await client(addr, "owner", dram_bytes=1024 * KiB)
    writer = await client(addr, "writer", fast_path=fast_path)
    writer.recent_writes.keep_s = 0.3
    runner2 = None
    try:
        runner.service.journal = lambda *a: None  # the master dies before any journal batch goes out
        data = {f"n/{i}": os.urandom(16 * KiB) for i in range(5)}
        assert all(await writer.batch_put(list(data.items())))
        assert len(owner.journal) == 0 and len(writer.recent_writes) == len(data)

        await runner.stop(0)
        await asyncio.sleep(0.05)
        if not fast_path:  # nothing broke under it yet: its next call finds the master gone
            with pytest.raises(StoreUnavailable):
                await writer.exist("n/0")
        await asyncio.sleep(3 * writer.recent_writes.keep_s)
        held = sum(len(ws) for ws in writer.recent_writes.by_segment().values())  # (ageing as it is read)
        assert held == len(data), "records aged out while the master was away"
        runner2, _ = await start(port=port, persist=False)
        await _all_back(writer, data)
        await asyncio.sleep(0.5)  # reported and taken: they age again
        assert not writer.recent_writes.by_segment()
    finally:
        await writer.close()
        await owner.close()
        if runner2 is not None:
            await runner2.stop(0)


async def test_a_key_removed_before_the_writer_re_reports_stays_removed():
    """The master restarts; another client removes one of the writer's last puts at the new master
    before the writer's re-report arrives: the report brings the others back, not that one."""
    runner, addr = await start(persist=False)
    port = int(addr.rsplit(":", 1)[1])
    owner = await client(addr, "owner", dram_bytes=1024 * KiB)
    writer = await client(addr, "writer")
    removed = asyncio.Event()
    report = writer._watch.report

    async def report_after_the_remove() -> None:
        await removed.wait()
        await report()

    writer._watch.report = report_after_the_remove
    runner2 = remover = None
    try:
        runner.service.journal = lambda *a: None  # the master dies before any journal batch goes out
        data = {f"r/{i}": os.urandom(16 * KiB) for i in range(4)}
        assert all(await writer.batch_put(list(data.items())))
        await runner.stop(0)
        runner2, _ = await start(port=port, persist=False)
        remover = await client(addr, "remover")
        assert await remover.remove(["r/0"]) == 0  # unknown to the new master yet
        removed.set()
        kept = {k: v for k, v in data.items() if k != "r/0"}
        await _all_back(writer, kept)
        assert len(runner2.service.master.removed) == 1
        assert await writer.batch_exist(list(data)) == [False, True, True, True]
        assert await writer.get("r/0") is None
    finally:
        for c in (remover, writer, owner):
            if c is not None:
                await c.close()
        if runner2 is not None:
            await runner2.stop(0)


async def _all_back(writer, data: dict[str, bytes]) -> None:
    """Every object exists at the new master (the writer's re-report was taken), and reads back intact."""
    deadline = time.monotonic() + 30
    while not all(await _exist(writer, list(data))):
        assert time.monotonic() < deadline, "the writer's recent writes were not taken back"
        await asyncio.sleep(0.1)
    assert await writer.batch_get(list(data)) == list(data.values())


async def _exist(c, keys: list[str]) -> list[bool]:
    try:
        return await c.batch_exist(keys)
    except Exception:  # noqa: BLE001 - the new master may not be up yet
        return [False]
