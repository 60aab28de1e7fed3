"""What steps an engine in a daemon: a task on the event loop that runs each step on the engine thread.

Requests arrive on the loop (gRPC, HTTP) and from other threads; the torch work must stay on the one
thread that built the engine (engine_thread.py says why). So the task sleeps while the engine has no
work, is woken (thread-safe) by whatever queues some, and hands each step to that thread. A pipeline
stage waiting for its input would find nothing to do in a loop: it waits for a wake, at most
STARVED_WAIT_S. The step's own error handling fails only the requests concerned; should the task die
anyway, `on_death` is told once (the engine fails its waiters and its owner exits).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Protocol

from mooncaked.engine.engine_thread import new_engine_thread
from mooncaked.tasks import log_task_failure

STARVED_WAIT_S = 0.05


class Steppable(Protocol):
    def has_work(self) -> bool: ...
    def step(self) -> object: ...
    @property
    def starved(self) -> bool: ...


class Driver:
    """Steps `engine` on `executor` (made on first start when not given) while a loop runs."""

    def __init__(self, engine: Steppable, executor: concurrent.futures.ThreadPoolExecutor | None,
                 on_death: Callable[[BaseException], None]) -> None:
        self.engine = engine
        self.executor = executor
        self.on_death = on_death
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The engine thread (made on first need: a dead engine's bookkeeping still runs there)."""
        if self.executor is None:
            self.executor = new_engine_thread()
        return self.executor

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drive on `loop` (again, if an earlier loop ended); no-op while already driving there."""
        self.thread()
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self._wake = asyncio.Event()
        self._loop = loop
        self._task = loop.create_task(self._drive(), name="engine-driver")
        self._task.add_done_callback(log_task_failure)
        self._task.add_done_callback(self._done)

    def wake(self) -> None:
        """New work (thread-safe); nothing until the first start."""
        loop = self._loop
        if self._wake is None or loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None

    def _done(self, task: asyncio.Task) -> None:
        """The task ended: by `close` or its loop's end (cancelled), or it died."""
        if task.cancelled() or task.exception() is None:
            return
        self.on_death(task.exception())  # type: ignore[arg-type]

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        engine, wake = self.engine, self._wake
        assert wake is not None
        while True:
            if not engine.has_work():
                wake.clear()
                if not engine.has_work():
                    await wake.wait()
                continue
            wake.clear()  # a wake during the step (a stage's input arriving) stays set
            await loop.run_in_executor(self.executor, engine.step)
            if engine.starved:
                try:
                    await asyncio.wait_for(wake.wait(), STARVED_WAIT_S)
                except asyncio.TimeoutError:
                    pass
