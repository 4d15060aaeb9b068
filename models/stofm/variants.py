"""Registered SToFM variants.

``stofm-base`` is the released transformer's shape; ``stofm-test`` a tiny one for the test suite.
``stofm-cell-encoder`` is the gene-scale cell encoder (Geneformer-6L-like default shape: the
released size is only in the checkpoint's ``cell_bert/config.json``, which
:func:`domainfm.models.stofm.convert.load_official_cell_encoder` reads), with its tiny
``stofm-cell-encoder-test``.

No weight source is registered: the official checkpoint is distributed only through a Google
Drive folder (linked from github.com/PharMolix/SToFM's README), which cannot be fetched and
verified like a Hub file. Download the folder by hand, then::

    model = domainfm.create_model("stofm-base", pretrained="ckpt/se2transformer.pth")
    model, cell_encoder = domainfm.models.stofm.load_official("ckpt")   # also reads config.json
"""
from __future__ import annotations

import torch

from domainfm.models.stofm.cell_encoder import CellEncoder
from domainfm.models.stofm.convert import convert_official_cell_encoder, convert_official_state_dict
from domainfm.models.stofm.stofm import TOKEN_CELL, TOKEN_CLS, TOKEN_HYPERNODE, TOKEN_PAD, SToFM
from domainfm.zoo import register_model

__all__ = ["PAPER", "WEIGHTS_NOTE", "stofm_base", "stofm_test", "stofm_cell_encoder", "stofm_cell_encoder_test"]

PAPER = "https://arxiv.org/abs/2507.11588"
WEIGHTS_NOTE = ("official weights: Google Drive folder linked from github.com/PharMolix/SToFM (README, "
                "'Download checkpoint'); not registered (no verifiable hub file). Load with "
                "pretrained='<folder>/se2transformer.pth' or domainfm.models.stofm.load_official('<folder>').")

_INPUT_SPEC = {
    "token_embeddings": "(batch, n_tokens, 256) float: [CLS] zeros, hypernode mean embeddings, cell-encoder "
                        "embeddings; masked cells -100",
    "distances": "(batch, n_tokens, n_tokens) float: kNN (k=50) Euclidean on coordinates centred on the "
                 "bounding box with diagonal 100; non-neighbours 100; full rows/columns for hypernodes; "
                 "0 on the [CLS] row/column, diagonal and padding",
    "token_types": f"(batch, n_tokens) int: cell {TOKEN_CELL}, [CLS] {TOKEN_CLS}, hypernode {TOKEN_HYPERNODE}, "
                   f"padding {TOKEN_PAD}",
    "sub_slice": "[CLS] + all hypernodes of the slice + <= ~1,000 cells (data_loaders.spatial.build_subslices)",
    "weights": WEIGHTS_NOTE,
}


def _example_input(n_tokens=(9, 6), input_dim=256):
    """Two sub-slices of different lengths, padded: [CLS], 2 hypernodes, cells."""
    g = torch.Generator().manual_seed(0)
    b, n = len(n_tokens), max(n_tokens)
    emb = torch.zeros(b, n, input_dim)
    types = torch.full((b, n), TOKEN_PAD, dtype=torch.long)
    dist = torch.zeros(b, n, n)
    for i, m in enumerate(n_tokens):
        xy = torch.rand(m, 2, generator=g) * 50
        d = torch.cdist(xy, xy)
        d[0, :] = 0
        d[:, 0] = 0
        dist[i, :m, :m] = d
        emb[i, 1:m] = torch.randn(m - 1, input_dim, generator=g)
        types[i, :m] = TOKEN_CELL
        types[i, 0] = TOKEN_CLS
        types[i, 1:3] = TOKEN_HYPERNODE
    return emb, dist, types


@register_model(
    "stofm-base",
    family="stofm",
    paper=PAPER,
    license="MIT",
    input_spec=_INPUT_SPEC,
    defaults={"input_dim": 256, "embed_dim": 256, "n_layers": 12, "n_heads": 32, "ffn_dim": 256, "n_kernels": 128,
              "n_outputs": None},
    converters={"official": convert_official_state_dict},
    head="head",
)
def stofm_base(**kwargs) -> SToFM:
    """SToFM SE(2) transformer as released: d=256, 12 post-LN layers, 32 heads, FFN 256, 128 Gaussian kernels."""
    return SToFM(**kwargs)


@register_model(
    "stofm-test",
    family="stofm",
    paper=PAPER,
    license="MIT",
    input_spec=_INPUT_SPEC,
    defaults={"input_dim": 256, "embed_dim": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 32, "n_kernels": 16,
              "n_outputs": 3},
    converters={"official": convert_official_state_dict},
    head="head",
    tags=("test",),
    example_input=_example_input,
)
def stofm_test(**kwargs) -> SToFM:
    """Tiny SToFM for tests: d=32, 2 layers, 4 heads, 16 kernels (same 256-d input)."""
    return SToFM(**kwargs)


_CELL_SPEC = {
    "input_ids": "(batch, n_tokens<=2048) int: <cls> (25426) + Geneformer gene tokens in descending order of "
                 "median-scaled expression; <pad>=0 (data_loaders.spatial.tokenize)",
    "attention_mask": "(batch, n_tokens) 1 for tokens, 0 for padding",
    "output": "(batch, 256) unit-norm cell embeddings",
    "weights": WEIGHTS_NOTE.replace("se2transformer.pth", "cell_encoder"),
}


def _cell_example_input():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 25426, (2, 12), generator=g)
    ids[:, 0] = 25426
    mask = torch.ones(2, 12, dtype=torch.long)
    ids[1, 8:] = 0
    mask[1, 8:] = 0
    return ids, mask


@register_model(
    "stofm-cell-encoder",
    family="stofm",
    paper=PAPER,
    license="MIT",
    input_spec=_CELL_SPEC,
    defaults={"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 512},
    converters={"official": convert_official_cell_encoder},
    head="head",
)
def stofm_cell_encoder(**kwargs) -> CellEncoder:
    """SToFM cell encoder: Geneformer-style BERT (assumed 6L/256/4 heads; the checkpoint's config wins) + Linear->L2 pooler."""
    return CellEncoder(**kwargs)


@register_model(
    "stofm-cell-encoder-test",
    family="stofm",
    paper=PAPER,
    license="MIT",
    input_spec=_CELL_SPEC,
    defaults={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 2048},
    converters={"official": convert_official_cell_encoder},
    head="head",
    tags=("test",),
    example_input=_cell_example_input,
)
def stofm_cell_encoder_test(**kwargs) -> CellEncoder:
    """Tiny SToFM cell encoder for tests: 2 layers, hidden 32 (full Geneformer vocabulary)."""
    return CellEncoder(**kwargs)
