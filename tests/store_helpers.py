"""A store master and clients in the test's own process, on real gRPC and sockets on loopback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import REGISTRY

from mooncaked.store import Policy, StoreClient, StoreClientConfig
from mooncaked.store.master_runner import MasterRunner


async def start(port: int = 0, **policy) -> tuple[MasterRunner, str]:
    """A master on 127.0.0.1:`port` (0: any) with a fast housekeeping tick; (runner, "host:port")."""
    runner = MasterRunner(Policy(**policy), f"127.0.0.1:{port}", tick_s=0.05)
    port = await runner.start()
    return runner, f"127.0.0.1:{port}"


async def client(master: str, name: str, **kw) -> StoreClient:
    """A started client that pings often (a restarted master is noticed within a fraction of a second)."""
    c = StoreClient(StoreClientConfig(master=master, client_id=name, ping_interval_s=0.2, **kw))
    await c.start()
    return c


@asynccontextmanager
async def pool(*clients: tuple[str, dict], **policy) -> AsyncIterator[tuple[MasterRunner, list[StoreClient]]]:
    """A master (`policy`) and started clients, one per (name, config overrides); all closed after."""
    runner, addr = await start(**policy)
    started: list[StoreClient] = []
    try:
        for name, kw in clients:
            started.append(await client(addr, name, **kw))
        yield runner, started
    finally:
        for c in reversed(started):
            await c.close()
        await runner.stop()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Wait until `cond()` holds (`what` it is waiting for shows in the timeout's traceback)."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def held(owner: StoreClient, key: str) -> None:
    """The owner's journal has the key (the master's batch came): it serves it by key from now on."""
    await until(lambda: owner.journal.find(key) is not None, f"{key} in the owner's journal")


_OWNER = """
import asyncio, sys
from mooncaked.store import StoreClient, StoreClientConfig
async def main():
    c = StoreClient(StoreClientConfig(master=sys.argv[1], client_id=sys.argv[2], dram_bytes=int(sys.argv[3]),
                                      ping_interval_s=0.1))
    await c.start()
    print("ready", flush=True)
    while True:
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        print("held" if c.journal.find(line.strip()) is not None else "not held", flush=True)
asyncio.run(main())
"""


def owner_process(addr: str, name: str, dram_bytes: int = 1 << 20) -> subprocess.Popen:
    """A store client lending `dram_bytes` of DRAM in a process of its own: it prints "ready" once mounted, then
    for each key written to its stdin whether its DRAM journal holds it ("held" / "not held")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-c", _OWNER, addr, name, str(dram_bytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


async def ask(proc: subprocess.Popen, key: str) -> str:
    """An owner_process's answer for `key`: "held" or "not held"."""
    proc.stdin.write(key + "\n")
    proc.stdin.flush()
    return (await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)).strip()
