"""What the transfer tests share: a peer in its own (spawned) process driven over a pipe, and byte helpers."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
import uvloop

T = TypeVar("T")
SPAWN = mp.get_context("spawn")


class PeerProcess:
    """Starts `target(pipe, backend, nbytes)`, which sends its transfer address, then answers commands."""

    def __init__(self, target: Callable[..., None], backend: str, nbytes: int) -> None:
        self.pipe, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(child, backend, nbytes), daemon=True)
        self.proc.start()
        assert self.pipe.poll(45), "peer process did not start"
        self.address: str = self.pipe.recv()

    def ask(self, *cmd: Any) -> Any:
        self.pipe.send(cmd)
        assert self.pipe.poll(20), f"peer did not answer {cmd}"
        return self.pipe.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.pipe.send(("stop",))
            self.proc.join(20)
            assert self.proc.exitcode == 0


def run_uv(coro: Awaitable[T]) -> T:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).hexdigest()


def digest_bytes(data: bytes) -> str:
    """digest() of these bytes as a tensor."""
    return hashlib.sha256(data).hexdigest()


def closed_port() -> int:
    """A port nothing listens on (cluster.free_port: below the ephemeral range, so nothing binding any port
    takes it meanwhile)."""
    from cluster import free_port

    return free_port()
