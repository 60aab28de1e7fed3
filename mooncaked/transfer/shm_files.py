"""Names and ownership checks of our shared-memory segments, without torch.

shm.py (the engine's segments and peers' mappings) and the transfer I/O process (io_worker.py,
which maps its own engine's segments to send from and receive into them) both open segments by
name; the rules of what we map live here once.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat

from mooncaked.transfer.api import PeerUnavailableError, TransferError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mooncaked-"
SEGMENT_MODE = 0o600


def segment_path(shm_name: str) -> str:
    if "/" in shm_name or not shm_name.startswith(SHM_PREFIX):
        raise TransferError(f"refusing shm segment name {shm_name!r}: not one of ours")
    return os.path.join(SHM_DIR, shm_name)


def check_private(shm_name: str, st: os.stat_result) -> None:
    """Refuse a segment that is not a regular file of ours that only we may open."""
    if not stat.S_ISREG(st.st_mode):
        raise TransferError(f"refusing shm segment {shm_name}: not a regular file")
    if st.st_uid != os.geteuid():
        raise TransferError(f"refusing shm segment {shm_name}: owned by uid {st.st_uid}, not ours "
                            f"({os.geteuid()}); peers sharing memory must run as one user")
    if st.st_mode & 0o077:
        raise TransferError(f"refusing shm segment {shm_name}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                            f"others open it (segments are {SEGMENT_MODE:04o})")



def reserve_and_map(fd: int, nbytes: int, where: str) -> mmap.mmap:
    """Reserve `nbytes` of the file's pages now (posix_fallocate: a full /dev/shm or memory fails here with
    an error, not with SIGBUS at first touch) and map them shared and prefaulted."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise TransferError(f"cannot allocate {nbytes} bytes {where}: {e}; free space there or use a smaller "
                            "region") from e
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def create_file(shm_name: str, nbytes: int) -> mmap.mmap:
    """Create a new file of ours of `nbytes` (mode SEGMENT_MODE, never over an existing name), its pages
    reserved now (posix_fallocate: a full /dev/shm fails here, not with SIGBUS at first touch), mapped
    shared and prefaulted; on any failure the name is removed."""
    path = segment_path(shm_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
    try:
        os.fchmod(fd, SEGMENT_MODE)  # exactly owner read/write, whatever the umask took away
        return reserve_and_map(fd, nbytes, f"in {SHM_DIR}")
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_segment(shm_name: str, nbytes: int | None = None) -> mmap.mmap:
    """Map the first `nbytes` of a segment of ours (None: all of it; checked as check_private checks), shared."""
    try:
        fd = os.open(segment_path(shm_name), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise PeerUnavailableError(f"shm segment {shm_name} is gone: its owner unregistered it or exited") from e
    except OSError as e:  # ELOOP: a symlink planted under our name
        raise TransferError(f"refusing shm segment {shm_name}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        check_private(shm_name, st)
        if nbytes is None:
            nbytes = st.st_size
        if st.st_size < nbytes or not nbytes:
            raise TransferError(f"shm segment {shm_name} has {st.st_size} bytes, expected {nbytes or 'some'}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))  # no faults later
    finally:
        os.close(fd)
