"""The table of registered memory regions: name -> bytes the data plane may touch.

A region is a contiguous CPU tensor seen as flat bytes, once as a uint8
tensor (for memcpy-style copies) and once as a memoryview (for socket
send/recv_into), both sharing the tensor's memory so no byte is copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mooncaked.transfer.api import (
    MAX_REGION_NAME_BYTES,
    RegionInfo,
    TransferError,
    UnknownRegionError,
    check_bounds,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Region:
    """A registered region: its public info and two byte views of one memory."""

    info: RegionInfo
    tensor: torch.Tensor  # the caller's tensor, kept alive while registered
    flat: torch.Tensor  # uint8, 1-D, same memory
    view: memoryview  # writable, format 'B', same memory
    on_release: Callable[[], None] | None = None  # e.g. unlink the shm segment
    fd: int | None = None  # private memory's descriptor (private_memory.py), for our I/O process only

    def slice_view(self, offset: int, length: int) -> memoryview:
        return self.view[offset : offset + length]


def byte_views(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """Flat uint8 tensor and memoryview over a contiguous CPU tensor's bytes."""
    if tensor.device.type != "cpu":
        raise TransferError(
            f"cannot register a {tensor.device.type} tensor: the tcp/shm data plane "
            "moves host memory; stage it in a CPU tensor first"
        )
    if not tensor.is_contiguous():
        raise TransferError("cannot register a non-contiguous tensor: call .contiguous() first")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return flat, flat.numpy().data


class RegionTable:
    """Owns the name -> Region map; checks names and ranges in one place."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        shm_name: str | None = None,
        on_release: Callable[[], None] | None = None,
        fd: int | None = None,
    ) -> Region:
        encoded = name.encode("utf-8")
        if not encoded or len(encoded) > MAX_REGION_NAME_BYTES:
            raise TransferError(f"region name must be 1..{MAX_REGION_NAME_BYTES} UTF-8 bytes, got {name!r}")
        if name in self._regions:
            raise TransferError(f"region {name!r} is already registered; unregister it first")
        flat, view = byte_views(tensor)
        info = RegionInfo(name, flat.numel(), shm_name, flat.data_ptr())  # == tensor.data_ptr()
        region = Region(info, tensor, flat, view, on_release, fd)
        self._regions[name] = region
        logger.debug("registered region %r (%d bytes, shm=%s)", name, info.nbytes, shm_name)
        return region

    def remove(self, name: str) -> Region:
        region = self._regions.pop(name, None)
        if region is None:
            raise UnknownRegionError(f"region {name!r} is not registered here")
        if region.on_release is not None:
            region.on_release()
        return region

    def get(self, name: str) -> Region | None:
        return self._regions.get(name)

    def lookup(self, name: str, offset: int, length: int, where: str = "local") -> Region:
        """The region, after checking that [offset, offset+length) lies in it."""
        region = self._regions.get(name)
        if region is None:
            raise UnknownRegionError(
                f"{where} region {name!r} is not registered "
                f"(known: {sorted(self._regions)[:8]})"
            )
        check_bounds(where, name, region.info.nbytes, offset, length)
        return region

    def all(self) -> list[Region]:
        return list(self._regions.values())

    def infos(self) -> list[RegionInfo]:
        return [r.info for r in self._regions.values()]

    def names(self) -> list[str]:
        return list(self._regions)

    def __len__(self) -> int:
        return len(self._regions)
