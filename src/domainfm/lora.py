"""Adapters: LoRA, DoRA and RepLoRA, injected by name patterns; unfreeze; exact merge/unmerge;
adapter-only save/load in PEFT's file format.

One small wrapper (:class:`LoraLayer`) sits next to the base layer; no model class is copied.

>>> from domainfm import lora
>>> lora.apply(model, ["blocks.*.attn.qkv@q,v"], rank=8, alpha=16, unfreeze=["*norm*"])  # doctest: +SKIP
>>> print(lora.trainable_summary(model))                                               # doctest: +SKIP
>>> lora.save_adapter(model, "run/adapter", base_model_name="dinov2-vitl14")           # doctest: +SKIP
>>> lora.load_adapter(fresh_model, "run/adapter")                                      # doctest: +SKIP
>>> lora.merge(model)   # fold adapters into the base weights, exact to ~1e-6          # doctest: +SKIP
>>> lora.unmerge(model) # bit-identical base weights again                             # doctest: +SKIP

Equations (per adapted weight :math:`W \\in \\mathbb{R}^{d_{out} \\times d_{in}}`; for a convolution
:math:`d_{in}` is ``in_channels * prod(kernel_size)``):

* LoRA (Hu et al., 2021): :math:`y = W x + b + s\\,B A\\,\\mathrm{drop}(x)`, :math:`A \\in
  \\mathbb{R}^{r \\times d_{in}}` (Kaiming-uniform, :math:`a=\\sqrt5`), :math:`B \\in \\mathbb{R}^{d_{out}
  \\times r}` (zeros), :math:`s = \\alpha / r` or :math:`\\alpha/\\sqrt{r}` (rsLoRA, Kalajdzievski 2023).
* DoRA (Liu et al., 2024, arXiv:2402.09353): :math:`W' = m \\odot (W + s B A) / \\lVert W + s B A
  \\rVert_{row}`, the norm taken per output row over every input dimension; :math:`m` is initialised to
  :math:`\\lVert W \\rVert_{row}`. As in PEFT (and the paper, Sec. 4.3) the norm is treated as a constant:
  it is detached from the autograd graph, which saves memory; :math:`m` and :math:`B, A` still train.
* RepLoRA (Truong et al., ICML 2025, arXiv:2502.03044): :math:`A = g_A(A_0)`, :math:`B = g_B(B_0)`
  with small trainable MLPs :math:`g`; after training they collapse to plain :math:`A, B`
  (see :class:`LoraLayer` for the exact form used here and what it is based on).

Fused projections: ``"blocks.*.attn.qkv@q,v"`` splits the output rows of a fused ``qkv`` layer
into three equal chunks ``q, k, v`` and adapts only the chosen chunks, each with its own
:math:`A_c \\in \\mathbb{R}^{r \\times d_{in}}`, :math:`B_c \\in \\mathbb{R}^{d_{out}/3 \\times r}`
(ExPLoRA: rank 64 on q and v of timm's fused qkv). Rows of unselected chunks are never touched.

Key names (``adapter_state_dict`` / ``adapter_model.safetensors``), with ``P = base_model.model.<module>``:

* ``P.lora_A.weight``: LoRA/DoRA down factor, ``(r, in)`` or ``(r, in, *kernel)``.
* ``P.lora_B.weight``: LoRA/DoRA up factor, ``(out, r)`` or ``(out, r, 1, ...)`` (PEFT's shapes).
* ``P.lora_magnitude_vector``: DoRA magnitude, ``(out,)``; conv ``(1, out, 1, ...)`` as in PEFT.
* ``P.<chunk>.lora_A.weight`` etc.: the same per chunk of a fused slice (``chunk`` in q, k, v).
* ``P.replora_A.weight`` / ``P.replora_B.weight``: RepLoRA's underlying :math:`A_0`
  ``(r, in[, *kernel])`` and :math:`B_0` ``(out_chunk, r)``, shared by the chunks of one layer.
* ``P[.<chunk>].replora_mlp_A.fc{1,2}.{weight,bias}``, ``P[.<chunk>].replora_mlp_B...``: RepLoRA's
  MLPs :math:`g_A, g_B`. RepLoRA files hold these training-time parameters, not collapsed factors,
  so training can resume; :func:`merge` gives the collapsed form for inference.
* ``base_model.model.<param>``: a full parameter made trainable by ``unfreeze`` (base-model name).

Conventions: :func:`merge` is never implicit (not on ``eval()``); merging a merged model and
unmerging an unmerged one raise ``RuntimeError``; NaN/inf deltas raise ``FloatingPointError``.
"""
from __future__ import annotations

import ctypes
import fnmatch
import hashlib
import json
import math
import os
import tempfile
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "CHUNK_NAMES",
    "HASH_SCHEME",
    "KEY_PREFIX",
    "PRESETS",
    "VARIANTS",
    "LoraLayer",
    "TrainableSummary",
    "adapter_state_dict",
    "apply",
    "base_model_sha256",
    "count_trainable",
    "load_adapter",
    "merge",
    "save_adapter",
    "trainable_summary",
    "unmerge",
]

VARIANTS = ("lora", "dora", "replora")
#: names of the equal output chunks of a fused projection, selected with ``"<pattern>@q,v"``
CHUNK_NAMES = ("q", "k", "v")
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
KEY_PREFIX = "base_model.model."
HASH_SCHEME = (
    "domainfm-v1: sha256 over the frozen parameters of the base model (adapter tensors and parameters "
    "matched by `unfreeze` excluded; buffers excluded), sorted by name; for each: name, NUL, dtype, NUL, "
    "shape, NUL, raw little-endian bytes. Wrapped layers are hashed under their original names with "
    "their unmerged weights."
)

_CONFIG_ATTR = "_domainfm_lora_config"
_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d)
_DEFAULTS: dict[str, Any] = {
    "targets": None,
    "rank": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "variant": "lora",
    "use_rslora": False,
    "unfreeze": (),
    "base_model_name": None,
    "replora_hidden": 64,
}


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


# ----------------------------------------------------------------------------------------------
# the wrapper
# ----------------------------------------------------------------------------------------------


class _Factor(nn.Module):
    """Holds one factor as ``.weight`` so keys read ``lora_A.weight`` as in PEFT."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


class _ReparamMLP(nn.Module):
    """Row-wise two-layer MLP :math:`g(X) = \\mathrm{fc2}(\\mathrm{GELU}(\\mathrm{fc1}(X)))`.

    **Shapes:** ``(n_rows, dim) -> (n_rows, dim)``.
    """

    def __init__(self, dim: int, hidden: int, *, zero_out: bool, dtype, device) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype, device=device)
        if zero_out:
            # g_B(.) == 0 at init, so a fresh RepLoRA adapter is an exact no-op, as LoRA's B = 0.
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if dtype is None:
            return self.fc2(F.gelu(self.fc1(x)))
        w1, b1 = self.fc1.weight.to(dtype), self.fc1.bias.to(dtype)
        w2, b2 = self.fc2.weight.to(dtype), self.fc2.bias.to(dtype)
        return F.linear(F.gelu(F.linear(x.to(dtype), w1, b1)), w2, b2)


class LoraLayer(nn.Module):
    """A frozen ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` plus a low-rank adapter beside it.

    Made by :func:`apply`; rarely built by hand. The original layer is ``self.base_layer``
    (PEFT's name), so the model's own state-dict keys become ``<module>.base_layer.weight``.

    Args:
        base_layer: the layer to adapt (groups must be 1 for convolutions).
        rank: :math:`r \\ge 1`.
        alpha: scale numerator; :math:`s = \\alpha/r`, or :math:`\\alpha/\\sqrt r` with ``use_rslora``.
        dropout: dropout probability on the adapter branch input only (default 0).
        variant: ``"lora"``, ``"dora"`` or ``"replora"``.
        use_rslora: rank-stabilised scaling.
        chunks: ``None`` adapts every output row; a tuple of names from :data:`CHUNK_NAMES`
            splits the output rows into three equal chunks and adapts only those named.
        replora_hidden: hidden width :math:`h` of RepLoRA's MLPs (default 64).

    RepLoRA, the form used here. The paper (Truong et al., ICML 2025) motivates RepLoRA by the MoE
    view of attention and by the prefix-tuning result that reparameterising *shared* underlying
    parameters through MLPs makes estimation sample-efficient; its practical method is "lightweight
    MLPs that reparameterise the LoRA matrices", removed after training. We could confirm that
    description (abstract), but not the exact equations (the method section was not reachable), so
    this form is our most defensible reading, not a verified copy:

    .. math::
        A_c = g_{A,c}(A_0), \\qquad B_c^\\top = g_{B,c}(B_0^\\top), \\qquad
        \\Delta W_c = s\\, B_c A_c,

    with :math:`A_0 \\in \\mathbb{R}^{r \\times d_{in}}` and :math:`B_0 \\in \\mathbb{R}^{d_{chunk}
    \\times r}` *shared by the chunks of one layer* (q and v of a fused qkv: the "shared structure"
    of the theory), and a separate row-wise two-layer GELU MLP :math:`g \\colon \\mathbb{R}^{d}
    \\to \\mathbb{R}^{h} \\to \\mathbb{R}^{d}` per chunk and factor (prefix-tuning style: each of the
    :math:`r` rows of :math:`A_0` / columns of :math:`B_0` goes through the MLP). Separate layers
    (e.g. distinct ``q_proj``/``v_proj``) do not share. :math:`g_B`'s output layer starts at zero, so
    a fresh adapter is an exact no-op; merge evaluates the MLPs once in fp32 and folds
    :math:`s B_c A_c` into :math:`W`, so inference costs nothing extra. RepLoRA trainable count per
    layer: :math:`r d_{in} + r d_{chunk} + \\sum_c [2 h d_{in} + h + d_{in} + 2 h d_{chunk} + h +
    d_{chunk}]` (LoRA: :math:`\\sum_c r (d_{in} + d_{chunk})`; DoRA adds :math:`d_{chunk}` per chunk).

    Dropout acts on the adapter branch input only, for every variant (PEFT's DoRA also feeds the
    dropped-out input to its :math:`(m/\\lVert\\cdot\\rVert - 1) W x` term; we do not). In eval
    mode both agree.

    **Shapes:** input and output as the base layer: Linear ``(*, in) -> (*, out)``; Conv1d
    ``(N, C_in, L) -> (N, C_out, L')``; Conv2d ``(N, C_in, H, W) -> (N, C_out, H', W')``
    (unbatched inputs work as for the base layer).
    """

    def __init__(
        self,
        base_layer: nn.Module,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        variant: str = "lora",
        use_rslora: bool = False,
        chunks: tuple[str, ...] | None = None,
        replora_hidden: int = 64,
    ) -> None:
        super().__init__()
        reason = _unsupported_reason(base_layer)
        if reason:
            raise ValueError(reason)
        _check_settings(rank=rank, alpha=alpha, dropout=dropout, variant=variant, replora_hidden=replora_hidden)
        self.base_layer = base_layer
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.variant = variant
        self.use_rslora = bool(use_rslora)
        self.scaling = self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.register_buffer("_merge_stash", None, persistent=False)

        weight = base_layer.weight
        self._n_spatial = weight.dim() - 2  # 0 for Linear
        self._out_dim = -(self._n_spatial + 1)  # channel axis of the output, counted from the end
        out_rows = weight.shape[0]
        if chunks is None:
            self.n_chunks, self.chunks = 1, (None,)
        else:
            chunks = tuple(chunks)
            if not chunks or len(set(chunks)) != len(chunks) or not set(chunks) <= set(CHUNK_NAMES):
                raise ValueError(f"chunk selector {chunks!r}: expected distinct names from {CHUNK_NAMES}")
            if out_rows % len(CHUNK_NAMES):
                raise ValueError(
                    f"cannot split {out_rows} output rows into {len(CHUNK_NAMES)} equal chunks "
                    f"{CHUNK_NAMES}; a fused-projection selector needs out_features divisible by 3"
                )
            self.n_chunks = len(CHUNK_NAMES)
            self.chunks = tuple(c for c in CHUNK_NAMES if c in chunks)
        self.chunk_out = out_rows // self.n_chunks
        fan_in = weight[0].numel()
        # Half-precision bases get fp32 adapters (as PEFT's autocast_adapter_dtype): tiny, and
        # updates of a zero-initialised B would otherwise underflow.
        dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        device = weight.device
        a_shape = (self.rank, *weight.shape[1:])
        b_shape = (self.chunk_out, self.rank, *([1] * self._n_spatial))

        if variant == "replora":
            self.replora_A = _Factor(_kaiming(a_shape, dtype, device))
            self.replora_B = _Factor(_kaiming((self.chunk_out, self.rank), dtype, device))
        for chunk in self.chunks:
            owner = self._new_owner(chunk)
            if variant == "replora":
                owner.replora_mlp_A = _ReparamMLP(fan_in, replora_hidden, zero_out=False, dtype=dtype, device=device)
                owner.replora_mlp_B = _ReparamMLP(
                    self.chunk_out, replora_hidden, zero_out=True, dtype=dtype, device=device
                )
            else:
                owner.lora_A = _Factor(_kaiming(a_shape, dtype, device))
                owner.lora_B = _Factor(torch.zeros(b_shape, dtype=dtype, device=device))
            if variant == "dora":
                with torch.no_grad():
                    rows = self._rows(weight.detach(), chunk).reshape(self.chunk_out, -1).float()
                    magnitude = rows.norm(p=2, dim=1).to(dtype)
                if self._n_spatial:
                    magnitude = magnitude.view(1, -1, *([1] * self._n_spatial))  # PEFT's conv shape
                owner.lora_magnitude_vector = nn.Parameter(magnitude)

    # -- structure ----------------------------------------------------------------------------

    def _new_owner(self, chunk: str | None) -> nn.Module:
        if chunk is None:
            return self
        owner = nn.Module()
        self.add_module(chunk, owner)
        return owner

    def _owner(self, chunk: str | None) -> nn.Module:
        return self if chunk is None else getattr(self, chunk)

    def _row_slice(self, chunk: str | None) -> slice:
        if chunk is None:
            return slice(None)
        i = CHUNK_NAMES.index(chunk)
        return slice(i * self.chunk_out, (i + 1) * self.chunk_out)

    def _rows(self, weight: torch.Tensor, chunk: str | None) -> torch.Tensor:
        return weight[self._row_slice(chunk)]

    def adapter_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The adapter's own parameters, names relative to this layer (``lora_A.weight``, ...)."""
        for name, p in self.named_parameters():
            if not name.startswith("base_layer."):
                yield name, p

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base_layer")
            if base is None or name == "base_layer":
                raise
            # in_features, out_features, kernel_size, ... of the base layer
            return getattr(base, name)

    # -- factors --------------------------------------------------------------------------------

    def _factors(self, chunk: str | None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``A`` shaped ``(r, in, *kernel)`` and ``B`` flat ``(out_chunk, r)`` for one chunk."""
        owner = self._owner(chunk)
        if self.variant == "replora":
            a0 = self.replora_A.weight
            a = owner.replora_mlp_A(a0.reshape(self.rank, -1), dtype).reshape(a0.shape)
            b = owner.replora_mlp_B(self.replora_B.weight.t(), dtype).t()
        else:
            a, b = owner.lora_A.weight, owner.lora_B.weight.reshape(self.chunk_out, self.rank)
            if dtype is not None:
                a, b = a.to(dtype), b.to(dtype)
        return a, b

    def delta_weight(self, chunk: str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:math:`s B A` for one chunk, shaped like those rows of the base weight."""
        a, b = self._factors(chunk, dtype)
        rows_shape = (self.chunk_out, *self.base_layer.weight.shape[1:])
        return (self.scaling * (b @ a.reshape(self.rank, -1))).reshape(rows_shape)

    # -- forward --------------------------------------------------------------------------------

    def _base_forward(self, x: torch.Tensor, with_bias: bool) -> torch.Tensor:
        base = self.base_layer
        bias = base.bias if with_bias else None
        if isinstance(base, nn.Linear):
            return F.linear(x, base.weight, bias)
        return base._conv_forward(x, base.weight, bias)

    def _branch(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if isinstance(base, nn.Linear):
            return F.linear(F.linear(x, a), b)
        # A is a convolution with the base layer's stride/padding/dilation; B is 1x1.
        hidden = base._conv_forward(x, a, None)
        conv = F.conv1d if self._n_spatial == 1 else F.conv2d
        return conv(hidden, b.reshape(self.chunk_out, self.rank, *([1] * self._n_spatial)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base_layer(x)
        dora = self.variant == "dora"
        y = self._base_forward(x, with_bias=not dora)
        x_branch = self.lora_dropout(x)
        pieces = list(y.split(self.chunk_out, dim=self._out_dim)) if self.n_chunks > 1 else [y]
        for chunk in self.chunks:
            idx = 0 if chunk is None else CHUNK_NAMES.index(chunk)
            a, b = self._factors(chunk)
            branch = self.scaling * self._branch(x_branch.to(a.dtype), a, b)
            if dora:
                rows = self._rows(self.base_layer.weight, chunk).reshape(self.chunk_out, -1)
                delta = self.scaling * (b @ a.reshape(self.rank, -1))
                # DoRA Sec. 4.3 / PEFT: the norm is a constant for autograd.
                norm = (rows.to(delta.dtype) + delta.detach()).norm(p=2, dim=1).detach()
                magnitude = self._owner(chunk).lora_magnitude_vector.reshape(-1)
                scale = (magnitude / norm).reshape(-1, *([1] * self._n_spatial))
                pieces[idx] = (scale * (pieces[idx].to(branch.dtype) + branch)).to(y.dtype)
            else:
                pieces[idx] = pieces[idx] + branch.to(y.dtype)
        y = torch.cat(pieces, dim=self._out_dim) if self.n_chunks > 1 else pieces[0]
        if dora and self.base_layer.bias is not None:
            y = y + self.base_layer.bias.reshape(-1, *([1] * self._n_spatial))
        return y

    # -- merge ----------------------------------------------------------------------------------

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapter into ``base_layer.weight`` (delta computed in fp32 or better).

        Raises ``RuntimeError`` if already merged, ``FloatingPointError`` on NaN/inf (the weight is
        then left untouched).
        """
        if self.merged:
            raise RuntimeError("adapter is already merged; call unmerge() first")
        weight = self.base_layer.weight
        compute = torch.promote_types(weight.dtype, torch.float32)
        new_rows = {}
        for chunk in self.chunks:
            rows = self._rows(weight, chunk).to(compute)
            merged = rows + self.delta_weight(chunk, compute)
            if self.variant == "dora":
                magnitude = self._owner(chunk).lora_magnitude_vector.to(compute).reshape(-1)
                norm = merged.reshape(self.chunk_out, -1).norm(p=2, dim=1)
                merged = merged * (magnitude / norm).reshape(-1, *([1] * (merged.dim() - 1)))
            if not torch.isfinite(merged).all():
                raise FloatingPointError(
                    f"merged weight of chunk {chunk or 'all'} contains NaN/inf; the adapter is "
                    "diverged or corrupt, the base weight was left untouched"
                )
            new_rows[chunk] = merged.to(weight.dtype)
        self._merge_stash = weight.detach().clone()
        for chunk, rows in new_rows.items():
            weight[self._row_slice(chunk)] = rows
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the base weight bit-exactly from the copy stashed by :meth:`merge`."""
        if not self.merged:
            raise RuntimeError("adapter is not merged")
        self.base_layer.weight.copy_(self._merge_stash)
        self._merge_stash = None
        self.merged = False

    def original_weight(self) -> torch.Tensor:
        """The base weight as it was before merging."""
        return self._merge_stash if self.merged else self.base_layer.weight

    def extra_repr(self) -> str:
        chunks = "" if self.chunks == (None,) else f", chunks={','.join(self.chunks)}"
        return (
            f"variant={self.variant}, rank={self.rank}, alpha={self.alpha:g}, scaling={self.scaling:g}"
            f"{chunks}, merged={self.merged}"
        )


def _kaiming(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    return t


def _unsupported_reason(module: nn.Module) -> str | None:
    kind = next((k for k in _SUPPORTED if isinstance(module, k)), None)
    if kind is None:
        return f"type {type(module).__name__} is not supported (nn.Linear, nn.Conv1d, nn.Conv2d)"
    if type(module).forward is not kind.forward:
        return (
            f"type {type(module).__name__} overrides {kind.__name__}.forward, so a weight delta "
            "would not be exact (only plain nn.Linear, nn.Conv1d, nn.Conv2d are supported)"
        )
    if kind is not nn.Linear and module.groups != 1:
        return f"grouped convolution (groups={module.groups}) is not supported"
    return None


# ----------------------------------------------------------------------------------------------
# model-level API
# ----------------------------------------------------------------------------------------------


def _explora(model: nn.Module) -> dict[str, Any]:
    """ExPLoRA (Khanna et al., 2024): LoRA r=64 on q, v of every block but the last; the last
    block, every norm and the cls/register tokens fully trainable."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        raise ValueError(f"preset 'explora' needs a ViT with a `blocks` container; {type(model).__name__} has none")
    n_blocks = len(list(blocks.children()))
    if n_blocks < 2:
        raise ValueError(f"preset 'explora' needs at least 2 blocks, model.blocks has {n_blocks}")
    last = n_blocks - 1
    unfreeze = [f"blocks.{last}.*", "*norm*", "cls_token"]
    if isinstance(getattr(model, "reg_token", None), nn.Parameter):
        unfreeze.append("reg_token")  # timm's register tokens
    return {
        "targets": [f"blocks.{i}.attn.qkv@q,v" for i in range(last)],
        "rank": 64,
        "alpha": 1.0,
        "dropout": 0.0,
        "variant": "lora",
        "unfreeze": unfreeze,
    }


#: name -> kwargs for :func:`apply`, or a callable ``model -> kwargs``; caller's kwargs win.
PRESETS: dict[str, Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]]] = {
    "explora": _explora,
}


def _check_settings(*, rank, alpha, dropout, variant, replora_hidden) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if isinstance(replora_hidden, bool) or not isinstance(replora_hidden, int) or replora_hidden < 1:
        raise ValueError(f"replora_hidden must be an integer >= 1, got {replora_hidden!r}")


def _as_patterns(value, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    patterns = list(value)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{what} must be non-empty strings (glob patterns), got {p!r}")
    return patterns


def _parse_target(pattern: str) -> tuple[str, tuple[str, ...] | None]:
    glob, at, selector = pattern.rpartition("@")
    if not at:
        return pattern, None
    chunks = tuple(c.strip() for c in selector.split(","))
    if not glob or not all(chunks) or len(set(chunks)) != len(chunks) or not set(chunks) <= set(CHUNK_NAMES):
        raise ValueError(
            f"target pattern {pattern!r}: the chunk selector after '@' must be distinct names "
            f"from {CHUNK_NAMES}, e.g. 'blocks.*.attn.qkv@q,v'"
        )
    return glob, tuple(c for c in CHUNK_NAMES if c in chunks)


def _wrappers(model: nn.Module) -> dict[str, LoraLayer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _base_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """``(name, parameter, original tensor)`` for every non-adapter parameter.

    Names are the base model's own: ``<module>.base_layer.weight`` reads ``<module>.weight``; the
    tensor is the unmerged weight where a wrapper is merged.
    """
    wrappers = _wrappers(model)
    adapter_ids = {id(p) for w in wrappers.values() for _, p in w.adapter_named_parameters()}
    for name, p in model.named_parameters():
        if id(p) in adapter_ids:
            continue
        tensor = p
        head, sep, tail = name.rpartition(".base_layer.")  # base layers have no children: innermost
        wrapper = wrappers.get(head) if sep else None
        if wrapper is not None:
            name = f"{head}.{tail}"
            if tail == "weight":
                tensor = wrapper.original_weight()
        yield name, p, tensor


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def apply(
    model: nn.Module,
    targets: str | Iterable[str] | None = None,
    *,
    rank: int = _UNSET,
    alpha: float = _UNSET,
    dropout: float = _UNSET,
    variant: str = _UNSET,
    use_rslora: bool = _UNSET,
    unfreeze: str | Iterable[str] = _UNSET,
    preset: str | Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]] | None = None,
    base_model_name: str | None = _UNSET,
    replora_hidden: int = _UNSET,
) -> nn.Module:
    """Wrap matching layers of ``model`` in place with adapters; freeze everything else.

    Args:
        model: any ``nn.Module``; modified in place and returned.
        targets: fnmatch-style globs on dotted module names (``"encoder.layers.*.linear1"``,
            ``"*attn.qkv"``); ``"<glob>@q,v"`` adapts only chunks q and v of a fused projection.
            Every pattern must match at least one module, and every match must be a plain
            ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d`` (groups=1).
        rank: :math:`r` (default 8).
        alpha: :math:`\\alpha` (default 16.0); scale :math:`\\alpha/r`.
        dropout: dropout on the adapter branch input (default 0.0).
        variant: ``"lora"`` (default), ``"dora"`` or ``"replora"``.
        use_rslora: scale :math:`\\alpha/\\sqrt r` instead (default False).
        unfreeze: globs on dotted *parameter* names made fully trainable (``"blocks.23.*"``,
            ``"*norm*"``, ``"cls_token"``); each must match a parameter (default none).
        preset: a name in :data:`PRESETS` (e.g. ``"explora"``), a kwargs mapping, or a callable
            ``model -> kwargs``; explicit keyword arguments override its values.
        base_model_name: recorded by :func:`save_adapter` as ``base_model_name_or_path``.
        replora_hidden: hidden width of RepLoRA's MLPs (default 64).

    Returns:
        ``model``, with only adapter and ``unfreeze`` parameters requiring grad.

    Raises:
        ValueError: a pattern matching nothing, an unsupported matched layer, bad settings, an
            unknown variant/preset, or a model that already has adapters (apply once, with every
            target).
    """
    settings = dict(_DEFAULTS)
    if preset is not None:
        if isinstance(preset, str):
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; available: {sorted(PRESETS)}")
            preset_name, preset = preset, PRESETS[preset]
        else:
            preset_name = getattr(preset, "__name__", "custom")
        values = preset(model) if callable(preset) else preset
        unknown = set(values) - set(settings)
        if unknown:
            raise ValueError(f"preset {preset_name!r} sets unknown options {sorted(unknown)}")
        settings.update(values)
        settings["preset"] = preset_name
    explicit = {
        "targets": targets, "rank": rank, "alpha": alpha, "dropout": dropout, "variant": variant,
        "use_rslora": use_rslora, "unfreeze": unfreeze, "base_model_name": base_model_name,
        "replora_hidden": replora_hidden,
    }
    settings.update({k: v for k, v in explicit.items() if v is not _UNSET and not (k == "targets" and v is None)})

    target_patterns = _as_patterns(settings["targets"], "targets")
    if not target_patterns:
        raise ValueError("no targets: pass target patterns (e.g. ['blocks.*.attn.qkv']) or a preset")
    unfreeze_patterns = _as_patterns(settings["unfreeze"], "unfreeze")
    _check_settings(
        rank=settings["rank"], alpha=settings["alpha"], dropout=settings["dropout"],
        variant=settings["variant"], replora_hidden=settings["replora_hidden"],
    )
    if getattr(model, _CONFIG_ATTR, None) is not None or _wrappers(model):
        raise ValueError(
            f"{type(model).__name__} already has adapters; apply() once with every target "
            "(applying twice to the same layer is an error)"
        )

    modules = [(name, m) for name, m in model.named_modules() if name]  # the root cannot be replaced in place
    plan: dict[str, tuple[tuple[str, ...] | None, str]] = {}
    for pattern in target_patterns:
        glob, chunks = _parse_target(pattern)
        hits = [(name, m) for name, m in modules if fnmatch.fnmatchcase(name, glob)]
        if not hits:
            examples = ", ".join(name for name, _ in modules[:8])
            raise ValueError(
                f"target pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(module names look like: {examples}, ...)"
            )
        for name, m in hits:
            reason = _unsupported_reason(m)
            parent_name = name.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if parent_name else model
            if reason is None and isinstance(parent, nn.MultiheadAttention):
                reason = "nn.MultiheadAttention reads out_proj.weight directly, so a wrapper would be bypassed"
            if reason:
                raise ValueError(f"target pattern {pattern!r} matched module {name!r}: {reason}")
            if chunks is not None and m.weight.shape[0] % len(CHUNK_NAMES):
                raise ValueError(
                    f"target pattern {pattern!r} matched module {name!r} with {m.weight.shape[0]} output "
                    f"rows, which cannot be split into {len(CHUNK_NAMES)} equal chunks {CHUNK_NAMES}"
                )
            if name in plan and plan[name][0] != chunks:
                raise ValueError(
                    f"module {name!r} is matched by {plan[name][1]!r} and {pattern!r} with different "
                    "chunk selectors; make the patterns disjoint"
                )
            plan.setdefault(name, (chunks, pattern))

    if unfreeze_patterns:
        names = [name for name, _ in model.named_parameters()]
        for pattern in unfreeze_patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(
                    f"unfreeze pattern {pattern!r} matches no parameter of {type(model).__name__} "
                    f"(parameter names look like: {', '.join(names[:6])}, ...)"
                )

    for name, (chunks, _) in plan.items():
        wrapper = LoraLayer(
            model.get_submodule(name), rank=settings["rank"], alpha=settings["alpha"],
            dropout=settings["dropout"], variant=settings["variant"], use_rslora=settings["use_rslora"],
            chunks=chunks, replora_hidden=settings["replora_hidden"],
        )
        _set_submodule(model, name, wrapper)

    model.requires_grad_(False)
    for wrapper in _wrappers(model).values():
        for _, p in wrapper.adapter_named_parameters():
            p.requires_grad_(True)
    for name, p, _ in _base_parameters(model):
        if _matches(name, unfreeze_patterns):
            p.requires_grad_(True)

    config = {
        "targets": target_patterns,
        "rank": int(settings["rank"]),
        "alpha": float(settings["alpha"]),
        "dropout": float(settings["dropout"]),
        "variant": settings["variant"],
        "use_rslora": bool(settings["use_rslora"]),
        "unfreeze": unfreeze_patterns,
        "base_model_name": settings["base_model_name"],
        "replora_hidden": int(settings["replora_hidden"]),
        "preset": settings.get("preset"),
    }
    setattr(model, _CONFIG_ATTR, config)
    return model


def _require_wrappers(model: nn.Module) -> dict[str, LoraLayer]:
    wrappers = _wrappers(model)
    if not wrappers:
        raise ValueError(f"{type(model).__name__} has no adapters; call lora.apply(...) first")
    return wrappers


def merge(model: nn.Module, *, unload: bool = False) -> nn.Module:
    """Fold every adapter into its base weight; the wrappers then compute the base layer only.

    The delta is computed in fp32 (or the base dtype if wider). Never called implicitly (not on
    ``eval()``, not on save): an EMA teacher deep-copied from the student stays untouched.
    The base weights are stashed, so :func:`unmerge` restores them bit-exactly.

    Args:
        unload: also replace each wrapper by its plain base layer (original module types, merged
            weights, no stash, no adapter parameters). The model can no longer be unmerged.

    Raises:
        RuntimeError: some adapter is already merged (merging twice is an error, not a no-op).
        FloatingPointError: an adapter gives NaN/inf; every layer is left unmerged.
    """
    wrappers = _require_wrappers(model)
    already = [name for name, w in wrappers.items() if w.merged]
    if already:
        raise RuntimeError(f"adapters already merged: {already[:5]}; call lora.unmerge(model) first")
    done: list[LoraLayer] = []
    for name, w in wrappers.items():
        try:
            w.merge()
        except FloatingPointError as err:
            for merged in done:
                merged.unmerge()
            raise FloatingPointError(f"cannot merge adapter of {name!r}: {err}") from err
        done.append(w)
    if unload:
        for name, w in wrappers.items():
            w._merge_stash = None
            _set_submodule(model, name, w.base_layer)
        if hasattr(model, _CONFIG_ATTR):
            delattr(model, _CONFIG_ATTR)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Restore every merged base weight bit-exactly (from the copy stashed at merge).

    Raises:
        RuntimeError: nothing is merged.
    """
    wrappers = _require_wrappers(model)
    merged = [w for w in wrappers.values() if w.merged]
    if not merged:
        raise RuntimeError("no adapter is merged; nothing to unmerge")
    for w in merged:
        w.unmerge()
    return model


def _config(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, _CONFIG_ATTR, None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no adapters; call lora.apply(...) first")
    return config


def _live_adapter_tensors(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    config = _config(model)
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    for module_name, w in _wrappers(model).items():
        for rel, p in w.adapter_named_parameters():
            out[f"{KEY_PREFIX}{module_name}.{rel}"] = (p, p)
    for name, p, tensor in _base_parameters(model):
        if _matches(name, config["unfreeze"]):
            out[f"{KEY_PREFIX}{name}"] = (p, tensor)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors and the ``unfreeze`` parameters, under PEFT-style keys.

    See the module docstring for the key table. Tensors are detached views of the live
    parameters (no copies). An unfrozen full parameter is keyed by its base-model name.
    """
    return {key: tensor.detach() for key, (_, tensor) in _live_adapter_tensors(model).items()}


def _tensor_buffer(t: torch.Tensor):
    if t.is_meta:
        raise ValueError("cannot hash parameters on the meta device; materialise the model first")
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    # a zero-copy view of the bytes (works for bf16, which numpy lacks); `t` must outlive it
    return t, (ctypes.c_ubyte * nbytes).from_address(t.data_ptr()) if nbytes else b""


def base_model_sha256(model: nn.Module, unfreeze: Iterable[str] | None = None) -> str:
    """sha256 fingerprint of the base model's frozen parameters (see :data:`HASH_SCHEME`).

    Gives the same value on a fresh base model and on that model after :func:`apply`, training of
    the adapters / ``unfreeze`` parameters, and :func:`merge`. It depends on the dtype.

    Args:
        unfreeze: parameter globs to leave out; default: the patterns recorded by :func:`apply`.
    """
    if unfreeze is None:
        config = getattr(model, _CONFIG_ATTR, None)
        unfreeze = config["unfreeze"] if config else ()
    patterns = list(unfreeze)
    h = hashlib.sha256()
    entries = sorted(
        ((name, tensor) for name, _, tensor in _base_parameters(model) if not _matches(name, patterns)),
        key=lambda item: item[0],
    )
    for name, tensor in entries:
        h.update(f"{name}\0{str(tensor.dtype).replace('torch.', '')}\0{tuple(tensor.shape)}\0".encode())
        keep, buf = _tensor_buffer(tensor)
        h.update(buf)
        del keep
    return h.hexdigest()


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, base_model_name: str | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's pair) to ``directory``.

    Each file is written to a temporary file in ``directory`` and renamed into place. The config
    holds PEFT's fields (``peft_type="LORA"``, ``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules`` (our globs, chunk selectors included), ``use_rslora``, ``use_dora``,
    ``modules_to_save`` (= our ``unfreeze`` globs, on parameter names), ``base_model_name_or_path``)
    plus ``variant``, ``unfreeze``, ``replora_hidden`` and ``base_model_sha256`` (see
    :func:`base_model_sha256`). Merged adapters are saved with their adapter tensors as usual.
    """
    config = _config(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in adapter_state_dict(model).items()}
    name = base_model_name if base_model_name is not None else config["base_model_name"]
    payload = {
        "peft_type": "LORA",
        "task_type": None,
        "r": config["rank"],
        "lora_alpha": config["alpha"],
        "lora_dropout": config["dropout"],
        "target_modules": config["targets"],
        "use_rslora": config["use_rslora"],
        "use_dora": config["variant"] == "dora",
        "modules_to_save": config["unfreeze"] or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": name,
        "variant": config["variant"],
        "unfreeze": config["unfreeze"],
        "replora_hidden": config["replora_hidden"],
        "preset": config.get("preset"),
        "base_model_sha256": base_model_sha256(model),
        "base_model_sha256_scheme": HASH_SCHEME,
        "library": "domainfm",
    }
    _atomic_write(
        os.path.join(directory, ADAPTER_WEIGHTS_NAME),
        lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
    )

    def write_json(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2, sort_keys=True)
            fh.write("\n")

    _atomic_write(os.path.join(directory, ADAPTER_CONFIG_NAME), write_json)


def _settings_from_file(cfg: Mapping[str, Any], path: str) -> dict[str, Any]:
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")
    variant = cfg.get("variant") or ("dora" if cfg.get("use_dora") else "lora")
    unfreeze = cfg.get("unfreeze")
    if unfreeze is None:
        unfreeze = cfg.get("modules_to_save") or []
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{path}: target_modules must be a non-empty list of patterns, got {targets!r}")
    return {
        "targets": list(targets),
        "rank": cfg["r"],
        "alpha": float(cfg["lora_alpha"]),
        "dropout": float(cfg.get("lora_dropout", 0.0)),
        "variant": variant,
        "use_rslora": bool(cfg.get("use_rslora", False)),
        "unfreeze": list(unfreeze),
        "replora_hidden": int(cfg.get("replora_hidden", _DEFAULTS["replora_hidden"])),
    }


def load_adapter(model: nn.Module, directory: str | os.PathLike, *, strict_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model``.

    A fresh base model gets :func:`apply` with the saved settings first; a model that already
    has adapters must have the same settings. The recorded ``base_model_sha256`` is compared with
    the model's before anything is changed.

    Args:
        strict_base: on a base-hash mismatch raise (default) or, if False, warn and load anyway.

    Raises:
        ValueError: base hash mismatch (naming both hashes), missing/unexpected/mis-shaped keys
            (naming them), differing settings, or a malformed config.
        RuntimeError: the model's adapters are merged.
    """
    directory = os.fspath(directory)
    config_path = os.path.join(directory, ADAPTER_CONFIG_NAME)
    weights_path = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    with open(config_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    settings = _settings_from_file(cfg, config_path)

    existing = getattr(model, _CONFIG_ATTR, None)
    if existing is not None:
        differing = [k for k, v in settings.items() if existing[k] != v]
        if differing:
            details = "; ".join(f"{k}: model {existing[k]!r} vs file {settings[k]!r}" for k in differing)
            raise ValueError(f"{config_path}: model already has adapters with other settings ({details})")
        if any(w.merged for w in _wrappers(model).values()):
            raise RuntimeError("model's adapters are merged; call lora.unmerge(model) before loading")

    recorded = cfg.get("base_model_sha256")
    actual = base_model_sha256(model, settings["unfreeze"])
    if recorded is None:
        warnings.warn(f"{config_path} records no base_model_sha256; the base model is not checked", stacklevel=2)
    elif recorded != actual:
        message = (
            f"{config_path} was trained on a different base model: recorded base_model_sha256 "
            f"{recorded}, this model's {actual} (base_model_name_or_path: "
            f"{cfg.get('base_model_name_or_path')!r}; same weights in another dtype also differ)"
        )
        if strict_base:
            raise ValueError(message + "; pass strict_base=False to load anyway")
        warnings.warn(message, stacklevel=2)

    if existing is None:
        apply(model, base_model_name=cfg.get("base_model_name_or_path"), **settings)
    live = _live_adapter_tensors(model)
    tensors = load_file(weights_path, device="cpu")
    missing = sorted(set(live) - set(tensors))
    unexpected = sorted(set(tensors) - set(live))
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not fit the model's adapters: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}, unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    wrong = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(p.shape)}"
        for k, (p, _) in live.items() if tuple(tensors[k].shape) != tuple(p.shape)
    ]
    if wrong:
        raise ValueError(f"{weights_path}: shape mismatch for {wrong[:20]}")
    with torch.no_grad():
        for k, (p, _) in live.items():
            p.copy_(tensors[k].to(dtype=p.dtype, device=p.device))
    return model


class TrainableSummary(dict):
    """``{"trainable": int, "total": int, "percent": float}``; ``str()`` gives one readable line."""

    def __str__(self) -> str:
        return (
            f"trainable params: {self['trainable']:,d} || all params: {self['total']:,d} "
            f"|| trainable%: {self['percent']:.4f}"
        )


def trainable_summary(model: nn.Module) -> TrainableSummary:
    """Trainable / total parameter counts (each shared parameter counted once)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return TrainableSummary(trainable=trainable, total=total, percent=100.0 * trainable / total if total else 0.0)


def count_trainable(model: nn.Module) -> int:
    """Number of parameters with ``requires_grad`` (each shared parameter counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
