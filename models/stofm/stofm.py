"""SToFM's SE(2) transformer: a distance-biased transformer over the tokens of a sub-slice.

Zhao et al., "SToFM: a Multi-scale Foundation Model for Spatial Transcriptomics", ICML 2025
(https://arxiv.org/abs/2507.11588; official code github.com/PharMolix/SToFM, MIT).

A sub-slice is a sequence of tokens: one ``[CLS]`` (token type 1), every macro-scale hypernode
of the slice (type 2) and the sub-slice's cells (type 0); padding has type 3. Each token carries a
256-d embedding (a cell encoder's output, the hypernode's mean embedding, zeros for ``[CLS]``) and
the pairwise distances ``D`` (kNN distances on coordinates normalised to a bounding-box diagonal
of 100; 100 for non-neighbours; 0 on the ``[CLS]`` row/column, the diagonal and padding).

.. math::
    h^{(0)} &= W_e x + E_{\\mathrm{type}} \\\\
    \\phi_k(D_{ij}) &= \\mathcal{N}(a D_{ij} + b;\\ \\mu_k, |\\sigma_k| + 10^{-5}),\\quad k=1..K \\\\
    B^{(0)}_{h,ij} &= [D_{ij} \\ne 0]\\ \\big(W_2\\,\\mathrm{ReLU}(W_1 \\phi(D_{ij}) + c_1) + c_2\\big)_h \\\\
    A^{(l)}_{h} &= \\frac{Q_h K_h^\\top}{\\sqrt{d_h}} + B^{(l)}_h,\\qquad B^{(l+1)} = A^{(l)}
        \\text{ (padding columns set to 0)} \\\\
    h &\\leftarrow \\mathrm{LN}(h + \\mathrm{Drop}(W_o\\,\\mathrm{softmax}(A^{(l)}) V)),\\quad
    h \\leftarrow \\mathrm{LN}(h + \\mathrm{Drop}(W_2\\,\\mathrm{GELU}(W_1 h)))

Each layer's attention logits (bias included) are the next layer's bias (Uni-Mol style) and the
last layer's logits are the *pair representation* read by the distance-recovery head. Post-LN.

**The cost trap and how it is avoided.** The official module evaluates the Gaussian basis and its
``K -> K -> heads`` MLP on every entry of ``D``: a ``[B, N, N, K]`` tensor (620 MB per 1,100-token
sub-slice in fp32) and ``2 N^2 K^2`` FLOPs. But the bias is an elementwise function of the distance
value, and a sub-slice holds few distinct values (every non-neighbour is exactly 100, every
``[CLS]``/diagonal/padding entry 0, each kNN distance appears twice). :class:`GaussianDistanceBias`
therefore evaluates the function once per *distinct* value (``torch.unique``, in chunks) and
gathers the result: the same numbers as the official formulation, without the big tensor. In
inference the attention also reuses each layer's logits buffer in place and applies the softmax
in row chunks, so about one ``[B, H, N, N]`` buffer is alive at a time.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SToFM", "GaussianDistanceBias", "DistanceBiasedAttention", "SToFMLayer", "SToFMEncoder",
           "TOKEN_CELL", "TOKEN_CLS", "TOKEN_HYPERNODE", "TOKEN_PAD", "MASK_VALUE"]

#: token types of the official code (``SToFMConfig``: norm 0, cls 1, hyper 2, pad 3)
TOKEN_CELL, TOKEN_CLS, TOKEN_HYPERNODE, TOKEN_PAD = 0, 1, 2, 3
#: the official constant written into masked cells' input embeddings (and unset labels)
MASK_VALUE = -100.0

# distinct distance values evaluated per chunk: [chunk, K] floats stay small (32 MB at K=128)
_BASIS_CHUNK = 65536
# query rows per softmax chunk in inference
_ROW_CHUNK = 256


class GaussianDistanceBias(nn.Module):
    """Distances ``(B, N, N)`` -> per-head additive attention bias ``(B, H, N, N)``.

    Official key layout: ``linear`` (``Linear(1, 1)``: an affine map of the distance), ``means``
    and ``stds`` (``Embedding(1, K)``: the K kernels), ``proj.0``/``proj.2`` (``Linear(K, K)``,
    ReLU, ``Linear(K, H)``). Entries whose distance is exactly 0 get a zero bias.

    Args:
        n_heads: attention heads ``H``.
        n_kernels: Gaussian kernels ``K`` (128).
    """

    def __init__(self, n_heads: int, n_kernels: int = 128):
        super().__init__()
        self.n_heads, self.n_kernels = n_heads, n_kernels
        self.linear = nn.Linear(1, 1)
        self.means = nn.Embedding(1, n_kernels)
        self.stds = nn.Embedding(1, n_kernels)
        self.proj = nn.Sequential(nn.Linear(n_kernels, n_kernels), nn.ReLU(), nn.Linear(n_kernels, n_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # the official `_init_weights` for GaussianModule
        nn.init.uniform_(self.means.weight, 0, 3)
        nn.init.uniform_(self.stds.weight, 0, 3)
        nn.init.ones_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        for layer in (self.proj[0], self.proj[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def basis(self, values: torch.Tensor) -> torch.Tensor:
        """The per-head bias of each distance value: ``(...)`` -> ``(..., H)`` (zero where 0)."""
        x = self.linear(values.float().unsqueeze(-1))  # (..., 1), broadcast against the K kernels
        mean = self.means.weight.float().view(-1)
        std = self.stds.weight.float().view(-1).abs() + 1e-5
        phi = torch.exp(-0.5 * ((x - mean) / std) ** 2) / (math.sqrt(2 * math.pi) * std)
        out = self.proj(phi)
        return out.masked_fill(values.eq(0).unsqueeze(-1), 0.0)

    def forward(self, distances: torch.Tensor) -> torch.Tensor:
        if distances.dim() != 3 or distances.shape[1] != distances.shape[2]:
            raise ValueError(f"distances must be (batch, n_tokens, n_tokens), got {tuple(distances.shape)}")
        b, n, _ = distances.shape
        values, inverse = torch.unique(distances.float(), return_inverse=True)
        table = torch.cat([self.basis(chunk) for chunk in values.split(_BASIS_CHUNK)])  # (U, H)
        table_t = table.t().contiguous()  # (H, U): one gather per example gives (H, N, N) rows
        flat = inverse.view(b, n * n)
        if torch.is_grad_enabled() and table.requires_grad:
            return torch.stack([table_t[:, flat[i]] for i in range(b)]).view(b, self.n_heads, n, n)
        out = torch.empty(b, self.n_heads, n * n, dtype=table.dtype, device=table.device)
        for i in range(b):
            torch.index_select(table_t, 1, flat[i], out=out[i])
        return out.view(b, self.n_heads, n, n)


class DistanceBiasedAttention(nn.Module):
    """Multi-head self-attention whose logits get an additive per-head bias and are returned.

    Official keys ``q_proj``/``k_proj``/``v_proj``/``out_proj`` (plain ``nn.Linear``, so LoRA can
    wrap them).

    **Shapes:** ``x (B, N, d)``, ``bias (B, H, N, N)``, ``pad (B, N)`` bool (True = padding) ->
    ``(B, N, d)`` and the logits ``(B, H, N, N)`` with padding columns set to 0.
    """

    def __init__(self, dim: int, n_heads: int, attention_dropout: float = 0.1):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"embed_dim={dim} must be divisible by n_heads={n_heads}")
        self.dim, self.n_heads, self.head_dim = dim, n_heads, dim // n_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attention_dropout = nn.Dropout(attention_dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None,
                bias_is_scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q = self._heads(self.q_proj(x) * self.scaling)
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        if torch.is_grad_enabled():
            logits = torch.matmul(q, k.transpose(-1, -2)) + bias
            if pad is not None:
                cols = pad[:, None, None, :]
                probs = torch.softmax(logits.masked_fill(cols, float("-inf")), dim=-1)
                logits = logits.masked_fill(cols, 0.0)
            else:
                probs = torch.softmax(logits, dim=-1)
            out = torch.matmul(self.attention_dropout(probs), v)
        else:
            logits, out = self._inference(q, k, v, bias, pad, bias_is_scratch)
        out = out.transpose(1, 2).reshape(b, n, self.dim)
        return self.out_proj(out), logits

    def _inference(self, q, k, v, bias, pad, bias_is_scratch):
        """Logits in place of the (scratch) bias buffer, softmax and ``@ v`` in row chunks."""
        b, h, n, hd = q.shape
        q3, k3, v3 = q.reshape(b * h, n, hd), k.reshape(b * h, n, hd), v.reshape(b * h, n, hd)
        if bias_is_scratch and bias.is_contiguous() and bias.dtype == q.dtype:
            logits = bias.view(b * h, n, n).baddbmm_(q3, k3.transpose(1, 2))
        else:
            logits = torch.baddbmm(bias.reshape(b * h, n, n).to(q.dtype), q3, k3.transpose(1, 2))
        additive = None
        if pad is not None and bool(pad.any()):
            additive = torch.zeros(b, n, dtype=q.dtype, device=q.device).masked_fill(pad, float("-inf"))
            additive = additive.repeat_interleave(h, dim=0).unsqueeze(1)  # (B*H, 1, N)
        out = torch.empty(b * h, n, hd, dtype=q.dtype, device=q.device)
        for start in range(0, n, _ROW_CHUNK):
            rows = logits[:, start:start + _ROW_CHUNK]
            probs = torch.softmax(rows + additive if additive is not None else rows, dim=-1)
            torch.bmm(self.attention_dropout(probs), v3, out=out[:, start:start + _ROW_CHUNK])
        if additive is not None:
            logits.view(b, h, n, n).masked_fill_(pad[:, None, None, :], 0.0)
        return logits.view(b, h, n, n), out.view(b, h, n, hd)


class SToFMLayer(nn.Module):
    """Post-LN transformer layer (official keys ``self_attn``, ``self_attn_layer_norm``, ``fc1``,
    ``fc2``, ``final_layer_norm``), GELU feed-forward."""

    def __init__(self, dim: int, n_heads: int, ffn_dim: int, dropout: float = 0.1,
                 attention_dropout: float = 0.1, activation_dropout: float = 0.1):
        super().__init__()
        self.self_attn = DistanceBiasedAttention(dim, n_heads, attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x, bias, pad, bias_is_scratch: bool = False):
        attn, logits = self.self_attn(x, bias, pad, bias_is_scratch)
        x = self.self_attn_layer_norm(x + self.dropout(attn))
        y = self.fc2(self.activation_dropout(F.gelu(self.fc1(x))))
        x = self.final_layer_norm(x + self.dropout(y))
        return x, logits


class SToFMEncoder(nn.Module):
    def __init__(self, n_layers: int, **layer_kwargs):
        super().__init__()
        self.layers = nn.ModuleList([SToFMLayer(**layer_kwargs) for _ in range(n_layers)])

    def forward(self, x, bias, pad, bias_is_scratch: bool = False):
        for layer in self.layers:
            # every bias after the first is the previous layer's logits: ours to overwrite
            x, bias = layer(x, bias, pad, bias_is_scratch)
            bias_is_scratch = True
        return x, bias


class SToFM(nn.Module):
    """The SToFM SE(2) transformer (official ``SToFMModel``) with optional heads.

    Args:
        input_dim: width of the input token embeddings (256, the cell encoder's projection).
        embed_dim: model width ``d`` (released: 256).
        n_layers: transformer layers (12).
        n_heads: attention heads (32).
        ffn_dim: feed-forward width (released: 256).
        n_kernels: Gaussian distance kernels ``K`` (128).
        dropout, attention_dropout, activation_dropout: 0.1 each, as officially.
        n_outputs: classes of a per-token classifier ``head`` (``None``: no head).
        pretrain_heads: build ``lm_head`` (masked cell modelling) and ``pair_head`` (distance
            recovery), as in the official ``SToFMForMaskedLM``.

    **Shapes:** ``forward_features(token_embeddings (B, N, input_dim), distances (B, N, N),
    token_types (B, N))`` -> ``(B, N, d)`` (with ``return_pair=True`` also the pair
    representation ``(B, N, N, H)``); ``forward`` -> per-token logits ``(B, N, n_outputs)``
    (or the features when there is no head).
    """

    def __init__(self, input_dim: int = 256, embed_dim: int = 256, n_layers: int = 12, n_heads: int = 32,
                 ffn_dim: int = 256, n_kernels: int = 128, dropout: float = 0.1, attention_dropout: float = 0.1,
                 activation_dropout: float = 0.1, n_outputs: int | None = None, pretrain_heads: bool = False,
                 head_dropout: float = 0.0):
        super().__init__()
        if n_outputs is not None and n_outputs <= 0:
            raise ValueError(f"n_outputs={n_outputs}: must be positive (or None for no head)")
        self.input_dim, self.embed_dim, self.n_heads = input_dim, embed_dim, n_heads
        self.num_features = embed_dim
        self.head_dropout = head_dropout
        self.embedding_layer = nn.Linear(input_dim, embed_dim)
        self.token_type_embeddings = nn.Embedding(4, embed_dim)
        self.gaussian = GaussianDistanceBias(n_heads, n_kernels)
        self.encoder = SToFMEncoder(n_layers, dim=embed_dim, n_heads=n_heads, ffn_dim=ffn_dim, dropout=dropout,
                                    attention_dropout=attention_dropout, activation_dropout=activation_dropout)
        self.dropout = nn.Dropout(dropout)
        self._init_weights()
        if pretrain_heads:
            # officially Linear(d, d) -> ReLU -> Linear(d, d), predicting the d = 256 input embedding; the
            # last layer maps to input_dim so that a model with d != input_dim predicts the right width
            self.lm_head = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, input_dim))
            self.pair_head = nn.Sequential(nn.Linear(n_heads, n_heads), nn.ReLU(), nn.Linear(n_heads, 1))
            for module in (self.lm_head, self.pair_head):
                module.apply(_init_normal)
        else:
            self.lm_head = self.pair_head = None
        self.head = None
        self.n_outputs = None
        if n_outputs is not None:
            self.reset_classifier(n_outputs)

    def _init_weights(self) -> None:
        # the official `_init_weights`: N(0, 0.02) linears/embeddings, zero biases; unit LayerNorms
        for name, module in self.named_modules():
            if name.startswith("gaussian"):
                continue
            _init_normal(module)
        self.gaussian.reset_parameters()

    # -- input checks ---------------------------------------------------------------------------

    def _check(self, token_embeddings, distances, token_types):
        if token_embeddings.dim() != 3 or token_embeddings.shape[-1] != self.input_dim:
            raise ValueError(f"token_embeddings must be (batch, n_tokens, {self.input_dim}), "
                             f"got {tuple(token_embeddings.shape)}")
        b, n, _ = token_embeddings.shape
        if tuple(distances.shape) != (b, n, n):
            raise ValueError(f"distances must be (batch, n_tokens, n_tokens) = {(b, n, n)}, got {tuple(distances.shape)}")
        if tuple(token_types.shape) != (b, n):
            raise ValueError(f"token_types must be (batch, n_tokens) = {(b, n)}, got {tuple(token_types.shape)}")

    # -- backbone -------------------------------------------------------------------------------

    def forward_features(self, token_embeddings: torch.Tensor, distances: torch.Tensor, token_types: torch.Tensor,
                         *, return_pair: bool = False):
        """Token representations ``(B, N, d)`` of a padded batch of sub-slices (padding: type 3).

        With ``return_pair=True`` returns ``(features, pair)``: the last layer's attention logits
        as ``(B, N, N, H)`` (the official ``pair_rep``; padding columns 0).
        """
        self._check(token_embeddings, distances, token_types)
        token_types = token_types.long()
        x = self.embedding_layer(token_embeddings) + self.token_type_embeddings(token_types)
        x = self.dropout(x)
        pad = token_types.eq(TOKEN_PAD)
        bias = self.gaussian(distances).to(x.dtype)
        x, logits = self.encoder(x, bias, pad if bool(pad.any()) else None, bias_is_scratch=True)
        if return_pair:
            return x, logits.permute(0, 2, 3, 1)
        return x

    # -- heads ----------------------------------------------------------------------------------

    def forward_pretrain(self, token_embeddings, distances, token_types):
        """``(features, lm_out (B, N, d) L2-normalised, pair_pred (B, N, N))`` for pretraining."""
        if self.lm_head is None or self.pair_head is None:
            raise RuntimeError("this SToFM was built without pretrain_heads=True (no lm_head/pair_head)")
        features, pair = self.forward_features(token_embeddings, distances, token_types, return_pair=True)
        lm = F.normalize(self.lm_head(features), dim=-1)
        return features, lm, self.pair_head(pair).squeeze(-1)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        # without a head (n_outputs=None) the head is the identity, as timm's num_classes=0
        if pre_logits or self.head is None:
            return features
        return self.head(features)

    def reset_classifier(self, n_outputs: int) -> None:
        """A fresh per-token ``head``: dropout + ``Linear(d, n_outputs)``."""
        self.head = nn.Sequential(nn.Dropout(self.head_dropout), nn.Linear(self.embed_dim, n_outputs))
        self.head.apply(_init_normal)
        self.n_outputs = n_outputs

    def forward(self, token_embeddings, distances, token_types):
        features = self.forward_features(token_embeddings, distances, token_types)
        return features if self.head is None else self.forward_head(features)


def _init_normal(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
