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
  (see :class:`~domainfm.lora.variants.RepLoRA` for the exact form used here and what it is based on).

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

Layout: :mod:`~domainfm.lora.layer` (the wrapper), :mod:`~domainfm.lora.variants` (one class per
variant), :mod:`~domainfm.lora.inject` (apply, merge/unmerge, counts), :mod:`~domainfm.lora.io`
(adapter files), :mod:`~domainfm.lora.presets` (named presets; families register their own, e.g.
``"explora"`` in ``domainfm.models.explora.preset``).

Conventions: :func:`merge` is never implicit (not on ``eval()``); merging a merged model and
unmerging an unmerged one raise ``RuntimeError``; NaN/inf deltas raise ``FloatingPointError``.
"""
from __future__ import annotations

from .inject import TrainableSummary, apply, count_trainable, merge, trainable_summary, unmerge
from .inject import wrappers as _wrappers  # noqa: F401  (used by tests and recipes to inspect merge state)
from .io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    HASH_SCHEME,
    KEY_PREFIX,
    adapter_state_dict,
    base_model_sha256,
    load_adapter,
    save_adapter,
)
from .layer import CHUNK_NAMES, LoraLayer
from .presets import PRESETS, register_preset
from .variants import VARIANTS, DoRA, LoraVariant, RepLoRA

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "CHUNK_NAMES",
    "HASH_SCHEME",
    "KEY_PREFIX",
    "PRESETS",
    "VARIANTS",
    "DoRA",
    "LoraLayer",
    "LoraVariant",
    "RepLoRA",
    "TrainableSummary",
    "adapter_state_dict",
    "apply",
    "base_model_sha256",
    "count_trainable",
    "load_adapter",
    "merge",
    "register_preset",
    "save_adapter",
    "trainable_summary",
    "unmerge",
]
