"""Mamba-2: the chunked state-space-duality (SSD) scan in plain torch, and the Mamba-2 block.

Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured
State Space Duality", ICML 2024 (https://arxiv.org/abs/2405.21060). The selective SSM with a
scalar decay per head is

.. math::
    h_t = e^{A_t}\\, h_{t-1} + B_t\\, x_t^\\top, \\qquad y_t = C_t^\\top h_t

with ``x_t`` in R^p (one head), ``B_t, C_t`` in R^n and ``A_t <= 0`` the log-decay already
multiplied by the step size. :func:`ssd_scan` evaluates it in chunks of ``chunk_size`` steps:
inside a chunk as a masked (decay-weighted) attention-like matrix product, across chunks as a
recurrence on the ``(p, n)`` states, so the cost is linear in the length and every step is a
batched matmul (fast on CPU and GPU alike). :class:`Mamba2` is the block around it
(in-projection, short causal depthwise convolution, SiLU, the scan with a skip ``D``, gated
RMSNorm, out-projection). When ``mamba_ssm`` is importable and the input lives on a GPU, the
block calls its fused Triton scan instead (same maths, same parameters).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ssd_scan", "ssd_sequential", "segsum", "Mamba2", "RMSNormGated", "fused_scan_available"]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``i >= j``, ``-inf`` above the diagonal.

    Built by a masked cumulative sum rather than as ``cumsum[i] - cumsum[j]``: the difference of
    two long cumulative sums cancels catastrophically in float32, the masked sum does not.

    **Shapes:** ``(..., T)`` -> ``(..., T, T)``.
    """
    t = a.shape[-1]
    x = a.unsqueeze(-1).expand(*a.shape, t)  # x[..., k, j] = a[k]
    strict = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~lower, -math.inf)


def ssd_scan(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
             initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan, chunked, in plain torch; any length (padded internally to whole chunks).

    Args:
        X: inputs ``(b, l, h, p)`` (already multiplied by the step size in Mamba-2).
        A: log-decays ``(b, l, h)``, already multiplied by the step size (``<= 0`` for a stable SSM).
        B: input projections ``(b, l, h, n)``, or ``(b, l, g, n)`` shared by groups of ``h / g``
            consecutive heads (mamba_ssm's ``ngroups``; ``g = 1`` in Mamba-2's default).
        C: output projections, shaped as ``B``.
        chunk_size: steps per chunk; the intra-chunk part costs ``O(chunk_size)`` per step.
        initial_states: state before the first step ``(b, h, p, n)``; zeros when ``None``.

    Returns:
        ``(Y, final_state)``: outputs ``(b, l, h, p)`` and the state after the last step
        ``(b, h, p, n)`` (mamba_ssm's layout: ``h_t`` transposed).

    Padding appends steps with ``A = 0`` (no decay) and ``X = B = C = 0`` (no input), which leaves
    the state unchanged, so the final state is the state after step ``l``. Every contraction is a
    two-operand einsum (a batched matmul): a three-operand one can materialise a
    ``(b, l, h, p, n)`` product.
    """
    if X.dim() != 4 or A.dim() != 3 or B.dim() != 4 or C.dim() != 4:
        raise ValueError(f"ssd_scan: expected X (b,l,h,p), A (b,l,h), B/C (b,l,h,n); got {tuple(X.shape)}, "
                         f"{tuple(A.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    b, length, h, p = X.shape
    g, n = B.shape[2], B.shape[3]
    if A.shape != (b, length, h) or B.shape[:2] != (b, length) or C.shape != B.shape or h % g:
        raise ValueError(f"ssd_scan: shapes disagree: X {tuple(X.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)} (B and C need (b, l, h or a divisor of h, n))")
    if chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size={chunk_size} must be >= 1")
    if initial_states is not None and initial_states.shape != (b, h, p, n):
        raise ValueError(f"ssd_scan: initial_states must be (b, h, p, n) = {(b, h, p, n)}, got "
                         f"{tuple(initial_states.shape)}")
    T = min(chunk_size, max(length, 1))
    pad = (-length) % T
    if pad:
        X = F.pad(X, (0, 0, 0, 0, 0, pad))
        A = F.pad(A, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    c = (length + pad) // T
    X = X.reshape(b, c, T, h, p)
    B = B.reshape(b, c, T, g, n)
    C = C.reshape(b, c, T, g, n)
    A = A.reshape(b, c, T, h).permute(0, 3, 1, 2)  # (b, h, c, T)
    A_cum = torch.cumsum(A, dim=-1)
    per_group = h // g

    def heads(t: torch.Tensor) -> torch.Tensor:  # (b, c, T, g, n) -> (b, c, T, h, n)
        return t if g == h else t.repeat_interleave(per_group, dim=3)

    # 1. within chunks: y_i = sum_{j<=i} (C_i . B_j) exp(A_{j+1} + ... + A_i) x_j
    # exp(A_cum_i - A_cum_j) below the diagonal, as mamba_ssm's kernels compute it: within one
    # chunk the difference is <= 0 and short, so it is accurate, and it costs one subtraction
    # instead of segsum's (T, T) cumulative sum (kept for the few chunk totals below)
    lower = torch.tril(torch.ones(T, T, dtype=torch.bool, device=X.device))
    L = torch.exp((A_cum.unsqueeze(-1) - A_cum.unsqueeze(-2)).masked_fill(~lower, -math.inf))  # (b, h, c, T, T)
    CB = torch.einsum("bcign,bcjgn->bgcij", C, B)  # once per group, not per head
    if g != h:
        CB = CB.repeat_interleave(per_group, dim=1)
    Y_diag = torch.einsum("bhcij,bcjhp->bcihp", CB * L, X)

    # 2. the state each chunk leaves behind, from its own inputs only
    decay_to_end = torch.exp(A_cum[..., -1:] - A_cum).permute(0, 2, 3, 1)  # (b, c, T, h)
    states = torch.einsum("bcjhn,bcjhp->bchpn", heads(B) * decay_to_end.unsqueeze(-1), X)

    # 3. across chunks: S_{k+1} = exp(sum of chunk k's A) S_k + states_k, from S_0 = initial
    if initial_states is None:
        initial_states = torch.zeros(b, h, p, n, dtype=X.dtype, device=X.device)
    states = torch.cat([initial_states.unsqueeze(1).to(states.dtype), states], dim=1)  # (b, c+1, h, p, n)
    chunk_decay = torch.exp(segsum(F.pad(A_cum[..., -1], (1, 0))))  # (b, h, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    entering, final_state = states[:, :-1], states[:, -1]

    # 4. the entering state's contribution to each step: C_i . exp(A_1 + ... + A_i) S_k
    decay_from_start = torch.exp(A_cum).permute(0, 2, 3, 1)  # (b, c, T, h)
    Y_off = torch.einsum("bcihn,bchpn->bcihp", heads(C) * decay_from_start.unsqueeze(-1), entering)

    Y = (Y_diag + Y_off).reshape(b, c * T, h, p)[:, :length]
    return Y, final_state


def ssd_sequential(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same SSM as :func:`ssd_scan`, one step at a time (the reference, and the recurrent
    inference path). Same shapes and state layout ``(b, h, p, n)``."""
    b, length, h, p = X.shape
    n = B.shape[-1]
    if B.shape[2] != h:  # groups of heads share B and C
        B, C = B.repeat_interleave(h // B.shape[2], dim=2), C.repeat_interleave(h // C.shape[2], dim=2)
    state = (torch.zeros(b, h, p, n, dtype=X.dtype, device=X.device) if initial_states is None
             else initial_states.to(X.dtype))
    ys = []
    for t in range(length):
        state = torch.exp(A[:, t])[..., None, None] * state + X[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    Y = torch.stack(ys, dim=1) if ys else X.new_zeros(b, 0, h, p)
    return Y, state


def fused_scan_available() -> bool:
    """Whether mamba_ssm's fused Triton scan can be imported (it needs a GPU to run)."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: F401
    except Exception:  # ImportError, or a broken triton/CUDA install
        return False
    return True


class RMSNormGated(nn.Module):
    """``RMSNorm(y * SiLU(z)) * weight`` (Mamba-2's gate before the out-projection; norm after the gate).

    With ``group_size`` the mean square is taken per group of that many channels (mamba_ssm's
    ``ngroups`` groups); the default is over all channels.
    """

    def __init__(self, dim: int, eps: float = 1e-5, group_size: int | None = None):
        super().__init__()
        self.eps, self.group_size = eps, group_size or dim
        if dim % self.group_size:
            raise ValueError(f"RMSNormGated: dim={dim} is not a multiple of group_size={self.group_size}")
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = y.dtype
        work = torch.promote_types(dtype, torch.float32)  # half precision is normalised in float32
        y = y.to(work)
        if z is not None:
            y = y * F.silu(z.to(work))
        shape = y.shape
        y = y.reshape(*shape[:-1], -1, self.group_size)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y.reshape(shape) * self.weight.to(work)).to(dtype)


class Mamba2(nn.Module):
    """One Mamba-2 mixer (the block's sequence-mixing part; the residual and pre-norm live outside).

    ``in_proj`` maps ``d_model`` to ``[z, x, B, C, dt]`` with ``d_inner = expand * d_model``,
    ``nheads = d_inner / headdim`` and one group of ``B, C`` (``ngroups=1``, shared by all heads);
    ``x, B, C`` pass a causal depthwise convolution (kernel ``d_conv``) and SiLU; ``dt =
    softplus(dt + dt_bias)``; the scan runs on ``X = x * dt`` and ``A = -exp(A_log) * dt`` with
    a per-head skip ``D * x``; ``y`` is gated by ``z`` in :class:`RMSNormGated` and projected out.
    Initialisation follows the reference (``mamba_ssm`` ``Mamba2Simple``): ``A`` uniform in
    ``[1, 16]``, ``dt`` log-uniform in ``[1e-3, 0.1]`` (floor ``1e-4``), ``D = 1``.

    Args:
        d_model: width of the residual stream.
        d_state: SSM state size ``n`` (64).
        d_conv: causal convolution kernel (4).
        expand: ``d_inner / d_model`` (2).
        headdim: channels per head ``p`` (64).
        chunk_size: scan chunk (64: a week of hours is 3 chunks).
        use_fused: ``"auto"`` (mamba_ssm's kernel on CUDA when importable), ``True`` or ``False``.

    **Shapes:** ``(B, L, d_model)`` -> ``(B, L, d_model)``.
    """

    def __init__(self, d_model: int, *, d_state: int = 64, d_conv: int = 4, expand: int = 2, headdim: int = 64,
                 chunk_size: int = 64, dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 A_init_range: tuple[float, float] = (1.0, 16.0), bias: bool = False, conv_bias: bool = True,
                 use_fused: bool | str = "auto"):
        super().__init__()
        d_inner = expand * d_model
        if d_inner % headdim:
            raise ValueError(f"Mamba2: expand * d_model = {d_inner} is not a multiple of headdim={headdim}")
        if use_fused not in ("auto", True, False):
            raise ValueError(f"Mamba2: use_fused={use_fused!r}: expected 'auto', true or false")
        self.d_model, self.d_state, self.d_conv, self.d_inner = d_model, d_state, d_conv, d_inner
        self.headdim, self.nheads, self.chunk_size, self.use_fused = headdim, d_inner // headdim, chunk_size, use_fused
        conv_dim = d_inner + 2 * d_state
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * d_state + self.nheads, bias=bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias)
        dt = torch.exp(torch.rand(self.nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(*A_init_range)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = RMSNormGated(d_inner)
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias)

    def _fused(self, x: torch.Tensor) -> bool:
        if self.use_fused is False or not x.is_cuda:
            return False
        available = fused_scan_available()
        if self.use_fused is True and not available:
            raise RuntimeError("Mamba2(use_fused=True): mamba_ssm's Triton scan is not importable")
        return available

    def forward(self, u: torch.Tensor, initial_states: torch.Tensor | None = None,
                return_final_states: bool = False):
        batch, length, _ = u.shape
        zxbcdt = self.in_proj(u)
        z, xBC, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * self.d_state, self.nheads], dim=-1)
        xBC = F.silu(self.conv1d(xBC.transpose(1, 2))[..., :length].transpose(1, 2))
        x, B, C = torch.split(xBC, [self.d_inner, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # (b, l, h)
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))  # (h,)
        x = x.reshape(batch, length, self.nheads, self.headdim)
        if self._fused(u):
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            out = mamba_chunk_scan_combined(x, dt, A, B.unsqueeze(2), C.unsqueeze(2), chunk_size=self.chunk_size,
                                            D=self.D, initial_states=initial_states,
                                            return_final_states=return_final_states)
            y, final = out if return_final_states else (out, None)
        else:
            y, final = ssd_scan(x * dt.unsqueeze(-1).to(x.dtype), (A * dt).to(x.dtype), B.unsqueeze(2),
                                C.unsqueeze(2), self.chunk_size, initial_states=initial_states)
            y = y + x * self.D.to(x.dtype)[:, None]
        y = self.norm(y.reshape(batch, length, self.d_inner), z)
        out = self.out_proj(y)
        return (out, final) if return_final_states else out
