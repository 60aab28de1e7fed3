"""The transfer I/O process: an engine's tcp socket work, off the engine's interpreter.

Measured (docs/performance.md, "Data plane"): a busy engine starves its own pushes because its
Python (a scheduler step, a burst of request handling) holds the GIL the socket code needs; an
I/O thread shares that GIL and does not help. This process has its own interpreter: it maps the
engine's regions (their memfds, private_memory.py, or their /dev/shm segments, shm_files.map_segment), so it
sends straight from and receives straight into them, over blocking sockets, one thread per connection (tcp_blocking.py: the same
wire, the cluster-secret handshake, per-op deadlines). The engine sends one command per batch and
gets one completion back (io_wire.py).

Started by io_transport.py as `python -m mooncaked.transfer.io_worker FD FDS` (FDS: where the engine hands
its regions' memfds, private_memory.py); it follows its parent:
it exits at end of stream on FD and the kernel kills it if the parent dies. Imports no torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncaked import proc_title
from mooncaked.transfer.api import TransferError, check_bounds
from mooncaked.transfer.io_wire import encode_error, frame, recv_frame
from mooncaked.transfer.private_memory import DESCRIPTOR_TIMEOUT_S, receive_mapping
from mooncaked.transfer.shm_files import map_segment
from mooncaked.transfer.tcp_blocking import BlockingBatch, BlockingPool, Result
from mooncaked.transfer.tcp_client import WireOp
from mooncaked.transfer.wire import Op

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
MAX_PEER_THREADS = 16
"""Lanes running at once toward one peer (each holds one connection); more wait for one of that peer's
threads. Per peer: lanes to a peer that stalls each wait out their deadline, and with one pool for every
peer (32 threads until 2026-12-06) enough batches to a stalled pool owner left a push to a healthy decode
waiting for a thread (tests/test_transfer_io_process.py). Threads start as lanes need them."""


class IoWorker:
    """Regions mapped by name, one connection pool per peer, the batches in flight by id."""

    def __init__(self, sock: socket.socket, descriptors: socket.socket, config: dict[str, Any]) -> None:
        self._sock = sock
        self._descriptors = descriptors  # the engine's regions' memfds, one a message (private_memory.py)
        self._send_lock = threading.Lock()
        self._token: bytes | None = config.get("token")
        self._lanes: int = config["connections_per_peer"]
        self._connect_timeout_s: float = config["connect_timeout_s"]
        self._idle_s: float = config["idle_s"]
        self._maps: dict[str, memoryview | TransferError] = {}
        self._pools: dict[str, BlockingPool] = {}
        self._batches: dict[int, BlockingBatch] = {}
        self._executors: dict[str, ThreadPoolExecutor] = {}  # by peer (MAX_PEER_THREADS)
        self._handlers = {"map": self._map, "map_fd": self._map_fd, "unmap": self._unmap, "submit": self._submit,
                          "cancel": self._cancel}

    def serve(self) -> None:
        while (message := recv_frame(self._sock)) is not None:
            self._handlers[message[0]](*message[1:])

    def send(self, message: tuple[Any, ...]) -> None:
        data = frame(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as e:  # the engine is gone; serve() sees the end of stream
                logger.debug("cannot answer the engine: %s", e)

    def close(self) -> None:
        for batch in list(self._batches.values()):
            batch.cancel()
        for executor in self._executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
        for pool in self._pools.values():
            pool.close()

    def _map(self, region: str, shm_name: str, nbytes: int) -> None:
        try:
            self._maps[region] = memoryview(map_segment(shm_name, nbytes))
        except TransferError as e:
            self._maps[region] = e  # its ops fail with this

    def _map_fd(self, region: str, nbytes: int) -> None:
        """The region's memfd was sent before this command (io_transport.py): it is waiting on the socket."""
        try:
            self._maps[region] = memoryview(receive_mapping(self._descriptors, region, nbytes))
        except TransferError as e:
            self._maps[region] = e  # its ops fail with this
        except OSError as e:
            self._maps[region] = TransferError(f"cannot map region {region!r} in the transfer I/O process: {e}")

    def _unmap(self, region: str) -> None:
        self._maps.pop(region, None)  # the mapping goes once no op in flight holds a view of it

    def _submit(self, batch_id: int, peer: str, timeout_s: float, ops: list[tuple[Any, ...]]) -> None:
        results: list[Result] = [None] * len(ops)
        wire: list[WireOp] = []
        placed: list[int] = []
        for i, (is_write, region, offset, remote, remote_offset, length) in enumerate(ops):
            try:
                view = self._view(region, offset, length)
            except TransferError as e:
                results[i] = e
                continue
            wire.append(WireOp(Op.WRITE if is_write else Op.READ, remote.encode("utf-8"), remote_offset, length,
                               payload=view if is_write else None, dest=None if is_write else view))
            placed.append(i)

        def done(outcomes: list[Result]) -> None:
            self._batches.pop(batch_id, None)
            for i, outcome in zip(placed, outcomes, strict=True):
                results[i] = outcome
            self.send(("done", batch_id, [encode_error(r) for r in results]))

        batch = BlockingBatch(self._pool(peer), wire, timeout_s, self._lanes, done)
        self._batches[batch_id] = batch
        executor = self._executors.get(peer)
        if executor is None:
            executor = self._executors[peer] = ThreadPoolExecutor(MAX_PEER_THREADS, thread_name_prefix="transfer-io")
        batch.start(executor)

    def _cancel(self, batch_id: int) -> None:
        batch = self._batches.pop(batch_id, None)
        if batch is not None:
            batch.cancel()  # its connections are aborted: the engine gave up on the memory they touch

    def _view(self, region: str, offset: int, length: int) -> memoryview:
        mapped = self._maps.get(region)
        if mapped is None:
            raise TransferError(f"local region {region!r} is not mapped in the transfer I/O process")
        if isinstance(mapped, TransferError):
            raise mapped
        check_bounds("local", region, len(mapped), offset, length)
        return mapped[offset : offset + length]

    def _pool(self, peer: str) -> BlockingPool:
        pool = self._pools.get(peer)
        if pool is None:
            pool = self._pools[peer] = BlockingPool(peer, self._connect_timeout_s, self._token, self._idle_s)
        return pool


def _die_with_parent() -> None:
    """The kernel kills us when the engine's process dies (Linux); elsewhere end of stream does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; following the parent by end of stream only")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s transfer-io[%(process)d] %(levelname)s %(message)s")
    _die_with_parent()
    proc_title.set_child("transfer-io")
    # the engine says when we end (end of stream; we die with it): a terminal's Ctrl-C reaches its whole
    # process group, us included, while the engine drains through us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    descriptors = socket.socket(fileno=int(argv[2]))
    descriptors.settimeout(DESCRIPTOR_TIMEOUT_S)
    config = recv_frame(sock)
    if config is None or config[0] != "config" or os.getppid() == 1:
        return 1  # the engine is already gone
    worker = IoWorker(sock, descriptors, config[1])
    worker.send(("ready", os.getpid()))
    try:
        worker.serve()
    finally:
        worker.close()
        sock.close()
        descriptors.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
