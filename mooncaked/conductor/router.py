"""Picks the prefill and decode instance for a request.

For now: the prefill instance with the least work once its cached prefix is counted
(uncached prompt tokens + tokens already queued there), and the decode instance with the
fewest requests that has room for the prompt's KV. The scheduling work (Mooncake's
cost model, early rejection, hot-spot replication) replaces this.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncaked.conductor.prefix_index import PrefixIndex
from mooncaked.conductor.registry import Instance, Registry


class NoInstanceError(Exception):
    """No instance can take the request now; the message says which role is missing."""


@dataclass
class Route:
    prefill: Instance
    decode: Instance
    cached_blocks: int


def pick(registry: Registry, index: PrefixIndex, hashes: list[int], prompt_len: int,
         exclude: set[str] = frozenset()) -> Route:
    prefills = [p for p in registry.available("prefill") if p.name not in exclude]
    decodes = [d for d in registry.available("decode") if d.name not in exclude]
    if not prefills:
        raise NoInstanceError("no prefill instance is serving")
    if not decodes:
        raise NoInstanceError("no decode instance is serving")
    hits = index.match(hashes)

    def prefill_cost(p: Instance) -> tuple[int, int]:
        bs = p.layout.block_size
        uncached = prompt_len - hits.get(p.name, 0) * bs
        return uncached + p.load.queued_prefill_tokens + p.inflight * bs, p.inflight

    def decode_cost(d: Instance) -> tuple[int, int]:
        return d.load.running_requests + d.load.waiting_requests + d.inflight, -d.load.free_kv_blocks

    prefill = min(prefills, key=prefill_cost)
    roomy = [d for d in decodes if d.load.free_kv_blocks * d.layout.block_size > prompt_len
             or d.load.total_kv_blocks == 0]
    decode = min(roomy or decodes, key=decode_cost)
    return Route(prefill, decode, hits.get(prefill.name, 0))
