"""`mooncaked --role all`: a whole cluster on one machine — conductor, store master, one prefill
and one decode — as supervised child processes started with ``spawn`` (no fork: the KV
pools are large and copy-on-write faults would dominate). A child that dies takes the
cluster down (systemd restarts it); SIGTERM drains every child."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import socket
import time

from mooncaked.config import (AllConfig, ConductorConfig, DecodeConfig, HostPort, PrefillConfig, RoleConfig,
                              StoreConfig)

log = logging.getLogger(__name__)

DEFAULT_POOL_DRAM = 256 << 20  # what the embedded prefill lends the KV pool when nothing is configured


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_configs(cfg: AllConfig) -> list[RoleConfig]:
    """Each child's config: the `all` settings that apply to its role, with its own port."""
    host = cfg.listen.host

    def make(cls: type[RoleConfig], **over) -> RoleConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}
        values.update({"name": "", **over})
        return cls(**values)

    conductor = HostPort(host, cfg.listen.port)
    store = cfg.store or HostPort(host, free_port(host))
    out: list[RoleConfig] = [make(ConductorConfig, role="conductor", listen=conductor, store=store)]
    if cfg.store is None:
        out.append(make(StoreConfig, role="store", listen=store))
    # engines bind any free port and register the one they got: no port can be taken between pick and bind
    out.append(make(PrefillConfig, role="prefill", listen=HostPort(host, 0), conductor=conductor, store=store,
                    store_dram_bytes=cfg.store_dram_bytes or DEFAULT_POOL_DRAM, name=f"prefill-{host}"))
    out.append(make(DecodeConfig, role="decode", listen=HostPort(host, 0), conductor=conductor, store=store,
                    name=f"decode-{host}"))
    return out


def _child_main(cfg: RoleConfig) -> None:
    from mooncaked.cli import run_role

    os.environ.pop("NOTIFY_SOCKET", None)  # only the `all` process speaks to systemd

    raise SystemExit(run_role(cfg, parent_pid=os.getppid()))


async def run_all_role(cfg: AllConfig) -> int:
    ctx = multiprocessing.get_context("spawn")
    children = []
    for child in child_configs(cfg):
        p = ctx.Process(target=_child_main, args=(child,), name=f"mooncaked-{child.role}", daemon=False)
        p.start()
        children.append((child, p))
    from mooncaked.rpc import sd_notify

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    conductor = f"{cfg.listen.host}:{cfg.listen.port}"
    print(f"mooncaked all: conductor on {conductor} ({len(children)} processes, model {cfg.model})\n"
          f"  try: mooncakectl --conductor {conductor} status\n"
          f"       mooncakectl --conductor {conductor} generate \"What is the capital of France?\"",
          flush=True)
    ready = await _wait_ready(conductor, stopping, children)
    if ready:
        print("mooncaked all: cluster ready", flush=True)
        sd_notify("READY=1")
    code = 0
    while not stopping.is_set():
        dead = [(c, p) for c, p in children if not p.is_alive()]
        if dead:
            for c, p in dead:
                log.error("%s process exited with code %s; stopping the cluster", c.role, p.exitcode)
            code = 1
            break
        try:
            await asyncio.wait_for(stopping.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    sd_notify("STOPPING=1")
    # engines first (they drain and deregister), then the conductor and the store
    order = sorted(children, key=lambda cp: cp[0].role in ("conductor", "store"))
    for c, p in order:
        if p.is_alive():
            p.terminate()
            await loop.run_in_executor(None, p.join, cfg.drain_timeout_s + 5)
        if p.is_alive():
            log.error("%s did not stop; killing it", c.role)
            p.kill()
            p.join()
    return code


async def _wait_ready(conductor: str, stopping: asyncio.Event, children) -> bool:
    """Until the conductor reports a serving prefill and decode instance."""
    import grpc

    from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc

    async with grpc.aio.insecure_channel(conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        start = time.monotonic()
        while not stopping.is_set():
            if any(not p.is_alive() for _, p in children):
                return False
            try:
                st = await stub.Status(conductor_pb2.StatusRequest(), timeout=2)
                roles = {i.role for i in st.instances if i.state == 2}
                if len(roles) >= 2:
                    log.info("cluster ready after %.1fs", time.monotonic() - start)
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    return False
