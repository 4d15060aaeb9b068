"""ExPLoRA speed paths (issue 15): DINOv2-style stochastic depth on the kept subset, the fused
q/v LoRA path, the CPU-bf16 attention form, and the ``init_values`` keyword of ``explora-test``.

Every fast path is checked against an independent computation of what it must equal."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from domainfm import create_model, lora
from domainfm.lora.layer import LoraLayer
from domainfm.models.explora.vit import SubsetDropPathBlock, drop_add_residual


def _row_branch(weight: torch.Tensor):
    """A per-sample nonlinear branch (each row's output depends on that row only)."""
    return lambda t: torch.tanh(t @ weight) * 0.5


def _kept_rows(batch: int, p: float, seed: int) -> torch.Tensor:
    keep = max(int(batch * (1 - p)), 1)
    return torch.randperm(batch, generator=torch.Generator().manual_seed(seed))[:keep]


# ------------------------------------------------------------------ stochastic depth on the kept subset


@pytest.mark.parametrize("batch,p", [(10, 0.3), (7, 0.5), (3, 0.9)])
def test_subset_drop_path_equals_row_by_row_reference(batch, p):
    torch.manual_seed(0)
    x = torch.randn(batch, 5, 8)
    w = torch.randn(8, 8)
    out = drop_add_residual(x, _row_branch(w), p, generator=torch.Generator().manual_seed(3))
    rows = _kept_rows(batch, p, 3)
    keep = max(int(batch * (1 - p)), 1)
    assert len(rows) == keep
    expected = x.clone()
    for i in rows.tolist():  # one sample at a time: branch(x_i) * B / k added, every other row untouched
        expected[i] = x[i] + torch.tanh(x[i] @ w) * 0.5 * (batch / keep)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    changed = (out != x).any(dim=(1, 2))
    assert changed.sum() == keep and changed[rows].all()


def test_subset_drop_path_gradients_only_through_kept_rows():
    torch.manual_seed(1)
    batch, p = 10, 0.3
    x = torch.randn(batch, 4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    drop_add_residual(x, _row_branch(w), p, generator=torch.Generator().manual_seed(5)).square().sum().backward()
    rows = _kept_rows(batch, p, 5)
    dropped = torch.ones(batch, dtype=torch.bool)
    dropped[rows] = False
    # dropped rows: identity, so d(sum y^2)/dx = 2x exactly
    torch.testing.assert_close(x.grad[dropped], 2 * x.detach()[dropped], rtol=0, atol=0)
    # reference: the same loss built from the kept rows only, with plain indexing
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    kept = x2[rows] + torch.tanh(x2[rows] @ w2) * 0.5 * (batch / len(rows))
    (kept.square().sum() + x2[dropped].square().sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_subset_drop_path_expectation_is_the_full_branch():
    """Mean over many draws -> x + branch(x). Seeded, so deterministic; the tolerance is still ~9
    standard deviations of the empirical keep frequency, so a different RNG stream cannot flake it."""
    batch, p, draws = 10, 0.3, 20000
    x = torch.arange(1.0, batch + 1).reshape(batch, 1)
    g = torch.Generator().manual_seed(0)
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += drop_add_residual(x, lambda t: 2 * t, p, generator=g)
    mean_coeff = (total / draws - x) / (2 * x)  # 1.0 in expectation for every row
    # per row: (B/k) * Binomial(n, k/B)/n, sd = (B/k) sqrt((k/B)(1-k/B)/n) = 0.0047 for k=7, B=10
    assert (mean_coeff - 1).abs().max() < 0.04, mean_coeff.flatten()


def _block_pair(drop: float, init_values: float = 1.0):
    torch.manual_seed(0)
    fast = create_model("explora-test", n_outputs=0, drop_path_rate=drop, init_values=init_values)
    plain = create_model("explora-test", n_outputs=0, drop_path_rate=drop, init_values=init_values,
                         efficient_drop_path=False)
    plain.load_state_dict(fast.state_dict())
    return fast, plain


def test_block_in_training_equals_reference_on_drawn_subsets():
    fast, _ = _block_pair(0.6)
    block = fast.blocks[2]  # timm's linear rule: rate 0.6 at the last of 3 blocks
    assert isinstance(block, SubsetDropPathBlock) and block.drop_path1.drop_prob == pytest.approx(0.6)
    block.train()
    block.generator = torch.Generator().manual_seed(11)
    x = torch.randn(10, 9, 48)
    out = block(x)
    # reference with the block's own sub-layers, rows drawn as documented (attention first, then MLP)
    g = torch.Generator().manual_seed(11)
    keep = max(int(10 * (1 - block.drop_path1.drop_prob)), 1)  # 3: timm's rate is 0.6000000238 (float32)
    r1 = torch.randperm(10, generator=g)[:keep]
    r2 = torch.randperm(10, generator=g)[:keep]
    block.eval()  # sub-layers without randomness; fp32 takes the same attention kernel
    with torch.no_grad():
        h = x.clone()
        h[r1] = x[r1] + block.ls1(block.attn(block.norm1(x[r1]))) * (10 / keep)
        ref = h.clone()
        ref[r2] = h[r2] + block.ls2(block.mlp(block.norm2(h[r2]))) * (10 / keep)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-5, atol=1e-5)


def test_eval_and_zero_drop_path_outputs_are_timm_blocks_exactly():
    fast, plain = _block_pair(0.3)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fast.eval()(x), plain.eval()(x))
    fast0, plain0 = _block_pair(0.0)
    with torch.no_grad():
        assert torch.equal(fast0.train()(x), plain0.train()(x))


def test_low_rates_keep_timm_per_sample_drop_path():
    """At rates <= 0.1 (every block of a 0.1 run) the block is timm's: same RNG use, same output."""
    fast, plain = _block_pair(0.1)
    x = torch.randn(6, 3, 32, 32)
    torch.manual_seed(4)
    a = fast.train()(x)
    torch.manual_seed(4)
    b = plain.train()(x)
    assert torch.equal(a, b)


def test_training_step_with_subset_drop_path_trains_only_adapters_and_reaches_every_block():
    fast, _ = _block_pair(0.5)
    lora.apply(fast, preset="explora")
    fast.train()
    x = torch.randn(8, 3, 32, 32)
    fast(x).square().mean().backward()
    for name, p in fast.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None, name
    # the zero-initialised B of every adapted block receives a gradient (the A's cannot yet: B = 0)
    for name, w in lora._wrappers(fast).items():
        for chunk in ("q", "v"):
            assert getattr(w, chunk).lora_B.weight.grad.abs().sum() > 0, (name, chunk)


def test_teacher_style_zeroed_drop_prob_switches_the_subset_path_off():
    fast, plain = _block_pair(0.5)
    for m in fast.modules():  # what the DINO teacher does to its copy
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(fast.train()(x), plain.eval()(x))


# ------------------------------------------------------------------ fused q/v LoRA


def _adapted_linear(variant: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 72))
    lora.apply(model, ["0@q,v"], rank=4, alpha=8.0, variant=variant)
    with torch.no_grad():  # non-zero up factors, so the update is visible
        for name, p in model.named_parameters():
            if "lora_B" in name or "mlp_B" in name:
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("variant", ["lora", "replora"])
@pytest.mark.parametrize("shape", [(7, 24), (2, 5, 24)])
def test_fused_qv_path_equals_per_chunk_loop_values_and_gradients(variant, shape):
    fused = _adapted_linear(variant)
    loop = copy.deepcopy(fused)
    loop[0].fuse_chunks = False
    assert fused[0]._fuses_chunks() and not loop[0]._fuses_chunks()
    x = torch.randn(shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fused(xa), loop(xb)
    # the adapter really acts on q and v and leaves k alone
    base = fused[0].base_layer(x)
    assert (ya - base)[..., :24].abs().max() > 0.1 and (ya - base)[..., 48:].abs().max() > 0.1
    assert torch.equal(ya[..., 24:48], base[..., 24:48])
    torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    scale = float(xb.grad.abs().max())  # gradients: same sums in another order, so relative to their size
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6 * scale)
    grads_a = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    grads_b = {n: p.grad for n, p in loop.named_parameters() if p.requires_grad}
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        scale = float(grads_b[n].abs().max())
        torch.testing.assert_close(grads_a[n], grads_b[n], rtol=1e-5, atol=1e-6 * scale, msg=n)


def test_fused_path_keeps_merge_state_dict_and_peft_export():
    fused = _adapted_linear("lora")
    loop = copy.deepcopy(fused)
    loop[0].fuse_chunks = False
    x = torch.randn(6, 24)
    with torch.no_grad():
        unmerged = fused(x)
        assert fused.state_dict().keys() == loop.state_dict().keys()
        export_a, export_b = lora.adapter_state_dict(fused), lora.adapter_state_dict(loop)
        assert export_a.keys() == export_b.keys() and all(torch.equal(export_a[k], export_b[k]) for k in export_a)
        lora.merge(fused)
        torch.testing.assert_close(fused(x), unmerged, rtol=1e-5, atol=1e-5)
        lora.unmerge(fused)
        assert torch.equal(fused(x), unmerged)


def test_dora_and_single_chunk_keep_the_loop():
    assert not _adapted_linear("dora")[0]._fuses_chunks()
    torch.manual_seed(0)
    single = nn.Sequential(nn.Linear(24, 72))
    lora.apply(single, ["0@v"], rank=4)
    assert not single[0]._fuses_chunks()


def test_fused_path_on_the_explora_vit_matches_the_loop_and_bf16_stays_close():
    torch.manual_seed(0)
    model = create_model("explora-test", n_outputs=0, init_values=1.0)
    lora.apply(model, preset="explora")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    loop = copy.deepcopy(model)
    for m in loop.modules():
        if isinstance(m, LoraLayer):
            m.fuse_chunks = False
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ya, yb = model.eval()(x), loop.eval()(x)
        torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y16 = model(x)
    rel = (y16.float() - ya).norm() / ya.norm()
    assert 0 < rel < 0.03, rel


# ------------------------------------------------------------------ attention form and init_values


def test_cpu_bf16_takes_plain_attention_and_fp32_keeps_sdpa():
    torch.manual_seed(0)
    model = create_model("explora-test", n_outputs=0, init_values=1.0).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        y32 = model(x)
        assert all(b.attn.fused_attn for b in model.blocks)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y16 = model(x)
        assert not any(b.attn.fused_attn for b in model.blocks)
        assert torch.equal(model(x), y32)  # back to fp32: SDPA again, the same numbers
    rel = (y16.float() - y32).norm() / y32.norm()
    assert 0 < rel < 0.03, rel


def test_explora_test_init_values_keyword():
    default = create_model("explora-test", n_outputs=0)
    assert all(torch.equal(b.ls1.gamma, torch.full_like(b.ls1.gamma, 1e-5)) for b in default.blocks)  # unchanged
    one = create_model("explora-test", n_outputs=0, init_values=1.0)
    assert all(torch.all(b.ls1.gamma == 1.0) and torch.all(b.ls2.gamma == 1.0) for b in one.blocks)
    none = create_model("explora-test", n_outputs=0, init_values=None)
    assert not any("gamma" in k for k in none.state_dict())
    with pytest.raises(ValueError, match="init_values"):
        create_model("explora-test", init_values=-1.0)
    # the point of the keyword: a block's residual branches are 1e5 times larger than at 1e-5
    one.load_state_dict({k: v for k, v in default.state_dict().items() if "gamma" not in k}, strict=False)
    x = torch.randn(1, 9, 48)
    with torch.no_grad():
        big, small = (one.blocks[0].eval()(x) - x).abs().mean(), (default.blocks[0].eval()(x) - x).abs().mean()
    assert big > 1e-3 and big / small > 1e4, (big, small)
