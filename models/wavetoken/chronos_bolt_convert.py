"""Hugging Face Chronos-Bolt repositories -> :class:`.chronos_bolt.ChronosBolt`.

An ``amazon/chronos-bolt-*`` repository holds a T5 ``config.json`` (architecture
``ChronosBoltModelForForecasting``) whose ``chronos_config`` block sets ``context_length``,
``prediction_length``, ``input_patch_size``, ``input_patch_stride``, ``quantiles`` and
``use_reg_token``, beside ``model.safetensors`` in Hugging Face's key names: the T5 stacks as in
any T5 checkpoint, ``input_patch_embedding.*`` and ``output_patch_embedding.*`` (each
``{hidden,output,residual}_layer.{weight,bias}``). :func:`convert_chronos_bolt` renames the keys
(the T5 part through :func:`.convert.convert_hf_t5`); :func:`apply_chronos_bolt_config` checks
the config against the model and adopts its ``chronos_config`` (the hub calls it through
``model.domainfm_upstream_config``); :func:`load_chronos_bolt` loads a local folder or a whole
``hf://org/repo`` choosing the variant from the config's sizes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .convert import check_t5_architecture, convert_hf_t5

__all__ = ["convert_chronos_bolt", "apply_chronos_bolt_config", "load_chronos_bolt", "fetch_registered_repo", "bolt_key",
           "upstream_chronos_config"]

_BLOCKS = {"input_patch_embedding": "patch_embed", "output_patch_embedding": "quantile_head"}
_LAYERS = {"hidden_layer": "hidden", "output_layer": "output", "residual_layer": "residual"}


def bolt_key(key: str) -> str | None:
    """Our key for an upstream residual-block key (``None``: not one of them)."""
    block, _, rest = key.partition(".")
    layer, _, leaf = rest.partition(".")
    if block in _BLOCKS and layer in _LAYERS and leaf in ("weight", "bias"):
        return f"{_BLOCKS[block]}.{_LAYERS[layer]}.{leaf}"
    return None


def convert_chronos_bolt(state_dict: Mapping[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face ``ChronosBoltModelForForecasting`` state_dict to our keys.

    ``lm_head.weight`` (which the upstream model ignores when loading) is dropped; the stacks'
    copies of the embeddings must equal ``shared``. Idempotent: our own keys pass through, so
    converting a converted state_dict changes nothing.
    """
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key == "lm_head.weight":
            continue
        renamed[bolt_key(key) or key] = value
    # convert_hf_t5 keeps the keys that are already ours (the blocks renamed above among them),
    # maps the T5 stacks and refuses anything else; Bolt never has an lm_head of its own
    return convert_hf_t5(renamed, model)


def upstream_chronos_config(config: Mapping[str, Any], architecture: str, what: str,
                            fields: Sequence[str]) -> Mapping[str, Any]:
    """The ``chronos_config`` block of an upstream Chronos ``config.json`` (a mapping), checked:
    the listed ``architectures`` include ``architecture``, and the block holds every one of
    ``fields``; each failure is a ``ValueError`` naming the field and ``what`` was expected."""
    if not isinstance(config, Mapping):
        raise ValueError(f"upstream config: expected a mapping, got {type(config).__name__}")
    architectures = config.get("architectures") or []
    if architectures and architecture not in architectures:
        raise ValueError(f"config.json architectures={architectures}: not a {what} checkpoint (expected {architecture})")
    chronos = config.get("chronos_config")
    if not isinstance(chronos, Mapping):
        raise ValueError(f"config.json has no chronos_config block: not a {what} checkpoint")
    for field in fields:
        if field not in chronos:
            raise ValueError(f"config.json chronos_config has no {field!r}: not a {what} config")
    return chronos


def apply_chronos_bolt_config(model, config: Mapping[str, Any]) -> None:
    """Check an upstream ``config.json`` against ``model`` and adopt its ``chronos_config``.

    Raises ``ValueError`` naming every architecture field that disagrees (build the matching
    variant instead) and for configs that are not Chronos-Bolt's. A different horizon, quantile
    list, patch size or ``[REG]`` setting rebuilds the affected modules before the weights load.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"upstream config: expected a mapping, got {type(config).__name__}")
    if "domainfm" in config:
        return  # our own save format: nothing to adopt
    chronos = upstream_chronos_config(config, "ChronosBoltModelForForecasting", "Chronos-Bolt",
                                      ("context_length", "prediction_length", "input_patch_size",
                                       "input_patch_stride", "quantiles"))
    check_t5_architecture(model, config, variants="chronos-bolt-*", vocab=False)
    if config.get("is_gated_act", False) or str(config.get("feed_forward_proj", "relu")).startswith("gated-"):
        raise ValueError(f"config.json feed_forward_proj={config.get('feed_forward_proj')!r}: gated feed-forward "
                         "is not supported (Chronos-Bolt's T5 uses ReLU)")
    act = config.get("dense_act_fn", "relu")
    if act != model.dense_act_fn:
        raise ValueError(f"config.json dense_act_fn={act!r} but the model uses {model.dense_act_fn!r}; "
                         f"build it with dense_act_fn={act!r}")
    model.reconfigure(context_length=int(chronos["context_length"]), prediction_length=int(chronos["prediction_length"]),
                      quantiles=[float(q) for q in chronos["quantiles"]], input_patch_size=int(chronos["input_patch_size"]),
                      input_patch_stride=int(chronos["input_patch_stride"]),
                      use_reg_token=bool(chronos.get("use_reg_token", False)))
    # vocab_size is not checked: upstream derives it from use_reg_token and ignores the config's value
    model.decoder_start_token_id = int(config.get("decoder_start_token_id", model.decoder_start_token_id))
    if not 0 <= model.decoder_start_token_id < model.shared.num_embeddings:
        raise ValueError(f"config.json decoder_start_token_id={model.decoder_start_token_id}: the model has "
                         f"{model.shared.num_embeddings} embeddings")


def _variant_for(config: Mapping[str, Any]) -> str:
    from domainfm import list_models, zoo

    for name in list_models("chronos-bolt-*"):
        defaults = zoo.get_card(name).defaults
        if all(defaults.get(k) == config.get(k) for k in ("d_model", "num_layers", "num_heads", "d_ff")):
            return name
    raise ValueError(
        f"config.json (d_model={config.get('d_model')}, num_layers={config.get('num_layers')}) matches no registered "
        "chronos-bolt-* variant; call domainfm.create_model('chronos-bolt-tiny', pretrained=DIR, d_model=…, …) with its sizes"
    )


def fetch_registered_repo(source: str, *, pattern: str, card=None, sha256: Mapping[str, str] | None = None) -> Path:
    """``hf://org/repo`` fetched whole into the cache, at the revision pinned by the weight source
    with that URL among the registered ``pattern`` variants (``main`` when none is)."""
    from domainfm import hub, zoo

    repo = source[len("hf://"):].strip("/")
    if repo.count("/") != 1:
        raise ValueError(f"{source!r}: expected hf://org/repo (a whole repository)")
    registered = next((w for n in zoo.list_models(pattern) for w in zoo.get_card(n).weights
                       if w.url == f"hf://{repo}"), None)
    return Path(hub.loading.fetch_hf_repo(f"hf://{repo}", card=card, sha256=sha256,
                                          revision=getattr(registered, "revision", None)))


def load_chronos_bolt(source: str | os.PathLike, *, name: str | None = None,
                      sha256: Mapping[str, str] | None = None, **kwargs):
    """A Chronos-Bolt model from a folder laid out as its Hugging Face repository, or from
    ``"hf://org/repo"`` (``config.json`` and ``model.safetensors`` fetched into the cache; digests
    from ``sha256={"config.json": …, "model.safetensors": …}`` or the card's weight sources).

    ``name`` picks the variant (default: the ``chronos-bolt-*`` whose sizes match ``config.json``).
    """
    from domainfm import hub, zoo

    if str(source).startswith("hf://"):
        directory = fetch_registered_repo(str(source), pattern="chronos-bolt-*",
                                          card=zoo.get_card(name) if name else None, sha256=sha256)
    else:
        directory = Path(source)
        if not directory.is_dir():
            raise FileNotFoundError(f"{source}: not a directory (expected config.json + model.safetensors)")
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (a Chronos-Bolt repository has one with a chronos_config block)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from exc
    name = name or _variant_for(config)
    return hub.create_model(name, pretrained=str(directory), **kwargs)
