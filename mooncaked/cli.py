"""`mooncaked`: the one executable.

    mooncaked --role conductor|prefill|decode|store|all [--config FILE.toml] [flags]
    mooncaked generate "PROMPT"      # the engine alone, in this process
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

log = logging.getLogger("mooncaked")


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncaked generate", description="generate from one prompt in this process")
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
    p.add_argument("--log-level", default="WARNING")
    return p


async def _stream(engine, prompt: list[int], params) -> None:
    start = time.perf_counter()
    first = None
    n = 0
    async for out in engine.stream(prompt, params):
        first = first if first is not None else time.perf_counter() - start
        n += len(out.new_token_ids)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            total = time.perf_counter() - start
            print(f"[{n} tokens, first after {first:.2f}s, {n / total:.1f} tok/s, finish={out.finish_reason}]",
                  file=sys.stderr)


def cmd_generate(argv: list[str]) -> int:
    from mooncaked.engine import Engine, RequestError, SamplingParams

    args = _generate_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except RequestError as e:
        print(f"mooncaked: {e}", file=sys.stderr)
        return 2
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                                    kv_cache_bytes=args.kv_cache_bytes)
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


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")


async def _watch_parent(parent_pid: int) -> None:
    """Children of `--role all` follow their parent: when it is gone, stop as if signalled."""
    import signal

    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("parent %d is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


async def _run(cfg, parent_pid: int | None) -> int:
    from mooncaked.tasks import spawn

    if parent_pid is not None:
        spawn(_watch_parent(parent_pid), "watch-parent")
    if getattr(cfg, "metrics", None) is not None:
        import prometheus_client

        server, _ = prometheus_client.start_http_server(cfg.metrics.port, cfg.metrics.host)
        print(f"mooncaked {cfg.role}: metrics on http://{cfg.metrics.host}:{server.server_port}/metrics", flush=True)
    if cfg.role in ("prefill", "decode"):
        from mooncaked.roles.engine_role import run_engine_role

        return await run_engine_role(cfg, cfg.role)
    if cfg.role == "conductor":
        from mooncaked.roles.conductor import run_conductor_role

        return await run_conductor_role(cfg)
    if cfg.role == "store":
        from mooncaked.roles.store_role import run_store_role

        return await run_store_role(cfg)
    from mooncaked.roles.all_role import run_all_role

    return await run_all_role(cfg)


def run_role(cfg, parent_pid: int | None = None) -> int:
    """Run one role's daemon on uvloop until it stops; returns the exit code."""
    import uvloop

    _setup_logging(cfg.log_level)
    try:
        return uvloop.run(_run(cfg, parent_pid))
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return cmd_generate(argv[1:])
    from mooncaked.config import ConfigError, add_config_args, load_config

    parser = argparse.ArgumentParser(prog="mooncaked", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args, os.environ)
    except ConfigError as e:
        print(f"mooncaked: {e}", file=sys.stderr)
        return 2
    return run_role(cfg)


if __name__ == "__main__":
    sys.exit(main())
