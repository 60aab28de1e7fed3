"""Which transports a backend name means, in the order they are tried for each op.

The one place that reads the backend's name: TransferEngine builds its chain here once and never
branches on the name again. A new data path is a Transport module plus a line in CHAINS.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncaked.transfer.io_transport import IoProcessTransport
from mooncaked.transfer.peers import PeerDirectory
from mooncaked.transfer.rdma_transport import RdmaTransport
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.shm_transport import ShmTransport
from mooncaked.transfer.tcp_transport import TcpTransport
from mooncaked.transfer.transport import Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Wiring:
    """What an engine hands its transports: its regions, its peers' directory, its tcp transport
    (always there: it carries the control query), the host it serves on, and, when its tcp ops go
    through an I/O process, that process's settings."""

    regions: RegionTable
    peers: PeerDirectory
    tcp: TcpTransport
    host: str
    io_config: dict[str, Any] | None = None

    def tcp_chain(self) -> list[Transport]:
        """tcp ops: through the I/O process where there is one (regions in shm), else in-process."""
        if self.io_config is None:
            return [self.tcp]
        return [IoProcessTransport(self.regions, self.io_config), self.tcp]


def _copy_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


CHAINS: dict[str, Callable[[Wiring], list[Transport]]] = {
    "tcp": lambda w: w.tcp_chain(),
    "shm": lambda w: [ShmTransport(w.regions, w.peers, True, _copy_threads())],
    "auto": lambda w: [ShmTransport(w.regions, w.peers, False, _copy_threads()), *w.tcp_chain()],
    "rdma": lambda w: [RdmaTransport("rdma", "rdma", w.host, w.regions, w.peers)],
    "mooncake-tcp": lambda w: [RdmaTransport("mooncake-tcp", "tcp", w.host, w.regions, w.peers)],
}
"""Each chain's last transport carries every op it is given (it never answers LEFT)."""


def chain(backend: str, wiring: Wiring) -> list[Transport]:
    return CHAINS[backend](wiring)
