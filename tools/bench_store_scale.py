"""The store master at scale: what a million objects on 64 segments cost the master, against
Mooncake's `mooncake_master` holding the same objects, in the same run (`bench_store.py --scale`).

Three measurements, each in a process of its own (so each RSS is that process's alone):

- `ours_process`: a real `mooncaked --role store` process. A driver process plays 64 engines:
  it mounts one DRAM segment per simulated client and pings them all every second, as
  engines do, then calls the master's fast path (framed TCP, what an engine on another host
  uses) with `depth` batches in flight: BatchPutStart + BatchPutEnd of every object, then
  BatchGetReplicas and LongestPrefix on random 64-key chains. No bytes move: segments are
  metadata (the master never touches the bytes), so these are the master's costs plus the
  wire's. RSS and CPU time are the master process's (/proc/PID/status, /proc/PID/stat).
- `ours_inprocess`: the `StoreMaster` state machine called directly (the calls the service
  makes), timing only the calls, in CPU time (so other work on a shared machine does not count):
  the pure metadata cost, without the wire or protobuf.
  Plus a small tracemalloc run that says exactly which structures the bytes per object are.
- `mooncake`: `mooncake_master` (the C++ master from mooncake-transfer-engine) with one
  `MooncakeDistributedStore` client mounting 64 segments (`allocate_and_mount_segment`) and
  the same keys through its metadata-only calls: `batch_put_session_start/_end` (the master's
  BatchPutStart/BatchPutEnd, no transfer), `batch_get_replica_desc` (BatchGetReplicaList) and
  `batch_is_exist` (it has no LongestPrefix: a prefix lookup asks whether each key exists).

Eviction round: one PutStart that takes a segment just past its high watermark runs one round
(about `evict_fraction` = 5 % of the segment freed, from the 1024 least recently used keys a
round looks at, by dropping them, as for a segment whose owner has no LMDB tier); timed
in-process (CPU) and over the fast path less an ordinary PutStart's round trip. Mooncake evicts
in a background thread with no per-round timing it exposes: reported as not measured, with that reason.

Also: how long the master's loop stalls (the longest of the simulated engines' ping round
trips during the run; a full gc, an eviction round or a PoolStats blocks it), the full garbage
collections during the in-process fill, and PoolStats' time on the full pool.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import xxhash

from ports import free_port

CTX = mp.get_context("spawn")
ROOT = Path(__file__).resolve().parent.parent
HIGH_WATERMARK = 0.9  # the master's default (--store-high-watermark), which the process runs with
MODEL = "SmolLM2-135M-Instruct"  # keys look like an engine's: model id / 16 hex digits of a block hash
CLK_TCK = os.sysconf("SC_CLK_TCK")
KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Shape:
    """One scale run's shape, the same for every system measured."""

    objects: int
    segments: int = 64
    batch: int = 64
    object_bytes: int = 4096  # the master only does arithmetic with it; small so Mooncake's client can lend it
    fill: float = 0.75  # segments end the fill this full: below the 0.9 high watermark, nothing evicted
    depth: int = 4  # batches in flight (ours: on one fast-path connection; Mooncake: client threads)
    sample_keys: int = 262_144  # keys looked up in the get and prefix phases (random 64-key chains)
    eviction_rounds: int = 3

    @property
    def batches(self) -> int:
        return -(-self.objects // self.batch)

    @property
    def segment_bytes(self) -> int:
        per_segment = -(-self.objects // self.segments)
        # Mooncake's client lends no segment under 16 MiB
        return max(16 * MiB, -(-int(per_segment * self.object_bytes / self.fill) // 4096) * 4096)

    @property
    def sample_batches(self) -> int:
        return max(1, min(self.batches, self.sample_keys // self.batch))


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def key(i: int) -> str:
    return f"{MODEL}/{xxhash.xxh3_64_intdigest(i.to_bytes(8, 'little')):016x}"


def checksum_of(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15 + 1) & 0xFFFFFFFFFFFFFFFF


def chain(shape: Shape, b: int) -> list[str]:
    """The keys of batch `b`: put together, looked up together (a prompt's chain of blocks)."""
    return [key(i) for i in range(b * shape.batch, min(shape.objects, (b + 1) * shape.batch))]


def sample(shape: Shape, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(shape.batches) for _ in range(shape.sample_batches)]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's libraries mapped (a master needs none of it)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("/torch/lib/" in line for line in f)


def rate(keys: int, batches: int, seconds: float, cpu: float | None = None) -> dict[str, float]:
    out = {"keys_s": round(keys / seconds), "batches_s": round(batches / seconds, 1), "seconds": round(seconds, 2)}
    if cpu is not None:
        out["master_cpu_s"] = round(cpu, 2)
        out["keys_per_master_cpu_s"] = round(keys / cpu) if cpu > 0 else None
    return out


def memory(shape: Shape, start: int, mounted: int, full: int) -> dict[str, Any]:
    """RSS in MiB at the three points, and the bytes per segment and per object they imply."""
    return {"rss_mib": {"start": round(start / KiB, 1), "mounted": round(mounted / KiB, 1),
                        "full": round(full / KiB, 1)},
            "bytes_per_segment": round((mounted - start) * KiB / shape.segments),
            "bytes_per_object": round((full - mounted) * KiB / shape.objects)}


# -- ours, in-process: the state machine alone ---------------------------------------------------------
def _segment_spec(s: int, capacity: int) -> Any:
    from mooncaked.store.records import Endpoint, SegmentSpec

    return SegmentSpec(f"bench-seg-{s}", "dram", capacity,
                       Endpoint(f"127.0.0.1:{20000 + s}", "tcp", f"bench-region-{s}"))


def _fill(m: Any, shape: Shape, lo: int, hi: int) -> tuple[float, int]:
    """PutStart + PutEnd of batches lo..hi as BatchPutStart/BatchPutEnd do; (seconds in the master, no room)."""
    spent, short = 0.0, 0
    for b in range(lo, hi):
        keys = chain(shape, b)
        items = [(k, shape.object_bytes, 0, 0, "", False) for k in keys]
        sums = [checksum_of(b * shape.batch + j) for j in range(len(keys))]
        t = time.thread_time()
        plans = m.put_start_many(items)
        for k, c in zip(keys, sums):
            m.put_end(k, c)
        spent += time.thread_time() - t
        short += plans.count(None)
    return spent, short


def traced_costs(shape: Shape, objects: int = 20_000) -> dict[str, Any]:
    """Exact Python heap bytes per segment and per object (tracemalloc), by where they are allocated."""
    from mooncaked.store.master import StoreMaster
    from mooncaked.store.records import Policy

    small = Shape(objects, shape.segments, shape.batch, shape.object_bytes, shape.fill)
    tracemalloc.start()
    m = StoreMaster(Policy(client_ttl_s=3600.0))
    s0 = tracemalloc.take_snapshot()
    for s in range(shape.segments):
        m.mount(f"bench-client-{s}", _segment_spec(s, small.segment_bytes))
    s1 = tracemalloc.take_snapshot()
    _fill(m, small, 0, small.batches)
    gc.collect()
    s2 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    keep = [tracemalloc.Filter(True, "*/mooncaked/*"), tracemalloc.Filter(True, __file__)]
    per_segment = sum(d.size_diff for d in s1.filter_traces(keep).compare_to(s0.filter_traces(keep), "filename")) \
        / shape.segments
    keep = [tracemalloc.Filter(True, "*/mooncaked/*"), tracemalloc.Filter(True, __file__)]
    s1, s2 = s1.filter_traces(keep), s2.filter_traces(keep)
    sites = s2.compare_to(s1, "lineno")
    total = sum(d.size_diff for d in sites)
    top = [{"where": f"{Path(d.traceback[0].filename).name}:{d.traceback[0].lineno}",
            "bytes_per_object": round(d.size_diff / objects, 1)} for d in sites[:6] if d.size_diff > 0]
    return {"objects": objects, "bytes_per_segment": round(per_segment), "bytes_per_object": round(total / objects),
            "top_sites": top}


class GcPauses:
    """A gc callback: how long (CPU time) each full (generation 2) collection took."""

    def __init__(self) -> None:
        self.full: list[float] = []
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t = time.thread_time()
        else:
            self.full.append(time.thread_time() - self._t)


def _timed(fn: Any) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def _eviction_probe_size(hw: float, capacity: int, used: int, object_bytes: int) -> int:
    """An object that takes a segment just past its high watermark."""
    return -(-(int(hw * capacity) - used + object_bytes) // 64) * 64


def _inprocess(pipe: Connection, shape: Shape) -> None:
    try:
        from mooncaked.store.errors import NotFound
        from mooncaked.store.gc_freeze import MetadataFreeze
        from mooncaked.store.master import StoreMaster
        from mooncaked.store.records import ObjectView, Policy

        out: dict[str, Any] = {"what": "StoreMaster state machine called in-process: only the calls are timed, in "
                                       "CPU time (no wire, no protobuf); RSS of that process"}
        pid = os.getpid()
        m = StoreMaster(Policy(client_ttl_s=3600.0))
        start = rss_kib(pid)
        for s in range(shape.segments):
            m.mount(f"bench-client-{s}", _segment_spec(s, shape.segment_bytes))
        mounted = rss_kib(pid)
        pauses = GcPauses()
        gc.callbacks.append(pauses)
        freeze = MetadataFreeze()  # as the store role's process does
        freeze.install()
        spent, short = _fill(m, shape, 0, shape.batches)
        gc.callbacks.remove(pauses)
        out.update(memory(shape, start, mounted, rss_kib(pid)))
        out["gc_full_collections"] = {"count": len(pauses.full), "max_ms": round(1e3 * max(pauses.full, default=0), 1),
                                      "at_full_ms": round(1e3 * _timed(gc.collect), 1),
                                      "tracked_objects": len(gc.get_objects()) + gc.get_freeze_count(),
                                      "frozen_objects": gc.get_freeze_count(),
                                      "freezes": freeze.freezes}
        freeze.uninstall()
        out["put"] = rate(shape.objects, shape.batches, spent)
        out["put"]["no_room"] = short
        picks = sample(shape, 1)
        spent, found, asked = 0.0, 0, 0
        for b in picks:
            keys = chain(shape, b)
            t = time.thread_time()
            for k in keys:  # what BatchGetReplicas does per key
                try:
                    found += isinstance(m.get_replicas(k), ObjectView)
                except NotFound:
                    pass
            spent += time.thread_time() - t
            asked += len(keys)
        out["get"] = rate(asked, len(picks), spent)
        out["get"]["found"] = found
        spent, found, asked = 0.0, 0, 0
        for b in sample(shape, 2):
            keys = chain(shape, b)
            t = time.thread_time()
            found += m.longest_prefix(keys)
            spent += time.thread_time() - t
            asked += len(keys)
        out["longest_prefix"] = rate(asked, shape.sample_batches, spent)
        out["longest_prefix"]["found"] = found
        rounds, evicted = [], []
        for r in range(shape.eviction_rounds):
            seg = m.segments[f"bench-seg-{r}"]
            size = _eviction_probe_size(m.policy.high_watermark, seg.capacity, seg.used, shape.object_bytes)
            before = m.evictions
            t = time.thread_time()
            m.put_start(f"evict-probe/{r}", size, 0, preferred=seg.name)
            rounds.append(time.thread_time() - t)
            evicted.append(m.evictions - before)
            m.put_revoke(f"evict-probe/{r}")
        out["eviction_round_ms"] = [round(1e3 * x, 2) for x in rounds]
        out["evicted_per_round"] = evicted
        t = time.thread_time()
        m.stats()
        out["pool_stats_ms"] = round(1e3 * (time.thread_time() - t), 1)
        del m
        gc.collect()
        out["traced"] = traced_costs(shape)  # last: its heap, freed, would otherwise be reused by the big run
        pipe.send(out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


# -- ours, a real `mooncaked --role store` process over its fast path ---------------------------------
def start_master(port: int) -> subprocess.Popen:
    """`mooncaked --role store` as an operator starts it (heartbeat timeout raised: a busy 2-core test
    machine must not declare the simulated engines dead mid-run; they ping every second regardless)."""
    proc = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", "--role", "store", "--listen",
                             f"127.0.0.1:{port}", "--log-level", "WARNING", "--heartbeat-timeout-s", "60"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if "gRPC on" not in line:
        proc.kill()
        raise RuntimeError(f"mooncaked --role store did not start: {line!r}")
    return proc


def _process_driver(pipe: Connection, addr: str, pid: int, shape: Shape) -> None:
    import uvloop

    try:
        pipe.send(uvloop.run(_drive(addr, pid, shape)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


async def _drive(addr: str, pid: int, shape: Shape) -> dict[str, Any]:
    from mooncaked.proto.mooncake.v1 import common_pb2, store_pb2, store_pb2_grpc, transfer_pb2
    from mooncaked.rpc import CHANNEL_OPTIONS
    from mooncaked.security import Security
    from mooncaked.store.fast_channel import FastChannel

    out: dict[str, Any] = {"what": "a `mooncaked --role store` process; a driver process plays 64 engines over the "
                                   f"fast path (framed TCP), {shape.depth} batches in flight; RSS and CPU of the "
                                   "master process"}
    channel = Security().channel(addr, options=CHANNEL_OPTIONS)
    try:
        stub = store_pb2_grpc.StoreMasterStub(channel)
        desc = await stub.Describe(store_pb2.DescribeRequest(), timeout=10)
        fast = await FastChannel.connect(addr.rsplit(":", 1)[0], desc.fast_path_port, 5.0)
        for i in range(64):  # warm the connection and the handlers before the first RSS reading
            await fast.call("Exist", store_pb2.ExistRequest(key=f"warm/{i}"), 10)
        clients = [f"bench-client-{s}" for s in range(shape.segments)]
        start = rss_kib(pid)
        out["torch_loaded"] = maps_torch(pid)
        for s, client in enumerate(clients):
            spec = _segment_spec(s, shape.segment_bytes)
            e = spec.endpoint
            seg = transfer_pb2.SegmentInfo(name=spec.name, owner=client, nbytes=spec.capacity, medium="dram",
                                           endpoint=common_pb2.TransferEndpoint(address=e.address, backend=e.backend,
                                                                                region=e.region))
            await fast.call("MountSegment", store_pb2.MountSegmentRequest(client_id=client, segment=seg), 10)
        tasks = TaskStreams(stub, clients)  # what each engine reads from the master (tier moves, its journal)
        mounted = rss_kib(pid)
        lost: list[str] = []
        latency: list[float] = []
        pinger = asyncio.create_task(_ping(fast, clients, lost, latency))
        try:
            out.update(await _phases(fast, pid, shape, start, mounted, clients, tasks))
            out["tasks_stream"] = await tasks.settle()
        finally:
            pinger.cancel()
            tasks.close()
        out["clients_lost"] = lost
        latency.sort()
        out["ping_ms"] = {"count": len(latency), "p50": round(1e3 * latency[len(latency) // 2], 2),
                          "p99": round(1e3 * latency[int(len(latency) * 0.99)], 2),
                          "max": round(1e3 * latency[-1], 1)} if latency else None
        fast.close()
    finally:
        await channel.close()
    return out


class TaskStreams:
    """Each simulated engine's `Tasks` stream, read as a StoreClient reads it: tier tasks and the
    journal of what was committed to its DRAM (a client that never read it would leave the
    master holding every entry for it)."""

    def __init__(self, stub: Any, clients: list[str]) -> None:
        self.messages = self.entries = 0
        self.errors: list[str] = []
        self._tasks = [asyncio.create_task(self._read(stub, c)) for c in clients]

    async def _read(self, stub: Any, client: str) -> None:
        from mooncaked.proto.mooncake.v1 import store_pb2

        try:
            async for task in stub.Tasks(store_pb2.TasksRequest(client_id=client), timeout=3600):
                self.messages += 1
                self.entries += len(task.journal)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the result
            self.errors.append(f"{client}: {type(e).__name__}: {e}")

    async def settle(self, quiet_s: float = 1.0, limit_s: float = 180.0) -> dict[str, Any]:
        """Wait until nothing has arrived for `quiet_s` (the master has sent all it had queued), at
        most `limit_s`; what had arrived before the wait, and how long the rest took."""
        before, t0 = self.entries, time.monotonic()
        last, last_change = self.messages, t0
        while not self.errors and time.monotonic() - last_change < quiet_s and time.monotonic() - t0 < limit_s:
            await asyncio.sleep(0.05)
            if self.messages != last:
                last, last_change = self.messages, time.monotonic()
        return {"journal_entries_before": before, "journal_entries": self.entries, "messages": self.messages,
                "caught_up_s": round(last_change - t0, 2), "errors": self.errors[:3]}

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()


async def _ping(fast: Any, clients: list[str], lost: list[str], latency: list[float]) -> None:
    """Every simulated engine pings each second, as a StoreClient does; each ping's round trip is kept
    (the longest says how long the master's loop stalled: a full gc, an eviction round, PoolStats)."""
    from mooncaked.proto.mooncake.v1 import store_pb2

    while True:
        await asyncio.sleep(1.0)
        for client in clients:
            t = time.perf_counter()
            reply = await fast.call("Ping", store_pb2.PingRequest(client_id=client), 10)
            latency.append(time.perf_counter() - t)
            if not reply.known:
                lost.append(client)


async def _pipelined(shape: Shape, batches: list[int], one: Any) -> None:
    """Run `one(b)` for every batch, `shape.depth` at a time."""
    it = iter(batches)

    async def worker() -> None:
        for b in it:
            await one(b)

    await asyncio.gather(*(worker() for _ in range(shape.depth)))


async def _phases(fast: Any, pid: int, shape: Shape, start: int, mounted: int, clients: list[str],
                  tasks: TaskStreams) -> dict[str, Any]:
    from mooncaked.proto.mooncake.v1 import store_pb2

    out: dict[str, Any] = {}
    short = 0

    async def put(b: int) -> None:
        nonlocal short
        keys = chain(shape, b)
        reply = await fast.call("BatchPutStart", store_pb2.BatchPutStartRequest(
            items=[store_pb2.PutStartRequest(key=k, size=shape.object_bytes) for k in keys]), 30)
        short += sum(1 for it in reply.items if not it.replicas and not it.exists)
        await fast.call("BatchPutEnd", store_pb2.BatchPutEndRequest(
            keys=keys, checksums=[checksum_of(b * shape.batch + j) for j in range(len(keys))]), 30)

    cpu, t = cpu_s(pid), time.perf_counter()
    await _pipelined(shape, list(range(shape.batches)), put)
    out["put"] = rate(shape.objects, shape.batches, time.perf_counter() - t, cpu_s(pid) - cpu)
    out["put"]["no_room"] = short
    out.update(memory(shape, start, mounted, rss_kib(pid)))
    # the engines' journal may lag the puts: let it catch up first, so the next rows measure lookups alone
    out["journal_after_put"] = await tasks.settle()
    out["rss_mib"]["journal_drained"] = round(rss_kib(pid) / KiB, 1)
    found = 0

    async def get(b: int) -> None:
        nonlocal found
        reply = await fast.call("BatchGetReplicas", store_pb2.BatchGetReplicasRequest(
            keys=chain(shape, b), client_id=clients[b % len(clients)]), 30)
        found += len(reply.objects)

    picks = sample(shape, 1)
    cpu, t = cpu_s(pid), time.perf_counter()
    await _pipelined(shape, picks, get)
    asked = sum(len(chain(shape, b)) for b in picks)
    out["get"] = rate(asked, len(picks), time.perf_counter() - t, cpu_s(pid) - cpu)
    out["get"]["found"] = found
    found = 0

    async def prefix(b: int) -> None:
        nonlocal found
        reply = await fast.call("LongestPrefix", store_pb2.LongestPrefixRequest(keys=chain(shape, b)), 30)
        found += reply.num_keys

    picks = sample(shape, 2)
    cpu, t = cpu_s(pid), time.perf_counter()
    await _pipelined(shape, picks, prefix)
    asked = sum(len(chain(shape, b)) for b in picks)
    out["longest_prefix"] = rate(asked, len(picks), time.perf_counter() - t, cpu_s(pid) - cpu)
    out["longest_prefix"]["found"] = found
    out.update(await _evictions(fast, shape))
    out["rss_mib"]["end"] = round(rss_kib(pid) / KiB, 1)
    return out


async def _evictions(fast: Any, shape: Shape) -> dict[str, Any]:
    """Each round: a PutStart that takes one segment past its watermark, less an ordinary PutStart's time."""
    from mooncaked.proto.mooncake.v1 import store_pb2

    async def put_start(k: str, size: int, segment: str) -> float:
        t = time.perf_counter()
        await fast.call("BatchPutStart", store_pb2.BatchPutStartRequest(
            items=[store_pb2.PutStartRequest(key=k, size=size, preferred_segment=segment)]), 30)
        spent = time.perf_counter() - t
        await fast.call("PutRevoke", store_pb2.PutRevokeRequest(key=k), 30)
        return spent

    t = time.perf_counter()
    stats = await fast.call("PoolStats", store_pb2.PoolStatsRequest(), 30)
    stats_ms = 1e3 * (time.perf_counter() - t)
    rounds, evicted, plain = [], [], []
    for r in range(shape.eviction_rounds):
        name = f"bench-seg-{r}"
        for i in range(5):
            plain.append(await put_start(f"plain-probe/{r}/{i}", shape.object_bytes, name))
        seg = next(s for s in stats.segments if s.name == name)
        size = _eviction_probe_size(HIGH_WATERMARK, seg.capacity, seg.used, shape.object_bytes)
        before = stats.evictions
        rounds.append(await put_start(f"evict-probe/{r}", size, name))
        stats = await fast.call("PoolStats", store_pb2.PoolStatsRequest(), 30)
        evicted.append(stats.evictions - before)
    base = statistics.median(plain)
    return {"eviction_round_ms": [round(1e3 * (x - base), 2) for x in rounds], "evicted_per_round": evicted,
            "plain_put_start_ms": round(1e3 * base, 3), "pool_stats_ms": round(stats_ms, 1)}


# -- Mooncake: mooncake_master with the same objects ------------------------------------------------
def _mc_driver(pipe: Connection, meta: str, master: str, pid: int, shape: Shape) -> None:
    try:
        with open(os.devnull, "w") as null:  # its client logs every mount on stderr (glog, before any flag)
            os.dup2(null.fileno(), 2)
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        start = rss_kib(pid)
        rc = store.setup("127.0.0.1", meta, shape.segment_bytes, 16 * MiB, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        for _ in range(shape.segments - 1):
            r = store.allocate_and_mount_segment(shape.segment_bytes)
            if r.get("ret") != 0:
                raise RuntimeError(f"allocate_and_mount_segment returned {r}")
        mounted = rss_kib(pid)
        out: dict[str, Any] = {"what": "mooncake_master process; one MooncakeDistributedStore client mounting "
                                       f"{shape.segments} segments, {shape.depth} client threads, metadata-only "
                                       "calls; RSS and CPU of the master process"}
        failed = [0]
        lock = threading.Lock()

        def put(b: int) -> None:
            keys = chain(shape, b)
            bad = sum(x != 0 for x in store.batch_put_session_start(keys, [shape.object_bytes] * len(keys)))
            bad += sum(x != 0 for x in store.batch_put_session_end(keys))
            with lock:
                failed[0] += bad

        cpu, t = cpu_s(pid), time.perf_counter()
        _threaded(shape, list(range(shape.batches)), put)
        out["put"] = rate(shape.objects, shape.batches, time.perf_counter() - t, cpu_s(pid) - cpu)
        out["put"]["failed"] = failed[0]
        out.update(memory(shape, start, mounted, rss_kib(pid)))
        found = [0]

        def get(b: int) -> None:
            n = sum(1 for v in store.batch_get_replica_desc(chain(shape, b)).values() if v)
            with lock:
                found[0] += n

        picks = sample(shape, 1)
        cpu, t = cpu_s(pid), time.perf_counter()
        _threaded(shape, picks, get)
        out["get"] = rate(sum(len(chain(shape, b)) for b in picks), len(picks), time.perf_counter() - t,
                          cpu_s(pid) - cpu)
        out["get"]["found"] = found[0]
        out["get"]["call"] = "batch_get_replica_desc"
        found[0] = 0

        def prefix(b: int) -> None:
            exists = store.batch_is_exist(chain(shape, b))
            n = 0
            while n < len(exists) and exists[n] == 1:
                n += 1
            with lock:
                found[0] += n

        picks = sample(shape, 2)
        cpu, t = cpu_s(pid), time.perf_counter()
        _threaded(shape, picks, prefix)
        out["longest_prefix"] = rate(sum(len(chain(shape, b)) for b in picks), len(picks), time.perf_counter() - t,
                                     cpu_s(pid) - cpu)
        out["longest_prefix"]["found"] = found[0]
        out["longest_prefix"]["call"] = "batch_is_exist (no LongestPrefix in Mooncake)"
        out["eviction_round_ms"] = None
        out["eviction_note"] = ("not measured: mooncake_master evicts in a background thread and exposes no "
                                "per-round timing")
        out["rss_mib"]["end"] = round(rss_kib(pid) / KiB, 1)
        store.close()
        pipe.send(out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


def _threaded(shape: Shape, batches: list[int], one: Any) -> None:
    """Run `one(b)` for every batch on `shape.depth` threads (the binding's calls block)."""
    it = iter(batches)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                with lock:
                    b = next(it, None)
                if b is None:
                    return
                one(b)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(shape.depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


# -- the run ----------------------------------------------------------------------------------------
def run(shape: Shape, mooncake_master: str | None, mooncake_why: str | None) -> dict[str, Any]:
    """Every measurement, one after the other (never two at once: they would share the 2 cores).
    `mooncake_master`: the binary's path; `mooncake_why`: why the baseline cannot run (None: it can)."""

    def child(target: Any, *args: Any, timeout_s: float = 900) -> dict[str, Any]:
        pipe, end = CTX.Pipe()
        proc = CTX.Process(target=target, args=(end, *args), daemon=True)
        proc.start()
        result = pipe.recv() if pipe.poll(timeout_s) else f"timed out after {timeout_s}s"
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        if isinstance(result, str):
            raise RuntimeError(result)
        return result

    out: dict[str, Any] = {"mode": "scale", "shape": asdict(shape) | {"segment_bytes": shape.segment_bytes},
                           "key_bytes": len(key(0))}
    port = free_port()
    master = start_master(port)
    try:
        out["ours_process"] = child(_process_driver, f"127.0.0.1:{port}", master.pid, shape)
    finally:
        master.terminate()
        master.wait(10)
    out["ours_inprocess"] = child(_inprocess, shape)
    if mooncake_why is not None or not mooncake_master:
        out["mooncake"] = {"skipped": mooncake_why or "mooncake_master not found"}
    else:
        rpc, http, metrics = free_port(), free_port(), free_port()
        with open(os.devnull, "w") as log:
            mc = subprocess.Popen([mooncake_master, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                   f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                                   f"--metrics_port={metrics}"], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 20
            while not listening(rpc) or not listening(http):
                if mc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not start (exit {mc.poll()})")
                time.sleep(0.1)
            out["mooncake"] = child(_mc_driver, f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}", mc.pid,
                                    shape)
        except Exception as e:  # noqa: BLE001 - the baseline failing must not hide our figures
            out["mooncake"] = {"skipped": f"{type(e).__name__}: {e}"}
        finally:
            mc.terminate()
            mc.wait(10)
    out["ratios"] = ratios(out)
    return out


def ratios(out: dict[str, Any]) -> dict[str, Any] | None:
    """Ours (the process) / Mooncake: >1 means ours is faster, or (bytes) ours takes more."""
    mc, ours = out.get("mooncake") or {}, out["ours_process"]
    if "skipped" in mc:
        return None
    r: dict[str, Any] = {row: round(ours[row]["keys_s"] / mc[row]["keys_s"], 2)
                         for row in ("put", "get", "longest_prefix")}
    cpu = {row: (ours[row].get("keys_per_master_cpu_s"), mc[row].get("keys_per_master_cpu_s"))
           for row in ("put", "get", "longest_prefix")}
    r["per_master_cpu_s"] = {row: round(a / b, 2) if a and b else None for row, (a, b) in cpu.items()}
    r["bytes_per_object"] = round(ours["bytes_per_object"] / mc["bytes_per_object"], 2) \
        if mc["bytes_per_object"] > 0 else None
    r["rss_full"] = round(ours["rss_mib"]["full"] / mc["rss_mib"]["full"], 2)
    return r


def print_table(out: dict[str, Any]) -> None:
    s = out["shape"]
    print(f"{s['objects']:,} objects on {s['segments']} segments, batches of {s['batch']} keys "
          f"({out['key_bytes']}-byte keys), {s['depth']} batches in flight; keys/s (batches/s)")
    systems = [("ours_process", "ours (process)"), ("ours_inprocess", "ours (in-process)"),
               ("mooncake", "mooncake_master")]
    print(f"{'system':<18} {'put':>17} {'get':>17} {'prefix':>17} {'RSS MiB start-full':>19} {'B/object':>9} "
          f"{'B/segment':>10} {'evict ms':>9}")
    for name, label in systems:
        r = out.get(name) or {}
        if "skipped" in r:
            print(f"{label:<18} skipped: {r['skipped']}")
            continue
        cells = [f"{r[row]['keys_s']:>9,} ({r[row]['batches_s']:>6,.0f})" for row in ("put", "get", "longest_prefix")]
        ev = r.get("eviction_round_ms")
        evict = f"{statistics.median(ev):.1f}" if ev else "-"
        rss = f"{r['rss_mib']['start']:,.0f} - {r['rss_mib']['full']:,.0f}"
        print(f"{label:<18} {' '.join(cells)} {rss:>19} {r['bytes_per_object']:>9,} "
              f"{r['bytes_per_segment']:>10,} {evict:>9}")
    rt = out.get("ratios")
    if rt:
        print(f"ours (process) / Mooncake: put {rt['put']}x, get {rt['get']}x, prefix {rt['longest_prefix']}x, "
              f"bytes per object {rt['bytes_per_object']}x, RSS {rt['rss_full']}x")
        c = rt["per_master_cpu_s"]
        print(f"  keys per master CPU second, ours / Mooncake: put {c['put']}x, get {c['get']}x, "
              f"prefix {c['longest_prefix']}x (the master's own cost, whatever else runs on the machine)")
    p = out["ours_process"]
    g = out["ours_inprocess"]["gc_full_collections"]
    if p.get("ping_ms"):
        ping = p["ping_ms"]
        print(f"ours (process): ping round trip under load p50 {ping['p50']} ms, p99 {ping['p99']} ms, "
              f"max {ping['max']} ms; in-process full gc during the fill: {g['count']}, longest "
              f"{g['max_ms']} ms, one at full {g['at_full_ms']} ms ({g['tracked_objects']:,} tracked objects, "
              f"{g.get('frozen_objects', 0):,} of them frozen after {g.get('freezes', 0)} slow passes: gc_freeze.py)")
    j = p.get("journal_after_put")
    if j:
        print(f"ours (process): engines' Tasks streams (journal): {j['journal_entries_before']:,} entries had arrived "
              f"when the puts ended, {j['journal_entries']:,} after {j['caught_up_s']} s more; RSS full "
              f"{p['rss_mib']['full']:,} MiB, {p['rss_mib']['journal_drained']:,} MiB once sent")
    print(f"ours (process): PoolStats at full {p['pool_stats_ms']} ms; master CPU s put/get/prefix: "
          f"{p['put']['master_cpu_s']}/{p['get']['master_cpu_s']}/{p['longest_prefix']['master_cpu_s']}; "
          f"torch loaded in the master: {p['torch_loaded']}")
    mc = out.get("mooncake") or {}
    if "put" in mc:
        print(f"mooncake_master CPU s put/get/prefix: {mc['put']['master_cpu_s']}/{mc['get']['master_cpu_s']}/"
              f"{mc['longest_prefix']['master_cpu_s']}; eviction: {mc['eviction_note']}")
    t = out["ours_inprocess"]["traced"]
    print(f"ours, traced Python heap ({t['objects']:,} objects): {t['bytes_per_object']} B/object, "
          f"{t['bytes_per_segment']} B/segment; top: "
          + ", ".join(f"{x['where']} {x['bytes_per_object']}" for x in t["top_sites"]))
