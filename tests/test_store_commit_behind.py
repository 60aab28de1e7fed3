"""Single puts whose commit overlaps the next put's transfer (store/commits_behind.py), against a real
master and real clients on loopback: the writer's own calls see its puts at once, flush() makes
them everyone's, and a commit the master refuses after put() returned is reported, never stored."""

from __future__ import annotations

import os

import pytest
from store_helpers import metric, pool

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
