"""The conductor's startup window (conductor/readiness.py) against a real Registry, without processes:
requests wait while the cluster starts, are refused at once after the window or once a cluster that
was ready loses its instances, and are woken (not polled) when a prefill and a decode serve."""

from __future__ import annotations

import asyncio

from mooncaked.conductor.readiness import ReadyGate
from mooncaked.conductor.registry import DEAD, Instance, Registry
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.proto.mooncake.v1 import common_pb2

LAYOUT = KVLayout(2, 64, 4, 2, 8, "float32", 4)


class Clock:
    """Monotonic time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _join(registry: Registry, name: str, role: str) -> Instance:
    inst = Instance(name, role, f"127.0.0.1:{len(registry.instances) + 1}", "m", LAYOUT,
                    common_pb2.TransferEndpoint())
    registry.register(inst)
    return inst


async def _close(registry: Registry) -> None:
    await registry.close()


async def test_a_waiting_request_is_woken_when_a_prefill_and_a_decode_serve():
    registry, clock = Registry(5.0), Clock()
    gate = ReadyGate(30.0, clock)
    assert gate.starting() and gate.state(registry) == "starting"
    waiter = asyncio.ensure_future(gate.wait())
    _join(registry, "p", "prefill")
    gate.note(registry)
    await asyncio.sleep(0)
    assert not waiter.done()  # a prefill alone serves nothing
    _join(registry, "d", "decode")
    gate.note(registry)
    assert await asyncio.wait_for(waiter, 5) is True
    assert gate.state(registry) == "ready" and not gate.starting()
    await _close(registry)


async def test_after_the_window_requests_are_refused_at_once():
    registry, clock = Registry(5.0), Clock()
    gate = ReadyGate(30.0, clock)
    clock.now += 30.0
    assert not gate.starting() and gate.state(registry) == "unavailable"
    assert await gate.wait() is False  # returns without waiting: nothing else can end it here


async def test_a_request_waits_no_longer_than_its_own_deadline():
    gate = ReadyGate(600.0, Clock())
    assert await gate.wait(limit_s=0.01) is False
    assert gate.starting()


async def test_a_cluster_that_was_ready_does_not_wait_again():
    registry, clock = Registry(5.0), Clock()
    gate = ReadyGate(30.0, clock)
    _join(registry, "p", "prefill")
    d = _join(registry, "d", "decode")
    gate.note(registry)
    registry.mark_dead(d.name, "test")
    assert d.state == DEAD
    assert gate.state(registry) == "unavailable" and not gate.starting()  # still inside the window
    await _close(registry)
