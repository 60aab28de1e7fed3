"""A client's registered memory: the DRAM segment it lends to the pool, and its staging area.

Both are regions of the process's TransferEngine, so peers write and read them through
`transfer/` (the only way bytes cross processes). The staging area is where a put's bytes
are gathered (from bytes or any tensor, contiguous or not) and where a get's bytes land
before their checksum is checked and they are handed over; concurrent calls share it
through an extent allocator and wait for room instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import torch

from mooncaked.store.allocator import ExtentAllocator, align_up
from mooncaked.store.errors import InvalidArgument
from mooncaked.transfer import TransferEngine

logger = logging.getLogger(__name__)

DRAM_REGION = "store-dram"
STAGING_REGION = "store-staging"
ALIGN = 64


class Region:
    """A registered uint8 region seen as a tensor and as a memoryview (same memory)."""

    def __init__(self, transfer: TransferEngine, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes
        self.tensor = transfer.alloc_region(name, nbytes)
        self.view = memoryview(self.tensor.numpy())

    def slice(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]


class DramSegment(Region):
    """The DRAM this process lends to the pool; the master allocates inside it."""


class Staging(Region):
    """Scratch space for puts and gets, shared by concurrent calls."""

    def __init__(self, transfer: TransferEngine, name: str, nbytes: int) -> None:
        super().__init__(transfer, name, nbytes)
        self._alloc = ExtentAllocator(nbytes, ALIGN)
        self._room = asyncio.Condition()

    def fits(self, sizes: Sequence[int]) -> bool:
        return sum(align_up(s, ALIGN) for s in sizes) <= self.nbytes

    @asynccontextmanager
    async def lease(self, sizes: Sequence[int]) -> AsyncIterator[list[int]]:
        """Offsets for all `sizes` at once (waits while other calls hold the room)."""
        if not self.fits(sizes):
            raise InvalidArgument(f"{sum(sizes)} bytes do not fit the {self.nbytes}-byte staging area; "
                                  "raise staging_bytes or split the batch")
        async with self._room:
            offsets = self._take(sizes)
            while offsets is None:
                await self._room.wait()
                offsets = self._take(sizes)
        try:
            yield offsets
        finally:
            async with self._room:
                for off in offsets:
                    self._alloc.free(off)
                self._room.notify_all()

    def _take(self, sizes: Sequence[int]) -> list[int] | None:
        got: list[int] = []
        for size in sizes:
            off = self._alloc.alloc(max(size, 1))
            if off is None:
                for o in got:
                    self._alloc.free(o)
                return None
            got.append(off)
        return got

    def stage(self, offset: int, data: bytes | bytearray | memoryview | torch.Tensor) -> int:
        """Copy one object's bytes in; returns its size."""
        if isinstance(data, torch.Tensor):
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            n = t.numel() * t.element_size()
            self.tensor[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
            return n
        mv = memoryview(data).cast("B")
        self.view[offset : offset + len(mv)] = mv
        return len(mv)

    def unstage(self, offset: int, out: torch.Tensor) -> None:
        """Copy staged bytes into a tensor of any layout and dtype (sizes already checked)."""
        n = out.numel() * out.element_size()
        out.copy_(self.tensor[offset : offset + n].view(out.dtype).view(out.shape))


def nbytes_of(data: bytes | bytearray | memoryview | torch.Tensor) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes
