"""`mooncaked --role store`: the Mooncake Store master (metadata only, never the bytes).

With `--etcd HOST:PORT[,...]` several masters run side by side: each campaigns for the
leadership through an etcd lease (store/leadership.py); the leader serves, the others stand
by and answer UNAVAILABLE naming it, and one of them takes over when the leader's lease
lapses. Clients follow with `--store etcd://...` (store/master_link.py).
"""

from __future__ import annotations

import asyncio
import logging

from mooncaked import proc_title
from mooncaked.config import HostPort, StoreConfig, StorePolicyConfig
from mooncaked.rpc import sd_notify
from mooncaked.security import Security
from mooncaked.startup import listening, tell_parent_port
from mooncaked.store import metrics
from mooncaked.store.records import Policy
from mooncaked.store.gc_freeze import MetadataFreeze
from mooncaked.store.master_runner import MasterRunner
from mooncaked.store.service import HOST_ID
from mooncaked.tasks import spawn

log = logging.getLogger(__name__)

FREEZE_TICK_S = 5.0  # how often the metadata freeze reports and checks whether to unfreeze


def policy_of(cfg: StorePolicyConfig) -> Policy:
    """The master's policy from the settings (`store` or `all`); a client silent for heartbeat_timeout_s is dead."""
    return Policy(replicas=cfg.store_replicas, lease_s=cfg.store_lease_s, high_watermark=cfg.store_high_watermark,
                  client_ttl_s=cfg.heartbeat_timeout_s)


async def run_store_role(cfg: StoreConfig, parent_pid: int | None = None) -> int:
    """``parent_pid``: the `all` process this store is a child of, told the port it bound (its --listen port
    may be 0 there: any free one)."""
    fast_port = None if cfg.store_fast_path_port < 0 else cfg.store_fast_path_port
    security = Security.from_config(cfg)
    runner = MasterRunner(policy_of(cfg), str(cfg.listen), fast_path_port=fast_port, security=security)
    if cfg.etcd:
        runner.service.gate.stand_by()  # nothing is served before the first campaign says who leads
    # gRPC's bind names --listen itself; an OSError here is the fast path's port (the process then exits)
    with listening("--store-fast-path-port", HostPort(cfg.listen.host, cfg.store_fast_path_port)):
        port = await runner.start()
    runner.server.install_signal_handlers()
    address = f"{cfg.advertise_address.host}:{port}"
    name = cfg.instance_name(port)
    runner.service.name = name
    proc_title.name_known(cfg.role, name)
    fast = runner.service.fast_path_port
    leadership = campaign = None
    if cfg.etcd:
        leadership, campaign = start_campaign(runner, [str(e) for e in cfg.etcd], security, name, address,
                                              cfg.etcd_prefix, cfg.etcd_lease_ttl_s)
    else:
        metrics.IS_LEADER.set(1)  # alone, it leads
    ha = f"; HA through etcd {','.join(str(e) for e in cfg.etcd)} (standing by until elected)" if cfg.etcd else ""
    print(f"mooncaked store {name}: gRPC on {address} (StoreMaster, epoch {runner.master.epoch}; "
          f"fast path {f'on port {fast}' if fast else 'off'}){ha}; security: {security.mode}", flush=True)
    if parent_pid is not None and not tell_parent_port(parent_pid, "store", port):
        # the parent waits for this port before it starts anything else: exiting is what it can act on
        raise RuntimeError(f"could not tell the `all` process {parent_pid} which port the store master bound")
    sd_notify(f"READY=1\nSTATUS=StoreMaster on {address}")
    freeze = MetadataFreeze()  # this process holds the pool's metadata: keep it out of full collections
    freeze.install()
    ticking = spawn(_tick_every(freeze, FREEZE_TICK_S), "gc-freeze")
    await runner.server.stopping.wait()
    ticking.cancel()
    freeze.uninstall()

    # nothing in flight is worth waiting for: metadata is rebuilt by the clients' remounts
    sd_notify("STOPPING=1")
    log.info("%s stopping", name)
    if leadership is not None and campaign is not None:
        campaign.cancel()
        await asyncio.gather(campaign, return_exceptions=True)
        await leadership.resign()  # a standby takes over now, not after the lease's TTL
        await leadership.etcd.close()
    await runner.stop(min(cfg.drain_timeout_s, 2.0))
    log.info("%s stopped", name)
    return 0


async def _tick_every(freeze: MetadataFreeze, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        freeze.tick()


def start_campaign(runner: MasterRunner, etcd_endpoints: list[str], security: Security, name: str, address: str,
                   prefix: str, ttl_s: int):
    """Campaign for `runner`'s master (a started one; its gate standing by): (Leadership, its task).
    The etcd modules are imported here: a single master starts without them."""
    from mooncaked.store.etcd_gateway import EtcdGateway
    from mooncaked.store.leadership import Leadership, MasterInfo

    service = runner.service

    def info() -> MasterInfo:
        return MasterInfo(name=name, address=address, epoch=service.master.epoch,
                          fast_path_port=service.fast_path_port, fast_path_unix=service.fast_path_unix,
                          host_id=HOST_ID)

    service.name = name
    etcd = EtcdGateway(etcd_endpoints, security)
    leadership = Leadership(etcd, service.gate, info, service.forget, prefix=prefix, ttl_s=ttl_s,
                            on_lead=service.took_over)
    return leadership, spawn(leadership.run(), "store-leadership")
