"""How the conductor's core talks to one engine instance: reserve, prefill, decode, abort, lend.

Plain dataclasses in and out and one error type, ``EngineError(kind, detail)``: the core decides
on kinds, never on a transport's codes. ``grpc_engine.GrpcEngineLink`` is the implementation the
daemon uses; ``instance.local_link.LocalEngineLink`` reaches an instance in this process (tests).
A link is owned by the registry's ``Instance`` and closed when that instance is replaced or the
conductor stops. Prefill instances use the same interface to reach a peer that lends them KV.
These dataclasses and ``EngineError`` are also what the instance logic (``mooncaked/instance/``)
takes, returns and raises, so the wire is a mapping on both sides.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mooncaked.engine import SamplingParams
from mooncaked.engine.kv_cache import KVLayout
from mooncaked.engine.outputs import TopLogprobs

# EngineError kinds
UNAVAILABLE = "unavailable"  # the instance is gone, draining, or its engine stopped: try another
DEADLINE = "deadline"  # the call's deadline passed
EXHAUSTED = "exhausted"  # no room now (a decode's KV blocks): wait, or try another
CANCELLED = "cancelled"  # the call (or the request, by an Abort that overtook it) was cancelled
OUT_OF_RANGE = "out_of_range"  # can never fit on this instance
ABORTED = "aborted"  # the prefill's KV push to the decode instance failed: the decode is at fault
NOT_FOUND = "not_found"  # no such request (a reservation that expired or was taken)
INVALID = "invalid"  # the engine refused the request as malformed
PRECONDITION = "precondition"  # the instances do not fit together (KV layouts differ, wrong role)
INTERNAL = "internal"  # the engine failed this request alone; a retry would fail alike
KINDS = (UNAVAILABLE, DEADLINE, EXHAUSTED, CANCELLED, OUT_OF_RANGE, ABORTED, NOT_FOUND, INVALID, PRECONDITION,
         INTERNAL)

POOL = "pool"  # PrefillPlan.pull_from / PrefillResult.pulled_from: the Mooncake Store
# a PrefillResult.deviations reason: the elastic prefill's helpers failed, the lead computed the prompt alone
ELASTIC_ALONE = "elastic_alone"

# instance states as engines report them
STARTING, SERVING, DRAINING, DEAD = "starting", "serving", "draining", "dead"


# KV events as engines report them in heartbeats
STORED, REMOVED = "stored", "removed"


@dataclass
class InstanceLoad:
    """What an engine last reported of its load (heartbeats)."""

    queued_prefill_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    prefix_hit_blocks: int = 0
    prefix_query_blocks: int = 0
    prefill_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    decode_tokens: int = 0
    cached_kv_blocks: int = 0
    preemptions: int = 0


@dataclass
class KVEvent:
    """Blocks that appeared on (``STORED``) or left (``REMOVED``) an instance's cache or tier."""

    kind: str
    block_hashes: list[int]
    medium: str = ""
    instance: str = ""  # the holder, when not the reporting instance


@dataclass
class DecodeSample:
    """One measured decode step (feeds the conductor's TBT model)."""

    batch: int
    context_tokens: int
    seconds: float


@dataclass
class Heartbeat:
    """Liveness plus the load and cache changes since the last heartbeat."""

    name: str
    load: InstanceLoad = field(default_factory=InstanceLoad)
    state: str = ""  # "": serving
    events: list[KVEvent] = field(default_factory=list)
    decode_samples: list[DecodeSample] = field(default_factory=list)
    drain_seq: int = 0  # the engine's count of Drain calls when it composed this (an older one's state is stale)


class EngineError(Exception):
    """A call to an engine failed: ``kind`` (one of ``KINDS``) says how, ``detail`` is the engine's message."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class TransferEndpoint:
    """Where a peer reaches an instance's KV region on the data plane (transfer/)."""

    address: str = ""
    backend: str = ""  # "tcp" | "shm" | "rdma"
    region: str = ""
    same_host_id: str = ""
    shm_name: str = ""


@dataclass
class Reservation:
    """KV blocks a decode instance holds for a prompt until the prefill wrote them and Decode takes them."""

    block_ids: list[int]
    endpoint: TransferEndpoint
    layout: KVLayout
    ttl_s: float = 0.0  # given back unless renewed within this long (0: never expires)
    # the decode's Engine address: the prefill writing these blocks renews the reservation there itself
    # and writes only while its own renewal is fresh (the write fence, instance/prefill.py); "": no fence
    engine_address: str = ""


@dataclass
class PrefillPlan:
    """What the scheduler decided the prefill does with cached KV, carried by each prefill call.

    Take the prompt's first ``reuse_blocks`` blocks from the instance's own prefix cache and the
    next ``pull_blocks`` from ``pull_from``: ``"pool"`` (the Mooncake Store) or a peer instance's
    name, whose KV cache is read directly over the transfer engine after it lends the blocks
    (its Engine at ``pull_address``). ``replicate`` (a hot prefix): keep the pulled blocks and
    hold the prefix in the pool with a soft pin. A block the prefill cannot get this way is
    computed and counted as a deviation (``PrefillResult.deviations``). ``pool_fallback``: the
    conductor does not follow the pool (it has no store master), so when the plan pulls nothing
    the prefill may still take the pool's longer run on its own, as it does without a plan."""

    reuse_blocks: int = 0
    pull_from: str = ""  # "" | POOL | a peer instance's name
    pull_blocks: int = 0
    pull_address: str = ""
    replicate: bool = False
    pool_fallback: bool = False
    # elastic CPP: idle prefill instances (Engine addresses) lent to this prompt, each computing the next even
    # share of the layers after this instance's, in order (instance/pipeline.py); empty: it prefills alone
    helpers: list[str] = field(default_factory=list)

    @property
    def pulls_from_peer(self) -> bool:
        return bool(self.pull_blocks and self.pull_from and self.pull_from != POOL)


@dataclass
class PrefillResult:
    """The first token and the "KV complete" signal, with what it cost."""

    first_token_id: int
    first_logprob: float = 0.0
    first_top_logprobs: TopLogprobs | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    finished: bool = False  # the first token already ends the request
    finish_reason: str = ""
    compute_s: float = 0.0  # engine step time spent on this prompt
    push_bytes: int = 0  # KV bytes pushed to the decode instance
    push_s: float = 0.0  # first push to last byte acknowledged
    # what it did with the prompt's leading blocks (its plan, or its own choice without one)
    local_blocks: int = 0  # from its own prefix cache
    pulled_blocks: int = 0  # read from ``pulled_from``
    pulled_from: str = ""  # POOL, a peer instance's name, or "" (nothing pulled)
    replicated: bool = False  # the prefix went to the pool with a soft pin
    deviations: dict[str, int] = field(default_factory=dict)  # planned blocks computed instead, by reason
    # a scored prompt (SamplingParams.prompt_logprobs): entry i is prompt token i + 1's log-prob, and the top there
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass
class TokenChunk:
    """Tokens a decode instance produced since its last chunk; ``finish_reason`` on the last."""

    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class Loan:
    """Cached blocks an instance lends a peer: pinned until released or ``lease_s`` has passed. The
    leading run of the hashes asked for that it holds (possibly none), in chain order, and where the
    peer reads them (its KV region on the transfer engine, in ``layout``)."""

    loan_id: str
    block_ids: list[int]
    endpoint: TransferEndpoint
    layout: KVLayout
    lease_s: float


@dataclass
class StageOpen:
    """A chunked-pipeline (CPP) stage asking the next stage of its group to take its layers of a prompt.

    The callee computes its layers of the prompt as the caller's hidden states arrive and writes its
    layers' KV into ``target`` (the decode's reservation, which every stage writes a part of); it
    opens the stages after it (``downstream``: their Engine addresses, in order) the same way."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    target: Reservation
    downstream: list[str] = field(default_factory=list)
    # elastic CPP: a whole-model instance lent to this one prompt is stage ``index`` of ``count`` for it (None:
    # the callee is a static group's stage, its place fixed at start-up); it reads its layers of the lead's
    # cached run (``lead_cached``: block ids the lead holds until the request ends) out of ``lead_endpoint``'s
    # KV region, and writes its layers of the new tokens into the lead's blocks there
    elastic: tuple[int, int] | None = None
    lead_cached: list[int] = field(default_factory=list)
    lead_endpoint: TransferEndpoint | None = None


@dataclass
class StageOpened:
    """The callee's answer: the leading blocks it and every stage after it hold in their prefix caches
    (the group computes from the shortest run: each stage must start at the same token), and where
    the caller writes the hidden states (``inbox``'s region at ``inbox_offset``, ``row_bytes`` a token)."""

    cached_blocks: int
    inbox: TransferEndpoint
    inbox_offset: int
    row_bytes: int


@dataclass(frozen=True)
class AbortResult:
    """``found``: the request was known; ``ended``: it has stopped (on a prefill: its KV pushes too)."""

    found: bool
    ended: bool


class EngineLink(abc.ABC):
    """One engine instance, as the conductor uses it. Every call has a timeout; failures raise
    ``EngineError``. Cancelling a call (its task) stops it on the engine's side as far as the
    transport can."""

    @abc.abstractmethod
    async def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      timeout_s: float) -> Reservation:
        """Decode: hold KV blocks for the prompt (EXHAUSTED: no room now; OUT_OF_RANGE: never)."""

    @abc.abstractmethod
    async def renew(self, request_id: str, timeout_s: float) -> float | None:
        """Decode: keep a reservation another TTL; its TTL, or None when it is gone."""

    @abc.abstractmethod
    async def prefill(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                      target: Reservation, timeout_s: float, plan: PrefillPlan | None = None,
                      stages: list[str] | None = None) -> PrefillResult:
        """Prefill: compute the prompt, write its KV into ``target`` (a decode's reservation), sample
        the first token. ABORTED: writing the KV to the decode failed. ``stages``: the instance is the
        first stage of a CPP group, these are its later stages' addresses (the conductor's registry)."""

    @abc.abstractmethod
    def decode(self, request_id: str, first: PrefillResult, timeout_s: float) -> AsyncIterator[TokenChunk]:
        """Decode: take the reserved, prefilled request into the batch and stream its tokens.
        Closing the iterator early stops the request and frees its blocks."""

    @abc.abstractmethod
    async def abort(self, request_id: str, timeout_s: float) -> AbortResult:
        """Either: stop a request wherever it is; remembered, so a later reserve/prefill of it is refused."""

    @abc.abstractmethod
    async def lend(self, block_hashes: list[int], lease_s: float, timeout_s: float, borrower: str = "") -> Loan:
        """Either: pin the cached blocks of this hash chain's leading run for a peer to read."""

    @abc.abstractmethod
    async def release(self, loan_id: str, timeout_s: float) -> bool:
        """Either: the peer has read a loan's blocks; whether it was still held."""

    @abc.abstractmethod
    async def drain(self, drain: bool, timeout_s: float) -> tuple[str, int]:
        """Either: stop (or resume) taking new work; the instance's state after it, and the call's number
        (heartbeats composed before it carry a smaller one)."""

    @abc.abstractmethod
    async def stage_open(self, opening: StageOpen, timeout_s: float) -> StageOpened:
        """A CPP stage: take this prompt's layers after the caller's (EXHAUSTED: no hidden-state slot free)."""

    @abc.abstractmethod
    async def stage_input(self, request_id: str, start_tokens: int, ready_tokens: int, timeout_s: float,
                          lead_block_ids: list[int] | None = None) -> None:
        """A CPP stage: the caller's hidden states of tokens [start_tokens, ready_tokens) are in the inbox
        (``start_tokens``: where the group starts computing, after the blocks every stage holds).
        ``lead_block_ids`` (elastic CPP, first call): the lead's blocks of the prompt, filled by every stage."""

    @abc.abstractmethod
    async def stage_finish(self, request_id: str, timeout_s: float) -> PrefillResult:
        """A CPP stage: once it and every stage after it computed and pushed their layers, the first
        token (the last stage's) and the KV bytes they pushed."""

    @abc.abstractmethod
    async def close(self, grace_s: float = 0.0) -> None:
        """Let calls in flight end for up to ``grace_s``, then drop the connection."""
