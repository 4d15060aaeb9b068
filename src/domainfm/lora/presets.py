"""Named adapter presets: ``lora.apply(model, preset="explora")``.

The core holds the registry only; a family registers its own presets beside its model
(``models/explora/preset.py`` registers ``"explora"``) with :func:`register_preset`. A name that
is not registered yet makes the registry import every family once
(:func:`domainfm.models.import_families`), so ``preset="explora"`` works without importing the
family first.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Mapping, Union

from torch import nn

__all__ = ["Preset", "PRESETS", "register_preset"]

#: kwargs for :func:`domainfm.lora.apply`, or a callable ``model -> kwargs``
Preset = Union[Mapping[str, Any], Callable[[nn.Module], Mapping[str, Any]]]


def _import_families() -> None:
    from domainfm.models import import_families

    import_families()


class PresetRegistry(MutableMapping):
    """name -> :data:`Preset`; looking up or listing loads the families' presets first."""

    def __init__(self) -> None:
        self._presets: dict[str, Preset] = {}

    def _load(self) -> None:
        _import_families()

    def __getitem__(self, name: str) -> Preset:
        if name not in self._presets:
            self._load()
        return self._presets[name]

    def __contains__(self, name: object) -> bool:
        if name not in self._presets:
            self._load()
        return name in self._presets

    def __setitem__(self, name: str, preset: Preset) -> None:
        self._presets[name] = preset

    def __delitem__(self, name: str) -> None:
        del self._presets[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(dict(self._presets))

    def __len__(self) -> int:
        self._load()
        return len(self._presets)

    def __repr__(self) -> str:
        return f"PresetRegistry({sorted(self._presets)})"


#: name -> kwargs for :func:`domainfm.lora.apply`, or a callable ``model -> kwargs``; caller's kwargs win.
PRESETS = PresetRegistry()


def register_preset(name: str, preset: Preset) -> Preset:
    """Register ``preset`` under ``name`` (usable as a decorator's target: returns ``preset``).

    Raises:
        ValueError: ``name`` is taken by another preset (a module re-imported may re-register
            the same function).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"preset name must be a non-empty string, got {name!r}")
    if not (callable(preset) or isinstance(preset, Mapping)):
        raise ValueError(f"preset {name!r} must be a kwargs mapping or a callable model -> kwargs, got {preset!r}")
    old = PRESETS._presets.get(name)
    if old is not None and _identity(old) != _identity(preset):
        raise ValueError(f"preset {name!r} is already registered by {_identity(old)}")
    PRESETS[name] = preset
    return preset


def _identity(preset: Preset) -> str:
    module, qualname = getattr(preset, "__module__", None), getattr(preset, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(preset)


def resolve_preset(preset: str | Preset, model: nn.Module) -> tuple[str, Mapping[str, Any]]:
    """``(name, kwargs)`` of a preset given by name, mapping or callable, evaluated on ``model``."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; available: {sorted(PRESETS)}")
        name, preset = preset, PRESETS[preset]
    else:
        name = getattr(preset, "__name__", "custom")
    return name, (preset(model) if callable(preset) else preset)
