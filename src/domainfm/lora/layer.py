"""The adapter layer: a frozen ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` with a low-rank
adapter beside it, its forward, and its exact merge/unmerge. What differs between LoRA, DoRA
and RepLoRA is a :class:`~domainfm.lora.variants.LoraVariant` object, not a branch here."""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .variants import VARIANT_CLASSES, VARIANTS, LoraVariant

__all__ = ["CHUNK_NAMES", "LoraLayer"]

#: names of the equal output chunks of a fused projection, selected with ``"<pattern>@q,v"``
CHUNK_NAMES = ("q", "k", "v")
_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d)


class LoraLayer(nn.Module):
    """A frozen ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` plus a low-rank adapter beside it.

    Made by :func:`domainfm.lora.apply`; rarely built by hand. The original layer is
    ``self.base_layer`` (PEFT's name), so the model's own state-dict keys become
    ``<module>.base_layer.weight``.

    Args:
        base_layer: the layer to adapt (groups must be 1 for convolutions).
        rank: :math:`r \\ge 1`.
        alpha: scale numerator; :math:`s = \\alpha/r`, or :math:`\\alpha/\\sqrt r` with ``use_rslora``.
        dropout: dropout probability on the adapter branch input only (default 0).
        variant: ``"lora"``, ``"dora"`` or ``"replora"`` (see :mod:`domainfm.lora.variants`).
        use_rslora: rank-stabilised scaling.
        chunks: ``None`` adapts every output row; a tuple of names from :data:`CHUNK_NAMES`
            splits the output rows into three equal chunks and adapts only those named.
        replora_hidden: hidden width :math:`h` of RepLoRA's MLPs (default 64).

    Dropout acts on the adapter branch input only, for every variant (PEFT's DoRA also feeds the
    dropped-out input to its :math:`(m/\\lVert\\cdot\\rVert - 1) W x` term; we do not). In eval
    mode both agree. Half-precision bases get fp32 adapters.

    **Shapes:** input and output as the base layer: Linear ``(*, in) -> (*, out)``; Conv1d
    ``(N, C_in, L) -> (N, C_out, L')``; Conv2d ``(N, C_in, H, W) -> (N, C_out, H', W')``
    (unbatched inputs work as for the base layer).
    """

    #: several adapted chunks of a fused ``nn.Linear`` (e.g. q and v of ``qkv``) compute their
    #: updates with one matmul pair (stacked down factors, block-diagonal up factors) instead of
    #: one pair per chunk; LoRA and RepLoRA only (DoRA rescales per chunk). Set False on an
    #: instance to take the per-chunk loop (same result to rounding; kept as the reference).
    fuse_chunks: bool = True

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
        reason = unsupported_reason(base_layer)
        if reason:
            raise ValueError(reason)
        check_settings(rank=rank, alpha=alpha, dropout=dropout, variant=variant, replora_hidden=replora_hidden)
        self.base_layer = base_layer
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.variant = variant
        self.variant_impl: LoraVariant = VARIANT_CLASSES[variant]()
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
        # Half-precision bases get fp32 adapters (as PEFT's autocast_adapter_dtype): tiny, and
        # updates of a zero-initialised B would otherwise underflow.
        self.adapter_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        #: shapes of one chunk's down factor ``(r, in, *kernel)`` and up factor ``(out_chunk, r, 1, ...)``
        self.a_shape = (self.rank, *weight.shape[1:])
        self.b_shape = (self.chunk_out, self.rank, *([1] * self._n_spatial))
        self.variant_impl.init(self, replora_hidden=replora_hidden)

    # -- structure ----------------------------------------------------------------------------

    def _new_owner(self, chunk: str | None) -> nn.Module:
        """The module that holds one chunk's parameters (this layer, or a child named ``chunk``)."""
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
        return self.variant_impl.factors(self, chunk, dtype)

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

    def _fuses_chunks(self) -> bool:
        """Whether :meth:`forward` takes the fused path (see :attr:`fuse_chunks`)."""
        return (self.fuse_chunks and len(self.chunks) > 1 and self._n_spatial == 0
                and type(self.variant_impl).forward_chunk is LoraVariant.forward_chunk
                and self.variant_impl.bias_in_base)

    def _chunk_index(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        cache = self.__dict__.setdefault("_chunk_index_cache", {})
        if key not in cache:
            cache[key] = torch.tensor([CHUNK_NAMES.index(c) for c in self.chunks], device=device)
        return cache[key]

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        r"""Several chunks of a fused Linear in one matmul pair: ``h = drop(x) [A_1; ...; A_n]^T``
        (the down factors stacked, ``(*, n r)``), then one batched matmul of each ``h_c`` with its
        ``B_c`` (a block-diagonal up factor), added into the selected chunks' rows, scaled by ``s``.
        Exactly :math:`W x + b + s B_c A_c\,\mathrm{drop}(x)` per chunk, as the per-chunk loop."""
        base = self.base_layer
        y = F.linear(x, base.weight, base.bias)
        factors = [self._factors(chunk) for chunk in self.chunks]
        a_all = torch.cat([a for a, _ in factors])  # (n r, in)
        b_all = torch.stack([b for _, b in factors])  # (n, out_chunk, r)
        n, r = len(factors), self.rank
        h = F.linear(self.lora_dropout(x).to(a_all.dtype), a_all).reshape(-1, n, r)
        update = torch.bmm(h.transpose(0, 1), b_all.transpose(1, 2).to(h.dtype))  # (n, M, out_chunk)
        rows = y.reshape(-1, self.n_chunks, self.chunk_out)
        out = rows.index_add(1, self._chunk_index(y.device), update.transpose(0, 1).to(y.dtype), alpha=self.scaling)
        return out.reshape(y.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.base_layer(x)
        if self._fuses_chunks():
            return self._fused_forward(x)
        impl = self.variant_impl
        y = self._base_forward(x, with_bias=impl.bias_in_base)
        x_branch = self.lora_dropout(x)
        pieces = list(y.split(self.chunk_out, dim=self._out_dim)) if self.n_chunks > 1 else [y]
        for chunk in self.chunks:
            idx = 0 if chunk is None else CHUNK_NAMES.index(chunk)
            a, b = self._factors(chunk)
            branch = self.scaling * self._branch(x_branch.to(a.dtype), a, b)
            pieces[idx] = impl.forward_chunk(self, chunk, pieces[idx], branch, a, b)
        y = torch.cat(pieces, dim=self._out_dim) if self.n_chunks > 1 else pieces[0]
        if not impl.bias_in_base and self.base_layer.bias is not None:
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
            merged = self.variant_impl.merge_rows(self, chunk, rows + self.delta_weight(chunk, compute))
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


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot be wrapped, or ``None`` when it can."""
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


def check_settings(*, rank, alpha, dropout, variant, replora_hidden) -> None:
    """Reject impossible adapter settings with an error naming the argument."""
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
