"""The LoRA variants, one class each (PEFT's ``LoraVariant`` pattern): LoRA, DoRA, RepLoRA.

:class:`~domainfm.lora.layer.LoraLayer` fixes the algorithm (chunking of fused projections, the
adapter branch, merge in fp32 with a NaN/inf check, exact unmerge); a variant fills in the small
part that differs, through four hooks:

* :meth:`LoraVariant.init`: create the adapter parameters of the layer (and of each chunk);
* :meth:`LoraVariant.factors`: the effective factors :math:`A` and :math:`B` of one chunk;
* :meth:`LoraVariant.forward_chunk`: combine one chunk's base output with its adapter branch;
* :meth:`LoraVariant.merge_rows`: turn :math:`W + s B A` of one chunk into the merged rows.

Variants hold no state: the parameters live on the layer (or its per-chunk owners) under PEFT's
key names, so a layer's ``state_dict`` is the same whichever class computes it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from .layer import LoraLayer

__all__ = ["LoraVariant", "LoRA", "DoRA", "RepLoRA", "VARIANT_CLASSES", "VARIANTS"]


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


def _kaiming(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    return t


class LoraVariant:
    """Plain LoRA (Hu et al., 2021): :math:`y = W x + b + s\\,B A\\,\\mathrm{drop}(x)`.

    The base class *is* LoRA; the other variants override the hooks that differ.
    """

    name = "lora"
    #: False when the variant rescales the base output and the bias is added after (DoRA)
    bias_in_base = True

    def init(self, layer: LoraLayer, *, replora_hidden: int) -> None:
        """Create the adapter parameters: per chunk ``lora_A`` ``(r, in, *kernel)`` (Kaiming
        uniform, :math:`a=\\sqrt5`) and ``lora_B`` ``(out_chunk, r, 1, ...)`` (zeros)."""
        dtype, device = layer.adapter_dtype, layer.base_layer.weight.device
        for chunk in layer.chunks:
            owner = layer._new_owner(chunk)
            owner.lora_A = _Factor(_kaiming(layer.a_shape, dtype, device))
            owner.lora_B = _Factor(torch.zeros(layer.b_shape, dtype=dtype, device=device))

    def factors(self, layer: LoraLayer, chunk: str | None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``A`` shaped ``(r, in, *kernel)`` and ``B`` flat ``(out_chunk, r)`` for one chunk."""
        owner = layer._owner(chunk)
        a, b = owner.lora_A.weight, owner.lora_B.weight.reshape(layer.chunk_out, layer.rank)
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        return a, b

    def forward_chunk(self, layer: LoraLayer, chunk: str | None, base_rows: torch.Tensor, branch: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """One chunk's output: its base rows (bias included when :attr:`bias_in_base`) and the
        scaled adapter branch :math:`s B A\\,\\mathrm{drop}(x)`."""
        return base_rows + branch.to(base_rows.dtype)

    def merge_rows(self, layer: LoraLayer, chunk: str | None, adapted: torch.Tensor) -> torch.Tensor:
        """The merged rows of one chunk from :math:`W + s B A` (in the compute dtype)."""
        return adapted


#: LoRA is the base variant itself
LoRA = LoraVariant


class DoRA(LoraVariant):
    """DoRA (Liu et al., 2024, arXiv:2402.09353): :math:`W' = m \\odot (W + s B A) / \\lVert W + s B A
    \\rVert_{row}`, the norm per output row over every input dimension, :math:`m` initialised to
    :math:`\\lVert W \\rVert_{row}` (``lora_magnitude_vector``; conv ``(1, out, 1, ...)`` as in PEFT).

    As in PEFT (and the paper, Sec. 4.3) the norm is a constant for autograd (detached), which
    saves memory; :math:`m` and :math:`B, A` still train. The bias is added after the rescaling.
    """

    name = "dora"
    bias_in_base = False

    def init(self, layer: LoraLayer, *, replora_hidden: int) -> None:
        super().init(layer, replora_hidden=replora_hidden)
        weight = layer.base_layer.weight
        for chunk in layer.chunks:
            with torch.no_grad():
                rows = layer._rows(weight.detach(), chunk).reshape(layer.chunk_out, -1).float()
                magnitude = rows.norm(p=2, dim=1).to(layer.adapter_dtype)
            if layer._n_spatial:
                magnitude = magnitude.view(1, -1, *([1] * layer._n_spatial))  # PEFT's conv shape
            layer._owner(chunk).lora_magnitude_vector = nn.Parameter(magnitude)

    def _magnitude(self, layer: LoraLayer, chunk: str | None) -> torch.Tensor:
        return layer._owner(chunk).lora_magnitude_vector.reshape(-1)

    def forward_chunk(self, layer: LoraLayer, chunk: str | None, base_rows: torch.Tensor, branch: torch.Tensor,
                      a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = layer._rows(layer.base_layer.weight, chunk).reshape(layer.chunk_out, -1)
        delta = layer.scaling * (b @ a.reshape(layer.rank, -1))
        # DoRA Sec. 4.3 / PEFT: the norm is a constant for autograd.
        norm = (rows.to(delta.dtype) + delta.detach()).norm(p=2, dim=1).detach()
        scale = (self._magnitude(layer, chunk) / norm).reshape(-1, *([1] * layer._n_spatial))
        return (scale * (base_rows.to(branch.dtype) + branch)).to(base_rows.dtype)

    def merge_rows(self, layer: LoraLayer, chunk: str | None, adapted: torch.Tensor) -> torch.Tensor:
        magnitude = self._magnitude(layer, chunk).to(adapted.dtype)
        norm = adapted.reshape(layer.chunk_out, -1).norm(p=2, dim=1)
        return adapted * (magnitude / norm).reshape(-1, *([1] * (adapted.dim() - 1)))


class RepLoRA(LoraVariant):
    """RepLoRA (Truong et al., ICML 2025, arXiv:2502.03044): :math:`A = g_A(A_0)`, :math:`B = g_B(B_0)`.

    The paper motivates RepLoRA by the MoE view of attention and by the prefix-tuning result that
    reparameterising *shared* underlying parameters through MLPs makes estimation sample-efficient;
    its practical method is "lightweight MLPs that reparameterise the LoRA matrices", removed after
    training. We could confirm that description (abstract), but not the exact equations (the
    method section was not reachable), so this form is our most defensible reading, not a
    verified copy:

    .. math::
        A_c = g_{A,c}(A_0), \\qquad B_c^\\top = g_{B,c}(B_0^\\top), \\qquad
        \\Delta W_c = s\\, B_c A_c,

    with :math:`A_0 \\in \\mathbb{R}^{r \\times d_{in}}` (``replora_A``) and :math:`B_0 \\in
    \\mathbb{R}^{d_{chunk} \\times r}` (``replora_B``) *shared by the chunks of one layer* (q and v of
    a fused qkv: the "shared structure" of the theory), and a separate row-wise two-layer GELU MLP
    :math:`g \\colon \\mathbb{R}^{d} \\to \\mathbb{R}^{h} \\to \\mathbb{R}^{d}` per chunk and factor
    (``replora_mlp_A``, ``replora_mlp_B``; prefix-tuning style: each of the :math:`r` rows of
    :math:`A_0` / columns of :math:`B_0` goes through the MLP). Separate layers (e.g. distinct
    ``q_proj``/``v_proj``) do not share. :math:`g_B`'s output layer starts at zero, so a fresh
    adapter is an exact no-op; merge evaluates the MLPs once in fp32 and folds :math:`s B_c A_c`
    into :math:`W`, so inference costs nothing extra. Trainable count per layer: :math:`r d_{in} +
    r d_{chunk} + \\sum_c [2 h d_{in} + h + d_{in} + 2 h d_{chunk} + h + d_{chunk}]`.
    """

    name = "replora"

    def init(self, layer: LoraLayer, *, replora_hidden: int) -> None:
        dtype, device = layer.adapter_dtype, layer.base_layer.weight.device
        layer.replora_A = _Factor(_kaiming(layer.a_shape, dtype, device))
        layer.replora_B = _Factor(_kaiming((layer.chunk_out, layer.rank), dtype, device))
        fan_in = layer.base_layer.weight[0].numel()
        for chunk in layer.chunks:
            owner = layer._new_owner(chunk)
            owner.replora_mlp_A = _ReparamMLP(fan_in, replora_hidden, zero_out=False, dtype=dtype, device=device)
            owner.replora_mlp_B = _ReparamMLP(layer.chunk_out, replora_hidden, zero_out=True, dtype=dtype,
                                              device=device)

    def factors(self, layer: LoraLayer, chunk: str | None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        owner = layer._owner(chunk)
        a0 = layer.replora_A.weight
        a = owner.replora_mlp_A(a0.reshape(layer.rank, -1), dtype).reshape(a0.shape)
        b = owner.replora_mlp_B(layer.replora_B.weight.t(), dtype).t()
        return a, b


#: variant name -> class; :class:`~domainfm.lora.layer.LoraLayer` instantiates the one asked for
VARIANT_CLASSES: dict[str, type[LoraVariant]] = {cls.name: cls for cls in (LoraVariant, DoRA, RepLoRA)}
VARIANTS = tuple(VARIANT_CLASSES)
