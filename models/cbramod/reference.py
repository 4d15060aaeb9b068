"""A plain restatement of the official CBraMod forward, in the official key layout.

``nn.MultiheadAttention`` per branch and the official ``.contiguous().view`` reshapes, written
from the paper and the official layout (github wjq-learning/CBraMod), independent of
:mod:`domainfm.models.cbramod.cbramod`. It is the reference the tests check our model against to
1e-5, and the "official-style" side of ``benchmarks/cbramod.py``. Its state_dict keys are the
official checkpoint's (``patch_embedding.*``, ``encoder.layers.{i}.*``, ``proj_out.0.*``).

**Shapes:** input (B, C, N, 200) patches in 100 µV units, optional mask (B, C, N) of 0/1;
:meth:`RefCBraMod.features` returns (B, C, N, 200), ``forward`` the reconstruction.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RefPatchEmbedding", "RefLayer", "RefEncoder", "RefCBraMod"]


class RefPatchEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.positional_encoding = nn.Sequential(nn.Conv2d(200, 200, (19, 7), (1, 1), (9, 3), groups=200))
        self.mask_encoding = nn.Parameter(torch.zeros(200), requires_grad=False)
        self.proj_in = nn.Sequential(
            nn.Conv2d(1, 25, (1, 49), (1, 25), (0, 24)), nn.GroupNorm(5, 25), nn.GELU(),
            nn.Conv2d(25, 25, (1, 3), (1, 1), (0, 1)), nn.GroupNorm(5, 25), nn.GELU(),
            nn.Conv2d(25, 25, (1, 3), (1, 1), (0, 1)), nn.GroupNorm(5, 25), nn.GELU(),
        )
        self.spectral_proj = nn.Sequential(nn.Linear(101, 200), nn.Dropout(0.1))

    def forward(self, x, mask=None):
        bz, ch, pn, ps = x.shape
        mask_x = x.clone()
        if mask is not None:
            mask_x[mask == 1] = self.mask_encoding
        img = mask_x.contiguous().view(bz, 1, ch * pn, ps)
        emb = self.proj_in(img).permute(0, 2, 1, 3).contiguous().view(bz, ch, pn, 200)
        spec = torch.abs(torch.fft.rfft(img.view(bz * ch * pn, ps), dim=-1, norm="forward")).view(bz, ch, pn, 101)
        emb = emb + self.spectral_proj(spec)
        pos = self.positional_encoding(emb.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return emb + pos


class RefLayer(nn.Module):
    def __init__(self, ffn=800):
        super().__init__()
        self.self_attn_s = nn.MultiheadAttention(100, 4, dropout=0.1, batch_first=True)
        self.self_attn_t = nn.MultiheadAttention(100, 4, dropout=0.1, batch_first=True)
        self.linear1 = nn.Linear(200, ffn)
        self.linear2 = nn.Linear(ffn, 200)
        self.norm1 = nn.LayerNorm(200)
        self.norm2 = nn.LayerNorm(200)
        self.dropout, self.dropout1, self.dropout2 = nn.Dropout(0.1), nn.Dropout(0.1), nn.Dropout(0.1)

    def sa(self, x):
        bz, ch, pn, d = x.shape
        xs = x[:, :, :, : d // 2].transpose(1, 2).contiguous().view(bz * pn, ch, d // 2)
        xt = x[:, :, :, d // 2 :].contiguous().view(bz * ch, pn, d // 2)
        xs = self.self_attn_s(xs, xs, xs, need_weights=False)[0].contiguous().view(bz, pn, ch, d // 2).transpose(1, 2)
        xt = self.self_attn_t(xt, xt, xt, need_weights=False)[0].contiguous().view(bz, ch, pn, d // 2)
        return self.dropout1(torch.cat((xs, xt), dim=3))

    def forward(self, x):
        x = x + self.sa(self.norm1(x))
        return x + self.dropout2(self.linear2(self.dropout(F.gelu(self.linear1(self.norm2(x))))))


class RefEncoder(nn.Module):
    def __init__(self, n_layers, ffn):
        super().__init__()
        self.layers = nn.ModuleList([RefLayer(ffn) for _ in range(n_layers)])


class RefCBraMod(nn.Module):
    def __init__(self, n_layers=12, ffn=800):
        super().__init__()
        self.patch_embedding = RefPatchEmbedding()
        self.encoder = RefEncoder(n_layers, ffn)
        self.proj_out = nn.Sequential(nn.Linear(200, 200))

    def features(self, x, mask=None):
        h = self.patch_embedding(x, mask)
        for layer in self.encoder.layers:
            h = layer(h)
        return h

    def forward(self, x, mask=None):
        return self.proj_out(self.features(x, mask))
