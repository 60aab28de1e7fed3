"""Names and ownership checks of our shared-memory segments, without torch.

shm.py (the engine's segments and peers' mappings) and the transfer I/O process (io_worker.py,
which maps its own engine's segments to send from and receive into them) both open segments by
name; the rules of what we map live here once.

A file in /dev/shm is memory held until someone removes it. A process killed before it could
remove its segments (kill -9, the OOM killer) would hold that memory until the host reboots, so
each creator keeps a shared `flock` on each of its files for as long as it lives (the kernel drops
it when the process dies, however it dies), and `remove_orphans` removes our files that nobody
holds whose creator's pid (in the name) is not running here. Both tests are needed: the lock
keeps a file of a creator in another pid namespace sharing this /dev/shm, the pid keeps a file
of a creator from before the lock existed.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import uuid

from mooncaked.transfer.api import PeerUnavailableError, TransferError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mooncaked-"
SEGMENT_MODE = 0o600


def new_name() -> str:
    """A fresh name for a file this process creates: the prefix, our pid (remove_orphans reads it), a random part."""
    return f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


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


_held: dict[str, int] = {}  # our files -> the descriptor that holds each one's lock (see the module docstring)
_PID_IN_NAME = re.compile(rf"{re.escape(SHM_PREFIX)}(\d+)-")  # new_name's pid


def create_file(shm_name: str, nbytes: int) -> mmap.mmap:
    """Create a new file of ours of `nbytes` (mode SEGMENT_MODE, never over an existing name), its pages
    reserved now (posix_fallocate: a full /dev/shm fails here, not with SIGBUS at first touch), mapped
    shared and prefaulted, and held (a lock) until `remove_file`; on any failure the name is removed."""
    path = segment_path(shm_name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # ours while we live: never an orphan
        os.fchmod(fd, SEGMENT_MODE)  # exactly owner read/write, whatever the umask took away
        mm = reserve_and_map(fd, nbytes, f"in {SHM_DIR}")
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    _held[shm_name] = fd
    return mm


def remove_file(shm_name: str) -> None:
    """Remove a file create_file made (gone already is fine) and let go of its lock."""
    try:
        os.unlink(segment_path(shm_name))
    except FileNotFoundError:
        pass
    fd = _held.pop(shm_name, None)
    if fd is not None:
        os.close(fd)


def remove_orphans() -> list[str]:
    """Remove our files in /dev/shm whose creator is gone without removing them; their names.

    An orphan: a regular file of ours (check_private) that no process holds (create_file's lock) and
    whose creator's pid is not running here. A file that is not clearly an orphan is left alone."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        m = _PID_IN_NAME.match(name)
        if m is None or _running(int(m.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            check_private(name, os.fstat(fd))
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its creator (or a namesake) holds it
            os.unlink(path)
            removed.append(name)
        except (TransferError, OSError):
            continue
        finally:
            os.close(fd)
    if removed:
        logger.warning("removed %d shared-memory files left in %s by processes that exited without removing "
                       "them: %s", len(removed), SHM_DIR, ", ".join(removed))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


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
