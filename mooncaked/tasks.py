"""Background asyncio tasks whose failure is logged, never lost (no gRPC here: the engine uses it too)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


def log_task_failure(task: asyncio.Task) -> None:
    """Done-callback for background tasks: a failure is logged, never lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())


def spawn(coro, name: str) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(log_task_failure)
    return task
