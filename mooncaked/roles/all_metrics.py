"""`mooncaked --role all --metrics HOST:PORT`: one Prometheus endpoint for the whole local cluster.

Each role runs in a process of its own, with its own registry, so the parent's registry holds nothing of
theirs (before, that endpoint showed the parent's process gauges and nothing else). Each child binds a
metrics port on loopback, any free one, and tells the parent (startup.tell_parent_port); on every scrape
the parent reads theirs and serves them as one page, each sample labelled with the process it came from
(`mooncaked_process`: conductor, store, prefill, prefill-1, decode, ...). A child that has not told its
port yet, or does not answer within SCRAPE_TIMEOUT_S, is left out of that scrape, and
`mooncaked_all_process_up` says which (0).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

LABEL = "mooncaked_process"
SCRAPE_TIMEOUT_S = 2.0
MAX_PAGE_BYTES = 16 << 20  # a child's page is ~100 KB; more is not a metrics page


def numbered(role: str, i: int) -> str:
    """The i-th process of a role: ROLE for the first, ROLE-I for the others (metrics labels, LMDB folders)."""
    return role if i == 0 else f"{role}-{i}"


def process_labels(roles: Iterable[str]) -> list[str]:
    """One label per child, in order (numbered within each role)."""
    seen: dict[str, int] = {}
    out = []
    for role in roles:
        i = seen.get(role, 0)
        seen[role] = i + 1
        out.append(numbered(role, i))
    return out


class ChildrenCollector:
    """Collects the children's pages at scrape time (prometheus_client calls `collect` on its server thread)."""

    def __init__(self, targets: dict[str, str | None]) -> None:
        self.targets = targets  # label -> "http://127.0.0.1:PORT/metrics", None until the child told its port

    def describe(self) -> list[Metric]:
        return []  # the families are the children's: nothing to check against other collectors

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily("mooncaked_all_process_up", "Whether a process of the cluster answered this scrape.",
                               labels=[LABEL])
        for label, url in list(self.targets.items()):
            if url is None:  # not started yet, or it has not bound its port
                up.add_metric([label], 0)
                continue
            try:
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
                    text = reply.read(MAX_PAGE_BYTES + 1).decode()
                if len(text) > MAX_PAGE_BYTES:
                    raise ValueError(f"over {MAX_PAGE_BYTES} bytes")
                parsed = list(text_string_to_metric_families(text))
            except (OSError, ValueError) as e:
                logger.info("metrics of the %s process not read this scrape (%s)", label, e)
                up.add_metric([label], 0)
                continue
            up.add_metric([label], 1)
            for fam in parsed:
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, LABEL: label}, s.value, s.timestamp, s.exemplar)
        yield from families.values()
        yield up


def children_registry(targets: dict[str, str | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ChildrenCollector(targets))  # type: ignore[arg-type]
    return registry
