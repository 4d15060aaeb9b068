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
