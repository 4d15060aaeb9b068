"""Probabilistic forecasting with a tokenized encoder-decoder: WaveToken and Chronos on one engine.

:class:`TokenForecaster` is the T5 encoder-decoder of :mod:`.t5` plus a tokenizer from
:mod:`.tokenizer` (``tokenizer="wavelet"`` for WaveToken, ``"chronos"`` for Chronos). It samples
``num_samples`` token paths autoregressively (temperature, top-k, top-p as in Hugging Face
``generate``), decodes them to values, and summarises them as quantiles.

Sampling is reproducible and independent of batch composition: each series draws its uniforms
from its own generator, seeded by ``(seed, a hash of the series' values)``, and a token is chosen
by inverting the cumulative distribution at that uniform. Special tokens (PAD, EOS) are never
sampled (Hugging Face's ``min_new_tokens`` suppresses only EOS).
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .t5 import T5EncoderDecoder, _mask_bias
from .tokenizer import SeriesTokenizer, TokenizerState, build_tokenizer

__all__ = ["TokenForecaster", "filter_logits", "series_seeds", "DEFAULT_QUANTILES"]

DEFAULT_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_TOKENIZER_KEYS = {
    "wavelet": ("vocab_size", "n_special_tokens", "pad_token_id", "eos_token_id", "use_eos_token", "context_length",
                "wavelet", "wavelet_level", "wavelet_mode", "scaling", "low_limit", "high_limit", "threshold",
                "threshold_rule", "fdr_q", "scaling_window"),
    "chronos": ("low_limit", "high_limit", "n_special_tokens", "pad_token_id", "eos_token_id", "use_eos_token",
                "context_length"),
}


def filter_logits(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Hugging Face's warpers in their order: divide by ``temperature``; keep the ``top_k`` largest
    (ties with the k-th kept); keep the smallest set whose probability reaches ``top_p``."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use top_k=1 for greedy decoding)")
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # ascending; stable, so that of tokens tied at the cut the lower ids go first, whatever the
        # vocabulary slice (the CPU sampler filters only the top-k candidates)
        sorted_logits, order = torch.sort(logits, dim=-1, stable=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[..., -1] = False  # keep at least the best token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


#: candidates beyond ``top_k`` kept by the top-k sampler, so that ties with the k-th logit (common
#: with bf16 logits) stay candidates as in the full-vocabulary filter
_TIE_MARGIN = 14


def _sample_top_k(logits: torch.Tensor, u: torch.Tensor, *, temperature: float, top_k: int,
                  top_p: float | None) -> torch.Tensor | None:
    """The token :meth:`TokenForecaster._sample` picks, computed on the ``top_k + _TIE_MARGIN``
    largest logits instead of the whole vocabulary (the filtered-out tokens have probability 0, so
    the CDF over the candidates in token-id order is the same CDF); about 4x less work per step
    on CPU. Returns ``None`` when ties with the k-th logit reach past the candidates (then the
    caller filters the whole vocabulary). ``logits`` (N, V) in any dtype, ``u`` (N,)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use top_k=1 for greedy decoding)")
    values, index = torch.topk(logits, top_k + _TIE_MARGIN, dim=-1)  # descending
    kth = values[:, top_k - 1 : top_k]
    if bool((values[:, -1:] >= kth).any()):
        return None
    keep = values >= kth  # the k largest and their ties (dividing by temperature keeps the order)
    index, order = index.sort(dim=-1)  # token-id order, the order the CDF is inverted in
    values = values.float().gather(-1, order).masked_fill_(~keep.gather(-1, order), float("-inf"))
    choice = _invert_cdf(filter_logits(values, temperature=temperature, top_p=top_p), u)
    return index.gather(-1, choice)[:, 0]


def _invert_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(N, 1) column of the first token whose softmax CDF (in column order) exceeds ``u * total``,
    from filtered (N, V) float logits and (N,) uniforms."""
    cdf = logits.softmax(-1).cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    choice = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # searchsorted can land past the last token of positive probability only through round-off
    # at the top (u * total rounding to total): cap it at that token (the first reaching total)
    return torch.minimum(choice, torch.searchsorted(cdf, total))


def _series_key(row: torch.Tensor) -> int:
    values = row.detach().to(torch.float32).cpu().numpy()
    first = np.flatnonzero(~np.isnan(values))
    values = values[first[0]:] if len(first) else values[:0]  # left padding does not change the key
    digest = hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def series_seeds(context: torch.Tensor, seed: int) -> list[int]:
    """One generator seed per series from ``seed`` and the series' own values."""
    return [(_series_key(row) ^ (int(seed) * 0x9E3779B97F4A7C15)) % (2**63 - 1) for row in context]


class TokenForecaster(T5EncoderDecoder):
    """Encoder-decoder forecaster over a series tokenizer.

    Args:
        tokenizer: ``"wavelet"`` (WaveToken) or ``"chronos"`` (mean scaling + 4093 uniform bins).
        context_length: context values the model sees (longer contexts are truncated to the last
            ``context_length``).
        prediction_length: the horizon the model was trained for; longer horizons roll out.
        num_samples, temperature, top_k, top_p: sampling defaults (Chronos: 20, 1.0, 50, 1.0).
        tokenizer_kwargs: tokenizer settings (see :class:`.tokenizer.WaveletTokenizer` and
            :class:`.tokenizer.MeanScaleUniformBins`), e.g. ``{"wavelet": "bior2.2",
            "wavelet_level": 1, "scaling": "standard", "threshold": "none"}``.
        **t5_kwargs: sizes of :class:`.t5.T5EncoderDecoder` (``vocab_size`` comes from the
            tokenizer: ``n_tokens`` for Chronos, ``vocab_size`` for WaveToken).
        n_chans, n_times, sfreq, n_outputs: the signal description of the zoo; a univariate model
            (``n_chans`` must be 1), ``n_times`` = ``context_length`` and ``n_outputs`` =
            ``prediction_length`` when given.
    """

    def __init__(self, *, tokenizer: str = "wavelet", context_length: int = 512, prediction_length: int = 64,
                 num_samples: int = 20, temperature: float = 1.0, top_k: int | None = 50, top_p: float | None = 1.0,
                 vocab_size: int = 1024, tokenizer_kwargs: dict[str, Any] | None = None,
                 n_chans: int | None = None, n_times: int | None = None, sfreq: float | None = None,
                 n_outputs: int | None = None, **t5_kwargs):
        if n_chans not in (None, 1):
            raise ValueError(f"n_chans={n_chans}: {type(self).__name__} forecasts univariate series; pass n_chans=1 "
                             "and forecast each channel as its own series")
        if n_times is not None and n_times != context_length:
            raise ValueError(f"n_times={n_times} disagrees with context_length={context_length}; give one of them")
        if n_outputs is not None and n_outputs != prediction_length:
            raise ValueError(f"n_outputs={n_outputs} disagrees with prediction_length={prediction_length}; give one of them")
        if prediction_length < 1 or context_length < 1:
            raise ValueError(f"context_length={context_length} and prediction_length={prediction_length} must be >= 1")
        tokenizer_kwargs = dict(tokenizer_kwargs or {})
        allowed = _TOKENIZER_KEYS.get(tokenizer)
        if allowed is None:
            raise ValueError(f"tokenizer={tokenizer!r}: expected 'wavelet' or 'chronos'")
        unknown = sorted(set(tokenizer_kwargs) - set(allowed))
        if unknown:
            raise ValueError(f"tokenizer_kwargs: unknown setting(s) {unknown} for the {tokenizer} tokenizer; known: {sorted(allowed)}")
        tokenizer_kwargs.setdefault("context_length", context_length)
        if tokenizer_kwargs["context_length"] != context_length:
            raise ValueError("tokenizer_kwargs.context_length must equal context_length")
        if tokenizer == "chronos":
            tok = build_tokenizer("chronos", n_tokens=vocab_size, **tokenizer_kwargs)
        else:
            tok = build_tokenizer("wavelet", vocab_size=vocab_size, **tokenizer_kwargs)
        super().__init__(vocab_size=vocab_size, pad_token_id=tok.pad_token_id,
                         decoder_start_token_id=t5_kwargs.pop("decoder_start_token_id", tok.pad_token_id), **t5_kwargs)
        self.tokenizer: SeriesTokenizer = tok
        self.tokenizer_kind = tokenizer
        self.context_length, self.prediction_length = context_length, prediction_length
        self.num_samples, self.temperature, self.top_k, self.top_p = num_samples, temperature, top_k, top_p
        self.sfreq = sfreq

    # -- Chronos-format configs ---------------------------------------------------

    @property
    def domainfm_upstream_config(self) -> dict | None:
        return self.__dict__.get("_upstream_config")

    @domainfm_upstream_config.setter
    def domainfm_upstream_config(self, config: dict) -> None:
        """Called by the hub with an upstream ``config.json`` (a Hugging Face T5 config with a
        ``chronos_config`` block): check that it describes this architecture, then adopt its
        tokenizer and sampling settings."""
        from .convert import apply_chronos_config

        apply_chronos_config(self, config)
        self.__dict__["_upstream_config"] = config

    # -- inputs ------------------------------------------------------------------

    def prepare_context(self, context) -> torch.Tensor:
        """(B, T) float32 on the model's device from a tensor, array or list of ragged series."""
        return self.tokenizer.prepare_context(context).to(self.shared.weight.device)

    def tokenize(self, context) -> tuple[torch.Tensor, torch.Tensor, TokenizerState]:
        ctx = self.prepare_context(context)
        ids, mask, state = self.tokenizer.encode_context(ctx)
        return ids.to(ctx.device), mask.to(ctx.device), state

    @torch.no_grad()
    def embed(self, context, *, return_state: bool = False):
        """Encoder states (B, L, d_model) of the tokenized context (with EOS: L = tokens + 1), as
        ``ChronosPipeline.embed``; ``return_state=True`` also returns the tokenizer state (scale)."""
        ids, mask, state = self.tokenize(context)
        states = self.encode(ids, mask)
        return (states, state) if return_state else states

    # -- sampling ------------------------------------------------------------------

    def _suppressed(self) -> torch.Tensor:
        suppress = torch.zeros(self.vocab_size, dtype=torch.bool)
        suppress[: self.tokenizer.n_special_tokens] = True
        return suppress

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_tokens: int, *,
                 uniforms: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True) -> torch.Tensor:
        """Sample token paths.

        Args:
            input_ids, attention_mask: tokenized context (B, L).
            num_tokens: tokens to generate per path.
            uniforms: (B, S, num_tokens) numbers in [0, 1); path ``s`` of series ``b`` takes at step
                ``t`` the token where the filtered CDF first exceeds ``uniforms[b, s, t]``. With
                ``top_k=1`` this is greedy decoding.
            use_cache: KV-cached decoding (one position per step) or recomputing the whole prefix.

        Returns:
            (B, S, num_tokens) token ids.
        """
        b, s = uniforms.shape[:2]
        encoder_states = self.encode(input_ids, attention_mask)
        device = encoder_states.device
        flat_u = uniforms.reshape(b * s, num_tokens).to(device=device, dtype=torch.float32)
        n_special = self.tokenizer.n_special_tokens
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        out = torch.empty((b * s, num_tokens), dtype=torch.long, device=device)
        if not use_cache:
            expanded = encoder_states.repeat_interleave(s, 0)
            mask = attention_mask.repeat_interleave(s, 0)
            prefix = torch.full((b * s, num_tokens + 1), self.decoder_start_token_id, dtype=torch.long, device=device)
            for t in range(num_tokens):
                states = self.decode(prefix[:, : t + 1], expanded, mask)[:, -1:]
                out[:, t] = prefix[:, t + 1] = self._sample(self.logits(states)[:, 0], flat_u[:, t], n_special, **sample)
            return out.reshape(b, s, num_tokens)
        # every path of a series starts from the same token: the first step runs once per series
        # (B rows), then the cache is widened to B * S rows; cross-attention keys/values stay (B, ...)
        # and are shared by the S paths of a series (cache.group)
        cache = self.new_cache(encoder_states, num_tokens)
        # the mask bias in the dtype of the cross-attention scores (no mixed-dtype add per step),
        # and none at all when nothing is masked (adding zeros changes no score)
        mask = attention_mask.bool()
        cross_bias = None if bool(mask.all()) else _mask_bias(mask, cache.cross_k[0].dtype)
        start = torch.full((b, 1), self.decoder_start_token_id, dtype=torch.long, device=device)
        first = self.logits(self.decode_step(start, cache, cross_bias))[:, 0]
        out[:, 0] = self._sample(first.repeat_interleave(s, 0), flat_u[:, 0], n_special, **sample)
        if num_tokens > 1:
            cache.expand(s, num_tokens)
        for t in range(1, num_tokens):
            states = self.decode_step(out[:, t - 1 : t], cache, cross_bias)
            out[:, t] = self._sample(self.logits(states)[:, 0], flat_u[:, t], n_special, **sample)
        return out.reshape(b, s, num_tokens)

    @staticmethod
    def _sample(logits: torch.Tensor, u: torch.Tensor, n_special: int, *, temperature: float,
                top_k: int | None, top_p: float | None) -> torch.Tensor:
        """(N,) token ids from (N, V) logits and (N,) uniforms by inverting the filtered CDF over
        the regular tokens (ids >= ``n_special``; special tokens are never sampled). No host sync
        (on CPU, with ``top_k``, one check whether ties reach past the candidates, which is free)."""
        logits = logits[:, n_special:]
        if top_k is not None and 0 < top_k and top_k + _TIE_MARGIN < logits.shape[-1] and logits.device.type == "cpu":
            choice = _sample_top_k(logits, u, temperature=temperature, top_k=top_k, top_p=top_p)
            if choice is not None:
                return choice + n_special
        choice = _invert_cdf(filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p), u)
        return choice[:, 0] + n_special

    def _uniforms(self, context: torch.Tensor, seed: int, chunk: int, num_samples: int, num_tokens: int) -> torch.Tensor:
        rows = []
        for row_seed in series_seeds(context, seed):
            g = torch.Generator().manual_seed((row_seed + 1_000_003 * chunk) % (2**63 - 1))
            rows.append(torch.rand(num_samples, num_tokens, generator=g))
        return torch.stack(rows)

    @torch.no_grad()
    def predict(self, context, prediction_length: int | None = None, num_samples: int | None = None, *,
                temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                seed: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """Sample forecast paths.

        Args:
            context: one series (T,), a batch (B, T) left-padded with NaN, or a list of 1-D series
                of any lengths; NaN marks missing values.
            prediction_length: horizon (default: the model's). Longer than the trained horizon rolls
                out: the median of the samples is appended to the context and forecasting continues
                (with a warning, as Chronos does).
            num_samples, temperature, top_k, top_p: sampling (defaults: the model's). ``top_k=1``
                is greedy decoding.
            seed: makes the samples reproducible; without it, a seed is drawn from torch's global
                generator (so ``torch.manual_seed`` also fixes the result).

        Returns:
            (B, num_samples, prediction_length) float32 samples on the CPU.
        """
        h = self.prediction_length if prediction_length is None else int(prediction_length)
        if h < 1:
            raise ValueError(f"prediction_length={prediction_length}: must be >= 1")
        num_samples = self.num_samples if num_samples is None else int(num_samples)
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: must be >= 1")
        temperature = self.temperature if temperature is None else temperature
        top_k = self.top_k if top_k is None else top_k
        top_p = self.top_p if top_p is None else top_p
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        if h > self.prediction_length:
            warnings.warn(
                f"prediction_length={h} exceeds the {self.prediction_length} steps this model was trained for; "
                "forecasting by rolling out (the median forecast is appended to the context), which may degrade quality",
                stacklevel=2,
            )
        was_training = self.training
        self.eval()
        try:
            context = self.tokenizer_context_history(context)
            pieces = []
            remaining, chunk = h, 0
            # Every chunk is the trained horizon's token layout, truncated: the wavelet tokenizer lays
            # a horizon out coarse-to-fine ([approximation | detail] of all of it), so generating
            # num_label_tokens(h) tokens for a shorter h would decode positions the model learned
            # as approximation as detail. A tokenizer whose tokens are the steps themselves
            # (``horizon_layout_is_causal``: Chronos) stops after the tokens it needs; its uniforms
            # are the first columns of the full chunk's, so both give the same values.
            full_tokens = self.tokenizer.num_label_tokens(self.prediction_length)
            causal = self.tokenizer.horizon_layout_is_causal
            while remaining > 0:
                step = min(remaining, self.prediction_length)
                ids, mask, state = self.tokenizer.encode_context(context.to(self.shared.weight.device))
                n_tokens = self.tokenizer.num_label_tokens(step) if causal else full_tokens
                uniforms = self._uniforms(context, seed, chunk, num_samples, full_tokens)[..., :n_tokens]
                tokens = self.generate(ids, mask, n_tokens, uniforms=uniforms, temperature=temperature,
                                       top_k=top_k, top_p=top_p, use_cache=use_cache)
                decoded = step if causal else self.prediction_length
                values = self.tokenizer.decode(tokens, state, decoded).float().cpu()[..., :step]
                pieces.append(values)
                remaining -= step
                chunk += 1
                if remaining > 0:
                    context = torch.cat([context, values.median(dim=1).values], dim=-1)
            return torch.cat(pieces, dim=-1)
        finally:
            self.train(was_training)

    def tokenizer_context_history(self, context) -> torch.Tensor:
        """The (B, T) context on the CPU, left-padded with NaN across the batch (kept whole: the
        tokenizer truncates to ``context_length`` itself, after roll-out appends the median)."""
        from .tokenizer import left_pad_and_stack

        return left_pad_and_stack(context)

    @torch.no_grad()
    def predict_quantiles(self, context, prediction_length: int | None = None,
                          quantile_levels: Sequence[float] = DEFAULT_QUANTILES, **predict_kwargs):
        """Quantiles (B, H, Q) and mean (B, H) of the sampled paths, as ``ChronosPipeline.predict_quantiles``."""
        levels = torch.tensor([float(q) for q in quantile_levels])
        if levels.numel() == 0 or (levels < 0).any() or (levels > 1).any():
            raise ValueError(f"quantile_levels={list(quantile_levels)}: expected levels in [0, 1]")
        samples = self.predict(context, prediction_length, **predict_kwargs).swapaxes(1, 2)  # (B, H, S)
        quantiles = torch.quantile(samples, levels, dim=-1).permute(1, 2, 0)
        return quantiles, samples.mean(-1)

    # -- training --------------------------------------------------------------------

    def training_tokens(self, context: torch.Tensor, future: torch.Tensor):
        """Token ids, attention mask and labels (``-100`` where the future is missing) for one
        batch of (B, T) contexts and (B, H) futures."""
        ctx = self.tokenizer.prepare_context(context) if context.shape[-1] != self.context_length else context
        ids, mask, state = self.tokenizer.encode_context(ctx.float())
        future = future.float()
        short = self.prediction_length - future.shape[-1]
        if short > 0 and not self.tokenizer.horizon_layout_is_causal:
            # a shorter future is the trained horizon with its tail missing: the labels keep the
            # layout predict() decodes (see predict), the missing tail is ignored by the loss
            future = torch.cat([future, future.new_full((future.shape[0], short), float("nan"))], dim=-1)
        labels, label_mask = self.tokenizer.encode_labels(future, state)
        labels = labels.masked_fill(~label_mask, -100)
        device = self.shared.weight.device
        return ids.to(device), mask.to(device), labels.to(device)

    def loss(self, context: torch.Tensor, future: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy of the label tokens under teacher forcing, and token accuracy."""
        ids, mask, labels = self.training_tokens(context, future)
        logits = self(ids, mask, self.shift_right(labels))
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        valid = labels != -100
        accuracy = ((logits.argmax(-1) == labels) & valid).sum() / valid.sum().clamp(min=1)
        return loss, {"loss": loss.detach(), "token_accuracy": accuracy.detach()}

