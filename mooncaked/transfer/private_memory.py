"""Memory an engine shares with its own transfer I/O process only: an anonymous memfd, handed over by
file descriptor (SCM_RIGHTS on a private socket), never named in /dev/shm.

Why not a /dev/shm segment (shm.py) for the I/O process: a named segment outlives a killed engine
(nothing sweeps it) and /dev/shm is small in a default container (64 MiB in Docker), while an engine's
KV cache is gigabytes. A memfd has no name: its pages go with the last mapping or descriptor, and it is
bounded by the process's memory, not by /dev/shm's size. Peers on the host cannot open it (they map
regions by name, shm.py); only a process we hand the descriptor to can. Imports no torch (the I/O
process maps with it too).
"""

from __future__ import annotations

import mmap
import os
import socket

from mooncaked.transfer.api import TransferError
from mooncaked.transfer.shm_files import reserve_and_map

MEMFD_NAME = "mooncaked-region"  # what /proc/PID/maps shows; not a path anyone can open
NAME_BYTES = 1024  # the region name sent with a descriptor, at most (MAX_REGION_NAME_BYTES is less)
DESCRIPTOR_TIMEOUT_S = 5.0
"""Bounds both ends of the descriptor socket: a descriptor is sent just before its command and never waits in
practice (a few regions, a socket buffer of room), so a wait means the other process is gone."""


def create_private(nbytes: int) -> tuple[int, mmap.mmap]:
    """A new memfd of `nbytes`, its pages reserved now (a full memory fails here, not with SIGBUS at first
    touch), mapped shared and prefaulted: (descriptor, mapping). The caller closes the descriptor when the
    region goes; the pages stay while the mapping does."""
    if nbytes <= 0:
        raise TransferError(f"region size must be positive, got {nbytes}")
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        return fd, reserve_and_map(fd, nbytes, "of memory")
    except BaseException:
        os.close(fd)
        raise


def send_descriptor(sock: socket.socket, name: str, fd: int) -> None:
    """Hand `fd` to the process at the other end of `sock`, labelled with the region's name."""
    socket.send_fds(sock, [name.encode("utf-8")], [fd])


def receive_mapping(sock: socket.socket, name: str, nbytes: int) -> mmap.mmap:
    """The next descriptor on `sock`, checked to be `name`'s and at least `nbytes` long, mapped shared."""
    label, fds, _, _ = socket.recv_fds(sock, NAME_BYTES, 4)
    try:
        if not fds:
            raise TransferError(f"no descriptor came for region {name!r}")
        if label != name.encode("utf-8") or len(fds) != 1:
            raise TransferError(f"expected region {name!r}'s descriptor, got {label[:64]!r} with {len(fds)}")
        size = os.fstat(fds[0]).st_size
        if size < nbytes:
            raise TransferError(f"region {name!r}'s memory has {size} bytes, not {nbytes}")
        return mmap.mmap(fds[0], nbytes, flags=mmap.MAP_SHARED)
    finally:
        for fd in fds:
            os.close(fd)
