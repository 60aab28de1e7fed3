"""A stalled engine lending pool DRAM costs the others' prefix reads a miss, not a stall (real processes).

p2 prefills a prompt, so its blocks sit in p2's DRAM; p2 is then paused (SIGSTOP: a GC pause, swap,
a hung host). A prefill of the same prefix on p1 reads them from p2: the read is given up after
transfer/deadlines.py's STALL_GRACE_S (plus the bytes at the floor rate), p1 computes the prompt, and the request
completes while p2 is still stopped; before, it waited out the whole transfer timeout (10 s). An
operator's `mooncakectl drain p2` meanwhile is answered (before, the conductor waited 10 s on p2,
as long as mooncakectl's own deadline)."""

from __future__ import annotations

import re
import signal

import grpc
import pytest

from cluster import Cluster
from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc
from mooncaked.transfer.deadlines import STALL_GRACE_S
from test_ctl import _ctl
from test_store_tiers import _objects, _request
from tiny_models import random_prompts

pytestmark = pytest.mark.timeout(300)

PREFIX = 200  # 50 blocks of 4 tokens


async def test_a_paused_owner_costs_a_prefix_read_a_miss_not_the_transfer_timeout(tiny_model_factory, tmp_path):
    _, folder = tiny_model_factory("llama")
    c = Cluster(folder, tmp_path, extra_env={"MOONCAKED_STORE_DRAM_BYTES": "4MiB"})
    stopped = False
    try:
        c.start("conductor", "conductor", "--policy", "cache_aware_local")  # plans no peer pull: p1 reads the pool
        store = f"127.0.0.1:{c.start('store', 'store')}"
        c.extra_env["MOONCAKED_STORE"] = store
        for name, role in {"p1": "prefill", "p2": "prefill", "d1": "decode"}.items():
            c.start(name, role)
        c.wait_serving(["p1", "p2", "d1"])
        base = random_prompts([PREFIX], seed=90)[0]
        async with grpc.aio.insecure_channel(c.conductor) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)

            async def generate(ids: list[int], only: str) -> list:
                for name in ("p1", "p2"):
                    await stub.SetDrain(conductor_pb2.SetDrainRequest(name=name, drain=name != only), timeout=15)
                return [x async for x in stub.Generate(_request(ids), timeout=60)]

            first = await generate(base + [5, 6], "p2")
            assert first[0].prefill_instance == "p2"
            blocks = (PREFIX + 2) // 4
            assert await _objects(store, blocks) == blocks  # in the pool: p2's DRAM (puts are placed locally)
            for name in ("p1", "p2"):
                await stub.SetDrain(conductor_pb2.SetDrainRequest(name=name, drain=name != "p1"), timeout=15)
            c.kill("p2", signal.SIGSTOP)
            stopped = True
            second = [x async for x in stub.Generate(_request(base + [7, 8]), timeout=60)]
            # an operator drains the stuck instance: answered (the conductor does not wait on it for long)
            drain = _ctl("drain", "p2", conductor=c.conductor)
            assert (drain.returncode, drain.stdout) == (0, "p2: draining\n"), drain.stderr
            assert c.procs["p2"].poll() is None  # still stopped: completed without it
            c.kill("p2", signal.SIGCONT)
            stopped = False
        assert second[0].prefill_instance == "p1"
        assert len([t for x in second for t in x.token_ids]) == 6
        # the read of p2's copies was given up at the stall deadline, not the transfer timeout
        deadlines = {float(s) for s in re.findall(r"within the ([0-9.]+)s deadline", c.log("p1"))}
        assert deadlines and max(deadlines) < STALL_GRACE_S + 1, deadlines
        assert "timed out; reading other copies (or computing)" in c.log("p1")
        assert await _objects(store, blocks) == blocks  # nothing was lost with the pause
    finally:
        if stopped:
            c.kill("p2", signal.SIGCONT)
        c.stop()
