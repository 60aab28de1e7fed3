"""Replay a Mooncake-format trace through the conductor's scheduling policies, in simulation.

N prefill and M decode instances are simulated (discrete events) with step times from a
profile: a built-in model of a bigger GPU (``a800-llama2-70b``: 8x A800 per instance, a
LLaMA2-70B-like model, so the numbers compare with the paper's) or a JSON profile measured
on a real engine (see ``Profile.from_json``). The policies, prefix index and cost models
are the live conductor's own code. Each policy replays the whole trace on the same cluster
(same instance speeds and jitter); a table of policy x (TTFT mean/p90, TBT SLO attainment,
SLO attainment, goodput, early rejections, late drops, prefill tokens computed / wasted /
reused, cache hit rate) is printed.

A measured profile (``tools/profile_engine.py --out FILE.json``) and ``--time-scale`` /
``--length-scale`` / ``--max-requests`` as given to ``tools/replay.py`` predict what a replay
of the same slice on that cluster shape reports, under the same names: ``mean_ttft_s``,
``p90_ttft_s``, ``cache_hit_rate`` (cached prompt tokens / prompt tokens),
``prefill_tokens_computed``.

``--shared-cores C --instance-threads T``: every instance on one host with C cores, T torch threads
each (``tools/sim/cores.py``): busy instances share the cores, as the engines of ``mooncaked --role all``
do; without it each instance has a machine of its own.

Chunked pipeline parallel (CPP) groups: ``--pipeline-groups G --pipeline-stages S`` make G
groups of S of the ``--prefill`` machines, each one prefill unit (``tools/sim/pipeline.py``);
``--policy mooncaked`` (ours) pipelines a long prompt over idle single instances instead
(the conductor's ``ElasticMooncakedPolicy`` with the profile's pipeline shape, ``tools/sim/elastic.py``).

    python tools/simulate.py --trace tools/traces/synthetic_trace.jsonl --prefill 16 --decode 16
    python tools/simulate.py --seeds 4 --pipeline-groups 2 --pipeline-stages 4 --policy mooncake mooncaked_static
    python tools/simulate.py --quick --json -            # one JSON object on stdout
    python tools/simulate.py --profile engine.json --prefill 2 --decode 2 --max-requests 120 \
        --time-scale 0.2 --length-scale 0.01             # the slice tools/replay.py sends
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from mooncaked.conductor.cost_model import PROFILES, Profile  # noqa: E402
from mooncaked.conductor.early_rejection import SLO  # noqa: E402
from mooncaked.conductor.pipeline_cost import DEFAULT_CHUNK_TOKENS  # noqa: E402
from mooncaked.conductor.policies import ALL_POLICY_NAMES, DEFAULT_BALANCING_THRESHOLD  # noqa: E402
from sim.elastic import DEFAULT_MAX_STAGES, ELASTIC_POLICY, make_sim_policy  # noqa: E402
from sim.engine import SimConfig, Simulation  # noqa: E402
from sim.metrics import PolicyResult, average, format_table  # noqa: E402
from sim.trace import DEFAULT_TRACE, load_trace  # noqa: E402

log = logging.getLogger("simulate")

QUICK_REQUESTS = 1000


def load_profile(spec: str) -> Profile:
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"--profile: {spec!r} is neither a built-in profile ({', '.join(PROFILES)}) nor a file")
    return Profile.from_json(path)


def shape_text(args: argparse.Namespace) -> str:
    if not args.pipeline_groups:
        return "all single"
    singles = args.prefill - args.pipeline_groups * args.pipeline_stages
    return (f"{args.pipeline_groups} CPP groups x {args.pipeline_stages} stages, {args.cpp_chunk_tokens}-token chunks"
            f" + {singles} single")


def run(args: argparse.Namespace) -> list[PolicyResult]:
    trace = load_trace(args.trace, args.max_requests, args.time_scale)
    if not trace:
        raise SystemExit(f"{args.trace}: no requests")
    slo = SLO(args.ttft_slo, args.tbt_slo)
    cfg = SimConfig(prefill=args.prefill, decode=args.decode, profile=load_profile(args.profile), slo=slo,
                    seed=args.seed, noise=args.noise, heterogeneity=args.heterogeneity,
                    cache_blocks=args.cache_blocks, kv_capacity_tokens=args.kv_capacity_tokens,
                    length_scale=args.length_scale, pipeline_groups=args.pipeline_groups,
                    pipeline_stages=args.pipeline_stages, cpp_chunk_tokens=args.cpp_chunk_tokens,
                    cpp_group_pulls=args.cpp_group_pulls, shared_cores=args.shared_cores,
                    instance_threads=args.instance_threads)
    log.info("%d requests over %.0f s; %d prefill (%s) + %d decode instances, profile %s", len(trace),
             trace[-1].arrival_s - trace[0].arrival_s, args.prefill, shape_text(args), args.decode, cfg.profile.name)
    results = []
    for name in args.policy:
        runs = []
        for seed in range(args.seed, args.seed + args.seeds):
            policy = make_sim_policy(name, cfg.profile, chunk_tokens=args.cpp_chunk_tokens,
                                     max_stages=args.elastic_max_stages,
                                     slo=None if args.no_early_rejection else slo, seed=seed,
                                     kvcache_balancing_threshold=args.threshold)
            runs.append(Simulation(trace, dataclasses.replace(cfg, seed=seed), policy).run())
            log.info("%s (seed %d): mean TTFT %.2f s, %.1f s of wall time", name, seed, runs[-1].mean_ttft_s,
                     runs[-1].wall_s)
        results.append(average(runs))
    return results


def parser() -> argparse.ArgumentParser:
    """The tool's flags (also what tools/replay_vs_sim.py fills for its slices, defaults and all)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    ap.add_argument("--prefill", type=int, default=16, help="prefill instances")
    ap.add_argument("--decode", type=int, default=16, help="decode instances")
    ap.add_argument("--pipeline-groups", type=int, default=0,
                    help="of the --prefill machines, this many form chunked pipeline (CPP) groups, each one "
                         "prefill unit; the rest stay single")
    ap.add_argument("--pipeline-stages", type=int, default=2, help="machines (stages) per CPP group")
    ap.add_argument("--cpp-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                    help="prompt tokens per pipeline chunk")
    ap.add_argument("--cpp-group-pulls", action="store_true",
                    help="let CPP groups pull prefix blocks from the pool (the live router does not yet: a group "
                         "reuses its stages' own caches only)")
    ap.add_argument("--shared-cores", type=float, default=None,
                    help="every instance on one host with this many cores, as `mooncaked --role all` runs them "
                         "(busy instances share them; default: each instance on a machine of its own)")
    ap.add_argument("--instance-threads", type=int, default=1,
                    help="with --shared-cores: torch threads per instance (as the profile was measured)")
    ap.add_argument("--policy", nargs="+", default=list(ALL_POLICY_NAMES), choices=ALL_POLICY_NAMES,
                    metavar="NAME", help=f"policies to compare (default: all of {', '.join(ALL_POLICY_NAMES)}; "
                                         f"{ELASTIC_POLICY} pipelines a prompt over idle single instances lent "
                                         "to it)")
    ap.add_argument("--elastic-max-stages", type=int, default=DEFAULT_MAX_STAGES,
                    help=f"most machines {ELASTIC_POLICY} pipelines one prompt over")
    ap.add_argument("--profile", default="a800-llama2-70b", help=f"built-in ({', '.join(PROFILES)}) or a JSON file")
    ap.add_argument("--ttft-slo", type=float, default=SLO().ttft_s, help="seconds")
    ap.add_argument("--tbt-slo", type=float, default=SLO().tbt_s, help="seconds")
    ap.add_argument("--no-early-rejection", action="store_true",
                    help="never reject for a predicted SLO miss, as a conductor started without --ttft-slo-s / "
                         "--tbt-slo-s (the SLOs are still measured)")
    ap.add_argument("--threshold", type=float, default=DEFAULT_BALANCING_THRESHOLD,
                    help="kvcache_balancing_threshold of the mooncake policy")
    ap.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="arrival time = trace time x this (< 1: more load; 0: all at once), as in replay.py")
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="input/output lengths and the 512-token trace block x this, as replay.py sends them")
    ap.add_argument("--cache-blocks", type=int, default=None, help="prefix cache per prefill instance, in blocks")
    ap.add_argument("--kv-capacity-tokens", type=int, default=None, help="KV room per decode instance")
    ap.add_argument("--noise", type=float, default=0.05, help="log-normal jitter of prefill times (sigma)")
    ap.add_argument("--heterogeneity", type=float, default=0.1, help="instance speeds in [1-h, 1+h]")
    ap.add_argument("--seed", type=int, default=0, help="seed of instance speeds, jitter and random choices")
    ap.add_argument("--seeds", type=int, default=1,
                    help="average each policy over this many seeds (runs are chaotic under load)")
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests only (< 1 min)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT ('-': stdout, no table)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        ap.error("--prefill and --decode must be at least 1")
    if args.pipeline_groups < 0 or (args.pipeline_groups and (
            args.pipeline_stages < 2 or args.pipeline_groups * args.pipeline_stages > args.prefill)):
        ap.error("--pipeline-groups x --pipeline-stages (at least 2) must fit in --prefill")
    if args.cpp_chunk_tokens < 1 or args.elastic_max_stages < 1:
        ap.error("--cpp-chunk-tokens and --elastic-max-stages must be positive")
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    if args.time_scale < 0 or args.length_scale <= 0:
        ap.error("--time-scale must be >= 0 and --length-scale > 0")
    if args.quick and args.max_requests is None:
        args.max_requests = QUICK_REQUESTS
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        results = run(args)
    except (OSError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    report = {
        "config": {"trace": str(args.trace), "prefill": args.prefill, "decode": args.decode, "profile": args.profile,
                   "pipeline_groups": args.pipeline_groups, "pipeline_stages": args.pipeline_stages,
                   "cpp_chunk_tokens": args.cpp_chunk_tokens, "cpp_group_pulls": args.cpp_group_pulls,
                   "requests": results[0].requests, "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo,
                   "early_rejection": not args.no_early_rejection,
                   "kvcache_balancing_threshold": args.threshold, "time_scale": args.time_scale,
                   "length_scale": args.length_scale, "seed": args.seed,
                   "seeds": args.seeds},
        "policies": {r.policy: r.as_json() for r in results},
    }
    if args.json == "-":
        print(json.dumps(report))
        return 0
    print(f"{results[0].requests} requests, {args.prefill} prefill ({shape_text(args)}) + {args.decode} decode, "
          f"profile {args.profile}, SLO TTFT {args.ttft_slo:g} s / TBT {args.tbt_slo * 1e3:g} ms"
          + (f", mean of {args.seeds} seeds" if args.seeds > 1 else ""))
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
