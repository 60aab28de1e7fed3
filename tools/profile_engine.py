"""Measure an engine's prefill and decode step times on this machine, as a profile for the simulator.

The simulator (``tools/simulate.py --profile FILE.json``) and the conductor's cost model
predict with ``PrefillTimeModel`` (prefill of ``n`` new tokens after a cached ``p``-token
prefix) and ``DecodeTimeModel`` (one step of a batch of ``b`` sequences holding ``c`` tokens
of KV). This tool runs a real ``Engine`` (the bundled default model, or ``--model``) with the
engine settings a cluster uses (``--block-size``, ``--max-num-batched-tokens``, ...) over a
grid of those shapes and writes the measured samples, the engine's KV capacity and context
and the sizes of a KV block; ``Profile.from_json`` fits the coefficients from the samples.

Times are the engine's own step times (the model runs), as the conductor's live models see
them: no gRPC, no KV push. Bandwidths are not measured; ``--remote-bps`` and friends set
them (the defaults suit TCP on loopback).

    python tools/profile_engine.py --out engine.json            # several minutes on 2 CPU cores
    python tools/profile_engine.py --quick --out engine.json    # a few minutes (SmolLM2), seconds for a tiny model
    python tools/simulate.py --profile engine.json --prefill 2 --decode 2 --max-requests 120 \\
        --time-scale 0.2 --length-scale 0.01
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

log = logging.getLogger("profile_engine")


@dataclass(frozen=True)
class Grid:
    """The shapes measured: prefill (new tokens x cached prefix) and decode (batch x context per sequence)."""

    prefill_new: tuple[int, ...]
    prefill_prefix: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    decode_steps: int
    repeats: int  # each prefill shape is the best of this many runs; the decode grid runs this many times


FULL = Grid((16, 64, 256, 512, 1024, 2048), (0, 256, 1024), (1, 4, 16, 32), (64, 512, 1024), 12, 2)
QUICK = Grid((16, 128, 512), (0, 256), (1, 8), (64, 256), 6, 2)


class Profiler:
    def __init__(self, engine, seed: int = 0) -> None:
        import torch

        self.engine = engine
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = engine.model_config.vocab_size
        self.low = min(100, self.vocab // 8)  # clear of the special tokens at the bottom

    def tokens(self, n: int) -> list[int]:
        import torch

        return torch.randint(self.low, self.vocab, (n,), generator=self.gen).tolist()

    def _run(self, prompts: list[list[int]], max_tokens: int):
        from mooncaked.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.drain_step_log()
        self.engine.generate(prompts, params)
        return self.engine.drain_step_log()

    def prefill(self, new: int, prefix: int) -> tuple[int, int, float]:
        """One prompt of ``prefix`` cached + ``new`` fresh tokens: (uncached, cached, seconds of its steps)."""
        head = self.tokens(prefix)
        if prefix:
            self._run([head], 1)  # now cached (prefix is a multiple of the block size)
        before = self.engine.stats().prompt_tokens_cached
        steps = self._run([head + self.tokens(new)], 1)
        cached = self.engine.stats().prompt_tokens_cached - before
        seconds = sum(s.seconds for s in steps if s.prefill_tokens)
        return prefix + new - cached, cached, seconds

    def decode(self, batch: int, context: int, steps: int) -> list[tuple[int, int, float]]:
        """``batch`` prompts of ``context`` tokens decoding together: (batch, KV tokens, seconds) per decode step."""
        records = self._run([self.tokens(context) for _ in range(batch)], steps + 1)
        return [(r.decodes, r.decode_context, r.seconds) for r in records
                if not r.prefill_tokens and r.decodes == batch]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from mooncaked.engine import Engine
    from mooncaked.engine.kv_cache import bytes_per_block

    if args.threads:
        torch.set_num_threads(args.threads)
    grid = QUICK if args.quick else FULL
    engine = Engine.from_pretrained(args.model, device=args.device, block_size=args.block_size,
                                    kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=max(64, max(grid.decode_batch)),
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    # a decode sample's prompts start together (a prefill sample is one prompt)
                                    prefill_pack_tokens=1 << 30)
    bs = args.block_size
    limit = engine.max_model_len
    num_blocks = engine.block_manager.num_blocks
    prof = Profiler(engine, args.seed)
    prof.prefill(32, 0)  # warm-up: first runs pay for allocations and kernel selection
    prof.decode(2, 32, 2)
    prefill, decode = [], []
    t0 = time.perf_counter()
    for p in grid.prefill_prefix:
        p = p // bs * bs
        for n in grid.prefill_new:
            if p + n >= limit or -(-(p + n) // bs) * 2 > num_blocks:
                continue
            # the best of a few: one pre-empted run on a shared machine (a 16-token prefill measured 4x a
            # 128-token one) bends the whole fit
            uncached, cached, s = min((prof.prefill(n, p) for _ in range(grid.repeats)), key=lambda r: r[2])
            prefill.append([uncached, cached, s])
            log.info("prefill %5d new after %5d cached: %.4f s (best of %d)", uncached, cached, s, grid.repeats)
    for _ in range(grid.repeats):
        for b in grid.decode_batch:
            for c in grid.decode_context:
                if c + grid.decode_steps + 1 >= limit or b * -(-(c + grid.decode_steps + 1) // bs) > num_blocks:
                    continue
                rows = prof.decode(b, c, grid.decode_steps)
                decode.extend([list(r) for r in rows])
                if rows:
                    log.info("decode batch %3d x %5d context: %.4f s/step", b, c, sum(r[2] for r in rows) / len(rows))
    name = f"{engine.model_dir.name}-{args.device}".lower()
    return {
        "name": name,
        "block_size": bs,
        "block_bytes": bytes_per_block(engine.model_config, bs, engine.dtype),
        "prefill_samples": prefill,
        "decode_samples": decode,
        "local_bps": args.local_bps,
        "remote_bps": args.remote_bps,
        "slow_bps": args.slow_bps,
        "kv_capacity_tokens": num_blocks * bs,
        "cache_blocks": num_blocks,
        "max_model_len": limit,
        "notes": (f"measured by tools/profile_engine.py{' --quick' if args.quick else ''} on {platform.node()} "
                  f"({platform.machine()}, {args.device}, {torch.get_num_threads()} torch threads, "
                  f"torch {torch.__version__}), {engine.model_dir.name}, max_num_batched_tokens "
                  f"{engine.config.step_tokens}, {time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f} s"),
    }


def _positive(kind):
    def parse(s: str):
        v = kind(s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    ap.add_argument("--model", default="default", help="'default' (bundled SmolLM2), an HF folder or a .gguf file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block-size", type=_positive(int), default=16, help="tokens per KV block (the cluster's)")
    ap.add_argument("--max-num-batched-tokens", type=_positive(int), default=None,
                    help="token budget of one step (default: the engine's, by device)")
    ap.add_argument("--kv-cache-bytes", type=_positive(int), default=None, help="KV cache size (engine default)")
    ap.add_argument("--threads", type=_positive(int), default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--local-bps", type=_positive(float), default=10e9, help="own cache -> compute, bytes/s")
    ap.add_argument("--remote-bps", type=_positive(float), default=1e9, help="another instance's cache, bytes/s")
    ap.add_argument("--slow-bps", type=_positive(float), default=0.2e9, help="a disk tier, bytes/s")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--quick", action="store_true", help="fewer shapes, one repeat (~2 min for SmolLM2, 2 cores)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each measurement")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        profile = measure(args)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"profile_engine: {e}", file=sys.stderr)
        return 2
    if not profile["prefill_samples"] or not profile["decode_samples"]:
        print("profile_engine: no shape fits this engine's context and KV cache", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    from mooncaked.conductor.cost_model import DecodeTimeModel, PrefillTimeModel, Profile

    fitted = Profile.from_json(args.out)
    print(f"{profile['name']}: {len(profile['prefill_samples'])} prefill and {len(profile['decode_samples'])} decode "
          f"samples; block {profile['block_size']} tokens = {profile['block_bytes']} bytes, "
          f"{profile['cache_blocks']} blocks of KV, context {profile['max_model_len']}")
    print("  prefill: " + ", ".join(f"{k} {v:.3g}" for k, v in zip(PrefillTimeModel.names, fitted.prefill_coef)))
    print("  decode:  " + ", ".join(f"{k} {v:.3g}" for k, v in zip(DecodeTimeModel.names, fitted.decode_coef)))
    print(f"  e.g. prefill 512 new tokens {fitted.prefill_s(512, 0) * 1e3:.1f} ms, after 512 cached "
          f"{fitted.prefill_s(512, 512) * 1e3:.1f} ms; decode step of 8 x 512 "
          f"{fitted.decode_s(8, 8 * 512) * 1e3:.1f} ms")
    print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
