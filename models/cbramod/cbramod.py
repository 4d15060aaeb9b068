"""CBraMod: a criss-cross brain foundation model for EEG decoding.

Wang et al., "CBraMod: A Criss-Cross Brain Foundation Model for EEG Decoding", ICLR 2025
(https://arxiv.org/abs/2412.07236; official code github.com/wjq-learning/CBraMod, MIT).

The EEG is cut into one-second patches (200 samples at 200 Hz, in units of 100 µV). Each patch is
embedded by a small time-domain CNN plus a projection of its rFFT magnitude; an *asymmetric
conditional positional encoding* (a depthwise (19, 7) convolution over the (channel, patch) grid)
is added once; then ``n_layers`` pre-norm criss-cross transformer layers follow. In a criss-cross
layer the ``d_model`` features of every patch are split in half: the first half attends across
channels (one sequence of ``C`` channels per patch index: *spatial* attention), the second half
across patches (one sequence of ``N`` patches per channel: *temporal* attention); the two
outputs are concatenated. No final norm.

.. math::
    h &= \\mathrm{CNN}(x) + \\mathrm{Drop}(W_s\\,|\\mathrm{rFFT}(x)|/P) \\\\
    h &\\leftarrow h + \\mathrm{DWConv}_{19\\times7}(h) \\\\
    h &\\leftarrow h + \\mathrm{Drop}([\\mathrm{MHA}_s(\\mathrm{LN}(h)_{:d/2})\\,\\|\\,
        \\mathrm{MHA}_t(\\mathrm{LN}(h)_{d/2:})]) \\\\
    h &\\leftarrow h + \\mathrm{Drop}(W_2\\,\\mathrm{Drop}(\\mathrm{GELU}(W_1 \\mathrm{LN}(h))))

This implementation computes attention on plain ``nn.Linear`` projections (``in_proj``/``out_proj``),
so that LoRA can wrap them, with :mod:`domainfm.models.cbramod._fast` (batched-matmul attention for
the short criss-cross sequences on CPU, ``scaled_dot_product_attention`` elsewhere; oneDNN linears
with fused bias/GELU/residual at inference); the
official checkpoint (``nn.MultiheadAttention``'s ``in_proj_weight``) loads through
:func:`domainfm.models.cbramod.convert.convert_official_state_dict` and gives the official outputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domainfm import threads
from domainfm.precision import active_autocast_dtype

from . import _fast

__all__ = ["CBraMod", "PatchEmbedding", "CrissCrossLayer", "SelfAttention", "ClassifierHead", "HEAD_TYPES"]

#: classifier heads: the official fine-tuning code's (``--classifier``), then braindecode's
HEAD_TYPES = ("all_patch_reps", "avgpooling_patch_reps", "flatten_emb")


class PatchEmbedding(nn.Module):
    """Time-domain CNN + spectral projection of each patch, then the asymmetric conditional
    positional encoding.

    The CNN sees all ``C * N`` patches as the rows of one single-channel image, so each patch is
    embedded independently: ``Conv(1->25, k=(1,49), s=(1,25))`` gives 25 maps of ``P/25`` values
    per patch (the ``d_model = 25 * P/25`` features are ordered map-major), followed by two
    ``Conv(25->25, k=(1,3))``; every conv is followed by ``GroupNorm(5, 25)`` and GELU.

    Args:
        patch_size: samples per patch ``P`` (200); also the embedding width.
        dropout: dropout after the spectral projection (0.1).

    **Shapes:** ``(B, C, N, P)`` (+ optional bool mask ``(B, C, N)``) -> ``(B, C, N, P)``.
    """

    def __init__(self, patch_size: int = 200, dropout: float = 0.1):
        super().__init__()
        if patch_size % 25:
            raise ValueError(f"patch_size={patch_size}: the patch CNN has stride 25, so patch_size must be a multiple of 25")
        self.patch_size = d_model = patch_size
        # A constant, not a parameter: the official model keeps it at zero (requires_grad=False).
        self.register_buffer("mask_encoding", torch.zeros(patch_size))
        self.positional_encoding = nn.Sequential(
            nn.Conv2d(d_model, d_model, kernel_size=(19, 7), stride=(1, 1), padding=(9, 3), groups=d_model),
        )
        self.proj_in = nn.Sequential(
            nn.Conv2d(1, 25, kernel_size=(1, 49), stride=(1, 25), padding=(0, 24)),
            nn.GroupNorm(5, 25),
            nn.GELU(),
            nn.Conv2d(25, 25, kernel_size=(1, 3), stride=(1, 1), padding=(0, 1)),
            nn.GroupNorm(5, 25),
            nn.GELU(),
            nn.Conv2d(25, 25, kernel_size=(1, 3), stride=(1, 1), padding=(0, 1)),
            nn.GroupNorm(5, 25),
            nn.GELU(),
        )
        self.spectral_proj = nn.Sequential(nn.Linear(patch_size // 2 + 1, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, c, n, p = x.shape
        if mask is not None:
            # masked patches are replaced by the (fixed, zero) mask encoding before embedding
            x = torch.where(mask.unsqueeze(-1), self.mask_encoding.to(x.dtype), x)
        emb = self.proj_in(x.reshape(b, 1, c * n, p))  # (B, 25, C*N, P/25)
        emb = emb.permute(0, 2, 1, 3).reshape(b, c, n, p)
        # rFFT at least in fp32: a half-precision FFT would lose the small high-frequency bins
        spectrum = torch.fft.rfft(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1, norm="forward").abs()
        if not torch.is_autocast_enabled(x.device.type):
            spectrum = spectrum.to(self.spectral_proj[0].weight.dtype)
        emb = emb + self.spectral_proj(spectrum)
        return emb + self._positional(emb.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    def _positional(self, grid: torch.Tensor) -> torch.Tensor:
        """The depthwise (19, 7) convolution on the ``(B, d, C, N)`` grid (a channels-last view).

        In CPU training under half-precision autocast it runs in fp32 and its output is rounded
        to the autocast dtype afterwards: oneDNN's depthwise backward is 1.8x faster in fp32 than
        in bf16 here, and the result is no less accurate than the bf16 convolution it replaces
        (the official model's under autocast) before the same rounding.
        """
        dtype = active_autocast_dtype("cpu")
        if grid.device.type == "cpu" and torch.is_grad_enabled() and dtype not in (None, torch.float32):
            with torch.autocast("cpu", enabled=False):
                return self.positional_encoding(grid.float()).to(dtype)
        return self.positional_encoding(grid)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused ``in_proj`` (q, k, v rows, as in
    ``nn.MultiheadAttention``) and ``out_proj``; the attention itself is
    :func:`domainfm.models.cbramod._fast.attention` (batched matmuls for short sequences on CPU,
    ``scaled_dot_product_attention`` otherwise).

    **Shapes:** ``(..., L, dim) -> (..., L, dim)`` (independent sequences of length ``L``; the
    input may be a strided view, the projections read it in place).
    """

    def __init__(self, dim: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"attention width {dim} is not divisible by its {n_heads} heads")
        self.dim, self.n_heads, self.head_dim, self.dropout = dim, n_heads, dim // n_heads, dropout
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        # nn.MultiheadAttention's initialisation (the official model's, before its Linear re-init)
        nn.init.xavier_uniform_(self.in_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, length, _ = x.shape
        dropout_p = self.dropout if self.training else 0.0
        compute_dtype = active_autocast_dtype(x.device.type) or x.dtype  # what the projections run in
        if _fast.attention_path(length, compute_dtype, x.device, dropout_p) == "packed":
            # fp32 inference: the bias goes in with the fused head split, not the matmul
            qkv, bias = _fast.projection_without_bias(self.in_proj, x)
            out = _fast.attention(qkv.reshape(-1, length, 3 * self.dim), self.n_heads, path="packed", bias=bias)
        else:
            qkv = _fast.linear(self.in_proj, x).reshape(-1, length, 3 * self.dim)
            out = _fast.attention(qkv, self.n_heads, dropout_p)
        return _fast.linear(self.out_proj, out).view(*lead, length, self.dim)


class CrissCrossLayer(nn.Module):
    """One pre-norm criss-cross transformer layer (attribute names as in the official code).

    **Shapes:** ``(B, C, N, d) -> (B, C, N, d)``.
    """

    def __init__(self, d_model: int = 200, n_heads: int = 8, dim_feedforward: int = 800, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-5):
        super().__init__()
        if d_model % 2 or n_heads % 2:
            raise ValueError(f"d_model={d_model} and n_heads={n_heads} must both be even (half of each per branch)")
        half = d_model // 2
        self.half = half
        self.self_attn_s = SelfAttention(half, n_heads // 2, dropout)
        self.self_attn_t = SelfAttention(half, n_heads // 2, dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def _criss_cross(self, x: torch.Tensor) -> torch.Tensor:
        h = self.half
        # split (not two slices): its backward is one concatenation instead of two zero-filled copies
        xs, xt = x.split(h, dim=-1)
        # spatial: dims [0, d/2) of every patch index attend across the C channels; the projection
        # reads the (B, N, C, h) view in place, so the only reorder is the output's transpose back
        xs = self.self_attn_s(xs.transpose(1, 2)).transpose(1, 2)
        # temporal: dims [d/2, d) of every channel attend across the N patches
        xt = self.self_attn_t(xt)
        return torch.cat((xs, xt), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            # dropouts through _fast.dropout (the nn.Dropout modules keep their p and names): on
            # CPU a cheaper mask than bernoulli_, fused with the residual add
            x = _fast.dropout(self._criss_cross(self.norm1(x)), self.dropout1.p, True, residual=x)
            hidden = _fast.dropout(F.gelu(self.linear1(self.norm2(x))), self.dropout.p, True)
            return _fast.dropout(self.linear2(hidden), self.dropout2.p, True, residual=x)
        x = x + self._criss_cross(self.norm1(x))
        # eval: dropouts are identities; bias + GELU and bias + residual fuse into the matmuls
        # where _fast.linear can (no grad, CPU, plain nn.Linear)
        return _fast.linear(self.linear2, _fast.linear(self.linear1, self.norm2(x), "gelu"), residual=x)


class CrissCrossEncoder(nn.Module):
    """``n_layers`` criss-cross layers, no final norm (``encoder.layers.{i}`` as officially)."""

    def __init__(self, n_layers: int, **layer_kwargs):
        super().__init__()
        self.layers = nn.ModuleList([CrissCrossLayer(**layer_kwargs) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ClassifierHead(nn.Module):
    """The classifier heads on the ``(B, C, N, d)`` patch representations.

    The official fine-tuning code's:

    - ``all_patch_reps``: flatten ``C*N*d`` -> ``N*d`` -> ``d`` (each ELU + dropout) -> ``n_outputs``.
    - ``avgpooling_patch_reps``: mean over channels and patches -> ``n_outputs``.

    braindecode's (``braindecode.models.CBraMod``, 1.8):

    - ``flatten_emb``: its ``proj_out`` (``Linear(d, emb_dim)`` on every patch) then its
      ``final_layer`` (``Flatten``, ``Linear(C*N*emb_dim, n_outputs)``), no activation or dropout:

      .. math::
          \\mathrm{logits} = W_f\\,\\mathrm{vec}\\big(h W_p^\\top + b_p\\big) + b_f,
          \\qquad h \\in \\mathbb{R}^{C \\times N \\times d}

      ``pre_logits.0`` is braindecode's ``proj_out.0`` and ``fc`` its ``final_layer.1``. The
      backbone's own ``proj_out`` (the pretraining reconstruction head) is a separate module.

    ``pre_logits`` holds everything before the last linear layer ``fc``; ``num_features`` is
    the width of its output (``d``, or ``C*N*emb_dim`` for ``flatten_emb``).

    Args:
        head_type: one of :data:`HEAD_TYPES`.
        n_outputs: classes / regression targets.
        d_model: width of the patch representations ``d``.
        n_chans, n_patches: ``C`` and ``N``, fixed by the flattening heads (``all_patch_reps``,
            ``flatten_emb``); may be ``None`` for ``avgpooling_patch_reps``.
        dropout: dropout inside the ``all_patch_reps`` MLP (0.1).
        emb_dim: per-patch projection width of ``flatten_emb`` (``None``: ``d_model``).

    **Shapes:** ``(B, C, N, d) -> (B, n_outputs)``; ``pre_logits=True``: ``-> (B, d)``, or
    ``(B, C*N*emb_dim)`` for ``flatten_emb`` (flattened channel-major, then patch, then feature).
    """

    def __init__(self, head_type: str, n_outputs: int, d_model: int, n_chans: int | None, n_patches: int | None,
                 dropout: float = 0.1, emb_dim: int | None = None):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"head_type={head_type!r}: expected one of {HEAD_TYPES}")
        if emb_dim is not None and head_type != "flatten_emb":
            raise ValueError(f"emb_dim={emb_dim} sizes only the 'flatten_emb' head, not head_type={head_type!r}")
        if emb_dim is not None and emb_dim <= 0:
            raise ValueError(f"emb_dim={emb_dim}: must be positive")
        self.head_type, self.n_chans, self.n_patches = head_type, n_chans, n_patches
        self.num_features = d_model
        if head_type == "flatten_emb":
            if not n_chans or not n_patches:
                raise ValueError(
                    "head_type='flatten_emb' (braindecode's final_layer) weights every channel x patch x emb_dim "
                    f"feature separately, so it needs n_chans and n_times (got n_chans={n_chans}, "
                    f"n_patches={n_patches}); pass them (from braindecode's config.json for its weights) or use "
                    "'avgpooling_patch_reps'"
                )
            self.emb_dim = emb_dim or d_model
            self.num_features = n_chans * n_patches * self.emb_dim
            self.pre_logits = nn.Sequential(nn.Linear(d_model, self.emb_dim), nn.Flatten(1))
        elif head_type == "all_patch_reps":
            if not n_chans or not n_patches:
                raise ValueError(
                    "head_type='all_patch_reps' flattens every patch representation, so it needs n_chans and "
                    f"n_times (got n_chans={n_chans}, n_patches={n_patches}); pass them or use 'avgpooling_patch_reps'"
                )
            self.pre_logits = nn.Sequential(
                nn.Flatten(1),
                nn.Linear(n_chans * n_patches * d_model, n_patches * d_model), nn.ELU(), nn.Dropout(dropout),
                nn.Linear(n_patches * d_model, d_model), nn.ELU(), nn.Dropout(dropout),
            )
        else:
            self.pre_logits = nn.Identity()
        self.fc = nn.Linear(self.num_features, n_outputs)

    def forward(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.head_type in ("all_patch_reps", "flatten_emb"):
            _, c, n, _ = features.shape
            if (c, n) != (self.n_chans, self.n_patches):
                raise ValueError(
                    f"the {self.head_type} head was built for {self.n_chans} channels x {self.n_patches} patches, "
                    f"got features of {c} x {n}; rebuild with matching n_chans/n_times"
                )
            pooled = self.pre_logits(features)
        else:
            pooled = features.mean(dim=(1, 2))
        return pooled if pre_logits else self.fc(pooled)


class CBraMod(nn.Module):
    """CBraMod backbone with the zoo's model surface.

    Args:
        n_chans: EEG channels ``C`` (any number; needed only by the ``all_patch_reps`` and
            ``flatten_emb`` heads).
        n_times: samples per example, a multiple of ``patch_size`` (needed only by those heads).
        sfreq: sampling rate; must be 200 Hz, the rate the model was pretrained at (resample in
            the data loader).
        n_outputs: classes / regression targets of the classifier ``head``; ``None`` (default):
            no head (pretraining, feature extraction).
        patch_size: samples per patch and embedding width (200).
        n_layers: criss-cross layers (12).
        n_heads: attention heads in total, half per branch (8).
        dim_feedforward: FFN width (800).
        dropout: dropout of the backbone (0.1).
        head_type: ``"all_patch_reps"`` (default, the paper's), ``"avgpooling_patch_reps"`` or
            ``"flatten_emb"`` (braindecode's ``proj_out`` + ``final_layer``, so that its fine-tuned
            classifiers load; see :class:`ClassifierHead`).
        head_dropout: dropout inside the ``all_patch_reps`` head (0.1).
        emb_dim: per-patch projection width of the ``flatten_emb`` head (braindecode's
            ``emb_dim``; ``None``, default: ``patch_size``).
        reconstruction_head: keep ``proj_out`` (Linear d->P per patch) used by
            :meth:`forward_reconstruction`; fine-tuning drops it, as the official code does.

    ``num_features`` is the width of ``forward_head(..., pre_logits=True)``: ``d`` (also without
    a head), or ``C * N * emb_dim`` with the ``flatten_emb`` head.

    Input units: the official model takes EEG in units of 100 µV (µV / 100); scaling is the data
    loader's job (:mod:`domainfm.data_loaders.eeg`), not the model's.

    **Shapes:** ``forward_features``: ``(B, C, T)`` with ``T = N * patch_size`` (or already
    patched ``(B, C, N, patch_size)``) -> ``(B, C, N, d)``; ``forward``: -> ``(B, n_outputs)``;
    ``forward_reconstruction``: ``(B, C, T)``, mask ``(B, C, N)`` -> ``(B, C, N, patch_size)``.
    """

    def __init__(self, n_chans: int | None = None, n_times: int | None = None, sfreq: float = 200.0,
                 n_outputs: int | None = None, *, patch_size: int = 200, n_layers: int = 12, n_heads: int = 8,
                 dim_feedforward: int = 800, dropout: float = 0.1, head_type: str = "all_patch_reps",
                 head_dropout: float = 0.1, reconstruction_head: bool = True, emb_dim: int | None = None):
        super().__init__()
        if sfreq is not None and abs(float(sfreq) - 200.0) > 1e-6:
            raise ValueError(f"sfreq={sfreq}: CBraMod works on 200 Hz EEG; resample in the data loader")
        if n_times is not None and (n_times <= 0 or n_times % patch_size):
            raise ValueError(f"n_times={n_times}: must be a positive multiple of patch_size={patch_size} samples")
        if n_chans is not None and n_chans <= 0:
            raise ValueError(f"n_chans={n_chans}: must be positive")
        if n_outputs is not None and n_outputs <= 0:
            raise ValueError(f"n_outputs={n_outputs}: must be positive (or None for no head)")
        if emb_dim is not None and (head_type != "flatten_emb" or emb_dim <= 0):
            raise ValueError(f"emb_dim={emb_dim}: a positive width, and only for head_type='flatten_emb' "
                             f"(got head_type={head_type!r})")
        self.n_chans, self.n_times, self.sfreq, self.n_outputs = n_chans, n_times, float(sfreq), n_outputs
        self.patch_size = patch_size
        self.d_model = patch_size
        self.head_type, self.head_dropout, self.emb_dim = head_type, head_dropout, emb_dim
        self.patch_embedding = PatchEmbedding(patch_size, dropout)
        self.encoder = CrissCrossEncoder(n_layers, d_model=patch_size, n_heads=n_heads,
                                         dim_feedforward=dim_feedforward, dropout=dropout)
        self.proj_out = nn.Sequential(nn.Linear(patch_size, patch_size)) if reconstruction_head else None
        self.apply(_init_linear)
        self.head = None
        if n_outputs is not None:
            self.reset_classifier(n_outputs)

    # -- input ------------------------------------------------------------------------------

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, T)`` -> ``(B, C, T / P, P)``; an already patched ``(B, C, N, P)`` passes."""
        p = self.patch_size
        if x.dim() == 4:
            if x.shape[-1] != p:
                raise ValueError(f"patched input must end in patch_size={p}, got shape {tuple(x.shape)}")
            return x
        if x.dim() != 3:
            raise ValueError(f"expected EEG of shape (batch, n_chans, n_times), got {tuple(x.shape)}")
        b, c, t = x.shape
        if t == 0 or t % p:
            raise ValueError(
                f"n_times={t} is not a multiple of the {p}-sample patch (1 s at 200 Hz); crop or pad the windows"
            )
        return x.reshape(b, c, t // p, p)

    # -- backbone ---------------------------------------------------------------------------

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Patch representations ``(B, C, N, d)`` of EEG ``(B, C, T)`` (units of 100 µV).

        CPU inference on a batch runs as one single-threaded shard per intra-op thread
        (:mod:`domainfm.threads`; the same values, 12-18% faster on 2 cores)."""
        if self._shard(x):
            return threads.sharded(self.forward_features, x)
        return self.encoder(self.patch_embedding(self.patchify(x)))

    def forward_reconstruction(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Reconstructed patches ``(B, C, N, P)`` from EEG whose ``mask``-ed patches were replaced
        by the mask encoding (``mask``: bool ``(B, C, N)``, True = masked)."""
        if self.proj_out is None:
            raise RuntimeError("this CBraMod was built with reconstruction_head=False (no proj_out)")
        if self._shard(x) and mask.shape[:1] == x.shape[:1]:
            return threads.sharded(self.forward_reconstruction, x, mask)
        patches = self.patchify(x)
        if mask.shape != patches.shape[:3]:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match (B, C, N) = {tuple(patches.shape[:3])}")
        return self.proj_out(self.encoder(self.patch_embedding(patches, mask.bool())))

    # -- head -------------------------------------------------------------------------------

    @property
    def num_features(self) -> int:
        """Width of ``forward_head(..., pre_logits=True)`` (``d`` without a head)."""
        return self.head.num_features if self.head is not None else self.d_model

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this CBraMod has no classifier head (n_outputs=None); call reset_classifier(n)")
        return self.head(features, pre_logits=pre_logits)

    def reset_classifier(self, n_outputs: int, head_type: str | None = None) -> None:
        """A fresh ``head`` with ``n_outputs`` outputs (of ``head_type``, default the current one)."""
        if head_type is not None:
            self.head_type = head_type
        n_patches = self.n_times // self.patch_size if self.n_times else None
        emb_dim = self.emb_dim if self.head_type == "flatten_emb" else None
        self.head = ClassifierHead(self.head_type, n_outputs, self.d_model, self.n_chans, n_patches, self.head_dropout,
                                   emb_dim)
        if self.head_type == "flatten_emb":
            # as braindecode: its proj_out takes the Kaiming init, final_layer keeps PyTorch's default
            # (Kaiming fan_out over n_outputs would give a C*N*emb_dim-wide Linear logits ~100x too large)
            _init_linear(self.head.pre_logits[0])
        else:
            self.head.apply(_init_linear)
        self.n_outputs = n_outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._shard(x):
            return threads.sharded(self.forward, x)
        return self.forward_head(self.forward_features(x))

    def _shard(self, x: torch.Tensor) -> bool:
        """Whether this call runs as per-thread shards of the batch (:mod:`domainfm.threads`)."""
        return threads.should_shard(x) and threads.module_can_shard(self)


def _init_linear(module: nn.Module) -> None:
    # the official `_weights_init`: Kaiming-normal (fan_out) on every Linear weight
    if isinstance(module, nn.Linear):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
