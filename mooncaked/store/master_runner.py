"""What the store role and the tests start: a `StoreService` on a gRPC server, its fast path, its housekeeping.

One runner owns the master's servers and stops them in one place (the housekeeping first, then the
streams, the fast path and the gRPC server).
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked.proto.mooncake.v1 import store_pb2_grpc
from mooncaked.rpc import RoleServer
from mooncaked.security import Security
from mooncaked.store import metrics
from mooncaked.store.fast_path import FastPathServer
from mooncaked.store.master import StoreMaster
from mooncaked.store.records import Policy
from mooncaked.store.service import SERVICE_NAME, TICK_S, StoreService
from mooncaked.tasks import spawn

logger = logging.getLogger(__name__)


class MasterRunner:
    """A StoreService on a RoleServer plus its housekeeping; what the store role and tests start.

    `fast_path_port`: where the fast path (fast_path.py) listens, on the gRPC listen host;
    0 picks a free port, None turns it off (clients then use gRPC for everything).
    `fast_path_unix`: whether clients on this host also get it on a Unix socket.
    """

    def __init__(self, policy: Policy, listen: str = "127.0.0.1:0", tick_s: float = TICK_S,
                 fast_path_port: int | None = 0, fast_path_unix: bool = True,
                 security: Security | None = None) -> None:
        self.service = StoreService(policy)
        self.security = security or Security()  # mutual TLS and the cluster token on gRPC
        self.server = RoleServer(listen, [SERVICE_NAME], security=self.security)
        store_pb2_grpc.add_StoreMasterServicer_to_server(self.service, self.server.server)
        self._listen_host = listen.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
        self._fast_port = fast_path_port
        self._fast_unix = fast_path_unix
        self.fast_path: FastPathServer | None = None
        self._tick_s = tick_s
        self._housekeeping: asyncio.Task | None = None

    @property
    def master(self) -> StoreMaster:
        return self.service.master

    async def start(self) -> int:
        port = await self.server.start()
        if self._fast_port is not None:
            self.fast_path = FastPathServer(self.service, token=self.security.token)
            self.service.fast_path_port = await self.fast_path.start(self._listen_host, self._fast_port,
                                                                     unix=self._fast_unix)
            self.service.fast_path_unix = self.fast_path.unix_name
        self._housekeeping = spawn(self.service.housekeeping(self._tick_s), "store-housekeeping")
        metrics.MASTERS.watch(self.master)  # its gauges are read at scrape time
        logger.info("store master (epoch %d) serving on port %d (fast path: %s)", self.master.epoch, port,
                    self.service.fast_path_port or "off")
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        metrics.MASTERS.unwatch(self.master)
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        self.service.close_streams()
        if self.fast_path is not None:
            await self.fast_path.close()
        await self.server.stop(grace_s)
