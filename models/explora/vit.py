"""ExPLoRA backbones on timm's VisionTransformer: DINOv2 ViT-{S,B,L}/14 and MAE ViT-{B,L}/16.

ExPLoRA (Khanna et al., ICML 2025, https://arxiv.org/abs/2406.10973) adds no architecture of its
own: it continues a natural-image ViT's self-supervised objective on a new domain with LoRA on
q and v of every block but the last, which is fully unfrozen (see ``domainfm.lora.PRESETS``).
So every RGB variant here *is* timm's ``VisionTransformer``; this module only fixes the
constructor arguments and gives them domainfm's keyword names (``n_outputs``).

Fine-tuning follows the paper (MAE-style): global average pooling over patch tokens and a
``fc_norm`` LayerNorm before the linear head (``global_pool="avg"``); pretraining and linear
probing use the class token (``global_pool="token"``, the timm default for DINOv2).

**Shapes:** ``forward(x)``: ``(B, 3, H, W) -> (B, n_outputs)`` (``n_outputs=0``: pooled
features ``(B, num_features)``); ``forward_features(x) -> (B, 1 + n_reg + N, D)``.
"""
from __future__ import annotations

from typing import Any

import timm
import torch
from torch import nn

__all__ = ["build_timm_vit", "TIMM_ARCHS"]

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
    """
    if global_pool not in {"token", "avg"}:
        raise ValueError(f"global_pool={global_pool!r}: expected 'token' or 'avg'")
    if not isinstance(n_outputs, int) or n_outputs < 0:
        raise ValueError(f"n_outputs={n_outputs!r}: expected an integer >= 0")
    name = TIMM_ARCHS.get(arch, arch)
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
) -> nn.Module:
    """A test-sized ViT with DINOv2's layout (LayerScale, class token, optional registers)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=n_outputs,
        embed_dim=embed_dim, depth=depth, num_heads=num_heads, init_values=1e-5, reg_tokens=reg_tokens,
        no_embed_class=reg_tokens > 0, global_pool=global_pool, drop_path_rate=drop_path_rate,
        dynamic_img_size=dynamic_img_size,
    )


def tiny_example_input(in_chans: int = 3, size: int = 32) -> tuple[torch.Tensor]:
    return (torch.randn(2, in_chans, size, size),)
