"""Fuzz every surface of a real cluster (store master, conductor, prefill, decode as processes on
a tiny model) and the model loaders; print what broke.

    python tools/fuzz.py [--inputs N] [--quick] [--json] [--surfaces http,grpc,...] [--seed S]

Per surface: HTTP (every route: bodies, headers), gRPC (every method of Conductor, Engine on the
prefill and the decode, StoreMaster: hostile messages and random bytes), the transfer port, the
store master's fast path and a DRAM owner's reads by key (random, truncated, oversized frames, long
pipelines), loaders (hostile config.json,
safetensors and GGUF files). The JSON:
``{"inputs", "crashes", "hangs", "server_errors", "fd_growth", "rss_growth_mb", "surfaces": {...}}``.
The cluster runs without TLS or a cluster secret, so inputs reach the parsers behind them.
``tests/test_fuzz.py`` runs the same surfaces with a few dozen inputs each.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_surfaces as fz  # noqa: E402
from cluster import Cluster  # noqa: E402  (the tests' real-process cluster)

SURFACES = ("http", "grpc_conductor", "grpc_engine", "grpc_store", "transfer", "fast_path", "owner_reads", "loaders")


@dataclass
class Targets:
    """Where a running cluster's surfaces are, and how to tell it is still alive."""

    cluster: Cluster
    http_port: int
    transfer_port: int
    fast_path_port: int
    owner_reads_port: int  # p1's reads by key of the pool objects its DRAM holds
    model_dir: Path

    def alive(self) -> str | None:
        for name, p in self.cluster.procs.items():
            if p.poll() is not None:
                return f"{name} (exit {p.returncode})"
        return None

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.cluster.procs.items()}


def start_cluster(model_dir: Path, log_dir: Path) -> Targets:
    """store, conductor, prefill p1 (lends DRAM to the pool), decode d1: the shape of a real cluster."""
    import re

    c = Cluster(model_dir, log_dir, extra_env={"MOONCAKED_LOG_LEVEL": "WARNING"})
    c.start("store", "store")
    store = c.ports["store"]
    c.start("conductor", "conductor", "--store", f"127.0.0.1:{store}")
    c.start("p1", "prefill", "--store", f"127.0.0.1:{store}", "--store-dram-bytes", "8MiB")
    c.start("d1", "decode", "--store", f"127.0.0.1:{store}")
    c.wait_serving(["p1", "d1"])
    transfer = int(re.search(r"transfer on [^ ]*:(\d+)", c.log("p1")).group(1))
    fast = int(re.search(r"fast path on port (\d+)", c.log("store")).group(1))
    reads = int(re.search(r"pool reads by key on [^ ]*:(\d+)", c.log("p1")).group(1))
    targets = Targets(c, c.http_port("conductor"), transfer, fast, reads, model_dir)
    _exercise(targets)
    return targets


def _exercise(targets: Targets) -> None:
    """Real traffic before anything is counted: the connections a cluster keeps for good (KV pushes,
    pool puts and gets, the conductor's channel to the store) open now, not during a surface's run."""
    import urllib.request

    body = json.dumps({"model": targets.model_dir.name, "prompt": " ".join(f"t{i}" for i in range(5, 45)),
                       "max_tokens": 3}).encode()
    for _ in range(3):  # the second and third find the prompt's blocks cached or pooled
        req = urllib.request.Request(f"http://127.0.0.1:{targets.http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    targets.cluster.status()


def _raw_probe(port: int, request: bytes, answer_bytes: int, what: str):
    """A check that a raw port still speaks its protocol: `request` gets at least a byte of an answer."""

    def probe() -> str | None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=fz.RAW_TIMEOUT_S) as s:
                s.sendall(request)
                if len(s.recv(answer_bytes)) == 0:
                    return f"{what} got no answer"
        except OSError as e:
            return f"{what} failed: {e}"
        return None

    return probe


def _transfer_probe(port: int):
    from mooncaked.transfer.wire import REQ, RESP, Op, pack_request

    return _raw_probe(port, pack_request(Op.INFO, 1, b"", 0, 0).ljust(REQ.size, b"\0"), RESP.size, "INFO")


def _owner_probe(port: int):
    from mooncaked.store.owner_wire import REPLY, KeyRequest, pack_request

    return _raw_probe(port, pack_request(KeyRequest(1, "fuzz-probe", 4096, 1)), REPLY.size, "a read by key")


def _store_probe(targets: Targets):
    from mooncaked.proto.mooncake.v1 import store_pb2, store_pb2_grpc

    def probe() -> str | None:
        with grpc.insecure_channel(f"127.0.0.1:{targets.cluster.ports['store']}") as ch:
            try:
                store_pb2_grpc.StoreMasterStub(ch).Describe(store_pb2.DescribeRequest(), timeout=5)
            except grpc.RpcError as e:
                return f"Describe: {e.code().name}"
        return None

    return probe


def _run_surface(targets: Targets, surface: str, n: int, seed: int, t: fz.Tally) -> None:
    c = targets.cluster
    if surface == "http":
        fz.run_examples(fz.http_inputs(targets.model_dir.name), n,
                        lambda x: fz.http_send("127.0.0.1", targets.http_port, x, t, targets.alive), seed)
    elif surface.startswith("grpc_"):
        service = {"grpc_conductor": "Conductor", "grpc_engine": "Engine", "grpc_store": "StoreMaster"}[surface]
        addresses = {"Conductor": [c.conductor], "StoreMaster": [f"127.0.0.1:{c.ports['store']}"],
                     "Engine": [f"127.0.0.1:{c.ports['p1']}", f"127.0.0.1:{c.ports['d1']}"]}[service]
        channels = [grpc.insecure_channel(a) for a in addresses]
        turn = iter(range(10**9))
        try:
            fz.run_examples(fz.grpc_inputs(service), n,
                            lambda x: fz.grpc_send(channels[next(turn) % len(channels)], x, t, targets.alive), seed)
        finally:
            for ch in channels:
                ch.close()
    elif surface == "transfer":
        probe = _transfer_probe(targets.transfer_port)
        fz.run_examples(fz.transfer_frames(), n,
                        lambda x: fz.raw_send("127.0.0.1", targets.transfer_port, x, t, targets.alive, probe), seed)
    elif surface == "fast_path":
        probe = _store_probe(targets)
        fz.run_examples(fz.fast_path_frames(), n,
                        lambda x: fz.raw_send("127.0.0.1", targets.fast_path_port, x, t, targets.alive, probe), seed)
    elif surface == "owner_reads":
        probe = _owner_probe(targets.owner_reads_port)
        fz.run_examples(fz.owner_read_frames(), n,
                        lambda x: fz.raw_send("127.0.0.1", targets.owner_reads_port, x, t, targets.alive, probe), seed)
    elif surface == "loaders":
        gguf = _gguf_head()
        worker = fz.LoaderWorker(c.env())
        try:
            fz.run_examples(fz.loader_inputs(), n, lambda x: fz.loader_send(worker, targets.model_dir, gguf, x, t),
                            seed)
        finally:
            worker.close()


WARM_UP_INPUTS = 20
"""Inputs per surface before descriptors are counted: the first calls of a kind open what a
process keeps for good (channels, thread pools, a store connection); a leak grows after that."""


def run_surfaces(targets: Targets, n: int, seed: int, surfaces: tuple[str, ...] = SURFACES) -> dict[str, Any]:
    """``n`` inputs on each surface (after a short warm-up); the report (the shape --json prints)."""
    tallies = {s: fz.Tally(s) for s in surfaces}
    started = time.monotonic()
    for surface in surfaces:
        _run_surface(targets, surface, min(WARM_UP_INPUTS, n), seed + 1, tallies[surface])
    pids = targets.pids()
    fds_before = {k: fz.fd_count(p) for k, p in pids.items()}
    rss_before = sum(fz.rss_mb(p) for p in pids.values())
    for surface in surfaces:
        t = tallies[surface]
        t0 = time.monotonic()
        _run_surface(targets, surface, n, seed, t)
        print(f"fuzz {surface}: {t.inputs} inputs, {t.crashes} crashes, {t.hangs} hangs, "
              f"{t.server_errors} server errors ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    alive = targets.alive()
    fd_growth = fz.settled_fd_growth(pids, fds_before) if alive is None else {}
    rss_after = sum(fz.rss_mb(p) for p in pids.values()) if alive is None else rss_before
    total = {k: sum(getattr(t, k) for t in tallies.values()) for k in ("inputs", "crashes", "hangs", "server_errors")}
    return {**total, "fd_growth": sum(fd_growth.values()), "fd_growth_by_process": fd_growth,
            "rss_growth_mb": round(rss_after - rss_before, 1), "seconds": round(time.monotonic() - started, 1),
            "seed": seed, "inputs_per_surface": n, "surfaces": {k: t.as_dict() for k, t in tallies.items()}}


_GGUF_HEAD: Path | None = None


def _gguf_head() -> Path | None:
    """The first 64 KiB of the bundled default model's GGUF: a real header to cut and mangle."""
    global _GGUF_HEAD
    if _GGUF_HEAD is None:
        try:
            from mooncaked.engine.default_model import find_default_gguf

            src = find_default_gguf()
        except Exception:  # noqa: BLE001 - without the default model, GGUF inputs are random bytes only
            return None
        _GGUF_HEAD = Path(tempfile.mkdtemp(prefix="fuzz-gguf-")) / "head.gguf"
        with open(src, "rb") as f:
            _GGUF_HEAD.write_bytes(f.read(64 << 10))
    return _GGUF_HEAD


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=10_000, help="inputs per surface (default 10000)")
    ap.add_argument("--quick", action="store_true", help="100 inputs per surface (under a minute or two)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--surfaces", default=",".join(SURFACES), help=f"comma-separated subset of {SURFACES}")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    args = ap.parse_args(argv)
    n = 100 if args.quick else args.inputs
    seed = fz.random_seed() if args.seed is None else args.seed
    surfaces = tuple(s for s in args.surfaces.split(",") if s)
    unknown = set(surfaces) - set(SURFACES)
    if unknown:
        ap.error(f"unknown surfaces {sorted(unknown)}; pick from {SURFACES}")
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        model_dir.mkdir()
        make_tiny_model("llama", model_dir)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        targets = start_cluster(model_dir, logs)
        try:
            report = run_surfaces(targets, n, seed, surfaces)
        finally:
            targets.cluster.stop()
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps({k: v for k, v in report.items() if k != "surfaces"}, indent=1))
        for name, s in report["surfaces"].items():
            print(f"{name}: {s['inputs']} inputs, {s['crashes']} crashes, {s['hangs']} hangs, "
                  f"{s['server_errors']} server errors")
            for line in s["samples"]:
                print(f"   {line}")
    return 0 if not (report["crashes"] or report["hangs"] or report["server_errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
