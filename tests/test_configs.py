"""Every shipped YAML config parses against the typed schema of the entry point that reads it."""
import importlib
from pathlib import Path

import pytest

from domainfm import config as C

ALL_CONFIGS = C.list_configs()


def _entry(config_name: str):
    family, name = config_name.split("/", 1)
    kind = "pretrain" if name.startswith("pretrain") else "finetune"
    return importlib.import_module(f"domainfm.{kind}.{family}"), kind


@pytest.mark.parametrize("config_name", ALL_CONFIGS)
def test_config_parses_against_schema(config_name):
    module, kind = _entry(config_name)
    family, name = config_name.split("/", 1)
    raw = C.load_yaml(C.config_path(family, name))
    cfg = C.from_dict(module.Config, raw)
    # and the resolved config round-trips through YAML unchanged
    assert C.from_dict(module.Config, C.to_dict(cfg)) == cfg


def test_every_family_with_configs_ships_its_default_entry_configs():
    families = {name.split("/")[0] for name in ALL_CONFIGS}
    for family in families:
        for kind in ("pretrain", "finetune"):
            try:
                importlib.import_module(f"domainfm.{kind}.{family}")
            except ModuleNotFoundError:
                continue
            assert f"{family}/{kind}" in ALL_CONFIGS, f"domainfm.{kind}.{family} exists but configs/{family}/{kind}.yaml does not"


def test_every_shipped_base_file_is_used():
    # Base files (configs/<family>/_*.yaml) are not runnable and not in list_configs; one that
    # no config names in `defaults:` would be parsed by nothing, so it could rot unseen.
    import importlib.resources

    import yaml

    root = Path(str(importlib.resources.files("domainfm.configs")))
    named = set()
    for path in root.glob("*/*.yaml"):
        defaults = (yaml.safe_load(path.read_text()) or {}).get(C.DEFAULTS_KEY) or []
        for name in [defaults] if isinstance(defaults, str) else defaults:
            named.add((path.parent / name).resolve().with_suffix("").name)
    unused = [str(p.relative_to(root)) for p in root.glob("*/_*.yaml") if p.stem not in named]
    assert not unused, f"base config(s) named by no `defaults:`: {unused}"
