"""CBraMod's fast paths (models/cbramod/_fast.py) compute the official function.

The short-sequence attention (batched matmuls + fp32 softmax) and SDPA agree with an explicit
softmax(q k^T / sqrt(d)) v, in values and gradients, at short and long lengths; the oneDNN linear
(fused bias / GELU / residual, inference only) equals F.linear + F.gelu + add and never swallows
gradients; the whole model with every fast path forced on or off equals the official
restatement (domainfm.models.cbramod.reference) to 1e-5 in fp32, and stays within the official
model's own bf16 error under bf16 autocast.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domainfm.models.cbramod import CBraMod, _fast, convert_official_state_dict

sys.path.insert(0, str(Path(__file__).parents[1]))
from _cbramod_weights import random_official_cbramod  # noqa: E402


def _explicit_attention(qkv, n_heads):
    """softmax(q k^T / sqrt(dh)) v per head, written out in float64 with no fused kernel."""
    s, length, width = qkv.shape
    dim = width // 3
    dh = dim // n_heads
    q, k, v = qkv.double().view(s, length, 3, n_heads, dh).unbind(2)  # (S, L, H, dh) each
    scores = torch.einsum("slhd,smhd->shlm", q, k) / dh ** 0.5
    probs = scores.exp() / scores.exp().sum(-1, keepdim=True)
    return torch.einsum("shlm,smhd->slhd", probs, v).reshape(s, length, dim)


@pytest.mark.parametrize("length", [1, 19, 30, 200])
@pytest.mark.parametrize("path", ["short", "sdpa"])
def test_attention_paths_equal_explicit_softmax_attention_values_and_gradients(path, length):
    g = torch.Generator().manual_seed(length)
    qkv = torch.randn(6, length, 3 * 100, generator=g).requires_grad_(True)
    got = _fast.attention(qkv, 4, path=path)
    want = _explicit_attention(qkv.detach(), 4)
    assert got.shape == (6, length, 100) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    # gradients: against the float64 explicit computation's autograd
    cot = torch.randn(got.shape, generator=g)
    (got * cot).sum().backward()
    ref_in = qkv.detach().double().requires_grad_(True)
    (_explicit_attention(ref_in, 4) * cot.double()).sum().backward()
    torch.testing.assert_close(qkv.grad.double(), ref_in.grad, rtol=1e-5, atol=1e-5)


def test_short_path_equals_sdpa_in_bf16_within_bf16_rounding():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(40, 19, 300, generator=g)
    want = _explicit_attention(qkv, 4)
    for path in ("short", "sdpa"):
        got = _fast.attention(qkv.bfloat16(), 4, path=path)
        assert got.dtype == torch.bfloat16
        # bf16 inputs: |error| of a convex combination of values of size ~1, a few bf16 ulps
        assert (got.double() - want).abs().max() < 0.05, path


def test_attention_path_policy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _fast.use_short_attention(19, torch.bfloat16, cpu) and _fast.use_short_attention(30, torch.float16, cpu)
    assert _fast.use_short_attention(_fast.SHORT_SEQUENCE, torch.bfloat16, cpu)
    assert not _fast.use_short_attention(_fast.SHORT_SEQUENCE + 1, torch.bfloat16, cpu)  # long: SDPA
    assert not _fast.use_short_attention(19, torch.float32, cpu)  # fp32: SDPA measured no slower
    assert not _fast.use_short_attention(19, torch.bfloat16, cuda)  # GPUs: SDPA's fused kernels
    with pytest.raises(ValueError, match="path="):
        _fast.attention(torch.randn(2, 3, 12), 2, path="flash")


def test_short_path_dropout_drops_probabilities_and_is_unbiased():
    torch.manual_seed(0)
    qkv = torch.randn(4, 10, 3 * 8)
    clean = _fast.attention(qkv, 2, path="short")
    draws = torch.stack([_fast.attention(qkv, 2, dropout_p=0.2, path="short") for _ in range(1000)])
    assert not torch.allclose(draws[0], clean)  # dropout really applied
    # E[dropout(probs)] = probs (kept ones scaled by 1/(1-p)): the mean over draws approaches the
    # clean output within 5 standard errors everywhere
    z = (draws.mean(0) - clean).abs() / (draws.std(0) / len(draws) ** 0.5)
    assert z.max() < 5


# ------------------------------------------------------------------------------------------ linear


# The bf16 weight copies exist only on oneDNN's bf16 path; where oneDNN has no bf16 linear (AVX2, or
# ONEDNN_MAX_CPU_ISA capped) plain torch runs, whose autocast keeps its own cast cache per context.
_NEEDS_ONEDNN_BF16 = pytest.mark.skipif(not _fast.onednn_bf16_linear_works(),
                                        reason="oneDNN has no bf16 linear on this CPU: no bf16 weight copies to test")


def _linear(i=40, o=24):
    torch.manual_seed(1)
    lin = nn.Linear(i, o)
    nn.init.normal_(lin.bias)
    return lin


@pytest.mark.parametrize("shape", [(7, 40), (2, 3, 5, 40)])
def test_onednn_linear_equals_linear_gelu_residual_in_fp32(shape):
    lin = _linear()
    x = torch.randn(*shape)
    res = torch.randn(*shape[:-1], 24)
    strided = torch.randn(*shape[:-1], 80)[..., 20:60]  # a non-contiguous slice, read in place
    with torch.no_grad():
        assert _fast._onednn_operands(lin, x) is not None or not _fast._HAS_ONEDNN_LINEAR
        for inp in (x, strided):
            torch.testing.assert_close(_fast.linear(lin, inp), F.linear(inp, lin.weight, lin.bias), rtol=0, atol=1e-5)
            torch.testing.assert_close(_fast.linear(lin, inp, "gelu"), F.gelu(F.linear(inp, lin.weight, lin.bias)),
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(_fast.linear(lin, inp, residual=res), res + F.linear(inp, lin.weight, lin.bias),
                                       rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        _fast.linear(lin, x, "relu")


def test_onednn_linear_under_bf16_autocast_matches_autocast_linear():
    lin = _linear()
    x = torch.randn(64, 40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = _fast.linear(lin, x, "gelu")
        want = F.gelu(lin(x))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_linear_keeps_autograd_and_wrapped_modules():
    lin = _linear()
    x = torch.randn(5, 40, requires_grad=True)
    assert _fast._onednn_operands(lin, x) is None  # grad enabled: the oneDNN op has no backward
    _fast.linear(lin, x, "gelu").sum().backward()
    x2 = x.detach().requires_grad_(True)
    lin2 = _linear()
    F.gelu(lin2(x2)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, lin2.weight.grad, rtol=0, atol=1e-6)

    class Wrapped(nn.Module):  # what LoRA puts in place of a Linear: must be called, not bypassed
        def __init__(self, base):
            super().__init__()
            self.base, self.calls = base, 0

        def forward(self, inp):
            self.calls += 1
            return self.base(inp) + 1.0

    wrapped = Wrapped(_linear())
    with torch.no_grad():
        out = _fast.linear(wrapped, x.detach())
    assert wrapped.calls == 1
    torch.testing.assert_close(out, F.linear(x.detach(), wrapped.base.weight, wrapped.base.bias) + 1.0)


# ------------------------------------------------------------------------------------------ model


def _pair(n_layers=2, ffn=64, seed=0):
    ref = random_official_cbramod(n_layers, ffn, seed)
    model = CBraMod(n_layers=n_layers, dim_feedforward=ffn)
    model.load_state_dict(convert_official_state_dict(ref.state_dict(), model))
    return ref.eval(), model.eval()


@pytest.mark.parametrize("short", [True, False])
@pytest.mark.parametrize("onednn", [True, False])
def test_model_with_fast_paths_on_or_off_equals_official_fp32(monkeypatch, short, onednn):
    ref, model = _pair()
    monkeypatch.setattr(_fast, "use_short_attention", lambda *a: short)
    if not onednn:
        monkeypatch.setattr(_fast, "_HAS_ONEDNN_LINEAR", False)
    x = torch.randn(2, 19, 4, 200, generator=torch.Generator().manual_seed(2))
    mask = torch.rand(2, 19, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref.features(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(model.forward_reconstruction(x, mask), ref(x, mask.long()), rtol=0, atol=1e-5)


def test_bf16_autocast_error_is_within_the_official_models_own_bf16_error():
    # Documented bf16 tolerance: under bf16 autocast our features differ from the fp32 official
    # output by no more than the official model's own bf16 run does (x1.5 + 0.02 slack for
    # rounding in different places: fused bias/GELU/residual, fp32 softmax).
    ref, model = _pair(n_layers=4, ffn=128, seed=5)
    x = torch.randn(2, 19, 30, 200, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref.features(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = model.forward_features(x).float()
            theirs = ref.features(x).float()
    err_ours, err_theirs = (ours - want).abs(), (theirs - want).abs()
    assert err_theirs.max() > 1e-3  # autocast was really in effect
    assert err_ours.max() <= 1.5 * err_theirs.max() + 0.02
    assert err_ours.mean() <= 1.5 * err_theirs.mean() + 1e-3


# ------------------------------------------------------------------------------------------ dropout


def test_keep_mask_rate_scale_and_reproducibility():
    torch.manual_seed(0)
    keep, scale = _fast.keep_mask((1000, 1001), 0.1)
    assert keep.dtype == torch.bool and keep.shape == (1000, 1001)
    p_eff = round(0.1 * 65536) / 65536
    assert abs(p_eff - 0.1) < 2 ** -17 and scale == pytest.approx(1 / (1 - p_eff), rel=1e-12)
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p_eff)) < 5 * (p_eff * (1 - p_eff) / n) ** 0.5  # binomial 5 sigma
    # no correlation between neighbouring 16-bit slots of one 64-bit draw
    k = keep.flatten()[: n - n % 4].view(-1, 4).float()
    assert (k[:, 0] * k[:, 1]).mean().item() == pytest.approx((1 - p_eff) ** 2, abs=3e-3)
    torch.manual_seed(0)
    again, _ = _fast.keep_mask((1000, 1001), 0.1)
    assert torch.equal(keep, again)  # torch.manual_seed reproducible
    for p in (0.0, 0.5, 0.9):
        keep, scale = _fast.keep_mask((200_000,), p)
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01 and scale == pytest.approx(1 / (1 - p), rel=1e-4)


def test_dropout_values_gradients_and_residual():
    x = torch.randn(64, 50, requires_grad=True)
    res = torch.randn(64, 50)
    assert _fast.dropout(x, 0.3, training=False) is x
    torch.testing.assert_close(_fast.dropout(x, 0.3, False, residual=res), res + x)
    torch.manual_seed(7)
    out = _fast.dropout(x, 0.3, training=True)
    torch.manual_seed(7)
    keep, scale = _fast.keep_mask(x.shape, 0.3)
    torch.testing.assert_close(out, torch.where(keep, x * scale, 0.0))
    out.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() * scale)
    torch.manual_seed(7)
    fused = _fast.dropout(x, 0.3, training=True, residual=res)
    torch.testing.assert_close(fused, res + out, rtol=0, atol=1e-6)
    assert (out == 0).float().mean().item() == pytest.approx(0.3, abs=0.05)


def test_train_mode_layer_uses_dropout_with_the_right_statistics():
    # train mode with dropout: E[output] over masks equals the eval output up to the nonlinearity,
    # and p=0 gives exactly the eval output (dropout is the only train/eval difference)
    from domainfm.models.cbramod.cbramod import CrissCrossLayer

    torch.manual_seed(0)
    layer = CrissCrossLayer(d_model=16, n_heads=4, dim_feedforward=32, dropout=0.0)
    x = torch.randn(2, 3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer.train()(x), layer.eval()(x), rtol=0, atol=1e-6)
    layer = CrissCrossLayer(d_model=16, n_heads=4, dim_feedforward=32, dropout=0.5).train()
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)  # stochastic in train mode
    assert a.shape == x.shape and torch.isfinite(a).all()


@_NEEDS_ONEDNN_BF16
def test_bf16_weight_copies_follow_in_place_updates_and_reloads():
    lin = _linear()
    x = torch.randn(8, 40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = _fast.linear(lin, x)
        assert torch.equal(_fast.linear(lin, x), first)  # cached copy reused: same result
        lin.weight.mul_(2.0)  # in-place update: the copy must be rebuilt
        torch.testing.assert_close(_fast.linear(lin, x).float(), lin(x).float(), rtol=2e-2, atol=2e-2)
        lin.load_state_dict({"weight": torch.zeros(24, 40), "bias": torch.ones(24)})
        assert torch.equal(_fast.linear(lin, x).float(), torch.ones(8, 24))
    assert "_fast_bf16" not in lin.state_dict() and not any("_fast" in k for k in lin.state_dict())


@_NEEDS_ONEDNN_BF16
def test_bf16_weight_copies_follow_replaced_parameters():
    lin = _linear()
    x = torch.randn(8, 40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _fast.linear(lin, x)
        lin.weight = nn.Parameter(torch.zeros(24, 40))
        lin.bias = nn.Parameter(torch.full((24,), 3.0))
        assert torch.equal(_fast.linear(lin, x).float(), torch.full((8, 24), 3.0))
        lin.weight.data = torch.ones(24, 40)  # .data swap (what Module.to does): new storage
        torch.testing.assert_close(_fast.linear(lin, x).float(), lin(x).float(), rtol=2e-2, atol=0.3)


# ------------------------------------------------------------------- packed fp32 inference path


@pytest.mark.parametrize("length", [1, 19, 30])
def test_packed_path_equals_explicit_attention_with_deferred_or_included_bias(length):
    g = torch.Generator().manual_seed(length)
    raw = torch.randn(6, length, 300, generator=g)
    bias = torch.randn(300, generator=g)
    want = _explicit_attention(raw + bias, 4)
    with torch.no_grad():
        deferred = _fast.attention(raw, 4, path="packed", bias=bias)  # the kernel adds the bias
        included = _fast.attention(raw + bias, 4, path="packed")  # bias already in: zeros added
        short_with_bias = _fast.attention(raw, 4, path="short", bias=bias)
    for got in (deferred, included, short_with_bias):
        assert got.shape == (6, length, 100) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_packed_path_policy_and_no_backward():
    cpu = torch.device("cpu")
    with torch.no_grad():
        assert _fast.attention_path(19, torch.float32, cpu) == "packed"
        assert _fast.attention_path(19, torch.bfloat16, cpu) == "short"
        assert _fast.attention_path(_fast.SHORT_SEQUENCE + 1, torch.float32, cpu) == "sdpa"
        assert _fast.attention_path(19, torch.float32, torch.device("cuda")) == "sdpa"
    assert _fast.attention_path(19, torch.float32, cpu) == "sdpa"  # gradients: the packed op has none
    assert _fast.attention_path(19, torch.float32, cpu, dropout_p=0.1) == "short"
    qkv = torch.randn(2, 5, 24, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward"):
        _fast.attention(qkv, 2, path="packed")


def test_projection_without_bias_defers_exactly_the_linear_bias():
    lin = _linear(40, 36)
    x = torch.randn(3, 7, 40)
    with torch.no_grad():
        raw, bias = _fast.projection_without_bias(lin, x)
        if _fast._HAS_ONEDNN_LINEAR:
            assert bias is lin.bias
            torch.testing.assert_close(raw + bias, lin(x), rtol=0, atol=1e-5)
        else:
            assert bias is None
            torch.testing.assert_close(raw, lin(x))
    raw, bias = _fast.projection_without_bias(lin, x)  # with gradients: the ordinary module call
    assert bias is None and raw.requires_grad


# ---------------------------------------------------------------------------- dropout multipliers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keep_multiplier_is_the_keep_mask_as_exact_zeros_and_ones(dtype):
    torch.manual_seed(3)
    keep, scale = _fast.keep_mask((300, 77), 0.1)
    torch.manual_seed(3)
    mult, scale2 = _fast.keep_multiplier((300, 77), 0.1, dtype)
    assert mult.dtype == dtype and mult.shape == (300, 77) and scale2 == scale
    assert torch.equal(mult.float(), keep.float())  # the same draw; values exactly 0.0 and 1.0
    ones, s = _fast.keep_multiplier((5, 4), 0.0, dtype)
    assert torch.equal(ones, torch.ones(5, 4, dtype=dtype)) and s == 1.0
    # the extremes of the 16-bit threshold (1 and 65535 dropped slots) do not overflow int16
    for p in (1 / 65536, 65535 / 65536):
        torch.manual_seed(0)
        m, _ = _fast.keep_multiplier((400_000,), p, dtype)
        assert set(m.float().unique().tolist()) <= {0.0, 1.0}
        assert abs(m.float().mean().item() - (1 - p)) < 5e-3


def test_bf16_dropout_rounds_kept_values_once():
    # kept values are x * 1/(1-p) rounded once from fp32 arithmetic (as torch.native_dropout),
    # not x times a bf16-rounded scale
    x = torch.randn(512, 64).bfloat16()
    torch.manual_seed(11)
    out = _fast.dropout(x, 0.1, training=True)
    torch.manual_seed(11)
    keep, scale = _fast.keep_mask(x.shape, 0.1)
    assert torch.equal(out, torch.where(keep, (x.float() * scale).bfloat16(), torch.zeros((), dtype=torch.bfloat16)))


def test_positional_conv_runs_in_fp32_in_cpu_training_under_autocast():
    from domainfm.models.cbramod.cbramod import PatchEmbedding

    torch.manual_seed(0)
    emb = PatchEmbedding(200, dropout=0.0)
    grid = torch.randn(2, 200, 19, 4).bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = emb._positional(grid)
        with torch.no_grad():  # inference keeps the autocast (bf16) convolution
            plain = emb._positional(grid)
    want = emb.positional_encoding(grid.detach().float()).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert plain.dtype == torch.bfloat16 and (plain.float() - want.float()).abs().max() < 0.1
    got.float().sum().backward()
    assert grid.grad is not None and grid.grad.dtype == torch.bfloat16 and emb.positional_encoding[0].weight.grad is not None


_CAPPED_ISA_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from _cbramod_weights import random_official_cbramod
from domainfm.models.cbramod import CBraMod, _fast, convert_official_state_dict
ref = random_official_cbramod(2, 64, 0).eval()
model = CBraMod(n_layers=2, dim_feedforward=64).eval()
model.load_state_dict(convert_official_state_dict(ref.state_dict(), model))
x = torch.randn(2, 19, 4, 200, generator=torch.Generator().manual_seed(2))
with torch.no_grad():
    want = model.forward_features(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.forward_features(x).float()
        theirs = ref.features(x).float()
print((got - want).abs().max().item(), (theirs - want).abs().max().item(), _fast.onednn_bf16_linear_works())
"""


def test_bf16_autocast_runs_where_onednn_has_no_bf16_linear():
    """oneDNN capped at AVX2 (as on CPUs without AVX-512-BF16) has no bf16 inner-product primitive:
    the fast linear falls back to plain torch, and the bf16 forward stays within the official
    model's own bf16 error of the fp32 one (the check is the real oneDNN call, so it holds on
    every CPU: on an AVX2-only machine the cap changes nothing)."""
    import os
    import subprocess

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CAPPED_ISA_SCRIPT, str(Path(__file__).resolve().parents[1])],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    err_ours, err_theirs, works = out.stdout.split()
    assert works == "False"
    assert float(err_theirs) > 1e-3  # autocast was in effect
    assert float(err_ours) <= 1.5 * float(err_theirs) + 0.02


def test_bf16_linear_falls_back_to_plain_torch_when_onednn_cannot(monkeypatch):
    lin = _linear()
    x = torch.randn(64, 40)
    monkeypatch.setattr(_fast, "onednn_bf16_linear_works", lambda: False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert _fast._onednn_operands(lin, x) is None
        assert _fast._onednn_operands(lin, x.bfloat16()) is None
        got = _fast.linear(lin, x, "gelu")
        want = F.gelu(lin(x))
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)  # same ops, same process
    with torch.no_grad():  # fp32 keeps the fused path
        assert _fast._onednn_operands(lin, x) is not None or not _fast._HAS_ONEDNN_LINEAR
