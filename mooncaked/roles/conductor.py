"""`mooncaked --role conductor`: wiring only. The gRPC ``Conductor`` servicer turns wire messages
into the core's records and back (conductor/wire.py) and the core's typed errors into gRPC
statuses (``STATUS_OF``); the request path, membership and status live in
``conductor/core.py`` (a ``Conductor``), which the HTTP front calls too."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from mooncaked import proc_title
from mooncaked.conductor import errors, metrics
from mooncaked.conductor.core import Conductor
from mooncaked.conductor.early_rejection import SLO
from mooncaked.conductor.grpc_engine import GrpcEngineLink
from mooncaked.conductor.policies import DEFAULT_MAX_STAGES, LiveElasticShape, make_policy
from mooncaked.conductor.prompt_tokenizer import PromptTokenizer
from mooncaked.conductor.router import SchedulerState
from mooncaked.conductor.status import ConductorFacts, StoreProbe
from mooncaked.conductor.wire import (STATE_ENUMS, chunk_to_proto, heartbeat_from_proto, registration_from_proto,
                                     spec_from_proto, status_to_proto)
from mooncaked.engine.tokenizer import Tokenizer
from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc
from mooncaked.security import Security

log = logging.getLogger(__name__)

# the core's errors -> gRPC statuses, in one table; a peer's failure carries its engine's kind (below)
STATUS_OF: dict[type[errors.ConductorError], grpc.StatusCode] = {
    errors.BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Rejected: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NoInstance: grpc.StatusCode.UNAVAILABLE,
    errors.PeerFailed: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
}
# a failed peer's status is the one its engine answered (by kind), as a client saw it before
PEER_STATUS_OF: dict[str, grpc.StatusCode] = {
    "unavailable": grpc.StatusCode.UNAVAILABLE, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED, "cancelled": grpc.StatusCode.CANCELLED,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE, "aborted": grpc.StatusCode.ABORTED,
    "not_found": grpc.StatusCode.NOT_FOUND, "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION, "internal": grpc.StatusCode.INTERNAL,
}


def status_of(e: errors.ConductorError) -> grpc.StatusCode:
    if isinstance(e, errors.PeerFailed):
        return PEER_STATUS_OF.get(e.kind, grpc.StatusCode.INTERNAL)
    return STATUS_OF.get(type(e), grpc.StatusCode.INTERNAL)


class ConductorService(conductor_pb2_grpc.ConductorServicer):
    """The gRPC front of a ``Conductor``: proto <-> records, typed errors -> statuses."""

    def __init__(self, core: Conductor) -> None:
        self.core = core

    async def Register(self, request, context):
        try:
            interval = self.core.register(registration_from_proto(request))
        except errors.ConductorError as e:
            await context.abort(status_of(e), str(e))
        return conductor_pb2.RegisterReply(heartbeat_interval_s=interval)

    async def Heartbeat(self, request, context):
        return conductor_pb2.HeartbeatReply(known=self.core.heartbeat(heartbeat_from_proto(request)))

    async def Deregister(self, request, context):
        return conductor_pb2.DeregisterReply(known=self.core.deregister(request.name))

    async def SetDrain(self, request, context):
        try:
            name, state = await self.core.set_drain(request.name, request.drain)
        except errors.ConductorError as e:
            await context.abort(status_of(e), str(e))
        return conductor_pb2.SetDrainReply(state=STATE_ENUMS.get(state, 0), name=name)

    async def Status(self, request, context):
        return status_to_proto(await self.core.status(with_pool_stats=not request.without_pool_stats))

    async def Generate(self, request, context):
        try:
            spec = spec_from_proto(request, context.time_remaining(), front="grpc")
        except errors.BadRequest as e:
            metrics.refused("grpc", "invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async with contextlib.aclosing(self.core.generate(spec)) as stream:
                async for chunk in stream:
                    yield chunk_to_proto(chunk)
        except errors.ConductorError as e:
            await context.abort(status_of(e), str(e))


async def run_conductor_role(cfg) -> int:
    """Serve the Conductor service (gRPC) and the HTTP front until SIGTERM."""
    from pathlib import Path

    from mooncaked.conductor.http_api import start_http
    from mooncaked.conductor.http_limits import HttpLimits
    from mooncaked.config import HostPort
    from mooncaked.conductor.openai_schema import ServedModel
    from mooncaked.engine.loader import read_model_config, resolve_model_dir
    from mooncaked.rpc import RoleServer, sd_notify
    from mooncaked.tasks import spawn

    loop = asyncio.get_running_loop()
    security = Security.from_config(cfg)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    model_dir = await loop.run_in_executor(None, resolve_model_dir, cfg.model, cache_dir)
    model_config, _ = read_model_config(model_dir)
    # early rejection is opt-in: without an SLO a request is never refused for predicted lateness
    slo = None
    if cfg.ttft_slo_s is not None or cfg.tbt_slo_s is not None:
        slo = SLO(cfg.ttft_slo_s or float("inf"), cfg.tbt_slo_s or float("inf"))
    # an elastic pipeline splits the model's layers (at most one stage a layer), in the engines' step budget
    shape = LiveElasticShape(num_layers=model_config.num_layers)
    policy = make_policy(cfg.policy, slo=slo, kvcache_balancing_threshold=cfg.kvcache_balancing_threshold,
                         shape_for=shape, max_stages=min(DEFAULT_MAX_STAGES, model_config.num_layers))
    tokenizer = Tokenizer(model_dir)
    prompts = PromptTokenizer.for_model(tokenizer, model_dir, model_config.max_position_embeddings)
    core = Conductor(tokenizer, model_config, model_dir.name, cfg.block_size, cfg.hash_seed, cfg.heartbeat_interval_s,
                     cfg.heartbeat_timeout_s, GrpcEngineLink.dialer(security), SchedulerState(policy),
                     ready_timeout_s=cfg.ready_timeout_s, prompts=prompts)
    # mutual TLS, the cluster token on every call but Generate/Status, the API key on Generate
    server = RoleServer(str(cfg.listen), ["mooncake.v1.Conductor"], security=security, api_key=cfg.api_key)
    conductor_pb2_grpc.add_ConductorServicer_to_server(ConductorService(core), server.server)
    port = await server.start()
    # clients may name the model as configured (a path, "default") or by the id engines report
    names = tuple(dict.fromkeys([model_dir.name, str(cfg.model or "default")]))
    served = ServedModel(names, model_config.max_position_embeddings, model_config.vocab_size)
    try:
        http, http_port = await start_http(core, served, cfg.http.host, cfg.http.port, cfg.api_key,
                                           cfg.drain_timeout_s, security=security,
                                           metrics_require_key=cfg.metrics_require_key,
                                           limits=HttpLimits.from_config(cfg))
    except OSError as e:
        await server.stop(0)
        from mooncaked.startup import bind_error

        raise bind_error("--http", cfg.http, e) from e
    sweeper = spawn(core.sweep_forever(), "sweep")
    pool_watch = watcher = None
    if cfg.store is not None:
        from mooncaked.conductor.pool_watch import PoolWatch

        pool_watch = PoolWatch(str(cfg.store), core.model_id, core.index, security=security)
        core.watches_pool = True
        watcher = spawn(pool_watch.run(), "pool-watch")
        core.store = StoreProbe(str(cfg.store), security=security)  # its figures for Status
    server.install_signal_handlers()
    http_at = str(HostPort(cfg.http.host, http_port))
    grpc_at = str(HostPort(cfg.listen.host, port))
    core.facts = ConductorFacts(address=str(HostPort(cfg.advertise_address.host, port)),
                                http_address=str(HostPort(cfg.advertise_address.host, http_port)),
                                policy=cfg.policy, ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                                ready_timeout_s=cfg.ready_timeout_s)
    proc_title.name_known(cfg.role, cfg.instance_name(port))
    print(f"mooncaked conductor {cfg.instance_name(port)}: gRPC on {grpc_at}, HTTP on {http_at}, "
          f"model {model_dir.name}, KV pool {cfg.store or 'none'}; security: {security.mode}"
          f"{', HTTPS' if security.tls else ''}{', API key' if cfg.api_key else ''}", flush=True)
    # both fronts accept now (requests wait for engines while the cluster starts); STATUS tells
    # `--role all` (and systemctl status) where
    sd_notify(f"READY=1\nSTATUS=gRPC on {grpc_at}, HTTP on {http_at}")
    await server.stopping.wait()
    sd_notify("STOPPING=1")
    sweeper.cancel()
    if watcher is not None:
        watcher.cancel()
    # both fronts stop accepting and drain their streams together, within one drain timeout
    await asyncio.gather(http.cleanup(), server.stop(cfg.drain_timeout_s))
    await core.close()  # the instances' links and the store probe
    if pool_watch is not None:
        await pool_watch.close()
    return 0
