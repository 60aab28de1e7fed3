"""The shared-memory transport: peers on this host, a transfer is one memcpy into their segment.

Strict (backend "shm") refuses a peer or region it cannot reach; lenient (backend "auto")
answers LEFT for those ops so the next transport (tcp) carries them. The copying is shm_path.py,
the segments shm.py; this module reads peers' regions from the engine's PeerDirectory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mooncaked.transfer import metrics
from mooncaked.transfer.api import TransferError, TransferOp
from mooncaked.transfer.peers import PeerDirectory
from mooncaked.transfer.regions import RegionTable
from mooncaked.transfer.shm_path import ShmPath
from mooncaked.transfer.transport import LEFT, Left, Outcome, Transport

logger = logging.getLogger(__name__)


class ShmTransport(Transport):
    label = "shm"
    shared_memory = True

    def __init__(self, regions: RegionTable, peers: PeerDirectory, strict: bool, copy_threads: int) -> None:
        self._peers = peers
        self._strict = strict
        self._path = ShmPath(regions, strict, copy_threads)

    async def submit(self, peer: str, ops: list[TransferOp], timeout_s: float) -> list[Outcome]:
        info = await self._peers.get(peer, timeout_s)
        outcomes, left = await self._path.run(peer, ops, info, self._peers.refresher(peer, timeout_s))
        results: list[Outcome] = list(outcomes)
        for j in left:
            results[j] = LEFT
        return results

    async def write_from(self, src: memoryview, peer: str, region: str, offset: int, timeout_s: float,
                         meanwhile: Callable[[], object] | None = None) -> bool | Left:
        target = await self._peer_bytes("write", peer, region, offset, src.nbytes, timeout_s)
        if target is None:
            return False if self._strict else LEFT  # auto: tcp sends it from the caller's buffer
        target[:] = src
        metrics.count_op(self.label, "write", "initiator", True, sent=src.nbytes)
        if meanwhile is not None:
            meanwhile()
        return True

    async def send_from(self, src: memoryview, peer: str, region: str, offset: int,
                        timeout_s: float) -> Awaitable[object] | None | Left:
        """One memcpy now; the answer is a future already done."""
        done = await self.write_from(src, peer, region, offset, timeout_s)
        if done is not True:
            return None if done is False else LEFT
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def read_bytes(self, peer: str, region: str, offset: int, length: int, timeout_s: float) -> bytes | None:
        source = await self._peer_bytes("read", peer, region, offset, length, timeout_s)
        if source is None:
            return None
        out = bytes(source)
        metrics.count_op(self.label, "read", "initiator", True, received=length)
        return out

    async def _peer_bytes(self, kind: str, peer: str, region: str, offset: int, length: int,
                          timeout_s: float) -> memoryview | None:
        if offset < 0 or length <= 0:
            raise TransferError(f"{kind} of {length} bytes at {offset}: need a positive length and offset >= 0")
        info = await self._peers.get(peer, timeout_s)
        return await self._path.peer_bytes(peer, region, offset, length, info, self._peers.refresher(peer, timeout_s))

    async def close(self) -> None:
        self._path.close()
