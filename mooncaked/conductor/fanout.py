"""``n`` choices of one OpenAI request: n streams of the request path, merged into one.

The first choice runs its prefill alone before the others start, so the copies find its prompt
in the prefix cache instead of computing it n times. Every choice's first chunk is awaited
before the answer starts, so a failure still gets its own HTTP status rather than a broken 200
stream. Closing the merge cancels every stream (which frees their decode instances' blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


async def _first(stream: AsyncIterator[T]) -> T | None:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def first_chunks(streams: list[AsyncIterator[T]]) -> list[T | None]:
    """The first chunk of each stream (None for one that ended without any): the first stream's,
    then the others' concurrently. An error of any of them is raised once all have stopped."""
    if not streams:
        return []
    head = await _first(streams[0])
    tasks = [asyncio.ensure_future(_first(s)) for s in streams[1:]]
    try:
        rest = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [head, *rest]


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """``(index, chunk)`` from every stream as they come; the first error ends the merge.

    The caller closes the streams themselves, after closing this iterator."""
    if len(streams) == 1:  # no tasks for the common case: the chunks come straight through
        async for c in streams[0]:
            yield 0, c
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for c in stream:
                queue.put_nowait((i, c, None))
            queue.put_nowait((i, _END, None))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, _END, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, c, err = await queue.get()
            if err is not None:
                raise err
            if c is _END:
                left -= 1
                continue
            yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
