"""A plain restatement of the official SToFM forward, in the official key layout.

Written from the paper and the official layout (github PharMolix/SToFM, ``model/se2transformer.py``),
independent of :mod:`domainfm.models.stofm.stofm`: the Gaussian basis is evaluated on the full
``[B, N, N, K]`` tensor, attention runs in the official ``(N, B, d)`` layout with
``bsz * num_heads`` batched matmuls, and each layer's logits (padding columns ``-inf`` -> 0) are
passed to the next layer as its bias. It is the reference the tests check our model against, and
the "official-style" side of ``benchmarks/stofm.py``. Its state_dict keys are the official
``se2transformer.pth``'s (plus ``lm_head``/``pair_head`` as in ``SToFMForMaskedLM``, under
``heads``=True).

**Shapes:** ``token_embeddings (B, N, input_dim)``, ``distances (B, N, N)``, ``token_types (B, N)``
-> ``(last_hidden_state (B, N, d), pair_rep (B, N, N, H))``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RefGaussian", "RefAttention", "RefLayer", "RefEncoder", "RefSToFM"]


class RefGaussian(nn.Module):
    def __init__(self, heads, k=128):
        super().__init__()
        self.k = k
        self.linear = nn.Linear(1, 1)
        self.means = nn.Embedding(1, k)
        self.stds = nn.Embedding(1, k)
        self.proj = nn.Sequential(nn.Linear(k, k), nn.ReLU(), nn.Linear(k, heads))

    def forward(self, d):  # [bs, n, n]
        zero = d.eq(0.0)
        x = self.linear(d.unsqueeze(-1)).expand(-1, -1, -1, self.k)  # [bs, n, n, K]
        mean = self.means.weight.float().view(-1)
        std = self.stds.weight.float().view(-1).abs() + 1e-5
        x = torch.exp(-0.5 * (((x - mean) / std) ** 2)) / ((2 * math.pi) ** 0.5 * std)
        x = self.proj(x).permute(0, 3, 1, 2).contiguous()  # [bs, heads, n, n]
        return x.masked_fill(zero.unsqueeze(1).expand_as(x), 0.0)


class RefAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, bias, pad):  # x [n, bs, dim], bias [bs, heads, n, n], pad [bs, n]
        n, bs, dim = x.shape
        q = self.q_proj(x) * self.scaling
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = q.contiguous().view(n, bs * self.heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(n, bs * self.heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(n, bs * self.heads, self.head_dim).transpose(0, 1)
        w = torch.bmm(q, k.transpose(1, 2)) + bias.contiguous().view(bs * self.heads, n, n)
        w = w.view(bs, self.heads, n, n).masked_fill(pad[:, None, None, :], float("-inf")).view(bs * self.heads, n, n)
        pair = w.clone().masked_fill(w == -math.inf, 0).view(bs, self.heads, n, n)
        p = F.softmax(w, dim=-1)
        out = torch.bmm(p, v).transpose(0, 1).contiguous().view(n, bs, dim)
        return self.out_proj(out), pair


class RefLayer(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.self_attn = RefAttention(dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.fc2 = nn.Linear(ffn, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, bias, pad):
        a, pair = self.self_attn(x, bias, pad)
        x = self.self_attn_layer_norm(x + a)
        x = self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))
        return x, pair


class RefEncoder(nn.Module):
    def __init__(self, layers, dim, heads, ffn):
        super().__init__()
        self.layers = nn.ModuleList([RefLayer(dim, heads, ffn) for _ in range(layers)])


class RefSToFM(nn.Module):
    """The official ``SToFMModel`` forward (eval mode: dropout off)."""

    def __init__(self, input_dim=256, dim=256, layers=12, heads=32, ffn=256, k=128, heads_for_pretraining=False):
        super().__init__()
        self.embedding_layer = nn.Linear(input_dim, dim)
        self.token_type_embeddings = nn.Embedding(4, dim)
        self.gaussian = RefGaussian(heads, k)
        self.encoder = RefEncoder(layers, dim, heads, ffn)
        if heads_for_pretraining:
            self.lm_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, input_dim))
            self.pair_head = nn.Sequential(nn.Linear(heads, heads), nn.ReLU(), nn.Linear(heads, 1))

    def forward(self, token_embeddings, distances, token_types):
        x = self.embedding_layer(token_embeddings) + self.token_type_embeddings(token_types.long())
        bias = self.gaussian(distances)
        pad = token_types.eq(3)
        x = x.transpose(0, 1)
        pair = None
        for layer in self.encoder.layers:
            x, pair = layer(x, bias, pad)
            bias = pair
        return x.transpose(0, 1), pair.permute(0, 2, 3, 1).contiguous()
