"""Official FIM imputation checkpoints -> our keys.

The Hub folders (``FIM4Science/fim-imp-pointwise-base``, ``FIM4Science/fim-imp-temporal``) are
``transformers`` ``save_pretrained`` folders: ``model.safetensors`` + ``config.json``. Their
keys follow the official modules (``src/fim/models/blocks/base.py``): ``Mlp`` layers are
``layers.linear_{j}`` / ``layers.output``, the branch ``Transformer`` has ``input_projection``,
``encoder_blocks.{i}.{self_attn, layer_norm1, residual_mlp, layer_norm2}``,
``final_query_vector`` and ``final_attention`` (``nn.MultiheadAttention``: ``in_proj_weight``,
``in_proj_bias``, ``out_proj.*``). The temporal model nests the local model under ``fim_base.``
(and the whole model under ``fim_imputation.`` in the windowed wrapper ``FIMImpTemp``).

When the folder has a ``config.json`` its architecture is checked against the model it is loaded
into (a clear error instead of a shape mismatch deep in the state_dict); a folder with only
``model.safetensors`` loads into the variant as configured (the base config for
``fim-imputation-base``).
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

__all__ = ["convert_official_local", "convert_official_temporal", "config_from_official", "rename_official_key"]

_MODULES = {
    "time_encoding.linear_embedding.": "time_encoding.linear.",
    "time_encoding.periodic_embedding.0.": "time_encoding.periodic.",
    "trunk_net.": "trunk.",
    "branch_net.": "branch.",
    "combiner_net.": "combiner.",
    "vector_field_net.": "drift_head.",
    "init_cond_net.": "init_head.",
}


def _rename_mlp(key: str) -> str:
    key = re.sub(r"layers\.linear_(\d+)\.", r"hidden.\1.", key)
    return key.replace("layers.output.", "out.")


def _rename_transformer(key: str) -> str:
    key = key.replace("input_projection.", "input_proj.")
    key = re.sub(r"encoder_blocks\.(\d+)\.self_attn\.", r"blocks.\1.attn.", key)
    key = re.sub(r"encoder_blocks\.(\d+)\.layer_norm1\.", r"blocks.\1.norm1.", key)
    key = re.sub(r"encoder_blocks\.(\d+)\.layer_norm2\.", r"blocks.\1.norm2.", key)
    key = re.sub(r"encoder_blocks\.(\d+)\.residual_mlp\.", r"blocks.\1.mlp.", key)
    key = key.replace("final_query_vector", "pool_query").replace("final_attention.", "pool.")
    key = key.replace("in_proj_weight", "in_proj.weight").replace("in_proj_bias", "in_proj.bias")
    return _rename_mlp(key)


def rename_official_key(key: str) -> str:
    """One official ``FIMImpPointBase`` key -> ours (unknown keys are returned unchanged)."""
    for old, new in _MODULES.items():
        if key.startswith(old):
            key = new + key[len(old):]
            break
    if key.startswith("branch."):
        return _rename_transformer(key)
    return _rename_mlp(key)


def config_from_official(config: dict[str, Any]) -> dict[str, int]:
    """Our ``FIMImputer`` keywords from an official ``FIMImpPointBaseConfig`` dict (``config.json``)."""
    try:
        te, br, tr = config["time_encoding"], config["branch_net"], config["trunk_net"]
        out = {
            "dim_time": int(te.get("out_features", te.get("dim_time"))),
            "dim_latent": int(br["dim_model"]),
            "n_heads": int(br["num_heads"]),
            "n_blocks": int(br["num_encoder_blocks"]) - 1,
            "mlp_hidden": int(br["residual_mlp"]["hidden_layers"][0]),
            "trunk_layers": len(tr["hidden_layers"]),
            "combiner_layers": len(config["combiner_net"]["hidden_layers"]),
            "init_layers": len(config["init_cond_net"]["hidden_layers"]),
        }
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"config.json: not an official FIMImpPointBase config (missing or malformed {exc})") from exc
    return out


def _check_config(model: nn.Module, config: dict[str, Any], where: str) -> None:
    if not config or "branch_net" not in config:
        return
    want = config_from_official(config)
    have = {k: getattr(model, "_fim_config", {}).get(k) for k in want}
    diff = {k: (have[k], v) for k, v in want.items() if have[k] is not None and have[k] != v}
    if diff:
        text = ", ".join(f"{k}: model {a} vs {where} {b}" for k, (a, b) in diff.items())
        raise ValueError(f"{where}: the checkpoint's architecture differs from the model ({text}); "
                         f"create the model with these keywords")


def convert_official_local(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Official ``FIMImpPointBase`` state_dict -> :class:`FIMImputer` keys."""
    _check_config(model, getattr(model, "domainfm_upstream_config", {}), "config.json")
    return {rename_official_key(k): v for k, v in state_dict.items()}


def convert_official_temporal(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Official ``FIMImpTempBase`` (or ``FIMImpTemp``, prefix ``fim_imputation.``) -> :class:`FIMTemporalImputer`."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith("fim_imputation."):
            key = key[len("fim_imputation."):]
        if key.startswith("fim_base."):
            out["local." + rename_official_key(key[len("fim_base."):])] = value
        elif key.startswith("psi_2."):
            out["window_transformer." + _rename_transformer(key[len("psi_2."):])] = value
        elif key.startswith("scale_feature_mapping."):
            out["scale_features." + key[len("scale_feature_mapping."):]] = value
        else:
            out[key] = value
    return out
