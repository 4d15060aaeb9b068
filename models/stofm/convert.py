"""Official SToFM checkpoints -> this implementation.

The released checkpoint (Google Drive only, linked from github.com/PharMolix/SToFM) is a folder::

    config.json            SToFMConfig of the transformer (embedding_dim, num_hidden_layers, ...)
    se2transformer.pth     state_dict of the official SToFMModel
    cell_encoder/cell_bert/    a Hugging Face BertModel folder (config.json + weights)
    cell_encoder/cell_proj.bin state_dict of Linear(hidden, 256) (keys weight, bias)

``se2transformer.pth`` already has our keys (``embedding_layer``, ``token_type_embeddings``,
``gaussian.{linear,means,stds,proj.0,proj.2}``, ``encoder.layers.{i}.self_attn.{q,k,v,out}_proj``,
``self_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``), so
``create_model("stofm-base", pretrained="se2transformer.pth")`` loads it as it is. A pretraining
checkpoint of the official ``SToFMForMaskedLM`` nests the same keys under ``model.`` beside
``lm_head.*``/``pair_head.*``: :func:`convert_official_state_dict` (the card's only converter, so
the hub applies it whenever the keys do not match) strips the prefix and keeps the heads when the
model has them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["convert_official_state_dict", "to_official_state_dict", "convert_official_cell_encoder",
           "official_config_to_kwargs", "cell_bert_config_to_kwargs", "load_official", "load_official_cell_encoder"]

_PRETRAIN_HEADS = ("lm_head.", "pair_head.")


def convert_official_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename an official ``SToFMModel`` / ``SToFMForMaskedLM`` state_dict to ``model``'s keys.

    ``module.`` (DataParallel) and ``model.`` (the MaskedLM wrapper) prefixes are stripped;
    ``lm_head``/``pair_head`` are kept only when ``model`` was built with ``pretrain_heads=True``;
    ``lm_output_learned_bias`` (unused by the official forward) is dropped. Unknown keys pass
    through so that the loader names them as unexpected.
    """
    has_heads = getattr(model, "lm_head", None) is not None
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "model."):
            if key.startswith(prefix):
                key = key[len(prefix):]
        if key.endswith("lm_output_learned_bias"):
            continue
        if key.startswith(_PRETRAIN_HEADS) and not has_heads:
            continue
        out[key] = value
    return out


def to_official_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our transformer's weights as an official ``se2transformer.pth`` (heads excluded)."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("head.", *_PRETRAIN_HEADS))}


def convert_official_cell_encoder(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A ``cell_bert`` state_dict (bare ``BertModel`` keys, or under ``bert.``) merged with
    ``cell_proj.bin`` under ``cell_proj.`` -> :class:`CellEncoder` keys (``bert.*``, ``proj.*``).

    HF's ``pooler.*`` (replaced by the projection in SToFM), an MLM head (``cls.*``) and the
    ``position_ids`` buffer are dropped.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("module."):
            key = key[len("module."):]
        if key.startswith("cell_proj."):
            out["proj." + key[len("cell_proj."):]] = value
            continue
        if key.startswith("proj."):
            out[key] = value
            continue
        if key.startswith("bert."):
            key = key[len("bert."):]
        if key.startswith(("pooler.", "cls.")) or key.endswith("position_ids"):
            continue
        out["bert." + key] = value
    return out


_CONFIG_MAP = {
    "input_dim": "input_dim",
    "embedding_dim": "embed_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "ffn_embedding_dim": "ffn_dim",
    "gaussian_hidden_dim": "n_kernels",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "activation_dropout": "activation_dropout",
}


def official_config_to_kwargs(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """An official ``SToFMConfig`` dict -> :class:`SToFM` keywords (unsupported settings refused)."""
    if config.get("pre_layernorm"):
        raise ValueError(f"{source}: pre_layernorm=true is not supported (the released model is post-LN)")
    if config.get("activation_fn", "gelu") != "gelu":
        raise ValueError(f"{source}: activation_fn={config['activation_fn']!r}; only 'gelu' is supported")
    if config.get("layerdrop", 0.0):
        raise ValueError(f"{source}: layerdrop={config['layerdrop']} is not supported")
    return {ours: config[theirs] for theirs, ours in _CONFIG_MAP.items() if theirs in config}


_BERT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "hidden_dropout_prob",
              "attention_probs_dropout_prob", "pad_token_id")


def cell_bert_config_to_kwargs(config: dict[str, Any], source: str = "cell_bert/config.json") -> dict[str, Any]:
    """A Hugging Face ``BertConfig`` dict -> :class:`CellEncoder` keywords."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source}: position_embedding_type={config['position_embedding_type']!r}; "
                         "only 'absolute' is supported")
    return {k: config[k] for k in _BERT_KEYS if k in config and config[k] is not None}


def _read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from domainfm.hub.checkpoints import _unwrap_state_dict, load_checkpoint

    for name in names:
        if (folder / name).is_file():
            return _unwrap_state_dict(load_checkpoint(folder / name), None)
    raise FileNotFoundError(f"{folder}: none of {', '.join(names)} found")


def load_official_cell_encoder(folder: str | Path, *, name: str = "stofm-cell-encoder", strict: bool = True,
                               **kwargs) -> nn.Module:
    """The official ``cell_encoder/`` folder (``cell_bert/`` + ``cell_proj.bin``) as a
    :class:`CellEncoder`, its shape read from ``cell_bert/config.json``."""
    from domainfm.hub import load_checkpoint, load_state_dict_into
    from domainfm.zoo import build_model

    folder = Path(folder)
    bert_dir = folder / "cell_bert"
    config_file = bert_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: expected the official layout cell_bert/config.json + cell_proj.bin")
    arch = cell_bert_config_to_kwargs(json.loads(config_file.read_text()), str(config_file))
    raw = _read_weights(bert_dir, ("model.safetensors", "pytorch_model.bin"))
    proj = load_checkpoint(folder / "cell_proj.bin")
    raw.update({f"cell_proj.{k}": v for k, v in proj.items()})
    model = build_model(name, **{**arch, **kwargs})
    state = convert_official_cell_encoder(raw, model)
    model.domainfm_load_report = load_state_dict_into(model, state, strict=strict, source=str(folder))
    return model


def load_official(folder: str | Path, *, name: str = "stofm-base", cell_encoder: bool = True,
                  **kwargs) -> tuple[nn.Module, nn.Module | None]:
    """The released checkpoint folder -> ``(SToFM, CellEncoder or None)``.

    ``config.json`` (the official ``SToFMConfig``), when present, sets the transformer's shape;
    ``se2transformer.pth`` is loaded strictly; ``cell_encoder/`` is read when ``cell_encoder``.
    """
    from domainfm.hub import create_model

    folder = Path(folder)
    weights = folder / "se2transformer.pth"
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: no se2transformer.pth (expected the released checkpoint folder)")
    arch = {}
    if (folder / "config.json").is_file():
        arch = official_config_to_kwargs(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
    model = create_model(name, pretrained=str(weights), **{**arch, **kwargs})
    encoder = load_official_cell_encoder(folder / "cell_encoder") if cell_encoder else None
    return model, encoder
