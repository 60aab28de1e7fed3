"""A cluster in the test's own process: the conductor's core (no gRPC) and engine instances
(``mooncaked.instance.Worker``: real ``Engine``s, real ``TransferEngine``s on loopback) reached
through ``LocalEngineLink``s. KV moves over the transfer engines as between processes: the
prefill pushes each layer into the decode's reserved blocks, a plan's pull reads a peer's KV cache.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from mooncaked.conductor.core import Conductor
from mooncaked.conductor.engine_link import (UNAVAILABLE, EngineError, EngineLink, Heartbeat, InstanceLoad, PrefillPlan,
                                             PrefillResult)
from mooncaked.conductor.membership import Registration
from mooncaked.conductor.policies import make_policy
from mooncaked.conductor.registry import PipelineMember
from mooncaked.conductor.router import SchedulerState
from mooncaked.engine import Engine
from mooncaked.instance.heartbeat import InstanceHeartbeat
from mooncaked.instance.kv_push import KV_REGION
from mooncaked.instance.local_link import LocalEngineLink, LocalFabric
from mooncaked.instance.pool_cache import PoolCache
from mooncaked.instance.worker import Worker
from mooncaked.transfer import TransferEngine

BLOCK = 4
KV_BYTES = 1 << 20


class Counted(LocalEngineLink):
    """A worker's in-process link that counts its calls and keeps the plans it was given."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.calls: Counter[str] = Counter()
        self.plans: list[PrefillPlan | None] = []
        self.results: list[PrefillResult] = []

    @property
    def engine(self) -> Engine:
        return self.worker.engine

    @property
    def reserved(self) -> dict:
        return self.worker.decoder.reserved

    async def reserve(self, *a, **k):
        self.calls["reserve"] += 1
        return await super().reserve(*a, **k)

    async def prefill(self, request_id, prompt_token_ids, sampling, target, timeout_s, plan=None, stages=None):
        self.calls["prefill"] += 1
        self.plans.append(plan)
        result = await super().prefill(request_id, prompt_token_ids, sampling, target, timeout_s, plan, stages)
        self.results.append(result)
        return result

    async def decode(self, request_id, first, timeout_s):
        self.calls["decode"] += 1
        started = finished = False
        try:
            async for c in super().decode(request_id, first, timeout_s):
                started = True
                finished = bool(c.finish_reason)
                yield c
        finally:
            if started and not finished:  # the caller went away mid-stream
                self.calls["decode_abandoned"] += 1

    async def abort(self, *a, **k):
        self.calls["abort"] += 1
        return await super().abort(*a, **k)

    async def lend(self, *a, **k):
        self.calls["lend"] += 1
        return await super().lend(*a, **k)

    async def release(self, *a, **k):
        self.calls["release"] += 1
        return await super().release(*a, **k)


class Unreachable(EngineLink):
    """An instance whose process is gone: every call fails as a refused connection does."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _gone(self, call: str) -> EngineError:
        self.calls[call] += 1
        return EngineError(UNAVAILABLE, "failed to connect to all addresses; connection refused")

    async def reserve(self, *a, **k):
        raise self._gone("reserve")

    async def renew(self, *a, **k):
        raise self._gone("renew")

    async def prefill(self, *a, **k):
        raise self._gone("prefill")

    async def decode(self, *a, **k):
        raise self._gone("decode")
        yield  # an async generator, as a real link's decode is

    async def abort(self, *a, **k):
        raise self._gone("abort")

    async def lend(self, *a, **k):
        raise self._gone("lend")

    async def release(self, *a, **k):
        raise self._gone("release")

    async def drain(self, *a, **k):
        raise self._gone("drain")

    async def stage_open(self, *a, **k):
        raise self._gone("stage_open")

    async def stage_input(self, *a, **k):
        raise self._gone("stage_input")

    async def stage_finish(self, *a, **k):
        raise self._gone("stage_finish")

    async def close(self, grace_s=0.0) -> None:
        pass


class HeldPrefill(Counted):
    """A prefill instance that starts only once ``go`` is set (a long queue), to leave during it."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.go = asyncio.Event()
        self.started = asyncio.Event()

    async def prefill(self, *a, **k) -> PrefillResult:
        self.started.set()
        await self.go.wait()
        return await super().prefill(*a, **k)


class Cluster:
    def __init__(self, folder, policy=None, kv_bytes: int = KV_BYTES) -> None:
        self.folder = folder
        self.kv_bytes = kv_bytes
        self.fabric = LocalFabric()  # address -> link: the conductor's connect and the workers' peers
        self.links: dict[str, EngineLink] = {}
        self.engines: list[Engine] = []
        self.transfers: list[TransferEngine] = []
        self.queued: dict[str, int] = {}
        probe = Engine.from_pretrained(folder, block_size=BLOCK, kv_cache_bytes=kv_bytes)
        self.engines.append(probe)
        self.layout = probe.runner.kv.layout()
        self.conductor = Conductor(probe.tokenizer, probe.model_config, folder.name, BLOCK, probe.config.hash_seed,
                                   heartbeat_interval_s=0.2, heartbeat_timeout_s=60.0, connect=self.fabric.connect,
                                   scheduler=SchedulerState(policy or make_policy("mooncake")))

    async def worker(self, name: str, role: str, store=None, **engine_kw) -> Worker:
        """A real instance: an engine whose KV pool is a transfer region, served on loopback."""
        transfer = TransferEngine(backend="tcp", host="127.0.0.1", port=0)
        engine = Engine.from_pretrained(self.folder, block_size=BLOCK, kv_cache_bytes=self.kv_bytes,
                                        record_kv_events=True,
                                        kv_pool_alloc=lambda n: transfer.alloc_region(KV_REGION, n), **engine_kw)
        engine.start_driver(asyncio.get_running_loop())
        await transfer.start()
        self.engines.append(engine)
        self.transfers.append(transfer)
        pool = PoolCache(store, engine, self.folder.name) if store is not None else None
        return Worker(name, role, engine, transfer, self.folder.name, pool=pool, peers=self.fabric.get)

    def join(self, name: str, role: str, link: EngineLink, queued_prefill_tokens: int = 0,
             pipeline: PipelineMember | None = None) -> EngineLink:
        address = f"inproc:{name}"
        self.links[name] = self.fabric[address] = link
        transfer = link.worker.endpoint() if isinstance(link, LocalEngineLink) else None
        layout = link.worker.layout if isinstance(link, LocalEngineLink) else self.layout
        self.conductor.register(Registration(name, role, address, self.folder.name, layout,
                                             **({"transfer": transfer} if transfer else {}), pipeline=pipeline))
        total = self.layout.num_blocks
        self.queued[name] = queued_prefill_tokens
        self.conductor.heartbeat(Heartbeat(name, InstanceLoad(queued_prefill_tokens=queued_prefill_tokens,
                                                              free_kv_blocks=total, total_kv_blocks=total)))
        return link

    async def serve(self, name: str, role: str, cls: type[Counted] = Counted, store=None, **load) -> Counted:
        return self.join(name, role, cls(await self.worker(name, role, store)), **load)

    async def group(self, name: str, stages: int, chunk_tokens: int) -> list[Counted]:
        """A CPP prefill group: stage k is instance f"{name}-s{k}", each engine holding its layers only and
        cutting prompts into chunks of ``chunk_tokens`` (its step budget)."""
        links = []
        for k in range(stages):
            worker = await self.worker(f"{name}-s{k}", "prefill", pipeline_stage=(k, stages),
                                       max_num_batched_tokens=chunk_tokens)
            links.append(self.join(f"{name}-s{k}", "prefill", Counted(worker),
                                   pipeline=PipelineMember(name, k, stages, chunk_tokens)))
        return links

    async def beat(self) -> None:
        """One heartbeat from every live in-process instance: its load and the KV events since the last."""
        for name, link in self.links.items():
            if not isinstance(link, LocalEngineLink):
                continue
            hb = InstanceHeartbeat(link.worker).beat()
            hb.load.queued_prefill_tokens = max(hb.load.queued_prefill_tokens, self.queued[name])
            self.conductor.heartbeat(hb)

    async def close(self) -> None:
        for e in self.engines:
            e.close()
        await asyncio.sleep(0)  # let the cancelled engine drivers end before the loop closes
        for t in self.transfers:
            await t.close()
