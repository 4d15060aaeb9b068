"""Launching a family's pretrain/finetune entry, one way for the CLI and for in-process stages:
the family's module (``domainfm.<kind>.<family>``, found by name, never imported by the core) and
its config, named by a YAML path or by the name of a config shipped for the family."""
from __future__ import annotations

import importlib
from pathlib import Path

__all__ = ["family_entry", "config_file"]


def family_entry(kind: str, family: str):
    """Import ``domainfm.<kind>.<family>`` and check that it provides ``Config`` and ``run``."""
    module_name = f"domainfm.{kind}.{family}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        from domainfm import list_families

        raise SystemExit(
            f"domainfm {kind}: no {kind} entry for family {family!r} (module {module_name}). "
            f"Families with models: {', '.join(list_families()) or 'none'}"
        ) from None
    for attr in ("Config", "run"):
        if not hasattr(module, attr):
            raise SystemExit(f"{module_name} must define {attr!r} to be run by the CLI")
    return module


def config_file(family: str, kind: str, given: str | None) -> Path:
    """``--config``: a YAML file, or the name of a config shipped for the family (``pretrain_demo``,
    as stages name them); none: the family's ``<kind>.yaml``."""
    from domainfm import config as cfgmod

    if not given:
        return cfgmod.config_path(family, kind)
    path = Path(given)
    if path.is_file():
        return path
    bare = len(path.parts) == 1 and path.suffix not in (".yaml", ".yml")
    if bare and f"{family}/{given}" in cfgmod.list_configs(family):
        return cfgmod.config_path(family, given)  # a shipped name, even where a folder of that name stands
    if path.is_dir():
        raise cfgmod.ConfigError(f"--config {given}: is a folder; expected a YAML file or the name of a shipped "
                                 f"config ({', '.join(cfgmod.list_configs(family))})")
    if not bare:
        return path  # a YAML path: its absence is reported by the reader, naming it
    return cfgmod.config_path(family, given)
