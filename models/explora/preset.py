"""The ExPLoRA adapter preset, registered into the core registry as ``lora.PRESETS["explora"]``.

ExPLoRA (Khanna et al., ICML 2025, https://arxiv.org/abs/2406.10973): LoRA r=64 on q and v of
every block but the last; the last block, every norm and the class/register tokens train in full.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from domainfm.lora import register_preset

__all__ = ["explora_preset"]


def explora_preset(model: nn.Module) -> dict[str, Any]:
    """:func:`domainfm.lora.apply` settings for a ViT with a ``blocks`` container (timm's layout,
    or :class:`~domainfm.models.explora.GroupChannelViT`)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        raise ValueError(f"preset 'explora' needs a ViT with a `blocks` container; {type(model).__name__} has none")
    n_blocks = len(list(blocks.children()))
    if n_blocks < 2:
        raise ValueError(f"preset 'explora' needs at least 2 blocks, model.blocks has {n_blocks}")
    last = n_blocks - 1
    unfreeze = [f"blocks.{last}.*", "*norm*", "cls_token"]
    if isinstance(getattr(model, "reg_token", None), nn.Parameter):
        unfreeze.append("reg_token")  # timm's register tokens (DINOv2 with registers)
    return {
        "targets": [f"blocks.{i}.attn.qkv@q,v" for i in range(last)],
        "rank": 64,
        "alpha": 1.0,
        "dropout": 0.0,
        "variant": "lora",
        "unfreeze": unfreeze,
    }


register_preset("explora", explora_preset)
