"""T5-style encoder-decoder with relative position bias and a KV-cached decoder.

The architecture of T5 (Raffel et al., 2020, arXiv:1910.10683) as used by Chronos and WaveToken:
pre-norm blocks with RMS layer norm (no mean, no bias, eps 1e-6), attention *without*
``1/sqrt(d_kv)`` scaling, a learned relative position bias computed by the first block of each
stack (bucketed: half the buckets exact distances, half logarithmic up to ``max_distance``;
bidirectional in the encoder, causal in the decoder) and shared by every block, no bias for
cross-attention, a ReLU feed-forward, shared input embeddings, and with tied embeddings an output
head that reuses them after scaling the decoder states by ``d_model ** -0.5``.

Parameter names (``shared``, ``encoder.blocks.{i}.self_attn.{q,k,v,o}``, ``….ffn.{wi,wo}``, …) are
ours; :func:`domainfm.models.wavetoken.convert.convert_hf_t5` maps Hugging Face T5 checkpoints.

Shapes:
    ``input_ids`` (B, L) int, ``attention_mask`` (B, L) bool, ``decoder_input_ids`` (B, T) int
    -> logits (B, T, vocab_size).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["relative_position_bucket", "RMSNorm", "Attention", "Block", "Stack", "T5EncoderDecoder", "KVCache"]


#: device types torch autocast knows (the meta device, used to build large models without memory, has none)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for device types autocast does not know)."""
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of ``relative_position = key_position - query_position``.

    Bidirectional: half the buckets for keys after the query. Within a half, distances below
    ``n/2`` get their own bucket, larger ones share logarithmically wider buckets up to
    ``max_distance``; everything farther lands in the last bucket. Causal (decoder): only keys at or
    before the query exist, and all ``num_buckets`` describe past distances.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1): log(0) would be -inf; those distances take the exact branch anyway
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RMSNorm(nn.Module):
    """T5's layer norm: ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class KVCache:
    """Decoder cache: per layer, self-attention keys/values written step by step into buffers of
    ``max_length`` positions, and cross-attention keys/values computed once from the encoder.

    The self-attention buffers (B, H, max_length, d_kv) are float32 even under bf16 autocast, and
    the cached self-attention runs with autocast off: with one query per row it is a few hundred
    tiny matmuls, about 2x faster in fp32 than in bf16 on CPUs without AMX (measured), and under
    autocast every step would otherwise cast the whole cached K/V to bf16."""

    def __init__(self, num_layers: int):
        self.self_k: list[torch.Tensor | None] = [None] * num_layers
        self.self_v: list[torch.Tensor | None] = [None] * num_layers
        self.cross_k: list[torch.Tensor | None] = [None] * num_layers
        self.cross_v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # positions already written
        # rows of the decoder batch per encoder row: with ``group`` > 1 the decoder batch is
        # (B * group) rows (samples of one series adjacent) while the cross-attention keys/values
        # stay (B, ...) and are shared by broadcasting instead of being copied per sample
        self.group = 1

    def expand(self, repeat: int, max_length: int) -> None:
        """Turn a cache of B rows into one of ``B * repeat`` rows (each row repeated, adjacent),
        keeping the positions written so far; cross-attention keys/values stay shared."""
        for store in (self.self_k, self.self_v):
            for i, buf in enumerate(store):
                b, h, _, d = buf.shape
                new = buf.new_empty((b * repeat, h, max_length, d))
                new.view(b, repeat, h, max_length, d)[:, :, :, : self.length] = buf[:, None, :, : self.length]
                store[i] = new
        self.group *= repeat


class Attention(nn.Module):
    """Multi-head attention without score scaling; the additive ``bias`` carries the relative
    position bias and the masks."""

    def __init__(self, d_model: int, num_heads: int, d_kv: int, dropout: float = 0.0):
        super().__init__()
        inner = num_heads * d_kv
        self.num_heads, self.d_kv, self.dropout = num_heads, d_kv, dropout
        self.q = nn.Linear(d_model, inner, bias=False)
        self.k = nn.Linear(d_model, inner, bias=False)
        self.v = nn.Linear(d_model, inner, bias=False)
        self.o = nn.Linear(inner, d_model, bias=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.d_kv).transpose(1, 2)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k(source)), self.split(self.v(source))

    @staticmethod
    def _cached_attention(q, kt, v, bias):
        scores = torch.matmul(q.to(kt.dtype), kt)
        if bias is not None:
            scores = scores + bias
        return torch.matmul(scores.softmax(-1).to(v.dtype), v).to(q.dtype)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, *, source: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``kv``: cached keys/values (B, H, S, d) each; the cached attention computes in their dtype."""
        q = self.split(self.q(x))
        if kv is not None and not (self.training and self.dropout):
            # cached decoding: a few queries against many keys, where plain matmuls beat the CPU
            # flash kernel (about 5x in bf16 for one query); bf16 softmax kernels accumulate in float32
            k, v = kv
            kt = k.transpose(-1, -2)
            device = q.device.type
            if _autocast_on(device):
                # computed in the cache's dtype with autocast off: autocast would cast a float32
                # cache to bf16 at every step, and return the softmax of bf16 scores in float32
                # (a copy back to bf16 per step); the bf16 softmax kernel accumulates in float32
                with torch.autocast(device, enabled=False):
                    out = self._cached_attention(q, kt, v, bias)
            else:
                out = self._cached_attention(q, kt, v, bias)
        else:
            k, v = kv if kv is not None else self.project_kv(x if source is None else source)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0, scale=1.0
            )
        b, _, n, _ = out.shape
        return self.o(out.transpose(1, 2).reshape(b, n, self.num_heads * self.d_kv))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.wo(self.dropout(F.relu(self.wi(x))))


class Block(nn.Module):
    """Pre-norm block: self-attention, (decoder) cross-attention, feed-forward; residuals."""

    def __init__(self, d_model, num_heads, d_kv, d_ff, dropout, eps, is_decoder):
        super().__init__()
        self.self_attn_norm = RMSNorm(d_model, eps)
        self.self_attn = Attention(d_model, num_heads, d_kv, dropout)
        self.is_decoder = is_decoder
        if is_decoder:
            self.cross_attn_norm = RMSNorm(d_model, eps)
            self.cross_attn = Attention(d_model, num_heads, d_kv, dropout)
        self.ffn_norm = RMSNorm(d_model, eps)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h, self_bias, *, encoder_states=None, cross_bias=None, cache: KVCache | None = None, layer: int = 0):
        normed = self.self_attn_norm(h)
        if cache is None:
            attn = self.self_attn(normed, self_bias)
        else:
            k_new, v_new = self.self_attn.project_kv(normed)
            t, n = cache.length, normed.shape[1]
            cache.self_k[layer][:, :, t : t + n] = k_new
            cache.self_v[layer][:, :, t : t + n] = v_new
            kv = (cache.self_k[layer][:, :, : t + n], cache.self_v[layer][:, :, : t + n])
            attn = self.self_attn(normed, self_bias, kv=kv)
        h = h + self.dropout(attn)
        if self.is_decoder:
            normed = self.cross_attn_norm(h)
            if cache is None:
                attn = self.cross_attn(normed, cross_bias, source=encoder_states)
            elif cache.group > 1:
                # the group's rows become queries of one encoder row: (B*G, n, d) -> (B, G*n, d)
                rows, n, d = normed.shape
                grouped = normed.reshape(rows // cache.group, cache.group * n, d)
                attn = self.cross_attn(grouped, cross_bias, kv=(cache.cross_k[layer], cache.cross_v[layer]))
                attn = attn.reshape(rows, n, -1)
            else:
                attn = self.cross_attn(normed, cross_bias, kv=(cache.cross_k[layer], cache.cross_v[layer]))
            h = h + self.dropout(attn)
        return h + self.dropout(self.ffn(self.ffn_norm(h)))


class Stack(nn.Module):
    """A stack of blocks with its relative position bias table and final norm."""

    def __init__(self, *, num_layers, d_model, num_heads, d_kv, d_ff, dropout, eps, is_decoder,
                 relative_attention_num_buckets, relative_attention_max_distance):
        super().__init__()
        self.is_decoder = is_decoder
        self.num_buckets, self.max_distance = relative_attention_num_buckets, relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(relative_attention_num_buckets, num_heads)
        self.blocks = nn.ModuleList(
            [Block(d_model, num_heads, d_kv, d_ff, dropout, eps, is_decoder) for _ in range(num_layers)]
        )
        self.final_norm = RMSNorm(d_model, eps)
        self.dropout = nn.Dropout(dropout)

    def position_bias(self, query_length: int, key_length: int, offset: int = 0, device=None) -> torch.Tensor:
        """(1, heads, query_length, key_length); query ``i`` sits at absolute position ``offset + i``."""
        device = device or self.relative_attention_bias.weight.device
        query = torch.arange(query_length, device=device)[:, None] + offset
        key = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(key - query, bidirectional=not self.is_decoder,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, h, self_bias, *, encoder_states=None, cross_bias=None, cache=None):
        h = self.dropout(h)
        for i, block in enumerate(self.blocks):
            h = block(h, self_bias, encoder_states=encoder_states, cross_bias=cross_bias, cache=cache, layer=i)
        return self.dropout(self.final_norm(h))


def _mask_bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    """(B, L) bool keep-mask -> (B, 1, 1, L) additive bias (0 or the most negative finite value,
    so that a fully masked row stays finite)."""
    return (~mask).to(dtype)[:, None, None, :] * torch.finfo(dtype).min


class T5EncoderDecoder(nn.Module):
    """T5 encoder-decoder (see module docstring).

    Args:
        vocab_size: number of token ids.
        d_model, d_kv, d_ff, num_heads, num_layers, num_decoder_layers: sizes (``num_decoder_layers``
            defaults to ``num_layers``).
        relative_attention_num_buckets, relative_attention_max_distance: T5 defaults 32 / 128.
        dropout: dropout rate (T5/Chronos: 0.1).
        layer_norm_eps: 1e-6.
        tie_word_embeddings: the output head reuses ``shared`` (and scales states by ``d_model**-0.5``).
        pad_token_id, decoder_start_token_id: T5 starts decoding from PAD (0).
        initializer_factor: T5's init scale (Chronos configs: 0.05).
    """

    def __init__(self, *, vocab_size: int, d_model: int = 256, d_kv: int = 64, d_ff: int = 1024, num_heads: int = 4,
                 num_layers: int = 4, num_decoder_layers: int | None = None, relative_attention_num_buckets: int = 32,
                 relative_attention_max_distance: int = 128, dropout: float = 0.1, layer_norm_eps: float = 1e-6,
                 tie_word_embeddings: bool = True, pad_token_id: int = 0, decoder_start_token_id: int = 0,
                 initializer_factor: float = 0.05):
        super().__init__()
        for label, value in (("vocab_size", vocab_size), ("d_model", d_model), ("d_kv", d_kv), ("d_ff", d_ff),
                             ("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r}: expected a positive integer")
        if relative_attention_num_buckets < 4 or relative_attention_max_distance <= relative_attention_num_buckets // 4:
            raise ValueError(
                f"relative_attention_num_buckets={relative_attention_num_buckets} / max_distance="
                f"{relative_attention_max_distance}: need >= 4 buckets and max_distance above num_buckets/4"
            )
        num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        self.vocab_size, self.d_model = vocab_size, d_model
        self.num_features = d_model
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id, self.decoder_start_token_id = pad_token_id, decoder_start_token_id
        self.initializer_factor = initializer_factor
        common = dict(d_model=d_model, num_heads=num_heads, d_kv=d_kv, d_ff=d_ff, dropout=dropout, eps=layer_norm_eps,
                      relative_attention_num_buckets=relative_attention_num_buckets,
                      relative_attention_max_distance=relative_attention_max_distance)
        self.shared = nn.Embedding(vocab_size, d_model)
        self.encoder = Stack(num_layers=num_layers, is_decoder=False, **common)
        self.decoder = Stack(num_layers=num_decoder_layers, is_decoder=True, **common)
        self.lm_head = None if tie_word_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    # -- init ------------------------------------------------------------------

    def _init_weights(self, module: nn.Module) -> None:
        # T5's initialisation (Mesh TensorFlow), scaled by initializer_factor
        f = self.initializer_factor
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Attention):
            d_model = module.q.in_features
            nn.init.normal_(module.q.weight, std=f * (d_model * module.d_kv) ** -0.5)
            nn.init.normal_(module.k.weight, std=f * d_model**-0.5)
            nn.init.normal_(module.v.weight, std=f * d_model**-0.5)
            nn.init.normal_(module.o.weight, std=f * (module.num_heads * module.d_kv) ** -0.5)
        elif isinstance(module, FeedForward):
            nn.init.normal_(module.wi.weight, std=f * module.wi.in_features**-0.5)
            nn.init.normal_(module.wo.weight, std=f * module.wo.in_features**-0.5)
        elif isinstance(module, Stack):
            nn.init.normal_(module.relative_attention_bias.weight, std=f * self.d_model**-0.5)
        elif module is self:
            nn.init.normal_(self.shared.weight, std=f)
            if self.lm_head is not None:
                nn.init.normal_(self.lm_head.weight, std=f)

    # -- pieces ----------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder states (B, L, d_model)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        h = self.shared(input_ids)
        length = input_ids.shape[1]
        bias = self.encoder.position_bias(length, length, device=h.device).to(h.dtype) + _mask_bias(attention_mask.bool(), h.dtype)
        if _autocast_on(h.device.type):  # cast the (B, H, L, L) bias once, not in every layer
            bias = bias.to(torch.get_autocast_dtype(h.device.type))
        return self.encoder(h, bias)

    def decode(self, decoder_input_ids: torch.Tensor, encoder_states: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder states (B, T, d_model) for a whole target prefix (teacher forcing, no cache)."""
        if attention_mask is None:
            attention_mask = torch.ones(encoder_states.shape[:2], dtype=torch.bool, device=encoder_states.device)
        h = self.shared(decoder_input_ids)
        t = decoder_input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        self_bias = self.decoder.position_bias(t, t, device=h.device).to(h.dtype) + _mask_bias(causal, h.dtype).view(1, 1, t, t)
        cross_bias = _mask_bias(attention_mask.bool(), h.dtype)
        return self.decoder(h, self_bias, encoder_states=encoder_states, cross_bias=cross_bias)

    def new_cache(self, encoder_states: torch.Tensor, max_length: int, *, repeat: int = 1) -> KVCache:
        """A cache for ``max_length`` decoder steps; cross-attention keys/values are projected once
        from ``encoder_states`` (B, L, d). ``repeat`` decoder rows per encoder row (for samples):
        copied ``repeat`` times (:meth:`KVCache.expand` instead shares them by broadcasting).
        Self-attention buffers are float32 (see :class:`KVCache`); cross-attention keys/values stay
        in the projections' dtype (the autocast dtype under autocast)."""
        cache = KVCache(len(self.decoder.blocks))
        b = encoder_states.shape[0] * repeat
        # self-attention buffers: float32 (see KVCache), or the states' dtype when that is wider
        dtype = torch.promote_types(encoder_states.dtype, torch.float32)
        for i, block in enumerate(self.decoder.blocks):
            # contiguous (B, H, L, d_kv): batched matmuls then read K^T and V without a copy per step
            k, v = (x.contiguous() for x in block.cross_attn.project_kv(encoder_states))
            if repeat > 1:
                k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
            cache.cross_k[i], cache.cross_v[i] = k, v
            shape = (b, block.self_attn.num_heads, max_length, block.self_attn.d_kv)
            cache.self_k[i] = encoder_states.new_zeros(shape, dtype=dtype)
            cache.self_v[i] = encoder_states.new_zeros(shape, dtype=dtype)
        return cache

    def decode_step(self, token_ids: torch.Tensor, cache: KVCache, cross_bias: torch.Tensor) -> torch.Tensor:
        """Decoder states (B, 1, d) for the next position, reading and extending ``cache``."""
        h = self.shared(token_ids)
        t = cache.length
        self_bias = self.decoder.position_bias(1, t + 1, offset=t, device=h.device).to(h.dtype)
        out = self.decoder(h, self_bias, cross_bias=cross_bias, cache=cache)
        cache.length += 1
        return out

    def logits(self, decoder_states: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(decoder_states * self.d_model**-0.5, self.shared.weight)
        return self.lm_head(decoder_states)

    # -- model surface -----------------------------------------------------------

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Teacher-forcing inputs: the start token, then the labels (``-100`` -> PAD) minus the last."""
        start = torch.full_like(labels[:, :1], self.decoder_start_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.pad_token_id)

    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder states (B, T, d_model); ``decoder_input_ids`` defaults to the start token alone."""
        if decoder_input_ids is None:
            decoder_input_ids = torch.full_like(input_ids[:, :1], self.decoder_start_token_id)
        encoder_states = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, encoder_states, attention_mask)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return features if pre_logits else self.logits(features)

    def reset_classifier(self, n_outputs: int) -> None:
        """A fresh, untied output head over ``n_outputs`` token ids (e.g. another vocabulary)."""
        self.tie_word_embeddings = False
        self.lm_head = nn.Linear(self.d_model, n_outputs, bias=False)
        nn.init.normal_(self.lm_head.weight, std=self.initializer_factor)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) of the next token at each decoder position."""
        return self.forward_head(self.forward_features(input_ids, attention_mask, decoder_input_ids))
