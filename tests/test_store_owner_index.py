"""The owner's index in shared memory (store/owner_index.py): a get on the owner's host copies the
object with no round trip, only while the owner lists it exactly as the reader knew it and its serve
window is open. The table on its own, then clients over shared memory against a real master: no
lookup at the master, never a removed or re-put object, nothing once the window has closed, and the
reads counted in the master's LRU."""

from __future__ import annotations

import os
import stat
import time
import uuid

import pytest
import torch
from store_helpers import held, metric, pool, start, until

from mooncaked.store import StoreClient, StoreClientConfig, owner_index, service
from mooncaked.store.errors import StoreUnavailable
from mooncaked.store.owner_index import IndexView, IndexViews, OwnerIndex, index_name
from mooncaked.transfer import TransferError
from mooncaked.transfer.shm_files import SHM_DIR, SHM_PREFIX

KiB = 1024
pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not owner_index.supported(), reason="the owner index needs x86-64's memory order")]
SHM = dict(transfer_backend="shm")


def _segment_name() -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _open_for(seconds: float) -> int:
    return time.monotonic_ns() + int(seconds * 1e9)


def test_the_index_vouches_for_exactly_what_the_owner_holds_while_its_window_is_open():
    idx = OwnerIndex(_segment_name(), 64)
    try:
        path = os.path.join(SHM_DIR, idx.name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        view = IndexView(idx.name)
        idx.put("k", 4096, 100, 77)
        assert view.vouch("k", 4096, 100, 77) is None  # the window is closed
        idx.set_window(_open_for(10))
        token = view.vouch("k", 4096, 100, 77)
        assert token is not None and view.still(*token)
        for other in (("k", 0, 100, 77), ("k", 4096, 99, 77), ("k", 4096, 100, 78), ("j", 4096, 100, 77)):
            assert view.vouch(*other) is None, other
        idx.put("k", 8192, 100, 77)  # moved: the old place is no longer vouched for, nor the copy made from it
        assert not view.still(*token) and view.vouch("k", 4096, 100, 77) is None
        assert view.vouch("k", 8192, 100, 77) is not None
        view.touch(view.vouch("k", 8192, 100, 77)[0])
        assert idx.take_touched(10) == ["k"] and idx.take_touched(10) == []
        idx.remove("k")
        assert view.vouch("k", 8192, 100, 77) is None
        idx.put("k", 0, 1, 2)
        idx.set_window(_open_for(0.001))  # less than the reader's margin left: closed to it
        assert view.vouch("k", 0, 1, 2) is None
        view.close()
    finally:
        idx.close()
    assert not os.path.exists(path)


def test_a_full_bucket_evicts_its_oldest_entry():
    idx = OwnerIndex(_segment_name(), 4)  # one bucket of 4 ways
    try:
        idx.set_window(_open_for(10))
        view = IndexView(idx.name)
        for i in range(5):
            idx.put(f"k{i}", i * 64, 10, i + 1)
        assert view.vouch("k0", 0, 10, 1) is None  # evicted: read the other ways
        assert all(view.vouch(f"k{i}", i * 64, 10, i + 1) is not None for i in range(1, 5))
        idx.remove("k0")  # not listed: nothing to do
        idx.clear()
        assert all(view.vouch(f"k{i}", i * 64, 10, i + 1) is None for i in range(5))
        view.close()
    finally:
        idx.close()


def test_a_reader_maps_only_a_private_table_of_ours():
    name = index_name(_segment_name())
    path = os.path.join(SHM_DIR, name)
    with open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600), "wb") as f:
        f.write(b"NOTATABLE" * 100)
    try:
        with pytest.raises(TransferError, match="is not one"):
            IndexView(name)
        os.chmod(path, 0o644)
        with pytest.raises(TransferError, match="lets others open it"):
            IndexView(name)
        views = IndexViews()
        assert views.get(name) is None and views.get(name) is None  # refused, then not tried again for a while
        assert views.get(index_name(_segment_name())) is None  # none there
    finally:
        os.unlink(path)
    with pytest.raises(TransferError):
        IndexView("../etc/passwd")


def index_gets() -> float:
    return metric("mooncaked_store_client_owner_gets_total", outcome="index")


def lookups() -> float:
    return sum(metric("mooncaked_store_lookups_total", result=r) for r in ("hit", "miss"))


async def test_a_get_on_the_owners_host_is_copied_from_its_index_without_any_round_trip():
    clients = ("owner", dict(dram_bytes=1 << 20, **SHM)), ("writer", SHM), ("reader", SHM)
    async with pool(*clients) as (runner, (owner, writer, reader)):
        a, b = os.urandom(64 * KiB), os.urandom(48 * KiB)
        assert await writer.put("i/a", a) and await writer.put("i/b", b)
        await held(owner, "i/a")
        await held(owner, "i/b")
        await until(owner.owner_server.window.open, "the owner's window open")
        served, asked = index_gets(), lookups()
        assert await writer.get("i/a") == a  # the writer knows the place and checksum from its put
        assert await writer.batch_get(["i/a", "i/b"]) == [a, b]
        out = bytearray(48 * KiB)
        t = torch.frombuffer(out, dtype=torch.uint8)
        assert await writer.get_into("i/b", t) and bytes(out) == b  # into a tensor too
        assert index_gets() == served + 4 and lookups() == asked  # no lookup at the master
        assert await reader.get("i/b") == b  # the reader learns the place from a lookup...
        assert lookups() == asked + 1
        assert await reader.get("i/b") == b  # ...and copies it from the index after
        assert lookups() == asked + 1 and index_gets() == served + 5
        obj = runner.master.objects["i/b"]  # the owner reports what readers took with its next ping
        await until(lambda: obj.hits >= 2, "i/b read through the index, counted at the master")


async def test_a_removed_or_re_put_object_is_never_copied_from_the_index():
    clients = ("owner", dict(dram_bytes=1 << 20, **SHM)), ("reader", SHM), ("other", SHM)
    async with pool(*clients) as (_, (owner, reader, other)):
        a, a2 = os.urandom(32 * KiB), os.urandom(32 * KiB)
        assert await other.put("x/a", a)
        await held(owner, "x/a")
        assert await reader.get("x/a") == a
        assert await reader.get("x/a") == a  # from the index now
        assert await other.remove(["x/a"]) == 1  # answered once the owner took it out of its journal (and index)
        served = index_gets()
        assert await reader.get("x/a") is None
        assert await other.put("x/a", a2)
        await held(owner, "x/a")
        assert await reader.get("x/a") == a2  # the old checksum is not listed: the master names the new one
        assert index_gets() == served
        assert await reader.get("x/a") == a2 and index_gets() == served + 1


async def test_nothing_is_copied_from_the_index_once_the_owners_window_has_closed(monkeypatch):
    monkeypatch.setattr(service, "SERVE_WINDOW_S", 0.4)
    runner, addr = await start()
    made = []
    try:
        for name, kw in (("owner", dict(dram_bytes=1 << 20)), ("writer", {})):
            c = StoreClient(StoreClientConfig(master=addr, client_id=name, ping_interval_s=0.1, **SHM, **kw))
            await c.start()
            made.append(c)
        owner, writer = made
        a = os.urandom(16 * KiB)
        assert await writer.put("w/a", a)
        await held(owner, "w/a")
        await until(owner.owner_server.window.open, "the owner's window open")
        assert await writer.get("w/a") == a
        await runner.stop()  # no more Pings answered: the window runs out
        await until(lambda: not owner.owner_server.window.open(), "the window closed")
        served = index_gets()
        with pytest.raises(StoreUnavailable):  # not listed as servable; the master's path has no master
            await writer.get("w/a")
        assert index_gets() == served
    finally:
        for c in reversed(made):
            await c.close()
