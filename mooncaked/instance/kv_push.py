"""A prefill instance pushing a request's KV into the decode instance's blocks, layer by layer.

The engine calls ``on_layer`` on its own thread right after a layer wrote its K/V for the
step; we turn the token range that became ready into transfer ops and hand them to the
event loop, so the bytes move while the next layer computes. Tokens already in the
prefill's cache before the request (a prefix hit) go out with the first push of each layer.
A small step (``SMALL_STEP_TOKENS``) sends its layers together, after the last one it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from mooncaked.engine.kv_cache import KVLayout
from mooncaked.engine.step_records import StepSeq
from mooncaked.instance import metrics
from mooncaked.instance.write_fence import WriteFence
from mooncaked.transfer import TransferEngine, TransferError, TransferOp

log = logging.getLogger(__name__)

KV_REGION = "kv"
# a step that computes at most this many of the request's tokens pushes once, after its last layer: its KV
# is small, and a submission per layer costs the engine's thread and loop more than the overlap gains (a few
# new tokens after a cached prefix, one host: median TTFT 83-86 ms against 95, docs/performance.md)
SMALL_STEP_TOKENS = 64


def range_ops(local: KVLayout, remote: KVLayout, layer: int, local_blocks: list[int], remote_blocks: list[int],
              start: int, end: int, peer: str, remote_layer: int | None = None) -> list[TransferOp]:
    """Ops that copy tokens [start, end) of one layer's K and V, block by block (into ``remote_layer``
    there: a pipeline stage's local layer i is the model's layer first_layer + i)."""
    remote_layer = layer if remote_layer is None else remote_layer
    ops: list[TransferOp] = []
    bs = local.block_size
    for j in range(start // bs, (end - 1) // bs + 1):
        t0 = max(start, j * bs) - j * bs
        t1 = min(end, (j + 1) * bs) - j * bs
        length = (t1 - t0) * local.token_bytes
        for kv in (0, 1):
            ops.append(TransferOp("write", KV_REGION, local.offset(layer, kv, local_blocks[j], t0), peer,
                                  KV_REGION, remote.offset(remote_layer, kv, remote_blocks[j], t0), length))
    return ops


@dataclass
class KVPush:
    transfer: TransferEngine
    loop: asyncio.AbstractEventLoop
    local: KVLayout
    remote: KVLayout
    peer: str
    remote_blocks: list[int]
    num_tokens: int
    layerwise: bool = True  # False: push everything once the prompt is done, in one batch (the baseline)
    pushed: list[int] = field(default_factory=list)  # per layer: tokens pushed so far
    tasks: list[asyncio.Future] = field(default_factory=list)
    bytes_sent: int = 0
    block_table: list[int] = field(default_factory=list)
    started: float | None = None  # perf_counter of the first push
    seconds: float = 0.0  # first push to last byte acknowledged  # the prefill's blocks for the request, last seen
    closed: bool = False  # set by stop(): no further write starts
    fence: WriteFence | None = None  # whether a write may start now (instance/write_fence.py)
    fenced: bool = False  # a write was refused by the fence: the push failed
    fenced_late: bool = False  # ... because the fence lapsed (WriteFence.lapsed): this side renewed too late
    layer_offset: int = 0  # a pipeline stage: its first layer's index in the model (and the decode's pool)
    # elastic CPP on a whole-model engine: only these layers [first, end) are this push's (None: all held)
    layers: tuple[int, int] | None = None
    start_tokens: int = 0  # tokens the target holds already (a lead's own cached run): never written again

    waiting: list[TransferOp] = field(default_factory=list)  # ops not sent yet (a small step's, or the prompt's)

    def __post_init__(self) -> None:
        self.pushed = [self.start_tokens] * self.local.num_layers

    def on_layer(self, layer: int, step: StepSeq) -> None:
        """Engine thread: the layer now holds KV for tokens up to step.start + step.num_tokens."""
        end = min(step.start + step.num_tokens, self.num_tokens)
        self.block_table = step.block_table
        self.waiting += self._ops(layer, list(step.block_table), self.pushed[layer], end)
        at_last = layer >= step.last_layer
        # layer-wise: each layer at once, but a small step's layers together; else the whole prompt at its end
        due = (at_last or step.num_tokens > SMALL_STEP_TOKENS) if self.layerwise else at_last and step.finishes_prompt
        if due:
            self._send(self.waiting)
            self.waiting = []

    def _ops(self, layer: int, blocks: list[int], start: int, end: int) -> list[TransferOp]:
        """The ops that push tokens [start, end) of one layer (none if there are none), counted as pushed."""
        if end <= start:
            return []
        ops = range_ops(self.local, self.remote, layer, blocks, self.remote_blocks, start, end, self.peer,
                        layer + self.layer_offset)
        self.pushed[layer] = end
        self.bytes_sent += sum(op.length for op in ops)
        return ops

    def _send(self, ops: list[TransferOp]) -> None:
        if ops:
            self.loop.call_soon_threadsafe(self._submit, ops)

    def _submit(self, ops: list[TransferOp]) -> None:
        if self.closed:  # the request ended: its decode blocks may be freed, nothing more may land there
            return
        if self.fenced or (self.fence is not None and not self.fence.allows()):
            # the reservation may be freed (and its blocks reused) by now: this push fails, writing nothing more
            if not self.fenced:
                self.fenced = True
                self.fenced_late = self.fence is not None and self.fence.lapsed()
                metrics.PUSHES_FENCED.inc()
                why = self.fence.why_closed() if self.fence is not None else "the write fence closed"
                log.warning("KV push to %s stopped: %s", self.peer, why)
                failed = self.loop.create_future()
                failed.set_exception(TransferError(why))
                self.tasks.append(failed)
            return
        if self.started is None:
            self.started = time.perf_counter()
        self.tasks.append(asyncio.ensure_future(self.transfer.submit(ops)))

    async def wait(self, timeout_s: float) -> None:
        """Until every byte is at the decode instance; raises the first transfer error."""
        # pushes scheduled from the engine thread land on the loop in order; let them arrive
        await asyncio.sleep(0)
        try:
            await asyncio.wait_for(asyncio.gather(*self.tasks), timeout_s)
            if self.started is not None:
                self.seconds = time.perf_counter() - self.started
        finally:
            for t in self.tasks:
                if not t.done():
                    t.cancel()

    async def stop(self, timeout_s: float) -> bool:
        """No write starts after this; the ones in flight are awaited (acknowledged by the decode
        instance or failed) up to ``timeout_s``, then cancelled. True when every write has ended
        before the timeout: only then may the decode instance free the blocks they target."""
        self.closed = True  # _submit runs on this loop: from here on it starts nothing
        pending = [t for t in self.tasks if not t.done()]
        if not pending:
            return True
        done, late = await asyncio.wait(pending, timeout=timeout_s)
        for t in late:
            t.cancel()
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved: a failed push of an ended request is expected, not an error
        return not late

    @property
    def complete(self) -> bool:
        first, end = self.layers or (0, self.local.num_layers)
        return all(p >= self.num_tokens for p in self.pushed[first:end])
