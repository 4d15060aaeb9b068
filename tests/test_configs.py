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
