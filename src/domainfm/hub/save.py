"""Our own format: save_pretrained (config.json + model.safetensors + model card)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from domainfm.atomic import atomic_path, atomic_write_text
from domainfm.hub.base import CONFIG_NAME, OWN_METADATA_KEY, WEIGHTS_NAME
from domainfm.hub.cache import sha256_file
from domainfm.hub.cards import write_model_card

# --------------------------------------------------------------------------- own format


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    raise TypeError(f"model keyword value {value!r} ({type(value).__name__}) cannot be written to JSON")


def _without_adapters(model: nn.Module) -> nn.Module:
    """``model`` itself, or, when it holds LoRA adapters (merged or not), a copy with each adapter
    folded into its base weight and the wrappers removed: the variant's own key layout, which
    ``create_model(folder)`` loads. The caller's model keeps its adapters."""
    import copy

    from domainfm.lora.inject import merge, unmerge, wrappers

    found = wrappers(model)
    if not found:
        return model
    plain = copy.deepcopy(model)
    if any(w.merged for w in wrappers(plain).values()):
        unmerge(plain)  # back to base + adapter, then one merge of every adapter (in fp32)
    return merge(plain, unload=True)


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, report: Mapping[str, Any] | None = None,
                    arm: str | None = None, card: bool = True) -> Path:
    """Write ``model.safetensors`` + ``config.json`` so that ``create_model(directory)`` rebuilds it,
    and a ``README.md`` model card in the Hub's format (see :func:`write_model_card`; ``report``
    and ``arm`` are passed on to it, ``card=False`` skips it). The folder can be uploaded as is
    (``hf upload user/repo DIR``) and loaded back with ``create_model("hf://user/repo")``.

    The model must come from :func:`create_model` (it remembers its variant and keywords). A model
    with LoRA adapters is saved with them merged into its weights (the adapters themselves:
    :func:`domainfm.lora.save_adapter`); ``model`` is not changed. Both files are written through
    :mod:`domainfm.atomic`, so a crash leaves no half-written file.
    """
    from safetensors.torch import save_model

    name = getattr(model, "domainfm_name", None)
    if name is None:
        raise ValueError("save_pretrained needs a model made by domainfm.create_model (it records the variant name)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = dict(getattr(model, "domainfm_kwargs", {}))
    n_outputs = getattr(model, "n_outputs", None)
    if "n_outputs" in kwargs and isinstance(n_outputs, int):
        # reset_classifier() after create_model() changed the head: record its size as it is now
        kwargs["n_outputs"] = n_outputs
    config = {
        "domainfm": {
            "model_name": name,
            "model_kwargs": _jsonable(kwargs),
            "format_version": 1,
        }
    }
    # weights first, then the config that records their digest: a crash in between leaves a
    # folder whose digest check fails loudly, never one that loads the wrong weights silently
    with atomic_path(directory / WEIGHTS_NAME) as tmp_weights:
        save_model(_without_adapters(model), str(tmp_weights), metadata={"format": "pt", OWN_METADATA_KEY: name})
        config["domainfm"]["sha256"] = sha256_file(tmp_weights)
    atomic_write_text(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    if card:
        write_model_card(directory, model, report=report, arm=arm)
    return directory
