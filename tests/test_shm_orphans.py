"""Shared-memory files a killed process left behind are removed by the next engine on the host; a
file whose creator still holds it is never removed (transfer/shm_files.py). Real child processes:
one killed with SIGKILL, one alive holding its file, one that exits without removing its own."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import uvloop

from mooncaked.transfer import TransferEngine
from mooncaked.transfer.shm_files import SHM_DIR, remove_orphans

ROOT = Path(__file__).resolve().parent.parent
# a child that makes one file and prints its name, then: 'kill' itself with SIGKILL, 'exit' without
# removing it, or 'wait' for a line on stdin (alive, holding it); argv[2], when given, is the pid its
# name carries (a creator in another pid namespace, as seen from here)
_CHILD = """
import os, signal, sys, uuid
from mooncaked.transfer.shm_files import SHM_PREFIX, create_file, new_name
name = f"{SHM_PREFIX}{sys.argv[2]}-{uuid.uuid4().hex[:12]}" if len(sys.argv) > 2 else new_name()
mm = create_file(name, 1 << 20)
print(name, flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "wait":
    sys.stdin.readline()
"""


def _child(mode: str, *name_pid: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode, *map(str, name_pid)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name.startswith("mooncaked-"), name
    return proc, os.path.join(SHM_DIR, name)


def _exited_pid() -> int:
    """A pid that is not running here (a process that has exited)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30, check=True)
    return int(proc.stdout)


def _start_and_close_a_shm_engine() -> None:
    async def body() -> None:
        engine = TransferEngine(backend="shm")
        await engine.start()
        await engine.close()

    uvloop.run(body())


@pytest.mark.timeout(120)
def test_a_killed_processes_file_is_removed_by_the_next_engine_and_a_live_ones_kept() -> None:
    live, live_path = _child("wait")
    dead, dead_path = _child("kill")
    try:
        assert dead.wait(30) == -9
        assert os.path.exists(dead_path), "kill -9: nobody removed it"
        _start_and_close_a_shm_engine()
        assert not os.path.exists(dead_path), "the next engine on the host removed the orphan"
        assert os.path.exists(live_path), "a running creator's file stays"
    finally:
        live.communicate("\n", timeout=30)  # it exits without removing its file: now an orphan too
    remove_orphans()  # (an engine starting in another test may have removed it first: the same code)
    assert not os.path.exists(live_path)


@pytest.mark.timeout(120)
def test_a_file_still_held_by_its_creator_stays_even_when_its_pid_is_not_running_here() -> None:
    """A creator in another pid namespace sharing this /dev/shm: its pid means nothing here, its lock does."""
    holder, path = _child("wait", _exited_pid())
    try:
        assert os.path.basename(path) not in remove_orphans()
        assert os.path.exists(path)
    finally:
        holder.communicate("\n", timeout=30)
    remove_orphans()
    assert not os.path.exists(path), "let go: an orphan"


@pytest.mark.timeout(60)
def test_a_file_that_is_not_privately_ours_is_never_removed() -> None:
    path = os.path.join(SHM_DIR, f"mooncaked-{_exited_pid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.fchmod(fd, 0o644)  # others may read it: not one of ours (check_private), whatever its name says
        assert os.path.basename(path) not in remove_orphans()
        assert os.path.exists(path)
    finally:
        os.close(fd)
        os.unlink(path)
