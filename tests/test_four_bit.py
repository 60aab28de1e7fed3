"""Weights on a 4-bit grid read as 4 bits by one-row calls (engine/four_bit.py): only weights found on
the grid, with two bf16 (scale, zero) pairs so that the kernel multiplies by the grid's own values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mooncaked.engine.bf16_weights import Bf16Linear, CandidateHead
from mooncaked.engine.four_bit import FOUR_BIT_ROWS, INT4_GROUP, FourBitPair, quantize_int4
from mooncaked.engine.quant import Fp16Linear, Fp16Scorer, quantize_model
from native_kernels import native_or_skip
from test_engine_precision import NO_BF16_HERE


def q4_1_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Q4_1 blocks as llama.cpp writes them: w = d * q + m, q in 0..15 (both ends used), d and m fp16
    values that bf16 cannot hold exactly."""
    g = torch.Generator().manual_seed(seed)
    blocks = rows * cols // INT4_GROUP
    q = torch.randint(0, 16, (blocks, INT4_GROUP), generator=g)
    q[:, 0], q[:, 1] = 0, 15
    d = (torch.rand(blocks, 1, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(blocks, 1, generator=g) * 0.08).half().float()
    return (d * q + m).reshape(rows, cols)


def test_only_weights_on_a_4_bit_grid_are_taken():
    assert FourBitPair.of(q4_1_weight(64, 128, seed=1)) is not None
    assert FourBitPair.of(torch.randn(64, 128) * 0.02) is None  # plain weights: re-quantizing would lose
    assert FourBitPair.of(q4_1_weight(64, 128, seed=1)[:, :100]) is None  # not groups of 32
    assert FourBitPair.of(q4_1_weight(72, 128, seed=1)[:40]) is None  # not rows in 16s
    # any weight, when asked for a lossy copy (a scorer whose picks are rescored in fp32)
    lossy = FourBitPair.of(torch.randn(64, 128) * 0.02, lossy_ok=True)
    assert lossy is not None and lossy.fine is None


def test_two_pairs_give_the_grids_own_weights():
    w = q4_1_weight(256, 576, seed=2)
    pair = FourBitPair.of(w)
    x = torch.randn(1, 576)
    xb = x.to(torch.bfloat16)
    exact = xb.double() @ w.double().T  # the bf16-rounded input times the grid's weights
    got = pair(x)
    assert got.dtype == torch.float32 and got.shape == (1, 256)
    err = (got.double() - exact).abs().max().item()
    # what the output's bf16 rounding allows (the kernel returns bf16), per pair
    assert err <= 2 * 2.0 ** -8 * exact.abs().max().item()
    # one bf16 pair alone multiplies by other weights (as bf16 weights do): the second pair is what
    # makes them the grid's, so what is left is the output's rounding (measured: ~0.68x their RMS error)
    q, scale, zero = quantize_int4(w)
    coarse = FourBitPair(q, scale, zero, exact=False)
    errors: dict[str, list[float]] = {"pair": [], "coarse": [], "bf16": []}
    for seed in range(16):
        x = torch.randn(1, 576, generator=torch.Generator().manual_seed(seed))
        exact = x.to(torch.bfloat16).double() @ w.double().T
        for name, y in (("pair", pair(x)), ("coarse", coarse(x)),
                        ("bf16", torch.nn.functional.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)))):
            errors[name].append((y.double() - exact).pow(2).mean().sqrt().item())
    rms = {name: sum(e) / len(e) for name, e in errors.items()}
    assert rms["pair"] < 0.8 * rms["coarse"] and rms["pair"] < 0.8 * rms["bf16"], rms


@pytest.mark.skipif(NO_BF16_HERE is not None, reason=str(NO_BF16_HERE))
def test_a_bf16_layer_reads_4_bits_for_a_few_rows_only():
    lin = nn.Linear(576, 256, bias=True)
    with torch.no_grad():
        lin.weight.copy_(q4_1_weight(256, 576, seed=3))
    layer = Bf16Linear(lin)
    assert layer.four_bit is not None
    rows = layer.four_bit.rows  # 8 for the native fp32 form, 4 for torch's int4 kernel
    one, few, many = torch.randn(1, 576), torch.randn(rows, 576), torch.randn(rows + 1, 576)
    torch.testing.assert_close(layer(one), layer.four_bit(one) + lin.bias, rtol=0, atol=0)
    torch.testing.assert_close(layer(few), layer.four_bit(few) + lin.bias, rtol=0, atol=0)
    torch.testing.assert_close(layer(many), layer.weight(many).float() + lin.bias, rtol=0, atol=0)
    plain = Bf16Linear(nn.Linear(576, 256))
    assert plain.four_bit is None
    torch.testing.assert_close(plain(one), plain.weight(one).float() + plain.bias, rtol=0, atol=0)


@pytest.mark.skipif(NO_BF16_HERE is not None, reason=str(NO_BF16_HERE))
def test_an_off_grid_head_scores_one_row_in_4_bits_and_its_best_in_fp32():
    torch.manual_seed(4)
    linear = nn.Linear(64, 512, bias=False)
    head = CandidateHead(linear, k=8)
    assert head.cheap.four_bit is not None and head.cheap.four_bit.fine is None
    h = torch.randn(1, 64)
    with torch.no_grad():
        want = linear(h)
        got = head(h)
        top = head.cheap.four_bit(h).topk(8, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.skipif(NO_BF16_HERE is not None, reason=str(NO_BF16_HERE))
def test_the_fp16_paths_head_scores_a_few_rows_in_4_bits_and_its_best_in_fp32():
    torch.manual_seed(5)
    linear = nn.Linear(64, 512, bias=False)
    model = nn.Sequential()
    model.lm_head = linear
    assert quantize_model(model, "fp16", dense=False, four_bit_head=True) == 1
    head = model.lm_head
    assert isinstance(head, CandidateHead) and isinstance(head.cheap, Fp16Scorer)
    assert head.cheap.four_bit is not None and head.cheap.four_bit.fine is None  # off the grid: lossy
    few, many = torch.randn(FOUR_BIT_ROWS, 64), torch.randn(FOUR_BIT_ROWS + 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(head.cheap(few), head.cheap.four_bit(few), rtol=0, atol=0)
        torch.testing.assert_close(head.cheap(many), head.cheap.fp16(many), rtol=0, atol=0)
        for h in (few, many):  # the best candidates are fp32's own logits, whichever scorer picked them
            want, got = linear(h), head(h)
            top = head.cheap(h).topk(head.k, dim=-1).indices
            torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top), rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    plain = nn.Sequential()
    plain.lm_head = nn.Linear(64, 512, bias=False)
    quantize_model(plain, "fp16", dense=False)  # without native bf16 the int4 kernel is slow: fp16 only
    assert isinstance(plain.lm_head.cheap, Fp16Linear)


def _native_or_skip():
    """The native 4-bit fp32 kernel (engine/native.py), or a skip that says why this CPU cannot run it."""
    return native_or_skip().q4_linear


def _grid_linear(seed: int) -> nn.Linear:
    """A [576 -> 256] layer with a bias whose weight is on a Q4_1 grid."""
    lin = nn.Linear(576, 256, bias=True)
    with torch.no_grad():
        lin.weight.copy_(q4_1_weight(256, 576, seed=seed))
    return lin


def test_the_native_kernel_multiplies_fp32_activations_by_the_grids_own_weights():
    from mooncaked.engine.four_bit import FourBitFp32, four_bit_form

    kernel = _native_or_skip()
    w = q4_1_weight(256, 576, seed=6)
    form = four_bit_form(w)
    assert isinstance(form, FourBitFp32) and form.exact
    for rows in (1, 3, form.rows, form.rows + 3, 16, 37):  # any row count: 16, 8, 4, 2 and 1 at a time
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ w.double().T
        got = form(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 256)
        # fp32 sums in another order than a GEMM's: ~1e-7 relative, where bf16 activations alone are ~4e-3
        assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # a weight off the grid gets no exact form; a lossy copy (a scorer's) stays torch's int4 kernel's
    assert four_bit_form(torch.randn(64, 128) * 0.02) is None
    lossy = four_bit_form(torch.randn(64, 128) * 0.02, lossy_ok=True)
    assert isinstance(lossy, FourBitPair) and not lossy.exact
    bad = torch.zeros(2, 100)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(bad, form.packed, form.scale, form.offset)


@pytest.mark.skipif(NO_BF16_HERE is not None, reason=str(NO_BF16_HERE))
def test_a_bf16_layer_on_the_grid_multiplies_in_fp32_in_a_small_step_only():
    from mooncaked.engine.bf16_weights import fp32_step

    _native_or_skip()
    lin = _grid_linear(seed=7)
    layer = Bf16Linear(lin, exact_steps=True)
    assert layer.exact_steps
    one, many = torch.randn(1, 576), torch.randn(40, 576)
    with torch.no_grad():
        want = lin(many)
        with fp32_step():  # the native kernel for every row: the grid's weights, fp32 sums
            torch.testing.assert_close(layer(many), layer.four_bit(many) + lin.bias, rtol=0, atol=0)
            torch.testing.assert_close(layer(many), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(layer(one), lin(one), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(many), layer.weight(many).float() + lin.bias, rtol=0, atol=0)  # bf16
        with fp32_step(False):
            torch.testing.assert_close(layer(many), layer.weight(many).float() + lin.bias, rtol=0, atol=0)
    assert not Bf16Linear(lin).exact_steps  # not asked for
    off_grid = Bf16Linear(nn.Linear(576, 256), exact_steps=True)
    assert not off_grid.exact_steps  # no exact 4-bit form: its steps stay bf16


def test_a_kernel_that_cannot_be_built_leaves_torchs_kernels(monkeypatch, tmp_path, caplog):
    """No compiler (or headers, or ninja) on a CPU that could run the kernel: a warning that says why, and
    None, so that the layers keep torch's int4 kernel; nothing is raised and nothing waits."""
    import logging

    from mooncaked.engine import native

    if native.cpu_cannot_run() is not None:
        pytest.skip(f"native 4-bit kernel: {native.cpu_cannot_run()}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="mooncaked.engine.native"):
        assert native._native_once.__wrapped__() is None  # past the cache: a fresh attempt
    assert "could not be built" in caplog.text and "no-such-compiler" in caplog.text


def test_the_users_switch_turns_the_native_kernels_off(monkeypatch, caplog):
    """MOONCAKED_NATIVE=0: no build is tried, the reason is logged, and callers keep torch's kernels."""
    import logging

    from mooncaked.engine import native

    monkeypatch.setenv("MOONCAKED_NATIVE", "0")
    assert native.native_unavailable() == "MOONCAKED_NATIVE=0"
    monkeypatch.setenv("CXX", "/no-such-compiler")  # a build attempt would warn about it
    with caplog.at_level(logging.INFO, logger="mooncaked.engine.native"):
        assert native._native_once.__wrapped__() is None  # past the cache: a fresh decision
    assert "MOONCAKED_NATIVE=0" in caplog.text and "could not be built" not in caplog.text
    monkeypatch.delenv("MOONCAKED_NATIVE")
    assert native.native_unavailable() == native.cpu_cannot_run()


def test_an_fp16_layer_on_the_grid_reads_4_bits_with_fp32_activations_for_a_few_rows():
    from mooncaked.engine.four_bit import FourBitFp32

    _native_or_skip()
    lin = _grid_linear(seed=8)
    layer = Fp16Linear(lin, dense=True)
    assert isinstance(layer.four_bit, FourBitFp32)
    few, mid, many = torch.randn(layer.four_bit.rows, 576), torch.randn(layer.four_bit.rows + 1, 576), torch.randn(80, 576)
    with torch.no_grad():
        torch.testing.assert_close(layer(few), layer.four_bit(few) + lin.bias, rtol=0, atol=0)
        torch.testing.assert_close(layer(few), lin(few), rtol=1e-5, atol=1e-5)  # the grid's weights, fp32 sums
        torch.testing.assert_close(layer(mid), layer._gemm(mid, layer.packed), rtol=0, atol=0)  # fbgemm fp16
        torch.testing.assert_close(layer(many), torch.nn.functional.linear(many, layer.dense, layer.bias), rtol=0, atol=0)
    assert Fp16Linear(nn.Linear(576, 256)).four_bit is None  # off the grid: fbgemm's fp16 only
