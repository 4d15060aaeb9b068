"""Chronos-2: an encoder-only forecaster over patches, with attention across related series.

Chronos-2 (Amazon, 2025; arXiv:2510.15821; ``amazon/chronos-2``, ``autogluon/chronos-2-small``)
forecasts a *group* of rows at once: the target series of a task, its past-only covariates and its
known-future covariates are rows of one group, and every row reads the others through attention
across the group.

1. **Instance normalisation** per row: ``loc`` = mean and ``scale`` = population standard
   deviation of the observed (non-NaN) context values (``scale = 1e-5`` for a constant row;
   ``loc = 0, scale = 1`` without observed values), then ``z = asinh((x - loc) / scale)``
   (``use_arcsinh``). Forecasts map back with ``sinh(z) * scale + loc``. Known future values of a
   row are normalised with the row's own context statistics.
2. **Tokens.** The (at most ``context_length``) context values are left-padded with NaN to a
   multiple of ``input_patch_size`` and cut into patches; each patch enters as ``[time, values,
   observed]`` (``3 * patch`` numbers; NaN values set to 0; ``time`` = position relative to the
   forecast start divided by ``time_encoding_scale``, negative in the past). A residual block
   embeds it. Then a learned ``[REG]`` token, then one token per future patch built the same way
   from the known future values of the row (zeros and mask 0 where unknown, as for every target).
3. **Encoder blocks** (pre-RMSNorm, residual, no biases, attention *without* ``1/sqrt(d_kv)``):
   self-attention along each row's tokens with rotary position embeddings (RoPE); attention across
   the rows of a group at each token position (no position encoding: the rows of a group are a
   set); a ReLU feed-forward. A final RMSNorm. Patches without an observed value are masked out as
   keys (the [REG] and future tokens never are).
4. **Quantile head.** A residual block maps each future token to ``len(quantiles) * patch``
   values. The future tokens attend to each other in both directions, so the forecast of the first
   steps depends on how many future tokens there are (24 steps of a 24-step and of a 64-step
   forecast differ).

Horizons beyond ``max_output_patches * output_patch_size`` roll out as the upstream pipeline does:
the quantile paths at ``unrolled_quantiles`` (0.1, ..., 0.9) are appended to the context (known
future covariate values replace the predicted ones), each path is forecast again as its own group,
and the ``paths x quantiles`` values per step are reduced to the model's quantiles by a weighted
empirical quantile (each value weighted by the probability mass of its path's and its own level).

:meth:`Chronos2.predict`, :meth:`~Chronos2.predict_quantiles` and :meth:`~Chronos2.predict_df`
take chronos-forecasting's inputs (see :mod:`.chronos2_convert`), batch them as its pipeline does
(tasks are added while fewer than ``batch_size`` rows are in the batch; ``cross_learning=True``
makes every task of a batch one group), and return the target rows only.

Inference (no gradients) takes a faster path than training, with the same numbers to float
rounding: rows of a group of one attend only to themselves, so their group attention is the
single matrix ``o.weight @ v.weight``; the last block computes only what the future tokens need;
the time attention's three projections are one matrix product; on the CPU the work is cut into row
chunks whose intermediates stay in cache, and fp32 matrix products go to oneDNN (see
:class:`_Pass`). The derived weights (and, under autocast, the weights in bf16) are kept between
calls while the weights are unchanged; :meth:`Chronos2.release_inference_cache` frees them.
Padded, unobserved tokens are never read by an observed one: their states (visible only through
:meth:`~Chronos2.embed`) may differ from upstream's, which mixes them across groups.

Parameter names are ours (``patch_embed``, ``shared``, ``encoder.blocks.{i}.{time_attn,
group_attn,ffn}`` with their norms, ``encoder.final_norm``, ``quantile_head``);
:func:`.chronos2_convert.convert_chronos2` maps the Hugging Face files.

Shapes:
    ``forward(context (B, T), group_ids (B,), future_covariates (B, F <= n * P), num_output_patches=n)``
    -> ``{"quantile_preds": (B, Q, n * P), "loss": None | scalar}``; ``forward_features`` -> (B, n,
    d_model) (the future tokens); ``forward_head`` -> (B, n * P, Q) in normalised units.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .chronos_bolt import _ACTIVATIONS, ResidualBlock, _check_levels, _example, instance_norm, patchify
from .forecast import DEFAULT_QUANTILES
from .t5 import Attention, RMSNorm

__all__ = ["Chronos2", "Chronos2Block", "CHRONOS2_QUANTILES", "UNROLLED_QUANTILES", "rope_tables",
           "interpolate_quantiles", "weighted_quantile", "convert_chronos2", "load_chronos2", "CHRONOS2_CONFIG",
           "CHRONOS2_SMALL_CONFIG", "CHRONOS2_REVISIONS"]

#: the 21 levels of amazon/chronos-2's head
CHRONOS2_QUANTILES = (0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75,
                      0.8, 0.85, 0.9, 0.95, 0.99)
#: the quantile paths a long-horizon rollout appends to the context (the upstream default)
UNROLLED_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: rows x tokens per chunk and CPU thread on the inference path: the chunk's activations stay in
#: cache (measured on one shared core at chronos-2's size: 5-10% faster than whole batches)
_CHUNK_TOKENS = 1024


def _chunk_tokens() -> int:
    return _CHUNK_TOKENS * max(1, torch.get_num_threads())


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()


def rope_tables(length: int, d_kv: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each (length, d_kv) float32, of rotary embeddings at positions 0..length-1:
    frequency ``theta ** (-2i / d_kv)`` for channel pair ``(i, i + d_kv / 2)``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_kv, 2, device=device).float() / d_kv))
    angles = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _attend(q, k, v, mask: torch.Tensor | None, dropout_p: float, fast: bool) -> torch.Tensor:
    """Attention without score scaling; ``mask`` (bool, broadcast to the scores) marks the keys read."""
    if fast and q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        # measured: in bf16 two matrix products and a float32 softmax beat the CPU flash kernel
        # 2.5-fold at these sequence lengths (in fp32 the two are even)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)  # the bf16 kernel accumulates in float32
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=1.0)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE: ``x * cos + [-x2, x1] * sin``, written ``x * cos + [x2, x1] * [-sin, sin]`` (same values)."""
    return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def interpolate_quantiles(levels: Sequence[float] | torch.Tensor, known: torch.Tensor,
                          values: torch.Tensor) -> torch.Tensor:
    """Values at ``levels`` (L,) by linear interpolation between ``values`` (..., K) at levels
    ``known`` ((K,) or the shape of ``values``, sorted), the extreme values repeated at levels 0
    and 1 (the upstream rule). Returns (..., L) float32."""
    values = values.to(torch.float32)
    shape = values.shape
    k = shape[-1]
    values = values.reshape(-1, k)
    known = torch.as_tensor(known, dtype=torch.float32, device=values.device)
    known = known.expand(values.shape[0], k) if known.ndim == 1 else known.reshape(-1, k)
    query = torch.as_tensor(levels, dtype=torch.float32, device=values.device)
    known, order = known.sort(dim=1)
    values = values.gather(1, order)
    lo_pad, hi_pad = bool(known.min() > 0), bool(known.max() < 1)
    if lo_pad:
        known = torch.cat([torch.zeros_like(known[:, :1]), known], dim=1)
        values = torch.cat([values[:, :1], values], dim=1)
    if hi_pad:
        known = torch.cat([known, torch.ones_like(known[:, :1])], dim=1)
        values = torch.cat([values, values[:, -1:]], dim=1)
    query = query.expand(values.shape[0], -1).contiguous()
    upper = torch.searchsorted(known.contiguous(), query, right=True).clamp(max=known.shape[1] - 1)
    lower = upper - 1
    lo_level, hi_level = known.gather(1, lower), known.gather(1, upper)
    lo_value, hi_value = values.gather(1, lower), values.gather(1, upper)
    weight = torch.nan_to_num((query - lo_level) / (hi_level - lo_level), nan=0.0)
    return (lo_value + weight * (hi_value - lo_value)).reshape(*shape[:-1], query.shape[-1])


def weighted_quantile(levels: Sequence[float], weights: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """Quantiles (..., L) of the weighted samples (..., S): the empirical CDF of the sorted samples
    (cumulative normalised weights), read by :func:`interpolate_quantiles`."""
    samples = samples.to(torch.float32)
    weights = weights.to(device=samples.device, dtype=torch.float32)
    weights = (weights / weights.sum()).expand(*samples.shape[:-1], -1)
    ordered, order = samples.sort(dim=-1)
    cdf = weights.gather(-1, order).cumsum(dim=-1).clamp(0.0, 1.0)
    return interpolate_quantiles(levels, cdf, ordered)


def _probability_mass(levels: torch.Tensor) -> torch.Tensor:
    """Mass of each level of a piecewise-uniform distribution: half the gap to its neighbours
    (0 and 1 at the ends), normalised."""
    edges = torch.cat([levels.new_zeros(1), levels, levels.new_ones(1)])
    mass = (edges[2:] - edges[:-2]) / 2
    return mass / mass.sum()


class _FeedForward(nn.Module):
    """``wo(dropout(act(wi(x))))`` without biases (T5's feed-forward with a configurable activation)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str):
        super().__init__()
        self.activation = activation
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(_ACTIVATIONS[self.activation](self.wi(x))))


class Chronos2Block(nn.Module):
    """Time attention (RoPE), group attention, feed-forward; each pre-RMSNorm with a residual.
    The computation lives in :class:`_Pass` (one for training, one faster for inference)."""

    def __init__(self, d_model: int, num_heads: int, d_kv: int, d_ff: int, dropout: float, eps: float,
                 activation: str):
        super().__init__()
        self.time_attn_norm = RMSNorm(d_model, eps)
        self.time_attn = Attention(d_model, num_heads, d_kv, dropout)
        self.group_attn_norm = RMSNorm(d_model, eps)
        self.group_attn = Attention(d_model, num_heads, d_kv, dropout)
        self.ffn_norm = RMSNorm(d_model, eps)
        self.ffn = _FeedForward(d_model, d_ff, dropout, activation)
        self.dropout = nn.Dropout(dropout)


class Chronos2Encoder(nn.Module):
    def __init__(self, num_layers: int, **block):
        super().__init__()
        self.blocks = nn.ModuleList(Chronos2Block(**block) for _ in range(num_layers))
        self.final_norm = RMSNorm(block["d_model"], block["eps"])


class _Pass:
    """One encoder pass. ``fast`` (no gradients): residuals added in place, row chunks whose
    intermediates stay in cache, the three projections of the time attention as one matrix product,
    the group attention of singleton groups as ``o.weight @ v.weight``, and (under autocast) weights
    in the compute dtype; the derived weights are kept by the model while its weights are unchanged
    (:meth:`Chronos2.release_inference_cache` frees them)."""

    def __init__(self, model: "Chronos2", device: torch.device):
        self.model = model
        self.fast = not torch.is_grad_enabled()
        self.chunked = device.type == "cpu"  # accelerators want the largest operations
        # fp32 matrix products straight to oneDNN (which PyTorch already uses for bf16): PyTorch's
        # default for fp32, MKL, runs at AVX2 speed on AMD CPUs (measured on a Zen 5 EPYC: 50 vs
        # 110 GMAC/s per core; the same to float32 rounding, strict fp32 in both)
        self.onednn = self.fast and device.type == "cpu" and _ONEDNN
        self.dtype = torch.get_autocast_dtype(device.type) if (
            device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)) else None

    def weight(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or tensor.dtype == self.dtype:
            return tensor
        return self.model._derived(("cast", id(tensor), self.dtype), (tensor,), lambda: tensor.to(self.dtype))

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               relu: bool = False) -> torch.Tensor:
        """``x @ weight.T + bias`` (then ReLU)."""
        if self.onednn and x.dtype == weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")
        y = F.linear(x, weight, bias)
        return y.relu_() if relu else y

    def linear(self, layer: nn.Module, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        if self.fast and type(layer) is nn.Linear:
            return self.matmul(x, self.weight(layer.weight), layer.bias, relu)
        y = layer(x)  # a wrapped layer (LoRA) runs its own forward
        return y.relu_() if relu else y

    def residual_block(self, block: ResidualBlock, x: torch.Tensor) -> torch.Tensor:
        """:class:`.chronos_bolt.ResidualBlock` (patch embedding, quantile head) on the fast path."""
        if not self.fast or block.activation != "relu" or block.training:
            return block(x)
        hidden = self.linear(block.hidden, x, relu=True)
        return self.linear(block.output, hidden).add_(self.linear(block.residual, x))

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if self.fast and x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)  # one kernel, same values
        return norm(x)

    def stacked(self, layers: Sequence[nn.Module]) -> torch.Tensor | None:
        """One weight computing several plain layers of one input at once (their outputs side by
        side); None on the training path or when a layer is wrapped (LoRA)."""
        if not self.fast or any(type(layer) is not nn.Linear or layer.bias is not None for layer in layers):
            return None
        weights = tuple(layer.weight for layer in layers)
        dtype = self.dtype or weights[0].dtype
        return self.model._derived(("stack", *map(id, weights), dtype), weights,
                                   lambda: torch.cat(weights).to(dtype))

    def value_output(self, attn: Attention) -> torch.Tensor | None:
        """``o.weight @ v.weight`` (the group attention of a row alone), or None (training, LoRA)."""
        if not self.fast or type(attn.v) is not nn.Linear or type(attn.o) is not nn.Linear:
            return None
        v, o = attn.v.weight, attn.o.weight
        dtype = self.dtype or v.dtype
        return self.model._derived(("ov", id(v), id(o), dtype), (v, o), lambda: (o.float() @ v.float()).to(dtype))

    def add(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return h.add_(y) if self.fast else h + y

    def chunks(self, rows: int, tokens: int):
        if not self.fast or not self.chunked:
            return [slice(0, rows)]
        step = max(1, _chunk_tokens() // max(1, tokens))
        return [slice(i, min(rows, i + step)) for i in range(0, rows, step)]

    # -- sub-layers -------------------------------------------------------------

    def time_attention(self, block, h, observed, cos, sin, keep: int | None):
        attn = block.time_attn
        dtype = self.dtype or h.dtype
        cos, sin = cos.to(dtype), sin.to(dtype)
        pieces = []
        for rows in self.chunks(h.shape[0], h.shape[1]):
            hc = h[rows]
            x = self.norm(block.time_attn_norm, hc)
            qkv = None if keep else self.stacked((attn.q, attn.k, attn.v))
            if qkv is not None:  # one matrix product for the three projections
                q, k, v = (attn.split(t) for t in self.matmul(x, qkv).chunk(3, dim=-1))
            else:
                q = attn.split(self.linear(attn.q, x[:, -keep:] if keep else x))
                k, v = attn.split(self.linear(attn.k, x)), attn.split(self.linear(attn.v, x))
            q = _rotate(q, cos[-q.shape[2]:], sin[-q.shape[2]:])
            k = _rotate(k, cos, sin)
            seen = observed[rows]
            # no mask when every token is observed (the faster kernel); meta tensors have no values
            mask = None if seen.device.type != "meta" and bool(seen.all()) else seen[:, None, None, :]
            out = _attend(q, k, v, mask, attn.dropout if block.training else 0.0, self.fast)
            b, _, n, _ = out.shape
            y = block.dropout(self.linear(attn.o, out.transpose(1, 2).reshape(b, n, -1)))
            if keep:
                pieces.append(hc[:, -keep:] + y)
            else:
                hc = self.add(hc, y)
                pieces.append(hc)
        if keep or not self.fast:
            return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return h

    def group_attention(self, block, h, observed, same_group):
        attn = block.group_attn
        if same_group is None:  # every row its own group: softmax over one key is 1
            fused = self.value_output(attn)
            for rows in self.chunks(h.shape[0], h.shape[1]):
                x = self.norm(block.group_attn_norm, h[rows])
                y = self.matmul(x, fused) if fused is not None else attn.o(attn.v(x))
                if self.fast:
                    h[rows].add_(y)
                else:
                    h = h + block.dropout(y)
            return h
        x = self.norm(block.group_attn_norm, h).transpose(0, 1)  # (S, B, d): rows are the sequence
        q, k, v = (attn.split(self.linear(layer, x)) for layer in (attn.q, attn.k, attn.v))
        # row q reads row b at a position when they share a group and b is observed there; each
        # row also reads itself, so that unobserved positions (read by no one) stay finite
        eye = torch.eye(h.shape[0], dtype=torch.bool, device=h.device)
        mask = same_group[None] & (observed.transpose(0, 1)[:, None, :] | eye[None])  # (S, B, B)
        out = _attend(q, k, v, mask[:, None], attn.dropout if block.training else 0.0, self.fast)
        s, _, b, _ = out.shape
        y = self.linear(attn.o, out.transpose(1, 2).reshape(s, b, -1)).transpose(0, 1)
        return self.add(h, block.dropout(y))

    def feed_forward(self, block, h):
        ffn = block.ffn
        act = _ACTIVATIONS[ffn.activation]
        for rows in self.chunks(h.shape[0], h.shape[1]):
            hc = h[rows]
            x = self.norm(block.ffn_norm, hc)
            if self.fast and ffn.activation == "relu":
                hidden = ffn.dropout(self.linear(ffn.wi, x, relu=True))
            else:
                hidden = ffn.dropout(act(self.linear(ffn.wi, x)))
            y = block.dropout(self.linear(ffn.wo, hidden))
            if self.fast:
                hc.add_(y)
            else:
                h = h + y
        return h


class Chronos2(nn.Module):
    """Chronos-2 forecaster (see the module docstring).

    Args:
        context_length: context values read per row (longer contexts keep their last values).
            Official: 8192.
        input_patch_size, input_patch_stride, output_patch_size: patching (official 16, 16, 16; the
            three must be equal: future tokens share the patch embedding, and upstream's time feature
            numbers every value once).
        max_output_patches: future tokens of one pass (official 64, i.e. 1024 steps); longer
            horizons roll out.
        quantiles: the levels the head predicts (official: the 21 of :data:`CHRONOS2_QUANTILES`).
        use_reg_token: put a learned ``[REG]`` token between context and future tokens (official: yes).
        use_arcsinh: ``asinh`` after standardising (official: yes).
        time_encoding_scale: divisor of the time feature (default ``context_length``; official 8192).
        d_model, d_kv, d_ff, num_heads, num_layers, layer_norm_eps, dense_act_fn, rope_theta,
        dropout, initializer_factor: encoder sizes and settings (official: 768, 64, 3072, 12, 12,
            1e-6, ``"relu"``, 10000, 0.1, 0.05).
        n_chans, n_times, sfreq, n_outputs: the zoo's signal description. Chronos-2 forecasts any
            number of rows and any horizon (a call argument), so ``n_chans`` is not fixed;
            ``n_times`` is ``context_length``; ``n_outputs`` counts the quantile levels the head
            predicts (other than ``len(quantiles)``: that many evenly spaced levels).
    """

    def __init__(self, *, context_length: int = 8192, input_patch_size: int = 16, input_patch_stride: int = 16,
                 output_patch_size: int = 16, max_output_patches: int = 64,
                 quantiles: Sequence[float] = CHRONOS2_QUANTILES, use_reg_token: bool = True,
                 use_arcsinh: bool = True, time_encoding_scale: int | None = None, d_model: int = 768,
                 d_kv: int = 64, d_ff: int = 3072, num_heads: int = 12, num_layers: int = 12,
                 dropout: float = 0.1, layer_norm_eps: float = 1e-6, dense_act_fn: str = "relu",
                 rope_theta: float = 10000.0, initializer_factor: float = 0.05, n_chans: int | None = None,
                 n_times: int | None = None, sfreq: float | None = None, n_outputs: int | None = None):
        super().__init__()
        if n_times is not None and n_times != context_length:
            raise ValueError(f"n_times={n_times} disagrees with context_length={context_length}; give one of them")
        for label, value in (("context_length", context_length), ("input_patch_size", input_patch_size),
                             ("input_patch_stride", input_patch_stride), ("output_patch_size", output_patch_size),
                             ("max_output_patches", max_output_patches), ("d_model", d_model), ("d_kv", d_kv),
                             ("d_ff", d_ff), ("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r}: expected a positive integer")
        if output_patch_size != input_patch_size:
            raise ValueError(f"output_patch_size={output_patch_size} differs from input_patch_size={input_patch_size}: "
                             "future tokens are embedded by the patch embedding, so the two must be equal")
        if input_patch_stride != input_patch_size:
            raise ValueError(f"input_patch_stride={input_patch_stride} differs from input_patch_size={input_patch_size}: "
                             "the time feature numbers every value once, so patches may not overlap or skip")
        if d_kv % 2:
            raise ValueError(f"d_kv={d_kv}: rotary embeddings need an even head size")
        if dense_act_fn not in _ACTIVATIONS:
            raise ValueError(f"dense_act_fn={dense_act_fn!r}: expected one of {sorted(_ACTIVATIONS)}")
        levels = _check_levels(quantiles, "quantiles")
        if n_outputs is not None and n_outputs != len(levels):
            levels = _even_levels(n_outputs)
        self.context_length, self.max_output_patches = context_length, max_output_patches
        self.input_patch_size, self.input_patch_stride = input_patch_size, input_patch_stride
        self.output_patch_size = output_patch_size
        self.quantiles = levels
        self.use_reg_token, self.use_arcsinh = bool(use_reg_token), bool(use_arcsinh)
        self.time_encoding_scale = int(time_encoding_scale or context_length)
        self.d_model, self.d_ff, self.d_kv, self.num_heads = d_model, d_ff, d_kv, num_heads
        self.num_features = d_model
        self.dropout_rate, self.dense_act_fn, self.rope_theta = dropout, dense_act_fn, float(rope_theta)
        self.initializer_factor = initializer_factor
        self.n_chans, self.sfreq = n_chans, sfreq
        self.reg_token_id = 1  # row 1 of `shared`; row 0 is the (unused) padding token, as upstream
        device = torch.empty(0).device  # where the caller builds (meta inside `with torch.device("meta")`)
        with torch.device("meta"):  # initialised once below, not twice
            self.shared = nn.Embedding(2 if self.use_reg_token else 1, d_model)
            self.patch_embed = ResidualBlock(3 * input_patch_size, d_ff, d_model, activation=dense_act_fn,
                                             dropout=dropout)
            self.encoder = Chronos2Encoder(num_layers, d_model=d_model, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff,
                                           dropout=dropout, eps=layer_norm_eps, activation=dense_act_fn)
            self.quantile_head = self._new_head(len(levels))
        self.to_empty(device=device)
        self.apply(self._init_weights)
        self.__dict__["_inference_cache"] = {}  # see _derived

    # -- init ------------------------------------------------------------------

    def _new_head(self, n_levels: int) -> ResidualBlock:
        return ResidualBlock(self.d_model, self.d_ff, n_levels * self.output_patch_size,
                             activation=self.dense_act_fn, dropout=self.dropout_rate)

    def _init_weights(self, module: nn.Module) -> None:
        # upstream's initialisation (Mesh TensorFlow's, scaled by initializer_factor; norms start
        # at initializer_factor, not 1)
        f = self.initializer_factor
        if isinstance(module, RMSNorm):
            nn.init.constant_(module.weight, f)
        elif isinstance(module, Attention):
            d_model, inner = module.q.in_features, module.num_heads * module.d_kv
            nn.init.normal_(module.q.weight, std=f * (d_model * module.d_kv) ** -0.5)
            nn.init.normal_(module.k.weight, std=f * d_model**-0.5)
            nn.init.normal_(module.v.weight, std=f * d_model**-0.5)
            nn.init.normal_(module.o.weight, std=f * inner**-0.5)
        elif isinstance(module, _FeedForward):
            nn.init.normal_(module.wi.weight, std=f * module.wi.in_features**-0.5)
            nn.init.normal_(module.wo.weight, std=f * module.wo.in_features**-0.5)
        elif isinstance(module, ResidualBlock):
            for layer in (module.hidden, module.residual, module.output):
                nn.init.normal_(layer.weight, std=f * layer.in_features**-0.5)
                nn.init.zeros_(layer.bias)
        elif module is self:
            nn.init.normal_(self.shared.weight, std=f)

    # -- configuration ------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this architecture."""
        block = self.encoder.blocks[0]
        return dict(context_length=self.context_length, input_patch_size=self.input_patch_size,
                    input_patch_stride=self.input_patch_stride, output_patch_size=self.output_patch_size,
                    max_output_patches=self.max_output_patches, quantiles=list(self.quantiles),
                    use_reg_token=self.use_reg_token, use_arcsinh=self.use_arcsinh,
                    time_encoding_scale=self.time_encoding_scale, d_model=self.d_model, d_kv=self.d_kv,
                    d_ff=self.d_ff, num_heads=self.num_heads, num_layers=len(self.encoder.blocks),
                    dropout=self.dropout_rate, layer_norm_eps=block.ffn_norm.eps, dense_act_fn=self.dense_act_fn,
                    rope_theta=self.rope_theta, initializer_factor=self.initializer_factor)

    def rebuild(self, **changes) -> None:
        """Become the architecture ``config() | changes`` (fresh weights where anything changed;
        what :func:`domainfm.save_pretrained` records follows)."""
        new = {**self.config(), **changes}
        if new != self.config():
            device = self.shared.weight.device
            with torch.device(device):
                other = Chronos2(**new, n_chans=self.n_chans, sfreq=self.sfreq)
            self.__dict__.update({k: v for k, v in other.__dict__.items() if not k.startswith("_") and k != "training"})
            for name, module in other.named_children():
                setattr(self, name, module)
            self.train(self.training)
            self._inference_cache.clear()
        record = getattr(self, "domainfm_kwargs", None)
        if isinstance(record, dict):
            record.update(new)
            record.pop("n_outputs", None)
            if record.get("n_times") is not None:
                record["n_times"] = self.context_length

    @property
    def domainfm_upstream_config(self) -> dict | None:
        return self.__dict__.get("_upstream_config")

    @domainfm_upstream_config.setter
    def domainfm_upstream_config(self, config: dict) -> None:
        """Called by the hub with an upstream ``config.json``: become the architecture it describes."""
        from .chronos2_convert import apply_chronos2_config

        apply_chronos2_config(self, config)
        self.__dict__["_upstream_config"] = config

    @property
    def device(self) -> torch.device:
        return self.shared.weight.device

    @property
    def prediction_length(self) -> int:
        """Steps of one pass (longer horizons roll out)."""
        return self.max_output_patches * self.output_patch_size

    # -- tokens -------------------------------------------------------------------

    def _normalise(self, x: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        z = (x.to(torch.float32) - loc) / scale
        return torch.asinh(z) if self.use_arcsinh else z

    def _denormalise(self, z: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        z = z.to(torch.float32)
        return (torch.sinh(z) if self.use_arcsinh else z) * scale + loc

    def tokens(self, context: torch.Tensor, *, context_mask: torch.Tensor | None = None,
               future_covariates: torch.Tensor | None = None, future_covariates_mask: torch.Tensor | None = None,
               num_output_patches: int = 1):
        """Token embeddings (B, S, d_model), which tokens are observed (B, S) bool, ``(loc, scale)``
        (each (B, 1)) and the known-future mask (B, n * P), from the raw inputs (see :meth:`forward`)."""
        context = torch.as_tensor(context, device=self.device)
        if context.ndim != 2:
            raise ValueError(f"context: expected shape (rows, time), got {tuple(context.shape)}")
        context = context.to(torch.float32)
        b = context.shape[0]
        observed = ~torch.isnan(context) if context_mask is None else torch.as_tensor(
            context_mask, device=self.device).to(torch.bool)
        if observed.shape != context.shape:
            raise ValueError(f"context_mask: expected shape {tuple(context.shape)}, got {tuple(observed.shape)}")
        context, observed = context[:, -self.context_length:], observed[:, -self.context_length:]
        loc, scale = instance_norm(context)
        p, horizon = self.input_patch_size, num_output_patches * self.output_patch_size
        values = patchify(self._normalise(context, loc, scale), p, self.input_patch_stride, float("nan"))
        seen = patchify(observed.to(torch.float32), p, self.input_patch_stride, 0.0)
        values = torch.where(seen > 0, values, torch.zeros_like(values))
        n = values.shape[1]
        time = torch.arange(-n * p, 0, device=self.device, dtype=torch.float32).div(self.time_encoding_scale)
        past = torch.cat([time.view(1, n, p).expand(b, -1, -1), values, seen], dim=-1)

        known = torch.zeros(b, horizon, device=self.device)
        future = torch.zeros(b, horizon, device=self.device)
        if future_covariates is not None:
            fc = torch.as_tensor(future_covariates, device=self.device).to(torch.float32)
            if fc.ndim != 2 or fc.shape[0] != b or fc.shape[1] > horizon:
                raise ValueError(f"future_covariates: expected shape (rows={b}, length <= num_output_patches * "
                                 f"output_patch_size = {horizon}), got {tuple(fc.shape)}")
            fmask = ~torch.isnan(fc) if future_covariates_mask is None else torch.as_tensor(
                future_covariates_mask, device=self.device).to(torch.bool)
            if fmask.shape != fc.shape:
                raise ValueError(f"future_covariates_mask: expected shape {tuple(fc.shape)}, got {tuple(fmask.shape)}")
            z = self._normalise(fc, loc, scale)
            width = fc.shape[1]
            future[:, :width] = torch.where(fmask, z, torch.zeros_like(z))
            known[:, :width] = fmask.to(torch.float32)
            if future.device.type != "meta" and torch.isnan(future).any():
                raise ValueError("future_covariates: NaN at steps that future_covariates_mask marks as known")
        ftime = torch.arange(horizon, device=self.device, dtype=torch.float32).div(self.time_encoding_scale)
        shape = (b, num_output_patches, p)
        ahead = torch.cat([ftime.view(1, num_output_patches, p).expand(b, -1, -1), future.view(shape),
                           known.view(shape)], dim=-1)

        inputs = torch.cat([past, ahead], dim=1)
        if not (self.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(self.device.type)):
            inputs = inputs.to(self.patch_embed.hidden.weight.dtype)
        if torch.is_grad_enabled():
            embeds = self.patch_embed(inputs)
        else:  # row chunks: the (tokens, d_ff) hidden layer stays in cache
            run = _Pass(self, self.device)
            step = max(1, _chunk_tokens() // inputs.shape[1]) if run.chunked else b
            embeds = torch.cat([run.residual_block(self.patch_embed, inputs[i:i + step]) for i in range(0, b, step)])
        flags = [seen.sum(-1) > 0]
        if self.use_reg_token:
            reg = self.shared.weight[self.reg_token_id].to(embeds.dtype).expand(b, 1, -1)
            embeds = torch.cat([embeds[:, :n], reg, embeds[:, n:]], dim=1)
            flags.append(flags[0].new_ones(b, 1))
        flags.append(flags[0].new_ones(b, num_output_patches))
        return embeds, torch.cat(flags, dim=1), (loc, scale), known

    # -- the encoder ----------------------------------------------------------------

    def _derived(self, key, sources: tuple[torch.Tensor, ...], build) -> torch.Tensor:
        """A tensor derived from ``sources`` (a cast, a stacked or multiplied weight), kept until a
        source changes (another storage or an in-place update)."""
        signature = tuple((t.data_ptr(), t._version, t.device) for t in sources)
        hit = self._inference_cache.get(key)
        if hit is None or hit[0] != signature:
            hit = (signature, build())
            self._inference_cache[key] = hit
        return hit[1]

    def release_inference_cache(self) -> None:
        """Free the weights derived for inference (stacked projections, ``o @ v`` products, and
        under autocast the weights in the compute dtype: up to about half the model's size)."""
        self._inference_cache.clear()

    def encode(self, embeds: torch.Tensor, observed: torch.Tensor, group_ids: torch.Tensor | None = None,
               keep: int | None = None) -> torch.Tensor:
        """Encoder states (B, S, d_model) of token embeddings, or of the last ``keep`` tokens only
        (B, keep, d_model), which is all the last block then computes. ``group_ids`` (B,): rows with
        equal ids attend to each other (default: every row alone)."""
        b, s, _ = embeds.shape
        same_group = None
        if group_ids is not None:
            group_ids = torch.as_tensor(group_ids, device=embeds.device)
            if group_ids.shape != (b,):
                raise ValueError(f"group_ids: expected shape (rows={b},), got {tuple(group_ids.shape)}")
            if group_ids.device.type == "meta" or torch.unique(group_ids).numel() < b:
                same_group = group_ids[:, None] == group_ids[None, :]
        blocks = self.encoder.blocks
        if same_group is None and self.training and any(blk.group_attn.dropout > 0 for blk in blocks):
            same_group = torch.eye(b, dtype=torch.bool, device=embeds.device)  # attention dropout applies
        run = _Pass(self, embeds.device)
        cos, sin = rope_tables(s, self.d_kv, self.rope_theta, embeds.device)
        sin = torch.cat([-sin[:, : self.d_kv // 2], sin[:, self.d_kv // 2:]], dim=-1)  # see _rotate
        h = embeds.clone(memory_format=torch.contiguous_format) if run.fast else embeds  # updated in place
        for i, block in enumerate(blocks):
            last = keep if i == len(blocks) - 1 else None
            h = run.time_attention(block, h, observed, cos, sin, last)
            seen = observed[:, -h.shape[1]:]
            h = run.group_attention(block, h, seen, same_group)
            h = run.feed_forward(block, h)
        if keep and not len(blocks):
            h = h[:, -keep:]
        return self.encoder.final_norm(h)

    # -- the module surface -------------------------------------------------------------

    def forward_features(self, context: torch.Tensor, group_ids: torch.Tensor | None = None,
                         future_covariates: torch.Tensor | None = None, num_output_patches: int = 1,
                         **masks) -> torch.Tensor:
        """States of the ``num_output_patches`` future tokens (B, n, d_model) that the head reads."""
        embeds, observed, _, _ = self.tokens(context, future_covariates=future_covariates,
                                             num_output_patches=num_output_patches, **masks)
        return self.encode(embeds, observed, group_ids, keep=num_output_patches)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Quantiles (B, n * P, Q) in normalised units from future-token states (B, n, d_model)."""
        if pre_logits:
            return features
        out = self.quantile_head(features)
        b, n = out.shape[:2]
        return out.view(b, n, len(self.quantiles), self.output_patch_size).permute(0, 1, 3, 2).reshape(b, n * self.output_patch_size, -1)

    def reset_classifier(self, n_outputs: int, quantiles: Sequence[float] | None = None) -> None:
        """A fresh quantile head for ``quantiles`` (default: ``n_outputs`` evenly spaced levels).
        The head's outputs are quantile levels: Chronos-2's horizon is a call argument."""
        levels = _check_levels(quantiles, "quantiles") if quantiles is not None else _even_levels(n_outputs)
        if quantiles is not None and n_outputs is not None and n_outputs != len(levels):
            raise ValueError(f"reset_classifier: n_outputs={n_outputs} but {len(levels)} quantiles")
        self.quantiles = levels
        self.quantile_head = self._new_head(len(levels)).to(self.shared.weight.device)
        self.quantile_head.apply(self._init_weights)
        record = getattr(self, "domainfm_kwargs", None)
        if isinstance(record, dict):
            record["quantiles"] = list(levels)
            record.pop("n_outputs", None)

    def forward(self, context: torch.Tensor, group_ids: torch.Tensor | None = None,
                future_covariates: torch.Tensor | None = None, num_output_patches: int = 1, *,
                context_mask: torch.Tensor | None = None, future_covariates_mask: torch.Tensor | None = None,
                future_target: torch.Tensor | None = None,
                future_target_mask: torch.Tensor | None = None) -> dict[str, Any]:
        """``{"quantile_preds": (B, Q, n * P) float32 in the data's units, "loss": scalar or None}``.

        Args:
            context: (B, T) rows, NaN = missing (or ``context_mask`` (B, T) True = observed).
            group_ids: (B,) rows with equal ids form one group (default: every row alone).
            future_covariates: (B, F <= n * P) known future values, NaN = unknown (every target row).
            num_output_patches: future tokens ``n`` (the forecast covers ``n * P`` steps).
            future_target: (B, F <= n * P) to score: the quantile loss in normalised units, summed
                over levels, averaged over the ``n * P`` steps (unobserved and known-future steps
                count as 0) and over the rows, as upstream.
        """
        n = int(num_output_patches)
        if n < 1:
            raise ValueError(f"num_output_patches={num_output_patches}: expected a positive integer")
        embeds, observed, (loc, scale), known = self.tokens(
            context, context_mask=context_mask, future_covariates=future_covariates,
            future_covariates_mask=future_covariates_mask, num_output_patches=n)
        states = self.encode(embeds, observed, group_ids, keep=n)
        normalised = self.forward_head(states).transpose(1, 2).to(torch.float32)  # (B, Q, n * P)
        loss = None
        if future_target is not None:
            loss = self._loss(normalised, future_target, future_target_mask, known, loc, scale)
        preds = self._denormalise(normalised, loc.unsqueeze(-1), scale.unsqueeze(-1))
        return {"quantile_preds": preds, "loss": loss}

    def _loss(self, normalised, target, target_mask, known, loc, scale) -> torch.Tensor:
        target = torch.as_tensor(target, device=normalised.device).to(torch.float32)
        b, _, horizon = normalised.shape
        if target.ndim != 2 or target.shape[0] != b or target.shape[1] > horizon:
            raise ValueError(f"future_target: expected shape (rows={b}, length <= {horizon}), got {tuple(target.shape)}")
        z = self._normalise(target, loc, scale)
        valid = ~torch.isnan(z) if target_mask is None else torch.as_tensor(target_mask, device=z.device).to(torch.bool)
        if valid.shape != target.shape:
            raise ValueError(f"future_target_mask: expected shape {tuple(target.shape)}, got {tuple(valid.shape)}")
        pad = horizon - target.shape[1]
        z = F.pad(torch.where(valid, z, torch.zeros_like(z)), (0, pad))
        weight = F.pad(valid.to(torch.float32), (0, pad)) * (1 - known)  # known future values are not scored
        levels = torch.tensor(self.quantiles, device=z.device).view(1, -1, 1)
        y = z.unsqueeze(1)
        pinball = 2 * torch.abs((y - normalised) * ((y <= normalised).float() - levels))
        return (pinball * weight.unsqueeze(1)).mean(-1).sum(-1).mean()

    # -- inference -------------------------------------------------------------------

    def _predict_step(self, context, group_ids, future, n_patches: int) -> torch.Tensor:
        steps = n_patches * self.output_patch_size
        if future.shape[-1] < steps:
            future = F.pad(future, (0, steps - future.shape[-1]), value=float("nan"))
        return self(context, group_ids, future[..., :steps], n_patches)["quantile_preds"]

    def _forecast_batch(self, context, group_ids, future, prediction_length: int, max_output_patches: int,
                        unrolled: list[float]) -> torch.Tensor:
        """(rows, Q, prediction_length) for one batch (see the module docstring for the rollout)."""
        p = self.output_patch_size
        patches = lambda remaining: min(math.ceil(remaining / p), max_output_patches)  # noqa: E731
        prediction = self._predict_step(context, group_ids, future, patches(prediction_length))
        pieces, remaining = [prediction], prediction_length - prediction.shape[-1]
        if remaining > 0:
            u = len(unrolled)
            levels = torch.tensor(self.quantiles)
            weights = torch.outer(_probability_mass(torch.tensor(unrolled)), _probability_mass(levels)).reshape(-1)
            context = context[:, None].expand(-1, u, -1)
            future = future[:, None].expand(-1, u, -1)
            # path j of every row joins the path-j copies of its group only
            group_ids = (group_ids[:, None] * u + torch.arange(u, device=group_ids.device)).reshape(-1)
            index = torch.tensor([self.quantiles.index(q) for q in unrolled], device=context.device)
        while remaining > 0:
            step = prediction.shape[-1]
            context = torch.cat([context, prediction[:, index]], dim=-1)[..., -self.context_length:]
            given = future[..., :step]  # known future values replace the predicted ones
            context = torch.cat([context[..., :-step], torch.where(torch.isnan(given), context[..., -step:], given)], -1)
            future = future[..., step:]
            b = context.shape[0]
            out = self._predict_step(context.reshape(b * u, -1), group_ids, future.reshape(b * u, -1),
                                     patches(remaining))
            samples = out.reshape(b, u * out.shape[1], -1).transpose(1, 2)  # (B, H, paths x levels)
            prediction = weighted_quantile(self.quantiles, weights, samples).transpose(1, 2)
            pieces.append(prediction)
            remaining -= prediction.shape[-1]
        return torch.cat(pieces, dim=-1)[..., :prediction_length]

    @torch.no_grad()
    def predict(self, inputs, prediction_length: int | None = None, *, batch_size: int = 256,
                context_length: int | None = None, cross_learning: bool = False, limit_prediction_length: bool = False,
                max_output_patches: int | None = None,
                unrolled_quantiles: Sequence[float] = UNROLLED_QUANTILES) -> list[torch.Tensor]:
        """Quantile forecasts, one (n_targets, Q, prediction_length) float32 CPU tensor per task.

        Args:
            inputs: chronos-forecasting's formats (:func:`.chronos2_convert.prepare_inputs`): a
                (tasks, variates, T) tensor/array, a list of (T,) / (variates, T) series, or a list
                of dicts with ``target``, ``past_covariates``, ``future_covariates``; also a (T,)
                series or a (B, T) batch of univariate series.
            prediction_length: horizon (default: one pass, ``max_output_patches * P``); longer ones
                roll out (a warning, or an error with ``limit_prediction_length``).
            batch_size: rows (targets and covariates) per model call; tasks are never split.
            context_length: context values used (at most the model's).
            cross_learning: every task of a batch in one group (results then depend on ``batch_size``).
            max_output_patches, unrolled_quantiles: rollout settings (upstream's defaults).
        """
        from .chronos2_convert import batch_tasks, prepare_inputs

        model_horizon = self.prediction_length
        horizon = model_horizon if prediction_length is None else int(prediction_length)
        if horizon < 1:
            raise ValueError(f"prediction_length={prediction_length}: expected a positive integer")
        if horizon > model_horizon:
            message = (f"prediction_length={horizon} exceeds the {model_horizon} steps this model forecasts in one "
                       "pass; rolling out, which may degrade quality")
            if limit_prediction_length:
                raise ValueError(message + " (limit_prediction_length=True)")
            warnings.warn(message, stacklevel=2)
        if not set(map(float, unrolled_quantiles)) <= set(self.quantiles):
            raise ValueError(f"unrolled_quantiles={list(unrolled_quantiles)} must be among the model's quantiles "
                             f"{self.quantiles}")
        context_length = self.context_length if context_length is None else int(context_length)
        if context_length > self.context_length:
            warnings.warn(f"context_length={context_length} exceeds the model's {self.context_length}; using "
                          f"{self.context_length}", stacklevel=2)
            context_length = self.context_length
        max_patches = self.max_output_patches if max_output_patches is None else int(max_output_patches)
        unrolled = [float(q) for q in unrolled_quantiles]
        tasks = prepare_inputs(inputs, horizon)
        was_training = self.training
        self.eval()
        out: list[torch.Tensor] = []
        try:
            for context, group_ids, future, ranges in batch_tasks(tasks, batch_size, context_length):
                if cross_learning:
                    group_ids = torch.zeros_like(group_ids)
                forecast = self._forecast_batch(context.to(self.device), group_ids.to(self.device),
                                                future.to(self.device), horizon, max_patches, unrolled)
                forecast = forecast.to(device="cpu", dtype=torch.float32)
                out.extend(forecast[start:end] for start, end in ranges)
        finally:
            self.train(was_training)
        return out

    @torch.no_grad()
    def predict_quantiles(self, inputs, prediction_length: int | None = None,
                          quantile_levels: Sequence[float] = DEFAULT_QUANTILES, **predict_kwargs):
        """``(quantiles, mean)`` as ``Chronos2Pipeline.predict_quantiles``: per task, quantiles
        (n_targets, H, len(quantile_levels)) and the median as mean (n_targets, H). Levels between
        the model's are interpolated linearly; levels outside them get the extreme prediction,
        with a warning. Keywords as :meth:`predict`."""
        levels = [float(q) for q in quantile_levels]
        if not levels or any(not 0.0 <= q <= 1.0 for q in levels):
            raise ValueError(f"quantile_levels={list(quantile_levels)}: expected levels in [0, 1]")
        if 0.5 not in self.quantiles:
            raise ValueError(f"the model's quantiles {self.quantiles} lack 0.5, the median returned as the mean")
        own = self.quantiles
        if not set(levels) <= set(own) and (min(levels) < min(own) or max(levels) > max(own)):
            warnings.warn(f"quantile_levels {levels} reach outside the levels this model predicts ({own[0]} to "
                          f"{own[-1]}); levels beyond them get its lowest/highest prediction", stacklevel=2)
        quantiles, means = [], []
        for forecast in self.predict(inputs, prediction_length, **predict_kwargs):
            forecast = forecast.transpose(-1, -2)  # (n_targets, H, Q)
            if set(levels) <= set(own):
                quantiles.append(forecast[..., [own.index(q) for q in levels]])
            else:
                quantiles.append(interpolate_quantiles(levels, torch.tensor(own), forecast))
            means.append(forecast[..., own.index(0.5)])
        return quantiles, means

    @torch.no_grad()
    def predict_df(self, df, future_df=None, *, id_column: str = "item_id", timestamp_column: str = "timestamp",
                   target: str | Sequence[str] = "target", prediction_length: int | None = None,
                   quantile_levels: Sequence[float] = DEFAULT_QUANTILES, freq: str | None = None,
                   validate_inputs: bool = True, **predict_kwargs):
        """Forecasts of a long-format DataFrame, as ``Chronos2Pipeline.predict_df``.

        ``df`` holds ``id_column``, ``timestamp_column``, the ``target`` column(s) and covariates
        (past-only, unless ``future_df`` holds their future values: ``prediction_length`` rows per
        item at the next timestamps). Returns one row per item, target and step with columns
        ``id_column``, ``timestamp_column``, ``target_name``, ``predictions`` (the median) and one per
        quantile level (named ``str(level)``). Keywords as :meth:`predict`.
        """
        from .chronos2_convert import forecast_frame, prepare_data_frame

        horizon = self.prediction_length if prediction_length is None else int(prediction_length)
        targets = [target] if isinstance(target, str) else list(target)
        tasks, future_index = prepare_data_frame(df, future_df, id_column=id_column, timestamp_column=timestamp_column,
                                                 targets=targets, prediction_length=horizon, freq=freq,
                                                 validate=validate_inputs)
        quantiles, means = self.predict_quantiles(tasks, horizon, quantile_levels, **predict_kwargs)
        return forecast_frame(future_index, targets, quantiles, means, quantile_levels, horizon)

    @torch.no_grad()
    def embed(self, inputs, *, batch_size: int = 256, context_length: int | None = None):
        """Encoder states per task (n_targets, patches + 2, d_model) (context patches, [REG], one
        future token) and ``(loc, scale)`` per task (each (n_targets, 1)), as ``Chronos2Pipeline.embed``.
        Only chronos-forecasting's tensor inputs are taken (no covariates)."""
        from .chronos2_convert import batch_tasks, prepare_inputs

        context_length = min(self.context_length, context_length or self.context_length)
        embeddings, loc_scales = [], []
        was_training = self.training
        self.eval()
        try:
            for context, group_ids, _, ranges in batch_tasks(prepare_inputs(inputs, 0), batch_size, context_length):
                embeds, observed, (loc, scale), _ = self.tokens(context.to(self.device))
                states = self.encode(embeds, observed, group_ids.to(self.device)).cpu()
                embeddings.extend(states[a:b] for a, b in ranges)
                loc_scales.extend((loc[a:b].cpu(), scale[a:b].cpu()) for a, b in ranges)
        finally:
            self.train(was_training)
        return embeddings, loc_scales

    def extra_repr(self) -> str:
        return (f"context_length={self.context_length}, patch={self.input_patch_size}, "
                f"max_output_patches={self.max_output_patches}, quantiles={len(self.quantiles)}, "
                f"reg_token={self.use_reg_token}, arcsinh={self.use_arcsinh}")


def _even_levels(n: int) -> list[float]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_outputs={n!r}: expected the number of quantile levels (a positive integer)")
    return [round((i + 1) / (n + 1), 6) for i in range(n)]


# --------------------------------------------------------------------------- registered variants

from domainfm.zoo import WeightSource, register_model  # noqa: E402

from .chronos2_convert import convert_chronos2, load_chronos2  # noqa: E402,F401

CHRONOS2_PAPER = "https://arxiv.org/abs/2510.15821"

#: amazon/chronos-2 (120M): the sizes several independent ports read from its config.json; they
#: give 119,477,664 parameters (the model card's 120M). Not read from config.json here; loading a
#: repository builds whatever its config.json says.
CHRONOS2_CONFIG = dict(d_model=768, d_kv=64, d_ff=3072, num_heads=12, num_layers=12, context_length=8192,
                       input_patch_size=16, input_patch_stride=16, output_patch_size=16, max_output_patches=64,
                       quantiles=list(CHRONOS2_QUANTILES), use_reg_token=True, use_arcsinh=True,
                       time_encoding_scale=8192, dropout=0.1, layer_norm_eps=1e-6, dense_act_fn="relu",
                       rope_theta=10000.0, initializer_factor=0.05)
#: autogluon/chronos-2-small (28M, model card): NOT confirmed. d_model 512 (a third-party note), T5
#: small's other sizes, and 13 levels (its 112 MB file fits 27.9M parameters, i.e. 13 levels, and a
#: third party reads its median at index 6). Loading the repository adopts its real config.json.
CHRONOS2_SMALL_CONFIG = {**CHRONOS2_CONFIG, "d_model": 512, "d_ff": 2048, "num_heads": 8, "num_layers": 6,
                         "quantiles": [0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]}
#: Hub commits the weight sources pin: the chronos-2-small one is the commit page's own hash on
#: huggingface.co (its README update after the weights were added); none confirmed for chronos-2
CHRONOS2_REVISIONS = {"autogluon/chronos-2-small": "ddec01313e50b6bc58ebaa92ede81bc24a3d9f9a"}
_DATA = ("the Hub pages' datasets autogluon/chronos_datasets (Chronos's real training corpora) and "
         "Salesforce/GiftEvalPretrain, with synthetic univariate and multivariate series (technical report, "
         "arXiv:2510.15821); which splits and the exact mixture are not confirmed here")


def _source(repo: str, size: str) -> WeightSource:
    revision = CHRONOS2_REVISIONS.get(repo)
    return WeightSource(
        f"hf://{repo}", sha256=None, converter="official", license="Apache-2.0", revision=revision,
        description=f"Chronos-2 ({size}) pretrained by Amazon",
        note=("no sha256 confirmed offline: the Hub's published digest + the lock file; "
              + (f"revision {revision} from the repository's commit page" if revision else
                 "unpinned (no commit confirmed from the package or its docs)")
              + "; overlaps with public benchmarks not confirmed (the Chronos corpora hold Chronos's Benchmark I "
                "training splits; GiftEvalPretrain is built to exclude GIFT-Eval's test data)"),
        pretraining_data=_DATA)


def _build(**kwargs) -> Chronos2:
    return Chronos2(**kwargs)


def _register(name: str, config: dict, *, description: str, weights=(), tags=()) -> None:
    register_model(
        name, family="wavetoken", paper=CHRONOS2_PAPER, license="Apache-2.0", description=description,
        input_spec={"n_times": config["context_length"], "input_patch_size": config["input_patch_size"],
                    "max_output_patches": config["max_output_patches"], "quantiles": list(config["quantiles"]),
                    "inputs": "rows of a task: targets, past-only and known-future covariates"},
        defaults=config, weights=list(weights), converters={"official": convert_chronos2}, head="quantile_head",
        tags=tags, example_input=_example(config["context_length"]),
    )(_build)


_register("chronos-2", CHRONOS2_CONFIG, weights=[_source("amazon/chronos-2", "120M")],
          description="Chronos-2 (120M): encoder over patches with attention across a task's series and "
                      "covariates, 21 quantiles x 16 steps per future token. Weights: hf://amazon/chronos-2")
_register("chronos-2-small", CHRONOS2_SMALL_CONFIG, weights=[_source("autogluon/chronos-2-small", "small, 28M")],
          description="Chronos-2-Small (28M; sizes unconfirmed until loaded, see CHRONOS2_SMALL_CONFIG). "
                      "Weights: hf://autogluon/chronos-2-small")
_register("chronos-2-test", {**CHRONOS2_CONFIG, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 2,
                             "context_length": 256, "time_encoding_scale": 256, "max_output_patches": 4,
                             "dropout": 0.0, "initializer_factor": 1.0},
          description="Chronos-2 at test size (random weights)", tags=("test",))
