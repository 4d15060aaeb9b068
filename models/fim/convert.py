"""Official FIM imputation checkpoints -> our keys, with their ``config.json`` checked.

The three official Hub repositories are ``transformers`` ``save_pretrained`` folders,
``config.json`` + ``model.safetensors`` (OpenFIM renamed them in commit 2805a1f, "Adapt Huggingface
Model Renaming"; the old names are in brackets):

* ``FIM4Science/fim-imp-pointwise-base`` (``fim-imputation-base``): ``FIMImpPointBase`` (formerly
  ``FIMODE``), the local model. Its published ``config.json`` names ``"architectures": ["FIMODE"]``,
  ``"model_type": "fimode"`` (the class is now ``FIMImpPointBaseConfig``, ``model_type
  "FIMImpPointBase"``) and the sub-networks ``time_encoding``, ``branch_net``, ``trunk_net``,
  ``combiner_net``, ``init_cond_net``, ``vector_field_net``. Keys follow the official modules
  (``src/fim/models/blocks/base.py``): ``Mlp`` layers are ``layers.linear_{j}`` / ``layers.output``,
  the branch ``Transformer`` has ``input_projection``, ``encoder_blocks.{i}.{self_attn, layer_norm1,
  residual_mlp, layer_norm2}``, ``final_query_vector`` and ``final_attention``
  (``nn.MultiheadAttention``: ``in_proj_weight``, ``in_proj_bias``, ``out_proj.*``).
* ``FIM4Science/fim-imp-temporal-base`` (``fim-imputation``): ``FIMImpTempBase`` (formerly
  ``FIMImputation``, ``model_type "fim_imputation"``): the local model under ``fim_base.``, the window
  transformer ``psi_2.`` (same block structure as the branch net, input ``2 x dim_latent``) and the
  scale-feature map ``scale_feature_mapping.`` (``nn.Linear(9, dim_latent)``); its ``config.json``
  describes ``psi_2``, ``scale_feature_mapping`` and the global normalisations, while ``fim_base``
  only names the local model's source (its architecture is read from the weights' shapes).
* ``FIM4Science/fim-imp-temporal`` (``fim-windowed-imputation``): ``FIMImpTemp`` (formerly
  ``FIMImputationWindowed``, ``model_type "fim_imputation_windowed"``), the temporal model wrapped
  with an optional denoiser: every key is the temporal model's under ``fim_imputation.``. Its
  published ``config.json`` holds no architecture at all, only ``"architectures":
  ["FIMImputationWindowed"]``, ``"fim_imputation": "FIM4Science/fim-imputation"`` (the temporal
  model it was built from) and ``"denoising_model": null``.

When a folder has a ``config.json`` it is checked against the model it is loaded into: a
checkpoint of another official class, or an architecture field that differs from the model (a
head count, for one, changes no tensor shape), is a ``ValueError`` naming ``config.json`` and the
field, instead of a wrong model or a shape mismatch deep in the state_dict. A folder with only
``model.safetensors`` loads into the variant as configured.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

__all__ = ["convert_official_local", "convert_official_temporal", "config_from_official",
           "temporal_config_from_official", "official_model_kind", "rename_official_key"]

_MODULES = {
    "time_encoding.linear_embedding.": "time_encoding.linear.",
    "time_encoding.periodic_embedding.0.": "time_encoding.periodic.",
    "trunk_net.": "trunk.",
    "branch_net.": "branch.",
    "combiner_net.": "combiner.",
    "vector_field_net.": "drift_head.",
    "init_cond_net.": "init_head.",
}

#: each official class under the names its ``config.json`` may carry (``model_type`` and
#: ``architectures``, before and after OpenFIM's renaming) -> (kind, the official class)
_CLASSES = {
    "fimode": ("local", "FIMImpPointBase"), "FIMODE": ("local", "FIMImpPointBase"),
    "FIMImpPointBase": ("local", "FIMImpPointBase"),
    "fim_imputation": ("temporal", "FIMImpTempBase"), "FIMImputation": ("temporal", "FIMImpTempBase"),
    "FIMImpTempBase": ("temporal", "FIMImpTempBase"),
    "fim_imputation_windowed": ("windowed", "FIMImpTemp"), "FIMImputationWindowed": ("windowed", "FIMImpTemp"),
    "FIMImpTemp": ("windowed", "FIMImpTemp"),
}
#: the variant each kind loads into
_VARIANT = {"local": "fim-imputation-base", "temporal": "fim-imputation-temporal",
            "windowed": "fim-imputation-temporal"}


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


def official_model_kind(config: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(kind, official class, the field that says so)`` of an official ``config.json``:
    kind ``"local"`` (``FIMImpPointBase``), ``"temporal"`` (``FIMImpTempBase``) or
    ``"windowed"`` (``FIMImpTemp``); None for an empty config. ``model_type`` decides, then
    ``architectures``, then the fields only one class has (the windowed release's published
    ``config.json`` has no ``model_type``). Anything else is a ``ValueError`` naming the field."""
    if not config:
        return None
    model_type = config.get("model_type")
    if model_type is not None:
        if model_type not in _CLASSES:
            raise ValueError(f"config.json: model_type {model_type!r} is not an official FIM imputation model "
                             f"(expected one of {sorted(k for k in _CLASSES if k.islower())} or 'FIMImpPointBase')")
        return (*_CLASSES[model_type], f"model_type {model_type!r}")
    for name in config.get("architectures") or ():
        if name in _CLASSES:
            return (*_CLASSES[name], f"architectures {config['architectures']!r}")
    if "fim_imputation" in config or "denoising_model" in config:
        return "windowed", "FIMImpTemp", "fim_imputation / denoising_model"
    if config.get("psi_2"):
        return "temporal", "FIMImpTempBase", "psi_2"
    if "branch_net" in config:
        return "local", "FIMImpPointBase", "branch_net"
    raise ValueError("config.json: not an official FIM imputation config (no model_type, no known architectures, "
                     "and none of branch_net, psi_2, fim_imputation); expected FIMImpPointBase, FIMImpTempBase or "
                     "FIMImpTemp")


def config_from_official(config: dict[str, Any]) -> dict[str, int]:
    """Our ``FIMImputer`` keywords from an official ``FIMImpPointBaseConfig`` dict (``config.json``)."""
    return {key: value for key, (value, _) in _local_fields(config).items()}


def _local_fields(config: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Our keyword -> (value, the official field it comes from)."""
    try:
        te, br, tr = config.get("time_encoding") or {}, config["branch_net"], config["trunk_net"]
        # SineTimeEncoding takes out_features, the yaml's TimeEncoding dim_time; the branch net repeats it
        te_field = next((f"time_encoding.{k}" for k in ("out_features", "dim_time") if k in te), "branch_net.dim_time")
        dim_time = te[te_field.split(".")[1]] if te_field.startswith("time_encoding") else br["dim_time"]
        out = {
            "dim_time": (int(dim_time), te_field),
            "dim_latent": (int(br["dim_model"]), "branch_net.dim_model"),
            "n_heads": (int(br["num_heads"]), "branch_net.num_heads"),
            # upstream counts the pooling attention as an encoder block
            "n_blocks": (int(br["num_encoder_blocks"]) - 1, "branch_net.num_encoder_blocks - 1"),
            "mlp_hidden": (int(br["residual_mlp"]["hidden_layers"][0]), "branch_net.residual_mlp.hidden_layers[0]"),
            "trunk_layers": (len(tr["hidden_layers"]), "len(trunk_net.hidden_layers)"),
            "combiner_layers": (len(config["combiner_net"]["hidden_layers"]), "len(combiner_net.hidden_layers)"),
            "init_layers": (len(config["init_cond_net"]["hidden_layers"]), "len(init_cond_net.hidden_layers)"),
        }
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"config.json: not an official FIMImpPointBase config (missing or malformed {exc})") from exc
    return out


def temporal_config_from_official(config: dict[str, Any]) -> dict[str, int]:
    """Our window-transformer keywords (``n_blocks``, ``n_heads``, ``mlp_hidden``) and the latent
    width ``dim_latent`` from an official ``FIMImpTempBaseConfig`` dict (``config.json``)."""
    return {key: value for key, (value, _) in _temporal_fields(config).items()}


def _temporal_fields(config: dict[str, Any]) -> dict[str, tuple[int, str]]:
    try:
        psi = config["psi_2"]
        out = {
            "dim_latent": (int(psi["dim_model"]), "psi_2.dim_model"),
            "n_heads": (int(psi["num_heads"]), "psi_2.num_heads"),
            "n_blocks": (int(psi["num_encoder_blocks"]) - 1, "psi_2.num_encoder_blocks - 1"),
            "mlp_hidden": (int(psi["residual_mlp"]["hidden_layers"][0]), "psi_2.residual_mlp.hidden_layers[0]"),
        }
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"config.json: not an official FIMImpTempBase config (missing or malformed {exc})") from exc
    return out


def _compare(fields: dict[str, tuple[int, str]], have: dict[str, int | None]) -> None:
    diff = [f"{k}: model {have[k]} vs config.json {v} ({field})" for k, (v, field) in fields.items()
            if have.get(k) is not None and have[k] != v]
    if diff:
        raise ValueError(f"config.json: the checkpoint's architecture differs from the model ({'; '.join(diff)}); "
                         "create the model with these keywords")


def _require_minmax(config: dict[str, Any], field: str, *, ours: str) -> None:
    """Our models hard-code MinMax scaling where upstream makes it configurable."""
    if field not in config:
        return
    value = config[field]
    name = value.get("name") if isinstance(value, dict) else value
    if not (isinstance(name, str) and name.endswith("MinMaxNormalization")):
        raise ValueError(f"config.json: {field} = {value!r}, but {ours} always applies MinMax scaling "
                         "(fim.models.blocks.normalization.MinMaxNormalization)")


def _official_config(model: nn.Module, expect: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The upstream ``config.json`` the hub handed to ``model`` and its kind, which must be in ``expect``."""
    config = getattr(model, "domainfm_upstream_config", None) or {}
    found = official_model_kind(config)
    if found is None:
        return None
    kind, official, field = found
    if kind not in expect:
        name = getattr(model, "domainfm_name", type(model).__name__)
        raise ValueError(f"config.json: {field} is the official {official} ({kind} model), which {name} does not "
                         f"hold; load it with create_model({_VARIANT[kind]!r}, pretrained=...)")
    return kind, config


def convert_official_local(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Official ``FIMImpPointBase`` state_dict -> :class:`FIMImputer` keys (``config.json`` checked)."""
    found = _official_config(model, ("local",))
    if found is not None:
        _, config = found
        if "branch_net" in config:
            _compare(_local_fields(config), getattr(model, "_fim_config", {}))
        for field in ("normalization_time", "normalization_values"):
            _require_minmax(config, field, ours="FIMImputer")
    return {rename_official_key(k): v for k, v in state_dict.items()}


def _window_transformer_config(model: nn.Module) -> dict[str, int | None]:
    wt = getattr(model, "window_transformer", None)
    if wt is None:
        return {}
    return {"dim_latent": wt.input_proj.out_features, "n_heads": wt.pool.n_heads, "n_blocks": len(wt.blocks),
            "mlp_hidden": wt.blocks[0].mlp.hidden[0].out_features if len(wt.blocks) else None}


def convert_official_temporal(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Official ``FIMImpTempBase`` (or the windowed ``FIMImpTemp``, every key under
    ``fim_imputation.``) -> :class:`FIMTemporalImputer` keys (``config.json`` checked)."""
    found = _official_config(model, ("temporal", "windowed"))
    if found is not None:
        kind, config = found
        if kind == "windowed":
            # FIMImpTemp = FIMImpTempBase + an optional denoiser applied to the observations first
            if config.get("denoising_model") is not None:
                raise ValueError(f"config.json: denoising_model = {config['denoising_model']!r}: this checkpoint "
                                 "denoises the observations with a model FIMTemporalImputer does not implement "
                                 "(the published FIM4Science/fim-imp-temporal has denoising_model null)")
        else:
            if config.get("psi_2"):
                _compare(_temporal_fields(config), _window_transformer_config(model))
            if config.get("use_fim_normalization", True) is not True:
                raise ValueError(f"config.json: use_fim_normalization = {config['use_fim_normalization']!r}, but "
                                 "FIMTemporalImputer always MinMax-normalises each window for the local model")
            for field in ("global_normalization_values", "global_normalization_times"):
                _require_minmax(config, field, ours="FIMTemporalImputer")
            mapping = config.get("scale_feature_mapping") or {}
            local_dim = getattr(getattr(model, "local", None), "dim_latent", None)
            if "out_features" in mapping and local_dim is not None and int(mapping["out_features"]) != local_dim:
                raise ValueError(f"config.json: the checkpoint's architecture differs from the model (dim_latent: "
                                 f"model {local_dim} vs config.json {mapping['out_features']} "
                                 "(scale_feature_mapping.out_features)); create the model with these keywords")
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
