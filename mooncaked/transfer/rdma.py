"""One-sided RDMA through Mooncake's own Transfer Engine (optional extra).

We do not write verbs by hand: `mooncake-transfer-engine` brings a tested
RDMA stack (GPUDirect, multi-NIC striping). It is imported only when the
rdma backend is chosen, and a missing package or a host without an RDMA
device is a clear error at start, not a fallback (Mooncake itself would
quietly drop to TCP). Its TCP mode (backend "mooncake-tcp") exercises the
same adapter on a machine without a NIC. Peers learn each other's session
("host:rpc_port") and region base addresses through our tcp control
exchange (PeerInfo). Mooncake's calls block, so they run in a thread; a
deadline abandons the wait, not the call.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from mooncaked.transfer import metrics
from mooncaked.transfer.api import (
    BackendUnavailableError,
    PeerInfo,
    TransferError,
    TransferOp,
    TransferTimeoutError,
    UnknownRegionError,
    check_bounds,
)
from mooncaked.transfer.regions import RegionTable

logger = logging.getLogger(__name__)

NEEDS = "rdma backend needs mooncake-transfer-engine and an RDMA device"
SYSFS_RDMA = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    """Verbs devices the kernel knows (mlx5_0, ...); empty without a NIC."""
    try:
        return sorted(os.listdir(SYSFS_RDMA))
    except OSError:
        return []


def unavailable_reason() -> str | None:
    """Why the rdma backend cannot run here, or None, without importing Mooncake (a start-up check)."""
    try:
        found = importlib.util.find_spec("mooncake.engine") is not None
    except ImportError:  # no `mooncake` package at all
        found = False
    if not found:
        return f"{NEEDS}: mooncake-transfer-engine is not installed"
    if not rdma_devices():
        return f"{NEEDS}: no RDMA device under {SYSFS_RDMA} on this host"
    return None


def load_mooncake() -> Any:
    """mooncake.engine.TransferEngine, or BackendUnavailableError saying why not."""
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found]
    except ImportError as e:
        raise BackendUnavailableError(
            f"{NEEDS}: cannot import mooncake.engine ({e}); "
            "`pip install mooncake-transfer-engine` on a host with an RDMA NIC, "
            "or start the engine with backend='tcp' (or 'auto')"
        ) from e
    return TransferEngine


@dataclass(frozen=True, slots=True)
class RdmaOp:
    """One range in raw addresses, as Mooncake's engine wants it."""

    local_address: int
    remote_address: int
    length: int


class MooncakeTransport:
    """A Mooncake TransferEngine in P2P-handshake mode (no metadata server)."""

    def __init__(
        self,
        hostname: str,
        protocol: Literal["rdma", "tcp"] = "rdma",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
    ) -> None:
        engine_cls = load_mooncake()
        if protocol == "rdma" and not rdma_devices():
            # Mooncake would quietly fall back to its TCP transport; say so instead.
            raise BackendUnavailableError(
                f"{NEEDS}: no RDMA device under {SYSFS_RDMA} on this host; "
                "use backend='tcp' (or 'auto'), or 'mooncake-tcp' to run Mooncake without a NIC"
            )
        self._te = engine_cls()
        ret = self._te.initialize(hostname, metadata_server, protocol, device_name)
        if ret != 0:
            raise BackendUnavailableError(
                f"{NEEDS}: mooncake TransferEngine.initialize({hostname!r}, {protocol!r}) "
                f"returned {ret}; check `ibv_devices` and the device name"
            )
        self.session = f"{hostname}:{self._te.get_rpc_port()}"
        logger.info("mooncake transfer engine (%s) up as %s", protocol, self.session)

    def register(self, address: int, nbytes: int) -> None:
        ret = self._te.register_memory(address, nbytes)
        if ret != 0:
            raise TransferError(f"mooncake register_memory({nbytes} bytes) returned {ret}")

    def unregister(self, address: int) -> None:
        ret = self._te.unregister_memory(address)
        if ret != 0:
            logger.warning("mooncake unregister_memory returned %d", ret)

    async def submit(
        self, peer: str, ops: list[TransferOp], info: PeerInfo, regions: RegionTable, timeout_s: float, label: str
    ) -> None:
        """Move TransferOps to a peer whose info names its session and region
        addresses; all or nothing (Mooncake reports a batch as one code)."""
        if info.rdma_session is None:
            raise TransferError(f"peer {peer} serves no Mooncake endpoint; start it with backend {label!r}")
        by_kind: dict[Literal["write", "read"], list[RdmaOp]] = {"write": [], "read": []}
        for op in ops:
            remote = info.regions.get(op.remote_region)
            if remote is None:
                raise UnknownRegionError(f"peer {peer}: remote region {op.remote_region!r} is not registered")
            check_bounds("remote", f"{peer}/{op.remote_region}", remote.nbytes, op.remote_offset, op.length)
            local = regions.lookup(op.local_region, op.local_offset, op.length)
            by_kind[op.op].append(
                RdmaOp(local.info.address + op.local_offset, remote.address + op.remote_offset, op.length)
            )
        for kind, kind_ops in by_kind.items():
            await self.run(info.rdma_session, kind, kind_ops, timeout_s)
        metrics.count_batch(
            label,
            "initiator",
            Counter((op.op, True) for op in ops),
            sent=sum(o.length for o in by_kind["write"]),
            received=sum(o.length for o in by_kind["read"]),
        )

    async def run(self, session: str, kind: Literal["write", "read"], ops: list[RdmaOp], timeout_s: float) -> None:
        """Move the ranges; Mooncake's calls block, so they run in a thread."""
        if not ops:
            return
        try:
            async with asyncio.timeout(timeout_s):
                ret = await asyncio.to_thread(self._run_sync, session, kind, ops)
        except TimeoutError as e:
            raise TransferTimeoutError(f"rdma {kind} to {session} exceeded {timeout_s}s") from e
        if ret != 0:
            raise TransferError(f"rdma {kind} to {session} failed with code {ret}; see mooncake's log")

    def _run_sync(self, session: str, kind: str, ops: list[RdmaOp]) -> int:
        batch = getattr(self._te, f"batch_transfer_sync_{kind}", None)
        if batch is not None:
            return int(
                batch(
                    session,
                    [o.local_address for o in ops],
                    [o.remote_address for o in ops],
                    [o.length for o in ops],
                )
            )
        single = getattr(self._te, f"transfer_sync_{kind}")
        for o in ops:
            ret = int(single(session, o.local_address, o.remote_address, o.length))
            if ret != 0:
                return ret
        return 0
