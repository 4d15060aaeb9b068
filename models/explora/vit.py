"""ExPLoRA backbones on timm's VisionTransformer: DINOv2 ViT-{S,B,L}/14 and MAE ViT-{B,L}/16.

ExPLoRA (Khanna et al., ICML 2025, https://arxiv.org/abs/2406.10973) adds no architecture of its
own: it continues a natural-image ViT's self-supervised objective on a new domain with LoRA on
q and v of every block but the last, which is fully unfrozen (see ``domainfm.lora.PRESETS``).
So every RGB variant here *is* timm's ``VisionTransformer``; this module only fixes the
constructor arguments and gives them domainfm's keyword names (``n_outputs``).

Fine-tuning follows the paper (MAE-style): global average pooling over patch tokens and a
``fc_norm`` LayerNorm before the linear head (``global_pool="avg"``); pretraining and linear
probing use the class token (``global_pool="token"``, the timm default for DINOv2).

Speed (issue 15; parameters, keys and eval outputs are timm's exactly): the blocks are
:class:`SubsetDropPathBlock`, whose stochastic depth above rate 0.1 runs each residual branch on
the kept samples only (DINOv2's "efficient stochastic depth", :func:`drop_add_residual`), and whose
attention on CPU in bf16 takes timm's plain matmul + softmax form instead of the CPU flash kernel.
LoRA on q and v of the fused ``qkv`` uses :class:`~domainfm.lora.LoraLayer`'s fused path.
Measured side by side with DINOv2's own ViT by ``benchmarks/explora.py --official``.

**Shapes:** ``forward(x)``: ``(B, 3, H, W) -> (B, n_outputs)`` (``n_outputs=0``: pooled
features ``(B, num_features)``); ``forward_features(x) -> (B, 1 + n_reg + N, D)``.
"""
from __future__ import annotations

from typing import Any, Callable

import timm
import torch
from timm.models.vision_transformer import Block
from torch import nn

from domainfm.precision import active_autocast_dtype

__all__ = ["build_timm_vit", "TIMM_ARCHS", "SubsetDropPathBlock", "drop_add_residual", "EFFICIENT_DROP_PATH_ABOVE"]

#: drop rates above this use the subset form of stochastic depth in training (DINOv2's threshold:
#: below it, gathering and scattering the kept rows costs more than the skipped work saves)
EFFICIENT_DROP_PATH_ABOVE = 0.1


def drop_add_residual(x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor], drop_prob: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastic depth computed on the kept samples only (DINOv2's "efficient stochastic depth").

    ``k = max(int(B * (1 - drop_prob)), 1)`` samples are drawn without replacement (the first ``k`` of
    ``torch.randperm(B, generator=generator)``); the residual ``branch`` runs on those ``k`` rows
    only and is added back scaled by ``B / k``; the other rows pass unchanged. Every sample is kept
    with probability ``k / B``, so the expected output equals ``x + branch(x)`` as for per-sample
    DropPath, while the branch costs ``k / B`` of the full batch. Unlike timm's DropPath the number
    of kept samples is fixed, not binomial (the choice DINOv2 makes; the expectation is the same).

    **Shapes:** ``x`` ``(B, *)``; ``branch`` maps ``(k, *) -> (k, *)``; returns ``(B, *)``.
    """
    b = x.shape[0]
    keep = max(int(b * (1.0 - drop_prob)), 1)
    if keep >= b:
        return x + branch(x)
    device = x.device if generator is None else generator.device
    rows = torch.randperm(b, generator=generator, device=device)[:keep].to(x.device)
    residual = branch(x.index_select(0, rows))
    out = torch.index_add(x.flatten(1), 0, rows, residual.flatten(1).to(x.dtype), alpha=b / keep)
    return out.view_as(x)


class SubsetDropPathBlock(Block):
    """timm's pre-norm ``Block`` (same parameters and keys) whose stochastic depth, in training
    with a drop rate above :data:`EFFICIENT_DROP_PATH_ABOVE`, runs each residual branch on the kept
    samples only (:func:`drop_add_residual`), as DINOv2's ``Block``. In eval, at lower rates, or
    with an attention mask, it is timm's ``Block`` exactly. On CPU in bf16 the attention takes
    timm's own plain matmul + softmax form instead of the fused SDPA kernel (same function,
    2-3x faster there; see :meth:`_choose_attention_kernel`).

    The drop rate is read from ``drop_path1.drop_prob`` / ``drop_path2.drop_prob`` at every call,
    so zeroing those (as the DINO teacher does) turns it off. ``generator`` (default None: the
    global RNG) makes the draws reproducible.
    """

    generator: torch.Generator | None = None

    def _choose_attention_kernel(self, x: torch.Tensor) -> None:
        # timm's Attention has two exact forms of softmax(q k^T / sqrt(d)) v: the fused SDPA kernel
        # and plain matmul + softmax. On CPU in bf16 the plain form is 2-3x faster for ViT
        # sequences (50-257 tokens, forward + backward, measured with torch 2.14: the CPU flash
        # kernel is a poor fit there); in fp32 and on GPUs the fused kernel is as fast or faster.
        # Under autocast the plain form rounds the attention logits to bf16 (autocast's usual
        # rule for matmuls); the softmax itself runs in fp32.
        attn = self.attn
        if not hasattr(attn, "fused_attn"):
            return
        if "_fused_attn_default" not in self.__dict__:
            self._fused_attn_default = bool(attn.fused_attn)
        plain = x.device.type == "cpu" and torch.bfloat16 in (x.dtype, active_autocast_dtype("cpu"))
        attn.fused_attn = self._fused_attn_default and not plain

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        self._choose_attention_kernel(x)
        p1 = float(getattr(self.drop_path1, "drop_prob", 0.0))
        p2 = float(getattr(self.drop_path2, "drop_prob", 0.0))
        # timm stores the rates as float32 (0.1 -> 0.10000000149): compare with a little slack
        if not self.training or attn_mask is not None or max(p1, p2) <= EFFICIENT_DROP_PATH_ABOVE + 1e-6:
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)

        def attn_branch(t: torch.Tensor) -> torch.Tensor:
            return self.ls1(self.attn(self.norm1(t), is_causal=is_causal))

        def mlp_branch(t: torch.Tensor) -> torch.Tensor:
            return self.ls2(self.mlp(self.norm2(t)))

        x = drop_add_residual(x, attn_branch, p1, self.generator) if p1 > 0 else x + attn_branch(x)
        x = drop_add_residual(x, mlp_branch, p2, self.generator) if p2 > 0 else x + mlp_branch(x)
        return x

#: our size name -> timm architecture name
TIMM_ARCHS = {
    "dinov2-small": "vit_small_patch14_dinov2",
    "dinov2-base": "vit_base_patch14_dinov2",
    "dinov2-large": "vit_large_patch14_dinov2",
    "mae-base": "vit_base_patch16_224",
    "mae-large": "vit_large_patch16_224",
}


def build_timm_vit(
    arch: str,
    *,
    n_outputs: int = 0,
    img_size: int = 224,
    in_chans: int = 3,
    global_pool: str = "token",
    drop_path_rate: float = 0.0,
    dynamic_img_size: bool = False,
    efficient_drop_path: bool = True,
    **timm_kwargs: Any,
) -> nn.Module:
    """Build timm's ViT ``arch`` (a key of :data:`TIMM_ARCHS` or a timm name) without weights.

    Args:
        n_outputs: classes of the linear head (0: no head, ``forward`` returns pooled features).
        img_size: input side in pixels (ExPLoRA's fMoW-RGB runs use 224 for ViT-L/14).
        global_pool: ``"token"`` (class token) or ``"avg"`` (mean of patch tokens + ``fc_norm``,
            the paper's fine-tuning head).
        drop_path_rate: stochastic depth (0.3 for DINOv2 pretraining, 0.2 for fine-tuning).
        dynamic_img_size: accept other input sizes (interpolating the position table), needed
            for DINOv2's small local crops.
        efficient_drop_path: blocks are :class:`SubsetDropPathBlock` (timm's ``Block`` whose
            stochastic depth above rate 0.1 computes each residual branch on the kept samples
            only, as DINOv2); ``False``: timm's ``Block``. Same parameters and keys either way.
    """
    if global_pool not in {"token", "avg"}:
        raise ValueError(f"global_pool={global_pool!r}: expected 'token' or 'avg'")
    if not isinstance(n_outputs, int) or n_outputs < 0:
        raise ValueError(f"n_outputs={n_outputs!r}: expected an integer >= 0")
    name = TIMM_ARCHS.get(arch, arch)
    if efficient_drop_path:
        timm_kwargs.setdefault("block_fn", SubsetDropPathBlock)
    model = timm.create_model(
        name, pretrained=False, num_classes=n_outputs, img_size=img_size, in_chans=in_chans,
        global_pool=global_pool, drop_path_rate=drop_path_rate, dynamic_img_size=dynamic_img_size,
        **timm_kwargs,
    )
    return model


def tiny_vit(
    *,
    n_outputs: int = 10,
    img_size: int = 32,
    patch_size: int = 4,
    in_chans: int = 3,
    embed_dim: int = 48,
    depth: int = 3,
    num_heads: int = 3,
    reg_tokens: int = 0,
    global_pool: str = "token",
    drop_path_rate: float = 0.0,
    dynamic_img_size: bool = True,
    init_values: float | None = 1e-5,
    efficient_drop_path: bool = True,
) -> nn.Module:
    """A test-sized ViT with DINOv2's layout (LayerScale, class token, optional registers).

    ``init_values``: LayerScale's initial value (default 1e-5, DINOv2's and timm's init for a
    randomly initialised ViT). That init makes every residual branch ~1e-5 of the stream, so an
    adapter or a fine-tuning step barely changes the output of a *random* tiny model; pass
    ``init_values=1.0`` (what a trained ViT's LayerScales look like, order 0.1-1) where a test must
    see the blocks act. ``None`` or 0: no LayerScale at all (other parameter keys).
    ``efficient_drop_path``: as :func:`build_timm_vit`.
    """
    from timm.models.vision_transformer import VisionTransformer

    if init_values is not None and (not isinstance(init_values, (int, float)) or isinstance(init_values, bool)
                                    or init_values < 0):
        raise ValueError(f"init_values={init_values!r}: expected a LayerScale init >= 0 or None")
    return VisionTransformer(
        img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=n_outputs,
        embed_dim=embed_dim, depth=depth, num_heads=num_heads, init_values=init_values or None,
        reg_tokens=reg_tokens, no_embed_class=reg_tokens > 0, global_pool=global_pool,
        drop_path_rate=drop_path_rate, dynamic_img_size=dynamic_img_size,
        block_fn=SubsetDropPathBlock if efficient_drop_path else Block,
    )


def tiny_example_input(in_chans: int = 3, size: int = 32) -> tuple[torch.Tensor]:
    return (torch.randn(2, in_chans, size, size),)
