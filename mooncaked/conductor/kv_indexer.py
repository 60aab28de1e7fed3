"""Mooncake's KV-indexer API (the conductor-indexer RFC, kvcache-ai/Mooncake#1403 and its design
doc) over our global prefix index, so routers and gateways built for Mooncake's conductor
can ask ours where a prompt's KV already sits.

``/query`` answers, per tenant and instance, the longest cached prefix of a prompt in tokens
and how many of those tokens sit in each tier (GPU = HBM, CPU = DRAM, DISK = LMDB).
``/register`` and ``/unregister`` let an external KV source (an engine or cache daemon that
is not one of our instances) announce itself; ``/events`` (ours, RFC #1527 field names) lets
it report what it stores, and from then on it appears in ``/query`` answers. Our own
instances are the ``default`` tenant, DP rank 0; their blocks arrive through heartbeats.
With a store master configured, the Mooncake Store pool is one more instance of that
tenant, ``store`` (CPU = its DRAM, DISK = its LMDB tier), fed by the master's pool events.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncaked.conductor.openai_schema import ApiError, bad
from mooncaked.conductor.prefix_index import POOL_HOLDER
from mooncaked.conductor.registry import DEAD
from mooncaked.hashing import block_hashes

if TYPE_CHECKING:
    from mooncaked.conductor.core import Conductor

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
TIER_NAMES = {"hbm": "GPU", "dram": "CPU", "lmdb": "DISK"}  # our media -> the RFC's tier names
MEDIA = {"gpu": "hbm", "hbm": "hbm", "npu": "hbm", "device": "hbm", "cpu": "dram", "cpu_pinned": "dram",
         "dram": "dram", "host": "dram", "disk": "lmdb", "ssd": "lmdb", "lmdb": "lmdb"}  # RFC media -> ours
MAX_SOURCES = 4096
MAX_NAME = 256  # characters of an id, endpoint or model name: sources are kept in memory
MAX_DP_RANK = 1 << 16
_U32, _U64 = 1 << 32, 1 << 64


@dataclass
class Source:
    """An external KV source as it registered."""

    instance_id: str
    tenant_id: str
    dp_rank: int
    endpoint: str
    type: str
    replay_endpoint: str | None = None
    registered_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        """Its name in the prefix index: one per (instance, tenant, DP rank), as the RFC keys them."""
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str(body: dict, name: str, required: bool = False, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        if required:
            raise bad(f"{name} is required", name)
        return default
    if not isinstance(v, str) or (required and not v):
        raise bad(f"{name} must be a non-empty string", name)
    if len(v) > MAX_NAME:
        raise bad(f"{name} is longer than {MAX_NAME} characters", name)
    return v


def _dp_rank(v: Any) -> int:
    if not _is_int(v) or not 0 <= v < MAX_DP_RANK:
        raise bad(f"dp_rank must be an integer in [0, {MAX_DP_RANK})", "dp_rank")
    return v


def _ints(v: Any, name: str, limit: int, max_len: int) -> list[int]:
    if isinstance(v, list) and len(v) > max_len:  # before looking at each: a long list is refused at once
        raise bad(f"{name} has {len(v)} entries; at most {max_len} (the model's context)", name)
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < limit for t in v):
        raise bad(f"{name} must be a list of integers in [0, {limit})", name)
    return v


class KVIndexer:
    """The indexer handlers' logic over the conductor's core: its registry, prefix index and the
    cluster's model, block size and hash seed."""

    def __init__(self, service: Conductor) -> None:
        self.service = service
        self.sources: dict[str, Source] = {}

    # -- shared checks ----------------------------------------------------------------------------
    @property
    def _max_tokens(self) -> int:
        return self.service.model_config.max_position_embeddings

    @property
    def _max_blocks(self) -> int:
        return self._max_tokens // self.service.block_size + 1

    def _body(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    def _check_model(self, body: dict, name: str) -> None:
        model = _str(body, name, required=True)
        if model != self.service.model_id:
            raise bad(f"{name} {model!r} is not served here; this cluster serves {self.service.model_id!r}", name,
                      "model_not_found")

    def _check_namespace(self, body: dict, salt_field: str) -> None:
        if body.get("lora_name") not in (None, "") or body.get("lora_id") not in (None, "", 0):
            raise bad("this cluster serves no LoRA adapters; send lora_name empty or not at all", "lora_name")
        if body.get(salt_field) not in (None, ""):
            raise bad(f"this cluster hashes blocks without a salt; send {salt_field} empty or not at all",
                      salt_field)

    def _check_block_size(self, body: dict, required: bool = True) -> None:
        bs = body.get("block_size")
        if bs is None and not required:
            return
        if not _is_int(bs):
            raise bad("block_size must be an integer", "block_size")
        if bs != self.service.block_size:
            raise bad(f"block_size {bs} does not match this cluster's block size {self.service.block_size} "
                      "(hashes of other sizes never match)", "block_size")

    # -- /query -----------------------------------------------------------------------------------
    def query(self, body: Any, by_hash: bool) -> dict[str, Any]:
        body = self._body(body)
        self._check_model(body, "model")
        self._check_namespace(body, "cache_salt")
        self._check_block_size(body)
        tenant = _str(body, "tenant_id", default=DEFAULT_TENANT)
        only = _str(body, "instance_id")
        bs = self.service.block_size
        if by_hash:
            name = "seq_hashes" if "seq_hashes" in body else "block_hash"
            if body.get(name) is None:
                raise bad("seq_hashes is required", "seq_hashes")
            hashes = _ints(body[name], name, _U64, self._max_blocks)
        else:
            if body.get("token_ids") is None:
                raise bad("token_ids is required", "token_ids")
            hashes = block_hashes(_ints(body["token_ids"], "token_ids", _U32, self._max_tokens), bs, self.service.hash_seed)
        index = self.service.index
        matched = index.match(hashes)
        answer: dict[str, dict[str, Any]] = {}
        for instance_id, key, dp in self._targets(tenant):
            if only is not None and instance_id != only:
                continue
            n = matched.get(key, 0)
            media = index.media(key, hashes[:n]) if n else {}
            row = answer.setdefault(instance_id, {"longest_matched": 0, **{t: 0 for t in TIER_NAMES.values()},
                                                  "DP": {}})
            row["longest_matched"] = max(row["longest_matched"], n * bs)
            for medium, blocks in media.items():
                tier = TIER_NAMES.get(medium, medium.upper())
                row[tier] = max(row.get(tier, 0), blocks * bs)
            row["DP"][str(dp)] = n * bs
        return {tenant: answer}

    def _targets(self, tenant: str) -> list[tuple[str, str, int]]:
        """(instance_id, name in the index, DP rank) of everything the tenant can be routed to."""
        out = []
        if tenant == DEFAULT_TENANT:
            out += [(name, name, 0) for name, inst in sorted(self.service.registry.instances.items())
                    if inst.state != DEAD]
            if getattr(self.service, "watches_pool", False):
                out.append((POOL_HOLDER, POOL_HOLDER, 0))
        out += [(s.instance_id, s.key, s.dp_rank) for s in self.sources.values() if s.tenant_id == tenant]
        return out

    # -- /register, /unregister -------------------------------------------------------------------
    def register(self, body: Any) -> dict[str, Any]:
        body = self._body(body)
        self._check_model(body, "modelname")
        self._check_namespace(body, "additionalsalt")
        self._check_block_size(body)
        instance_id = _str(body, "instance_id", required=True)
        if "|" in instance_id:
            raise bad("instance_id must not contain '|'", "instance_id")
        if instance_id in self.service.registry.instances or instance_id == POOL_HOLDER:
            raise bad(f"{instance_id!r} is one of this cluster's own instances (or its KV pool), which report "
                      "by themselves; pick another instance_id", "instance_id")
        dp = _dp_rank(body.get("dp_rank"))
        source = Source(instance_id, _str(body, "tenant_id", default=DEFAULT_TENANT), dp,
                        _str(body, "endpoint", required=True), _str(body, "type", required=True),
                        _str(body, "replay_endpoint"))
        if source.key not in self.sources and len(self.sources) >= MAX_SOURCES:
            raise ApiError(429, f"{MAX_SOURCES} sources are registered; unregister some first",
                           "rate_limit_error", None, "too_many_sources")
        self.sources[source.key] = source
        log.info("registered external KV source %s (%s at %s)", source.key, source.type, source.endpoint)
        return {"status": "registered successfully", "instance_id": instance_id}

    def unregister(self, body: Any) -> dict[str, Any]:
        body = self._body(body)
        instance_id = _str(body, "instance_id", required=True)
        tenant = _str(body, "tenant_id", default=DEFAULT_TENANT)
        dp = body.get("dp_rank")
        if dp is not None:
            dp = _dp_rank(dp)
        gone = [k for k, s in self.sources.items()
                if s.instance_id == instance_id and s.tenant_id == tenant and (dp is None or s.dp_rank == dp)]
        if not gone:
            raise ApiError(404, f"no source {instance_id!r} is registered under tenant {tenant!r}"
                           + (f" with dp_rank {dp}" if dp is not None else ""), "invalid_request_error",
                           "instance_id", "not_registered")
        for key in gone:
            del self.sources[key]
            self.service.index.drop_instance(key)
            log.info("unregistered external KV source %s", key)
        return {"status": "unregistered successfully", "removed_instances": gone}

    # -- /events ----------------------------------------------------------------------------------
    def events(self, body: Any) -> dict[str, Any]:
        """KV events of registered sources, as JSON with RFC #1527's field names. A "stored" event adds
        its medium to what the source holds; a "removed" one with a medium takes only that medium away
        (the source may still hold the block elsewhere), without one every medium."""
        events = self._body(body).get("events")
        if not isinstance(events, list):
            raise bad("events must be a list", "events")
        checked = [self._event(i, e) for i, e in enumerate(events)]  # all or nothing
        index = self.service.index
        for kind, key, hashes, medium in checked:
            if kind == "stored":
                index.stored(key, hashes, medium)
            elif kind == "removed":  # BlockRemoved: from that medium only when it names one
                index.removed(key, hashes, medium)
            else:
                index.drop_instance(key)
        return {"applied": len(checked)}

    def _event(self, i: int, e: Any) -> tuple[str, str, list[int], str]:
        where = f"events[{i}]"
        if not isinstance(e, dict):
            raise bad(f"{where} must be an object", where)
        kind = e.get("event_type")
        if kind not in ("stored", "removed", "cleared"):
            raise bad(f"{where}.event_type must be stored, removed or cleared", f"{where}.event_type")
        self._check_block_size(e, required=False)
        instance_id = e.get("instance_id") or e.get("backend_id")
        tenant = e.get("tenant_id") or DEFAULT_TENANT
        dp = e.get("dp_rank") or 0
        if not all(isinstance(v, str) and len(v) <= MAX_NAME for v in (instance_id, tenant)) or not _is_int(dp) \
                or not 0 <= dp < MAX_DP_RANK:
            raise bad(f"{where}: instance_id and tenant_id must be strings of at most {MAX_NAME} characters, "
                      f"dp_rank an integer in [0, {MAX_DP_RANK})", f"{where}.instance_id")
        key = f"{instance_id}|{tenant}|{dp}"
        if key not in self.sources:
            raise bad(f"{where}: {key[:3 * MAX_NAME]!r} is not registered; POST /register first",
                      f"{where}.instance_id")
        hashes: list[int] = []
        if kind != "cleared":
            name = "seq_hashes" if "seq_hashes" in e else "block_hashes"
            hashes = _ints(e.get(name), f"{where}.{name}", _U64, self._max_blocks)
        raw = e.get("medium")
        if kind == "removed" and raw in (None, ""):
            return kind, key, hashes, ""  # from every medium
        medium = MEDIA.get(str(raw or "cpu").lower())
        if medium is None:
            raise bad(f"{where}.medium must be one of {sorted(MEDIA)}", f"{where}.medium")
        return kind, key, hashes, medium
