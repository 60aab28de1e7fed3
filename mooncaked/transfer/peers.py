"""What each peer serves (its PeerInfo), asked once over the control query and cached.

Transports that address a peer's memory themselves (shm maps its segments, rdma names its
addresses) need the peer's region table; the tcp control connection answers it (INFO). One
directory per engine, so a peer is asked once whichever transport needs it first.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from mooncaked.transfer.api import PeerInfo

logger = logging.getLogger(__name__)


class PeerDirectory:
    """peer address -> PeerInfo, fetched through `fetch` (the tcp control query)."""

    def __init__(self, fetch: Callable[[str, float], Awaitable[PeerInfo]]) -> None:
        self._fetch = fetch
        self._infos: dict[str, PeerInfo] = {}

    async def get(self, peer: str, timeout_s: float, refresh: bool = False) -> PeerInfo:
        """The peer's host and regions; asked afresh when `refresh` (a region looked stale)."""
        info = self._infos.get(peer)
        if info is None or refresh:
            info = self._infos[peer] = await self._fetch(peer, timeout_s)
        return info

    def refresher(self, peer: str, timeout_s: float) -> Callable[[], Awaitable[PeerInfo]]:
        """A callable that asks the peer again (handed to paths that notice a stale region)."""
        return lambda: self.get(peer, timeout_s, refresh=True)
