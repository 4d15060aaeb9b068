"""Adapter files in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``,
PEFT key names (``base_model.model.<module>.lora_A.weight``, ...), and a fingerprint of the base
model they were trained on (see the key table in :mod:`domainfm.lora`).

``peft.PeftModel.from_pretrained(base, directory)`` reads what :func:`save_adapter` writes when
the adapter is one PEFT has (plain or DoRA LoRA on whole ``nn.Linear`` / ``nn.Conv1d`` /
``nn.Conv2d`` layers; ``unfreeze`` covering whole submodules): ``target_modules`` then holds the
full module names (or an exact regex of them where a name would also suffix-match another
module under PEFT's rule), ``modules_to_save`` the unfrozen submodules, and our glob patterns
stay under ``domainfm_target_patterns`` / ``unfreeze``. An adapter PEFT has no layer for (fused
``@q,v`` slices, RepLoRA's training-time MLPs, unfrozen root parameters such as ``cls_token``) is
marked ``domainfm_peft_compatible: false`` with the reason in ``domainfm_peft_incompatible``, and
its ``target_modules`` matches no module under PEFT's rules, so PEFT refuses it
(``Target modules ... not found``) instead of loading an adapter that does nothing.

:func:`load_adapter` reads these files, files from before ``domainfm_target_patterns`` (whose
``target_modules`` held the globs), and files written by PEFT itself (``target_modules`` as PEFT's
names or regex and ``modules_to_save``, resolved against the model's module names)."""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
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
    "PEFT_TARGETS_KEY",
    "adapter_state_dict",
    "base_model_sha256",
    "load_adapter",
    "peft_layout",
    "save_adapter",
]

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
KEY_PREFIX = "base_model.model."
#: our glob patterns (chunk selectors included) in ``adapter_config.json``; ``target_modules`` is PEFT's
PEFT_TARGETS_KEY = "domainfm_target_patterns"
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


def _base_module_names(model: nn.Module, wrapped: Mapping[str, Any]) -> list[str]:
    """Module names of the base model as PEFT sees it (the children of our wrappers left out)."""
    return [name for name, _ in model.named_modules() if not any(a in wrapped for a in _ancestors(name))]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _modules_to_save(model: nn.Module, names: list[str], wrapped: Mapping[str, Any],
                     unfreeze: list[str]) -> tuple[list[str], str | None]:
    """PEFT's ``modules_to_save`` for our ``unfreeze`` parameter globs: the largest submodules
    all of whose parameters are unfrozen, or ``(…, reason)`` when PEFT cannot express them."""
    params = [n for n, _, _ in base_parameters(model)]
    unfrozen = [n for n in params if matches(n, unfreeze)]
    if not unfrozen:
        return [], None
    unfrozen_set = set(unfrozen)
    chosen: list[str] = []
    for pname in unfrozen:
        if any(pname.startswith(m + ".") for m in chosen):
            continue
        owner = pname.rpartition(".")[0]
        if not owner:
            return [], (f"unfreeze matches {pname!r}, a parameter of the root module; PEFT's modules_to_save "
                        "trains whole submodules only")
        pick = None
        for cand in _ancestors(pname):
            inside = [n for n in params if n.startswith(cand + ".")]
            if all(n in unfrozen_set for n in inside) and not any(w == cand or w.startswith(cand + ".") for w in wrapped):
                pick = cand
                break
        if pick is None:
            return [], (f"unfreeze covers {pname!r} but not every parameter of a submodule free of adapters around "
                        f"it ({owner!r}); PEFT's modules_to_save trains whole submodules")
        chosen.append(pick)
    for m in chosen:
        # PEFT wraps every module whose name ends with the entry (no dot rule) and keeps adapters
        # out of every module matching (^|.*\.)entry($|\..*)
        clash = [k for k in names if k != m and k.endswith(m)]
        if clash:
            return [], f"modules_to_save entry {m!r} would also match {clash[:3]} under PEFT's suffix rule"
        hit = [w for w in wrapped if re.match(rf"(^|.*\.){m}($|\..*)", w)]
        if hit:
            return [], f"modules_to_save entry {m!r} would keep PEFT's adapters out of {hit[:3]}"
    return chosen, None


def peft_layout(model: nn.Module) -> dict[str, Any]:
    """How the adapters of ``model`` read in PEFT: ``{"target_modules", "modules_to_save",
    "compatible", "reason"}``. ``target_modules`` is the sorted list of the adapted modules' full
    names, or an exact regex of them where one name would also suffix-match another module under
    PEFT's list rule; ``reason`` (when not compatible) says what PEFT has no counterpart for."""
    recorded = config(model)
    found = wrappers(model)
    names = _base_module_names(model, found)
    reasons = []
    sliced = sorted(n for n, w in found.items() if w.chunks != (None,))
    if sliced:
        patterns = [p for p in recorded["targets"] if "@" in p]
        reasons.append(f"fused-projection slices {patterns} adapt chunks of {len(sliced)} layer(s) (e.g. "
                       f"{sliced[0]!r}); PEFT adapts whole layers only")
    if recorded["variant"] == "replora":
        reasons.append("RepLoRA: the file holds its training-time MLPs, which PEFT has no layer for")
    modules_to_save, why = _modules_to_save(model, names, found, list(recorded["unfreeze"]))
    if why:
        reasons.append(why)
    targets: list[str] | str = sorted(found)
    target_set = set(targets)
    suffix_hit = any(".".join(k.split(".")[i:]) in target_set
                     for k in names if k not in target_set for i in range(1, k.count(".") + 1))
    if suffix_hit:
        targets = "(?:" + "|".join(re.escape(t) for t in sorted(found)) + ")"  # PEFT: re.fullmatch
    return {"target_modules": targets, "modules_to_save": modules_to_save or None,
            "compatible": not reasons, "reason": "; ".join(reasons) or None}


def _refusal_token(reason: str) -> str:
    """A ``target_modules`` entry no module name can match (it holds ':' and no dot-free suffix of
    a real name), so that PEFT refuses the file and prints why."""
    words = re.sub(r"[^A-Za-z0-9@,]+", "-", reason).strip("-")
    return f"domainfm-only-adapter:{words}:load-with-domainfm.lora.load_adapter"


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, base_model_name: str | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's pair) to ``directory``.

    Each file is written atomically (:func:`domainfm.atomic.atomic_path`). The config holds
    PEFT's fields (``peft_type="LORA"``, ``task_type=None``, ``r``, ``lora_alpha``, ``lora_dropout``,
    ``bias="none"``, ``fan_in_fan_out=False``, ``use_rslora``, ``use_dora``,
    ``base_model_name_or_path``, and, see :func:`peft_layout`, ``target_modules`` as PEFT matches
    them and ``modules_to_save``) plus ours: ``domainfm_target_patterns`` (the globs, chunk
    selectors included), ``variant``, ``unfreeze`` (parameter globs), ``replora_hidden``,
    ``base_model_sha256`` (see :func:`base_model_sha256`) and ``domainfm_peft_compatible`` /
    ``domainfm_peft_incompatible``. The persistent buffers of ``modules_to_save`` modules are
    saved beside their parameters, as PEFT expects. Merged adapters are saved with their adapter
    tensors as usual.
    """
    recorded = config(model)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in adapter_state_dict(model).items()}
    name = base_model_name if base_model_name is not None else recorded["base_model_name"]
    layout = peft_layout(model)
    if layout["compatible"]:
        target_modules, modules_to_save = layout["target_modules"], layout["modules_to_save"]
        for module_name in modules_to_save or ():
            module = model.get_submodule(module_name)
            for buffer_name, buf in module.named_buffers():
                owner_name, _, leaf = buffer_name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                if leaf not in owner._non_persistent_buffers_set and buf is not None:
                    tensors[f"{KEY_PREFIX}{module_name}.{buffer_name}"] = buf.detach().to("cpu").contiguous().clone()
    else:
        # PEFT must refuse this file rather than load adapters that do nothing: our globs match no
        # module under PEFT's rules unless one is a plain name, and then a token that matches
        # nothing and says why goes in its place
        names = _base_module_names(model, wrappers(model))
        globs = list(recorded["targets"])
        plain = [g for g in globs if any(k == g or k.endswith("." + g) for k in names)]
        target_modules = [g for g in globs if g not in plain] + ([_refusal_token(layout["reason"])] if plain else [])
        modules_to_save = recorded["unfreeze"] or None
    payload = {
        "peft_type": "LORA",
        "task_type": None,
        "r": recorded["rank"],
        "lora_alpha": recorded["alpha"],
        "lora_dropout": recorded["dropout"],
        "target_modules": target_modules,
        "use_rslora": recorded["use_rslora"],
        "use_dora": recorded["variant"] == "dora",
        "modules_to_save": modules_to_save,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": name,
        PEFT_TARGETS_KEY: list(recorded["targets"]),
        "domainfm_peft_compatible": layout["compatible"],
        "domainfm_peft_incompatible": layout["reason"],
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


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _peft_targets(cfg: Mapping[str, Any], path: str, names: list[str]) -> tuple[list[str], list[str]]:
    """A file written by PEFT: its ``target_modules`` (names matched exactly or as dotted
    suffixes, or one regex matched in full) and ``modules_to_save`` (name suffixes) resolved
    against the model's module names into our globs (targets, unfreeze)."""
    unsupported = {k: cfg.get(k) for k in ("layers_to_transform", "rank_pattern", "alpha_pattern", "exclude_modules",
                                           "target_parameters", "trainable_token_indices") if cfg.get(k)}
    if cfg.get("bias", "none") != "none":
        unsupported["bias"] = cfg["bias"]
    if cfg.get("fan_in_fan_out"):
        unsupported["fan_in_fan_out"] = True
    if unsupported:
        raise ValueError(f"{path}: PEFT settings {unsupported} have no counterpart in domainfm.lora (expected "
                         "bias 'none', fan_in_fan_out false, one rank and alpha for every layer)")
    spec = cfg.get("target_modules")
    if isinstance(spec, str):
        hits = [k for k in names if k and re.fullmatch(spec, k)]
    elif spec:
        hits = [k for k in names if k and any(k == t or k.endswith("." + t) for t in spec)]
    else:
        raise ValueError(f"{path}: target_modules must name modules (a list, or a regex), got {spec!r}")
    if not hits:
        raise ValueError(f"{path}: target_modules {spec!r} matches no module of the model")
    unfreeze = [_glob_escape(k) + ".*" for k in names if k and any(k.endswith(m) for m in cfg.get("modules_to_save") or ())]
    return [_glob_escape(k) for k in hits], unfreeze


def _settings_from_file(cfg: Mapping[str, Any], path: str, model: nn.Module) -> dict[str, Any]:
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")
    variant = cfg.get("variant") or ("dora" if cfg.get("use_dora") else "lora")
    if PEFT_TARGETS_KEY in cfg or cfg.get("library") == "domainfm":
        # ours; files from before domainfm_target_patterns held the globs in target_modules
        targets = cfg.get(PEFT_TARGETS_KEY, cfg.get("target_modules"))
        if isinstance(targets, str) or not targets:
            raise ValueError(f"{path}: {PEFT_TARGETS_KEY} must be a non-empty list of patterns, got {targets!r}")
        unfreeze = cfg.get("unfreeze")
        if unfreeze is None:
            unfreeze = cfg.get("modules_to_save") or []
    else:
        targets, unfreeze = _peft_targets(cfg, path, _base_module_names(model, wrappers(model)))
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


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for module_name, module in model.named_modules():
        for leaf, buf in module.named_buffers(recurse=False):
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                out[f"{KEY_PREFIX}{module_name + '.' if module_name else ''}{leaf}"] = buf
    return out


def load_adapter(model: nn.Module, directory: str | os.PathLike, *, strict_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` (or by PEFT, see the module docstring) into ``model``.

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
    settings = _settings_from_file(cfg, config_path, model)

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
    # the buffers of PEFT's modules_to_save (saved beside their parameters) go back into the model
    buffers = {k: b for k, b in _persistent_buffers(model).items() if k in tensors and k not in live}
    missing = sorted(set(live) - set(tensors))
    unexpected = sorted(set(tensors) - set(live) - set(buffers))
    if missing or unexpected:
        raise ValueError(
            f"{weights_path} does not fit the model's adapters: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}, unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    wrong = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(p.shape)}"
        for k, p in [*((k, p) for k, (p, _) in live.items()), *buffers.items()]
        if tuple(tensors[k].shape) != tuple(p.shape)
    ]
    if wrong:
        raise ValueError(f"{weights_path}: shape mismatch for {wrong[:20]}")
    with torch.no_grad():
        for k, (p, _) in live.items():
            p.copy_(tensors[k].to(dtype=p.dtype, device=p.device))
        for k, b in buffers.items():
            b.copy_(tensors[k].to(dtype=b.dtype, device=b.device))
    return model
