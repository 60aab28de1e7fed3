"""`mooncaked --role store`: the Mooncake Store master (metadata only, never the bytes)."""

from __future__ import annotations

import logging

from mooncaked.config import HostPort, StoreConfig, StorePolicyConfig
from mooncaked.rpc import sd_notify
from mooncaked.security import Security
from mooncaked.startup import listening
from mooncaked.store.records import Policy
from mooncaked.store.service import MasterRunner

log = logging.getLogger(__name__)


def policy_of(cfg: StorePolicyConfig) -> Policy:
    """The master's policy from the settings (`store` or `all`); a client silent for heartbeat_timeout_s is dead."""
    return Policy(replicas=cfg.store_replicas, lease_s=cfg.store_lease_s, high_watermark=cfg.store_high_watermark,
                  client_ttl_s=cfg.heartbeat_timeout_s)


async def run_store_role(cfg: StoreConfig) -> int:
    fast_port = None if cfg.store_fast_path_port < 0 else cfg.store_fast_path_port
    security = Security.from_config(cfg)
    runner = MasterRunner(policy_of(cfg), str(cfg.listen), fast_path_port=fast_port, security=security)
    # gRPC's bind names --listen itself; an OSError here is the fast path's port (the process then exits)
    with listening("--store-fast-path-port", HostPort(cfg.listen.host, cfg.store_fast_path_port)):
        port = await runner.start()
    runner.server.install_signal_handlers()
    address = f"{cfg.advertise_address.host}:{port}"
    fast = runner.service.fast_path_port
    print(f"mooncaked store {cfg.instance_name(port)}: gRPC on {address} (StoreMaster, epoch {runner.master.epoch}; "
          f"fast path {f'on port {fast}' if fast else 'off'}); security: {security.mode}", flush=True)
    sd_notify("READY=1")
    await runner.server.stopping.wait()

    # nothing in flight is worth waiting for: metadata is rebuilt by the clients' remounts
    sd_notify("STOPPING=1")
    log.info("%s stopping", cfg.name)
    await runner.stop(min(cfg.drain_timeout_s, 2.0))
    log.info("%s stopped", cfg.name)
    return 0
