"""A plain restatement of the official FIM imputation forward, on the official key layout.

Written from the paper and the official code's structure (github FIM4Science/OpenFIM,
``FIMImpPointBase.forward`` + ``new_stats`` + ``rk4``, and ``FIMImpPoint`` with
``StaticWindowing``), independent of :mod:`domainfm.models.fim.fim`: functional torch over a
state_dict whose keys are the official ones (``time_encoding.linear_embedding.*``,
``branch_net.encoder_blocks.{i}.self_attn.in_proj_weight``, ``trunk_net.layers.linear_{j}.*``, ...),
attention written out by hand, and FIM-ℓ as upstream does it: window loop, every window padded
(here to the full grid: the cost model of the issue), the official missing-mask convention
(True = missing), forward-filled times and values. It is what the fidelity tests compare
:class:`~domainfm.models.fim.FIMImputer` against.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["official_state_dict_layout", "ref_local", "ref_windowed"]


def official_state_dict_layout(dim_time: int, dim_latent: int, n_heads: int, n_blocks: int, mlp_hidden: int,
                               n_layers: int = 4) -> dict[str, tuple[int, ...]]:
    """Key -> shape of an official ``FIMImpPointBase`` state_dict (``num_encoder_blocks = n_blocks + 1``)."""
    shapes: dict[str, tuple[int, ...]] = {
        "time_encoding.linear_embedding.weight": (1, 1), "time_encoding.linear_embedding.bias": (1,),
        "time_encoding.periodic_embedding.0.weight": (dim_time - 1, 1),
        "time_encoding.periodic_embedding.0.bias": (dim_time - 1,),
    }

    def mlp(prefix, sizes):
        for j, (a, b) in enumerate(zip(sizes[:-2], sizes[1:-1])):
            shapes[f"{prefix}.layers.linear_{j}.weight"] = (b, a)
            shapes[f"{prefix}.layers.linear_{j}.bias"] = (b,)
        shapes[f"{prefix}.layers.output.weight"] = (sizes[-1], sizes[-2])
        shapes[f"{prefix}.layers.output.bias"] = (sizes[-1],)

    def mha(prefix, d):
        shapes[f"{prefix}.in_proj_weight"] = (3 * d, d)
        shapes[f"{prefix}.in_proj_bias"] = (3 * d,)
        shapes[f"{prefix}.out_proj.weight"] = (d, d)
        shapes[f"{prefix}.out_proj.bias"] = (d,)

    d = dim_latent
    mlp("trunk_net", [dim_time] + [mlp_hidden] * n_layers + [d])
    shapes["branch_net.input_projection.weight"] = (d, dim_time + 1)
    shapes["branch_net.input_projection.bias"] = (d,)
    for i in range(n_blocks):
        p = f"branch_net.encoder_blocks.{i}"
        mha(f"{p}.self_attn", d)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{norm}.weight"] = (d,)
            shapes[f"{p}.{norm}.bias"] = (d,)
        mlp(f"{p}.residual_mlp", [d, mlp_hidden, d])
    shapes["branch_net.final_query_vector"] = (1, 1, d)
    mha("branch_net.final_attention", d)
    mlp("combiner_net", [2 * d] + [mlp_hidden] * n_layers + [d])
    mlp("vector_field_net", [d, 2])
    mlp("init_cond_net", [d + 1] + [mlp_hidden] * n_layers + [2])
    return shapes


def _mlp(sd, prefix, x):
    j = 0
    while f"{prefix}.layers.linear_{j}.weight" in sd:
        x = torch.selu(x @ sd[f"{prefix}.layers.linear_{j}.weight"].T + sd[f"{prefix}.layers.linear_{j}.bias"])
        j += 1
    return x @ sd[f"{prefix}.layers.output.weight"].T + sd[f"{prefix}.layers.output.bias"]


def _mha(sd, prefix, q_in, kv_in, key_missing, n_heads):
    w, b = sd[f"{prefix}.in_proj_weight"], sd[f"{prefix}.in_proj_bias"]
    d = q_in.shape[-1]
    q = q_in @ w[:d].T + b[:d]
    k = kv_in @ w[d:2 * d].T + b[d:2 * d]
    v = kv_in @ w[2 * d:].T + b[2 * d:]
    n, lq, _ = q.shape
    hd = d // n_heads
    q = q.view(n, lq, n_heads, hd).permute(0, 2, 1, 3)
    k = k.view(n, -1, n_heads, hd).permute(0, 2, 1, 3)
    v = v.view(n, -1, n_heads, hd).permute(0, 2, 1, 3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(key_missing[:, None, None, :], -math.inf)
    out = (scores.softmax(dim=-1) @ v).permute(0, 2, 1, 3).reshape(n, lq, d)
    return out @ sd[f"{prefix}.out_proj.weight"].T + sd[f"{prefix}.out_proj.bias"]


def _layer_norm(sd, prefix, x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[f"{prefix}.weight"], sd[f"{prefix}.bias"], 1e-5)


def _time_enc(sd, t):
    lin = t @ sd["time_encoding.linear_embedding.weight"].T + sd["time_encoding.linear_embedding.bias"]
    per = torch.sin(t @ sd["time_encoding.periodic_embedding.0.weight"].T + sd["time_encoding.periodic_embedding.0.bias"])
    return torch.cat([lin, per], dim=-1)


def _branch(sd, x, key_missing, n_heads):
    x = x @ sd["branch_net.input_projection.weight"].T + sd["branch_net.input_projection.bias"]
    i = 0
    while f"branch_net.encoder_blocks.{i}.self_attn.in_proj_weight" in sd:
        p = f"branch_net.encoder_blocks.{i}"
        x = _layer_norm(sd, f"{p}.layer_norm1", x + _mha(sd, f"{p}.self_attn", x, x, key_missing, n_heads))
        x = _layer_norm(sd, f"{p}.layer_norm2", x + _mlp(sd, f"{p}.residual_mlp", x))
        i += 1
    query = sd["branch_net.final_query_vector"].repeat(x.shape[0], 1, 1)
    return _mha(sd, "branch_net.final_attention", query, x, key_missing, n_heads)  # (N, 1, d)


def _minmax(x, mask):
    lo = torch.amin(x.masked_fill(mask, float("inf")), dim=1)
    hi = torch.amax(x.masked_fill(mask, float("-inf")), dim=1)
    return lo[:, None], (hi - lo + 1e-6)[:, None]


def _vector_field(sd, loc, enc):
    trunk = _mlp(sd, "trunk_net", _time_enc(sd, loc))
    comb = _mlp(sd, "combiner_net", torch.cat([trunk, enc.repeat(1, trunk.shape[1], 1)], dim=-1))
    out = _mlp(sd, "vector_field_net", comb)
    return out[..., :1], out[..., 1:]


def ref_local(sd: dict[str, Tensor], obs_times: Tensor, obs_values: Tensor, missing: Tensor, fine_grid: Tensor,
              n_heads: int) -> dict[str, Tensor]:
    """The official ``FIMImpPointBase.forward(training=False)``; all inputs ``[B, T|L, 1]``,
    ``missing`` True where a value is missing (the official convention)."""
    t_min, t_rng = _minmax(obs_times, missing)
    x_min, x_rng = _minmax(obs_values, missing)
    tn, vn, ln = (obs_times - t_min) / t_rng, (obs_values - x_min) / x_rng, (fine_grid - t_min) / t_rng
    enc = _branch(sd, torch.cat([_time_enc(sd, tn), vn], dim=-1), missing[..., 0], n_heads)
    drift_mean, drift_log_std = _vector_field(sd, ln, enc)
    ic = _mlp(sd, "init_cond_net", torch.cat([enc, ln[:, :1]], dim=-1))[:, 0]
    ic_mean, ic_log_std = ic[:, :1] * x_rng[:, 0] + x_min[:, 0], ic[:, 1:] + torch.log(x_rng[:, 0])
    drift_mean_o = drift_mean * x_rng / t_rng
    drift_log_std_o = drift_log_std + torch.log(x_rng) - torch.log(t_rng)
    # get_solution: super-fine grid (points and midpoints), drift there, then rk4 (Simpson) steps
    b, length = ln.shape[:2]
    sf = torch.zeros(b, 2 * length - 1, 1, dtype=ln.dtype)
    sf[:, ::2] = ln
    sf[:, 1::2] = (ln[:, 1:] + ln[:, :-1]) / 2
    sf_mean = _vector_field(sd, sf, enc)[0] * x_rng / t_rng
    sf_o = sf * t_rng + t_min
    drift = sf_mean[:, :-1, 0].reshape(b, -1, 2)
    end = torch.cat([drift[:, 1:, 0], sf_mean[:, -1:, 0]], dim=-1)
    half = sf_o[:, :-1, 0].reshape(b, -1, 2)
    half = half[..., 1] - half[..., 0]
    inc = half * (1 / 3) * (drift[..., 0] + 4 * drift[..., 1] + end)
    solution = torch.cumsum(torch.cat([ic_mean, inc], dim=1), dim=1)[..., None]
    return {"solution": solution, "drift_mean": drift_mean_o, "drift_log_std": drift_log_std_o,
            "init_mean": ic_mean, "init_log_std": ic_log_std}


def _forward_fill(x, observed):
    filled = x.clone()
    for r in range(x.shape[0]):
        obs = observed[r, :, 0].nonzero().flatten()
        for t in range(x.shape[1]):
            before = obs[obs <= t]
            filled[r, t] = x[r, before[-1]] if len(before) else x[r, obs[0]]
    return filled


def _windows(t_len, count, overlap):
    ideal = t_len / (1 + (count - 1) * (1 - overlap))
    size = round(ideal)
    stride = round(size * (1 - overlap))
    starts = [i * stride if i < count - 1 else t_len - size for i in range(count)]
    return size, [(s, s + size) for s in starts]


def ref_windowed(sd: dict[str, Tensor], obs_times: Tensor, obs_values: Tensor, missing: Tensor,
                 eval_times: Tensor, n_heads: int, count: int, overlap: float) -> dict[str, Tensor]:
    """Official ``FIMImpPoint`` with ``StaticWindowing(count, overlap)`` for one channel
    (``[B, T, 1]`` inputs), every window padded to the full grid (``T`` observations, ``G``
    evaluation points). Returns the blended ``solution``, ``drift_mean``, ``drift_log_std`` and
    the first window's ``init_mean``."""
    observed = ~missing
    times = _forward_fill(obs_times * observed, observed)
    values = _forward_fill(obs_values * observed, observed)
    b, t_len, _ = times.shape
    g = eval_times.shape[1]
    size, slices = _windows(t_len, count, overlap)
    lo = torch.stack([times[:, s, 0] for s, _ in slices], dim=1)
    hi = torch.stack([times[:, e - 1, 0] for _, e in slices], dim=1)
    lo[:, 0], hi[:, -1] = -math.inf, math.inf
    upper = torch.maximum(hi, torch.cat([lo[:, 1:], hi[:, -1:]], dim=1))
    lower = torch.minimum(lo, torch.cat([lo[:, :1], hi[:, :-1]], dim=1))
    ev = eval_times[..., 0]
    masks = (ev[:, None] >= lower[..., None]) & (ev[:, None] <= upper[..., None])  # [B, W, G]
    keys = ("solution", "drift_mean", "drift_log_std")
    scattered = {k: torch.zeros(b, count, g, dtype=times.dtype) for k in keys}
    init = None
    row_max = ev.amax(dim=1)
    for w, (s, e) in enumerate(slices):
        pad = t_len - size
        wt = torch.cat([times[:, s:e], times[:, e - 1:e].expand(-1, pad, -1)], dim=1)
        wv = torch.cat([values[:, s:e], torch.zeros(b, pad, 1, dtype=times.dtype)], dim=1)
        wm = torch.cat([missing[:, s:e], torch.ones(b, pad, 1, dtype=torch.bool)], dim=1)
        we = row_max[:, None].repeat(1, g).clone()
        for r in range(b):
            idx = masks[r, w].nonzero().flatten()
            we[r, : len(idx)] = ev[r, idx]
        out = ref_local(sd, wt, wv, wm, we[..., None], n_heads)
        if w == 0:
            init = out["init_mean"]
        for r in range(b):
            idx = masks[r, w].nonzero().flatten()
            for k in keys:
                scattered[k][r, w, idx] = out[k][r, : len(idx), 0]
    m = masks.to(times.dtype)
    result = {}
    for k in keys:
        vals = scattered[k] * m
        single = m.sum(1) <= 1
        ov = m[:, :-1] * m[:, 1:]
        right = torch.cumsum(ov, dim=-1) * ov
        left = torch.flip(torch.cumsum(torch.flip(ov, [-1]), dim=-1), [-1]) * ov
        tot = torch.where(left + right == 0, 1.0, left + right)
        both = ((left / tot) * vals[:, :-1] + (right / tot) * vals[:, 1:]).sum(1)
        result[k] = torch.where(single, vals.sum(1), 0.0) + torch.where(single, 0.0, both)
    result["init_mean"] = init
    return result
