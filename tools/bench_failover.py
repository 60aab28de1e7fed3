"""Benchmark store-master fail-over through etcd: how long the pool stops taking writes when its
leader is killed, and whether anything committed is lost.

Layout: a real etcd on loopback (temporary data dir; election timeout 500 ms, so that it grants
the 1-second leases the masters ask for with --ttl 1), two store masters (`mooncaked --role store
--etcd ...`), and two store clients in this process, each lending DRAM and an LMDB tier, each
running a stream of puts (new 16 KiB objects) and gets (of objects it committed) through
`--store etcd://...`. Then, --failovers times (at least 3): kill -9 the leader, measure, restart
it as a standby. Per failover:

- elected_s: the kill until etcd names the other master leader (the lease's TTL, mostly);
- failover_s: the kill until the first put committed after it (on the new leader);
- rebuild_s: the new leader's election until it knows again every object committed before the
  kill (the clients' remounts re-report their DRAM and LMDB objects).

At the end every committed object is read back: lost_objects must be 0. failed_ops counts puts
and gets that failed or missed while a master was down (a put that fails is not committed).

--with-store-bench: also `tools/bench_store.py`'s rows (ours over TCP with the fast path) with HA on
(clients following etcd://, the leader fencing every write) and off, and Mooncake's store in the
same run: its aims (put >= 3x, get >= 2x Mooncake) must hold with HA on.

Usage: python tools/bench_failover.py [--quick] [--json] [--failovers N] [--ttl S] [--with-store-bench]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ports import free_port  # noqa: E402
OBJECT_BYTES = 16 << 10


class Etcd:
    def __init__(self, workdir: Path) -> None:
        self.data = workdir / "etcd-data"
        self.log = open(workdir / "etcd.log", "a")
        self.client, self.peer = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client}"

    def start(self) -> Etcd:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise SystemExit("bench_failover: etcd is not installed (Debian: apt-get install etcd-server)")
        peer, client = f"http://127.0.0.1:{self.peer}", f"http://{self.endpoint}"
        self.proc = subprocess.Popen(
            [etcd, "--name", "default", "--data-dir", str(self.data), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy within 30s")

    def leader_name(self) -> str:
        body = json.dumps({"key": base64.b64encode(b"/mooncaked/store/leader").decode()}).encode()
        try:
            req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=body, method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                kvs = json.loads(r.read()).get("kvs") or []
        except OSError:
            return ""
        return json.loads(base64.b64decode(kvs[0]["value"]))["name"] if kvs else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Masters:
    """Store masters as processes, by name."""

    def __init__(self, etcd: Etcd, workdir: Path, ttl_s: int) -> None:
        self.etcd, self.workdir, self.ttl_s = etcd, workdir, ttl_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str) -> str:
        log = open(self.workdir / f"{name}.log", "a")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "mooncaked.cli", "--role", "store", "--listen", "127.0.0.1:0", "--name", name,
             "--etcd", self.etcd.endpoint, "--etcd-lease-ttl-s", str(self.ttl_s), "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env)
        line = proc.stdout.readline() if proc.stdout else ""
        if "gRPC on" not in line:
            raise RuntimeError(f"store master {name} did not start: {line!r}")
        self.procs[name] = proc
        self.addresses[name] = line.split("gRPC on ", 1)[1].split()[0]
        return self.addresses[name]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Stream:
    """One client's puts and gets; what it committed, what failed, when puts committed."""

    def __init__(self, client: Any, name: str) -> None:
        self.client, self.name = client, name
        self.committed: dict[str, bytes] = {}
        self.commit_times: list[tuple[float, float]] = []  # (put started, committed)
        self.failed = self.ops = 0
        self.stopping = False

    async def run(self) -> None:
        rng = random.Random(self.name)
        i = 0
        while not self.stopping:
            i += 1
            self.ops += 1
            try:
                if i % 2 or not self.committed:
                    key, data = f"{self.name}/{i}", os.urandom(OBJECT_BYTES)
                    started = time.monotonic()
                    if await self.client.put(key, data):
                        self.committed[key] = data
                        self.commit_times.append((started, time.monotonic()))
                    else:
                        self.failed += 1
                else:
                    key = rng.choice(list(self.committed))
                    if await self.client.get(key) != self.committed[key]:
                        self.failed += 1
            except Exception:  # noqa: BLE001 - counted; the stream goes on
                self.failed += 1
            await asyncio.sleep(0.002)  # a steady stream, not a spin


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 3), "max": round(max(values), 3),
            "all": [round(v, 3) for v in values]} if values else {"mean": 0.0, "max": 0.0, "all": []}


async def _all_known(link: Any, keys: list[str]) -> bool:
    """Whether the leader knows every one of `keys` (committed before a kill: re-reported since)."""
    import grpc

    from mooncaked.proto.mooncake.v1 import store_pb2

    try:
        return all((await link.stub.BatchExist(store_pb2.BatchExistRequest(keys=keys), timeout=2)).exists)
    except grpc.aio.AioRpcError:
        return False


async def failover_bench(failovers: int, ttl_s: int, warm_s: float, workdir: Path,
                         reserve_ahead: bool = True) -> dict[str, Any]:
    from mooncaked.store import StoreClient, StoreClientConfig
    from mooncaked.store.master_link import MasterLink

    etcd = Etcd(workdir).start()
    masters = Masters(etcd, workdir, ttl_s)
    clients: list[Any] = []
    link = None
    try:
        masters.start("master-a")
        while etcd.leader_name() != "master-a":
            await asyncio.sleep(0.05)
        masters.start("master-b")
        target = f"etcd://{etcd.endpoint}"
        for n in ("client-1", "client-2"):
            c = StoreClient(StoreClientConfig(master=target, client_id=n, dram_bytes=8 << 20,
                                              lmdb_path=str(workdir / n), lmdb_bytes=512 << 20, ping_interval_s=0.5,
                                              **({} if reserve_ahead else {"reserve_ahead_bytes": 0})))
            await c.start()
            clients.append(c)
        link = MasterLink(target)
        streams = [Stream(c, c.config.client_id) for c in clients]
        running = [asyncio.create_task(s.run()) for s in streams]
        rows = []
        kills: list[float] = []
        for _ in range(failovers):
            await asyncio.sleep(warm_s)
            leader = etcd.leader_name()
            other = next(n for n in masters.procs if n != leader)
            before = [k for s in streams for k in s.committed]
            killed = time.monotonic()
            kills.append(killed)
            masters.kill(leader)
            while etcd.leader_name() != other:
                await asyncio.sleep(0.01)
            elected = time.monotonic()
            while not any(started > killed for s in streams for started, _ in s.commit_times[-50:]):
                await asyncio.sleep(0.01)
            first = min(done for s in streams for started, done in s.commit_times if started > killed)
            while not await _all_known(link, before) and time.monotonic() - elected < 60:
                await asyncio.sleep(0.02)
            rebuilt = time.monotonic()
            await asyncio.to_thread(masters.start, leader)  # back, as a standby
            rows.append({"elected_s": elected - killed, "failover_s": first - killed, "rebuild_s": rebuilt - elected,
                         "objects_before": len(before)})
        await asyncio.sleep(warm_s / 2)
        for s in streams:
            s.stopping = True
        await asyncio.gather(*running)
        lost = 0
        for s in streams:
            keys = list(s.committed)
            got = await s.client.batch_get(keys)
            missing = [k for k, g in zip(keys, got) if g != s.committed[k]]
            lost += len(missing)
            if missing:  # what a reader of the figures needs to find the cause
                known = await s.client.batch_exist(missing)
                done_at = dict(zip(keys, (d for _, d in s.commit_times)))
                for k, k_known in zip(missing, known):
                    near = min(kills, key=lambda t: abs(done_at.get(k, t) - t))
                    print(f"lost {k}: committed {done_at.get(k, near) - near:+.3f}s from a kill; the master "
                          f"{'knows it (bytes wrong or unreadable)' if k_known else 'does not know it'}",
                          file=sys.stderr)
        return {"failovers": len(rows), "etcd_lease_ttl_s": ttl_s, "clients": len(clients),
                "reserve_ahead": reserve_ahead,
                "object_bytes": OBJECT_BYTES,
                "failover_s": _stats([r["failover_s"] for r in rows]),
                "elected_s": _stats([r["elected_s"] for r in rows]),
                "rebuild_s": _stats([r["rebuild_s"] for r in rows]),
                "objects_rebuilt_max": max(r["objects_before"] for r in rows),
                "committed_objects": sum(len(s.committed) for s in streams), "lost_objects": lost,
                "failed_ops": sum(s.failed for s in streams), "ops": sum(s.ops for s in streams)}
    finally:
        for c in clients:
            await c.close(evacuate_timeout_s=0)
        if link is not None:
            await link.close()
        masters.stop()
        etcd.stop()


# -- bench_store's rows with HA on ----------------------------------------------------------------
def _ha_row(n: int, size: int, batch: int, workdir: Path, ttl_s: int, backend: str = "tcp") -> dict[str, Any]:
    """bench_store's 'ours' row (fast path; `backend` tcp, or auto: shared memory on one host) with the
    clients following etcd:// and the leader fencing."""
    import bench_store

    workdir.mkdir(parents=True, exist_ok=True)
    etcd = Etcd(workdir).start()
    masters = Masters(etcd, workdir, ttl_s)
    try:
        masters.start("bench-a")
        while etcd.leader_name() != "bench-a":
            time.sleep(0.05)
        masters.start("bench-b")
        target = f"etcd://{etcd.endpoint}"
        owner_pipe, child = bench_store.CTX.Pipe()
        owner = bench_store.CTX.Process(target=bench_store._our_owner,
                                        args=(child, target, int(n * size * 2.4) + 64 * bench_store.MiB, backend, ""),
                                        daemon=True)
        owner.start()
        if not owner_pipe.poll(60) or owner_pipe.recv() != "ready":
            raise RuntimeError("the owner process did not start")
        driver_pipe, child = bench_store.CTX.Pipe()
        driver = bench_store.CTX.Process(target=bench_store._our_driver,
                                         args=(child, target, n, size, batch, backend, True, ""), daemon=True)
        driver.start()
        if not driver_pipe.poll(300):
            raise RuntimeError("the driver did not finish")
        result = driver_pipe.recv()
        driver.join(10)
        owner_pipe.send("stop")
        owner.join(10)
        if isinstance(result, str):
            raise RuntimeError(result)
        return result
    finally:
        masters.stop()
        etcd.stop()


def store_bench(quick: bool, ttl_s: int, workdir: Path, backend: str = "tcp") -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_store

    n, size, batch, reps = (96 if quick else 512), 512 << 10, 16, (1 if quick else 3)
    why = bench_store.mooncake_unavailable()
    runs: dict[str, list[dict[str, Any]]] = {"ours_ha": [], "ours": [], "mooncake": []}
    for rep in range(reps):
        runs["ours_ha"].append(_ha_row(n, size, batch, workdir / f"store-bench-{rep}", ttl_s, backend))
        runs["ours"].append(bench_store.bench_ours(n, size, batch, backend, True))
        if why is None:
            try:
                runs["mooncake"].append(bench_store.bench_mooncake(n, size, batch))
            except Exception as e:  # noqa: BLE001 - the baseline failing must not hide our figures
                why = f"{type(e).__name__}: {e}"
    out: dict[str, Any] = {"backend": backend, "objects": n, "object_bytes": size, "batch": batch, "reps": reps,
                           "ours_ha": bench_store.best(runs["ours_ha"]), "ours": bench_store.best(runs["ours"])}
    if runs["mooncake"] and why is None:
        mc = out["mooncake"] = bench_store.best(runs["mooncake"])
        out["ratios"] = {name: {row: round(out[name][row]["mb_s"] / mc[row]["mb_s"], 2) for row in mc}
                         for name in ("ours_ha", "ours")}
        ha = out["ratios"]["ours_ha"]
        out["meets_aims_with_ha"] = ha["put"] >= 3 and ha["get"] >= 2
    else:
        out["mooncake"] = None
        out["baseline"] = f"baseline unavailable: {why}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 failovers, shorter streams (about a minute)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--failovers", type=int, default=None, help="leaders killed (at least 3; default 5, quick 3)")
    p.add_argument("--ttl", type=int, default=1, help="the masters' etcd lease TTL in seconds (default 1)")
    p.add_argument("--no-reserve-ahead", action="store_true",
                   help="clients reserve no places ahead (every put is PutStart, write, PutEnd)")
    p.add_argument("--with-store-bench", action="store_true",
                   help="also bench_store's rows with HA on and off, and Mooncake's, in the same run")
    p.add_argument("--store-bench-backend", choices=("tcp", "auto"), default="tcp",
                   help="our rows' data plane in --with-store-bench: tcp, or auto (shared memory on one host)")
    args = p.parse_args(argv)
    failovers = max(3, args.failovers or (3 if args.quick else 5))
    workdir = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    try:
        import uvloop

        out = uvloop.run(failover_bench(failovers, args.ttl, 1.0 if args.quick else 2.0, workdir,
                                        reserve_ahead=not args.no_reserve_ahead))
        out["meets_aims"] = out["failover_s"]["max"] <= 3.0 and out["lost_objects"] == 0
        if args.with_store_bench:
            out["store_bench"] = store_bench(args.quick, args.ttl, workdir, args.store_bench_backend)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rc = 0 if out["lost_objects"] == 0 else 1  # a lost committed object is a failure, not a figure
    if args.json:
        print(json.dumps(out))
        return rc
    print(f"{out['failovers']} failovers (kill -9 the leader; etcd lease TTL {out['etcd_lease_ttl_s']}s), "
          f"{out['clients']} clients streaming puts and gets of {OBJECT_BYTES >> 10} KiB objects")
    for key in ("elected_s", "failover_s", "rebuild_s"):
        s = out[key]
        print(f"{key:<11} mean {s['mean']:.2f}s  max {s['max']:.2f}s  ({', '.join(f'{v:.2f}' for v in s['all'])})")
    print(f"committed {out['committed_objects']} objects, lost {out['lost_objects']}; "
          f"{out['failed_ops']} of {out['ops']} ops failed or missed while a master was down; "
          f"aims (failover <= 3 s, 0 lost) {'met' if out['meets_aims'] else 'NOT met'}")
    sb = out.get("store_bench")
    if sb:
        for name in ("ours_ha", "ours", "mooncake"):
            if sb.get(name):
                print(f"{name:<9} " + "  ".join(f"{row} {sb[name][row]['mb_s']:.0f} MB/s" for row in sb[name]))
        if sb.get("ratios"):
            print("ratios vs Mooncake with HA on: " + ", ".join(f"{k} {v:.2f}x" for k, v in sb["ratios"]["ours_ha"].items())
                  + f"; aims (put >= 3x, get >= 2x) {'met' if sb['meets_aims_with_ha'] else 'NOT met'}")
        else:
            print(sb.get("baseline", ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
