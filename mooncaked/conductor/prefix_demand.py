"""How often a prefix was asked for lately: what makes a prefix hot.

Hot-spot replication (the pulling instance keeps the blocks, and the pool holds them with a soft
pin) pays when the prefix will be asked for again: the copy spreads the next requests off its
holder. A prefix pulled and never asked for again only takes room from blocks that would be hit.
The conductor sees every request it routes, so it counts, per chained block hash, the requests
routed in the last ``window_s`` seconds whose prompt held that block (a chain hash names the whole
prefix up to it). The live router (``SchedulerState``) and the simulator fill
``ClusterView.pool_demand`` from this one class, the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A prefix is recent demand while requested within this many seconds, counted up to KEEP_ARRIVALS.
DEMAND_WINDOW_S = 600.0
KEEP_ARRIVALS = 4


@dataclass
class PrefixDemand:
    """Recent routed requests per block hash (at most ``keep`` remembered each: the count saturates)."""

    window_s: float = DEMAND_WINDOW_S
    keep: int = KEEP_ARRIVALS
    _seen: dict[int, deque[tuple[float, str]]] = field(default_factory=dict)
    _swept_s: float = 0.0

    def __post_init__(self) -> None:
        if self.window_s < 0 or self.keep < 1:
            raise ValueError("PrefixDemand needs window_s >= 0 and keep >= 1")

    def routed(self, request_id: str, hashes: tuple[int, ...] | list[int], now_s: float) -> None:
        """A request with these block hashes was routed at ``now_s`` (a retry of it counts once)."""
        for h in hashes:
            q = self._seen.get(h)
            if q is None:
                q = self._seen[h] = deque(maxlen=self.keep)
            elif q[-1][1] == request_id:
                continue
            q.append((now_s, request_id))
        if now_s - self._swept_s > self.window_s:
            self._sweep(now_s)

    def count(self, hashes: tuple[int, ...] | list[int], blocks: int, now_s: float) -> int:
        """Requests routed within the window whose prompt held the first ``blocks`` of ``hashes``."""
        if blocks <= 0 or blocks > len(hashes):
            return 0
        q = self._seen.get(hashes[blocks - 1])
        if not q:
            return 0
        since = now_s - self.window_s
        return sum(1 for t, _ in q if t >= since)

    def _sweep(self, now_s: float) -> None:
        """Forget blocks no request asked for within the window (bounds the memory by recent traffic)."""
        since = now_s - self.window_s
        for h in [h for h, q in self._seen.items() if q[-1][0] < since]:
            del self._seen[h]
        self._swept_s = now_s
