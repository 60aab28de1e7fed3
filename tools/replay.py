"""Replay a Mooncake-format trace against a live cluster over its OpenAI HTTP API.

The trace is JSONL, one request a line: ``timestamp`` (ms since the trace began),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token prompt
block; equal ids are equal content). We synthesize token ids so that equal hash ids give
equal token blocks (each block is drawn from a generator seeded by its hash id alone), so the
cluster sees the same prefix sharing the trace had, and send every request at its trace time
(open loop: a slow cluster does not slow the arrivals). Lengths and block size scale by
``--length-scale``; arrival gaps by ``--time-scale``.

Reports TTFT and TBT percentiles, SLO attainment (a request meets the SLO when its TTFT and
the P90 of its token gaps are both within bounds), goodput (requests meeting the SLO per
second), rejections (HTTP 429) and the prompt-cache hit rate (cached_tokens / prompt_tokens
from ``usage``). ``mean_ttft_s``, ``p90_ttft_s``, ``cache_hit_rate`` and ``prefill_tokens_computed``
are the figures ``tools/simulate.py`` predicts for the same slice, under the same names.
Writes ``report.json`` and ``replay.png`` (TTFT and TBT CDFs, throughput over time) into
``--out``.

    python tools/replay.py --trace tools/traces/synthetic_trace.jsonl --url http://127.0.0.1:8000 \\
        --time-scale 0.1 --length-scale 0.01 --max-requests 200 --out replay-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim.trace import DEFAULT_TRACE, TraceRequest, load_trace  # noqa: E402  (the one Mooncake-trace reader, shared with simulate.py)

log = logging.getLogger("replay")

TRACE_BLOCK_TOKENS = 512  # Mooncake's traces hash 512-token blocks
META_TIMEOUT_S = 10.0


# -- the trace and its token ids ----------------------------------------------------------------------
@dataclass(frozen=True)
class Synthesizer:
    """Token ids for trace requests, after length scaling; a block's ids depend only on its hash id."""

    length_scale: float
    vocab_size: int
    seed: int = 0
    max_prompt_tokens: int | None = None  # clip prompts (keeping their prefix) to fit the context

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))

    @property
    def low(self) -> int:
        return min(100, self.vocab_size // 8)  # stay clear of the special tokens at the bottom

    def block(self, hash_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, hash_id])
        return rng.integers(self.low, self.vocab_size, self.block_tokens, dtype=np.int64)

    def lengths(self, req: TraceRequest) -> tuple[int, int]:
        """(prompt tokens, output tokens) after scaling, the prompt clipped to leave room for the output."""
        n_out = max(1, round(req.output_length * self.length_scale))
        n_in = max(1, round(req.input_length * self.length_scale))
        if self.max_prompt_tokens is not None:
            n_out = min(n_out, max(1, self.max_prompt_tokens // 2))
            n_in = max(1, min(n_in, self.max_prompt_tokens - n_out))
        return n_in, n_out

    def prompt(self, index: int, req: TraceRequest) -> list[int]:
        n_in, _ = self.lengths(req)
        parts = [self.block(h) for h in req.hash_ids[: -(-n_in // self.block_tokens)]]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if len(ids) < n_in:  # more tokens than hash ids cover: a tail private to this request
            tail = np.random.default_rng([self.seed, 1 << 62, index]).integers(
                self.low, self.vocab_size, n_in - len(ids), dtype=np.int64)
            ids = np.concatenate([ids, tail])
        return ids[:n_in].tolist()


# -- sending ------------------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    sent_s: float  # scheduled send time, seconds from the replay's start
    prompt_len: int
    max_tokens: int
    status: int = 0  # HTTP status; 0: no answer (connection failed or timed out)
    error: str = ""
    timed_out: bool = False
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content chunk, from sent_s
    done_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and bool(self.chunk_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


async def send_one(session: aiohttp.ClientSession, url: str, model: str, res: Result, prompt: list[int],
                   t0: float, timeout_s: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": res.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = t0 + res.sent_s
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    res.error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    res.error = text[:200]
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = msg["error"].get("message", "error in stream")
                elif msg.get("choices"):
                    res.chunk_s.append(time.perf_counter() - start)
                elif msg.get("usage"):
                    use = msg["usage"]
                    res.prompt_tokens = use["prompt_tokens"]
                    res.completion_tokens = use["completion_tokens"]
                    res.cached_tokens = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            res.done_s = time.perf_counter() - t0
    except asyncio.TimeoutError:
        res.timed_out, res.error = True, f"no complete answer within {timeout_s:.0f}s"
    except (aiohttp.ClientError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def fetch_model(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=META_TIMEOUT_S)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}/v1/models answered {resp.status}: {(await resp.text())[:200]}")
        return (await resp.json())["data"][0]


async def replay(args: argparse.Namespace) -> tuple[list[Result], dict[str, Any]]:
    from tqdm import tqdm

    trace = load_trace(args.trace, args.max_requests)
    if not trace:
        raise ValueError(f"{args.trace} holds no requests")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.max_inflight)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        card = await fetch_model(session, args.url)
        model = args.model or card["id"]
        vocab = args.vocab_size or card.get("vocab_size")
        if not vocab:
            raise ValueError("the server does not report vocab_size; pass --vocab-size")
        ctx = card.get("max_model_len") if args.fit_context else None
        synth = Synthesizer(args.length_scale, int(vocab), args.seed, ctx - 1 if ctx else None)
        first_ts = min(r.arrival_s for r in trace)
        results: list[Result] = []
        tasks: list[asyncio.Task] = []
        clipped = 0
        bar = tqdm(total=len(trace), unit="req", desc="replay", file=sys.stderr, disable=args.no_progress)
        rejected = 0

        def finished(task: asyncio.Task) -> None:
            nonlocal rejected
            if not task.cancelled() and task.result().status == 429:
                rejected += 1
                bar.set_postfix(rejected=rejected)
            bar.update(1)

        t0 = time.perf_counter()
        for i, req in enumerate(trace):
            n_in, n_out = synth.lengths(req)
            clipped += n_in < max(1, round(req.input_length * args.length_scale))
            res = Result(i, (req.arrival_s - first_ts) * args.time_scale, n_in, n_out)
            prompt = synth.prompt(i, req)
            delay = t0 + res.sent_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(session, args.url, model, res, prompt, t0, args.request_timeout))
            task.add_done_callback(finished)
            tasks.append(task)
            results.append(res)
        await asyncio.gather(*tasks)
        bar.close()
        wall = time.perf_counter() - t0
    settings = {"trace": str(args.trace), "url": args.url, "model": model, "time_scale": args.time_scale,
                "length_scale": args.length_scale, "block_tokens": synth.block_tokens, "vocab_size": vocab,
                "slo_ttft_s": args.slo_ttft, "slo_tbt_s": args.slo_tbt, "requests_clipped_to_context": clipped,
                "wall_s": wall}
    return results, settings


# -- the report ---------------------------------------------------------------------------------------
def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def meets_slo(r: Result, slo_ttft: float, slo_tbt: float) -> bool:
    gaps = r.gaps_s
    return r.ok and r.ttft_s <= slo_ttft and (not gaps or float(np.percentile(gaps, 90)) <= slo_tbt)


def summarize(results: list[Result], settings: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    slo_ttft, slo_tbt = settings["slo_ttft_s"], settings["slo_tbt_s"]
    met = [r for r in ok if meets_slo(r, slo_ttft, slo_tbt)]
    ends = [r.done_s for r in ok if r.done_s is not None]
    span = max(ends) if ends else settings["wall_s"]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = percentiles([r.ttft_s for r in ok])
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = "timeout" if r.timed_out else str(r.status or "connection")
            errors[key] = errors.get(key, 0) + 1
    sample = {f"{r.status or 'no answer'}": r.error for r in results if r.error}
    return {
        "settings": settings,
        "requests": {"sent": len(results), "completed": len(ok), "rejected": sum(r.status == 429 for r in results),
                     "failed": len(results) - len(ok), "timed_out": sum(r.timed_out for r in results)},
        "failures_by_status": errors,
        "error_samples": sample,
        # the figures tools/simulate.py predicts, under its names
        "mean_ttft_s": ttft["mean"],
        "p90_ttft_s": ttft["p90"],
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "prefill_tokens_computed": prompt - cached,
        "ttft_s": ttft,
        "tbt_s": percentiles([g for r in ok for g in r.gaps_s]),
        "slo_attainment": len(met) / len(results) if results else 0.0,
        "ttft_slo_attainment": sum(r.ttft_s <= slo_ttft for r in ok) / len(results) if results else 0.0,
        "tbt_slo_attainment": (sum(meets_slo(r, float("inf"), slo_tbt) for r in ok) / len(ok)) if ok else 0.0,
        "goodput_rps": len(met) / span if span > 0 else 0.0,
        "throughput_tok_s": sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0,
        "duration_s": span,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "hit_rate": cached / prompt if prompt else 0.0,  # = cache_hit_rate (the older name)
    }


def plot(results: list[Result], report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, xs, slo, name in ((axes[0], [r.ttft_s for r in ok], report["settings"]["slo_ttft_s"], "TTFT"),
                              (axes[1], [g for r in ok for g in r.gaps_s], report["settings"]["slo_tbt_s"], "TBT")):
        if xs:
            xs = np.sort(np.asarray(xs))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g}s")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.set_title(f"{name} CDF")
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    # output tokens over time: each request's tokens spread over its chunks' arrivals
    span = max(report["duration_s"], 1e-3)
    bins = np.linspace(0, span, min(60, max(5, len(ok))) + 1)
    times = [r.sent_s + c for r in ok for c in r.chunk_s]
    weights = [r.completion_tokens / len(r.chunk_s) for r in ok for _ in r.chunk_s]
    hist, edges = np.histogram(times, bins=bins, weights=weights) if times else (np.zeros(len(bins) - 1), bins)
    axes[2].step(edges[:-1], hist / np.diff(edges), where="post")
    axes[2].set_xlabel("time since start (s)")
    axes[2].set_ylabel("output tokens / s")
    axes[2].set_title(f"throughput ({report['requests']['completed']}/{report['requests']['sent']} done, "
                      f"{report['requests']['rejected']} rejected)")
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _positive(kind):
    def parse(s: str):
        v = kind(s)
        if v < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
        return v
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="Mooncake-format JSONL trace (default: the bundled tools/traces/synthetic_trace.jsonl)")
    ap.add_argument("--url", required=True, help="the conductor's HTTP front, e.g. http://127.0.0.1:8000")
    ap.add_argument("--time-scale", type=_positive(float), default=1.0,
                    help="send time = trace time x this (1 real time, 0.1 ten times faster, 0 all at once)")
    ap.add_argument("--length-scale", type=_positive(float), default=1.0,
                    help="input/output lengths and the 512-token block size x this")
    ap.add_argument("--max-requests", type=_positive(int), default=None, help="replay only the first N requests")
    ap.add_argument("--out", type=Path, default=Path("replay-out"), help="folder for report.json and replay.png")
    ap.add_argument("--slo-ttft", type=float, default=30.0, help="TTFT SLO in seconds")
    ap.add_argument("--slo-tbt", type=float, default=0.1, help="TBT SLO (P90 of a request's token gaps), seconds")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take in all")
    ap.add_argument("--max-inflight", type=int, default=512, help="open connections at most")
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this "
                    "(default: what /v1/models reports)")
    ap.add_argument("--no-fit-context", dest="fit_context", action="store_false",
                    help="send prompts longer than the model's context as they are (they get 400)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token synthesis")
    ap.add_argument("--api-key", default=None, help="bearer token, when the server requires one")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.length_scale <= 0:
        ap.error("--length-scale must be > 0")
    args.url = args.url.rstrip("/")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        results, settings = asyncio.run(replay(args))
    except (OSError, ValueError, RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    report = summarize(results, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(
        {**report, "per_request": [{**asdict(r), "ttft_s": r.ttft_s} for r in results]}, indent=1))
    plot(results, report, args.out / "replay.png")
    q = report["requests"]
    ttft, tbt = report["ttft_s"], report["tbt_s"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}ms"

    print(f"replayed {q['sent']} requests in {report['duration_s']:.1f}s: {q['completed']} completed, "
          f"{q['rejected']} rejected, {q['failed'] - q['rejected']} other failures\n"
          f"  TTFT  p50 {ms(ttft['p50'])}  p90 {ms(ttft['p90'])}  p99 {ms(ttft['p99'])}\n"
          f"  TBT   p50 {ms(tbt['p50'])}  p90 {ms(tbt['p90'])}  p99 {ms(tbt['p99'])}\n"
          f"  SLO attainment {report['slo_attainment']:.1%} (TTFT <= {args.slo_ttft:g}s, TBT p90 <= "
          f"{args.slo_tbt:g}s), goodput {report['goodput_rps']:.2f} req/s, "
          f"{report['throughput_tok_s']:.1f} output tok/s\n"
          f"  cache hit rate {report['cache_hit_rate']:.1%} "
          f"({report['cached_tokens']}/{report['prompt_tokens']} prompt tokens "
          f"cached)\n  wrote {args.out / 'report.json'} and {args.out / 'replay.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
