"""WBM (wearables): the chunked SSD scan against the step-by-step recurrence, the Mamba-2 block,
TST tokenisation and the two backbones."""
from __future__ import annotations

import pytest
import torch

import domainfm
from domainfm.models.wearables.mamba2 import Mamba2, ssd_scan, ssd_sequential


def _recurrence(X, A, B, C, h0=None):
    """h_t = exp(A_t) h_{t-1} + B_t x_t^T, y_t = C_t h_t, written out per batch, head and step
    (state as (n, p) here, independent of the implementation's (p, n) layout)."""
    b, l, nh, p = X.shape
    n = B.shape[-1]
    Y = torch.zeros_like(X)
    finals = torch.zeros(b, nh, p, n, dtype=X.dtype)
    for i in range(b):
        for k in range(nh):
            h = torch.zeros(n, p, dtype=X.dtype) if h0 is None else h0[i, k].T.clone()
            for t in range(l):
                h = torch.exp(A[i, t, k]) * h + torch.outer(B[i, t, k], X[i, t, k])
                Y[i, t, k] = C[i, t, k] @ h
            finals[i, k] = h.T
    return Y, finals


def _inputs(b, l, h, p, n, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(b, l, h, p, generator=g, dtype=torch.float64)
    A = -torch.rand(b, l, h, generator=g, dtype=torch.float64) * 0.7
    B = torch.randn(b, l, h, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, l, h, n, generator=g, dtype=torch.float64)
    h0 = torch.randn(b, h, p, n, generator=g, dtype=torch.float64)
    return [t.requires_grad_(requires_grad) for t in (X, A, B, C, h0)]


@pytest.mark.parametrize("length,chunk", [(37, 8), (37, 16), (50, 7), (5, 16), (64, 16), (1, 4)])
@pytest.mark.parametrize("with_init", [False, True])
def test_ssd_scan_equals_sequential_recurrence(length, chunk, with_init):
    X, A, B, C, h0 = _inputs(2, length, 3, 4, 5, seed=length * 31 + chunk)
    init = h0 if with_init else None
    Y, final = ssd_scan(X, A, B, C, chunk, initial_states=init)
    Y_ref, final_ref = _recurrence(X, A, B, C, init)
    assert Y.shape == (2, length, 3, 4) and final.shape == (2, 3, 4, 5)
    torch.testing.assert_close(Y, Y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk", [4, 9])
def test_ssd_scan_gradients_equal_the_recurrence(chunk):
    inputs = _inputs(2, 23, 2, 3, 4, seed=chunk, requires_grad=True)
    g = torch.Generator().manual_seed(99)
    wY = torch.randn(2, 23, 2, 3, generator=g, dtype=torch.float64)
    wS = torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64)

    def grads(fn):
        Y, S = fn(*inputs)
        return torch.autograd.grad((Y * wY).sum() + (S * wS).sum(), inputs)

    got = grads(lambda X, A, B, C, h0: ssd_scan(X, A, B, C, chunk, initial_states=h0))
    want = grads(lambda X, A, B, C, h0: _recurrence(X, A, B, C, h0))
    for name, a, b in zip("XABC", got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"gradient of {name}")
    torch.testing.assert_close(got[4], want[4], rtol=0, atol=1e-10, msg="gradient of initial_states")


def test_ssd_scan_chunks_continue_through_final_states_and_sequential_path_agrees():
    X, A, B, C, h0 = _inputs(1, 40, 2, 3, 4, seed=5)
    Y, S = ssd_scan(X, A, B, C, 8, initial_states=h0)
    Y1, S1 = ssd_scan(X[:, :17], A[:, :17], B[:, :17], C[:, :17], 8, initial_states=h0)
    Y2, S2 = ssd_scan(X[:, 17:], A[:, 17:], B[:, 17:], C[:, 17:], 5, initial_states=S1)
    torch.testing.assert_close(torch.cat([Y1, Y2], 1), Y, rtol=0, atol=1e-10)
    torch.testing.assert_close(S2, S, rtol=0, atol=1e-10)
    Ys, Ss = ssd_sequential(X, A, B, C, h0)
    torch.testing.assert_close(Ys, Y, rtol=0, atol=1e-10)
    torch.testing.assert_close(Ss, S, rtol=0, atol=1e-10)


def test_ssd_scan_with_groups_of_heads_sharing_B_and_C():
    X, A, B, C, h0 = _inputs(2, 29, 4, 3, 5, seed=11)
    Bg, Cg = B[:, :, :2], C[:, :, :2]  # 2 groups of 2 heads
    Y, S = ssd_scan(X, A, Bg, Cg, 8, initial_states=h0)
    Y_ref, S_ref = _recurrence(X, A, Bg.repeat_interleave(2, 2), Cg.repeat_interleave(2, 2), h0)
    torch.testing.assert_close(Y, Y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-10)


def test_ssd_scan_rejects_bad_shapes():
    X, A, B, C, _ = _inputs(1, 6, 2, 3, 4, seed=0)
    with pytest.raises(ValueError, match="shapes disagree"):
        ssd_scan(X, A[:, :5], B, C, 4)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_scan(X, A, B, C, 4, initial_states=torch.zeros(1, 2, 4, 3, dtype=X.dtype))


def _mamba2_reference(block: Mamba2, u):
    """The Mamba-2 mixer restated step by step from its definition (plain loops, no chunking)."""
    b, l, _ = u.shape
    zxbcdt = u @ block.in_proj.weight.T
    di, n, nh, p = block.d_inner, block.d_state, block.nheads, block.headdim
    z, xBC, dt = zxbcdt[..., :di], zxbcdt[..., di:2 * di + 2 * n], zxbcdt[..., 2 * di + 2 * n:]
    w = block.conv1d.weight[:, 0]  # (channels, k)
    k = w.shape[1]
    padded = torch.cat([xBC.new_zeros(b, k - 1, xBC.shape[-1]), xBC], 1)
    conv = torch.stack([(padded[:, t:t + k] * w.T).sum(1) for t in range(l)], 1) + block.conv1d.bias
    xBC = conv * torch.sigmoid(conv)
    x, B, C = xBC[..., :di].reshape(b, l, nh, p), xBC[..., di:di + n], xBC[..., di + n:]
    dt = torch.nn.functional.softplus(dt + block.dt_bias)
    A = -torch.exp(block.A_log)
    h = u.new_zeros(b, nh, p, n)
    ys = []
    for t in range(l):
        h = torch.exp(A * dt[:, t])[:, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", h, C[:, t]) + block.D[:, None] * x[:, t])
    y = torch.stack(ys, 1).reshape(b, l, di) * torch.nn.functional.silu(z)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + block.norm.eps) * block.norm.weight
    return y @ block.out_proj.weight.T


def test_mamba2_block_equals_its_step_by_step_definition_and_is_causal():
    torch.manual_seed(0)
    block = Mamba2(8, d_state=4, headdim=4, chunk_size=5).double()
    u = torch.randn(2, 13, 8, dtype=torch.float64)
    out = block(u)
    torch.testing.assert_close(out, _mamba2_reference(block, u), rtol=0, atol=1e-10)
    u2 = u.clone()
    u2[:, 9:] += 1.0
    torch.testing.assert_close(block(u2)[:, :9], out[:, :9], rtol=0, atol=1e-12)
    assert not torch.allclose(block(u2)[:, 9:], out[:, 9:])


# --------------------------------------------------------------------------- the WBM model


def _week(n=2, t=48, v=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, t, v, generator=g)
    observed = torch.rand(n, t, v, generator=g) > 0.3
    return values, observed


@pytest.mark.parametrize("name", ["wbm-test", "wbm-transformer-test"])
def test_unobserved_values_do_not_matter_and_nan_means_missing(name):
    torch.manual_seed(0)
    model = domainfm.create_model(name, n_outputs=None).eval()
    values, observed = _week()
    with torch.no_grad():
        ref = model.forward_features(values, observed)
        noisy = torch.where(observed, values, torch.full_like(values, 1e3))
        torch.testing.assert_close(model.forward_features(noisy, observed), ref)
        with_nan = torch.where(observed, values, torch.full_like(values, float("nan")))
        torch.testing.assert_close(model.forward_features(with_nan), ref)  # observed defaults to ~isnan
        assert ref.shape == (2, 32)
        # the embedding is the mean of the hour tokens over hours with any observed value
        observed[0, :20] = False
        tokens = model.forward_tokens(values, observed)
        feats = model.forward_features(values, observed)
        torch.testing.assert_close(feats[0], tokens[0, 20:].mean(0))
        torch.testing.assert_close(feats[1], tokens[1][observed[1].any(-1)].mean(0))
        assert model.forward_projection(values, observed).shape == (2, 16)


def test_tst_token_is_linear_in_masked_values_and_mask():
    model = domainfm.create_model("wbm-test")
    tok = model.tokenizer
    values, observed = _week(1, 3, 8)
    got = tok(values, observed)
    W, b = tok.proj.weight, tok.proj.bias
    want = (values * observed) @ W[:, :8].T + observed.float() @ W[:, 8:].T + b
    torch.testing.assert_close(got, want)


def test_mamba_backbone_is_causal_and_chunk_size_does_not_change_it():
    torch.manual_seed(0)
    a = domainfm.create_model("wbm-test", n_outputs=None).double().eval()
    torch.manual_seed(0)
    b = domainfm.create_model("wbm-test", n_outputs=None, chunk_size=7).double().eval()
    b.load_state_dict(a.state_dict())
    values, observed = _week(2, 61)
    values = values.double()
    with torch.no_grad():
        ta, tb = a.forward_tokens(values, observed), b.forward_tokens(values, observed)
        torch.testing.assert_close(ta, tb, rtol=0, atol=1e-10)
        changed = values.clone()
        changed[:, 40:] += 3.0
        t2 = a.forward_tokens(changed, observed)
    torch.testing.assert_close(t2[:, :40], ta[:, :40], rtol=0, atol=1e-12)
    assert (t2[:, 40:] - ta[:, 40:]).abs().max() > 1e-3


def test_rope_scores_depend_on_relative_position_only():
    from domainfm.models.wearables import RotaryEmbedding

    rope = RotaryEmbedding(8).double()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    seq_q = q.expand(1, 1, 20, 8).contiguous()
    seq_k = k.expand(1, 1, 20, 8).contiguous()
    scores = rope(seq_q)[0, 0] @ rope(seq_k)[0, 0].T  # (20, 20)
    torch.testing.assert_close(scores[5, 2], scores[15, 12])
    torch.testing.assert_close(scores[3, 9], scores[10, 16])
    assert not torch.isclose(scores[5, 2], scores[5, 3])


def test_zscore_statistics_are_saved_with_the_weights(tmp_path):
    model = domainfm.create_model("wbm-test", variables=[f"v{i}" for i in range(8)])
    model.set_zscore(torch.arange(8.0), torch.arange(1.0, 9.0))
    domainfm.save_pretrained(model, tmp_path / "m")
    again = domainfm.create_model(tmp_path / "m")
    assert again.zscore() == {"variables": [f"v{i}" for i in range(8)], "mean": list(map(float, range(8))),
                              "std": list(map(float, range(1, 9)))}
    # raw=True z-scores with the buffers; kwargs seed them, loaded weights overwrite them
    values, observed = _week(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(again(values * torch.arange(1.0, 9.0) + torch.arange(8.0), observed, raw=True),
                                   again(values, observed))
    seeded = domainfm.create_model("wbm-test", zscore_mean=[1.0] * 8, zscore_std=[2.0] * 8)
    assert seeded.zscore()["std"] == [2.0] * 8
    assert domainfm.create_model(tmp_path / "m", zscore_std=[2.0] * 8).zscore()["std"] == list(map(float, range(1, 9)))
    with pytest.raises(ValueError, match="SDs positive"):
        model.set_zscore(torch.zeros(8), torch.zeros(8))


def test_signal_spec_is_checked():
    with pytest.raises(ValueError, match="hourly"):
        domainfm.create_model("wbm-test", sfreq=1.0)
    with pytest.raises(ValueError, match="n_chans=8 but 3"):
        domainfm.create_model("wbm-test", variables=["a", "b", "c"])
    model = domainfm.create_model("wbm-test")
    with pytest.raises(ValueError, match="n_chans=8"):
        model(torch.zeros(1, 10, 5))
    base = domainfm.model_info("wbm-base")
    assert base["input_spec"]["n_chans"] == 22 and base["input_spec"]["n_times"] == 168
    assert base["defaults"]["d_model"] == 256 and base["defaults"]["proj_dim"] == 128 and base["defaults"]["n_layers"] == 4


def test_any_length_runs_and_lora_wraps_the_projections():
    from domainfm import lora

    model = domainfm.create_model("wbm-test")
    values, observed = _week(1, 173)
    assert model(values, observed).shape == (1, 2)
    lora.apply(model, targets=["*in_proj", "*out_proj"], rank=2, alpha=4)
    out = model(values, observed)
    out.sum().backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable), trainable
