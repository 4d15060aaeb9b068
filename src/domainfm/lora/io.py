"""Adapter files in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``,
PEFT key names (``base_model.model.<module>.lora_A.weight``, ...), and a fingerprint of the base
model they were trained on (see the key table in :mod:`domainfm.lora`)."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import warnings
from typing import Any, Iterable, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from domainfm.atomic import atomic_path, atomic_write_text

from .inject import CONFIG_ATTR, DEFAULTS, apply, base_parameters, config, matches, wrappers

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "HASH_SCHEME",
    "KEY_PREFIX",
    "adapter_state_dict",
    "base_model_sha256",
    "load_adapter",
    "save_adapter",
]

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
KEY_PREFIX = "base_model.model."
HASH_SCHEME = (
    "domainfm-v1: sha256 over the frozen parameters of the base model (adapter tensors and parameters "
    "matched by `unfreeze` excluded; buffers excluded), sorted by name; for each: name, NUL, dtype, NUL, "
    "shape, NUL, raw little-endian bytes. Wrapped layers are hashed under their original names with "
    "their unmerged weights."
)


def _live_adapter_tensors(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    recorded = config(model)
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    for module_name, w in wrappers(model).items():
        for rel, p in w.adapter_named_parameters():
            out[f"{KEY_PREFIX}{module_name}.{rel}"] = (p, p)
    for name, p, tensor in base_parameters(model):
        if matches(name, recorded["unfreeze"]):
            out[f"{KEY_PREFIX}{name}"] = (p, tensor)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors and the ``unfreeze`` parameters, under PEFT-style keys.

    See :mod:`domainfm.lora` for the key table. Tensors are detached views of the live
    parameters (no copies). An unfrozen full parameter is keyed by its base-model name.
    """
    return {key: tensor.detach() for key, (_, tensor) in _live_adapter_tensors(model).items()}


def _tensor_buffer(t: torch.Tensor):
    if t.is_meta:
        raise ValueError("cannot hash parameters on the meta device; materialise the model first")
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    # a zero-copy view of the bytes (works for bf16, which numpy lacks); `t` must outlive it
    return t, (ctypes.c_ubyte * nbytes).from_address(t.data_ptr()) if nbytes else b""


def base_model_sha256(model: nn.Module, unfreeze: Iterable[str] | None = None) -> str:
    """sha256 fingerprint of the base model's frozen parameters (see :data:`HASH_SCHEME`).

    Gives the same value on a fresh base model and on that model after :func:`apply`, training of
    the adapters / ``unfreeze`` parameters, and :func:`merge`. It depends on the dtype.

    Args:
        unfreeze: parameter globs to leave out; default: the patterns recorded by :func:`apply`.
    """
    if unfreeze is None:
        recorded = getattr(model, CONFIG_ATTR, None)
        unfreeze = recorded["unfreeze"] if recorded else ()
    patterns = list(unfreeze)
    h = hashlib.sha256()
    entries = sorted(
        ((name, tensor) for name, _, tensor in base_parameters(model) if not matches(name, patterns)),
        key=lambda item: item[0],
    )
    for name, tensor in entries:
        h.update(f"{name}\0{str(tensor.dtype).replace('torch.', '')}\0{tuple(tensor.shape)}\0".encode())
        keep, buf = _tensor_buffer(tensor)
        h.update(buf)
        del keep
    return h.hexdigest()


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, base_model_name: str | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's pair) to ``directory``.

    Each file is written atomically (:func:`domainfm.atomic.atomic_path`). The config holds
    PEFT's fields (``peft_type="LORA"``, ``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules`` (our globs, chunk selectors included), ``use_rslora``, ``use_dora``,
    ``modules_to_save`` (= our ``unfreeze`` globs, on parameter names), ``base_model_name_or_path``)
    plus ``variant``, ``unfreeze``, ``replora_hidden`` and ``base_model_sha256`` (see
    :func:`base_model_sha256`). Merged adapters are saved with their adapter tensors as usual.
    """
    recorded = config(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in adapter_state_dict(model).items()}
    name = base_model_name if base_model_name is not None else recorded["base_model_name"]
    payload = {
        "peft_type": "LORA",
        "task_type": None,
        "r": recorded["rank"],
        "lora_alpha": recorded["alpha"],
        "lora_dropout": recorded["dropout"],
        "target_modules": recorded["targets"],
        "use_rslora": recorded["use_rslora"],
        "use_dora": recorded["variant"] == "dora",
        "modules_to_save": recorded["unfreeze"] or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": name,
        "variant": recorded["variant"],
        "unfreeze": recorded["unfreeze"],
        "replora_hidden": recorded["replora_hidden"],
        "preset": recorded.get("preset"),
        "base_model_sha256": base_model_sha256(model),
        "base_model_sha256_scheme": HASH_SCHEME,
        "library": "domainfm",
    }
    with atomic_path(os.path.join(directory, ADAPTER_WEIGHTS_NAME)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(os.path.join(directory, ADAPTER_CONFIG_NAME), json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _settings_from_file(cfg: Mapping[str, Any], path: str) -> dict[str, Any]:
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")
    variant = cfg.get("variant") or ("dora" if cfg.get("use_dora") else "lora")
    unfreeze = cfg.get("unfreeze")
    if unfreeze is None:
        unfreeze = cfg.get("modules_to_save") or []
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{path}: target_modules must be a non-empty list of patterns, got {targets!r}")
    return {
        "targets": list(targets),
        "rank": cfg["r"],
        "alpha": float(cfg["lora_alpha"]),
        "dropout": float(cfg.get("lora_dropout", 0.0)),
        "variant": variant,
        "use_rslora": bool(cfg.get("use_rslora", False)),
        "unfreeze": list(unfreeze),
        "replora_hidden": int(cfg.get("replora_hidden", DEFAULTS["replora_hidden"])),
    }


def load_adapter(model: nn.Module, directory: str | os.PathLike, *, strict_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model``.

    A fresh base model gets :func:`apply` with the saved settings first; a model that already
    has adapters must have the same settings. The recorded ``base_model_sha256`` is compared with
    the model's before anything is changed.

    Args:
        strict_base: on a base-hash mismatch raise (default) or, if False, warn and load anyway.

    Raises:
        ValueError: base hash mismatch (naming both hashes), missing/unexpected/mis-shaped keys
            (naming them), differing settings, or a malformed config.
        RuntimeError: the model's adapters are merged.
    """
    directory = os.fspath(directory)
    config_path = os.path.join(directory, ADAPTER_CONFIG_NAME)
    weights_path = os.path.join(directory, ADAPTER_WEIGHTS_NAME)
    with open(config_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    settings = _settings_from_file(cfg, config_path)

    existing = getattr(model, CONFIG_ATTR, None)
    if existing is not None:
        differing = [k for k, v in settings.items() if existing[k] != v]
        if differing:
            details = "; ".join(f"{k}: model {existing[k]!r} vs file {settings[k]!r}" for k in differing)
            raise ValueError(f"{config_path}: model already has adapters with other settings ({details})")
        if any(w.merged for w in wrappers(model).values()):
            raise RuntimeError("model's adapters are merged; call lora.unmerge(model) before loading")

    recorded = cfg.get("base_model_sha256")
    actual = base_model_sha256(model, settings["unfreeze"])
    if recorded is None:
        warnings.warn(f"{config_path} records no base_model_sha256; the base model is not checked", stacklevel=2)
    elif recorded != actual:
        message = (
            f"{config_path} was trained on a different base model: recorded base_model_sha256 "
            f"{recorded}, this model's {actual} (base_model_name_or_path: "
            f"{cfg.get('base_model_name_or_path')!r}; same weights in another dtype also differ)"
        )
        if strict_base:
            raise ValueError(message + "; pass strict_base=False to load anyway")
        warnings.warn(message, stacklevel=2)

    if existing is None:
        apply(model, base_model_name=cfg.get("base_model_name_or_path"), **settings)
    live = _live_adapter_tensors(model)
    tensors = load_file(weights_path, device="cpu")
    missing = sorted(set(live) - set(tensors))
    unexpected = sorted(set(tensors) - set(live))
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not fit the model's adapters: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}, unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    wrong = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(p.shape)}"
        for k, (p, _) in live.items() if tuple(tensors[k].shape) != tuple(p.shape)
    ]
    if wrong:
        raise ValueError(f"{weights_path}: shape mismatch for {wrong[:20]}")
    with torch.no_grad():
        for k, (p, _) in live.items():
            p.copy_(tensors[k].to(dtype=p.dtype, device=p.device))
    return model
