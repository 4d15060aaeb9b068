"""A plain restatement of the official OpenMHC WBM forward, in the release's key layout.

Written from the facts listed in :mod:`.openmhc` (OpenMHC's week encoder over mamba_ssm 2.2.4's
``Mamba2``), as functions of a state_dict with the release's names (``tokenizer.fc1.*``,
``backbone.{i}.fwd.in_proj.weight``, ``proj_head.{j}.*``; a Lightning ``model.``/``encoder.``
prefix is accepted), independent of :mod:`.wbm` and :mod:`.mamba2`: the Mamba-2 scan is the
selective-SSM recurrence taken one hour at a time, the causal convolution a sum over its taps.
It is the reference the tests check ``wbm-openmhc`` against (to 1e-5); it is slow and for tests
only.

Per Mamba-2 mixer (``ngroups`` 1, ``D`` per head, gated RMSNorm after the gate, eps 1e-5)::

    z, xBC, dt = split(u W_in^T, [d_inner, d_inner + 2 N, H])
    xBC_t = SiLU(b + sum_k w_k * xBC_{t - (K-1) + k})          (zero before the first hour)
    x, B, C = split(xBC, [d_inner, N, N]);  dt = softplus(dt + dt_bias);  A = -exp(A_log)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T;  y_t = h_t C_t + D x_t       (per head)
    out = RMSNorm(y * SiLU(z)) * w_norm  W_out^T

**Shapes:** input ``(B, T, 38)`` (z-scores, 0 where missing, then missing flags) ->
:func:`reference_forward` ``(h (B, proj_dim) unit-norm, r (B, d_model))``.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

__all__ = ["release_state_dict", "mamba2_mixer", "bimamba2_block", "reference_forward"]


def release_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's keys without the Lightning module's ``model.`` / ``encoder.`` prefix."""
    if "state_dict" in state_dict and isinstance(state_dict["state_dict"], Mapping):
        state_dict = state_dict["state_dict"]
    out = {}
    for key, value in state_dict.items():
        for prefix in ("model.", "encoder."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        out[key] = value
    return out


def _linear(x: torch.Tensor, p: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ p[f"{name}.weight"].to(x.dtype).T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias.to(x.dtype)


def mamba2_mixer(u: torch.Tensor, p: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """One mamba_ssm ``Mamba2`` forward ``(B, T, d_model) -> (B, T, d_model)``, step by step."""
    dtype = u.dtype
    conv_w = p[f"{name}.conv1d.weight"].to(dtype)  # (conv_dim, 1, K)
    conv_b = p[f"{name}.conv1d.bias"].to(dtype)
    dt_bias, A_log, D = (p[f"{name}.{k}"].to(dtype) for k in ("dt_bias", "A_log", "D"))
    norm_w = p[f"{name}.norm.weight"].to(dtype)
    n_heads, d_inner = dt_bias.numel(), norm_w.numel()
    headdim, d_state, width = d_inner // n_heads, (conv_w.shape[0] - d_inner) // 2, conv_w.shape[-1]
    batch, length, _ = u.shape

    zxbcdt = u @ p[f"{name}.in_proj.weight"].to(dtype).T
    z = zxbcdt[..., :d_inner]
    xBC = zxbcdt[..., d_inner:2 * d_inner + 2 * d_state]
    dt = zxbcdt[..., 2 * d_inner + 2 * d_state:]

    conv = conv_b.expand(batch, length, -1).clone()
    for k in range(width):  # tap k reads the hour (width - 1 - k) before
        lag = width - 1 - k
        shifted = torch.zeros_like(xBC)
        shifted[:, lag:] = xBC[:, :length - lag]
        conv = conv + conv_w[:, 0, k] * shifted
    xBC = F.silu(conv)
    x = xBC[..., :d_inner].reshape(batch, length, n_heads, headdim)
    B = xBC[..., d_inner:d_inner + d_state]
    C = xBC[..., d_inner + d_state:]
    dt = F.softplus(dt + dt_bias)  # (batch, length, heads)
    A = -torch.exp(A_log)

    state = torch.zeros(batch, n_heads, headdim, d_state, dtype=dtype)
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        inject = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
        state = decay * state + inject
        ys.append((state * C[:, t, None, None, :]).sum(-1) + D[:, None] * x[:, t])
    y = torch.stack(ys, dim=1).reshape(batch, length, d_inner)

    gated = y * F.silu(z)
    gated = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    return gated @ p[f"{name}.out_proj.weight"].to(dtype).T


def _layer_norm(x: torch.Tensor, p: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"].to(x.dtype), p[f"{name}.bias"].to(x.dtype), 1e-5)


def bimamba2_block(x: torch.Tensor, p: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """OpenMHC's bidirectional post-norm block ``backbone.{i}`` (eval mode: no dropout)."""
    forward = mamba2_mixer(x, p, f"{name}.fwd")
    backward = torch.flip(mamba2_mixer(torch.flip(x, dims=[1]), p, f"{name}.bwd"), dims=[1])
    x = _layer_norm(x + _linear(torch.cat([forward, backward], dim=-1), p, f"{name}.proj"), p, f"{name}.norm1")
    ffn = _linear(F.gelu(_linear(x, p, f"{name}.ffn.0")), p, f"{name}.ffn.3")
    return _layer_norm(x + ffn, p, f"{name}.norm2")


def reference_forward(inputs: torch.Tensor, state_dict: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The official encoder in eval mode: ``(h, r)`` for inputs ``(B, T, 38)``; ``h`` is
    ``None`` when the state_dict has no ``proj_head``."""
    p = release_state_dict(state_dict)
    x = _linear(F.gelu(_linear(inputs, p, "tokenizer.fc1")), p, "tokenizer.fc2")
    i = 0
    while f"backbone.{i}.proj.weight" in p:
        x = bimamba2_block(x, p, f"backbone.{i}")
        i += 1
    r = x.mean(dim=1)
    if "proj_head.0.weight" not in p:
        return None, r
    if "proj_head.8.weight" in p:  # the 3-layer head: Linear, LN, GELU, (drop), Linear, LN, GELU, (drop), Linear
        h = F.gelu(_layer_norm(_linear(r, p, "proj_head.0"), p, "proj_head.1"))
        h = F.gelu(_layer_norm(_linear(h, p, "proj_head.4"), p, "proj_head.5"))
        h = _linear(h, p, "proj_head.8")
    else:
        h = _linear(r, p, "proj_head.0")
    return F.normalize(h, dim=-1), r
