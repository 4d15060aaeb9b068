"""YAML configs with ``key=value`` overrides, parsed strictly into typed dataclasses.

A family's entry point (``domainfm.pretrain.<family>`` / ``domainfm.finetune.<family>``) declares
its schema as a dataclass ``Config`` (nested dataclasses for sections) and a function
``run(cfg: Config, run_dir: Path) -> dict``. Every YAML under ``configs/`` is parsed against its
schema in the tests, so no config can drift from the code that reads it.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

__all__ = [
    "ConfigError",
    "load_yaml",
    "apply_overrides",
    "from_dict",
    "to_dict",
    "save_yaml",
    "config_path",
    "list_configs",
]


class ConfigError(ValueError):
    pass


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML: ``3``, ``1e-4``, ``[a, b]``,
    ``null``, ``true``). Returns a new dict; the dotted path may create a new leaf but not cross
    a non-mapping value."""
    result = _deepcopy(config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        value = yaml.safe_load(raw) if raw.strip() else ""
        # YAML 1.1 reads 1e-4 as a string; numbers written that way are meant as floats.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value.lower() for c in "e.") and value.lower() not in {"nan", "inf"} else value
            except ValueError:
                pass
        node[parts[-1]] = value
    return result


def _deepcopy(value):
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy(v) for v in value]
    return value


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: {value!r} does not fit {tp}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, Sequence, typing.Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, where) for v in value)
        if args and len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(a, v, where) for a, v in zip(args or [Any] * len(value), value))
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is bool:
        # Strict: the strings "False"/"no" are not silently truthy.
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type, values: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``values``: unknown keys, wrong types and missing required
    fields are errors that name the dotted key."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown config key(s) {[prefix + u for u in unknown]}; {where or 'top level'} accepts {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def save_yaml(data: Any, path: str | os.PathLike) -> None:
    from domainfm.engine import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(to_dict(data), sort_keys=False))


def config_path(family: str, name: str) -> Path:
    """Path of a shipped config ``configs/<family>/<name>.yaml``."""
    root = importlib.resources.files("domainfm.configs")
    path = Path(str(root / family / f"{name}.yaml"))
    if not path.is_file():
        available = list_configs(family)
        raise ConfigError(f"no shipped config {family}/{name}.yaml; available for {family!r}: {available}")
    return path


def list_configs(family: str | None = None) -> list[str]:
    root = Path(str(importlib.resources.files("domainfm.configs")))
    pattern = f"{family}/*.yaml" if family else "*/*.yaml"
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob(pattern))
