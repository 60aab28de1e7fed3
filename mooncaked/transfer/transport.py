"""The one seam of the data plane: a `Transport` moves a peer's share of a batch.

As in Mooncake's Transfer Engine (one `Transport` class, one folder per transport), every data
path — tcp, shared memory, Mooncake's rdma — is one module implementing this interface, and
`TransferEngine` only validates ops, groups them by peer and hands each peer's share down a
chain of transports (backends.py says which chain a backend name means). A transport that
cannot carry an op (auto: a peer on another host, a region not in shared memory) answers LEFT
for it and the next transport in the chain takes it, so a new data path is one new file and one
line in the chain table.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

from mooncaked.transfer.api import TransferOp

if TYPE_CHECKING:
    from mooncaked.transfer.regions import Region, RegionTable

logger = logging.getLogger(__name__)


class Left:
    """The answer for an op a transport does not carry: the next transport in the chain takes it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LEFT"


LEFT: Final = Left()
Outcome = BaseException | None | Left
"""Per op: None (done), the op's error, or LEFT (not this transport's to carry)."""


class Transport(ABC):
    """One data path of one engine. Never raises for a single op's failure: outcomes carry it; a
    TransferError raised by `submit` fails the whole share (e.g. the backend is not set up)."""

    label: str = "?"
    """The backend label of its metrics and logs."""
    shared_memory: bool = False
    """Whether it wants the engine's regions allocated in /dev/shm (alloc_region)."""
    private_memory: bool = False
    """Whether it wants them, where none wants /dev/shm, in memory a process of ours maps by descriptor
    (private_memory.py: the transfer I/O process)."""

    async def start(self, regions: RegionTable) -> None:
        """Set up what needs the engine started (e.g. Mooncake's engine); may raise
        BackendUnavailableError, before the engine listens."""

    def register(self, region: Region) -> None:
        """A region joined the engine's table (e.g. pin it for rdma)."""

    def unregister(self, region: Region) -> None:
        """A region left the engine's table (it is already out of the table)."""

    @property
    def session(self) -> str | None:
        """Set when peers must learn raw region addresses (one-sided rdma): the session they reach."""
        return None

    @abstractmethod
    async def submit(self, peer: str, ops: list[TransferOp], timeout_s: float) -> list[Outcome]:
        """Move a peer's share of a batch; one outcome per op."""

    async def submit_one(self, op: TransferOp, timeout_s: float) -> Outcome:
        """One op (a single put/get); a transport with a cheaper single-op path overrides it."""
        return (await self.submit(op.peer, [op], timeout_s))[0]

    async def write_from(self, src: memoryview, peer: str, region: str, offset: int, timeout_s: float,
                         meanwhile: Callable[[], object] | None = None) -> bool | Left:
        """Move a caller's bytes (in no registered region) straight into a peer's region: True when
        done, and then `meanwhile` was called once, while they travelled or after; False (nothing
        moved) where this transport carries the op but not from a caller's buffer (stage it and
        submit); LEFT where the op is not this transport's to carry (the next one is asked)."""
        return False

    async def send_from(self, src: memoryview, peer: str, region: str, offset: int,
                        timeout_s: float) -> Awaitable[object] | None | Left:
        """Hand an immutable caller's bytes (a `bytes` object's view) over to move into a peer's region,
        without waiting for the peer: the awaitable of its acknowledgement (it raises the write's
        TransferError). None (nothing moved) where this transport carries the op but not from a caller's
        buffer; LEFT where the op is not this transport's (the next one is asked)."""
        return None

    async def read_bytes(self, peer: str, region: str, offset: int, length: int, timeout_s: float) -> bytes | None:
        """A peer's bytes as a new bytes object, copied once; None where this transport cannot."""
        return None

    @property
    def pid(self) -> int | None:
        """The process doing this transport's I/O, when it is not the engine's own."""
        return None

    def outgoing_connections(self) -> dict[str, int]:
        """Open connections per peer, for EngineStats."""
        return {}

    async def close(self) -> None:
        """Drop connections, mappings and threads; the engine closes transports after its regions."""
