"""What a role checks before it starts anything slow: its ports (free, and on loopback unless
something guards them), its device and the backends it asked for, its model.

A busy port found here fails the daemon in a moment, before it loads a model, spawns
children or registers with a conductor (a second `--role all` on a taken `--listen` would
otherwise start engines that join the first cluster). The servers still map a failed bind
themselves, for a port taken between this check and their bind.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mooncaked.config import HostPort, RoleConfig
from mooncaked.security import check_exposure
from mooncaked.startup import StartupError, check_addresses

log = logging.getLogger(__name__)


def listen_addresses(cfg: RoleConfig) -> list[tuple[str, Any]]:
    """(flag, address) of every port this process itself will listen on."""
    out: list[tuple[str, Any]] = [("--listen", cfg.listen)]
    if getattr(cfg, "http", None) is not None:
        out.append(("--http", cfg.http))
    if cfg.metrics is not None:
        out.append(("--metrics", cfg.metrics))
    if cfg.role in ("prefill", "decode") and getattr(cfg, "transfer_listen", None) is not None:
        out.append(("--transfer-listen", cfg.transfer_listen))
    reads_port = getattr(cfg, "store_reads_port", 0)
    if cfg.role in ("prefill", "decode") and reads_port > 0 and getattr(cfg, "store_dram_bytes", 0):
        out.append(("--store-reads-port", HostPort(cfg.transfer_listen.host, reads_port)))  # type: ignore[attr-defined]
    fast_port = getattr(cfg, "store_fast_path_port", 0)
    if fast_port > 0 and (cfg.role == "store" or (cfg.role == "all" and cfg.store is None)):
        out.append(("--store-fast-path-port", HostPort(cfg.listen.host, fast_port)))
    return out


def check_ports(cfg: RoleConfig) -> None:
    """Raise `StartupError` naming the flag of the first address another process holds, or of the
    first one beyond loopback when nothing guards it (neither TLS nor a cluster token, no --insecure)."""
    addresses = listen_addresses(cfg)
    check_exposure(addresses, secured=bool(cfg.tls_cert or cfg.cluster_token_file), insecure=cfg.insecure)
    check_addresses(addresses)


def check_engine_choices(cfg: Any) -> None:
    """An attention backend or a transfer backend this host cannot run, named by its flag (before a
    model loads, and under `all` before any child starts)."""
    from mooncaked.engine.attention.flash_backend import flash_unavailable_reason

    if cfg.attention_backend == "flash" and (why := flash_unavailable_reason(cfg.device, cfg.block_size)):
        raise StartupError(f"--attention-backend flash: {why}; use auto (flash where it can run) or torch")
    if cfg.transfer_backend == "rdma":
        from mooncaked.transfer.rdma import unavailable_reason

        if why := unavailable_reason():
            raise StartupError(f"--transfer-backend rdma: {why}; use tcp, shm or auto")


def check_model(cfg: RoleConfig) -> Path:
    """The device (engines) and the model, resolved (a GGUF converted once, here, not by each child);
    raises the engine's own typed errors, which `startup.user_message` turns into one line."""
    from mooncaked.engine.config import check_device
    from mooncaked.engine.loader import read_model_config, resolve_model_dir

    if cfg.role in ("prefill", "decode", "all"):
        check_device(cfg.device)  # type: ignore[attr-defined]
        check_engine_choices(cfg)
    model_dir = resolve_model_dir(cfg.model, Path(cfg.cache_dir) if cfg.cache_dir else None)
    read_model_config(model_dir)
    log.debug("preflight: model %s", model_dir)
    return model_dir
