"""How long a read of cached bytes (KV from the pool or a peer) may take before the reader gives up.

A reader of cached KV can always compute it instead, so a copy whose owner is stalled (paused,
swapping, its host gone) should cost a miss, not a wait as long as a bulk transfer's timeout: a
read waits STALL_GRACE_S at most, plus its bytes at READ_FLOOR_BYTES_PER_S, where computing the
KV again is the cheaper way on a CPU as on a GPU.
"""

from __future__ import annotations

STALL_GRACE_S = 2.0
READ_FLOOR_BYTES_PER_S = 50e6


def read_deadline(nbytes: int, cap_s: float) -> float:
    """Seconds a read of `nbytes` from one owner may take (never more than `cap_s`)."""
    return min(cap_s, STALL_GRACE_S + nbytes / READ_FLOOR_BYTES_PER_S)
