"""Fast kernels for CBraMod's criss-cross layer: short-sequence attention, fused CPU linears, dropout.

CBraMod attends over very short sequences (19 channels, 30 patches; head dim 25), where the
flash-attention CPU kernel behind :func:`torch.nn.functional.scaled_dot_product_attention` spends
most of its time on per-block bookkeeping. On CPU, :func:`attention` therefore takes one of two
batched-matmul paths for sequences up to ``SHORT_SEQUENCE`` tokens (:func:`attention_path`):

- ``"short"`` (half precision, or training with attention dropout): one head-split copy, two
  batched matmuls over all ``sequences x heads`` around an fp32 softmax (about 2x the flash
  kernel in bf16 at L = 19/30);
- ``"packed"`` (fp32 inference): ``torch._transform_bias_rescale_qkv`` (the kernel of
  ``nn.MultiheadAttention``'s inference fast path, which the official model takes in fp32) adds
  the in-projection bias, scales q and splits heads in one pass, then the same matmuls. It has no
  backward, so it is used only without gradients.

Long sequences and GPUs keep :func:`scaled_dot_product_attention`.

The linear layers go through oneDNN's ``mkldnn::_linear_pointwise`` when no gradient is needed
on CPU (inference): it is 25-40% faster than the BLAS ``addmm`` for these shapes in fp32, fuses
the bias (and in fp32 the exact erf GELU of the feed-forward block) into the matmul, and can add
the residual in the same pass; under bf16 autocast it runs on bf16 weight copies kept across
calls, with the GELU as a separate pass (cheaper there than oneDNN's erf post-op).
The op has no autograd formula, so any grad-enabled call, any module that is not a plain
``nn.Linear`` (LoRA, quantised wrappers) and any non-CPU tensor take the ordinary ``module(x)``
path. In training, dropout multiplies by exact 0/1 masks in the activation dtype
(:func:`keep_multiplier`, 16 random bits per element from numpy's SFC64 seeded by torch's
generator): CPU ``bernoulli_`` and ``torch.where`` on bool masks were a quarter of the step.

All paths compute the official function: fp32 outputs equal the official restatement to 1e-5
(values and gradients, tests/models/test_cbramod_speed.py). Documented bf16 tolerance: under bf16
autocast, the features' error against the fp32 official output is at most 1.5x the official
model's own bf16 error (+0.02 max, +1e-3 mean), since the roundings sit in slightly different
places (fused bias/GELU/residual, fp32 softmax of bf16 scores, the fp32 positional convolution
in training).
"""
from __future__ import annotations

import functools

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from domainfm.precision import active_autocast_dtype

__all__ = ["SHORT_SEQUENCE", "use_short_attention", "attention_path", "attention", "projection_without_bias", "linear", "dropout", "keep_mask", "keep_multiplier"]

#: longest sequence for which :func:`attention` uses batched matmuls instead of SDPA on CPU
#: (measured crossover with head dim 25: between 128 and 256 tokens in bf16)
SHORT_SEQUENCE = 128

_LINEAR_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_HAS_ONEDNN_LINEAR = bool(torch.backends.mkldnn.is_available()) and _LINEAR_POINTWISE is not None
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def use_short_attention(length: int, dtype: torch.dtype, device: torch.device, dropout_p: float = 0.0) -> bool:
    """Whether :func:`attention` takes the batched-matmul path for sequences of ``length``
    tokens held in ``dtype`` on ``device``: on CPU for ``length <= SHORT_SEQUENCE`` in half
    precision, or in training with attention dropout (whose mask then comes from
    :func:`keep_multiplier` instead of ``bernoulli_``)."""
    return device.type == "cpu" and length <= SHORT_SEQUENCE and (
        dtype in (torch.bfloat16, torch.float16) or dropout_p > 0.0)


def _random_int16(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` independent uniform int16 values (16 random bits each) on ``device``.

    On CPU the bits come from numpy's SFC64 generator (``random_raw``, four 16-bit slots per
    64-bit output), seeded by one draw from torch's default generator, so ``torch.manual_seed``
    makes them reproducible. It is 2.5x faster than ``torch.randint`` over the full int64 range
    (and torch's ``random_()`` on int64 leaves the top bit zero); CPU ``bernoulli_`` draws one
    Mersenne-Twister number per element. Elsewhere, ``torch.randint`` on the device.
    """
    device = torch.device(device)
    words = (n + 3) // 4
    if device.type == "cpu":
        seed = int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64).item())
        raw = np.random.SFC64(seed).random_raw(words)
        return torch.from_numpy(raw.view(np.int16)[:n])
    bits = torch.randint(-2 ** 63, 2 ** 63 - 1, (words,), dtype=torch.int64, device=device)
    return bits.view(torch.int16)[:n]


def _drop_rule(p: float) -> tuple[int, float]:
    """Of the 65536 values of a 16-bit slot, how many mean "drop" (``round(p * 2**16)``), and
    the scale ``1 / (1 - p')`` that makes dropout with that rate unbiased."""
    dropped = round(p * 65536)
    return dropped, 65536.0 / (65536 - dropped)


def keep_mask(shape, p: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """A bool mask of ``shape`` keeping each element with probability ``1 - p``, and the scale
    ``1 / P(keep)`` that makes dropout unbiased.

    Each element uses 16 random bits (:func:`_random_int16`): the drop probability is
    ``round(p * 2**16) / 2**16`` (within 2**-17 of ``p``) and the returned scale is exactly its
    ``1 / (1 - p')``. The same draw as :func:`keep_multiplier` under the same seed.
    """
    dropped, scale = _drop_rule(p)
    keep = _random_int16(math.prod(shape), device).view(shape) >= dropped - 32768
    return keep, scale


#: bit patterns of 1.0 in the 2-byte floating types (a 0/1 int16 times this, viewed as the type)
_ONE_BITS = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}


def keep_multiplier(shape, p: float, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """:func:`keep_mask` as exact 0.0 / 1.0 values of ``dtype`` (the same draw), and the scale.

    Multiplying by it is a plain vectorised ``mul`` in forward and backward, where a bool mask
    goes through ``torch.where`` (3x slower on CPU in bf16). It is built with int16 arithmetic
    (clamp the 16-bit draw to ``[t - 1, t]`` and subtract ``t - 1``: 0 or 1, no overflow), and
    for 2-byte float types by writing 1.0's bit pattern instead of converting.
    """
    dropped, scale = _drop_rule(p)
    if dropped == 0:
        return torch.ones(shape, dtype=dtype, device=device), scale
    threshold = dropped - 32768
    # in place on the fresh random buffer: no second allocation of n int16
    keep = _random_int16(math.prod(shape), device).clamp_(threshold - 1, threshold).sub_(threshold - 1)  # 0 / 1
    if dtype in _ONE_BITS:
        return keep.mul_(_ONE_BITS[dtype]).view(dtype).view(shape), scale
    return keep.to(dtype).view(shape), scale


def dropout(x: torch.Tensor, p: float, training: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] F.dropout(x, p, training)``, with :func:`keep_multiplier` on CPU (3-4x
    faster than ``bernoulli_`` + ``where``; the residual add fused into the same pass).
    Elsewhere, ``F.dropout``. Kept values are ``x * 1/(1-p)`` rounded once, as in
    ``torch.native_dropout``."""
    if not training or p == 0.0:
        return x if residual is None else residual + x
    if x.device.type != "cpu" or not 0.0 < p < 1.0:
        out = F.dropout(x, p, training=True)
        return out if residual is None else residual + out
    keep, scale = keep_multiplier(x.shape, p, x.dtype, x.device)
    if residual is None:
        return (x * keep).mul_(scale)
    return torch.addcmul(residual, x, keep, value=scale)


_TRANSFORM_QKV = getattr(torch, "_transform_bias_rescale_qkv", None)


def attention_path(length: int, dtype: torch.dtype, device: torch.device, dropout_p: float = 0.0) -> str:
    """The path :func:`attention` takes by default:

    - ``"short"`` when :func:`use_short_attention` says so (CPU, half precision or dropout);
    - ``"packed"`` for fp32 on CPU with no gradient and at most ``SHORT_SEQUENCE`` tokens:
      ``torch._transform_bias_rescale_qkv`` (the kernel behind ``nn.MultiheadAttention``'s
      inference fast path: bias, 1/sqrt(d) scaling of q and the head split in one pass) + two
      batched matmuls + softmax. At L = 19 / 30 it made the whole fp32 forward 12% faster than
      the flash kernel (torch 2.14, 2 threads); the op has no backward, hence no-grad only;
    - ``"sdpa"`` otherwise.
    """
    if use_short_attention(length, dtype, device, dropout_p):
        return "short"
    if (device.type == "cpu" and length <= SHORT_SEQUENCE and dtype == torch.float32 and dropout_p == 0.0
            and not torch.is_grad_enabled() and _TRANSFORM_QKV is not None):
        return "packed"
    return "sdpa"


def attention(qkv: torch.Tensor, n_heads: int, dropout_p: float = 0.0, path: str | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head self-attention from packed projections.

    Args:
        qkv: ``(S, L, 3 * dim)`` (q, k, v blocks of ``dim`` features, each ``n_heads`` heads of
            ``dim / n_heads``; the layout of ``nn.MultiheadAttention``'s fused ``in_proj``).
        n_heads: heads per block.
        dropout_p: dropout on the attention probabilities (pass 0 in eval mode).
        path: ``"short"`` (batched matmuls + softmax), ``"packed"`` (the same after the fused
            bias / scale / head-split kernel; no gradient), ``"sdpa"``, or None to choose by
            :func:`attention_path`.
        bias: ``(3 * dim,)`` in-projection bias not yet added to ``qkv`` (the ``"packed"`` path
            adds it in its first pass); None when ``qkv`` already includes it.

    **Shapes:** ``(S, L, 3 * dim) -> (S, L, dim)``.
    """
    s, length, width = qkv.shape
    dim = width // 3
    head_dim = dim // n_heads
    if path is None:
        path = attention_path(length, qkv.dtype, qkv.device, dropout_p)
    if path == "packed":
        if torch.is_grad_enabled() and qkv.requires_grad:
            raise RuntimeError("attention path 'packed' has no backward; use 'short' or 'sdpa' with gradients")
        if bias is None:
            bias = qkv.new_zeros(width)
        q, k, v = _TRANSFORM_QKV(qkv.contiguous(), bias.to(qkv.dtype), n_heads)  # (S, H, L, Dh), q scaled
        scores = torch.bmm(q.view(-1, length, head_dim), k.view(-1, length, head_dim).transpose(1, 2))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v.view(-1, length, head_dim)).view(s, n_heads, length, head_dim)
        return out.transpose(1, 2).reshape(s, length, dim)
    if bias is not None:
        qkv = qkv + bias
    heads = qkv.view(s, length, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)  # (3, S, H, L, Dh)
    if path == "sdpa":
        out = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], dropout_p=dropout_p)
    elif path == "short":
        q, k, v = heads.reshape(3, s * n_heads, length, head_dim).unbind(0)
        scores = torch.baddbmm(q.new_empty(s * n_heads, length, length), q, k.transpose(1, 2),
                               beta=0.0, alpha=head_dim ** -0.5)
        # softmax in at least fp32 whatever the matmul dtype (as the flash kernel accumulates); it
        # is also the fast kernel: for rows of 19-30 scores torch's bf16 softmax is 2-4x slower
        # forward and 10x slower backward than fp32's plus the cast (torch 2.14, CPU)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
        if dropout_p > 0.0:
            probs = dropout(probs, dropout_p, training=True)
        out = torch.bmm(probs, v).view(s, n_heads, length, head_dim)
    else:
        raise ValueError(f"path={path!r}: expected 'short', 'packed', 'sdpa' or None")
    return out.transpose(1, 2).reshape(s, length, dim)


def projection_without_bias(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(module(x) - bias, bias)`` for a plain ``nn.Linear`` on the oneDNN inference path (the
    bias left for :func:`attention`'s ``"packed"`` path to add), else ``(module(x), None)``."""
    operands = _onednn_operands(module, x)
    if operands is None:
        return module(x), None
    xx, w, b = operands
    return _LINEAR_POINTWISE(xx, w, None, "none", [], ""), b


def _bf16_weights(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 copies of a Linear's weight and bias for autocast inference, kept across calls.

    Autocast casts them again on every forward; the copy is reused while the parameters are the
    same tensors at the same version (any in-place update, ``load_state_dict`` included, bumps
    ``_version``; ``.to()`` / re-assignment changes the tensor), and rebuilt otherwise.
    """
    w, b = module.weight, module.bias
    key = (w.data_ptr(), w._version, b.data_ptr(), b._version)
    cached = module.__dict__.get("_fast_bf16")
    # the cache holds the parameter objects themselves, so `is` cannot be fooled by a reused id
    if cached is None or cached[0] is not w or cached[1] is not b or cached[2] != key:
        cached = (w, b, key, w.detach().to(torch.bfloat16), b.detach().to(torch.bfloat16))
        module.__dict__["_fast_bf16"] = cached
    return cached[3], cached[4]


@functools.lru_cache(maxsize=None)
def onednn_bf16_linear_works() -> bool:
    """Whether oneDNN can build a bf16 inner-product primitive here. It cannot without
    AVX-512-BF16/AMX (or with ``ONEDNN_MAX_CPU_ISA`` capped below them), where the call raises
    instead of computing slowly; asked once per process by making the real call on a tiny input."""
    if not _HAS_ONEDNN_LINEAR:
        return False
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            _LINEAR_POINTWISE(x, torch.ones(4, 8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16),
                              "none", [], "")
    except RuntimeError:
        return False
    return True


def _onednn_operands(module: nn.Module, x: torch.Tensor):
    """(x, weight, bias) in the dtype the oneDNN linear should run in, or None for the plain path."""
    if not _HAS_ONEDNN_LINEAR or type(module) is not nn.Linear or module.bias is None:
        return None
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    w, b = module.weight, module.bias
    dtype = active_autocast_dtype("cpu")
    if dtype is not None:
        if dtype != torch.bfloat16 or not onednn_bf16_linear_works():
            return None
        return x.to(dtype), *_bf16_weights(module)
    if x.dtype not in _ONEDNN_DTYPES or w.dtype != x.dtype or b.dtype != x.dtype:
        return None
    if x.dtype == torch.bfloat16 and not onednn_bf16_linear_works():
        return None
    return x, w, b


def linear(module: nn.Module, x: torch.Tensor, activation: str | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``module(x)``, then exact GELU if ``activation == "gelu"``, then ``+ residual``.

    With no gradient on CPU and a plain ``nn.Linear``, one oneDNN call does it all (the residual
    is fused only when it has the output's dtype, i.e. not under autocast, where the residual
    stream stays fp32 as in the official model). Otherwise the ordinary modules run.
    """
    if activation not in (None, "gelu"):
        raise ValueError(f"activation={activation!r}: expected None or 'gelu'")
    operands = _onednn_operands(module, x)
    if operands is not None:
        xx, w, b = operands
        if residual is not None and activation is None and residual.dtype == xx.dtype \
                and residual.shape == (*xx.shape[:-1], w.shape[0]):
            return torch.ops.mkldnn._linear_pointwise.binary(xx, residual, w, b, "add")
        if activation and xx.dtype == torch.bfloat16:
            # bf16: oneDNN's erf-GELU post-op costs more (+28% of the matmul on one core) than a
            # separate GELU pass over the bf16 output, which is also what autocast computes
            y = F.gelu(_LINEAR_POINTWISE(xx, w, b, "none", [], ""))
        else:
            y = _LINEAR_POINTWISE(xx, w, b, "gelu" if activation else "none", [], "none" if activation else "")
    else:
        y = module(x)
        if activation == "gelu":
            y = F.gelu(y)
    return y if residual is None else residual + y
