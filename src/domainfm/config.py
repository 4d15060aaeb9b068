"""YAML configs with ``key=value`` overrides, parsed strictly into typed dataclasses.

A family's entry point (``domainfm.pretrain.<family>`` / ``domainfm.finetune.<family>``) declares
its schema as a dataclass ``Config`` (nested dataclasses for sections) and a function
``run(cfg: Config, run_dir: Path) -> dict``. Every YAML under ``configs/`` is parsed against its
schema in the tests, so no config can drift from the code that reads it.

Defaults. A YAML may start from one or more base files::

    defaults: _finetune_base.yaml          # or a list: [_eeg.yaml, _finetune_base.yaml]
    data:
      kind: bciciv2a                       # the file's own keys win over the base's

:func:`load_yaml` resolves ``defaults`` recursively (a cycle is an error naming the chain) and
deep-merges: mappings merge key by key, any other value (lists included) replaces the base's
value whole. A listed base wins over the bases before it. A name is looked up relative to the
folder of the file that names it, then among the shipped configs (``cbramod/_finetune_base``
works from a user's YAML anywhere); ``.yaml`` may be left out. Every key remembers the file it
came from, so :func:`from_dict` names that file beside the dotted key when a key is unknown or
its value does not fit. Shipped files whose name starts with ``_`` are bases, not runnable
configs, and :func:`list_configs` leaves them out.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

__all__ = [
    "ConfigError",
    "DEFAULTS_KEY",
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


DEFAULTS_KEY = "defaults"


class _SourcedDict(dict):
    """A config mapping that remembers, per key, the file (or override) that set its value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.origins: dict[str, str] = {}


# A loaded config dumps like a plain mapping.
yaml.SafeDumper.add_representer(_SourcedDict, yaml.representer.SafeRepresenter.represent_dict)


def _sourced(value: Any, origin: str) -> Any:
    """``value`` with every mapping in it turned into a :class:`_SourcedDict` of ``origin``."""
    if isinstance(value, dict):
        out = _SourcedDict((k, _sourced(v, origin)) for k, v in value.items())
        out.origins = {k: origin for k in value}
        return out
    if isinstance(value, list):
        return [_sourced(v, origin) for v in value]
    return value


def _merge(base: Any, top: Any) -> Any:
    """Deep merge: mappings key by key (``top`` wins), anything else replaced by ``top``."""
    if not (isinstance(base, dict) and isinstance(top, dict)):
        return top
    out = _SourcedDict(base)
    out.origins = dict(getattr(base, "origins", {}))
    for key, value in top.items():
        out[key] = _merge(base[key], value) if key in base else value
        if key in getattr(top, "origins", {}):
            out.origins[key] = top.origins[key]
    return out


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping, got {type(data).__name__}")
    return data


def _resolve_default(name: Any, including: Path) -> Path:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{including}: '{DEFAULTS_KEY}' expected a file name or a list of file names, got {name!r}")
    candidates = []
    for folder in (including.parent, Path(str(importlib.resources.files("domainfm.configs")))):
        path = Path(name) if Path(name).is_absolute() else folder / name
        candidates += [path] if path.suffix in {".yaml", ".yml"} else [path, path.with_name(path.name + ".yaml")]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ConfigError(
        f"{including}: '{DEFAULTS_KEY}' names {name!r}, which is not a file next to it nor a shipped config "
        f"(looked for {[str(c) for c in candidates]})"
    )


def _load(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve() if path.is_file() else path
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(path):], path))
        raise ConfigError(f"'{DEFAULTS_KEY}' form a cycle: {cycle}")
    data = _read_mapping(path)
    names = data.pop(DEFAULTS_KEY, None)
    if names is None:
        names = []
    elif isinstance(names, str):
        names = [names]
    elif not isinstance(names, list):
        raise ConfigError(f"{path}: '{DEFAULTS_KEY}' expected a file name or a list of file names, got {names!r}")
    merged: Any = _SourcedDict()
    for name in names:
        merged = _merge(merged, _load(_resolve_default(name, path), (*chain, path)))
    return _merge(merged, _sourced(data, str(path)))


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a config file with its ``defaults`` resolved and merged (see the module docstring).

    The result maps like a plain dict; the key ``defaults`` is consumed and never returned.
    """
    return _load(Path(path), ())


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
            if part not in node and isinstance(node, _SourcedDict):
                node.origins[part] = f"override {item!r}"
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
        if isinstance(node, _SourcedDict):
            node.origins[parts[-1]] = f"override {item!r}"
    return result


def _deepcopy(value):
    if isinstance(value, _SourcedDict):
        out = _SourcedDict((k, _deepcopy(v)) for k, v in value.items())
        out.origins = dict(value.origins)
        return out
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
    origins = getattr(values, "origins", {})
    unknown = sorted(set(values) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        named = ", ".join(repr(prefix + u) + (f" in {origins[u]}" if u in origins else "") for u in unknown)
        raise ConfigError(f"unknown config key(s) [{named}]; {where or 'top level'} accepts {sorted(fields)}")
    kwargs = {}
    for name, value in values.items():
        try:
            kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
        except ConfigError as exc:
            # The innermost section that knows where the value came from says so, once.
            if name not in origins or getattr(exc, "located", False):
                raise
            located = ConfigError(f"{exc} (set in {origins[name]})")
            located.located = True
            raise located from None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a section's own checks (__post_init__) name the key
        message = str(exc)
        error = ConfigError(message if where and message.startswith(f"{where}.") else
                            f"{where}: {message}" if where else message)
        # the key the check names says where its value came from (an override, not the section's file)
        named = [k for k in kwargs if k in origins and re.search(rf"(^|[.\s]){re.escape(k)}=", message)]
        if named:
            error = ConfigError(f"{error} (set in {origins[named[0]]})")
            error.located = True
        raise error from None


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
    """Names ``family/name`` of the shipped runnable configs (base files ``_*.yaml`` left out)."""
    root = Path(str(importlib.resources.files("domainfm.configs")))
    pattern = f"{family}/*.yaml" if family else "*/*.yaml"
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob(pattern) if not p.name.startswith("_"))
