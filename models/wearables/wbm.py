"""WBM: a wearable behavioural foundation model over hourly behavioural data.

Erturk et al., "Beyond Sensor Data: Foundation Models of Behavioral Data from Wearables Improve
Health Predictions", ICML 2025 (https://arxiv.org/abs/2507.00191). Neither code nor weights are
public; this is our implementation of the published design, with details the paper leaves open
chosen as in the open reimplementation OpenMHC (github.com/AshleyLab/OpenMHC) where known, and
otherwise as said in the comments.

A participant-week is ``n_times = 168`` hours of ``n_chans`` behavioural variables (steps, heart
rate, sleep minutes, ...), z-scored per variable, with an ``observed`` mask (an hour without a
record is missing, never zero). TST tokenisation makes **one token per hour** from that hour's
values and mask (the paper's best tokeniser, ahead of mTAN and tuple tokens):

.. math::
    e_t = W\\,[\\,x_t \\odot m_t \\;\\|\\; m_t\\,] + b

A backbone of ``n_layers`` pre-norm residual blocks mixes the tokens — Mamba-2 (the paper's
choice; :mod:`.mamba2`) or a Transformer with rotary position embeddings (the paper's
comparison) — then a final RMSNorm and a mean over the hours with at least one observed value
give the embedding ``(B, d_model)``. A two-layer projection head (``d -> d -> proj_dim``) maps it
into the space where the contrastive loss is computed (pretraining only); a linear ``head``
predicts ``n_outputs`` targets for fine-tuning.

The per-variable z-score statistics the input was normalised with are buffers of the model
(``zscore_mean``, ``zscore_std``), so they are saved with its weights and
:func:`domainfm.data_loaders.wearables.to_weeks` can normalise new data the same way.

The layout of OpenMHC's released WBM (``wbm-openmhc``; converter in :mod:`.openmhc`) is selected
by constructor options, each off by default: ``tokenizer="mlp"`` (a two-layer GELU MLP over the
hour's z-scores and *missing* flags), ``backbone="bimamba2"`` (post-norm blocks of a forward and
a time-reversed Mamba-2, a linear merge and a GELU FFN; no final norm), ``pool="all"`` (the mean
over all hours) and ``projector="linear" | "mlp3"`` (its two projection heads).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from domainfm.models.wearables.mamba2 import Mamba2

__all__ = ["WBM", "TSTTokenizer", "MLPTokenizer", "MambaBlock", "BiMambaBlock", "TransformerBlock",
           "RotaryEmbedding", "BACKBONES", "TOKENIZERS", "POOLINGS", "PROJECTORS"]

BACKBONES = ("mamba2", "transformer", "bimamba2")
TOKENIZERS = ("linear", "mlp")
POOLINGS = ("observed", "all")
PROJECTORS = ("mlp", "linear", "mlp3")


class TSTTokenizer(nn.Module):
    """One token per hour: a linear map of the hour's masked values and its observed mask.

    **Shapes:** values, observed ``(B, T, V)`` -> ``(B, T, d_model)``.
    """

    def __init__(self, n_chans: int, d_model: int):
        super().__init__()
        self.proj = nn.Linear(2 * n_chans, d_model)

    def forward(self, values: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        m = observed.to(values.dtype)
        return self.proj(torch.cat([torch.where(observed, values, torch.zeros_like(values)), m], dim=-1))


class MLPTokenizer(nn.Module):
    """One token per hour from ``[z-scores (0 where missing) || missing flags (1 = missing)]``
    through ``Linear -> GELU -> Linear`` (OpenMHC's hour-patch embedding: its flags mark what is
    *missing*, the complement of :class:`TSTTokenizer`'s observed mask).

    **Shapes:** values, observed ``(B, T, V)`` -> ``(B, T, d_model)``.
    """

    def __init__(self, n_chans: int, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(2 * n_chans, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(self, values: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        missing = (~observed).to(values.dtype)
        x = torch.cat([torch.where(observed, values, torch.zeros_like(values)), missing], dim=-1)
        return self.fc2(F.gelu(self.fc1(x)))


class BiMambaBlock(nn.Module):
    """Bidirectional post-norm block (OpenMHC's WBM):
    ``x = LN1(x + proj([fwd(x) || flip(bwd(flip(x)))]))``, then ``x = LN2(x + FFN(x))`` with a
    ``d -> ffn_mult d -> d`` GELU FFN. ``fwd`` and ``bwd`` are independent Mamba-2 mixers; ``bwd``
    reads the sequence backwards, so every hour sees the whole week.
    """

    def __init__(self, d_model: int, ffn_mult: int = 4, dropout: float = 0.0, **mixer):
        super().__init__()
        self.fwd = Mamba2(d_model, **mixer)
        self.bwd = Mamba2(d_model, **mixer)
        self.proj = nn.Linear(2 * d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.drop1 = nn.Dropout(dropout)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_mult * d_model), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_mult * d_model, d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backward = self.bwd(x.flip(1)).flip(1)
        x = self.norm1(x + self.drop1(self.proj(torch.cat([self.fwd(x), backward], dim=-1))))
        return self.norm2(x + self.drop2(self.ffn(x)))


class MambaBlock(nn.Module):
    """``x + Mamba2(RMSNorm(x))`` (the residual block of mamba_ssm's ``Block`` with no MLP)."""

    def __init__(self, d_model: int, dropout: float = 0.0, **mixer):
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.mixer = Mamba2(d_model, **mixer)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mixer(self.norm(x)))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) on the two halves of each head's channels."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim={head_dim} must be even")
        self.register_buffer("inv_freq", base ** (-torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, hd)
        t = torch.arange(x.shape[-2], device=x.device, dtype=self.inv_freq.dtype)
        angles = torch.outer(t, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TransformerBlock(nn.Module):
    """Pre-norm bidirectional self-attention with RoPE, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"TransformerBlock: d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.n_heads, self.dropout = n_heads, dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.rope = RotaryEmbedding(d_model // n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        hidden = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v,
                                              dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class WBM(nn.Module):
    """Wearable behavioural model: TST tokens -> Mamba-2 (or Transformer+RoPE) -> weekly embedding.

    Args:
        n_chans: behavioural variables per hour ``V``.
        n_times: hours per example (168, a week); any length runs, this is the nominal one.
        sfreq: samples per second (one per hour: ``1/3600``); anything else is refused.
        n_outputs: outputs of the linear ``head`` (``None``: no head; ``forward`` returns the embedding).
        backbone: ``"mamba2"`` (the paper's), ``"transformer"`` (Transformer+RoPE, the comparison)
            or ``"bimamba2"`` (OpenMHC's bidirectional post-norm blocks, :class:`BiMambaBlock`; no
            final norm).
        d_model: token and embedding width (256).
        n_layers: residual blocks (4).
        proj_dim: width of the contrastive projection (128; ``None``: no projection head).
        d_state, d_conv, expand, headdim, chunk_size: the Mamba-2 mixer's (see :class:`Mamba2`).
        n_heads, mlp_ratio: the Transformer's.
        dropout: dropout in the blocks (0).
        tokenizer: ``"linear"`` (:class:`TSTTokenizer`) or ``"mlp"`` (:class:`MLPTokenizer`,
            OpenMHC's, with ``tokenizer_hidden`` units).
        ffn_mult: FFN expansion of the ``"bimamba2"`` blocks (4).
        pool: ``"observed"`` (mean over hours with any observed value) or ``"all"`` (mean over all
            hours, OpenMHC's).
        projector: ``"mlp"`` (``d -> d -> proj_dim``, GELU), ``"linear"`` (``d -> proj_dim``) or
            ``"mlp3"`` (``d -> 4d -> d -> proj_dim`` with LayerNorm, GELU and dropout 0.1 between;
            OpenMHC's default head).
        variables: names of the ``n_chans`` variables, in input order (recorded with the weights).
        use_fused: Mamba-2 fused-kernel policy (``"auto"``).
        zscore_mean, zscore_std: initial values of the z-score buffers (weights loaded later
            overwrite them: a pretrained model keeps the statistics it was trained with).

    Every forward method takes ``raw=True`` to z-score ``values`` with the model's own buffers first
    (then ``values`` are in the variables' units).

    **Shapes:** ``values`` and ``observed`` ``(B, T, V)`` (hours x variables, as
    :func:`~domainfm.data_loaders.wearables.to_weeks` returns them; ``observed`` is bool, and
    defaults to ``~isnan(values)``) -> ``forward_features``: ``(B, d_model)``;
    ``forward_tokens``: ``(B, T, d_model)``; ``forward_projection``: ``(B, proj_dim)``;
    ``forward``: ``(B, n_outputs)`` (or ``(B, d_model)`` without a head).
    """

    def __init__(self, n_chans: int | None = None, n_times: int | None = 168, sfreq: float | None = 1 / 3600,
                 n_outputs: int | None = None, *, backbone: str = "mamba2", d_model: int = 256, n_layers: int = 4,
                 proj_dim: int | None = 128, d_state: int = 64, d_conv: int = 4, expand: int = 2, headdim: int = 64,
                 chunk_size: int = 64, n_heads: int = 8, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 variables: Sequence[str] | None = None, use_fused: bool | str = "auto",
                 zscore_mean: Sequence[float] | None = None, zscore_std: Sequence[float] | None = None,
                 tokenizer: str = "linear", tokenizer_hidden: int = 64, ffn_mult: int = 4, pool: str = "observed",
                 projector: str = "mlp"):
        super().__init__()
        if variables is not None:
            variables = [str(v) for v in variables]
            if n_chans is None:
                n_chans = len(variables)
            elif len(variables) != n_chans:
                raise ValueError(f"WBM: n_chans={n_chans} but {len(variables)} variable names were given")
        if n_chans is None or n_chans <= 0:
            raise ValueError(f"WBM: n_chans={n_chans}: give the number of hourly variables (or their names)")
        if sfreq is not None and abs(float(sfreq) * 3600 - 1) > 1e-6:
            raise ValueError(f"WBM: sfreq={sfreq}: the model works on hourly data (sfreq = 1/3600 Hz); "
                             "aggregate to hours in the data loader")
        if n_times is not None and n_times <= 0:
            raise ValueError(f"WBM: n_times={n_times}: must be positive")
        if backbone not in BACKBONES:
            raise ValueError(f"WBM: backbone={backbone!r}: expected one of {BACKBONES}")
        if n_outputs is not None and n_outputs <= 0:
            raise ValueError(f"WBM: n_outputs={n_outputs}: must be positive (or None for no head)")
        for option, value, allowed in (("tokenizer", tokenizer, TOKENIZERS), ("pool", pool, POOLINGS),
                                       ("projector", projector, PROJECTORS)):
            if value not in allowed:
                raise ValueError(f"WBM: {option}={value!r}: expected one of {allowed}")
        if tokenizer == "mlp" and tokenizer_hidden <= 0:
            raise ValueError(f"WBM: tokenizer_hidden={tokenizer_hidden}: must be positive")
        self.n_chans, self.n_times, self.sfreq, self.n_outputs = n_chans, n_times, 1 / 3600, n_outputs
        self.backbone, self.variables = backbone, variables
        self.tokenizer_kind, self.pool, self.projector_kind = tokenizer, pool, projector
        self.d_model = self.num_features = d_model
        self.tokenizer = (TSTTokenizer(n_chans, d_model) if tokenizer == "linear"
                          else MLPTokenizer(n_chans, d_model, tokenizer_hidden))
        mixer = dict(d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim, chunk_size=chunk_size,
                     use_fused=use_fused)
        if backbone == "mamba2":
            self.layers = nn.ModuleList(MambaBlock(d_model, dropout, **mixer) for _ in range(n_layers))
            self.norm = nn.RMSNorm(d_model, eps=1e-5)
        elif backbone == "bimamba2":
            # post-norm blocks end in a LayerNorm: OpenMHC has no final norm
            self.layers = nn.ModuleList(BiMambaBlock(d_model, ffn_mult, dropout, **mixer) for _ in range(n_layers))
            self.norm = nn.Identity()
        else:
            self.layers = nn.ModuleList(TransformerBlock(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
            self.norm = nn.LayerNorm(d_model)
        self.projector = None
        if proj_dim is not None:
            self.projector = self._make_projector(projector, d_model, proj_dim)
        self.register_buffer("zscore_mean", torch.zeros(n_chans))
        self.register_buffer("zscore_std", torch.ones(n_chans))
        self._init_weights()
        if zscore_mean is not None or zscore_std is not None:
            self.set_zscore(zscore_mean if zscore_mean is not None else [0.0] * n_chans,
                            zscore_std if zscore_std is not None else [1.0] * n_chans)
        self.head = None
        if n_outputs is not None:
            self.reset_classifier(n_outputs)

    @staticmethod
    def _make_projector(kind: str, d_model: int, proj_dim: int) -> nn.Sequential:
        if kind == "mlp":
            return nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.Linear(d_model, proj_dim))
        if kind == "linear":
            return nn.Sequential(nn.Linear(d_model, proj_dim))
        hidden = 4 * d_model  # "mlp3": OpenMHC's default projector, its dropout included
        return nn.Sequential(nn.Linear(d_model, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(0.1),
                             nn.Linear(hidden, d_model), nn.LayerNorm(d_model), nn.GELU(), nn.Dropout(0.1),
                             nn.Linear(d_model, proj_dim))

    def _init_weights(self) -> None:
        # GPT-2 style: small normal Linear weights, zero biases; out-projections of residual
        # branches scaled by 1/sqrt(2 n_layers) (as mamba_ssm's _init_weights rescales out_proj)
        depth_scale = 1 / math.sqrt(2 * max(len(self.layers), 1))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = 0.02 * (depth_scale if name.endswith(("out_proj", ".proj", "mlp.3")) else 1.0)
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # -- normalisation statistics --------------------------------------------------------------

    def set_zscore(self, mean, std) -> None:
        """Record the per-variable statistics the input was z-scored with (saved with the weights)."""
        mean = torch.as_tensor(mean, dtype=self.zscore_mean.dtype).flatten()
        std = torch.as_tensor(std, dtype=self.zscore_std.dtype).flatten()
        if mean.shape != (self.n_chans,) or std.shape != (self.n_chans,):
            raise ValueError(f"set_zscore: expected {self.n_chans} means and SDs, got {tuple(mean.shape)} and "
                             f"{tuple(std.shape)}")
        if not torch.isfinite(mean).all() or not (std > 0).all():
            raise ValueError("set_zscore: means must be finite and SDs positive")
        self.zscore_mean.copy_(mean)
        self.zscore_std.copy_(std)

    def zscore(self) -> dict:
        """The recorded statistics as ``{"variables", "mean", "std"}`` (plain lists)."""
        return {"variables": list(self.variables) if self.variables else None,
                "mean": self.zscore_mean.tolist(), "std": self.zscore_std.tolist()}

    # -- backbone ------------------------------------------------------------------------------

    def _check(self, values: torch.Tensor, observed: torch.Tensor | None, raw: bool = False):
        if values.dim() != 3 or values.shape[-1] != self.n_chans:
            raise ValueError(f"WBM: expected values of shape (batch, hours, n_chans={self.n_chans}), got "
                             f"{tuple(values.shape)}")
        if observed is None:
            observed = ~torch.isnan(values)
        elif observed.shape != values.shape:
            raise ValueError(f"WBM: observed {tuple(observed.shape)} must match values {tuple(values.shape)}")
        observed = observed.bool()
        if raw:
            values = (values - self.zscore_mean.to(values.dtype)) / self.zscore_std.to(values.dtype)
        return torch.where(observed, torch.nan_to_num(values), torch.zeros_like(values)), observed

    def forward_tokens(self, values: torch.Tensor, observed: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        """Per-hour representations ``(B, T, d_model)`` after the final norm."""
        values, observed = self._check(values, observed, raw)
        x = self.tokenizer(values, observed)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def forward_features(self, values: torch.Tensor, observed: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        """The embedding ``(B, d_model)``: mean of the hour tokens over hours with any observed value
        (over all hours when none is), or over all hours with ``pool="all"``."""
        values, observed = self._check(values, observed, raw)
        tokens = self.forward_tokens(values, observed)
        if self.pool == "all":
            return tokens.mean(1)
        weight = observed.any(dim=-1).to(tokens.dtype)  # (B, T)
        weight = torch.where(weight.sum(1, keepdim=True) > 0, weight, torch.ones_like(weight))
        return (tokens * weight.unsqueeze(-1)).sum(1) / weight.sum(1, keepdim=True)

    def forward_projection(self, values: torch.Tensor, observed: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        """The contrastive projection ``(B, proj_dim)`` of the embedding (not normalised)."""
        if self.projector is None:
            raise RuntimeError("this WBM was built with proj_dim=None (no projection head)")
        return self.projector(self.forward_features(values, observed, raw))

    # -- head ----------------------------------------------------------------------------------

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if pre_logits:
            return features
        if self.head is None:
            raise RuntimeError("this WBM has no head (n_outputs=None); call reset_classifier(n)")
        return self.head(features)

    def reset_classifier(self, n_outputs: int | None) -> None:
        """A fresh linear ``head`` with ``n_outputs`` outputs (``None`` removes it)."""
        if n_outputs is None:
            self.head, self.n_outputs = None, None
            return
        self.head = nn.Linear(self.d_model, n_outputs)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        self.n_outputs = n_outputs

    def forward(self, values: torch.Tensor, observed: torch.Tensor | None = None, raw: bool = False) -> torch.Tensor:
        features = self.forward_features(values, observed, raw)
        return features if self.head is None else self.forward_head(features)
