"""`mooncaked --role all`: a whole cluster on one machine — conductor, store master,
``--prefill-instances`` prefills and ``--decode-instances`` decodes (one each by default) — as
supervised child processes started with ``spawn`` (no fork: the KV pools are large and
copy-on-write faults would dominate). Each engine binds its own gRPC and transfer ports, names
itself after them and keeps its LMDB tier in a subfolder of its own; every prefill lends the pool
DRAM. A child that dies takes the cluster down (systemd restarts it); SIGTERM drains every child.

What it prints is true when printed: "conductor on ..." once the conductor child accepts on
both fronts (it says so over a private notify socket, systemd's protocol), from which moment
a request waits for the engines rather than failing (conductor/readiness.py); "cluster
ready" once every engine serves, which is also when systemd hears READY=1."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncaked import proc_title
from mooncaked.config import (AllConfig, ConductorConfig, DecodeConfig, HostPort, PrefillConfig, RoleConfig,
                              StoreConfig)
from mooncaked.roles.all_metrics import children_registry, numbered, process_labels

log = logging.getLogger(__name__)

DEFAULT_POOL_DRAM = 256 << 20  # what the embedded prefill lends the KV pool when nothing is configured


def engine_count(cfg: AllConfig) -> int:
    """The engine processes ``cfg`` starts: every prefill instance's stages and every decode."""
    return cfg.prefill_instances * cfg.pipeline_stages + cfg.decode_instances


def engine_threads(engines: int, cores: int | None = None) -> int:
    """Torch threads per engine process when the user set none: the host's cores shared out (at least
    one each), or 0 (torch's own choice) when OMP_NUM_THREADS says. Measured on 2 cores, one request:
    a decode with 2 threads beside a busy conductor took 6.0 s for 128 tokens, with 1 thread 5.2 s."""
    if os.environ.get("OMP_NUM_THREADS"):
        return 0
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // engines)


def _child(cfg: AllConfig, cls: type[RoleConfig], **over) -> RoleConfig:
    """A child's config: the `all` settings that apply to its role, then ``over``."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}
    # the parent serves --metrics; the conductor's own are on its HTTP port
    values.update({"name": "", "metrics": None, **over})
    return cls(**values)


def embedded_store(cfg: AllConfig) -> StoreConfig | None:
    """The store master's config when `all` runs one (no --store given): it binds any free port and tells
    the parent which (startup.tell_parent_port) before any other child starts, as a port picked here and
    bound later by the child could be taken by another process in between."""
    if cfg.store is not None:
        return None
    return _child(cfg, StoreConfig, role="store", listen=HostPort(cfg.listen.host, 0))  # type: ignore[return-value]


def child_configs(cfg: AllConfig, store: HostPort | None = None) -> list[RoleConfig]:
    """The conductor's and each engine's config, each with its own port; ``store``: where the embedded
    store listens (--store, when given, is where the external one does)."""
    host = cfg.listen.host
    at = store or cfg.store
    if at is None:
        raise ValueError("child_configs needs the embedded store's address (or --store)")

    def engine(cls: type[RoleConfig], role: str, i: int, **over) -> RoleConfig:
        """Two engines cannot share a data-plane port (nor a reads-by-key port) or an LMDB folder: any port, a
        folder each (ROLE for the first of a role, ROLE-I for the others). Only an engine that lends DRAM gets an
        LMDB tier: its objects are served by promoting them into that DRAM (a decode lends none unless
        --store-dram-bytes says)."""
        folder = numbered(role, i)
        lends_dram = over.get("store_dram_bytes", cfg.store_dram_bytes) > 0
        lmdb = str(Path(cfg.store_lmdb_path) / folder) if cfg.store_lmdb_path and lends_dram else None
        return _child(cfg, cls, role=role, listen=HostPort(host, 0), conductor=conductor, store=at,
                      transfer_listen=HostPort(cfg.transfer_listen.host, 0), store_reads_port=0, store_lmdb_path=lmdb,
                      store_lmdb_bytes=cfg.store_lmdb_bytes if lmdb else 0, threads=threads, **over)

    threads = cfg.threads or engine_threads(engine_count(cfg))

    conductor = HostPort(host, cfg.listen.port)
    out: list[RoleConfig] = [_child(cfg, ConductorConfig, role="conductor", listen=conductor, store=at)]
    # engines bind any free port and register the one they got: no port can be taken between pick and bind;
    # they name themselves ROLE-HOST-PORT after that port, as every instance without --name does
    for i in range(cfg.prefill_instances):
        dram = cfg.store_dram_bytes or DEFAULT_POOL_DRAM
        if cfg.pipeline_stages == 1:
            out.append(engine(PrefillConfig, "prefill", i, store_dram_bytes=dram))
            continue
        for k in range(cfg.pipeline_stages):  # one CPP group: stage processes named after their ports
            out.append(engine(PrefillConfig, "prefill", i * cfg.pipeline_stages + k, store_dram_bytes=dram,
                              pipeline_group=f"group-{i}", pipeline_stage=(k, cfg.pipeline_stages)))
    for i in range(cfg.decode_instances):
        out.append(engine(DecodeConfig, "decode", i))
    return out


class ChildPorts:
    """Ports the children bound themselves and told us of (startup.tell_parent_port), by kind and pid."""

    def __init__(self) -> None:
        self._told: dict[tuple[str, int], asyncio.Future[int]] = {}

    def future(self, kind: str, pid: int) -> asyncio.Future[int]:
        fut = self._told.get((kind, pid))
        if fut is None:
            fut = self._told[(kind, pid)] = asyncio.get_running_loop().create_future()
        return fut

    def told(self, kind: str, pid: int, port: int) -> None:
        fut = self.future(kind, pid)
        if not fut.done():
            fut.set_result(port)


def _serve_metrics(cfg: AllConfig) -> dict[str, str | None]:
    """--metrics serves every child's metrics as one page (all_metrics.py). Returns the scrape targets by
    label, empty here: each child is added as it starts, None until it told the port it bound
    (``_scrape_when_told``)."""
    import prometheus_client

    from mooncaked.startup import listening

    assert cfg.metrics is not None
    targets: dict[str, str | None] = {}
    with listening("--metrics", cfg.metrics):
        server, _ = prometheus_client.start_http_server(cfg.metrics.port, cfg.metrics.host,
                                                        registry=children_registry(targets))
    print(f"mooncaked all: metrics of every process on http://{cfg.metrics.host}:{server.server_port}/metrics",
          flush=True)
    return targets


def _scrape_when_told(ports: ChildPorts, pid: int, label: str, targets: dict[str, str | None]) -> None:
    targets[label] = None

    def told(fut: asyncio.Future[int]) -> None:
        if not fut.cancelled():
            targets[label] = f"http://127.0.0.1:{fut.result()}/metrics"

    ports.future("metrics", pid).add_done_callback(told)


def _child_main(cfg: RoleConfig, notify: str | None = None) -> None:
    from mooncaked.cli import run_role

    # a process group of its own: a terminal's Ctrl-C (SIGINT to the whole foreground group) reaches the
    # parent alone, which stops the children in order (engines drain and deregister while the conductor
    # and the store still answer); every child still follows its parent (cli._watch_parent)
    os.setpgid(0, 0)
    proc_title.set_child(cfg.role)

    # only the `all` process speaks to systemd; the conductor tells it (``notify``) when it accepts
    if notify:
        os.environ["NOTIFY_SOCKET"] = notify
    else:
        os.environ.pop("NOTIFY_SOCKET", None)

    raise SystemExit(run_role(cfg, parent_pid=os.getppid()))


def _parent_socket() -> tuple[socket.socket, str]:
    """The datagram socket children talk to the parent on: the conductor's systemd-style READY=1
    (as its NOTIFY_SOCKET, spelled with '@'), the ports children bound and any child's one-line startup
    error. Its name is in the abstract namespace, where any local process can send to it: the kernel
    stamps each datagram with its sender's pid (SO_PASSCRED), and only our children's are heard."""
    from mooncaked.startup import parent_socket_name

    name = parent_socket_name(os.getpid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(name)
    sock.setblocking(False)
    return sock, "@" + name[1:]


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


async def _datagram(sock: socket.socket) -> tuple[str, int | None]:
    """The next datagram and the pid the kernel says sent it (None: no credentials came)."""
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(_CREDENTIALS.size))
        except BlockingIOError:
            readable = loop.create_future()
            loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            continue
        pid = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _CREDENTIALS.size:
                pid = _CREDENTIALS.unpack_from(payload)[0]
        return data.decode(errors="replace"), pid


async def _hear_children(sock: socket.socket, conductor_ready: asyncio.Future, ports: ChildPorts,
                         children: Callable[[], set[int]]) -> None:
    """Resolve ``conductor_ready`` with the conductor's READY=1 fields; take the ports children bound;
    print the first child's error line (later ones are the cluster stopping, not news). ``children``: the
    pids of the processes started; a datagram from any other process is dropped."""
    from mooncaked.startup import CHILD_ERROR, child_port

    told_error = False
    while True:
        data, sender = await _datagram(sock)
        if sender is None or sender not in children():
            log.info("dropped a message on the children's socket from process %s, not a child of ours", sender)
            continue
        port = child_port(data)
        if port is not None:
            if port[1] == sender:  # a child speaks for itself only
                ports.told(*port)
            continue
        if data.startswith(CHILD_ERROR + "="):
            if not told_error:
                print(data.removeprefix(CHILD_ERROR + "="), file=sys.stderr, flush=True)
                told_error = True
            continue
        fields = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
        if fields.get("READY") == "1" and not conductor_ready.done():
            conductor_ready.set_result(fields)


async def run_all_role(cfg: AllConfig) -> int:
    ctx = multiprocessing.get_context("spawn")
    from mooncaked.security import Security
    from mooncaked.tasks import spawn

    # the children get the same settings (files, not contents) and read them themselves; reading them
    # here first makes a bad file one line before any child starts
    security = Security.from_config(cfg)

    notify, notify_at = _parent_socket()
    conductor_ready: asyncio.Future = asyncio.get_running_loop().create_future()
    ports = ChildPorts()
    children: list[tuple[RoleConfig, multiprocessing.process.BaseProcess]] = []
    hearing = spawn(_hear_children(notify, conductor_ready, ports, lambda: {p.pid for _, p in children}),
                    "hear-children")
    targets = _serve_metrics(cfg) if cfg.metrics is not None else None

    def start(child: RoleConfig) -> multiprocessing.process.BaseProcess:
        if targets is not None:  # a metrics port on loopback, any free one: the child tells us which
            child = dataclasses.replace(child, metrics=HostPort("127.0.0.1", 0))  # type: ignore[call-arg]
        told = notify_at if child.role == "conductor" else None
        p = ctx.Process(target=_child_main, args=(child, told), name=f"mooncaked-{child.role}", daemon=False)
        p.start()
        children.append((child, p))
        if targets is not None:
            assert p.pid is not None
            label = process_labels(c.role for c, _ in children)[-1]
            _scrape_when_told(ports, p.pid, label, targets)
        return p

    from mooncaked.rpc import sd_notify

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    store: HostPort | None = cfg.store
    own_store = embedded_store(cfg)
    if own_store is not None:  # first: every other child is told the port it bound
        p = start(own_store)
        assert p.pid is not None
        port = await _told(ports.future("store", p.pid), stopping, children)
        if port is not None:  # else it failed (its line is printed) or we are stopping
            store = HostPort(cfg.listen.host, port)
    if store is not None:
        for child in child_configs(cfg, store):
            start(child)
    conductor = str(HostPort(cfg.listen.host, cfg.listen.port))
    told = await _told(conductor_ready, stopping, children) if store is not None else None
    if told is not None:
        m = re.search(r"HTTP on (\S+)", told.get("STATUS", ""))
        # under TLS, mooncakectl needs the same files (and --api-key for generate, when one is set)
        tls = f" --tls-cert {cfg.tls_cert} --tls-key {cfg.tls_key} --tls-ca {cfg.tls_ca}" if security.tls else ""
        http = m.group(1) if m else str(cfg.http)
        print(f"mooncaked all: conductor on {conductor}, HTTP on {http} ({len(children)} processes, model "
              f"{cfg.model}; security: {security.mode}); requests wait until a prefill and a decode are ready\n"
              f"  try: mooncakectl --conductor {conductor}{tls} status\n"
              f"       mooncakectl --conductor {conductor}{tls} generate \"What is the capital of France?\"",
              flush=True)
        ready = await _wait_ready(conductor, stopping, children, security, engine_count(cfg))
        if ready is not None:
            names = ", ".join(f"{i.name} at {i.address}" for i in ready.instances)
            print(f"mooncaked all: cluster ready ({names})", flush=True)
            sd_notify("READY=1")
    code = 0
    while not stopping.is_set():
        dead = [(c, p) for c, p in children if not p.is_alive()]
        if dead:  # the first one's own line (on our stderr) says why; one more line says which
            c, p = dead[0]
            log.error("the %s process exited with code %s; stopping the cluster", c.role, p.exitcode)
            code = 1
            break
        try:
            await asyncio.wait_for(stopping.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    sd_notify("STOPPING=1")
    # engines first (they drain and deregister), then the conductor and the store
    order = sorted(children, key=lambda cp: {"conductor": 1, "store": 2}.get(cp[0].role, 0))
    for c, p in order:
        if p.is_alive():
            p.terminate()
            await loop.run_in_executor(None, p.join, cfg.drain_timeout_s + 5)
        if p.is_alive():
            log.error("%s did not stop; killing it", c.role)
            p.kill()
            p.join()
    await asyncio.sleep(0)  # a last child's error line, if one is on its way, is printed before we go
    hearing.cancel()
    await asyncio.gather(hearing, return_exceptions=True)  # it stops watching the socket before it closes
    notify.close()
    return code


async def _told(fut: asyncio.Future, stopping: asyncio.Event, children) -> Any:
    """What a child tells us (the conductor's READY=1 fields, once both its fronts accept; the port the
    store bound), or None once a child died or we are stopping. No deadline of its own: a child that
    cannot start exits with its error, and a slow one is the user's to stop (Ctrl-C)."""
    while not stopping.is_set():
        if any(not p.is_alive() for _, p in children):
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(fut), 0.5)
        except asyncio.TimeoutError:
            continue
    return None


async def _wait_ready(conductor: str, stopping: asyncio.Event, children, security, engines: int):
    """Until the conductor reports every engine serving (``engines`` of them, prefill and decode
    among them): its Status reply, or None."""
    import grpc

    from mooncaked.proto.mooncake.v1 import conductor_pb2, conductor_pb2_grpc

    async with security.channel(conductor) as ch:
        stub = conductor_pb2_grpc.ConductorStub(ch)
        start = time.monotonic()
        while not stopping.is_set():
            if any(not p.is_alive() for _, p in children):
                return None
            try:
                st = await stub.Status(conductor_pb2.StatusRequest(without_pool_stats=True), timeout=2)
                serving = [i for i in st.instances if i.state == 2]
                if len({i.role for i in serving}) >= 2 and len(serving) >= engines:
                    log.info("cluster ready after %.1fs", time.monotonic() - start)
                    return st
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    return None
