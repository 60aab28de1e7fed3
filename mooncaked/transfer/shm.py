"""Shared-memory regions for peers on one host: a transfer is one memcpy.

Segments are plain files in /dev/shm mapped with mmap, not
multiprocessing.shared_memory: that module's resource tracker unlinks
segments it merely attached to when the attaching process exits (Python
< 3.13), which would tear regions out from under their owner. The owner
unlinks its segment on unregister/close; peers keep a mapping per segment.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import uuid
from dataclasses import dataclass

import torch

from mooncaked.transfer.api import PeerUnavailableError, TransferError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mooncaked-"
PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def host_id() -> str:
    """Names this host (and boot) so two engines can tell they share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _path(shm_name: str) -> str:
    if "/" in shm_name or not shm_name.startswith(SHM_PREFIX):
        raise TransferError(f"refusing shm segment name {shm_name!r}: not one of ours")
    return os.path.join(SHM_DIR, shm_name)


def _map(fd: int, nbytes: int) -> torch.Tensor:
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive


@dataclass(slots=True)
class ShmSegment:
    """A segment this process created and owns (and must unlink)."""

    shm_name: str
    nbytes: int
    tensor: torch.Tensor  # uint8, maps the whole segment

    def unlink(self) -> None:
        """Remove the name; the pages go when the last mapping is dropped."""
        try:
            os.unlink(_path(self.shm_name))
        except FileNotFoundError:
            pass


def create_segment(nbytes: int) -> ShmSegment:
    """Create, size, map and prefault a new segment.

    posix_fallocate reserves the pages now, so a full /dev/shm fails here with
    an error instead of SIGBUS on first touch later; touching every page maps
    them into this process so the first transfer pays no page faults.
    """
    if nbytes <= 0:
        raise TransferError(f"shm region size must be positive, got {nbytes}")
    shm_name = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = _path(shm_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise TransferError(
                f"cannot allocate {nbytes} bytes in {SHM_DIR}: {e}; "
                "free space there or use a smaller region"
            ) from e
        tensor = _map(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    tensor[::PAGE].zero_()  # prefault: one write per page
    logger.debug("created shm segment %s (%d bytes)", shm_name, nbytes)
    return ShmSegment(shm_name, nbytes, tensor)


class ShmAttachments:
    """Mappings of peers' segments, made on first use and kept until close."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def get(self, shm_name: str, nbytes: int) -> torch.Tensor:
        tensor = self._maps.get(shm_name)
        if tensor is not None and tensor.numel() >= nbytes:
            return tensor
        try:
            fd = os.open(_path(shm_name), os.O_RDWR)
        except FileNotFoundError as e:
            raise PeerUnavailableError(
                f"shm segment {shm_name} is gone: its owner unregistered it or exited"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise TransferError(f"shm segment {shm_name} has {size} bytes, peer said {nbytes}")
            tensor = _map(fd, nbytes)
        finally:
            os.close(fd)
        self._maps[shm_name] = tensor
        logger.debug("attached shm segment %s (%d bytes)", shm_name, nbytes)
        return tensor

    @staticmethod
    def alive(shm_name: str) -> bool:
        """Whether the owner still has the segment (it unlinks on unregister)."""
        return os.path.exists(_path(shm_name))

    def drop(self, shm_name: str) -> None:
        self._maps.pop(shm_name, None)

    def close(self) -> None:
        self._maps.clear()
