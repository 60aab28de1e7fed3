"""`mooncaked` command line: `mooncaked generate PROMPT` runs the engine in this process.

(The cluster roles, `mooncaked --role ...`, come with the cluster work.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from mooncaked.engine import Engine, RequestError, SamplingParams


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (chat template applied) or, with --raw, the plain text")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), an HF folder or a .gguf")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template")


async def _stream(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    start = time.perf_counter()
    first = None
    n = 0
    async for out in engine.stream(prompt, params):
        if first is None:
            first = time.perf_counter() - start
        n += len(out.new_token_ids)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            total = time.perf_counter() - start
            sys.stdout.write("\n")
            print(f"[{n} tokens, first after {first:.2f}s, {n / total:.1f} tok/s, finish={out.finish_reason}]",
                  file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except RequestError as e:
        print(f"mooncaked: {e}", file=sys.stderr)
        return 2
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                    block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes)
    tok = engine.tokenizer
    try:
        ids = tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user", "content": args.prompt}])
        asyncio.run(_stream(engine, ids, params))
    except (RequestError, ValueError) as e:
        print(f"mooncaked: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncaked", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_args(sub.add_parser("generate", help="generate from one prompt in this process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return cmd_generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
