"""The scheduler's vocabulary: what a policy sees of a request and of the cluster, and what it answers.

The live conductor (``router.pick``) and the simulator (``tools/sim``) both build these
views and hand them to the same policy object, so what the simulator measures is the code
that serves. Views are snapshots: a policy reads them and never mutates them; the caller
acts on the ``Decision`` (and tells its ledgers) or maps the ``Rejection`` to an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mooncaked.conductor.cost_model import InstanceModel


@dataclass(frozen=True)
class RequestView:
    """A request as the scheduler needs it: sizes and the chained hashes of its full blocks."""

    prompt_len: int
    block_hashes: tuple[int, ...]
    block_size: int
    max_tokens: int
    arrival_s: float = 0.0
    request_id: str = ""


@dataclass(frozen=True)
class SeqLoad:
    """One sequence on (or on its way to) a decode instance.

    ``joins_at_s`` is when it enters the running batch: in the past for running sequences,
    the predicted end of its prefill for sequences routed there and still prefilling. The
    remaining tokens of a live request are an estimate (``max_tokens`` minus streamed).
    """

    context_tokens: int
    remaining_tokens: int
    joins_at_s: float = 0.0


@dataclass(frozen=True)
class InstanceView:
    """One instance at decision time.

    Prefill figures: ``own_blocks`` leading prompt blocks in its own cache (``own_slow_blocks``
    of them on its local disk tier), ``pool_blocks`` leading blocks the pool (any holder) can
    serve it (``pool_slow_blocks`` of them from disk only), ``queued_tokens`` and the predicted
    ``queued_s`` before a new request would start there, and ``pending_blocks`` leading
    prompt blocks that prefills already routed there (queued or running) are computing: they
    are in its cache by the time a request sent there now starts (its queue is first come,
    first served). 0 when the caller does not track them. Decode figures: ``batch`` (running
    and incoming sequences) and its KV capacity in blocks (0 total = unknown, unbounded).
    ``model`` is this instance's own fitted step-time and transfer model. ``pipeline_stages``:
    machines this prefill unit spans, 1 for an instance, S for a chunked pipeline group the
    conductor treats as one unit (its ``model`` then predicts the whole pipeline, fill and
    drain included: ``pipeline_cost.pipeline_instance_model``); ``pulls``: whether it can take
    prefix blocks from another holder or the pool (a live CPP group cannot: its stages reuse
    their own prefix caches only).
    """

    name: str
    role: str  # "prefill" | "decode"
    model: InstanceModel
    available: bool = True
    own_blocks: int = 0
    own_slow_blocks: int = 0
    pool_blocks: int = 0
    pool_slow_blocks: int = 0
    queued_tokens: int = 0
    queued_s: float = 0.0
    pending_blocks: int = 0
    pipeline_stages: int = 1
    pulls: bool = True
    batch: tuple[SeqLoad, ...] = ()
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0


@dataclass(frozen=True)
class ClusterView:
    """Every candidate instance, where the pool's longest copy of the prompt's prefix is, and how hot it is.

    ``pool_demand``: requests routed lately (``prefix_demand.PrefixDemand``'s window, this one not
    counted) whose prompts held the whole of that longest run; 0 when the caller does not count.
    """

    now_s: float
    prefills: tuple[InstanceView, ...]
    decodes: tuple[InstanceView, ...]
    pool_source: str | None = None  # holder with the longest own run of the prompt's blocks
    pool_demand: int = 0


@dataclass(frozen=True)
class Decision:
    """Where the request goes and how much of its prefix is reused, and from where.

    ``reuse_blocks`` leading blocks are not recomputed: ``local_blocks`` of them are already
    in the prefill instance's cache, the rest are pulled from ``pull_from`` (a holder name, e.g.
    "store" for the Mooncake Store pool; "pool" when no other single holder has the whole run)
    before the prefill. ``replicate`` (the prefix is hot) asks the prefill instance to keep the
    pulled blocks in its own cache and hold them in the pool with a soft pin, which is how a hot
    prefix spreads off a loaded holder; without it the pulled blocks serve this request only.
    """

    prefill: str
    decode: str
    reuse_blocks: int
    local_blocks: int
    pull_from: str | None = None
    replicate: bool = False
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    predicted_prefill_s: float = 0.0  # transfer + compute on the chosen instance, without its queue


@dataclass(frozen=True)
class ElasticDecision(Decision):
    """A ``Decision`` whose prefill also runs on ``helpers`` (elastic CPP), in stage order after ``prefill``;
    ``alone_prefill_s``: its predicted prefill on ``prefill`` alone (should the helpers be busy or gone)."""

    helpers: tuple[str, ...] = ()
    chunk_tokens: int = 0
    alone_prefill_s: float = 0.0

    def alone(self) -> "ElasticDecision":
        """The same route without helpers, booked for its time alone: a pipeline that cannot be formed must
        not leave its machine looking free too early (docs/performance.md, "Elastic CPP and the SLO")."""
        return dataclasses.replace(self, helpers=(), predicted_prefill_s=self.alone_prefill_s)


@dataclass(frozen=True)
class Rejection:
    """The request is refused before any prefill is spent; the reason is machine-readable."""

    reason: str  # "ttft_slo" | "tbt_slo" | "kv_capacity" | "no_prefill" | "no_decode"
    detail: str
