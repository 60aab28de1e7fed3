"""int4 on a Q4_1 GGUF (the default model's format): the re-quantization at load time recovers the
file's own grid, so the int4 kernel multiplies by exactly the weights the fp32 path holds.

A Q4_1 block is w = d*q + m (q in 0..15, d and m fp16), quantized by llama.cpp (and gguf-py, whose
quantizer the GGUF here is written with) from its block's min and max, so q = 0 and q = 15 both occur
and min/max recover d and m (measured on the default model: all 3,317,760 blocks, 0 of 106M q's differ;
docs/performance.md "Engine"). The kernel takes bf16 scales and zeros: exact where d and m + 8d are
bf16-representable, which the weights below are built to be."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from mooncaked.engine import Engine, SamplingParams
from mooncaked.engine.quant import INT4_GROUP, QuantLinear, quantize_int4
from test_gguf import Vocab, bpe, bpe_vocab, tiny_llama, write_gguf  # noqa: F401 - fixtures

Q = gguf.GGMLQuantizationType


def _on_q4_1_grid(model: nn.Module, seed: int) -> nn.Module:
    """Every linear weight made of Q4_1 blocks that use q = 0 and 15, with d a power of two and
    m a small multiple of d: every value, d and m + 8d are then exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2 or "embed" in name:
                continue
            rows, cols = p.shape
            blocks = rows * cols // INT4_GROUP
            q = torch.randint(0, 16, (blocks, INT4_GROUP), generator=g)
            q[:, 0], q[:, 1] = 0, 15
            d = 2.0 ** -torch.randint(5, 9, (blocks, 1), generator=g).float()
            m = torch.randint(-12, -3, (blocks, 1), generator=g).float() * d
            p.copy_((d * q + m).reshape(rows, cols))
    return model


def test_int4_reproduces_the_q4_1_weights_exactly(tmp_path: Path, bpe_vocab: Vocab) -> None:
    model = _on_q4_1_grid(tiny_llama(seed=3), seed=4)
    path = write_gguf(tmp_path / "q4_1.gguf", model, bpe_vocab, Q.Q4_1)
    kw = dict(dtype="float32", block_size=4, kv_cache_bytes=4 << 20, cache_dir=tmp_path / "cache")
    exact = dict(Engine.from_pretrained(path, **kw).runner.model.named_modules())
    int4 = Engine.from_pretrained(path, quantize="int4", **kw)
    checked = 0
    for name, layer in int4.runner.model.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        w = exact[name].weight.detach()
        q, scale, zero = quantize_int4(w)
        back = ((q.float().view(*q.shape[:1], -1, INT4_GROUP) - 8) * scale[..., None] + zero[..., None]).view(w.shape)
        assert torch.equal(back, w), name  # the grid recovered: the same weights, bit for bit
        # the kernel's own weights (what a decode step multiplies by): the identity (bf16-exact) times them
        eye = torch.eye(layer.in_features)
        with torch.no_grad():
            got = torch.ops.aten._weight_int4pack_mm_for_cpu(eye.bfloat16(), layer.packed, INT4_GROUP,
                                                             layer.scales_zeros)
        assert torch.equal(got.float().T, w), name
        checked += 1
    assert checked == 2 * 4  # per layer: qkv, o, gate_up, down (the 300-row head stays fp32: rows in 16s)


def test_the_weights_of_a_q4_1_gguf_are_found_on_the_grid_and_no_others(tmp_path: Path, bpe_vocab: Vocab) -> None:
    """What the bf16 path (the default where the CPU has native bf16) keeps as 4 bits too, for one-row
    steps (engine/four_bit.py): a Q4_1 file's weights as the loader gives them; any other checkpoint's
    are not on a grid and stay bf16 only. The same files through the bf16 engine: the next test."""
    from mooncaked.engine.four_bit import FourBitPair

    kw = dict(dtype="float32", block_size=4, kv_cache_bytes=4 << 20, cache_dir=tmp_path / "cache")
    for path, want in _grid_and_plain_gguf(tmp_path, bpe_vocab):
        model = Engine.from_pretrained(path, **kw).runner.model
        found = [FourBitPair.of(m.weight) is not None for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and "layers." in n]
        assert len(found) == 2 * 4 and sum(found) == want, path


def _grid_and_plain_gguf(tmp_path: Path, bpe_vocab: Vocab) -> list[tuple[Path, int]]:
    """A Q4_1 GGUF on the grid and an F32 one of the same model, each with how many of its 2 layers x 4
    linear weights are on a 4-bit grid."""
    on_grid = write_gguf(tmp_path / "q4_1.gguf", _on_q4_1_grid(tiny_llama(seed=3), seed=4), bpe_vocab, Q.Q4_1)
    plain = write_gguf(tmp_path / "f32.gguf", tiny_llama(seed=3), bpe_vocab, Q.F32)
    return [(on_grid, 2 * 4), (plain, 0)]


def test_the_bf16_engine_reads_a_q4_1_ggufs_weights_as_4_bits(tmp_path: Path, bpe_vocab: Vocab) -> None:
    from mooncaked.engine.bf16_weights import Bf16Linear
    from test_engine_precision import NO_BF16_HERE

    if NO_BF16_HERE is not None:  # bf16 weights need oneDNN's bf16 GEMM on this CPU
        pytest.skip(NO_BF16_HERE)
    kw = dict(dtype="float32", quantize="bf16", block_size=4, kv_cache_bytes=4 << 20, cache_dir=tmp_path / "cache")
    for path, want in _grid_and_plain_gguf(tmp_path, bpe_vocab):
        engine = Engine.from_pretrained(path, **kw)
        layers = {n: m for n, m in engine.runner.model.named_modules() if isinstance(m, Bf16Linear)}
        assert sum(m.four_bit is not None for n, m in layers.items() if "layers." in n) == want, path
        one = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(one.token_ids) == 4 and one.finish_reason == "length"


def test_the_bf16_engine_gives_fp32s_greedy_tokens_for_a_lone_short_prompt(tmp_path: Path, bpe_vocab: Vocab) -> None:
    """The default path on a Q4_1 GGUF where the native kernel runs: a step of a few sequences and few tokens
    multiplies in fp32 (every call by the 4-bit kernel with fp32 activations), so one prompt at a time gets the
    exact path's tokens, and so do up to 16 short prompts at once; a longer step runs bf16."""
    from mooncaked.engine.bf16_weights import EXACT_ROWS, Bf16Linear
    from mooncaked.engine.four_bit import NATIVE_ROWS
    from native_kernels import native_or_skip
    from test_engine_precision import NO_BF16_HERE

    if NO_BF16_HERE is not None:
        pytest.skip(NO_BF16_HERE)
    native_or_skip()
    path = write_gguf(tmp_path / "q4_1.gguf", _on_q4_1_grid(tiny_llama(seed=3), seed=4), bpe_vocab, Q.Q4_1)
    kw = dict(block_size=4, kv_cache_bytes=8 << 20, cache_dir=tmp_path / "cache")
    exact = Engine.from_pretrained(path, dtype="float32", **kw)
    fast = Engine.from_pretrained(path, dtype="float32", quantize="bf16", **kw)
    layers = [m for n, m in fast.runner.model.named_modules() if isinstance(m, Bf16Linear) and "layers." in n]
    assert len(layers) == 8 and all(m.exact_steps for m in layers)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 9, 17, EXACT_ROWS)]
    for p in prompts:
        assert fast.generate([p], params)[0].token_ids == exact.generate([p], params)[0].token_ids, len(p)
    # 16 short prompts at once: their prefill (48 tokens) and every decode step of 16 rows are small steps too
    batch = [torch.randint(3, 250, (3,), generator=g).tolist() for _ in range(NATIVE_ROWS)]
    want = [exact.generate([p], params)[0].token_ids for p in batch]
    bf16_rows = _count_bf16_rows(layers)
    assert [o.token_ids for o in fast.generate(batch, params)] == want
    assert bf16_rows == [], "a step of 16 short sequences went through the bf16 GEMM"
    fresh = torch.randint(3, 250, (EXACT_ROWS + 1,), generator=g).tolist()  # nothing of it in the prefix cache
    fast.generate([fresh], SamplingParams(max_tokens=1, ignore_eos=True))
    assert bf16_rows == [EXACT_ROWS + 1] * len(layers)  # a longer step does

    def gap(p: list[int]) -> float:
        """How far the fast engine's best 16 logits (rescored in fp32 by its head) are from the exact one's."""
        want, got = exact.score(p), fast.score(p)
        top = want.topk(16, dim=-1).indices
        return (got.gather(-1, top) - want.gather(-1, top)).abs().max().item()

    # a prompt in one small step: the logits of fp32 weights (the head's bmm sums in its own order: ~1e-6);
    # the same prompt scored in one step of EXACT_ROWS + 1 tokens goes through bf16, ~1000x further off
    short = prompts[-1]
    long = short + [7]
    assert gap(short) < 1e-5
    assert gap(long) > 1e-3
    # --no-exact-small-steps: a short prompt through bf16 as a long one
    off = Engine.from_pretrained(path, dtype="float32", quantize="bf16", exact_small_steps=False, **kw)
    assert not any(m.exact_steps for m in off.runner.model.modules() if isinstance(m, Bf16Linear))
    want, got = exact.score(short), off.score(short)
    top = want.topk(16, dim=-1).indices
    assert (got.gather(-1, top) - want.gather(-1, top)).abs().max().item() > 1e-3


def _count_bf16_rows(layers: list) -> list[int]:
    """From now on, the row count of every call that goes through these layers' bf16 GEMM."""
    seen: list[int] = []

    class Counted:
        def __init__(self, packed) -> None:
            self.packed = packed

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.reshape(-1, x.shape[-1]).shape[0])
            return self.packed(x)

    for m in layers:
        m.weight = Counted(m.weight)
    return seen
