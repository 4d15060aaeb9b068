"""Putting adapters into a model and folding them out again: :func:`apply` (inject by name
patterns, unfreeze), :func:`merge` / :func:`unmerge`, and trainable-parameter counts."""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from .layer import CHUNK_NAMES, LoraLayer, check_settings, unsupported_reason
from .presets import resolve_preset

__all__ = ["apply", "merge", "unmerge", "TrainableSummary", "trainable_summary", "count_trainable"]

CONFIG_ATTR = "_domainfm_lora_config"
DEFAULTS: dict[str, Any] = {
    "targets": None,
    "rank": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "variant": "lora",
    "use_rslora": False,
    "unfreeze": (),
    "base_model_name": None,
    "replora_hidden": 64,
}


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()


def _as_patterns(value, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    patterns = list(value)
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"{what} must be non-empty strings (glob patterns), got {p!r}")
    return patterns


def _parse_target(pattern: str) -> tuple[str, tuple[str, ...] | None]:
    glob, at, selector = pattern.rpartition("@")
    if not at:
        return pattern, None
    chunks = tuple(c.strip() for c in selector.split(","))
    if not glob or not all(chunks) or len(set(chunks)) != len(chunks) or not set(chunks) <= set(CHUNK_NAMES):
        raise ValueError(
            f"target pattern {pattern!r}: the chunk selector after '@' must be distinct names "
            f"from {CHUNK_NAMES}, e.g. 'blocks.*.attn.qkv@q,v'"
        )
    return glob, tuple(c for c in CHUNK_NAMES if c in chunks)


def wrappers(model: nn.Module) -> dict[str, LoraLayer]:
    """Every :class:`LoraLayer` of ``model``, by dotted module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def base_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, torch.Tensor]]:
    """``(name, parameter, original tensor)`` for every non-adapter parameter.

    Names are the base model's own: ``<module>.base_layer.weight`` reads ``<module>.weight``; the
    tensor is the unmerged weight where a wrapper is merged.
    """
    found = wrappers(model)
    adapter_ids = {id(p) for w in found.values() for _, p in w.adapter_named_parameters()}
    for name, p in model.named_parameters():
        if id(p) in adapter_ids:
            continue
        tensor = p
        head, sep, tail = name.rpartition(".base_layer.")  # base layers have no children: innermost
        wrapper = found.get(head) if sep else None
        if wrapper is not None:
            name = f"{head}.{tail}"
            if tail == "weight":
                tensor = wrapper.original_weight()
        yield name, p, tensor


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def config(model: nn.Module) -> dict[str, Any]:
    """The settings recorded by :func:`apply`."""
    recorded = getattr(model, CONFIG_ATTR, None)
    if recorded is None:
        raise ValueError(f"{type(model).__name__} has no adapters; call lora.apply(...) first")
    return recorded


def apply(
    model: nn.Module,
    targets: str | Iterable[str] | None = None,
    *,
    rank: int = _UNSET,
    alpha: float = _UNSET,
    dropout: float = _UNSET,
    variant: str = _UNSET,
    use_rslora: bool = _UNSET,
    unfreeze: str | Iterable[str] = _UNSET,
    preset: str | Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]] | None = None,
    base_model_name: str | None = _UNSET,
    replora_hidden: int = _UNSET,
) -> nn.Module:
    """Wrap matching layers of ``model`` in place with adapters; freeze everything else.

    Args:
        model: any ``nn.Module``; modified in place and returned.
        targets: fnmatch-style globs on dotted module names (``"encoder.layers.*.linear1"``,
            ``"*attn.qkv"``); ``"<glob>@q,v"`` adapts only chunks q and v of a fused projection.
            Every pattern must match at least one module, and every match must be a plain
            ``nn.Linear``, ``nn.Conv1d`` or ``nn.Conv2d`` (groups=1).
        rank: :math:`r` (default 8).
        alpha: :math:`\\alpha` (default 16.0); scale :math:`\\alpha/r`.
        dropout: dropout on the adapter branch input (default 0.0).
        variant: ``"lora"`` (default), ``"dora"`` or ``"replora"``.
        use_rslora: scale :math:`\\alpha/\\sqrt r` instead (default False).
        unfreeze: globs on dotted *parameter* names made fully trainable (``"blocks.23.*"``,
            ``"*norm*"``, ``"cls_token"``); each must match a parameter (default none).
        preset: a name in :data:`~domainfm.lora.PRESETS` (e.g. ``"explora"``), a kwargs mapping,
            or a callable ``model -> kwargs``; explicit keyword arguments override its values.
        base_model_name: recorded by :func:`~domainfm.lora.save_adapter` as ``base_model_name_or_path``.
        replora_hidden: hidden width of RepLoRA's MLPs (default 64).

    Returns:
        ``model``, with only adapter and ``unfreeze`` parameters requiring grad.

    Raises:
        ValueError: a pattern matching nothing, an unsupported matched layer, bad settings, an
            unknown variant/preset, or a model that already has adapters (apply once, with every
            target).
    """
    settings = dict(DEFAULTS)
    if preset is not None:
        preset_name, values = resolve_preset(preset, model)
        unknown = set(values) - set(settings)
        if unknown:
            raise ValueError(f"preset {preset_name!r} sets unknown options {sorted(unknown)}")
        settings.update(values)
        settings["preset"] = preset_name
    explicit = {
        "targets": targets, "rank": rank, "alpha": alpha, "dropout": dropout, "variant": variant,
        "use_rslora": use_rslora, "unfreeze": unfreeze, "base_model_name": base_model_name,
        "replora_hidden": replora_hidden,
    }
    settings.update({k: v for k, v in explicit.items() if v is not _UNSET and not (k == "targets" and v is None)})

    target_patterns = _as_patterns(settings["targets"], "targets")
    if not target_patterns:
        raise ValueError("no targets: pass target patterns (e.g. ['blocks.*.attn.qkv']) or a preset")
    unfreeze_patterns = _as_patterns(settings["unfreeze"], "unfreeze")
    check_settings(
        rank=settings["rank"], alpha=settings["alpha"], dropout=settings["dropout"],
        variant=settings["variant"], replora_hidden=settings["replora_hidden"],
    )
    if getattr(model, CONFIG_ATTR, None) is not None or wrappers(model):
        raise ValueError(
            f"{type(model).__name__} already has adapters; apply() once with every target "
            "(applying twice to the same layer is an error)"
        )

    modules = [(name, m) for name, m in model.named_modules() if name]  # the root cannot be replaced in place
    plan: dict[str, tuple[tuple[str, ...] | None, str]] = {}
    for pattern in target_patterns:
        glob, chunks = _parse_target(pattern)
        hits = [(name, m) for name, m in modules if fnmatch.fnmatchcase(name, glob)]
        if not hits:
            examples = ", ".join(name for name, _ in modules[:8])
            raise ValueError(
                f"target pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(module names look like: {examples}, ...)"
            )
        for name, m in hits:
            reason = unsupported_reason(m)
            parent_name = name.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if parent_name else model
            if reason is None and isinstance(parent, nn.MultiheadAttention):
                reason = "nn.MultiheadAttention reads out_proj.weight directly, so a wrapper would be bypassed"
            if reason:
                raise ValueError(f"target pattern {pattern!r} matched module {name!r}: {reason}")
            if chunks is not None and m.weight.shape[0] % len(CHUNK_NAMES):
                raise ValueError(
                    f"target pattern {pattern!r} matched module {name!r} with {m.weight.shape[0]} output "
                    f"rows, which cannot be split into {len(CHUNK_NAMES)} equal chunks {CHUNK_NAMES}"
                )
            if name in plan and plan[name][0] != chunks:
                raise ValueError(
                    f"module {name!r} is matched by {plan[name][1]!r} and {pattern!r} with different "
                    "chunk selectors; make the patterns disjoint"
                )
            plan.setdefault(name, (chunks, pattern))

    if unfreeze_patterns:
        names = [name for name, _ in model.named_parameters()]
        for pattern in unfreeze_patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(
                    f"unfreeze pattern {pattern!r} matches no parameter of {type(model).__name__} "
                    f"(parameter names look like: {', '.join(names[:6])}, ...)"
                )

    for name, (chunks, _) in plan.items():
        wrapper = LoraLayer(
            model.get_submodule(name), rank=settings["rank"], alpha=settings["alpha"],
            dropout=settings["dropout"], variant=settings["variant"], use_rslora=settings["use_rslora"],
            chunks=chunks, replora_hidden=settings["replora_hidden"],
        )
        _set_submodule(model, name, wrapper)

    model.requires_grad_(False)
    for wrapper in wrappers(model).values():
        for _, p in wrapper.adapter_named_parameters():
            p.requires_grad_(True)
    for name, p, _ in base_parameters(model):
        if matches(name, unfreeze_patterns):
            p.requires_grad_(True)

    recorded = {
        "targets": target_patterns,
        "rank": int(settings["rank"]),
        "alpha": float(settings["alpha"]),
        "dropout": float(settings["dropout"]),
        "variant": settings["variant"],
        "use_rslora": bool(settings["use_rslora"]),
        "unfreeze": unfreeze_patterns,
        "base_model_name": settings["base_model_name"],
        "replora_hidden": int(settings["replora_hidden"]),
        "preset": settings.get("preset"),
    }
    setattr(model, CONFIG_ATTR, recorded)
    return model


def _require_wrappers(model: nn.Module) -> dict[str, LoraLayer]:
    found = wrappers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no adapters; call lora.apply(...) first")
    return found


def merge(model: nn.Module, *, unload: bool = False) -> nn.Module:
    """Fold every adapter into its base weight; the wrappers then compute the base layer only.

    The delta is computed in fp32 (or the base dtype if wider). Never called implicitly (not on
    ``eval()``, not on save): an EMA teacher deep-copied from the student stays untouched.
    The base weights are stashed, so :func:`unmerge` restores them bit-exactly.

    Args:
        unload: also replace each wrapper by its plain base layer (original module types, merged
            weights, no stash, no adapter parameters). The model can no longer be unmerged.

    Raises:
        RuntimeError: some adapter is already merged (merging twice is an error, not a no-op).
        FloatingPointError: an adapter gives NaN/inf; every layer is left unmerged.
    """
    found = _require_wrappers(model)
    already = [name for name, w in found.items() if w.merged]
    if already:
        raise RuntimeError(f"adapters already merged: {already[:5]}; call lora.unmerge(model) first")
    done: list[LoraLayer] = []
    for name, w in found.items():
        try:
            w.merge()
        except FloatingPointError as err:
            for merged in done:
                merged.unmerge()
            raise FloatingPointError(f"cannot merge adapter of {name!r}: {err}") from err
        done.append(w)
    if unload:
        for name, w in found.items():
            w._merge_stash = None
            _set_submodule(model, name, w.base_layer)
        if hasattr(model, CONFIG_ATTR):
            delattr(model, CONFIG_ATTR)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Restore every merged base weight bit-exactly (from the copy stashed at merge).

    Raises:
        RuntimeError: nothing is merged.
    """
    found = _require_wrappers(model)
    merged = [w for w in found.values() if w.merged]
    if not merged:
        raise RuntimeError("no adapter is merged; nothing to unmerge")
    for w in merged:
        w.unmerge()
    return model


class TrainableSummary(dict):
    """``{"trainable": int, "total": int, "percent": float}``; ``str()`` gives one readable line."""

    def __str__(self) -> str:
        return (
            f"trainable params: {self['trainable']:,d} || all params: {self['total']:,d} "
            f"|| trainable%: {self['percent']:.4f}"
        )


def trainable_summary(model: nn.Module) -> TrainableSummary:
    """Trainable / total parameter counts (each shared parameter counted once)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return TrainableSummary(trainable=trainable, total=total, percent=100.0 * trainable / total if total else 0.0)


def count_trainable(model: nn.Module) -> int:
    """Number of parameters with ``requires_grad`` (each shared parameter counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
