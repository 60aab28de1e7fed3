"""A store master and clients in the test's own process, on real gRPC and sockets on loopback."""

from __future__ import annotations

from mooncaked.store import Policy, StoreClient, StoreClientConfig
from mooncaked.store.service import MasterRunner


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
