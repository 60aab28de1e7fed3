"""Global prefix index: block hash -> the instances (and media) that hold that block.

Fed by KV events. Because block hashes are chained, the longest cached prefix of a prompt
on an instance is the longest run of its hashes, from the first, that the instance
holds: O(prompt blocks) per lookup. Memory is bounded by dropping the least recently
touched hashes when ``max_entries`` is passed.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self._holders: OrderedDict[int, dict[str, str]] = OrderedDict()  # hash -> {instance: medium}

    def __len__(self) -> int:
        return len(self._holders)

    def stored(self, instance: str, hashes: list[int], medium: str = "dram") -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            else:
                self._holders.move_to_end(h)
            holders[instance] = medium
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def removed(self, instance: str, hashes: list[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(instance, None)
                if not holders:
                    del self._holders[h]

    def drop_instance(self, instance: str) -> None:
        for h in list(self._holders):
            self.removed(instance, [h])

    def match(self, hashes: list[int]) -> dict[str, int]:
        """For each instance holding the first block: how many leading blocks it holds."""
        lengths: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            here = set(holders) if alive is None else alive & holders.keys()
            if not here:
                break
            for name in here:
                lengths[name] = i + 1
            alive = here
        return lengths

    def media(self, instance: str, hashes: list[int]) -> dict[str, int]:
        """How many of these blocks the instance holds in each medium."""
        out: dict[str, int] = {}
        for h in hashes:
            medium = self._holders.get(h, {}).get(instance)
            if medium is not None:
                out[medium] = out.get(medium, 0) + 1
        return out
