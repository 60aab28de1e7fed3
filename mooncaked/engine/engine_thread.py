"""The one thread that does an engine's torch work: it builds the engine, then runs its steps.

Why one: torch runs CPU ops on libgomp's OpenMP teams, one team per thread that calls it. Once a
process holds more OpenMP threads than it has CPUs, libgomp cuts the time its workers spin between
ops to ~100 iterations, so every op then wakes them through the kernel. On a 2-vCPU host an engine
built on one thread and stepped on another ran each decode-step linear layer in ~115 µs instead of
~25 µs, and `mooncaked generate` made 23 tokens/s instead of 40 (docs/performance.md, "An AMX host").
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

THREAD_NAME = "engine-step"


def new_engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)


def build_on_engine_thread(make: Callable[[concurrent.futures.ThreadPoolExecutor], T], threads: int = 0) -> T:
    """``make(thread)`` run on a new engine thread, which it hands to the engine it builds (blocks;
    from async code, call it through ``run_in_executor``: the waiting thread does no torch work).
    ``threads``: torch's CPU threads for the process, set there first (0: torch's own choice)."""

    def build(thread: concurrent.futures.ThreadPoolExecutor) -> T:
        if threads:
            torch.set_num_threads(threads)
        log.info("engine: %d torch threads", torch.get_num_threads())
        return make(thread)

    thread = new_engine_thread()
    try:
        return thread.submit(build, thread).result()
    except BaseException:
        thread.shutdown(wait=False)
        raise
