"""SToFM's gene-scale cell encoder: a Geneformer-style BERT whose pooler is ``[CLS] -> Linear -> L2``.

The official cell encoder (``cell_encoder/`` of the released checkpoint, loaded in the official
``get_embeddings.py``) is a Hugging Face ``BertModel`` (``cell_bert/``) whose pooler is replaced
by the ``[CLS]`` hidden state through ``Linear(hidden, 256)`` (``cell_proj.bin``) and an L2
normalisation. Its input is a Geneformer rank-value encoding of one cell (gene tokens in
descending order of median-scaled expression) with ``<cls>`` prepended, at most 2,048 tokens.

This is a plain-torch BERT with the Hugging Face key names under ``bert.`` (``embeddings.*``,
``encoder.layer.{i}.attention.self.{query,key,value}``, ``attention.output.{dense,LayerNorm}``,
``intermediate.dense``, ``output.{dense,LayerNorm}``), so ``transformers`` is not required; the
projection is ``proj``. The released shape is given only in the checkpoint's ``config.json``
(``convert.load_official_cell_encoder`` reads it); without one the defaults follow Geneformer's
6-layer model (hidden 256, 4 heads, FFN 512, ReLU, 2,048 positions), our assumption.

**Shapes:** ``input_ids (B, L)`` int, ``attention_mask (B, L)`` (1 = token) -> ``(B, proj_dim)``
unit vectors; ``forward_features`` -> hidden states ``(B, L, hidden)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CellEncoder", "BertBackbone", "GENEFORMER_VOCAB", "CLS_TOKEN_ID"]

#: Geneformer's dictionary (25,424 genes + <pad>=0 + <mask>=1) plus SToFM's <cls> (= 25,426)
GENEFORMER_VOCAB = 25_427
CLS_TOKEN_ID = 25_426

_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class _Embeddings(nn.Module):
    def __init__(self, vocab_size, hidden, max_positions, type_vocab_size, eps, dropout, pad_token_id):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden, padding_idx=pad_token_id)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids):
        n = input_ids.shape[1]
        if n > self.position_embeddings.num_embeddings:
            raise ValueError(f"input of {n} tokens is longer than the encoder's "
                             f"{self.position_embeddings.num_embeddings} positions")
        positions = torch.arange(n, device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings.weight[0])
        return self.dropout(self.LayerNorm(x))


class _SelfAttention(nn.Module):
    def __init__(self, hidden, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden // n_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class _Output(nn.Module):
    def __init__(self, d_in, d_out, eps, with_norm=True):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        if with_norm:
            self.LayerNorm = nn.LayerNorm(d_out, eps=eps)


class _Attention(nn.Module):
    def __init__(self, hidden, n_heads, eps):
        super().__init__()
        self.self = _SelfAttention(hidden, n_heads)
        self.output = _Output(hidden, hidden, eps)


class _Layer(nn.Module):
    def __init__(self, hidden, n_heads, ffn, eps, act, dropout, attention_dropout):
        super().__init__()
        self.attention = _Attention(hidden, n_heads, eps)
        self.intermediate = _Output(hidden, ffn, eps, with_norm=False)
        self.output = _Output(ffn, hidden, eps)
        self.act = _ACTIVATIONS[act]
        self.dropout = nn.Dropout(dropout)
        self.attention_dropout = attention_dropout

    def forward(self, x, key_mask):
        sa = self.attention.self
        b, n, d = x.shape

        def heads(t):
            return t.view(b, n, sa.n_heads, sa.head_dim).transpose(1, 2)

        q, k, v = heads(sa.query(x)), heads(sa.key(x)), heads(sa.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask,
                                             dropout_p=self.attention_dropout if self.training else 0.0)
        ctx = ctx.transpose(1, 2).reshape(b, n, d)
        out = self.attention.output
        x = out.LayerNorm(x + self.dropout(out.dense(ctx)))
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + self.dropout(y))


class _LayerList(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layer = nn.ModuleList(layers)


class BertBackbone(nn.Module):
    """A BERT encoder in Hugging Face ``BertModel``'s key layout (no pooler)."""

    def __init__(self, vocab_size, hidden, n_layers, n_heads, ffn, max_positions, type_vocab_size, eps, act,
                 dropout, attention_dropout, pad_token_id):
        super().__init__()
        if hidden % n_heads:
            raise ValueError(f"hidden_size={hidden} must be divisible by num_attention_heads={n_heads}")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r}: expected one of {sorted(_ACTIVATIONS)}")
        self.embeddings = _Embeddings(vocab_size, hidden, max_positions, type_vocab_size, eps, dropout, pad_token_id)
        self.encoder = _LayerList([_Layer(hidden, n_heads, ffn, eps, act, dropout, attention_dropout)
                                   for _ in range(n_layers)])

    def forward(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        key_mask = None
        if attention_mask is not None:
            # additive -inf-like mask as in HF (finfo.min, not -inf: a fully padded row stays finite)
            keep = attention_mask.bool()[:, None, None, :]
            key_mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~keep, torch.finfo(x.dtype).min)
        for layer in self.encoder.layer:
            x = layer(x, key_mask)
        return x


class CellEncoder(nn.Module):
    """Geneformer-style BERT + SToFM's pooler (``[CLS]`` -> ``Linear(hidden, proj_dim)`` -> L2).

    Args (Hugging Face ``BertConfig`` names): ``vocab_size`` (25,427: Geneformer's 25,426 +
    ``<cls>``), ``hidden_size`` (256), ``num_hidden_layers`` (6), ``num_attention_heads`` (4),
    ``intermediate_size`` (512), ``max_position_embeddings`` (2,048), ``type_vocab_size`` (2),
    ``layer_norm_eps`` (1e-12), ``hidden_act`` ("relu"), ``hidden_dropout_prob`` (0.02),
    ``attention_probs_dropout_prob`` (0.02), ``pad_token_id`` (0); ``proj_dim`` (256).
    """

    def __init__(self, vocab_size: int = GENEFORMER_VOCAB, hidden_size: int = 256, num_hidden_layers: int = 6,
                 num_attention_heads: int = 4, intermediate_size: int = 512, max_position_embeddings: int = 2048,
                 type_vocab_size: int = 2, layer_norm_eps: float = 1e-12, hidden_act: str = "relu",
                 hidden_dropout_prob: float = 0.02, attention_probs_dropout_prob: float = 0.02,
                 pad_token_id: int = 0, proj_dim: int = 256, n_outputs: int | None = None):
        super().__init__()
        self.config = {
            "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_attention_heads, "intermediate_size": intermediate_size,
            "max_position_embeddings": max_position_embeddings, "type_vocab_size": type_vocab_size,
            "layer_norm_eps": layer_norm_eps, "hidden_act": hidden_act, "pad_token_id": pad_token_id,
        }
        self.num_features = proj_dim
        self.max_length = max_position_embeddings
        self.bert = BertBackbone(vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
                                 max_position_embeddings, type_vocab_size, layer_norm_eps, hidden_act,
                                 hidden_dropout_prob, attention_probs_dropout_prob, pad_token_id)
        self.proj = nn.Linear(hidden_size, proj_dim)
        self.apply(_init_bert)
        self.head = None
        self.n_outputs = None
        if n_outputs is not None:
            self.reset_classifier(n_outputs)

    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, n_tokens), got {tuple(input_ids.shape)}")
        return self.bert(input_ids.long(), attention_mask)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """SToFM's pooler: ``[CLS]`` hidden state -> ``proj`` -> L2 normalisation."""
        return F.normalize(self.proj(hidden[:, 0]), dim=-1)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Hidden states -> the unit-norm cell embedding (``pre_logits`` or no head), or the logits
        of a cell-level classifier ``head`` on it."""
        pooled = self.pool(features)
        return pooled if pre_logits or self.head is None else self.head(pooled)

    def reset_classifier(self, n_outputs: int) -> None:
        self.head = nn.Linear(self.num_features, n_outputs)
        _init_bert(self.head)
        self.n_outputs = n_outputs

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Unit-norm cell embeddings ``(B, proj_dim)`` (logits ``(B, n_outputs)`` with a head)."""
        return self.forward_head(self.forward_features(input_ids, attention_mask))


def _init_bert(module: nn.Module) -> None:
    # HF BertPreTrainedModel._init_weights (initializer_range 0.02)
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)

