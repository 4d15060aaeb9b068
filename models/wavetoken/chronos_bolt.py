"""Chronos-Bolt: patch-based direct multi-quantile forecasting on the T5 encoder-decoder of :mod:`.t5`.

Chronos-Bolt (Amazon, 2024; ``amazon/chronos-bolt-{tiny,mini,small,base}``) replaces Chronos's
token vocabulary with patches of the raw series and its sampling with one decoder step that
emits every quantile for the whole horizon at once:

1. **Instance normalisation.** ``loc`` = mean and ``scale`` = root mean square deviation of the
   observed (non-NaN) context values of each series; a constant series gets ``scale = 1e-5``,
   a series with no observed value ``loc = 0``, ``scale = 1``. Computed in float32.
2. **Patching.** The normalised context (at most ``context_length`` values) is left-padded with
   missing values to a multiple of ``input_patch_size`` and cut into patches of that size every
   ``input_patch_stride`` values. Each patch enters as ``[values, observed]`` (``2 * patch`` numbers,
   missing values set to 0); a patch with no observed value is masked out of attention.
3. **Patch embedding.** A residual block ``out(act(hidden(x))) + residual(x)`` maps each patch to
   ``d_model``; with ``use_reg_token`` a learned ``[REG]`` embedding (id 1) is appended.
4. **T5 encoder** over the patch embeddings (bidirectional relative position bias).
5. **T5 decoder, one step**, from the start token (id 0), cross-attending to the encoder.
6. **Quantile head.** A residual block maps the decoder state to ``len(quantiles) *
   prediction_length`` values, read as ``(quantiles, horizon)`` in normalised units and mapped back
   with ``x * scale + loc``.

Training minimises the quantile (pinball) loss ``2 |(y - q) (1[y <= q] - level)|`` in normalised
units, averaged over the quantile levels, summed over the observed horizon steps and averaged
over the batch (what the upstream implementation computes; its comments name the two
reductions the other way round).

Forecasts beyond ``prediction_length`` roll out as the upstream pipeline does: every predicted
quantile path is appended to the context, each of these ``Q`` contexts is forecast again, and
the ``Q x Q`` values per step are reduced to the model's ``Q`` levels by empirical quantiles.

Parameter names are ours (``shared``, ``encoder``/``decoder`` as in :mod:`.t5`, ``patch_embed``,
``quantile_head``); :func:`.chronos_bolt_convert.convert_chronos_bolt` maps the Hugging Face files.

Shapes:
    ``context`` (B, T) float (NaN = missing; or a list of 1-D series of any lengths)
    -> ``quantile_preds`` (B, Q, prediction_length); encoder states (B, N [+1], d_model) with
    ``N = ceil(min(T, context_length) / patch)`` patches when the stride equals the patch size.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .forecast import DEFAULT_QUANTILES
from .t5 import Stack, T5EncoderDecoder, _mask_bias
from .tokenizer import left_pad_and_stack

__all__ = ["ChronosBolt", "ResidualBlock", "instance_norm", "patchify", "quantile_loss", "load_chronos_bolt",
           "convert_chronos_bolt", "BOLT_SIZES", "CHRONOS_BOLT_REVISIONS"]

#: the activations a Hugging Face T5 config may name in ``dense_act_fn`` that we support
#: (``gelu_new`` is the tanh approximation, as in transformers)
_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}

#: sampling keywords of :meth:`.forecast.TokenForecaster.predict_quantiles` that a deterministic
#: quantile forecaster accepts and ignores, so that one forecasting path serves both
_SAMPLING_KEYWORDS = ("num_samples", "temperature", "top_k", "top_p", "seed", "use_cache")


def instance_norm(context: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-aware ``(loc, scale)``, each (B, 1), of a (B, T) context, in float32.

    ``loc`` is the mean of the observed values (0 without any), ``scale`` the root of their mean
    squared deviation from it (1 without any observed value, ``eps`` for a constant series).
    """
    x = context.to(torch.float32)
    loc = torch.nan_to_num(torch.nanmean(x, dim=-1, keepdim=True), nan=0.0)
    scale = torch.nan_to_num((x - loc).square().nanmean(dim=-1, keepdim=True).sqrt(), nan=1.0)
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    return loc, scale


def patchify(x: torch.Tensor, size: int, stride: int, fill: float) -> torch.Tensor:
    """(B, T) -> (B, N, size): left-pad with ``fill`` to a multiple of ``size``, then windows of
    ``size`` every ``stride`` values (the upstream padding rule, also when ``stride != size``)."""
    remainder = x.shape[-1] % size
    if remainder:
        pad = x.new_full((*x.shape[:-1], size - remainder), fill)
        x = torch.cat([pad, x], dim=-1)
    return x.unfold(-1, size, stride)


def quantile_loss(quantile_preds: torch.Tensor, target: torch.Tensor, target_mask: torch.Tensor,
                  levels: torch.Tensor) -> torch.Tensor:
    """Per-series pinball loss (B,): ``2 |(y - q)(1[y <= q] - level)|`` masked, averaged over the
    ``Q`` levels and summed over the horizon.

    Args:
        quantile_preds: (B, Q, H) predictions; target: (B, H) with missing steps already zeroed;
        target_mask: (B, H) bool; levels: (Q,).
    """
    y = target.unsqueeze(1)
    indicator = (y <= quantile_preds).to(quantile_preds.dtype)
    loss = 2 * torch.abs((y - quantile_preds) * (indicator - levels.view(1, -1, 1)))
    loss = loss * target_mask.unsqueeze(1).to(loss.dtype)
    return loss.mean(dim=1).sum(dim=-1)


class ResidualBlock(nn.Module):
    """``output(dropout(act(hidden(x)))) + residual(x)``: Chronos-Bolt's patch embedding and
    quantile head (linear layers with biases, no normalisation).

    Shapes: (..., in_dim) -> (..., out_dim).
    """

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, *, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(_ACTIVATIONS)}")
        self.activation = activation
        self.hidden = nn.Linear(in_dim, hidden_dim)
        self.output = nn.Linear(hidden_dim, out_dim)
        self.residual = nn.Linear(in_dim, out_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.output(_ACTIVATIONS[self.activation](self.hidden(x)))) + self.residual(x)


def _check_levels(levels, label: str) -> list[float]:
    values = [float(q) for q in levels]
    if not values or any(not 0.0 < q < 1.0 for q in values):
        raise ValueError(f"{label}={list(levels)}: expected a non-empty list of levels strictly between 0 and 1")
    return values


class ChronosBolt(nn.Module):
    """Chronos-Bolt forecaster (see the module docstring).

    Args:
        context_length: context values the model reads (longer contexts keep their last
            ``context_length`` values). Official models: 2048.
        prediction_length: steps the quantile head forecasts in one pass (official: 64).
        input_patch_size, input_patch_stride: patching (official: 16 and 16).
        quantiles: the levels the head predicts (official: 0.1, 0.2, ..., 0.9).
        use_reg_token: append a learned ``[REG]`` embedding to the patches (official: yes).
        d_model, d_kv, d_ff, num_heads, num_layers, num_decoder_layers,
        relative_attention_num_buckets, relative_attention_max_distance, layer_norm_eps:
            the T5 sizes (see :class:`.t5.T5EncoderDecoder`; ``num_decoder_layers`` defaults to
            ``num_layers``).
        dropout: dropout rate of the T5 stacks and the residual blocks (official configs: 0.1).
        dense_act_fn: activation of the residual blocks (official: ``"relu"``).
        initializer_factor: T5's init scale (official configs: 0.05).
        decoder_start_token_id: the decoder's single input id (0).
        n_chans, n_times, sfreq, n_outputs: the zoo's signal description; univariate
            (``n_chans`` 1), ``n_times`` = ``context_length``, ``n_outputs`` = ``prediction_length``.

    Shapes:
        ``forward(context (B, T))`` -> ``{"quantile_preds": (B, Q, prediction_length), "loss": None}``;
        with ``target`` (B, H <= prediction_length) the loss is a scalar.
    """

    is_quantile_forecaster = True

    def __init__(self, *, context_length: int = 2048, prediction_length: int = 64, input_patch_size: int = 16,
                 input_patch_stride: int = 16, quantiles: Sequence[float] = DEFAULT_QUANTILES,
                 use_reg_token: bool = True, d_model: int = 256, d_kv: int = 64, d_ff: int = 1024,
                 num_heads: int = 4, num_layers: int = 4, num_decoder_layers: int | None = None,
                 relative_attention_num_buckets: int = 32, relative_attention_max_distance: int = 128,
                 dropout: float = 0.1, layer_norm_eps: float = 1e-6, dense_act_fn: str = "relu",
                 initializer_factor: float = 0.05, decoder_start_token_id: int = 0,
                 n_chans: int | None = None, n_times: int | None = None, sfreq: float | None = None,
                 n_outputs: int | None = None):
        super().__init__()
        if n_chans not in (None, 1):
            raise ValueError(f"n_chans={n_chans}: ChronosBolt forecasts univariate series; pass n_chans=1 "
                             "and forecast each channel as its own series")
        if n_times is not None and n_times != context_length:
            raise ValueError(f"n_times={n_times} disagrees with context_length={context_length}; give one of them")
        if n_outputs is not None and n_outputs != prediction_length:
            raise ValueError(f"n_outputs={n_outputs} disagrees with prediction_length={prediction_length}; give one of them")
        for label, value in (("context_length", context_length), ("prediction_length", prediction_length),
                             ("input_patch_size", input_patch_size), ("input_patch_stride", input_patch_stride),
                             ("d_model", d_model), ("d_kv", d_kv), ("d_ff", d_ff), ("num_heads", num_heads),
                             ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r}: expected a positive integer")
        if input_patch_stride > input_patch_size:
            raise ValueError(f"input_patch_stride={input_patch_stride} exceeds input_patch_size={input_patch_size}: "
                             "values between patches would be skipped")
        if dense_act_fn not in _ACTIVATIONS:
            raise ValueError(f"dense_act_fn={dense_act_fn!r}: expected one of {sorted(_ACTIVATIONS)}")
        if relative_attention_num_buckets < 4 or relative_attention_max_distance <= relative_attention_num_buckets // 4:
            raise ValueError(
                f"relative_attention_num_buckets={relative_attention_num_buckets} / max_distance="
                f"{relative_attention_max_distance}: need >= 4 buckets and max_distance above num_buckets/4"
            )
        self.context_length, self.prediction_length = context_length, prediction_length
        self.input_patch_size, self.input_patch_stride = input_patch_size, input_patch_stride
        self.quantiles = _check_levels(quantiles, "quantiles")
        self.use_reg_token = bool(use_reg_token)
        self.d_model, self.d_ff = d_model, d_ff
        self.num_features = d_model
        self.dropout_rate, self.dense_act_fn = dropout, dense_act_fn
        self.initializer_factor = initializer_factor
        self.decoder_start_token_id = decoder_start_token_id
        self.reg_token_id = 1  # the [REG] embedding is row 1 of `shared`; row 0 is the decoder start
        self.sfreq = sfreq
        num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        common = dict(d_model=d_model, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff, dropout=dropout, eps=layer_norm_eps,
                      relative_attention_num_buckets=relative_attention_num_buckets,
                      relative_attention_max_distance=relative_attention_max_distance)
        # built on the meta device and initialised once below: the modules' own default init
        # would draw every weight twice (seconds for the 205M-parameter base)
        device = torch.empty(0).device  # where the caller builds (meta inside `with torch.device("meta")`)
        with torch.device("meta"):
            self.shared = nn.Embedding(2 if self.use_reg_token else 1, d_model)
            self.encoder = Stack(num_layers=num_layers, is_decoder=False, **common)
            self.decoder = Stack(num_layers=num_decoder_layers, is_decoder=True, **common)
            self.patch_embed = ResidualBlock(2 * input_patch_size, d_ff, d_model, activation=dense_act_fn,
                                             dropout=dropout)
            self.quantile_head = self._new_head(len(self.quantiles), prediction_length)
        self.to_empty(device=device)
        self.apply(self._init_weights)  # covers every parameter (tested)

    # -- init ------------------------------------------------------------------

    def _new_head(self, n_quantiles: int, horizon: int) -> ResidualBlock:
        return ResidualBlock(self.d_model, self.d_ff, n_quantiles * horizon, activation=self.dense_act_fn,
                             dropout=self.dropout_rate)

    def _init_weights(self, module: nn.Module) -> None:
        f = self.initializer_factor
        if isinstance(module, ResidualBlock):
            # upstream scales the hidden and residual layers of *both* blocks by (2 * patch size)^-0.5
            # (also the head, whose input is d_model wide); kept so that training from scratch starts alike
            std_in = f * (2 * self.input_patch_size) ** -0.5
            nn.init.normal_(module.hidden.weight, std=std_in)
            nn.init.normal_(module.residual.weight, std=std_in)
            nn.init.normal_(module.output.weight, std=f * self.d_ff**-0.5)
            for layer in (module.hidden, module.output, module.residual):
                nn.init.zeros_(layer.bias)
        elif module is self:
            nn.init.normal_(self.shared.weight, std=f)
        elif not isinstance(module, (nn.Linear, nn.Embedding)):
            # T5's own initialisation of norms, attention, feed-forward and the bias tables
            T5EncoderDecoder._init_weights(self, module)

    # -- configuration -----------------------------------------------------------

    def reconfigure(self, *, context_length: int | None = None, prediction_length: int | None = None,
                    quantiles: Sequence[float] | None = None, input_patch_size: int | None = None,
                    input_patch_stride: int | None = None, use_reg_token: bool | None = None) -> None:
        """Adopt other forecasting settings (e.g. an upstream ``chronos_config``). Modules whose
        shape changes (the head for another horizon or other levels, the patch embedding for
        another patch size, the embeddings with or without ``[REG]``) are rebuilt with fresh
        weights; the record that :func:`domainfm.save_pretrained` writes is updated."""
        if context_length is not None:
            if int(context_length) < 1:
                raise ValueError(f"context_length={context_length}: expected a positive integer")
            self.context_length = int(context_length)
        size = self.input_patch_size if input_patch_size is None else int(input_patch_size)
        stride = self.input_patch_stride if input_patch_stride is None else int(input_patch_stride)
        if size < 1 or not 1 <= stride <= size:
            raise ValueError(f"input_patch_size={size}, input_patch_stride={stride}: need 1 <= stride <= size")
        device = self.shared.weight.device
        if size != self.input_patch_size:
            self.input_patch_size = size
            self.patch_embed = ResidualBlock(2 * size, self.d_ff, self.d_model, activation=self.dense_act_fn,
                                             dropout=self.dropout_rate).to(device)
            self.patch_embed.apply(self._init_weights)
        self.input_patch_stride = stride
        if use_reg_token is not None and bool(use_reg_token) != self.use_reg_token:
            self.use_reg_token = bool(use_reg_token)
            self.shared = nn.Embedding(2 if self.use_reg_token else 1, self.d_model, device=device)
            nn.init.normal_(self.shared.weight, std=self.initializer_factor)
        levels = self.quantiles if quantiles is None else _check_levels(quantiles, "quantiles")
        horizon = self.prediction_length if prediction_length is None else int(prediction_length)
        if horizon < 1:
            raise ValueError(f"prediction_length={prediction_length}: expected a positive integer")
        if len(levels) * horizon != self.quantile_head.output.out_features:
            self.quantile_head = self._new_head(len(levels), horizon).to(device)
            self.quantile_head.apply(self._init_weights)
        self.quantiles, self.prediction_length = levels, horizon
        record = getattr(self, "domainfm_kwargs", None)
        if isinstance(record, dict):
            record.update(context_length=self.context_length, prediction_length=self.prediction_length,
                          quantiles=list(self.quantiles), input_patch_size=self.input_patch_size,
                          input_patch_stride=self.input_patch_stride, use_reg_token=self.use_reg_token)
            if "n_times" in record:
                record["n_times"] = self.context_length
            if "n_outputs" in record:
                record["n_outputs"] = self.prediction_length

    @property
    def n_outputs(self) -> int:
        return self.prediction_length

    @property
    def domainfm_upstream_config(self) -> dict | None:
        return self.__dict__.get("_upstream_config")

    @domainfm_upstream_config.setter
    def domainfm_upstream_config(self, config: dict) -> None:
        """Called by the hub with an upstream ``config.json``: check it describes this
        architecture, then adopt its ``chronos_config``."""
        from .chronos_bolt_convert import apply_chronos_bolt_config

        apply_chronos_bolt_config(self, config)
        self.__dict__["_upstream_config"] = config

    # -- inputs ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.shared.weight.device

    def prepare_context(self, context) -> torch.Tensor:
        """(B, T) float32 on the model's device from a tensor/array (T,) or (B, T), or a list of
        1-D series of any lengths (left-padded with NaN to the longest)."""
        if torch.is_tensor(context) and context.ndim == 2:
            return context.to(device=self.device, dtype=torch.float32)
        return left_pad_and_stack(context).to(self.device)

    def patch_inputs(self, context: torch.Tensor, mask: torch.Tensor | None = None):
        """Patch embeddings (B, N [+1], d_model), their attention mask (B, N [+1]) bool and
        ``(loc, scale)`` (each (B, 1)) of a (B, T) context; ``mask`` (B, T) marks observed values
        (default: the non-NaN ones)."""
        context = context.to(torch.float32)
        observed = ~torch.isnan(context) if mask is None else mask.to(torch.bool)
        if context.shape[-1] > self.context_length:
            context = context[..., -self.context_length :]
            observed = observed[..., -self.context_length :]
        loc, scale = instance_norm(context)
        scaled = (context - loc) / scale
        size, stride = self.input_patch_size, self.input_patch_stride
        values = patchify(scaled, size, stride, float("nan"))
        patch_mask = patchify(observed.to(torch.float32), size, stride, 0.0)
        values = torch.where(patch_mask > 0, values, torch.zeros_like(values))
        embeds = self.patch_embed(torch.cat([values, patch_mask], dim=-1))
        attention = patch_mask.sum(-1) > 0
        if self.use_reg_token:
            reg = self.shared.weight[self.reg_token_id].to(embeds.dtype).expand(embeds.shape[0], 1, -1)
            embeds = torch.cat([embeds, reg], dim=1)
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
        return embeds, attention, (loc, scale)

    # -- the network ---------------------------------------------------------------

    def encode(self, context: torch.Tensor, mask: torch.Tensor | None = None):
        """Encoder states (B, N [+1], d_model), attention mask (B, N [+1]) and ``(loc, scale)``."""
        embeds, attention, loc_scale = self.patch_inputs(context, mask)
        n = embeds.shape[1]
        bias = (self.encoder.position_bias(n, n, device=embeds.device).to(embeds.dtype)
                + _mask_bias(attention, embeds.dtype))
        return self.encoder(embeds, bias), attention, loc_scale

    def decode(self, encoder_states: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The decoder's state (B, d_model) at its single position (the start token)."""
        b = encoder_states.shape[0]
        start = self.shared.weight[self.decoder_start_token_id].to(encoder_states.dtype).expand(b, 1, -1)
        self_bias = self.decoder.position_bias(1, 1, device=start.device).to(start.dtype)
        cross_bias = _mask_bias(attention, start.dtype)
        return self.decoder(start, self_bias, encoder_states=encoder_states, cross_bias=cross_bias)[:, 0]

    def forward_features(self, context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder state (B, d_model) that the quantile head reads."""
        states, attention, _ = self.encode(context, mask)
        return self.decode(states, attention)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Quantiles in normalised units (B, Q, prediction_length) from decoder states (B, d_model)."""
        if pre_logits:
            return features
        out = self.quantile_head(features)
        return out.view(*features.shape[:-1], len(self.quantiles), out.shape[-1] // len(self.quantiles))

    def reset_classifier(self, n_outputs: int, quantiles: Sequence[float] | None = None) -> None:
        """A fresh quantile head for a horizon of ``n_outputs`` steps (and other ``quantiles``)."""
        old = self.quantile_head.output.out_features
        self.reconfigure(prediction_length=n_outputs, quantiles=quantiles)
        if self.quantile_head.output.out_features == old:  # same shape: still a fresh head, as asked
            self.quantile_head = self._new_head(len(self.quantiles), self.prediction_length).to(self.device)
            self.quantile_head.apply(self._init_weights)

    def per_sample_loss(self, context: torch.Tensor, target: torch.Tensor, target_mask: torch.Tensor | None = None,
                        *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The quantile loss of each series (B,) (see :func:`quantile_loss`); its mean is
        ``forward(...)["loss"]``."""
        return self._run(context, target, target_mask, mask)[1]

    def forward(self, context: torch.Tensor, target: torch.Tensor | None = None,
                target_mask: torch.Tensor | None = None, *, mask: torch.Tensor | None = None) -> dict[str, Any]:
        """``{"quantile_preds": (B, Q, prediction_length) in the data's units, "loss": scalar or None}``.

        ``target`` (B, H) with ``H <= prediction_length`` (missing steps NaN, or marked False in
        ``target_mask``) gives the quantile loss in normalised units, averaged over the batch."""
        preds, per_sample = self._run(context, target, target_mask, mask)
        return {"quantile_preds": preds, "loss": None if per_sample is None else per_sample.mean()}

    def _run(self, context, target, target_mask, mask):
        states, attention, (loc, scale) = self.encode(self.prepare_context(context), mask)
        normalised = self.forward_head(self.decode(states, attention))
        per_sample = None if target is None else self._loss(normalised, target, target_mask, loc, scale)
        preds = normalised.to(torch.float32) * scale.unsqueeze(-1) + loc.unsqueeze(-1)
        return preds, per_sample

    def _loss(self, normalised, target, target_mask, loc, scale) -> torch.Tensor:
        target = torch.as_tensor(target).to(device=normalised.device, dtype=torch.float32)
        if target.ndim == 1:
            target = target.unsqueeze(0)
        horizon = normalised.shape[-1]
        if target.ndim != 2 or target.shape[0] != normalised.shape[0] or target.shape[-1] > horizon:
            raise ValueError(f"target: expected shape (batch={normalised.shape[0]}, H <= prediction_length={horizon}), "
                             f"got {tuple(target.shape)}")
        valid = ~torch.isnan(target)
        if target_mask is not None:
            # a NaN marked as observed would make the loss NaN; it counts as missing instead
            valid = valid & torch.as_tensor(target_mask).to(device=target.device, dtype=torch.bool)
        scaled = torch.where(valid, (target - loc) / scale, torch.zeros_like(target))
        if target.shape[-1] < horizon:  # steps beyond the target are not scored
            pad = horizon - target.shape[-1]
            scaled = F.pad(scaled, (0, pad))
            valid = F.pad(valid, (0, pad), value=False)
        levels = torch.tensor(self.quantiles, device=normalised.device, dtype=torch.float32)
        return quantile_loss(normalised.to(torch.float32), scaled, valid, levels)

    # -- inference -------------------------------------------------------------------

    @torch.no_grad()
    def embed(self, context, *, return_state: bool = False):
        """Encoder states (B, N [+1 for REG], d_model) of the context on the model's device, as
        ``ChronosBoltPipeline.embed`` (which moves them to the CPU); ``return_state=True`` also
        returns ``(loc, scale)``, each (B,), as :meth:`.forecast.TokenForecaster.embed` returns its
        tokenizer state."""
        states, _, (loc, scale) = self.encode(self.prepare_context(context))
        return (states, (loc.squeeze(-1), scale.squeeze(-1))) if return_state else states

    @torch.no_grad()
    def predict(self, context, prediction_length: int | None = None, *, limit_prediction_length: bool = False,
                **sampling) -> torch.Tensor:
        """Quantile forecasts (B, Q, prediction_length) float32 on the CPU, Q = ``len(self.quantiles)``.

        Args:
            context: one series (T,), a batch (B, T) left-padded with NaN, or a list of 1-D series.
            prediction_length: horizon (default: the model's). A longer horizon rolls out (each
                predicted quantile path appended to the context, the ``Q x Q`` forecasts reduced
                to ``Q`` quantiles), with a warning, or an error with ``limit_prediction_length``.
            **sampling: sampling keywords of the token forecasters (``num_samples``, ``seed``,
                ...), accepted and ignored: this forecaster is deterministic.
        """
        unknown = sorted(set(sampling) - set(_SAMPLING_KEYWORDS))
        if unknown:
            raise TypeError(f"predict() got unexpected keyword argument(s) {unknown}")
        horizon = self.prediction_length if prediction_length is None else int(prediction_length)
        if horizon < 1:
            raise ValueError(f"prediction_length={prediction_length}: must be >= 1")
        if horizon > self.prediction_length:
            message = (f"prediction_length={horizon} exceeds the {self.prediction_length} steps this model forecasts "
                       "in one pass; rolling out, which may degrade quality")
            if limit_prediction_length:
                raise ValueError(message + " (limit_prediction_length=True)")
            warnings.warn(message, stacklevel=2)
        was_training = self.training
        self.eval()
        try:
            context = self.prepare_context(context)[..., -self.context_length :]
            prediction = self(context)["quantile_preds"]
            pieces, remaining = [prediction], horizon - prediction.shape[-1]
            if remaining > 0:
                n_levels = len(self.quantiles)
                levels = torch.tensor(self.quantiles, device=context.device, dtype=torch.float32)
                paths = context.unsqueeze(1).expand(-1, n_levels, -1)  # (B, Q, T)
                while remaining > 0:
                    paths = torch.cat([paths, prediction], dim=-1)[..., -self.context_length :]
                    b, q, t = paths.shape
                    step = self(paths.reshape(b * q, t))["quantile_preds"].reshape(b, q * n_levels, -1)
                    prediction = torch.quantile(step, levels, dim=1).transpose(0, 1)  # (B, Q, H)
                    pieces.append(prediction)
                    remaining -= prediction.shape[-1]
        finally:
            self.train(was_training)
        return torch.cat(pieces, dim=-1)[..., :horizon].to(device="cpu", dtype=torch.float32)

    @torch.no_grad()
    def predict_quantiles(self, context, prediction_length: int | None = None,
                          quantile_levels: Sequence[float] = DEFAULT_QUANTILES, **predict_kwargs):
        """Quantiles (B, H, len(quantile_levels)) and mean (B, H), as ``ChronosBoltPipeline.predict_quantiles``.

        Levels the model predicts are returned as they are. Others are interpolated linearly
        between the model's levels, with the lowest and highest prediction repeated once at each
        end (the upstream rule, exact for an evenly spaced grid such as 0.1, ..., 0.9); levels
        outside the model's range get its extreme prediction, with a warning. The mean is the
        median (as upstream), interpolated the same way when 0.5 is not one of the model's levels.
        """
        levels = [float(q) for q in quantile_levels]
        if not levels or any(not 0.0 <= q <= 1.0 for q in levels):
            raise ValueError(f"quantile_levels={list(quantile_levels)}: expected levels in [0, 1]")
        predictions = self.predict(context, prediction_length, **predict_kwargs).swapaxes(1, 2)  # (B, H, Q)
        own = self.quantiles
        if set(levels) <= set(own):
            quantiles = predictions[..., [own.index(q) for q in levels]]
        else:
            if min(levels) < min(own) or max(levels) > max(own):
                warnings.warn(f"quantile_levels {levels} reach outside the levels this model predicts ({own}); "
                              "levels beyond them get its lowest/highest prediction", stacklevel=2)
            quantiles = self._interpolate(predictions, levels)
        mean = predictions[..., own.index(0.5)] if 0.5 in own else self._interpolate(predictions, [0.5])[..., 0]
        return quantiles, mean

    @staticmethod
    def _interpolate(predictions: torch.Tensor, levels: list[float]) -> torch.Tensor:
        augmented = torch.cat([predictions[..., :1], predictions, predictions[..., -1:]], dim=-1)
        q = torch.tensor(levels, dtype=augmented.dtype)
        return torch.quantile(augmented, q, dim=-1).permute(1, 2, 0)

    def extra_repr(self) -> str:
        return (f"context_length={self.context_length}, prediction_length={self.prediction_length}, "
                f"patch={self.input_patch_size}/{self.input_patch_stride}, quantiles={len(self.quantiles)}, "
                f"reg_token={self.use_reg_token}")



# --------------------------------------------------------------------------- registered variants

from domainfm.zoo import WeightSource, register_model  # noqa: E402

from .chronos_bolt_convert import convert_chronos_bolt, load_chronos_bolt  # noqa: E402,F401

CHRONOS_BOLT_PAPER = "https://arxiv.org/abs/2403.07815"  # Chronos; Bolt is described in its repository and model cards

#: T5 sizes of the published checkpoints (d_kv 64 throughout). Confirmed by parameter counts:
#: these shapes give 8.65M / 21.2M / 47,718,016 / 205.3M parameters, the published 9M / 21M / 48M
#: / 205M (small's exact count as reported by a user of the checkpoint); the config.json files
#: themselves could not be read from here.
BOLT_SIZES = {
    "tiny": dict(d_model=256, d_ff=1024, num_layers=4, num_heads=4),
    "mini": dict(d_model=384, d_ff=1536, num_layers=4, num_heads=8),
    "small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8),
    "base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
}
#: forecasting settings of the published checkpoints (their chronos_config; loading a repository
#: adopts whatever its config.json says, so these are only the defaults of a bare create_model)
BOLT_DEFAULTS = dict(context_length=2048, prediction_length=64, input_patch_size=16, input_patch_stride=16,
                     quantiles=list(DEFAULT_QUANTILES), use_reg_token=True, d_kv=64, relative_attention_num_buckets=32,
                     relative_attention_max_distance=128, dropout=0.1, layer_norm_eps=1e-6, dense_act_fn="relu",
                     initializer_factor=0.05)
#: Hub revisions the weight sources pin (as pinned by several public projects using these
#: checkpoints; not verified from here)
CHRONOS_BOLT_REVISIONS = {
    "tiny": "a0e552de83495b5c28c14c71c374f3e33280b340",
    "mini": "251268337516a88e253628c43e1d26ec577b376b",
    "small": "772f3d25d38aec6d914c8949dab4462e2d46f5d8",
    "base": "5d9f166d69f47aef3401367a7b842e78fe97b121",
}
#: full sha256 of the published files, when confirmed ("amazon/chronos-bolt-tiny" -> {file: digest});
#: none could be confirmed offline
CHRONOS_BOLT_SHA256: dict[str, dict[str, str]] = {}


def _weights(size: str) -> tuple[WeightSource, ...]:
    """The published repository ``hf://amazon/chronos-bolt-SIZE`` (config.json + model.safetensors),
    Apache-2.0, pinned to the revision in :data:`CHRONOS_BOLT_REVISIONS`. No full sha256 could be
    confirmed offline: the hub verifies each file against the sha256 the Hub publishes for it at
    that revision and enforces the digest recorded on first download."""
    # defined by the package before it imports this module (Chronos-T5 and Bolt share the real corpus)
    from . import CHRONOS_OVERLAPS, CHRONOS_REAL_DATA

    repo = f"amazon/chronos-bolt-{size}"
    digest = CHRONOS_BOLT_SHA256.get(repo, {}).get("model.safetensors")
    try:
        return (WeightSource(
            f"hf://{repo}", sha256=digest, converter="official", license="Apache-2.0",
            description=f"Chronos-Bolt ({size}) pretrained by Amazon on nearly 100 billion time series observations",
            revision=CHRONOS_BOLT_REVISIONS[size],
            note="no sha256 confirmed offline; revision as pinned by public projects using this checkpoint, "
                 "not verified from here; real datasets as Chronos-T5's per a Chronos author "
                 "(amazon-science/chronos-forecasting#245), the model card says the 27 Benchmark II datasets "
                 "were not seen; not confirmed: Bolt's synthetic data and training windows, and the GIFT-Eval "
                 "overlap (third-party reports: SalesforceAIResearch/gift-eval#29, #62)",
            pretraining_data=CHRONOS_REAL_DATA + ", and synthetic series; nearly 100 billion observations in all "
                                                 "(model card)",
            overlaps=CHRONOS_OVERLAPS),)
    except (TypeError, ValueError, AttributeError):
        # a zoo whose WeightSource needs a full sha256 (no revision/note fields): no registered
        # source; pretrained="hf://amazon/chronos-bolt-SIZE" or a local folder still load
        return ()


def _example(context_length: int):
    def make():
        g = torch.Generator().manual_seed(0)
        context = torch.randn(2, min(40, context_length), generator=g)
        context[1, :7] = float("nan")  # left padding
        context[0, 12] = float("nan")  # a gap
        return (context,)

    return make


def _build(**kwargs) -> ChronosBolt:
    return ChronosBolt(**kwargs)


def _register(size: str, shape: dict, *, tags=(), weights=(), **overrides) -> None:
    defaults = {**BOLT_DEFAULTS, **shape, **overrides}
    register_model(
        f"chronos-bolt-{size}", family="wavetoken", paper=CHRONOS_BOLT_PAPER, license="Apache-2.0",
        description=f"Chronos-Bolt ({size}): patch embedding + T5 encoder, one decoder step to "
                    f"{len(defaults['quantiles'])} quantiles x {defaults['prediction_length']} steps. "
                    f"Weights: hf://amazon/chronos-bolt-{size} (or pretrained=DIR / load_chronos_bolt)",
        input_spec={"n_chans": 1, "n_times": defaults["context_length"],
                    "prediction_length": defaults["prediction_length"],
                    "input_patch_size": defaults["input_patch_size"], "quantiles": list(defaults["quantiles"])},
        defaults=defaults, weights=weights, converters={"official": convert_chronos_bolt}, head="quantile_head",
        tags=tags, example_input=_example(defaults["context_length"]),
    )(_build)


_register("test", dict(d_model=32, d_ff=64, num_layers=2, num_heads=4), tags=("test",), d_kv=8,
          relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout=0.0, initializer_factor=1.0,
          context_length=64, prediction_length=16, input_patch_size=8, input_patch_stride=8)
for _size, _shape in BOLT_SIZES.items():
    _register(_size, _shape, weights=_weights(_size))
