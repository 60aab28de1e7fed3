"""Instances that share one machine's cores, as the embedded cluster (`mooncaked --role all`) runs them.

A profile is one engine measured alone with T torch threads. Live, ``--role all`` puts every engine on
the same host: when k instances compute at once with T threads each on C cores, each gets
``min(1, C / (k * T))`` of its profiled speed. Without this the simulator predicts a 2-core box as if
each engine had a machine of its own (its TTFTs were a third of the live ones, and under load the
policies' order was not the live one).

Processor sharing, updated at the simulation's events: a running prefill's remaining work (in profiled
seconds) is stretched or shrunk whenever the number of busy instances changes; a decode step takes
its profiled time times the slowdown current when it starts. A decode batch that empties between two
events is counted busy until the next one. An elastic pipeline (``elastic.py``) counts each of its
machines busy: the lead's pipelined prefill and its helpers' holds start with the same work and stretch
alike, so they still end together (a pipeline's fill and drain, when some stages wait, count as busy).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Running:
    """A prefill in progress: profiled seconds of work left as of ``at``."""

    work_s: float
    at: float


@dataclass
class SharedCores:
    cores: float
    threads: int = 1
    slowdown: float = 1.0  # wall seconds per profiled second, since the last update
    running: dict[str, Running] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.threads < 1:
            raise ValueError(f"shared cores need cores > 0 and threads >= 1, got {self.cores} and {self.threads}")

    def started(self, name: str, now: float, finish: float) -> None:
        """A prefill started at ``now`` that would end at ``finish`` on a machine of its own."""
        self.running[name] = Running(finish - now, now)

    def stopped(self, name: str) -> None:
        self.running.pop(name, None)

    def update(self, now: float, busy: int) -> dict[str, float]:
        """``busy`` instances compute from ``now`` on: the new finish time of every running prefill."""
        new = max(1.0, busy * self.threads / self.cores)
        finish = {}
        for name, r in self.running.items():
            if r.at < now:
                r.work_s = max(0.0, r.work_s - (now - r.at) / self.slowdown)
                r.at = now
            finish[name] = now + r.work_s * new
        self.slowdown = new
        return finish
