"""Global prefix index: block hash -> the instances (and media) that hold that block.

Fed by KV events. Because block hashes are chained, the longest cached prefix of a prompt
on an instance is the longest run of its hashes, from the first, that the instance
holds, and the longest prefix the whole pool can serve is the longest run of hashes
that *someone* holds (blocks of one prefix may sit on different holders).

Cost: a lookup walks the prompt's blocks once and, per block, the holders still in the
running, so it is O(prompt blocks x holders per block) and holders per block are bounded by
the cluster size: O(prompt blocks) for a given cluster. Memory: at most ``max_entries``
hashes, each with at most one entry per holder; the least recently stored *or matched*
hash goes first, so a prefix that keeps being hit stays known even if nobody re-stores it.

A holder may keep a block on several media at once (an engine in HBM and in its CPU cache);
each entry is a bitmask of them, so a BlockRemoved naming one medium keeps the others, and a
lookup counts the fastest. The pool's events (pool_watch.py) say where a block is at best now:
they replace the mask instead of adding to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# Media from fastest to slowest: a pull prefers the fastest holder of a block.
MEDIA_ORDER: dict[str, int] = {"hbm": 0, "dram": 1, "lmdb": 2}
SLOW_MEDIA = frozenset({"lmdb"})
_BIT = {m: 1 << rank for m, rank in MEDIA_ORDER.items()}  # an unknown medium counts as "dram"
_SLOW = sum(_BIT[m] for m in SLOW_MEDIA)
_FAST = sum(_BIT.values()) & ~_SLOW
_BEST = {mask: next(m for m in MEDIA_ORDER if mask & _BIT[m]) for mask in range(1, 1 << len(MEDIA_ORDER))}
POOL_HOLDER = "store"
"""The holder name of blocks in the Mooncake Store pool (fed by the store master's pool events, with
medium "dram" or "lmdb"); no instance may register under it."""


@dataclass(frozen=True)
class PrefixLookup:
    """What a prompt's leading blocks find in the cluster; the policies' input on caching.

    ``holders`` maps each holder of block 0 to the length of its own leading run and
    ``holder_slow`` to how many of that run sit on a slow medium (it reads them from its
    own disk). ``pool_blocks`` is the longest leading run the pool as a whole can serve,
    ``pool_slow`` how many of those are held on slow media only, and ``pool_source`` the
    holder with the longest own run (the natural one to pull from), or None.
    """

    holders: dict[str, int] = field(default_factory=dict)
    holder_slow: dict[str, int] = field(default_factory=dict)
    pool_blocks: int = 0
    pool_slow: int = 0
    pool_source: str | None = None


class PrefixIndex:
    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._holders: OrderedDict[int, dict[str, int]] = OrderedDict()  # hash -> {instance: media bitmask}

    def __len__(self) -> int:
        return len(self._holders)

    def stored(self, instance: str, hashes: list[int], medium: str = "dram", replace: bool = False) -> None:
        """The instance holds these blocks on `medium` (too; or, with `replace`, only there now)."""
        bit = _BIT.get(medium, _BIT["dram"])
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            else:
                self._holders.move_to_end(h)
            holders[instance] = bit if replace else holders.get(instance, 0) | bit
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def removed(self, instance: str, hashes: list[int], medium: str = "") -> None:
        """The instance no longer holds these blocks on `medium` ("": on any medium)."""
        keep = ~_BIT.get(medium, _BIT["dram"]) if medium else 0
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and instance in holders:
                left = holders[instance] & keep
                if left:
                    holders[instance] = left
                    continue
                del holders[instance]
                if not holders:
                    del self._holders[h]

    def drop_instance(self, instance: str) -> None:
        """Forget everything an instance held: one pass over the index (rare: restarts, deaths)."""
        empty = []
        for h, holders in self._holders.items():
            if holders.pop(instance, None) is not None and not holders:
                empty.append(h)
        for h in empty:
            del self._holders[h]

    def match(self, hashes: list[int]) -> dict[str, int]:
        """For each instance holding the first block: how many leading blocks it holds."""
        return self.lookup(hashes).holders

    def lookup(self, hashes: list[int]) -> PrefixLookup:
        """One pass over the prompt's blocks: each holder's own run and the pool's run.

        Matched hashes are refreshed in the LRU order, which is what keeps a hot prefix in a
        bounded index.
        """
        runs: dict[str, int] = {}
        slow: dict[str, int] = {}
        alive: dict[str, int] | None = None  # holders whose run is unbroken so far -> media
        pool = pool_slow = 0
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            self._holders.move_to_end(h)
            pool = i + 1  # every block so far has some holder
            if all(not mask & _FAST for mask in holders.values()):
                pool_slow += 1
            if alive is None:
                alive = holders
            elif alive:
                alive = {name: holders[name] for name in alive if name in holders}
            for name, mask in alive.items():
                runs[name] = i + 1
                if not mask & _FAST:
                    slow[name] = slow.get(name, 0) + 1
        source = max(runs, key=lambda n: (runs[n], -slow.get(n, 0), n)) if runs else None
        return PrefixLookup(runs, slow, pool, pool_slow, source)

    def media(self, instance: str, hashes: list[int]) -> dict[str, int]:
        """How many of these blocks the instance holds at best in each medium (a block counts once)."""
        out: dict[str, int] = {}
        for h in hashes:
            mask = self._holders.get(h, {}).get(instance)
            if mask:
                medium = _BEST[mask]
                out[medium] = out.get(medium, 0) + 1
        return out
