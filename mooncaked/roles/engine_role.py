"""`mooncaked --role prefill|decode`: load the model, open the data plane, serve, register, drain.

Two ways out, both bounded: SIGTERM/SIGINT drains (up to drain_timeout_s), aborts what is left
and exits 0; a dead engine driver (a bug: request errors never kill it) turns gRPC health
NOT_SERVING and heartbeats DEAD (the conductor stops routing here), then exits 1 so systemd's
Restart=on-failure starts a fresh process. Past drain_timeout_s + STOP_MARGIN_S after either
begins, the process ends even if a step or a peer hangs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from mooncaked import proc_title
from mooncaked.config import WorkerConfig
from mooncaked.engine import Engine
from mooncaked.engine.engine_thread import build_on_engine_thread
from mooncaked.engine.loader import resolve_model_dir
from mooncaked.proto.mooncake.v1 import common_pb2, conductor_pb2, engine_pb2_grpc
from mooncaked.convert import layout_to_proto
from mooncaked.instance.heartbeat import InstanceHeartbeat
from mooncaked.instance.kv_push import KV_REGION
from mooncaked.instance.pool_cache import PoolCache, stage_pool_id
from mooncaked.roles.membership import STARTUP_GRACE_S, Memberships
from mooncaked.rpc import RoleServer, sd_notify
from mooncaked.security import Security
from mooncaked.startup import StartupError, listening
from mooncaked.tasks import spawn
from mooncaked.roles.worker import PeerLinks, WorkerService
from mooncaked.transfer import TransferEngine

log = logging.getLogger(__name__)

_ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
# what shutdown may take past the drain: aborting, leaving the cluster, closing servers and the data plane
STOP_MARGIN_S = 5.0
DEREGISTER_TIMEOUT_S = 2.0


async def run_engine_role(cfg: WorkerConfig, role: str) -> int:
    loop = asyncio.get_running_loop()
    security = Security.from_config(cfg)  # TLS and the cluster secret, read once, before anything slow
    backend = "tcp" if cfg.transfer_backend == "auto" else cfg.transfer_backend
    transfer = TransferEngine(backend=backend, host=cfg.transfer_listen.host, port=cfg.transfer_listen.port,
                              rate_limit_bytes_per_s=cfg.transfer_rate_limit, token=security.token,
                              io_process=cfg.io_process)
    if cfg.transfer_io_process and not cfg.io_process:
        log.info("transfer I/O process off: --transfer-rate-limit is set, and only the in-process data plane paces")
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    model_dir = await loop.run_in_executor(None, resolve_model_dir, cfg.model, cache_dir)
    # built on the thread that will step it: one OpenMP team in the process (engine/engine_thread.py)
    engine = await loop.run_in_executor(None, build_on_engine_thread, lambda thread: Engine(
        model_dir, cfg.engine_config(), lambda n: transfer.alloc_region(KV_REGION, n), thread), cfg.threads)
    engine.start_driver(loop)
    with listening("--transfer-listen", cfg.transfer_listen):
        await transfer.start()
    # a prefill's plan may pull KV from a peer's cache: its Lend over gRPC, the bytes over the transfer engine
    peers = PeerLinks(security)
    service = WorkerService(cfg.name, role, engine, transfer, model_dir.name, cfg.kv_push, peers=peers)
    worker = service.worker
    if cfg.debug_kill_engine_after_steps:
        engine.layer_hook = _dying_hook(engine.layer_hook, cfg.debug_kill_engine_after_steps)
    server = RoleServer(str(cfg.listen), ["mooncake.v1.Engine"], security=security)
    engine_pb2_grpc.add_EngineServicer_to_server(service, server.server)
    port = await server.start()
    address = f"{cfg.advertise_address.host}:{port}"
    # one naming rule in every mode: --name, else ROLE-HOST-PORT with the port just bound (--listen
    # HOST:0, as under --role all, learns it only now); the pool's segments are named after it too
    cfg = dataclasses.replace(cfg, name=cfg.instance_name(port))
    service.name = cfg.name
    proc_title.name_known(cfg.role, cfg.name)
    try:
        store = await _start_store_client(cfg, transfer, security) if cfg.store is not None else None
    except StartupError:
        await server.stop(0)
        await peers.close()
        engine.close()
        await transfer.close()
        raise
    stage = getattr(cfg, "pipeline_stage", None)
    member = conductor_pb2.PipelineMember(group=cfg.pipeline_group, stage=stage[0], stages=stage[1],
                                          chunk_tokens=cfg.cpp_chunk_tokens) if stage else None
    if store is not None:
        # nobody routes here before we register; a CPP stage's blocks hold only its layers: they go to the
        # pool under keys of their own, which only stages of the same layers read
        worker.pool = PoolCache(store, engine, stage_pool_id(service.model_id, engine.stage))
    def register() -> conductor_pb2.RegisterRequest:
        return conductor_pb2.RegisterRequest(name=cfg.name, role=_ROLES[role], address=address,
                                             model_id=service.model_id, layout=layout_to_proto(service.layout),
                                             transfer=service.endpoint(), pipeline=member,
                                             step_tokens=engine.config.step_tokens)

    # every conductor listed (--conductor A,B) gets our registration, heartbeats and every KV event
    heartbeats = InstanceHeartbeat(worker)
    membership = Memberships([str(c) for c in cfg.conductor], register, heartbeats.beat, cfg.heartbeat_interval_s,
                             security, heartbeats.snapshot)
    tasks = [*membership.start(), spawn(service.expire_reservations(), "reservations")]
    server.install_signal_handlers()
    # a conductor that never accepts us (not running, a wrong address or secret) is the user's to fix:
    # one line and exit 1 rather than an engine that serves nobody (systemd restarts it later)
    unjoined = await membership.joined(cfg.join_timeout_s) if cfg.join_timeout_s else None
    if unjoined is None:
        reads = store.owner_server.address if store is not None and store.owner_server is not None else ""
        print(f"mooncaked {role} {cfg.name}: gRPC on {address}, transfer on {transfer.address}"
              f"{f', pool reads by key on {reads}' if reads else ''}, model {model_dir}; security: {security.mode}",
              flush=True)
        sd_notify("READY=1")
        exit_code = await _until_stop_or_death(server, engine, membership, cfg.name)
    else:
        exit_code = 1

    # drain: take no new work, finish what is in flight, abort the rest, leave the cluster
    sd_notify("STOPPING=1")
    _exit_hard_after(cfg.drain_timeout_s + STOP_MARGIN_S, cfg.name)
    worker.draining = True
    if unjoined is None and engine.driver_failure is None:
        log.info("%s draining (up to %.0fs)", cfg.name, cfg.drain_timeout_s)
        deadline = time.monotonic() + cfg.drain_timeout_s
        while not worker.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not worker.idle():
            log.warning("%s: drain timeout; aborting what is left", cfg.name)
            engine.abort_all()
            for _ in range(10):  # the handlers answer their callers as the aborts land
                if worker.idle():
                    break
                await asyncio.sleep(0.1)
    await membership.deregister(cfg.name, DEREGISTER_TIMEOUT_S)  # every conductor at once, each bounded
    for t in tasks:
        t.cancel()
    await server.stop(1.0)
    await membership.close()
    await peers.close()
    engine.close()
    if store is not None:
        await store.close()
    await transfer.close()
    if unjoined is not None:
        raise StartupError(unjoined)
    log.info("%s stopped", cfg.name)
    return exit_code


async def _until_stop_or_death(server: RoleServer, engine: Engine, membership: Memberships, name: str) -> int:
    """Serve until a signal (then 0) or the engine's driver dies (then 1, once the conductor was told)."""
    died = asyncio.Event()
    engine.on_driver_death = lambda exc: died.set()
    if engine.driver_failure is not None:
        died.set()
    stop, death = asyncio.ensure_future(server.stopping.wait()), asyncio.ensure_future(died.wait())
    await asyncio.wait([stop, death], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    death.cancel()
    if not died.is_set():
        return 0
    log.critical("%s: the engine driver died (%r); reporting NOT_SERVING and DEAD, then exiting 1 for a restart",
                 name, engine.driver_failure)
    sd_notify("STATUS=engine driver died; exiting for a restart")
    await server.not_serving()
    # heartbeats now say DEAD: give two of them the chance to reach the conductor (it stops routing here
    # at the first), unless a signal asks us to go at once
    try:
        await asyncio.wait_for(server.stopping.wait(), 2 * membership.interval_s)
    except asyncio.TimeoutError:
        pass
    return 1


def _exit_hard_after(seconds: float, name: str) -> None:
    """The bound on shutdown: a daemon thread ends the process if the orderly path has not by then
    (a stuck model step, a peer that never answers); Python's exit would otherwise wait for them."""

    def exit_now() -> None:
        log.error("%s: shutdown took over %.0fs; exiting now", name, seconds)
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


class DebugEngineFault(BaseException):
    """Raised by --debug-kill-engine-after-steps. A BaseException on purpose: the engine's step fails
    only its requests for an Exception; this one escapes it, as a bug would, and kills the driver."""


def _dying_hook(inner, steps: int):
    """A layer hook that lets ``steps`` engine steps run, then raises DebugEngineFault in the next."""
    seen = 0

    def hook(layer: int, seqs) -> None:
        nonlocal seen
        if layer == 0:
            seen += 1
            if seen > steps:
                raise DebugEngineFault(f"--debug-kill-engine-after-steps {steps}: killing the engine driver")
        if inner is not None:
            inner(layer, seqs)

    return hook


async def _start_store_client(cfg: WorkerConfig, transfer: TransferEngine, security: Security):
    """Join the KV pool, waiting up to --join-timeout-s for its master (0: for ever).

    A cluster's processes start in any order, so the master may come up after us: one warning says
    so (naming --store), the rest of the retries are quiet. A master that never answers is the
    user's to fix (not running, a wrong address or secret): a `StartupError`, not an engine that
    quietly serves without the pool it was told to use."""
    from mooncaked.store import StoreClient, StoreClientConfig, StoreError

    store = StoreClient(StoreClientConfig.from_worker(cfg), transfer=transfer, security=security)
    started = time.monotonic()
    deadline = started + cfg.join_timeout_s
    warned = False
    while True:
        try:
            await store.start()
            log.info("%s joined the KV pool at %s (DRAM %d bytes, LMDB %s)", cfg.name, cfg.store,
                     cfg.store_dram_bytes, cfg.store_lmdb_path or "none")
            return store
        except StoreError as e:
            if cfg.join_timeout_s and time.monotonic() >= deadline:
                await store.close()
                raise StartupError(f"the store master {cfg.store} (--store) did not take this engine within "
                                   f"{cfg.join_timeout_s:g}s: {e}; start it or fix the address or secret "
                                   f"(--join-timeout-s sets the wait)") from e
            away_s = time.monotonic() - started
            if not warned and away_s >= STARTUP_GRACE_S:  # roles started together come up in any order
                warned = True
                log.warning("store master %s (--store) is not reachable yet (%s, for %.0fs); retrying",
                            cfg.store, e, away_s)
            else:
                log.debug("store master %s not reachable yet (%s)", cfg.store, e)
            await asyncio.sleep(1.0)
