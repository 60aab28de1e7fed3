"""Replay a trace slice live and simulate the same slice, per policy, and print them side by side.

The check that the simulator predicts the live cluster (issue 14): for each policy both the live
conductor and ``tools/simulate.py`` know, the bundled trace slice (``--max-requests``,
``--time-scale``, ``--length-scale``) is sent to a live 2 prefill + 2 decode cluster on this
machine by ``tools/replay.py``'s sender, and simulated on the same shape with a profile measured
on the same model (``tools/profile_engine.py``; ``--profile FILE`` reuses one). The table shows
the figures both report under the same names: ``cache_hit_rate``, ``mean_ttft_s``,
``p90_ttft_s``, and the order of the policies by mean TTFT, live and simulated.

Live clusters (``--cluster``):

- ``all`` (default): per policy a fresh ``mooncaked --role all --prefill-instances 2
  --decode-instances 2 --policy NAME``: empty caches, as the simulation starts. Each start is
  six processes importing torch: ~25 s on 2 cores.
- ``shared``: one store master, 2 prefill and 2 decode processes started once, registered with
  one conductor per policy side by side (``--conductor A,B,...``). Each policy's replay
  synthesizes its own tokens (replay ``--seed`` = the policy's position), so no policy finds
  another's prefixes cached; the KV caches are sized so that no policy's blocks evict another's.
  One start instead of six: what ``--quick`` and tests/test_replay_vs_sim.py use.

The model is a tiny random checkpoint made like tests/tiny_models.py makes them (``--model
tiny``, block size 4: hit rates and routing, not speed) or any model the engine loads. No SLO
is set: the conductors never reject early, and the simulation runs ``--no-early-rejection``.
Simulated TTFT is queueing and compute only (no HTTP, gRPC or KV push), so live TTFTs are
higher by a per-request overhead; the order of the policies is what should agree.

    python tools/replay_vs_sim.py                       # 6 policies, 150 requests, --cluster all: ~5 min
    python tools/replay_vs_sim.py --quick               # --cluster shared, 120 requests: ~1.5 min on 2 cores
    python tools/replay_vs_sim.py --quick --json -      # one JSON object on stdout
    python tools/replay_vs_sim.py --rounds 2            # each policy twice, the second round in reverse order
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import replay as replay_tool  # noqa: E402
import simulate as simulate_tool  # noqa: E402
from ports import free_port  # noqa: E402
from mooncaked.conductor.policies import ALL_POLICY_NAMES  # noqa: E402
from mooncaked.config import POLICIES as LIVE_POLICIES  # noqa: E402
from sim.trace import DEFAULT_TRACE  # noqa: E402

log = logging.getLogger("replay_vs_sim")

# the policies both sides know: the simulator's and the conductor's --policy choices, ours (elastic CPP) last
BOTH_POLICIES: tuple[str, ...] = tuple(p for p in ALL_POLICY_NAMES if p in LIVE_POLICIES)
STEP_TOKENS = 256  # the live engines' step budget (the CPU default), and so an elastic pipeline's chunk
START_TIMEOUT_S = 240.0
STATUS_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 30.0


# -- the model and its profile ---------------------------------------------------------------------------
def tiny_model(folder: Path) -> Path:
    """A tiny random llama checkpoint (tests/tiny_models.py), written once into ``folder``."""
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_model

        make_tiny_model("llama", folder)
    return folder


def measure_profile(model: str, out: Path, block_size: int, kv_cache_bytes: int, threads: int | None = None) -> Path:
    """``tools/profile_engine.py --quick`` on the cluster's engine settings (its own process: its torch threads,
    ``threads`` of them as each live engine gets)."""
    cmd = [sys.executable, str(ROOT / "tools" / "profile_engine.py"), "--quick", "--model", model, "--block-size",
           str(block_size), "--kv-cache-bytes", str(kv_cache_bytes), "--out", str(out)]
    if threads:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"profile_engine failed: {done.stderr[-2000:]}")
    return out


# -- live clusters ---------------------------------------------------------------------------------------
@dataclass
class Processes:
    """Child processes with their logs; each role listens on a port it picks and prints."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> None:
        log_file = open(self.log_dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mooncaked.cli", *args], env=self.env,
                                            stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def printed(self, name: str, pattern: str, deadline: float) -> str:
        """The first group of ``pattern`` once ``name`` has printed it."""
        while True:
            m = re.search(pattern, self.log(name))
            if m:
                return m.group(1)
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}: {self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not print /{pattern}/: {self.log(name)[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", name, STOP_TIMEOUT_S)
                p.kill()
                p.wait()


def wait_serving(conductor: str, prefills: int, decodes: int, deadline: float, procs: Processes) -> None:
    """Until ``conductor`` (gRPC address) lists ``prefills`` + ``decodes`` serving instances."""
    import grpc

    from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc

    want = {common_pb2.ROLE_PREFILL: prefills, common_pb2.ROLE_DECODE: decodes}
    with grpc.insecure_channel(conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        while True:
            try:
                st = stub.Status(conductor_pb2.StatusRequest(without_pool_stats=True), timeout=STATUS_TIMEOUT_S)
                serving = [i.role for i in st.instances if i.state == common_pb2.INSTANCE_STATE_SERVING]
                if all(serving.count(role) >= n for role, n in want.items()):
                    return
            except grpc.RpcError:
                pass
            for name, p in procs.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: {procs.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{conductor} does not list {prefills}P+{decodes}D serving")
            time.sleep(0.2)


def cluster_env(model: str, block_size: int, kv_cache_bytes: int, heartbeat_s: float,
                threads: int | None = None, log_level: str = "INFO") -> dict[str, str]:
    """The live processes' settings; ``threads``: torch threads per process (OMP_NUM_THREADS), so that engines
    sharing this machine's cores run at the speed their profile was measured at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKED_") and k != "NOTIFY_SOCKET"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(MOONCAKED_MODEL=model, MOONCAKED_BLOCK_SIZE=str(block_size),
               MOONCAKED_KV_CACHE_BYTES=str(kv_cache_bytes),
               MOONCAKED_STORE_DRAM_BYTES=str(kv_cache_bytes), MOONCAKED_HEARTBEAT_INTERVAL_S=str(heartbeat_s),
               MOONCAKED_HEARTBEAT_TIMEOUT_S=str(max(2.0, 10 * heartbeat_s)), MOONCAKED_DRAIN_TIMEOUT_S="5",
               MOONCAKED_LOG_LEVEL=log_level, PYTHONUNBUFFERED="1")
    return env


@contextlib.contextmanager
def all_role_cluster(env: dict[str, str], log_dir: Path, policy: str, prefills: int = 2,
                     decodes: int = 2) -> Iterator[str]:
    """``mooncaked --role all --policy POLICY`` with ``prefills`` + ``decodes`` engines; yields its HTTP URL."""
    procs = Processes(env, log_dir)
    grpc_at = f"127.0.0.1:{free_port()}"
    procs.start(f"all-{policy}", "--role", "all", "--policy", policy, "--listen", grpc_at, "--http", "127.0.0.1:0",
                "--prefill-instances", str(prefills), "--decode-instances", str(decodes))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        http = procs.printed(f"all-{policy}", r"HTTP on (\S+?)[ ,(]", deadline)
        wait_serving(grpc_at, prefills, decodes, deadline, procs)
        yield f"http://{http}"
    finally:
        procs.stop()


@contextlib.contextmanager
def shared_cluster(env: dict[str, str], log_dir: Path, policies: list[str], prefills: int = 2,
                   decodes: int = 2) -> Iterator[dict[str, str]]:
    """A store master and ``prefills`` + ``decodes`` engines registered with one conductor per policy
    (side by side); yields {policy: HTTP URL}."""
    procs = Processes(env, log_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # every server binds a port of its own choosing and prints it: a port picked here and bound later can be
        # taken in between (another process's outgoing connection; seen once in CI)
        procs.start("store", "--role", "store", "--listen", "127.0.0.1:0")
        store = procs.printed("store", r"gRPC on (\S+) \(StoreMaster", deadline)
        for p in policies:  # each follows the pool (its plans pull from it), as in `--role all`
            procs.start(f"conductor-{p}", "--role", "conductor", "--policy", p, "--listen", "127.0.0.1:0", "--http",
                        "127.0.0.1:0", "--store", store)
        conductors = {p: procs.printed(f"conductor-{p}", r"gRPC on (\S+?),", deadline) for p in policies}
        for role, n in (("prefill", prefills), ("decode", decodes)):
            for i in range(n):
                procs.start(f"{role}-{i}", "--role", role, "--listen", "127.0.0.1:0", "--name", f"{role}-{i}",
                            "--transfer-listen", "127.0.0.1:0", "--store", store,
                            "--conductor", ",".join(conductors.values()))
        urls = {p: "http://" + procs.printed(f"conductor-{p}", r"HTTP on (\S+?)[ ,]", deadline) for p in policies}
        for at in conductors.values():
            wait_serving(at, prefills, decodes, deadline, procs)
        yield urls
    finally:
        procs.stop()


# -- both sides of one slice -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Slice:
    trace: Path = DEFAULT_TRACE
    max_requests: int = 150
    time_scale: float = 0.2
    length_scale: float = 0.01
    request_timeout_s: float = 120.0


def cut_trace(trace: Path, skip: int, out: Path) -> Path:
    """The trace from its request ``skip`` on, arrivals rebased to start at 0, written to ``out`` (both sides
    then read the same file). Later parts of Mooncake's trace share far more prefixes within a short slice
    (from request 3500, 31 % of 150 requests' blocks repeat an earlier one's; from 0, 8 %)."""
    if skip <= 0:
        return trace
    every = trace.read_text().splitlines()
    lines = every[skip:]
    if not lines:
        raise ValueError(f"--skip {skip}: the trace has only {len(every)} requests")
    rows = [json.loads(line) for line in lines if line.strip()]
    t0 = rows[0]["timestamp"]
    out.write_text("".join(json.dumps({**r, "timestamp": r["timestamp"] - t0}) + "\n" for r in rows))
    return out


def replay_live(url: str, s: Slice, seed: int = 0) -> dict[str, Any]:
    """``tools/replay.py`` against ``url``: its report (``summarize``), without the per-request rows."""
    args = argparse.Namespace(trace=s.trace, max_requests=s.max_requests, time_scale=s.time_scale,
                              length_scale=s.length_scale, url=url, api_key=None, max_inflight=512, model=None,
                              vocab_size=None, fit_context=True, seed=seed, no_progress=True,
                              request_timeout=s.request_timeout_s, slo_ttft=30.0, slo_tbt=0.1)
    results, settings = asyncio.run(replay_tool.replay(args))
    return replay_tool.summarize(results, settings)


def simulate_slice(profile: Path, s: Slice, policies: list[str], prefills: int = 2, decodes: int = 2,
                   seed: int = 0, shared_cores: float | None = None, threads: int = 1,
                   step_tokens: int = STEP_TOKENS) -> dict[str, dict[str, Any]]:
    """``tools/simulate.py --profile PROFILE --no-early-rejection --heterogeneity 0`` on the slice: {policy:
    its JSON figures}. The live instances run one model on one machine: no speed heterogeneity; with
    ``shared_cores`` they share that many cores, ``threads`` torch threads each, as they do live; an
    elastic pipeline's chunk is the live engines' step budget (``step_tokens``)."""
    args = simulate_tool.parser().parse_args([])  # every flag at its default, then this slice's
    vars(args).update(trace=s.trace, max_requests=s.max_requests, time_scale=s.time_scale,
                      length_scale=s.length_scale, prefill=prefills, decode=decodes, profile=str(profile),
                      policy=policies, ttft_slo=30.0, tbt_slo=0.1, no_early_rejection=True, noise=0.05,
                      heterogeneity=0.0, seed=seed, seeds=1, shared_cores=shared_cores,
                      instance_threads=threads, cpp_chunk_tokens=step_tokens)
    return {r.policy: r.as_json() for r in simulate_tool.run(args)}


TIE_TOLERANCE = 0.10  # simulated mean TTFTs closer than this (relative) are a tie no one live run can order
FIGURES = ("cache_hit_rate", "mean_ttft_s", "p90_ttft_s", "prefill_tokens_computed")


def mean_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's live figures over repeated runs: the mean of each, and each run's figures under
    ``rounds`` (one run of a 2-core host moves by tens of percent with the machine's speed)."""
    if len(rounds) == 1:
        return rounds[0]
    out: dict[str, Any] = {"requests": {k: sum(r["requests"][k] for r in rounds) for k in rounds[0]["requests"]},
                           "rounds": [{k: r.get(k) for k in FIGURES} for r in rounds]}
    for k in FIGURES:
        values = [r.get(k) for r in rounds]
        out[k] = None if None in values else sum(values) / len(values)
    if out["prefill_tokens_computed"] is not None:
        out["prefill_tokens_computed"] = round(out["prefill_tokens_computed"])
    return out


def compare(live: dict[str, dict[str, Any]], sim: dict[str, dict[str, Any]],
            tie_tolerance: float = TIE_TOLERANCE) -> dict[str, Any]:
    """Per policy the shared figures live and simulated, and the policies ordered by mean TTFT each way."""
    policies = [p for p in sim if p in live]
    rows = {p: {"live": {k: live[p].get(k) for k in FIGURES}, "sim": {k: sim[p].get(k) for k in FIGURES},
                "live_requests": live[p]["requests"]} for p in policies}
    for p in policies:
        if "rounds" in live[p]:
            rows[p]["live_rounds"] = live[p]["rounds"]
    for p, row in rows.items():
        row["hit_rate_gap"] = abs(row["live"]["cache_hit_rate"] - row["sim"]["cache_hit_rate"])

    def order(side: str) -> list[str]:
        return sorted(policies, key=lambda p: (rows[p][side]["mean_ttft_s"] is None, rows[p][side]["mean_ttft_s"] or 0))

    return {"policies": rows, "order_by_mean_ttft": {"live": order("live"), "sim": order("sim")},
            "pairs": pair_agreement(rows, tie_tolerance)}


def pair_agreement(rows: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Every two policies whose simulated mean TTFTs differ by more than ``tolerance`` (relative) must be in
    the same order live; closer ones are a tie the simulator cannot call, listed apart. A strict order of
    all policies asks the live run to order ties too, which is the noise of one run."""
    agree, disagree, tied = [], [], []
    names = [p for p in rows if rows[p]["sim"]["mean_ttft_s"] and rows[p]["live"]["mean_ttft_s"]]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sa, sb = rows[a]["sim"]["mean_ttft_s"], rows[b]["sim"]["mean_ttft_s"]
            if max(sa, sb) / min(sa, sb) - 1.0 <= tolerance:
                tied.append([a, b])
            elif (sa < sb) == (rows[a]["live"]["mean_ttft_s"] < rows[b]["live"]["mean_ttft_s"]):
                agree.append([a, b])
            else:
                disagree.append([a, b])
    return {"tolerance": tolerance, "agree": agree, "disagree": disagree, "tied_in_sim": tied}


def format_table(cmp: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    head = (f"{'policy':<18} {'hit live':>8} {'hit sim':>8} {'gap':>6}  {'TTFT mean ms live':>17} {'sim':>7}  "
            f"{'TTFT p90 ms live':>16} {'sim':>7}  {'computed live':>13} {'sim':>7}")
    lines = [head, "-" * len(head)]
    for p, r in cmp["policies"].items():
        lv, sm = r["live"], r["sim"]
        lines.append(f"{p:<18} {lv['cache_hit_rate']:>8.1%} {sm['cache_hit_rate']:>8.1%} {r['hit_rate_gap']:>6.3f}  "
                     f"{ms(lv['mean_ttft_s']):>17} {ms(sm['mean_ttft_s']):>7}  {ms(lv['p90_ttft_s']):>16} "
                     f"{ms(sm['p90_ttft_s']):>7}  {lv['prefill_tokens_computed']:>13,} "
                     f"{sm['prefill_tokens_computed']:>7,}")
    for p, r in cmp["policies"].items():
        if "live_rounds" in r:
            lines.append(f"{p}: live mean TTFT ms by round: "
                         + ", ".join(ms(x["mean_ttft_s"]) for x in r["live_rounds"]))
    o = cmp["order_by_mean_ttft"]
    lines.append(f"by mean TTFT, live: {' < '.join(o['live'])}")
    lines.append(f"by mean TTFT, sim:  {' < '.join(o['sim'])}")
    pr = cmp["pairs"]
    lines.append(f"pairs the simulator separates by > {pr['tolerance']:.0%}: {len(pr['agree'])} in the same order live, "
                 f"{len(pr['disagree'])} not" + (f" ({', '.join('/'.join(p) for p in pr['disagree'])})" if pr['disagree'] else "")
                 + f"; {len(pr['tied_in_sim'])} tied in simulation")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="replay-vs-sim-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(tiny_model(work / "tiny-model")) if args.model == "tiny" else args.model
    t0 = time.perf_counter()
    profile = Path(args.profile) if args.profile else measure_profile(model, work / "profile.json", args.block_size,
                                                                      args.kv_cache_bytes, args.threads)
    trace = cut_trace(args.trace, args.skip, work / f"trace-from-{args.skip}.jsonl")
    s = Slice(trace, args.max_requests, args.time_scale, args.length_scale, args.request_timeout)
    cores = args.sim_cores if args.sim_cores is not None else float(os.cpu_count() or 1)
    threads = args.threads or int(os.cpu_count() or 1)  # torch's default: a thread per core
    sim = simulate_slice(profile, s, args.policy, args.prefill, args.decode, args.seed, cores or None, threads,
                         args.step_tokens)
    env = cluster_env(model, args.block_size, args.kv_cache_bytes, args.heartbeat_interval, args.threads,
                      args.log_level)
    env["MOONCAKED_MAX_NUM_BATCHED_TOKENS"] = str(args.step_tokens)
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policy}
    for r in range(args.rounds):
        # every other round in reverse order: a machine that slows down or speeds up over the run then
        # weighs on each policy alike
        order = args.policy if r % 2 == 0 else args.policy[::-1]
        logs = work if args.rounds == 1 else work / f"round-{r + 1}"
        logs.mkdir(parents=True, exist_ok=True)
        if args.cluster == "shared":
            with shared_cluster(env, logs, order, args.prefill, args.decode) as urls:
                for p in order:  # a seed each: no policy finds another's prefixes cached
                    rounds[p].append(replay_live(urls[p], s, seed=args.seed + args.policy.index(p)))
        else:
            for p in order:
                with all_role_cluster(env, logs, p, args.prefill, args.decode) as url:
                    rounds[p].append(replay_live(url, s, seed=args.seed))
        for p in order:
            log.info("round %d, %s: live hit rate %.3f, mean TTFT %s s", r + 1, p, rounds[p][-1]["cache_hit_rate"],
                     rounds[p][-1]["mean_ttft_s"])
    live = {p: mean_of_rounds(rs) for p, rs in rounds.items()}
    cmp = compare(live, sim, args.tie_tolerance)
    cmp["config"] = {"trace": str(args.trace), "skip": args.skip, "threads": args.threads, "sim_shared_cores": cores,
                     "max_requests": s.max_requests, "time_scale": s.time_scale,
                     "length_scale": s.length_scale, "prefill": args.prefill, "decode": args.decode,
                     "cluster": args.cluster, "rounds": args.rounds, "step_tokens": args.step_tokens,
                     "model": args.model, "block_size": args.block_size,
                     "kv_cache_bytes": args.kv_cache_bytes, "profile": str(profile), "wall_s": time.perf_counter() - t0,
                     "logs": str(work)}
    return cmp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    ap.add_argument("--max-requests", type=int, default=150, help="the first N requests of the trace (after --skip)")
    ap.add_argument("--skip", type=int, default=0, help="start the slice at this request of the trace")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each live process and of the profile (default: torch's choice)")
    ap.add_argument("--sim-cores", type=float, default=None,
                    help="cores the simulated instances share, as the live ones share this host's (default: this "
                         "machine's count; 0: each simulated instance on a machine of its own)")
    ap.add_argument("--tie-tolerance", type=float, default=TIE_TOLERANCE,
                    help="simulated mean TTFTs closer than this (relative) are a tie, left out of the order check")
    ap.add_argument("--time-scale", type=float, default=0.2, help="arrival time x this, as replay/simulate take it")
    ap.add_argument("--length-scale", type=float, default=0.01, help="lengths and the 512-token block x this")
    ap.add_argument("--policy", nargs="+", default=list(BOTH_POLICIES), choices=BOTH_POLICIES, metavar="NAME",
                    help=f"policies (default: all of {', '.join(BOTH_POLICIES)})")
    ap.add_argument("--step-tokens", type=int, default=STEP_TOKENS,
                    help="the live engines' step budget (max_num_batched_tokens), and the simulated elastic "
                         "pipeline's chunk")
    ap.add_argument("--cluster", choices=("all", "shared"), default=None,
                    help="'all': a fresh `mooncaked --role all` per policy (default); 'shared': one set of engines, "
                         "one conductor per policy side by side (default with --quick)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="replay every policy this many times, every other round in reverse order, and compare "
                         "the mean (the simulation is deterministic: it runs once)")
    ap.add_argument("--prefill", type=int, default=2, help="prefill instances")
    ap.add_argument("--decode", type=int, default=2, help="decode instances")
    ap.add_argument("--model", default="tiny", help="'tiny' (a random checkpoint made here), 'default' or a path")
    ap.add_argument("--block-size", type=int, default=4, help="tokens per KV block")
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                    help="each engine's KV cache (and pool share); big enough that nothing is evicted")
    ap.add_argument("--heartbeat-interval", type=float, default=0.2, help="engines' heartbeat interval, seconds")
    ap.add_argument("--profile", default=None, help="a profile JSON (tools/profile_engine.py); default: measure one")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds one live request may take")
    ap.add_argument("--seed", type=int, default=0, help="token synthesis and simulation seed")
    ap.add_argument("--work-dir", default=None, help="folder for the model, profile and logs (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="120 requests on a shared cluster (~1.5 min on 2 cores)")
    ap.add_argument("--json", metavar="OUT", help="write one JSON object to OUT ('-': stdout, no table)")
    ap.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"),
                    help="the live processes' log level; DEBUG logs each request's predicted and measured prefill "
                         "(conductor/placement.py), in the logs folder")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_requests = min(args.max_requests, 120)
        args.cluster = args.cluster or "shared"
    args.cluster = args.cluster or "all"
    if args.skip < 0 or (args.threads is not None and args.threads < 1):
        ap.error("--skip must be >= 0 and --threads >= 1")
    if args.rounds < 1 or args.step_tokens < 1:
        ap.error("--rounds and --step-tokens must be >= 1")
    if args.max_requests < 1 or args.prefill < 1 or args.decode < 1 or args.length_scale <= 0 or args.time_scale < 0:
        ap.error("--max-requests, --prefill, --decode and --length-scale must be positive, --time-scale >= 0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cmp = run(args)
    except (OSError, RuntimeError, TimeoutError, ValueError) as e:
        print(f"replay_vs_sim: {e}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(cmp))
        return 0
    c = cmp["config"]
    print(f"{c['max_requests']} requests of {Path(c['trace']).name} from request {c['skip']} (time x{c['time_scale']:g}, lengths "
          f"x{c['length_scale']:g}), {c['prefill']}P+{c['decode']}D, cluster '{c['cluster']}', model {c['model']}, "
          f"{c['wall_s']:.0f} s")
    print(format_table(cmp))
    if args.json:
        Path(args.json).write_text(json.dumps(cmp, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
