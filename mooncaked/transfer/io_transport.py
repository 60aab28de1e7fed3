"""The tcp transport in a dedicated I/O process: a busy engine does not starve its pushes.

The engine's side of io_worker.py. Regions the engine allocates are memory the I/O process maps:
a memfd whose descriptor crosses a second private socket (`private_memory`, private_memory.py: no
name in /dev/shm, gone with the engine), or, where a backend puts them in /dev/shm anyway (auto),
the named segment. Each peer's share of a batch crosses the private socketpair as one command and
one completion (io_wire.py); the bytes never pass through the engine's interpreter. Ops on a region
the I/O process cannot reach (registered from a caller's tensor, not alloc_region'ed), and shares
too small to pay for the hop (MIN_SHARE_BYTES), are answered LEFT, so the in-process tcp transport
behind it in the chain carries them.

Failure: if the I/O process dies, every batch in flight on it fails at once with a
PeerUnavailableError that says so (end of stream on the socketpair), and the next submit starts a
fresh process. A caller that cancels a submit sends a cancel; the I/O process aborts that batch's
connections. Deadlines are the tcp client's own (per op, in the I/O process).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from mooncaked.transfer import metrics
from mooncaked.transfer.api import PeerUnavailableError, TransferError, TransferOp
from mooncaked.transfer.io_wire import MAX_OPS_PER_SUBMIT, decode_error, frame, read_frame
from mooncaked.transfer.private_memory import DESCRIPTOR_TIMEOUT_S, send_descriptor
from mooncaked.transfer.regions import Region, RegionTable
from mooncaked.transfer.transport import LEFT, Left, Outcome, Transport

logger = logging.getLogger(__name__)

MIN_SHARE_BYTES = 16 * 1024 * 1024
"""A peer's share below this stays on the in-process tcp transport. The hop to the I/O process and back
costs ~0.2 ms a batch: one submit of n x 512 KiB writes to a peer on an idle host (docs/performance.md,
"Data plane") took 0.59x / 0.71x / 0.88x the in-process time's speed at 2 / 4 / 8 MiB, and 1.31x / 1.06x /
1.09x at 16 / 32 / 64 MiB. From 16 MiB the I/O process is no slower idle, and under contention it keeps
1.07-1.19x a plain socket where the in-process path falls to 0.72-0.80x."""
START_TIMEOUT_S = 30.0
"""The I/O process imports no torch (well under a second), but a loaded 2-core machine is slow."""
STOP_TIMEOUT_S = 5.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(slots=True)
class _Child:
    """One I/O process and the batches in flight on it (a restarted one starts afresh)."""

    proc: subprocess.Popen[bytes]
    writer: asyncio.StreamWriter
    descriptors: socket.socket  # blocking SOCK_SEQPACKET: one region's memfd a message (private_memory.py)
    pending: dict[int, asyncio.Future[list[Any]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return not self.writer.is_closing()

    def send(self, message: tuple[Any, ...]) -> None:
        if not self.alive:
            raise PeerUnavailableError(f"the transfer I/O process {self.proc.pid} is gone; retry")
        self.writer.write(frame(message))


class IoProcessTransport(Transport):
    """tcp through a child process; one per engine, started with the engine."""

    label = "tcp"
    private_memory = True

    def __init__(self, regions: RegionTable, config: dict[str, Any]) -> None:
        self._regions = regions
        self._config = config  # connections_per_peer, connect_timeout_s, idle_s, token, rate_limit_bytes_per_s
        self._child: _Child | None = None
        self._ids = itertools.count(1)
        self._starting: asyncio.Lock | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None and self._child.alive else None

    async def start(self, regions: RegionTable) -> None:
        await self._ensure_started()

    async def _ensure_started(self) -> _Child:
        child = self._child
        if child is not None and child.alive:
            return child
        if self._closed:
            raise TransferError("transfer engine is closed; make a new one")
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._child is None or not self._child.alive:
                self._child = await self._spawn()
        return self._child

    async def _spawn(self) -> _Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds_ours, fds_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds_ours.settimeout(DESCRIPTOR_TIMEOUT_S)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "mooncaked.transfer.io_worker", str(theirs.fileno()),
                                     str(fds_theirs.fileno())], pass_fds=(theirs.fileno(), fds_theirs.fileno()),
                                    env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            fds_ours.close()
            raise
        finally:
            theirs.close()
            fds_theirs.close()
        try:
            reader, writer = await asyncio.open_connection(sock=ours)
            writer.write(frame(("config", self._config)))  # the secret goes here, never on a command line
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await read_frame(reader)
            if ready is None or ready[0] != "ready":
                raise PeerUnavailableError(f"the transfer I/O process did not start (exit code {proc.poll()})")
        except BaseException:
            ours.close()
            fds_ours.close()
            proc.kill()
            raise
        child = _Child(proc, writer, fds_ours)
        for region in self._regions.all():
            self._map(child, region)
        child.reader = asyncio.get_running_loop().create_task(self._read(child, reader))
        logger.info("transfer I/O process %d started", proc.pid)
        return child

    async def _read(self, child: _Child, reader: asyncio.StreamReader) -> None:
        """Completions until end of stream; then fail whatever is still waiting on this child."""
        try:
            while (message := await read_frame(reader)) is not None:
                future = child.pending.pop(message[1], None)
                if future is not None and not future.done():
                    future.set_result(message[2])
        except Exception as e:  # a broken frame: treat the process as gone, and say why
            logger.error("transfer I/O process %d sent a bad message: %s", child.proc.pid, e)
        finally:
            child.writer.close()
            child.descriptors.close()
            code = child.proc.poll()
            if code is None:
                child.proc.kill()
            error = PeerUnavailableError(
                f"the transfer I/O process {child.proc.pid} exited (code {code if code is not None else 'killed'}) "
                "with the batch in flight; a fresh one starts on the next submit: retry")
            if not self._closed and child.pending:
                logger.warning("%s (%d batches failed)", error, len(child.pending))
            elif not self._closed:  # (e.g. a daemon stopping after a failed start): nothing lost
                logger.info("transfer I/O process %d exited (code %s) with nothing in flight; a fresh one starts on "
                            "the next submit", child.proc.pid, code if code is not None else "killed")
            for future in child.pending.values():
                if not future.done():
                    future.set_exception(error)
            child.pending.clear()
            await asyncio.to_thread(child.proc.wait)  # reap it

    def register(self, region: Region) -> None:
        if self._child is not None and self._child.alive:
            self._map(self._child, region)

    def _map(self, child: _Child, region: Region) -> None:
        if region.info.shm_name is not None:
            child.send(("map", region.info.name, region.info.shm_name, region.info.nbytes))
        elif region.fd is not None:  # the descriptor first: the command finds it waiting
            try:
                send_descriptor(child.descriptors, region.info.name, region.fd)
            except OSError as e:  # the child is gone: its reader fails what is in flight, the next submit restarts
                logger.warning("cannot hand region %r to the transfer I/O process %d: %s", region.info.name,
                               child.proc.pid, e)
                return
            child.send(("map_fd", region.info.name, region.info.nbytes))

    def unregister(self, region: Region) -> None:
        if self._reachable_region(region) and self._child is not None and self._child.alive:
            self._child.send(("unmap", region.info.name))

    async def submit(self, peer: str, ops: list[TransferOp], timeout_s: float) -> list[Outcome]:
        results: list[Outcome] = [LEFT] * len(ops)
        mine = [i for i, op in enumerate(ops) if self._reachable(op)]
        if sum(ops[i].length for i in mine) < MIN_SHARE_BYTES:  # read here: tests lower it
            return results
        child = await self._ensure_started()
        for start in range(0, len(mine), MAX_OPS_PER_SUBMIT):
            part = mine[start : start + MAX_OPS_PER_SUBMIT]
            errors = await self._run(child, peer, [ops[i] for i in part], timeout_s)
            for i, error in zip(part, errors, strict=True):
                results[i] = error
        return results

    async def write_from(self, src: memoryview, peer: str, region: str, offset: int, timeout_s: float,
                         meanwhile: Callable[[], object] | None = None) -> Left:
        """A caller's buffer is no region the child maps: the in-process tcp transport sends it as it is (a
        single op's bytes, under MIN_SHARE_BYTES anyway, or a big one, which staging for the hop would copy)."""
        return LEFT

    async def send_from(self, src: memoryview, peer: str, region: str, offset: int, timeout_s: float) -> Left:
        return LEFT  # as write_from

    def _reachable(self, op: TransferOp) -> bool:
        region = self._regions.get(op.local_region)
        return region is not None and self._reachable_region(region)

    @staticmethod
    def _reachable_region(region: Region) -> bool:
        return region.info.shm_name is not None or region.fd is not None

    async def _run(self, child: _Child, peer: str, ops: list[TransferOp], timeout_s: float) -> list[BaseException | None]:
        batch_id = next(self._ids)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        wire = [(op.op == "write", op.local_region, op.local_offset, op.remote_region, op.remote_offset, op.length)
                for op in ops]
        child.send(("submit", batch_id, peer, timeout_s, wire))
        child.pending[batch_id] = future
        try:
            answer = await future
        except asyncio.CancelledError:
            child.pending.pop(batch_id, None)
            if child.alive:
                child.send(("cancel", batch_id))
            raise
        errors: list[BaseException | None] = [decode_error(e) for e in answer]
        metrics.count_initiated(self.label, ops, [e is None for e in errors])
        return errors

    async def close(self) -> None:
        self._closed = True
        child = self._child
        if child is None:
            return
        child.writer.close()  # end of stream: the I/O process closes its connections and exits
        try:
            await asyncio.wait_for(asyncio.to_thread(child.proc.wait), STOP_TIMEOUT_S)
        except TimeoutError:
            logger.warning("transfer I/O process %d did not stop within %ss; killing it", child.proc.pid,
                           STOP_TIMEOUT_S)
            child.proc.kill()
        if child.reader is not None:
            await child.reader
        child.descriptors.close()
