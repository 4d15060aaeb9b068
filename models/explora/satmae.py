"""SatMAE's group-channel ViT for multispectral imagery (Cong et al., NeurIPS 2022,
https://arxiv.org/abs/2207.08051), as used by ExPLoRA's fMoW-Sentinel runs.

The bands are split into groups (SatMAE / ExPLoRA on fMoW-Sentinel keep 10 Sentinel-2 bands,
B1, B9 and B10 dropped, grouped ``[[0,1,2,6], [3,4,5,7], [8,9]]``: visible + NIR, red edge,
SWIR). Each group has its own patch embedding, so an image of ``L`` patches becomes ``G * L``
tokens. Every token gets a fixed sin-cos encoding: the 2-D position on the first ``D - 256``
dimensions and a 1-D *channel-group* encoding on the last 256:

.. math::
    z_{g,l} = E_g\\,x_{g,l} + [\\,p_l \\,\\|\\, c_g\\,], \\qquad
    z_{cls} = t_{cls} + [\\,p_0 \\,\\|\\, 0\\,]

The transformer blocks are timm's :class:`~timm.models.vision_transformer.Block` (no ViT is
re-written here). Classification pools the mean of all ``G * L`` tokens through ``fc_norm``
(``global_pool="avg"``), as SatMAE's fine-tuning model does, or takes the class token.

**Shapes:** ``forward(x)``: ``(B, C, H, W) -> (B, n_outputs)`` with ``C = sum of group sizes``
(or more, when ``channel_groups`` index a subset); ``forward_features(x) -> (B, 1 + G*L, D)``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch import nn

__all__ = ["GroupChannelViT", "sincos_1d", "sincos_2d", "SENTINEL2_GROUPS", "freeze_fixed_encodings"]

#: ExPLoRA / SatMAE groups over the 10 kept bands (B2,B3,B4,B5,B6,B7,B8,B8A,B11,B12)
SENTINEL2_GROUPS = ((0, 1, 2, 6), (3, 4, 5, 7), (8, 9))


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """MAE's 1-D sin-cos table ``(len(positions), dim)``: ``[sin(p w_k), cos(p w_k)]``,
    ``w_k = 10000^{-2k/dim}``."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding dim must be even, got {dim}")
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, grid_size: int, cls_token: bool = True) -> np.ndarray:
    """MAE's 2-D sin-cos table ``(1 + grid**2, dim)`` (a zero row first for the class token)."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding dim must be divisible by 4, got {dim}")
    grid_h, grid_w = np.meshgrid(np.arange(grid_size, dtype=np.float64), np.arange(grid_size, dtype=np.float64))
    # MAE's convention: the first half encodes the column (w), the second the row (h)
    emb = np.concatenate([sincos_1d(dim // 2, grid_h), sincos_1d(dim // 2, grid_w)], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros((1, dim)), emb], axis=0)
    return emb


class GroupChannelViT(nn.Module):
    """Group-channel ViT encoder with a classification head.

    Args:
        img_size: square input side (SatMAE/ExPLoRA fMoW-Sentinel: 96).
        patch_size: 8 in SatMAE's multispectral models.
        in_chans: bands in the input tensor.
        channel_groups: band indices of each group (every index < ``in_chans``).
        embed_dim, depth, num_heads, mlp_ratio: transformer size (ViT-L: 1024, 24, 16, 4).
        channel_embed: width of the channel-group encoding (256).
        n_outputs: head classes (0: ``forward`` returns pooled features).
        global_pool: ``"avg"`` (mean of all tokens + ``fc_norm``) or ``"token"``.
        drop_path_rate: stochastic depth, linearly increasing over the blocks.
        init_values: LayerScale init (``None``: no LayerScale, as MAE/SatMAE).
    """

    def __init__(
        self,
        *,
        img_size: int = 96,
        patch_size: int = 8,
        in_chans: int = 10,
        channel_groups: Sequence[Sequence[int]] = SENTINEL2_GROUPS,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        channel_embed: int = 256,
        n_outputs: int = 0,
        global_pool: str = "avg",
        drop_path_rate: float = 0.0,
        init_values: float | None = None,
    ) -> None:
        super().__init__()
        groups = [list(g) for g in channel_groups]
        flat = [i for g in groups for i in g]
        if not groups or any(not g for g in groups):
            raise ValueError(f"channel_groups={channel_groups!r}: need at least one non-empty group")
        if len(set(flat)) != len(flat) or min(flat) < 0 or max(flat) >= in_chans:
            raise ValueError(
                f"channel_groups={channel_groups!r}: band indices must be distinct and in [0, {in_chans}) "
                f"for in_chans={in_chans}"
            )
        if global_pool not in {"avg", "token"}:
            raise ValueError(f"global_pool={global_pool!r}: expected 'avg' or 'token'")
        if not 0 < channel_embed < embed_dim or (embed_dim - channel_embed) % 4 or channel_embed % 2:
            raise ValueError(
                f"channel_embed={channel_embed} with embed_dim={embed_dim}: need 0 < channel_embed < embed_dim, "
                "embed_dim - channel_embed divisible by 4 and channel_embed even"
            )
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} is not a multiple of patch_size={patch_size}")
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.channel_groups = [tuple(g) for g in groups]
        self.num_features = self.embed_dim = embed_dim
        self.global_pool = global_pool
        self.num_prefix_tokens = 1
        self.patch_embed = nn.ModuleList(
            PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=len(g), embed_dim=embed_dim) for g in groups
        )
        grid = img_size // patch_size
        self.num_patches = grid * grid
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # fixed (requires_grad=False) parameters, as in SatMAE: they are in its checkpoints
        pos = torch.from_numpy(sincos_2d(embed_dim - channel_embed, grid)).float().unsqueeze(0)
        self.pos_embed = nn.Parameter(pos, requires_grad=False)
        chan = torch.from_numpy(sincos_1d(channel_embed, np.arange(len(groups)))).float().unsqueeze(0)
        self.channel_embed = nn.Parameter(chan, requires_grad=False)
        dpr = [float(v) for v in np.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=True, init_values=init_values,
                  drop_path=dpr[i], norm_layer=nn.LayerNorm)
            for i in range(depth)
        ])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "token" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "avg" else nn.Identity()
        self.head = nn.Linear(embed_dim, n_outputs) if n_outputs > 0 else nn.Identity()
        nn.init.normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)
        for pe in self.patch_embed:  # MAE: patch embeddings initialised like a Linear
            w = pe.proj.weight.data
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def n_groups(self) -> int:
        return len(self.channel_groups)

    def group_pos_embed(self) -> torch.Tensor:
        """``(1, G, L, D)``: position (first ``D-256`` dims) ‖ channel group (last 256)."""
        g, l = self.n_groups, self.num_patches
        pos = self.pos_embed[:, 1:, :].unsqueeze(1).expand(-1, g, -1, -1)
        chan = self.channel_embed.unsqueeze(2).expand(-1, -1, l, -1)
        return torch.cat([pos, chan], dim=-1)

    def embed_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Patch tokens with encodings, ``(B, C, H, W) -> (B, G, L, D)`` (no class token)."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(
                f"GroupChannelViT expects (B, {self.in_chans}, {self.img_size}, {self.img_size}), got {tuple(x.shape)}"
            )
        tokens = torch.stack([pe(x[:, list(g)]) for pe, g in zip(self.patch_embed, self.channel_groups)], dim=1)
        return tokens + self.group_pos_embed().to(tokens.dtype)

    def cls_with_pos(self, batch: int) -> torch.Tensor:
        zeros = self.cls_token.new_zeros(1, 1, self.channel_embed.shape[-1])
        pos = torch.cat([self.pos_embed[:, :1, :], zeros], dim=-1)
        return (self.cls_token + pos).expand(batch, -1, -1)

    def forward_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Class token + ``tokens`` ``(B, T, D)`` through the blocks and final norm."""
        x = torch.cat([self.cls_with_pos(tokens.shape[0]), tokens], dim=1)
        return self.norm(self.blocks(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_tokens(self.embed_groups(x).flatten(1, 2))

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            pooled = self.fc_norm(features[:, self.num_prefix_tokens:].mean(dim=1))
        else:
            pooled = features[:, 0]
        return pooled if pre_logits else self.head(pooled)

    def reset_classifier(self, n_outputs: int) -> None:
        self.head = nn.Linear(self.embed_dim, n_outputs) if n_outputs > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def freeze_fixed_encodings(model: nn.Module) -> nn.Module:
    """Keep a :class:`GroupChannelViT`'s sin-cos position and channel tables frozen.

    They are fixed by design (SatMAE), also when every other parameter trains (full fine-tuning
    or full extended pretraining calls ``requires_grad_(True)`` on the whole model); any other
    model is returned unchanged.
    """
    if isinstance(model, GroupChannelViT):
        model.pos_embed.requires_grad_(False)
        model.channel_embed.requires_grad_(False)
    return model
