"""Shared-memory regions for peers on one host: a transfer is one memcpy.

Segments are plain files in /dev/shm mapped with mmap, not
multiprocessing.shared_memory: that module's resource tracker unlinks
segments it merely attached to when the attaching process exits (Python
< 3.13), which would tear regions out from under their owner. The owner
unlinks its segment on unregister/close; peers keep a mapping per segment.

Each segment ends with a trailer page after the region's bytes whose first
word says whether the owner still has the region (LIVE) or dropped it
(DEAD, written before the unlink). A peer that mapped the segment reads the
word from its own mapping before each batch, which costs no syscall; for a
segment without a trailer (made by an older owner) it asks the filesystem.

Trust boundary: a segment is a file of mode 0600 owned by the engine's user,
so any process of that same user on this host can map it (as it could ptrace
the engine anyway), and no other user can; the cluster secret does not guard
this path. A peer maps only a regular file it owns that nobody else may
open, never through a symlink: a file planted in the world-writable /dev/shm
under one of our names is refused.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass

import torch

from mooncaked.transfer.api import PeerUnavailableError, TransferError
from mooncaked.transfer.shm_files import SHM_DIR, check_private, create_file, new_name, remove_file, segment_path as _path

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


_LIVE = b"MCKDLIVE"
_DEAD = b"MCKDDEAD"


def _trailer_at(nbytes: int) -> int:
    """Offset of the trailer: the first page boundary at or after the region's end."""
    return -(-nbytes // PAGE) * PAGE


def _map(fd: int, size: int) -> tuple[torch.Tensor, memoryview]:
    """Map `size` bytes of the file: a uint8 tensor and a memoryview of them."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    return torch.frombuffer(mm, dtype=torch.uint8), memoryview(mm)  # both keep mm alive


@dataclass(slots=True)
class ShmSegment:
    """A segment this process created and owns (and must unlink)."""

    shm_name: str
    nbytes: int
    tensor: torch.Tensor  # uint8, the region's nbytes (the trailer page follows)
    trailer: memoryview  # the liveness word

    def unlink(self) -> None:
        """Mark the region dropped for peers that mapped it, then remove the
        name; the pages go when the last mapping is dropped."""
        self.trailer[:] = _DEAD
        remove_file(self.shm_name)


def create_segment(nbytes: int) -> ShmSegment:
    """Create, size, map and prefault a new segment (region + trailer page).

    posix_fallocate reserves the pages now, so a full /dev/shm fails here with
    an error instead of SIGBUS on first touch later; touching every page maps
    them into this process so the first transfer pays no page faults.
    """
    if nbytes <= 0:
        raise TransferError(f"shm region size must be positive, got {nbytes}")
    shm_name = new_name()
    at = _trailer_at(nbytes)
    mm = create_file(shm_name, at + PAGE)
    tensor, view = torch.frombuffer(mm, dtype=torch.uint8), memoryview(mm)  # both keep mm alive
    tensor[::PAGE].zero_()  # prefault: one write per page
    trailer = view[at : at + len(_LIVE)]
    trailer[:] = _LIVE
    logger.debug("created shm segment %s (%d bytes)", shm_name, nbytes)
    return ShmSegment(shm_name, nbytes, tensor[:nbytes], trailer)


@dataclass(slots=True)
class Attachment:
    """A peer's segment as mapped here."""

    tensor: torch.Tensor  # uint8, the region's bytes
    nbytes: int  # and address: asked of torch once, not per op
    address: int
    trailer: memoryview | None  # the owner's liveness word; None for a segment without one
    view: memoryview  # the region's bytes again, for copies to and from caller buffers


class ShmAttachments:
    """Mappings of peers' segments, made on first use and kept until close."""

    def __init__(self) -> None:
        self._maps: dict[str, Attachment] = {}

    def get(self, shm_name: str, nbytes: int) -> Attachment:
        att = self._maps.get(shm_name)
        if att is not None and att.nbytes >= nbytes:
            return att
        try:
            fd = os.open(_path(shm_name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            raise _gone(shm_name) from e
        except OSError as e:  # ELOOP: a symlink planted under our name
            raise TransferError(f"refusing shm segment {shm_name}: {e.strerror or e}") from e
        try:
            st = os.fstat(fd)
            check_private(shm_name, st)
            size = st.st_size
            if size < nbytes:
                raise TransferError(f"shm segment {shm_name} has {size} bytes, peer said {nbytes}")
            at = _trailer_at(nbytes)
            tensor, view = _map(fd, at + PAGE if size >= at + PAGE else nbytes)
        finally:
            os.close(fd)
        trailer = view[at : at + len(_LIVE)] if len(view) > at else None
        if trailer is not None and trailer == _DEAD:
            raise _gone(shm_name)
        if trailer is not None and trailer != _LIVE:
            trailer = None  # not our trailer: fall back to asking the filesystem
        att = self._maps[shm_name] = Attachment(tensor[:nbytes], nbytes, tensor.data_ptr(), trailer, view[:nbytes])
        logger.debug("attached shm segment %s (%d bytes)", shm_name, nbytes)
        return att

    def alive(self, shm_name: str) -> bool:
        """Whether the owner still has the segment: its trailer says so once
        mapped (no syscall); otherwise whether the name exists (the owner
        unlinks it on unregister)."""
        att = self._maps.get(shm_name)
        if att is not None and att.trailer is not None:
            return att.trailer == _LIVE
        return os.path.exists(_path(shm_name))

    def drop(self, shm_name: str) -> None:
        self._maps.pop(shm_name, None)

    def close(self) -> None:
        self._maps.clear()


def _gone(shm_name: str) -> PeerUnavailableError:
    return PeerUnavailableError(f"shm segment {shm_name} is gone: its owner unregistered it or exited")
