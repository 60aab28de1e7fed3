"""Benchmark the KV pool: put and get of 512 KiB objects through the master and the data plane,
between two processes, against Mooncake's own store measured in the same run.

Layout, for both systems: a master process; an owner process that lends the memory (our
StoreClient with a DRAM segment / a MooncakeDistributedStore with a global segment); and a
driver process, which lends nothing, that puts N objects and gets them back, so every byte
crosses processes. Rows: sequential single-object put and get (MB/s, p50, p99 latency),
batched put and get (MB/s), and ours only: sequential single puts with their commit behind
(`commit_behind`: put() returns once its bytes landed and its commit is sent, so the commit
overlaps the next put's transfer; ratio against Mooncake's single put), and over TCP sequential single gets
that poll for the owner's answer before sleeping (`get_spin`: owner_read_spin_us=SPIN_US, on a client that
learned each object's owner in one untimed pass; ratio against Mooncake's single get). Our gets ask the owner by
key when the driver knows it from its puts (owner_server.py): the share it served is printed. Mooncake uses TCP on loopback; our rows: TCP, shared memory
(backend auto, what two engines on one host use), and TCP with the metadata calls over gRPC
instead of the master's fast path (what the fast path buys). Floors, measured in the same run: a raw
TCP request/response of one object between two processes (blocking sockets, no framing) and one
memcpy of it: what the transports alone cost; and a bare 64-byte round trip between the same two
processes, against the round trips each system's single op waits for (ROUND_TRIPS): where a round
trip costs as much as the bytes, a ratio tends to their count.

The baseline is `mooncake-transfer-engine`'s `MooncakeDistributedStore` with its
`mooncake_master` (`pip install mooncake-transfer-engine-non-cuda` on a host without CUDA:
the default wheel needs libcuda.so.1; Debian's libibverbs1 must be installed). When it
cannot run, the output says "baseline unavailable: <reason>" and still gives our figures.

Usage: python tools/bench_store.py [--quick] [--json] [--objects N] [--object-kib K] [--batch B] [--token]
[--only ours,ours_shm,ours_grpc,ours_io,mooncake] [--phases]
--only ...,ours_io: also the driver on a transfer engine with its I/O process, as an engine's own client
runs (shares of 16 MiB or more a peer go through it: here none, so it shows what the engines' default costs
the pool's traffic).
--token: our master and clients share a cluster secret (gRPC metadata; the fast path's and the
transfer ports' handshake, once per connection).

--scale: the master at scale instead (tools/bench_store_scale.py): 1,000,000 objects (--quick:
100,000; --objects N) on 64 segments (--segments), batches of 64 keys (--batch), --depth batches in
flight: master RSS, metadata bytes per object and per segment, BatchPutStart+BatchPutEnd,
BatchGetReplicas and LongestPrefix keys/s, one eviction round's time; ours as a real process
over the fast path and as the state machine in-process, and mooncake_master with the same objects.
Processes are spawned, never forked.

--phases: where one put and one get spend their time over TCP, each phase timed alone in the same
layout (tools/bench_store_phases.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ports import free_port

CTX = mp.get_context("spawn")
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent

WARM_BATCHES = 2
SPIN_US = 200  # the get_spin row's owner_read_spin_us: about two bare round trips on the developers' host
"""Batch gets made, untimed, before the timed pass, by both systems: the first batches' results (a batch of
new bytes objects while the previous batch's are still held) grow the heap, and on a VM a page touched for
the first time can cost ~35 us (measured: the first two of 32 batches took 74-84 ms for 2048 pages each, the others ~2 ms). That
is the allocator meeting the machine, once per process, not the store (store/heap.py keeps those pages after)."""

ROUND_TRIP_BYTES = 64
# The round trips one single put or get waits for, one after the other. Mooncake Store: PutStart, the write,
# PutEnd; GetReplicaList, the read (its design doc, doc/en/mooncake-store-preview.md). Ours: the write and the
# commit (the place is reserved ahead), a read by key from the owner; over shared memory the write and the read
# are copies (the get's from the owner's index), so only the put's commit is a round trip. Where a round trip
# costs more than the bytes (a VM whose processes wake each other slowly: docs/performance.md), a ratio tends
# to Mooncake's count over ours.
ROUND_TRIPS = {"mooncake": {"put": 3, "get": 2}, "ours": {"put": 2, "get": 1}, "ours_shm": {"put": 1, "get": 0}}


def payloads(n: int, size: int) -> list[bytes]:
    base = os.urandom(size)
    return [i.to_bytes(8, "little") + base[8:] for i in range(n)]  # distinct, cheap to make


def summarize(lat_s: list[float], nbytes: int, tail_s: float = 0.0) -> dict[str, float]:
    """MB/s over the ops' time plus `tail_s` (what was left to wait for after the last op returned)."""
    lat = sorted(lat_s)
    total = sum(lat) + tail_s
    return {
        "mb_s": round(nbytes * len(lat) / total / MiB, 1),
        "p50_ms": round(1e3 * lat[len(lat) // 2], 3),
        "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
    }


def throughput(seconds: float, nbytes: int) -> dict[str, float]:
    return {"mb_s": round(nbytes / seconds / MiB, 1)}


# -- ours -------------------------------------------------------------------------------------------
_MASTER = ("import asyncio, sys\n"
           "from mooncaked.config import StoreConfig\n"
           "from mooncaked.roles.store_role import run_store_role\n"
           "import uvloop; sys.exit(uvloop.run(run_store_role(StoreConfig(listen=sys.argv[1], log_level='WARNING',\n"
           "    cluster_token_file=sys.argv[2] or None))))\n")


def _security(token_file: str) -> Any:
    from mooncaked.security import Security

    return Security.load(cluster_token_file=token_file or None)


def _our_owner(pipe: Connection, master: str, dram_bytes: int, backend: str, token_file: str) -> None:
    import uvloop

    from mooncaked.store import StoreClient, StoreClientConfig

    async def main() -> None:
        client = StoreClient(StoreClientConfig(master=master, client_id="bench-owner", dram_bytes=dram_bytes,
                                               transfer_backend=backend), security=_security(token_file))
        await client.start()
        pipe.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
        await client.close()

    uvloop.run(main())


def _our_driver(pipe: Connection, master: str, n: int, size: int, batch: int, backend: str, fast_path: bool,
                token_file: str) -> None:
    import uvloop

    from mooncaked.store import StoreClient, StoreClientConfig
    from mooncaked.store.metrics import OWNER_GETS

    from mooncaked.transfer import TransferEngine

    transfers: list[TransferEngine] = []

    async def open_client(**settings: Any) -> StoreClient:
        """A driver's client; with backend tcp_io, on a transfer engine with its I/O process, as an engine's
        client runs (its engine's transfer engine, --transfer-io-process on by default)."""
        security = _security(token_file)
        transfer = None
        if backend == "tcp_io":
            transfer = TransferEngine(backend="tcp", host="127.0.0.1", token=security.token, io_process=True)
            await transfer.start()
            transfers.append(transfer)
        client = StoreClient(StoreClientConfig(master=master, transfer_backend="tcp" if transfer else backend,
                                               fast_path=fast_path, **settings), transfer, security=security)
        await client.start()
        return client

    async def main() -> dict[str, Any]:
        client = await open_client(client_id="bench-driver", staging_bytes=max(64 * MiB, 2 * batch * size))
        data = payloads(n, size)
        keys = [f"bench/{i}" for i in range(n)]
        for i in range(4):  # warm up connections
            await client.put(f"warm/{i}", data[i])
            await client.get(f"warm/{i}")

        def served(outcome: str) -> float:
            return OWNER_GETS.labels(outcome)._value.get()

        async def timed_gets(reader: StoreClient) -> tuple[list[float], float]:
            """Each single get's seconds, and the share the owner served by key."""
            hits, lat = served("hit"), []
            for k, d in zip(keys, data):
                t = time.perf_counter()
                got = await reader.get(k)
                lat.append(time.perf_counter() - t)
                assert got == d, f"get {k} returned wrong bytes"
            return lat, round((served("hit") - hits) / n, 3)

        index_hits = served("index")  # after the warm-up: the shares are of the timed gets
        put_lat = []
        for k, d in zip(keys, data):
            t = time.perf_counter()
            ok = await client.put(k, d)
            put_lat.append(time.perf_counter() - t)
            assert ok, f"put {k} found no room"
        get_lat, owner_share = await timed_gets(client)
        index_share = round((served("index") - index_hits) / n, 3)
        spin_lat, spin_share = [], 0.0
        if backend == "tcp":  # single gets polling for the owner's answer before sleeping (owner_read_spin_us)
            spinner = await open_client(client_id="bench-driver-spin", owner_read_spin_us=SPIN_US)
            for k in keys:  # untimed: it learns each object's owner (the driver's client knew them from its puts)
                await spinner.get(k)
            spin_lat, spin_share = await timed_gets(spinner)
            await spinner.close()
        await client.remove(keys)
        bkeys = [f"batch/{i}" for i in range(n)]
        t = time.perf_counter()
        for s in range(0, n, batch):
            ok = await client.batch_put(list(zip(bkeys[s:s + batch], data[s:s + batch])))
            assert all(ok), f"batch put found no room for {ok.count(False)} objects"
        bput = time.perf_counter() - t
        for s in range(0, WARM_BATCHES * batch, batch):  # untimed, as Mooncake's: see WARM_BATCHES
            await client.batch_get(bkeys[s:s + batch])
        t = time.perf_counter()
        for s in range(0, n, batch):
            got = await client.batch_get(bkeys[s:s + batch])
            assert got == data[s:s + batch], "batch get returned wrong bytes or missed"
        bget = time.perf_counter() - t
        await client.remove(bkeys)
        await client.close()
        # single puts whose commit overlaps the next put's transfer (commit_behind): a client of its own
        behind = await open_client(client_id="bench-driver-cb", commit_behind=True)
        for i in range(4):
            await behind.put(f"warm-cb/{i}", data[i])
        behind_lat = []
        ckeys = [f"behind/{i}" for i in range(n)]
        for k, d in zip(ckeys, data):
            t = time.perf_counter()
            ok = await behind.put(k, d)
            behind_lat.append(time.perf_counter() - t)
            assert ok, f"put {k} found no room"
        t = time.perf_counter()
        assert await behind.flush() == [], "commits behind failed"
        behind_tail = time.perf_counter() - t  # counted: the last puts' bytes and commits still in flight
        await behind.remove(ckeys)
        await behind.close()
        for transfer in transfers:
            await transfer.close()
        return {"put": summarize(put_lat, size), "get": summarize(get_lat, size),
                "batch_put": throughput(bput, n * size), "batch_get": throughput(bget, n * size),
                "put_commit_behind": summarize(behind_lat, size, behind_tail), "get_share_by_owner": owner_share,
                "get_share_by_index": index_share,
                **({"get_spin": summarize(spin_lat, size), "get_spin_share_by_owner": spin_share} if spin_lat else {})}

    try:
        pipe.send(uvloop.run(main()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


def bench_ours(n: int, size: int, batch: int, backend: str = "tcp", fast_path: bool = True,
               token_file: str = "") -> dict[str, Any]:
    # room for both phases: the first phase's removed objects stay reserved until their read leases end
    return run_our_layout(_our_driver, (n, size, batch, backend, fast_path, token_file), backend,
                          int(n * size * 3.4) + 64 * MiB, token_file)


def run_our_layout(driver_main: Any, args: tuple, backend: str, dram_bytes: int, token_file: str = "") -> Any:
    """Our master and an owner lending `dram_bytes`, then `driver_main(pipe, master_address, *args)` in a
    process of its own; what it sent back (a string is its error, raised here)."""
    port = free_port()
    master = subprocess.Popen([sys.executable, "-c", _MASTER, f"127.0.0.1:{port}", token_file], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        line = master.stdout.readline()
        if "gRPC on" not in line:
            raise RuntimeError(f"store master did not start: {line!r}")
        addr = f"127.0.0.1:{port}"
        owner_pipe, child = CTX.Pipe()
        owner_backend = "tcp" if backend == "tcp_io" else backend  # the owner only serves: no I/O process to use
        owner = CTX.Process(target=_our_owner, args=(child, addr, dram_bytes, owner_backend, token_file), daemon=True)
        owner.start()
        if not owner_pipe.poll(60) or owner_pipe.recv() != "ready":
            raise RuntimeError("our owner process did not start")
        driver_pipe, child = CTX.Pipe()
        driver = CTX.Process(target=driver_main, args=(child, addr, *args), daemon=True)
        driver.start()
        if not driver_pipe.poll(300):
            raise RuntimeError("our driver did not finish")
        result = driver_pipe.recv()
        driver.join(10)
        owner_pipe.send("stop")
        owner.join(10)
        if isinstance(result, str):
            raise RuntimeError(result)
        return result
    finally:
        master.terminate()
        master.wait(10)


# -- Mooncake ---------------------------------------------------------------------------------------
def _mc_setup(store: Any, meta: str, master: str, segment: int, buffer: int) -> None:
    rc = store.setup("127.0.0.1", meta, segment, buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")


def _mc_owner(pipe: Connection, meta: str, master: str, segment: int) -> None:
    try:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        _mc_setup(store, meta, master, segment, 16 * MiB)
        pipe.send("ready")
        pipe.recv()
        store.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


def _mc_driver(pipe: Connection, meta: str, master: str, n: int, size: int, batch: int) -> None:
    try:
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        _mc_setup(store, meta, master, 0, max(256 * MiB, 4 * batch * size))
        data = payloads(n, size)
        keys = [f"bench/{i}" for i in range(n)]
        for i in range(4):
            store.put(f"warm/{i}", data[i])
            store.get(f"warm/{i}")
        put_lat, get_lat = [], []
        for k, d in zip(keys, data):
            t = time.perf_counter()
            rc = store.put(k, d)
            put_lat.append(time.perf_counter() - t)
            assert rc == 0, f"mooncake put {k} returned {rc}"
        for k, d in zip(keys, data):
            t = time.perf_counter()
            got = store.get(k)
            get_lat.append(time.perf_counter() - t)
            assert got == d, f"mooncake get {k} returned wrong bytes"
        for k in keys:
            store.remove(k)  # as ours does; a leased object stays until its lease ends (same as ours)
        bkeys = [f"batch/{i}" for i in range(n)]
        t = time.perf_counter()
        for s in range(0, n, batch):
            rc = store.put_batch(bkeys[s:s + batch], data[s:s + batch])
            assert rc == 0, f"mooncake put_batch returned {rc}"
        bput = time.perf_counter() - t
        for s in range(0, WARM_BATCHES * batch, batch):  # untimed, as ours: see WARM_BATCHES
            store.get_batch(bkeys[s:s + batch])
        t = time.perf_counter()
        for s in range(0, n, batch):
            got = list(store.get_batch(bkeys[s:s + batch]))
            bad = sum(g != d for g, d in zip(got, data[s:s + batch]))
            assert not bad, f"mooncake get_batch returned wrong bytes or missed for {bad} of {len(got)} objects"
        bget = time.perf_counter() - t
        store.close()
        pipe.send({"put": summarize(put_lat, size), "get": summarize(get_lat, size),
                   "batch_put": throughput(bput, n * size), "batch_get": throughput(bget, n * size)})
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        pipe.send(f"{type(e).__name__}: {e}")


def mooncake_unavailable() -> str | None:
    """Why the baseline cannot run here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        return f"cannot import mooncake.store ({type(e).__name__}: {e}); pip install mooncake-transfer-engine " \
               "(mooncake-transfer-engine-non-cuda without CUDA) and apt-get install libibverbs1"
    if not _mooncake_master():
        return "mooncake_master is not on PATH nor next to this Python"
    return None


def _mooncake_master() -> str | None:
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def bench_mooncake(n: int, size: int, batch: int) -> dict[str, Any]:
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(os.devnull, "w")
    master = subprocess.Popen([_mooncake_master(), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                               f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                               f"--metrics_port={metrics}"], stdout=log, stderr=log)
    try:
        meta, addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        deadline = time.monotonic() + 20
        while not _listening(rpc) or not _listening(http):
            if master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start (exit {master.poll()})")
            time.sleep(0.1)
        owner_pipe, child = CTX.Pipe()
        owner = CTX.Process(target=_mc_owner, args=(child, meta, addr, int(n * size * 2.4) + 64 * MiB),
                            daemon=True)
        owner.start()
        ready = owner_pipe.recv() if owner_pipe.poll(60) else "timeout"
        if ready != "ready":
            raise RuntimeError(f"mooncake owner: {ready}")
        driver_pipe, child = CTX.Pipe()
        driver = CTX.Process(target=_mc_driver, args=(child, meta, addr, n, size, batch), daemon=True)
        driver.start()
        result = driver_pipe.recv() if driver_pipe.poll(300) else "driver timed out"
        driver.join(10)
        owner_pipe.send("stop")
        owner.join(10)
        if owner.is_alive():
            owner.kill()
        if isinstance(result, str):
            raise RuntimeError(result)
        return result
    finally:
        master.terminate()
        master.wait(10)
        log.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- floors: what the transports alone cost per object, measured in the same run --------------------
def _raw_server(pipe: Connection, size: int) -> None:
    """Answers each 16-byte request with `size` bytes (or 64 bytes, for a request of b"s"), with blocking
    sends (no event loop, no Python framing): the floor for moving one object between processes over
    loopback TCP, and for a bare round trip."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        pipe.send(srv.getsockname()[1])
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body, small = os.urandom(size), os.urandom(ROUND_TRIP_BYTES)
        while True:
            asked = conn.recv(16)
            if not asked:
                break
            conn.sendall(small if asked[:1] == b"s" else body)


def _timed_asks(c: socket.socket, request: bytes, answer: memoryview, count: int) -> list[float]:
    """Seconds each of `count` requests took to be answered in full (the answer lands in `answer`)."""
    out = []
    for _ in range(count):
        t = time.perf_counter()
        c.sendall(request)
        got = 0
        while got < len(answer):
            got += c.recv_into(answer[got:])
        out.append(time.perf_counter() - t)
    return out


def floors(n: int, size: int) -> dict[str, float]:
    """p50 ms per object: a raw TCP request/response of `size` bytes between two processes, one memcpy of
    `size` bytes (the data part of a shared-memory put or get); and a bare round trip of ROUND_TRIP_BYTES
    between the same two processes (what each of an op's round trips costs at least)."""
    pipe, child = CTX.Pipe()
    server = CTX.Process(target=_raw_server, args=(child, size), daemon=True)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", pipe.recv()), timeout=10) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            buf = memoryview(bytearray(size))
            lat = _timed_asks(c, b"r" * 16, buf[:size], n + 16)
            trips = _timed_asks(c, b"s" * 16, buf[:ROUND_TRIP_BYTES], 4 * n + 16)
    finally:
        server.join(5)
    src = payloads(n, size)
    dst = bytearray(size)
    copies = []
    for d in src:
        t = time.perf_counter()
        dst[:] = d
        copies.append(time.perf_counter() - t)
    return {"tcp_request_response_p50_ms": summarize(lat[16:], size)["p50_ms"],
            "memcpy_p50_ms": summarize(copies, size)["p50_ms"],
            "round_trip_p50_ms": summarize(trips[16:], ROUND_TRIP_BYTES)["p50_ms"]}


# -- main ---------------------------------------------------------------------------------------------
def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row, the run with the highest MB/s (reps absorb noise from the shared machine); plain
    figures (the share of gets an owner served) as in that best get."""
    out = {row: max((r[row] for r in runs), key=lambda x: x["mb_s"]) for row in runs[0] if isinstance(runs[0][row], dict)}
    shares = (("get_share_by_owner", "get"), ("get_share_by_index", "get"), ("get_spin_share_by_owner", "get_spin"))
    for share, row in shares:
        if share in runs[0]:
            out[share] = max(runs, key=lambda r: r[row]["mb_s"])[share]
    return out


# our rows: (transfer backend, metadata on the master's fast path); auto = shm between processes on one host
SYSTEMS = {"ours": ("tcp", True), "ours_shm": ("auto", True), "ours_grpc": ("tcp", False), "ours_io": ("tcp_io", True)}
DEFAULT_SYSTEMS = ("ours", "ours_shm", "ours_grpc")  # ours_io on request (--only): the engines' own client


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer objects and one rep (< 1 min)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--objects", type=int, default=None, help="objects per run (default 512, quick 96)")
    p.add_argument("--object-kib", type=int, default=512)
    p.add_argument("--batch", type=int, default=None, help="objects per batch in the batched rows (default 16; "
                   "--scale: keys per metadata batch, default 64)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, alternating systems (default 3, quick 1)")
    p.add_argument("--token", action="store_true", help="our processes share a (random) cluster secret")
    p.add_argument("--only", default="", help="comma-separated systems to run (of ours, ours_shm, ours_grpc, "
                   "ours_io, mooncake; default all but ours_io)")
    p.add_argument("--scale", action="store_true", help="the master at scale: 1,000,000 objects (--quick: 100,000) "
                   "on --segments segments, metadata only, ours and mooncake_master")
    p.add_argument("--phases", action="store_true", help="where one put and one get spend their time over TCP, "
                   "per phase (tools/bench_store_phases.py)")
    p.add_argument("--segments", type=int, default=64, help="--scale: segments mounted (one per simulated engine)")
    p.add_argument("--depth", type=int, default=4, help="--scale: metadata batches in flight")
    args = p.parse_args(argv)
    if args.scale:
        return scale(args)
    if args.phases:
        return phases(args)
    args.batch = args.batch or 16
    n = args.objects or (96 if args.quick else 512)
    reps = args.reps or (1 if args.quick else 3)
    size = args.object_kib * 1024
    why = mooncake_unavailable()
    token_file = ""
    if args.token:
        token_dir = tempfile.mkdtemp(prefix="bench-store-")
        token_file = os.path.join(token_dir, "cluster-token")
        with open(os.open(token_file, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
    only = set(args.only.split(",")) if args.only else {*DEFAULT_SYSTEMS, "mooncake"}
    if only - {*SYSTEMS, "mooncake"}:
        raise SystemExit(f"bench_store --only: unknown systems {sorted(only - {*SYSTEMS, 'mooncake'})}")
    systems = {name: v for name, v in SYSTEMS.items() if name in only}
    if "mooncake" not in only:
        why = "not asked for (--only)"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in (*systems, "mooncake")}
    for _ in range(reps):
        for name, (backend, fast_path) in systems.items():
            runs[name].append(bench_ours(n, size, args.batch, backend, fast_path, token_file))
        if why is None:
            try:
                runs["mooncake"].append(bench_mooncake(n, size, args.batch))
            except Exception as e:  # noqa: BLE001 - the baseline failing must not hide our figures
                why = f"{type(e).__name__}: {e}"
    if token_file:
        shutil.rmtree(os.path.dirname(token_file), ignore_errors=True)
    out: dict[str, Any] = {"object_bytes": size, "objects": n, "batch": args.batch, "reps": reps,
                           "transport": {"ours": "tcp loopback", "ours_shm": "shared memory (backend auto)",
                                         "ours_grpc": "tcp loopback, metadata over gRPC (no fast path)",
                                         "ours_io": "tcp loopback, the driver's transfer engine with its I/O process "
                                                    "(as an engine's client runs)",
                                         "mooncake": "tcp loopback"},
                           "floors": floors(n, size), "round_trips": ROUND_TRIPS,
                           "cluster_secret": bool(token_file)}
    for name in systems:
        out[name] = best(runs[name])
    if runs["mooncake"] and why is None:
        mc = out["mooncake"] = best(runs["mooncake"])
        out["baseline"] = "mooncake-transfer-engine MooncakeDistributedStore + mooncake_master"
        out["ratios"] = {name: {row: round(out[name][row]["mb_s"] / mc[row]["mb_s"], 2) for row in mc}
                         for name in systems}
        for name in systems:  # our single put with its commit behind, against Mooncake's single put
            out["ratios"][name]["put_commit_behind"] = round(out[name]["put_commit_behind"]["mb_s"] / mc["put"]["mb_s"], 2)
            if "get_spin" in out[name]:  # our single get polling for its answer, against Mooncake's single get
                out["ratios"][name]["get_spin"] = round(out[name]["get_spin"]["mb_s"] / mc["get"]["mb_s"], 2)
        out["tcp_ceilings"] = tcp_ceilings(out["floors"], mc)
        out["aims"] = aims(out["ratios"])
    else:
        out["mooncake"] = None
        out["baseline"] = f"baseline unavailable: {why}"
        out["ratios"] = None
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{n} objects of {size // 1024} KiB, batches of {args.batch}, best of {reps}; "
          "ours over tcp, over shm (auto) and over tcp with gRPC metadata; Mooncake over tcp; "
          "ratio = MB/s ours / Mooncake")
    print(f"{'row':<17} {'system':<10} {'MB/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>7}")
    for row in ("put", "put_commit_behind", "get", "get_spin", "batch_put", "batch_get"):
        for name in (*systems, "mooncake"):
            r = out[name].get(row) if out.get(name) else None
            if r is None:
                continue
            ratio = f"{out['ratios'][name][row]:.2f}x" if out["ratios"] and name in systems else ""
            p50 = f"{r['p50_ms']:.3f}" if "p50_ms" in r else "-"
            p99 = f"{r['p99_ms']:.3f}" if "p99_ms" in r else "-"
            print(f"{row:<17} {name:<10} {r['mb_s']:>9.1f} {p50:>8} {p99:>8} {ratio:>7}")
    shares = ", ".join(f"{name} {out[name]['get_share_by_owner']:.0%}" for name in systems)
    spin = ", ".join(f"{name} {out[name]['get_spin_share_by_owner']:.0%}" for name in systems
                     if "get_spin_share_by_owner" in out[name])
    print(f"gets served by the owner by key (no master): {shares}"
          + (f"; polling ones (get_spin): {spin}" if spin else ""))
    shares = ", ".join(f"{name} {out[name]['get_share_by_index']:.0%}" for name in systems)
    print(f"gets copied from the owner's shared-memory index (no round trip): {shares}")
    f = out["floors"]
    print(f"floors, p50 per object: raw TCP request/response {f['tcp_request_response_p50_ms']:.3f} ms "
          f"(blocking sockets, no framing); memcpy {f['memcpy_p50_ms']:.3f} ms; a bare {ROUND_TRIP_BYTES}-byte "
          f"round trip between two processes {f['round_trip_p50_ms']:.3f} ms")
    trips = "; ".join(f"{name} put {t['put']}, get {t['get']}" for name, t in ROUND_TRIPS.items())
    print(f"round trips a single op waits for: {trips}")
    if out.get("tcp_ceilings"):
        c = out["tcp_ceilings"]
        print(f"over TCP no single put or get can beat Mooncake's by more than put {c['put']:.2f}x, get {c['get']:.2f}x "
              "here: its p50 over the raw request/response floor (each op moves its bytes once over loopback)")
    for name, a in (out.get("aims") or {}).items():
        print(f"aim {name}: {a['row']} {a['ratio']:.2f}x against {a['aim']:g}x: {'met' if a['met'] else 'NOT met'}"
              + (f" ({a['note']})" if a.get("note") else ""))
    if out["mooncake"] is None:
        print(out["baseline"])
    return 0


# issue 16's aims against Mooncake Store: (our system, row, at least); over TCP the put is the one whose commit
# overlaps the next put's transfer (the design the aim names); over shared memory 4x is the margin aim on a fast
# core, so that a slower-per-core machine still clears 3x
AIMS = {"tcp_put": ("ours", "put_commit_behind", 3.0), "tcp_get": ("ours", "get", 2.0),
        "shm_put": ("ours_shm", "put", 4.0), "shm_get": ("ours_shm", "get", 3.0)}


def aims(ratios: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Each aim this run measured: the row compared, its ratio, and whether it clears the aim (the plain TCP put,
    which waits for the master's commit, is named beside the TCP put's; the polling get beside the get's)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (system, row, at_least) in AIMS.items():
        ratio = ratios.get(system, {}).get(row)
        if ratio is None:
            continue
        out[name] = {"row": f"{system}.{row}", "ratio": ratio, "aim": at_least, "met": ratio >= at_least}
        if name == "tcp_put" and "put" in ratios[system]:
            out[name]["note"] = f"the plain put, which waits for the master's commit: {ratios[system]['put']:.2f}x"
        if name == "tcp_get" and "get_spin" in ratios[system]:
            out[name]["note"] = (f"the get polling for its answer (owner_read_spin_us={SPIN_US}, a client without an "
                                 f"engine thread): {ratios[system]['get_spin']:.2f}x")
    return out


def tcp_ceilings(floors_ms: dict[str, float], mooncake: dict[str, Any]) -> dict[str, float]:
    """The best single-op ratio over TCP this host allows: Mooncake's p50 over the raw floor (one request and
    its object's bytes, blocking sockets, no framing), which any put or get over TCP pays at least once. Where
    it is under an aim, the aim cannot be met on this host over TCP, whatever the store does."""
    floor = floors_ms["tcp_request_response_p50_ms"]
    return {op: round(mooncake[op]["p50_ms"] / floor, 2) for op in ("put", "get") if floor > 0}


def phases(args: argparse.Namespace) -> int:
    from bench_store_phases import run

    n = args.objects or (96 if args.quick else 256)
    out = {"object_bytes": args.object_kib * 1024, "objects": n, "transport": "tcp loopback",
           "p50_us": run(n, args.object_kib * 1024, args.reps or (1 if args.quick else 3))}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{n} objects of {args.object_kib} KiB over TCP, p50 µs per phase (median of the reps)")
        for name, us in out["p50_us"].items():
            print(f"  {name:<20} {us:>8.1f}")
    return 0


def scale(args: argparse.Namespace) -> int:
    from bench_store_scale import Shape, print_table, run

    n = args.objects or (100_000 if args.quick else 1_000_000)
    shape = Shape(objects=n, segments=args.segments, batch=args.batch or 64, depth=args.depth,
                  sample_keys=65_536 if args.quick else 262_144)
    if n < shape.segments or shape.batch < 1 or shape.depth < 1:
        raise SystemExit("bench_store --scale: need at least one object per segment, --batch and --depth >= 1")
    out = run(shape, _mooncake_master(), mooncake_unavailable())
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
