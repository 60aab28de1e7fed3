"""Benchmark the data plane against plain baselines measured in the same run.

Rows (the same total bytes, moved as fixed-size blocks):
  socket   plain blocking sockets: sendall from a memoryview, recv_into a
           preallocated buffer (the ceiling for any tcp transport here)
  tcp      TransferEngine(backend="tcp"), one batch of write ops (default
           4 connections per peer, and again with 1), and tcp_io: the same
           through the engine's I/O process (io_process=True: what mooncaked's
           engines run, --transfer-io-process, on by default; `tcp` is the
           in-process path, --no-transfer-io-process)
  memcpy   torch copy_ and ctypes.memmove of the same blocks in one process
  shm      TransferEngine(backend="shm"), peer in another process
  mooncake mooncake-transfer-engine's TCP transport, when importable
           (through our adapter, mooncaked.transfer.rdma; run after the others)

Usage: python tools/bench_transfer.py [--quick] [--json] [--contention [--burn-ms MS]] [--total-mib N]
       [--block-mib N] [--token]
--token: our engines prove a cluster secret to each other (the handshake, once per connection).
--contention: only the socket and tcp rows, under load: one compute process per core (torch
  matmuls, one thread each) saturates the CPU, and the engine's own event loop is kept busy by a
  task burning CPU in short slices (pure Python, the GIL held, as a serving engine's loop runs its
  scheduler). The socket baseline (the ceiling, the ratio's denominator) blocks the loop thread in
  sendall, so it meets the same busy cores but not the burner; socket_thread runs the same sendall
  in a thread beside the burning loop (it shares the GIL with it), for comparison, and socket_proc
  sends from a process of its own while the burner burns: the same load as the engine's rows (the
  fair ceiling). `same_contention` in the JSON: per row, the median over reps of row / baseline
  within one rep, against socket_proc and against socket.
Baseline and engine reps are interleaved so both see the same machine load.
Processes are spawned, never forked: forking after allocating big buffers
would make every page copy-on-write.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import uvloop

from mooncaked.transfer import TransferEngine, TransferOp
from mooncaked.transfer.rdma import MooncakeTransport, RdmaOp

MiB = 1024 * 1024
CTX = mp.get_context("spawn")


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.numpy().data, digest_size=16).hexdigest()


def _fill(t: torch.Tensor) -> None:
    """Random bytes tiled from 8 MiB, each 4 KiB page stamped with its index,
    so a misplaced block changes the digest (cheaper than 1 GiB of randint)."""
    g = torch.Generator().manual_seed(1234)
    tile = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=g)
    for o in range(0, t.numel(), tile.numel()):
        n = min(tile.numel(), t.numel() - o)
        t[o : o + n].copy_(tile[:n])
    pages = t.numel() // 4096
    stamps = torch.arange(pages, dtype=torch.int64).view(torch.uint8).view(pages, 8)
    t[: pages * 4096].view(pages, 4096)[:, :8].copy_(stamps)


# -- peers in other processes ------------------------------------------------------
def _socket_receiver(pipe: Connection, total: int) -> None:
    """Plain baseline: recv_into one preallocated buffer, ack each full pass."""
    buf = bytearray(total)
    view = memoryview(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    pipe.send(srv.getsockname()[1])
    conn, _ = srv.accept()
    while True:
        got = 0
        while got < total:
            n = conn.recv_into(view[got:], total - got)
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


def _socket_sender(pipe: Connection, total: int, port: int) -> None:
    """The fair baseline under --contention: a plain blocking socket in a process of its own, so the
    burner keeps burning the engine's loop while it sends (the same load the engine meets), and it
    shares no GIL with it (the ceiling for any design that moves the socket work off that GIL)."""
    buf = bytearray(total)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        pipe.send("ready")
        while pipe.recv() == "go":
            t0 = time.perf_counter()
            sock.sendall(view)
            assert sock.recv(1) == b"k"
            pipe.send(time.perf_counter() - t0)


def _engine_peer(pipe: Connection, backend: str, total: int, token: bytes | None) -> None:
    async def main() -> None:
        engine = TransferEngine(backend=backend, token=token)
        dst = engine.alloc_region("dst", total)
        pipe.send(await engine.start())
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, pipe.recv)) != "stop":
            assert cmd == "digest"
            pipe.send(_digest(dst))
        await engine.close()

    uvloop.run(main())


def _spawn(target: Any, *args: Any) -> tuple[Connection, Any, Any]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return parent, proc, parent.recv()


def _gbps(total: int, seconds: float) -> float:
    return total / seconds / 1e9


def _hog(stop: Any) -> None:
    """One core's worth of compute: small torch matmuls on one thread until told to stop."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        for _ in range(50):
            a = torch.tanh(a @ a)


class Contention:
    """The load of --contention: compute processes on every core, and a task that keeps the
    engine's event loop busy (BURN_SLICE_S of pure Python, then one yield, over and over)."""

    BURN_SLICE_S = 0.002

    def __init__(self, burn_slice_s: float = BURN_SLICE_S) -> None:
        self.burn_slice_s = burn_slice_s
        self._stop = CTX.Event()
        self._procs = [CTX.Process(target=_hog, args=(self._stop,), daemon=True) for _ in range(os.cpu_count() or 1)]
        self._burner: asyncio.Task[None] | None = None
        self.slices = 0

    def start_hogs(self) -> None:
        for p in self._procs:
            p.start()

    def stop_hogs(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()

    def start_burner(self) -> None:
        self._burner = asyncio.get_running_loop().create_task(self._burn())

    async def _burn(self) -> None:
        while True:
            end = time.perf_counter() + self.burn_slice_s
            x = 0
            while time.perf_counter() < end:
                x += 1  # Python bytecode: holds the GIL, as a scheduler step does
            self.slices += 1
            await asyncio.sleep(0)

    async def stop_burner(self) -> None:
        if self._burner is not None:
            self._burner.cancel()
            try:
                await self._burner
            except asyncio.CancelledError:
                pass


def bench_tcp(total: int, block: int, reps: int, token: bytes | None = None,
              contention: Contention | None = None) -> dict[str, list[float] | bool]:
    """Plain socket and engine tcp, reps interleaved so both see the same load."""
    _, sock_proc, port = _spawn(_socket_receiver, total)
    pipe, peer_proc, peer = _spawn(_engine_peer, "tcp", total, token)
    times: dict[str, list[float] | bool] = {"socket": [], "tcp": [], "tcp_1conn": [], "tcp_io": []}
    sender = None
    if contention is not None:
        _, recv2_proc, port2 = _spawn(_socket_receiver, total)
        sender_pipe, sender_proc, _ = _spawn(_socket_sender, total, port2)
        sender = (sender_pipe, sender_proc, recv2_proc)

    def send_pass(sock: socket.socket, view: memoryview) -> None:
        sock.sendall(view)  # blocking on purpose: the plain-socket ceiling
        assert sock.recv(1) == b"k"

    async def main() -> bool:
        engine = TransferEngine(backend="tcp", token=token)
        one = TransferEngine(backend="tcp", connections_per_peer=1, token=token)
        io = TransferEngine(backend="tcp", token=token, io_process=True)
        await io.start()
        src = io.alloc_region("src", total)  # in shared memory: the I/O process sends from it
        engine.register("src", src)
        one.register("src", src)
        _fill(src)
        view = src.numpy().data
        ops = [TransferOp("write", "src", o, peer, "dst", o, block) for o in range(0, total, block)]
        loop = asyncio.get_running_loop()
        for eng in (engine, one, io):
            await eng.submit(ops[:1])  # opens the pool: set-up, not transfer
        if contention is not None:
            contention.start_hogs()
            contention.start_burner()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setblocking(True)
            for _ in range(reps):
                t0 = time.perf_counter()
                send_pass(sock, view)  # blocks the loop: the burner waits, the sender has the GIL to itself
                times["socket"].append(_gbps(total, time.perf_counter() - t0))  # type: ignore[union-attr]
                if contention is not None:  # again in a thread, beside the burning loop (same GIL)
                    t0 = time.perf_counter()
                    await loop.run_in_executor(None, send_pass, sock, view)
                    times.setdefault("socket_thread", []).append(_gbps(total, time.perf_counter() - t0))  # type: ignore[union-attr]
                if sender is not None:  # and in a process of its own while the loop burns: the same load
                    sender[0].send("go")
                    took = await loop.run_in_executor(None, sender[0].recv)
                    times.setdefault("socket_proc", []).append(_gbps(total, took))  # type: ignore[union-attr]
                for key, eng in (("tcp", engine), ("tcp_1conn", one), ("tcp_io", io)):
                    t0 = time.perf_counter()
                    await eng.submit(ops)
                    times[key].append(_gbps(total, time.perf_counter() - t0))  # type: ignore[union-attr]
        if contention is not None:
            await contention.stop_burner()
            contention.stop_hogs()
        pipe.send("digest")
        ok = await loop.run_in_executor(None, pipe.recv) == _digest(src)
        await one.close()
        await engine.close()
        await io.close()
        return ok

    try:
        times["tcp_verified"] = uvloop.run(main())
    finally:
        if contention is not None:
            contention.stop_hogs()  # again, in case main() failed half way
        pipe.send("stop")
        peer_proc.join(30)
        sock_proc.join(30)
        if sender is not None:
            sender[0].send("stop")
            for proc in sender[1:]:
                proc.join(30)
    return times


def bench_shm(total: int, block: int, reps: int, token: bytes | None = None) -> dict[str, list[float] | bool]:
    """In-process copies (torch copy_, memmove) and engine shm, interleaved."""
    pipe, peer_proc, peer = _spawn(_engine_peer, "shm", total, token)
    times: dict[str, list[float] | bool] = {"torch_copy": [], "memmove": [], "shm": []}

    async def main() -> bool:
        engine = TransferEngine(backend="shm", token=token)
        src = engine.alloc_region("src", total)
        _fill(src)
        dst = torch.zeros(total, dtype=torch.uint8)
        ops = [TransferOp("write", "src", o, peer, "dst", o, block) for o in range(0, total, block)]
        await engine.submit(ops[:1])  # the control query and the mapping are set-up, not transfer
        for _ in range(reps):
            for kind in ("torch_copy", "memmove"):
                dst.zero_()
                t0 = time.perf_counter()
                for o in range(0, total, block):
                    if kind == "memmove":
                        ctypes.memmove(dst.data_ptr() + o, src.data_ptr() + o, block)
                    else:
                        dst[o : o + block].copy_(src[o : o + block])
                times[kind].append(_gbps(total, time.perf_counter() - t0))  # type: ignore[union-attr]
                assert torch.equal(src, dst)
            t0 = time.perf_counter()
            await engine.submit(ops)
            times["shm"].append(_gbps(total, time.perf_counter() - t0))  # type: ignore[union-attr]
        pipe.send("digest")
        ok = pipe.recv() == _digest(src)
        await engine.close()
        return ok

    try:
        times["shm_verified"] = uvloop.run(main())
    finally:
        pipe.send("stop")
        peer_proc.join(30)
    return times


# -- mooncake-transfer-engine (optional) -------------------------------------
def _mooncake_peer(pipe: Connection, total: int) -> None:
    transport = MooncakeTransport("127.0.0.1", "tcp")
    dst = torch.zeros(total, dtype=torch.uint8)
    transport.register(dst.data_ptr(), total)
    pipe.send((transport.session, dst.data_ptr()))
    pipe.recv()
    pipe.send(_digest(dst))


def bench_mooncake(total: int, block: int, reps: int) -> tuple[list[float], bool] | str:
    try:
        import mooncake.engine  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return "not installed"
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_mooncake_peer, args=(child, total), daemon=True)
    proc.start()
    session, base = parent.recv()
    transport = MooncakeTransport("127.0.0.1", "tcp")
    src = torch.empty(total, dtype=torch.uint8)
    _fill(src)
    transport.register(src.data_ptr(), total)
    ops = [RdmaOp(src.data_ptr() + o, base + o, block) for o in range(0, total, block)]

    async def main() -> list[float]:
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            await transport.run(session, "write", ops, 120.0)
            runs.append(_gbps(total, time.perf_counter() - t0))
        return runs

    gbps = uvloop.run(main())
    parent.send("digest")
    ok = parent.recv() == _digest(src)
    proc.join(30)
    return gbps, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 MiB and 3 reps instead of 1 GiB and 5 (under a minute)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--total-mib", type=int, default=None)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--token", action="store_true", help="engines prove a (random) cluster secret to each other")
    ap.add_argument("--contention", action="store_true",
                    help="socket and tcp rows only, with every core busy and the engine's loop burning CPU")
    ap.add_argument("--burn-ms", type=float, default=Contention.BURN_SLICE_S * 1e3,
                    help="--contention: how long each burn slice holds the engine's loop (and the GIL)")
    args = ap.parse_args(argv)
    total = (args.total_mib or (256 if args.quick else 1024)) * MiB
    block = args.block_mib * MiB
    reps = args.reps or (3 if args.quick else 5)
    if total % block:
        ap.error("total must be a multiple of the block size")

    token = os.urandom(32).hex().encode() if args.token else None
    if args.contention:
        return contention_main(total, block, reps, token, args.json, args.burn_ms / 1e3)
    tcp_runs = bench_tcp(total, block, reps, token)
    shm_runs = bench_shm(total, block, reps, token)
    mc = bench_mooncake(total, block, reps)
    tcp_ok, shm_ok = bool(tcp_runs.pop("tcp_verified")), bool(shm_runs.pop("shm_verified"))
    runs: dict[str, list[float]] = {**tcp_runs, **shm_runs}  # type: ignore[dict-item]
    if not isinstance(mc, str):
        runs["mooncake_tcp"] = mc[0]
    best = {k: max(v) for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in runs.items()}
    memcpy = max(best["torch_copy"], best["memmove"])  # the faster in-process copy is the bar
    result: dict[str, Any] = {
        "total_bytes": total,
        "block_bytes": block,
        "reps": reps,
        "cluster_secret": bool(token),
        **_tcp_figures(best, median),
        "shm_vs_memcpy": round(best["shm"] / memcpy, 3),
        "tcp_verified": tcp_ok,
        "shm_verified": shm_ok,
        "mooncake_tcp": mc if isinstance(mc, str) else "measured",
    }
    if not isinstance(mc, str):
        result["tcp_vs_mooncake_tcp"] = round(best["tcp"] / best["mooncake_tcp"], 3)
        result["mooncake_verified"] = mc[1]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{total // MiB} MiB as {block // MiB} MiB write ops, {reps} interleaved reps (GB/s = 1e9 bytes/s)")
        print(f"{'path':<32}{'best':>7}{'median':>8}  {'ratio (best)':<22}verified")

        def row(label: str, key: str, ratio: str = "", ok: object = "") -> None:
            print(f"{label:<32}{best[key]:>7.2f}{median[key]:>8.2f}  {ratio:<22}{ok}")

        row("plain socket (baseline)", "socket")
        row("TransferEngine tcp", "tcp", f"{best['tcp'] / best['socket']:.2f}x socket", tcp_ok)
        row("TransferEngine tcp, 1 conn", "tcp_1conn", f"{best['tcp_1conn'] / best['socket']:.2f}x socket", tcp_ok)
        row("TransferEngine tcp, I/O process", "tcp_io", f"{best['tcp_io'] / best['socket']:.2f}x socket", tcp_ok)
        row("memcpy: torch copy_ (baseline)", "torch_copy")
        row("memcpy: memmove (baseline)", "memmove")
        row("TransferEngine shm", "shm", f"{best['shm'] / memcpy:.2f}x best memcpy", shm_ok)
        if isinstance(mc, str):
            print(f"{'mooncake-transfer-engine tcp':<32}{mc:>15}")
        else:
            ratio = f"{best['tcp'] / best['mooncake_tcp']:.2f}x (ours/theirs)"
            row("mooncake-transfer-engine tcp", "mooncake_tcp", ratio, mc[1])
    ok = tcp_ok and shm_ok and (isinstance(mc, str) or mc[1])
    return 0 if ok else 1


def _tcp_figures(best: dict[str, float], median: dict[str, float]) -> dict[str, Any]:
    """The figures both modes report: GB/s best and median, and the tcp rows against the socket."""
    return {"unit": "GB/s (1e9 bytes/s); best and median of interleaved reps",
            "best_gbps": {k: round(v, 3) for k, v in best.items()},
            "median_gbps": {k: round(v, 3) for k, v in median.items()},
            "tcp_vs_socket": round(best["tcp"] / best["socket"], 3),
            "tcp_vs_socket_median": round(median["tcp"] / median["socket"], 3),
            "tcp_1conn_vs_socket": round(best["tcp_1conn"] / best["socket"], 3),
            "tcp_io_vs_socket": round(best["tcp_io"] / best["socket"], 3),
            "tcp_io_vs_socket_median": round(median["tcp_io"] / median["socket"], 3),
            "engines_default": "tcp_io"}


def _paired(runs: dict[str, list[float]], row: str, baseline: str) -> float:
    """Median over reps of row/baseline within the same rep: the reps are interleaved, so a pair
    saw the same moment's load (on a shared machine the load moves more between reps than within)."""
    return round(statistics.median(a / b for a, b in zip(runs[row], runs[baseline], strict=True)), 3)


def contention_main(total: int, block: int, reps: int, token: bytes | None, as_json: bool,
                    burn_slice_s: float = Contention.BURN_SLICE_S) -> int:
    """--contention: the tcp rows under load; the ratio tcp/socket is what the data plane must hold.

    Two baselines: `socket` blocks the engine's loop thread in sendall, so the burner pauses while
    it sends (less load than the engine meets); `socket_proc` sends from a process of its own while
    the burner burns (the same load: the fair ceiling). `same_contention` holds the paired ratios."""
    load = Contention(burn_slice_s)
    runs = bench_tcp(total, block, reps, token, load)
    ok = bool(runs.pop("tcp_verified"))
    best = {k: max(v) for k, v in runs.items()}  # type: ignore[arg-type]
    median = {k: statistics.median(v) for k, v in runs.items()}  # type: ignore[arg-type]
    result: dict[str, Any] = {
        "total_bytes": total,
        "block_bytes": block,
        "reps": reps,
        "cluster_secret": bool(token),
        "contention": {"compute_processes": os.cpu_count() or 1, "loop_burn_slice_s": load.burn_slice_s,
                       "loop_slices_burnt": load.slices},
        **_tcp_figures(best, median),
        "same_contention": {f"{row}_vs_{base}_paired_median": _paired(runs, row, base)  # type: ignore[arg-type]
                            for row in ("tcp", "tcp_io") for base in ("socket_proc", "socket")},
        "tcp_verified": ok,
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{total // (1024 * 1024)} MiB as {block // (1024 * 1024)} MiB write ops, {reps} interleaved reps, "
              f"under contention: {os.cpu_count()} compute processes, the engine's loop burning "
              f"{load.burn_slice_s * 1e3:g} ms slices ({load.slices} burnt)")
        print(f"{'path':<32}{'best':>7}{'median':>8}  {'ratio (best)':<22}verified")
        print(f"{'plain socket (baseline)':<32}{best['socket']:>7.2f}{median['socket']:>8.2f}")
        print(f"{'plain socket in a thread':<32}{best['socket_thread']:>7.2f}{median['socket_thread']:>8.2f}")
        print(f"{'plain socket, own process':<32}{best['socket_proc']:>7.2f}{median['socket_proc']:>8.2f}")
        for label, key in (("TransferEngine tcp", "tcp"), ("TransferEngine tcp, 1 conn", "tcp_1conn"),
                           ("TransferEngine tcp, I/O process", "tcp_io")):
            ratio = f"{best[key] / best['socket']:.2f}x socket"
            print(f"{label:<32}{best[key]:>7.2f}{median[key]:>8.2f}  {ratio:<22}{ok}")
        for name, value in result["same_contention"].items():
            print(f"  {name}: {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
