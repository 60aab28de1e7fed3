"""Per-instance time models the scheduler predicts with, refreshed online from measurements.

Mooncake's Algorithm 1 needs, for every prefill instance, how long a prefill of ``n``
uncached tokens after a ``p``-token prefix takes *there* and how long pulling cached blocks
takes; and for a decode instance how long a step of a given batch takes. Instances differ
(GPU, clocks, neighbours), so each keeps its own model, fitted by least squares over a
sliding window of its own measured steps and shrunk toward a prior so that it answers
sensibly before (and in directions where) it has data.

Units: seconds, tokens. Features use kilo-tokens so the normal equations stay well scaled.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)


class StepTimeModel:
    """Time = coef . features(x); fitted on a window of samples, weighted by 1/time.

    Weighting by the inverse of the measured time fits relative error, so short prompts
    are predicted as well as long ones. Each coefficient is pulled toward the prior by a
    ridge term scaled by how much that term matters over ``prior_grid`` (shapes across the
    range the model is asked about, in the same relative units), ``prior_weight`` samples'
    worth: where the data says nothing (no prefix ever seen: the n*p term; only short
    prompts seen: the n^2 term) the prior decides, and a few real samples cannot swing a
    term the data does not constrain. (A ridge scaled by the data's own features did not:
    one 29-token sample fitted a quadratic term 1000x the prior's and predicted 440 s for a
    16k prompt; the next fitted it to zero and predicted 25 ms for a 37k one, and the
    scheduler queued a dozen long prompts there, a minute each.) Diagonal, so a term with
    no data stays exactly at its prior however the others move.
    """

    names: tuple[str, ...] = ()
    prior_grid: tuple[tuple[float, float], ...] = ()

    def __init__(self, prior: Sequence[float], window: int = 512, ridge: float = 1e-4,
                 refit_every: int = 8, prior_weight: float = 0.01) -> None:
        if len(prior) != len(self.names):
            raise ValueError(f"{type(self).__name__} takes {len(self.names)} coefficients ({self.names})")
        self.prior = tuple(float(c) for c in prior)
        self.coef = self.prior
        self.ridge = ridge
        self._prior_lam = self._prior_ridge(max(0.0, prior_weight))
        self.refit_every = max(1, refit_every)
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._unfitted = 0

    @staticmethod
    def features(a: float, b: float) -> tuple[float, ...]:
        raise NotImplementedError

    def _prior_ridge(self, weight: float) -> np.ndarray:
        """Per-coefficient ridge: ``weight`` samples on the prior spread over ``prior_grid``, diagonal.

        Zeros when the prior predicts nothing somewhere on the grid (an all-zero prior to
        fit from scratch): relative error to a zero time is undefined.
        """
        k = len(self.names)
        if weight <= 0 or not self.prior_grid:
            return np.zeros(k)
        rows = []
        for a, b in self.prior_grid:
            f = np.asarray(self.features(a, b), dtype=np.float64)
            y = float(np.dot(self.prior, f))
            if y <= 0:
                return np.zeros(k)
            rows.append(f / y)
        g = np.asarray(rows)
        return weight / len(rows) * (g * g).sum(axis=0)

    def __len__(self) -> int:
        return len(self._y)

    def observe(self, a: float, b: float, seconds: float) -> None:
        """Record one measured step; the fit follows lazily (every ``refit_every`` samples)."""
        if seconds <= 0 or not np.isfinite(seconds):
            return
        self._x.append(self.features(a, b))
        self._y.append(float(seconds))
        self._unfitted += 1
        if self._unfitted >= self.refit_every or len(self._y) <= self.refit_every:
            self.refit()

    def refit(self) -> None:
        """Weighted ridge least squares with non-negative coefficients.

        Every term is a cost (time per unit of work), so none may be negative; a noisy
        window that fits, say, a negative prefix term would predict ~0 s for long-prefix
        prompts and pull every request onto this instance. A coefficient that comes out
        negative is pinned at zero and the rest refitted (an active-set pass).
        """
        self._unfitted = 0
        if not self._y:
            self.coef = self.prior
            return
        x = np.asarray(self._x, dtype=np.float64)
        y = np.asarray(self._y, dtype=np.float64)
        xw = x / y[:, None]  # weight 1/time: relative error
        k = x.shape[1]
        a = xw.T @ xw
        # ridge scaled per feature (features differ by orders of magnitude); a feature with no
        # data at all still gets a tiny weight, so its coefficient is exactly the prior's
        lam = self.ridge * np.maximum(np.diag(a), 1e-12 * max(float(np.max(np.diag(a))), 1.0))
        lam = lam + self._prior_lam
        a += np.diag(lam)
        b = xw.T @ np.ones_like(y) + lam * np.asarray(self.prior)
        free = list(range(k))
        coef = np.zeros(k)
        try:
            while free:
                sol = np.linalg.solve(a[np.ix_(free, free)], b[free])
                if (sol >= 0).all():
                    coef[free] = sol
                    break
                free.pop(int(np.argmin(sol)))
        except np.linalg.LinAlgError:
            log.warning("%s: singular fit over %d samples; keeping the previous coefficients",
                        type(self).__name__, len(y))
            return
        self.coef = tuple(float(c) for c in coef)

    def predict(self, a: float, b: float) -> float:
        return max(0.0, sum(c * f for c, f in zip(self.coef, self.features(a, b))))


class PrefillTimeModel(StepTimeModel):
    """Prefill of ``n`` uncached tokens after ``p`` reused ones: fixed + linear + attention terms.

    Attention of ``n`` new tokens over ``p + n/2`` keys on average gives the ``n*p`` and
    ``n^2`` terms; weights give the linear one.
    """

    names = ("const_s", "per_ktok_s", "per_ktok_x_kprefix_s", "per_ktok2_s")
    prior_grid = tuple((n, p) for n in (64, 1024, 8192, 32768) for p in (0, 4096, 32768))
    reach_tokens: float = 0.0  # the longest prompt (new tokens) in the fitted window

    @staticmethod
    def features(n: float, p: float) -> tuple[float, ...]:
        x, y = n / 1000.0, p / 1000.0
        return (1.0, x, x * y, x * x)

    def refit(self) -> None:
        super().refit()
        self.reach_tokens = max((row[1] for row in self._x), default=0.0) * 1000.0

    def predict(self, n: float, p: float) -> float:
        """Within the prompt lengths measured, the fit; beyond them, the fit's fixed cost plus its variable
        cost at the longest measured length, grown as the prior's variable cost grows (the prior's shape,
        this instance's measured speed; the fixed cost is not scaled: live, the first prompts an instance
        sees are often a few tokens, where a step's fixed cost is most of the time).

        A polynomial fitted to a few prompts of up to 20k tokens extrapolates a 191k one anywhere from
        0.4x to 1.7x its time (bundled trace, simulated), and the policy then picks the instance that
        underpredicts most: its books show it free a minute early and short prompts queue behind the
        long one, or early rejection refuses a prompt because this instance "could" serve it in time
        (docs/performance.md, "Elastic CPP and the SLO")."""
        fitted = super().predict(n, p)
        reach = self.reach_tokens
        if n <= reach or reach <= 0:
            return fitted
        prior_edge = self._prior_variable(reach, p)
        if prior_edge <= 0:
            return fitted
        fixed = self.coef[0]
        return fixed + max(0.0, super().predict(reach, p) - fixed) * self._prior_variable(n, p) / prior_edge

    def _prior_variable(self, n: float, p: float) -> float:
        """The prior's time beyond its fixed cost (``const_s``)."""
        return max(0.0, sum(c * f for c, f in zip(self.prior[1:], self.features(n, p)[1:])))


class DecodeTimeModel(StepTimeModel):
    """One decode step of a batch: weights read once, per-sequence work, KV read per context token."""

    names = ("const_s", "per_seq_s", "per_kctx_s")
    prior_grid = tuple((b, b * c) for b in (1, 16, 128) for c in (256, 4096, 32768))

    @staticmethod
    def features(batch: float, context_tokens: float) -> tuple[float, ...]:
        return (1.0, float(batch), context_tokens / 1000.0)


class _MeasuredPrefillFit(StepTimeModel):
    """``PrefillTimeModel``'s terms fitted from a profile's samples with the attention terms tied.

    ``n`` new tokens attend over ``p + n/2`` keys on average, so the ``n*p`` and ``n^2`` terms are
    one attention cost ``t``: ``(t, t/2)``. Fitted apart from a few noisy samples (a 512-token model
    gives ``tools/profile_engine.py --quick`` four shapes) the ``n*p`` term could soak up the noise
    alone and predict a cached prefix as dearer than computing it, so that every cost-aware policy
    in the simulator shuns its own cache while the live conductor does not.
    """

    names = ("const_s", "per_ktok_s", "attention_s")

    @staticmethod
    def features(n: float, p: float) -> tuple[float, ...]:
        x, y = n / 1000.0, p / 1000.0
        return (1.0, x, x * y + x * x / 2)

    def expanded(self) -> tuple[float, ...]:
        """As ``PrefillTimeModel.names``."""
        c, a, t = self.coef
        return (c, a, t, t / 2)


@dataclass
class TransferModel:
    """Seconds to bring cached blocks into an instance: local tier, remote holder, disk tier.

    Bandwidths are EWMA-refreshed from measured transfers (bytes over seconds).
    """

    block_bytes: int
    local_bps: float    # own DRAM -> HBM
    remote_bps: float   # another holder's DRAM over the network
    slow_bps: float     # a disk (LMDB) tier, own or remote
    alpha: float = 0.2

    def seconds(self, remote_blocks: int = 0, slow_blocks: int = 0, local_blocks: int = 0) -> float:
        b = self.block_bytes
        return (remote_blocks * b / self.remote_bps + slow_blocks * b / self.slow_bps
                + local_blocks * b / self.local_bps)

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        """``path`` is "local", "remote" or "slow"."""
        if seconds <= 0 or nbytes <= 0:
            return
        attr = f"{path}_bps"
        old = getattr(self, attr)
        setattr(self, attr, (1 - self.alpha) * old + self.alpha * nbytes / seconds)


@dataclass
class InstanceModel:
    """Everything the scheduler predicts about one instance."""

    prefill: PrefillTimeModel
    decode: DecodeTimeModel
    transfer: TransferModel


@dataclass(frozen=True)
class Profile:
    """Step times of one kind of instance: a prior for live models, the ground truth for the simulator.

    ``prefill_coef`` and ``decode_coef`` follow ``PrefillTimeModel.names`` and
    ``DecodeTimeModel.names``. ``kv_capacity_tokens`` is a decode instance's KV room,
    ``cache_blocks`` a prefill instance's own prefix cache (its share of the DRAM pool),
    ``max_model_len`` the model's context (0: unbounded; the simulator clips prompts to it
    as ``tools/replay.py`` does). ``num_layers`` and ``hidden_bytes_per_token`` (hidden size x
    bytes per element) size a chunked pipeline group's stages and the hidden states sent between
    them (``pipeline_cost``); 0 layers: stages take exact equal shares.
    """

    name: str
    block_size: int
    block_bytes: int
    prefill_coef: tuple[float, ...]
    decode_coef: tuple[float, ...]
    local_bps: float
    remote_bps: float
    slow_bps: float
    kv_capacity_tokens: int
    cache_blocks: int
    notes: str = ""
    max_model_len: int = 0
    num_layers: int = 0
    hidden_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if len(self.prefill_coef) != len(PrefillTimeModel.names):
            raise ValueError(f"profile {self.name}: prefill_coef takes {PrefillTimeModel.names}")
        if len(self.decode_coef) != len(DecodeTimeModel.names):
            raise ValueError(f"profile {self.name}: decode_coef takes {DecodeTimeModel.names}")
        if min(self.local_bps, self.remote_bps, self.slow_bps) <= 0 or self.block_size < 1 or self.block_bytes < 1:
            raise ValueError(f"profile {self.name}: bandwidths, block_size and block_bytes must be positive")
        if min(self.max_model_len, self.kv_capacity_tokens, self.cache_blocks, self.num_layers,
               self.hidden_bytes_per_token) < 0:
            raise ValueError(f"profile {self.name}: max_model_len, kv_capacity_tokens, cache_blocks, num_layers and "
                             "hidden_bytes_per_token must be >= 0")

    def prefill_s(self, uncached: int, prefix: int) -> float:
        return max(0.0, sum(c * f for c, f in zip(self.prefill_coef, PrefillTimeModel.features(uncached, prefix))))

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return max(0.0, sum(c * f for c, f in zip(self.decode_coef, DecodeTimeModel.features(batch, context_tokens))))

    def instance_model(self, window: int = 512) -> InstanceModel:
        return InstanceModel(PrefillTimeModel(self.prefill_coef, window=window),
                             DecodeTimeModel(self.decode_coef, window=window, refit_every=32),
                             TransferModel(self.block_bytes, self.local_bps, self.remote_bps, self.slow_bps))

    @classmethod
    def from_json(cls, path: str | Path) -> "Profile":
        """A profile file: the fields above, or measured samples to fit them from.

        ``{"prefill_samples": [[uncached, prefix, seconds], ...], "decode_samples": [[batch,
        context_tokens, seconds], ...]}`` (as measured on a real engine) replace the
        coefficients; every other field defaults to the A800 profile's.
        """
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a profile is a JSON object")
        base = {k: v for k, v in A800_LLAMA2_70B.__dict__.items()}
        unknown = set(raw) - set(base) - {"prefill_samples", "decode_samples"}
        if unknown:
            raise ValueError(f"{path}: unknown profile keys {sorted(unknown)}; known: {sorted(base)}")
        for key, model in (("prefill_samples", _MeasuredPrefillFit), ("decode_samples", DecodeTimeModel)):
            samples = raw.pop(key, None)
            if samples:
                m = model([0.0] * len(model.names), window=max(len(samples), 1))
                for a, b, s in samples:
                    m.observe(a, b, s)
                m.refit()
                raw[key.replace("_samples", "_coef")] = m.expanded() if isinstance(m, _MeasuredPrefillFit) else m.coef
        base.update(raw)
        if base["name"] == A800_LLAMA2_70B.name and "prefill_coef" in raw:
            base["name"] = Path(path).stem  # measured, not the A800 model: do not wear its name
        base["prefill_coef"] = tuple(base["prefill_coef"])
        base["decode_coef"] = tuple(base["decode_coef"])
        return cls(**base)


def _a800_llama2_70b() -> Profile:
    """One prefill/decode instance = 8x A800-80G (TP8) serving a LLaMA2-70B-like model (GQA, 8 KV heads).

    Compute from FLOPs at a sustained 1.0 PFLOP/s (40% of 8 x 312 TFLOPs bf16): 1.38e11 FLOPs
    per token for the weights, 4*L*d = 2.6e6 FLOPs per (query, key) pair for attention.
    Decode from memory bandwidth: 138 GB of weights and 320 KiB of KV per context token over
    ~9.8 TB/s effective. KV block of 512 tokens = 160 MiB. 80 layers, hidden size 8192 in bf16
    (16 KiB per token between pipeline stages). Network: 8x200 Gbps RDMA at ~100 GB/s
    achieved; local DRAM->HBM ~200 GB/s; NVMe tier ~8 GB/s. A node's ~1 TB of DRAM holds
    ~6000 blocks of prefix cache; a decode node's spare HBM ~1.4M tokens of KV.
    """
    flops = 1.0e15
    per_ktok = 1.38e11 * 1e3 / flops
    attn = 2.62e6 * 1e6 / flops
    kv_token_bytes = 2 * 80 * 8 * 128 * 2
    return Profile(
        name="a800-llama2-70b",
        block_size=512,
        block_bytes=512 * kv_token_bytes,
        prefill_coef=(0.02, per_ktok, attn, attn / 2),
        decode_coef=(0.015, 0.0003, kv_token_bytes * 1e3 / 9.8e12),
        local_bps=200e9,
        remote_bps=100e9,
        slow_bps=8e9,
        kv_capacity_tokens=1_400_000,
        cache_blocks=6000,
        notes="8x A800-80G per instance, LLaMA2-70B-like; modelled from FLOPs and bandwidth",
        num_layers=80,
        hidden_bytes_per_token=8192 * 2,
    )


A800_LLAMA2_70B = _a800_llama2_70b()

# An uninformed prior for a live cluster with no profile: 1 ms per uncached token and 1 ms per
# decode sequence, so before any measurement the cost model ranks instances by tokens of work
# and by batch size, like the old router.
GENERIC = Profile(name="generic", block_size=16, block_bytes=1 << 20, prefill_coef=(0.0, 1.0, 0.0, 0.0),
                  decode_coef=(0.01, 0.001, 0.0001), local_bps=10e9, remote_bps=1e9, slow_bps=0.2e9,
                  kv_capacity_tokens=0, cache_blocks=0, notes="uninformed prior")

PROFILES: dict[str, Profile] = {p.name: p for p in (A800_LLAMA2_70B, GENERIC)}


@dataclass
class PrefillBacklog:
    """Prefill work routed to one instance and not yet finished, in predicted seconds.

    This is the ``T_queue`` of Algorithm 1: what the conductor itself sent there, so it is
    current between heartbeats. A started job counts only its predicted remainder.
    """

    waiting: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (predicted s, tokens)
    running: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (predicted s, started at)
    waiting_s: float = 0.0
    waiting_tokens: int = 0

    def add(self, request_id: str, predicted_s: float, tokens: int = 0) -> None:
        self.waiting[request_id] = (predicted_s, tokens)
        self.waiting_s += predicted_s
        self.waiting_tokens += tokens

    def _unwait(self, request_id: str) -> float:
        predicted, tokens = self.waiting.pop(request_id, (0.0, 0))
        self.waiting_s = max(0.0, self.waiting_s - predicted) if self.waiting else 0.0
        self.waiting_tokens = self.waiting_tokens - tokens if self.waiting else 0
        return predicted

    def start(self, request_id: str, now_s: float) -> None:
        self.running[request_id] = (self._unwait(request_id), now_s)

    def finish(self, request_id: str) -> bool:
        """The job ended (done, failed or dropped); whether it was booked here."""
        if self.running.pop(request_id, None) is not None:
            return True
        booked = request_id in self.waiting
        self._unwait(request_id)
        return booked

    def seconds(self, now_s: float) -> float:
        left = sum(max(0.0, p - (now_s - t0)) for p, t0 in self.running.values())
        return left + self.waiting_s
