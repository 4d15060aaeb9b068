"""ExPLoRA's MAE objective: masked-patch pixel regression with a light decoder
(Khanna et al., ICML 2025; MAE, He et al. 2022; SatMAE for group-channel encoders).

**MAE** (``objective: mae``): mask 75 % of the patch tokens, encode the rest,
decode with a light transformer and regress normalised pixels of the masked patches. Encoder:
the explora preset; decoder: LoRA rank 8 on q, v plus its embedding/norm/prediction layers.
Works on timm ViTs and on the multispectral :class:`~domainfm.models.explora.GroupChannelViT`
(per-group masking and per-group pixel heads, as SatMAE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from domainfm.engine import Recipe

__all__ = ["MaeSection", "MaeDecoder", "MaePretrainer", "MaeRecipe", "patchify"]


@dataclass
class MaeSection:
    mask_ratio: float = 0.75
    norm_pix_loss: bool = True
    img_size: int = 224
    crop_scale: list[float] = field(default_factory=lambda: [0.2, 1.0])
    decoder_dim: int = 512
    decoder_depth: int = 8
    decoder_heads: int = 16
    decoder_channel_embed: int = 128
    decoder_lora_rank: int = 8
    decoder_lora_alpha: float = 8.0


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``(B, C, H, W) -> (B, N, p*p*C)``, patches row-major, pixels (p, p, C) as MAE."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)


class MaeDecoder(nn.Module):
    """MAE's light decoder on timm Blocks: embed, re-insert mask tokens, fixed sin-cos positions
    (+ a channel-group code for group-channel encoders), blocks, norm, pixel head(s)."""

    def __init__(self, enc_dim: int, n_patches: int, patch_pixels: Sequence[int], n_groups: int = 1,
                 dim: int = 512, depth: int = 8, heads: int = 16, channel_embed: int = 128):
        super().__init__()
        from timm.models.vision_transformer import Block

        from domainfm.models.explora.satmae import sincos_1d, sincos_2d

        grid = int(round(math.sqrt(n_patches)))
        self.n_groups = n_groups
        self.decoder_embed = nn.Linear(enc_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.normal_(self.mask_token, std=0.02)
        pos_dim = dim - channel_embed if n_groups > 1 else dim
        self.register_buffer("pos", torch.from_numpy(sincos_2d(pos_dim, grid)).float().unsqueeze(0), persistent=False)
        if n_groups > 1:
            chan = torch.from_numpy(sincos_1d(channel_embed, np.arange(n_groups))).float()
            self.register_buffer("chan", chan.unsqueeze(0), persistent=False)
        self.decoder_blocks = nn.Sequential(*[Block(dim, heads, qkv_bias=True) for _ in range(depth)])
        self.decoder_norm = nn.LayerNorm(dim)
        self.decoder_pred = nn.ModuleList(nn.Linear(dim, n) for n in patch_pixels)

    def encodings(self, n_patches: int) -> torch.Tensor:
        pos = self.pos[:, 1:]
        if self.n_groups == 1:
            return pos
        g = self.n_groups
        pos = pos.unsqueeze(1).expand(-1, g, -1, -1)
        chan = self.chan.unsqueeze(2).expand(-1, -1, n_patches, -1)
        return torch.cat([pos, chan], dim=-1).flatten(1, 2)

    def forward(self, latent: torch.Tensor, restore: torch.Tensor, n_patches: int) -> list[torch.Tensor]:
        x = self.decoder_embed(latent)
        cls, kept = x[:, :1], x[:, 1:]
        n_tokens = restore.shape[1]
        fill = self.mask_token.expand(x.shape[0], n_tokens - kept.shape[1], -1)
        full = torch.cat([kept, fill], dim=1)
        full = torch.gather(full, 1, restore.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
        full = full + self.encodings(n_patches)
        cls = cls + self.pos[:, :1, : cls.shape[-1]] if self.n_groups == 1 else cls
        h = self.decoder_norm(self.decoder_blocks(torch.cat([cls, full], dim=1)))[:, 1:]
        per_group = h.reshape(h.shape[0], self.n_groups, n_patches, -1)
        return [pred(per_group[:, i]) for i, pred in enumerate(self.decoder_pred)]


class MaePretrainer(nn.Module):
    """MAE on a timm ViT or a :class:`GroupChannelViT`: ``forward(images) -> (loss, logs)``."""

    def __init__(self, encoder: nn.Module, settings: MaeSection):
        super().__init__()
        from domainfm.models.explora.satmae import GroupChannelViT

        self.settings = settings
        self.encoder = encoder
        self.grouped = isinstance(encoder, GroupChannelViT)
        if self.grouped:
            p, n = encoder.patch_size, encoder.num_patches
            groups = encoder.channel_groups
            pixels = [p * p * len(g) for g in groups]
        else:
            p = encoder.patch_embed.patch_size[0]
            n = encoder.patch_embed.num_patches
            groups = [tuple(range(encoder.patch_embed.proj.in_channels))]
            pixels = [p * p * len(groups[0])]
        self.patch, self.n_patches, self.groups = p, n, [list(g) for g in groups]
        self.decoder = MaeDecoder(encoder.embed_dim, n, pixels, n_groups=len(groups), dim=settings.decoder_dim,
                                  depth=settings.decoder_depth, heads=settings.decoder_heads,
                                  channel_embed=settings.decoder_channel_embed)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefix tokens with encodings, patch tokens with encodings ``(B, T, D)``)."""
        enc = self.encoder
        if self.grouped:
            return enc.cls_with_pos(x.shape[0]), enc.embed_groups(x).flatten(1, 2)
        h = enc._pos_embed(enc.patch_embed(x))
        return h[:, : enc.num_prefix_tokens], h[:, enc.num_prefix_tokens:]

    def forward(self, images: torch.Tensor):
        s = self.settings
        prefix, tokens = self._tokens(images)
        b, t, d = tokens.shape
        n_keep = max(1, int(round(t * (1 - s.mask_ratio))))
        noise = torch.rand(b, t, device=tokens.device)
        shuffle = noise.argsort(dim=1)
        restore = shuffle.argsort(dim=1)
        kept = torch.gather(tokens, 1, shuffle[:, :n_keep].unsqueeze(-1).expand(-1, -1, d))
        mask = torch.ones(b, t, device=tokens.device)
        mask[:, :n_keep] = 0
        mask = torch.gather(mask, 1, restore)  # 1 = masked, in token order
        enc = self.encoder
        h = torch.cat([prefix, kept], dim=1)
        if not self.grouped:
            h = enc.norm_pre(h)
        h = enc.norm(enc.blocks(h))
        if not self.grouped and enc.num_prefix_tokens > 1:  # drop registers, keep the class token
            h = torch.cat([h[:, :1], h[:, enc.num_prefix_tokens:]], dim=1)
        preds = self.decoder(h, restore, self.n_patches)
        mask = mask.reshape(b, len(self.groups), self.n_patches)
        losses, weights = [], []
        for gi, (pred, bands) in enumerate(zip(preds, self.groups)):
            target = patchify(images[:, bands], self.patch)
            if s.norm_pix_loss:
                mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
                target = (target - mean) / (var + 1e-6) ** 0.5
            per_patch = ((pred.float() - target.float()) ** 2).mean(dim=-1)
            losses.append((per_patch * mask[:, gi]).sum())
            weights.append(mask[:, gi].sum())
        loss = sum(losses) / torch.stack(weights).sum().clamp(min=1)
        return loss, {"masked_fraction": float(mask.mean())}


class MaeRecipe(Recipe):
    def __init__(self, pretrainer: MaePretrainer, train_dataset):
        self.model, self.train_dataset = pretrainer, train_dataset

    def step(self, model, images):
        return model(images)
