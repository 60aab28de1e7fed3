"""Single puts whose commit overlaps the next put's transfer (store/commits_behind.py), against a real
master and real clients on loopback: the writer's own calls see its puts at once, flush() makes
them everyone's, and a commit the master refuses after put() returned is reported, never stored."""

from __future__ import annotations

import os

import pytest
from store_helpers import metric, pool

from mooncaked.store.dram_segment import DRAM_REGION
from mooncaked.store.records import RESERVED_PREFIX

KiB = 1024
pytestmark = pytest.mark.timeout(60)


async def test_puts_with_commits_behind_are_seen_by_the_writer_at_once_and_by_everyone_after_flush():
    clients = ("owner", dict(dram_bytes=4 << 20)), ("writer", dict(commit_behind=True)), ("reader", {})
    async with pool(*clients) as (_, (owner, writer, reader)):
        data = {f"c/{i}": os.urandom(64 * KiB) for i in range(24)}
        for k, d in data.items():
            assert await writer.put(k, d)
            assert await writer.exist(k)  # behind its commit on the same connection
        assert await writer.get("c/3") == data["c/3"]
        assert await writer.flush() == []
        assert await reader.batch_get(list(data)) == list(data.values())


async def test_a_commit_refused_after_put_returned_is_reported_by_flush_and_the_object_is_not_there():
    clients = ("owner", dict(dram_bytes=4 << 20)), ("writer", dict(commit_behind=True))
    async with pool(*clients) as (runner, (owner, writer)):
        assert await writer.put("l/warm", os.urandom(32 * KiB))  # places of this size are now reserved ahead
        assert await writer.flush() == []
        master = runner.master
        for key in [k for k in master.objects if k.startswith(RESERVED_PREFIX)]:  # they lapse, as after a restart
            master.revoke_reserved(int(key[len(RESERVED_PREFIX):]))
        lost = metric("mooncaked_store_client_ops_total", op="put", result="lost")
        assert await writer.put("l/a", os.urandom(32 * KiB))  # its bytes landed; the commit is refused
        assert await writer.flush() == ["l/a"]
        assert not await writer.exist("l/a")
        assert metric("mooncaked_store_client_ops_total", op="put", result="lost") == lost + 1
        assert await writer.put("l/a", b"again" * 1000)  # the next put finds a fresh place
        assert await writer.flush() == [] and await writer.exist("l/a")


async def test_puts_back_to_back_are_seen_by_the_writers_next_calls_and_a_mutable_buffer_is_never_sent_late():
    """A put of bytes returns once they are handed to the data plane (its acknowledgement and commit follow
    behind): the writer's next calls, of any kind, still see every put that returned. A bytearray the
    caller changes right after put() returns is stored as it was (such a put waits for its bytes)."""
    # room to spare: under pressure the master gives up places reserved ahead (then a commit is refused)
    clients = ("owner", dict(dram_bytes=32 << 20)), ("writer", dict(commit_behind=True)), ("reader", {})
    async with pool(*clients) as (_, (owner, writer, reader)):
        data = {f"b/{i}": os.urandom(128 * KiB) for i in range(32)}
        for k, d in data.items():
            assert await writer.put(k, d)
        assert await writer.batch_exist(list(data)) == [True] * len(data)
        assert await writer.longest_prefix(list(data)) == len(data)
        assert await writer.get("b/31") == data["b/31"]
        for k, d in data.items():
            assert await writer.put(k + "/again", d)
            assert await writer.get(k + "/again") == d
        buf = bytearray(os.urandom(128 * KiB))
        kept = bytes(buf)
        assert await writer.put("b/mutable", buf)
        buf[:] = bytes(len(buf))
        assert await writer.flush() == []
        assert await reader.get("b/mutable") == kept
        assert await reader.batch_get(list(data)) == list(data.values())


async def test_a_write_failing_after_put_returned_is_reported_by_flush_and_the_object_is_not_there():
    clients = ("owner", dict(dram_bytes=4 << 20)), ("writer", dict(commit_behind=True))
    async with pool(*clients) as (_, (owner, writer)):
        assert await writer.put("w/warm", os.urandom(32 * KiB))
        assert await writer.flush() == []
        owner.transfer.unregister(DRAM_REGION)  # the owner now refuses writes into its DRAM: the ack is an error
        failed = metric("mooncaked_store_client_ops_total", op="put", result="failed")
        assert await writer.put("w/a", os.urandom(32 * KiB))  # returned before the owner answered
        assert await writer.flush() == ["w/a"]
        assert metric("mooncaked_store_client_ops_total", op="put", result="failed") == failed + 1
        assert not await writer.exist("w/a")
        assert await writer.put("w/b", os.urandom(32 * KiB))  # one failure fails only itself
        assert await writer.flush() == ["w/b"]


async def test_puts_behind_with_two_copies_land_in_both_owners():
    """Each copy's acknowledgement is awaited before the commit: with two replicas, both owners hold
    every object once flush() returned."""
    clients = (("a", dict(dram_bytes=8 << 20)), ("b", dict(dram_bytes=8 << 20)),
               ("writer", dict(commit_behind=True, replicas=2)), ("reader", {}))
    async with pool(*clients) as (runner, (a, b, writer, reader)):
        data = {f"r/{i}": os.urandom(96 * KiB) for i in range(16)}
        for k, d in data.items():
            assert await writer.put(k, d)
        assert await writer.flush() == []
        for k in data:
            assert len(runner.master.objects[k].replicas) == 2, k
        assert await reader.batch_get(list(data)) == list(data.values())
