"""The rdma transport: one-sided reads and writes through Mooncake's Transfer Engine.

Backends "rdma" (a NIC) and "mooncake-tcp" (Mooncake's own TCP, where no NIC exists). Mooncake's
engine is made at start(), so a missing package or device is a clear error then and not a
fallback; regions registered before start are pinned then. Peers learn our session and region
addresses from the control query (the engine advertises addresses because `session` is set).
The adapter to Mooncake's API is rdma.py.
"""

from __future__ import annotations

import logging
from typing import Literal

from mooncaked.transfer.api import TransferError, TransferOp
from mooncaked.transfer.peers import PeerDirectory
from mooncaked.transfer.rdma import MooncakeTransport
from mooncaked.transfer.regions import Region, RegionTable
from mooncaked.transfer.transport import Outcome, Transport

logger = logging.getLogger(__name__)


class RdmaTransport(Transport):
    def __init__(self, label: str, protocol: Literal["rdma", "tcp"], host: str, regions: RegionTable,
                 peers: PeerDirectory) -> None:
        self.label = label
        self._protocol = protocol
        self._host = host
        self._regions = regions
        self._peers = peers
        self._te: MooncakeTransport | None = None

    async def start(self, regions: RegionTable) -> None:
        if self._te is None:
            self._te = MooncakeTransport(self._host, self._protocol)  # raises if unavailable
            for info in regions.infos():
                self._te.register(info.address, info.nbytes)

    def register(self, region: Region) -> None:
        if self._te is not None:
            self._te.register(region.info.address, region.info.nbytes)

    def unregister(self, region: Region) -> None:
        if self._te is not None:
            self._te.unregister(region.info.address)

    @property
    def session(self) -> str | None:
        return self._te.session if self._te is not None else None

    async def submit(self, peer: str, ops: list[TransferOp], timeout_s: float) -> list[Outcome]:
        """All or nothing: Mooncake reports a batch as one code (raised, so every op carries it)."""
        if self._te is None:
            raise TransferError(f"backend {self.label!r} is set up by start(); call it before submit()")
        # asked afresh per batch: raw addresses of a region the peer dropped must not be reused
        info = await self._peers.get(peer, timeout_s, refresh=True)
        await self._te.submit(peer, ops, info, self._regions, timeout_s, self.label)
        return [None] * len(ops)

    async def close(self) -> None:
        self._te = None  # Mooncake's engine stops its threads when dropped
