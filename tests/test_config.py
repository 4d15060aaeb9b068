import importlib.resources
import json
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from domainfm import config as C
from domainfm.engine import TrainConfig


@dataclass
class Data:
    root: str | None = None
    channels: list[str] = field(default_factory=lambda: ["C3", "C4"])


@dataclass
class Schema:
    name: str = "demo"
    mode: Literal["full", "lora"] = "full"
    use_amp: bool = False
    data: Data = field(default_factory=Data)
    train: TrainConfig = field(default_factory=TrainConfig)


def test_overrides_are_typed_and_nested():
    raw = {"data": {"root": None}, "train": {"lr": 0.001}}
    out = C.apply_overrides(raw, ["train.lr=1e-4", "train.max_epochs=3", "data.channels=[Fz, Cz]", "mode=lora",
                                  "use_amp=true"])
    assert raw["train"]["lr"] == 0.001  # input untouched
    cfg = C.from_dict(Schema, out)
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.max_epochs == 3 and cfg.data.channels == ["Fz", "Cz"]
    assert cfg.mode == "lora" and cfg.use_amp is True


@pytest.mark.parametrize(
    "values, message",
    [
        ({"trian": {}}, "unknown config key"),
        ({"train": {"learning_rate": 1}}, "learning_rate"),
        ({"mode": "partial"}, "not one of"),
        ({"use_amp": "False"}, "expected true or false"),  # CBraMod's official flags parse 'False' as True
        ({"train": {"max_epochs": 2.5}}, "expected an integer"),
        ({"data": {"channels": "C3"}}, "expected a list"),
    ],
)
def test_bad_values_are_named(values, message):
    with pytest.raises((C.ConfigError, ValueError), match=message):
        C.from_dict(Schema, values)


def test_override_syntax_errors():
    with pytest.raises(C.ConfigError, match="KEY=VALUE"):
        C.apply_overrides({}, ["train.lr"])
    with pytest.raises(C.ConfigError, match="not a section"):
        C.apply_overrides({"name": "x"}, ["name.sub=1"])


def test_save_and_load_round_trip(tmp_path):
    cfg = C.from_dict(Schema, {"data": {"root": "/data"}, "train": {"lr": 3e-4, "betas": [0.9, 0.95]}})
    C.save_yaml(cfg, tmp_path / "config.yaml")
    again = C.from_dict(Schema, C.load_yaml(tmp_path / "config.yaml"))
    assert again == cfg and again.train.betas == (0.9, 0.95)
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load_yaml(tmp_path / "nope.yaml")
    with pytest.raises(C.ConfigError, match="no shipped config"):
        C.config_path("nofamily", "finetune")


# ----------------------------------------------------------------------------- defaults:


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_deep_merge_file_keys_win_and_lists_replace(tmp_path):
    _write(tmp_path / "_base.yaml", "name: base\nmode: lora\ndata:\n  root: /base\n  channels: [C3, C4, Cz]\n"
                                    "train:\n  lr: 0.001\n  max_epochs: 7\n")
    child = _write(tmp_path / "child.yaml", "defaults: _base.yaml\nname: child\ndata:\n  channels: [Fz]\n"
                                            "train:\n  lr: 0.0002\n")
    raw = C.load_yaml(child)
    assert raw == {
        "name": "child",
        "mode": "lora",
        "data": {"root": "/base", "channels": ["Fz"]},  # root from the base; the list replaced whole
        "train": {"lr": 0.0002, "max_epochs": 7},
    }
    cfg = C.from_dict(Schema, raw)
    assert (cfg.train.lr, cfg.train.max_epochs, cfg.data.root) == (pytest.approx(2e-4), 7, "/base")


def test_defaults_list_later_base_wins_and_chains_recurse(tmp_path):
    _write(tmp_path / "bases" / "_root.yaml", "name: root\nuse_amp: true\ntrain:\n  max_epochs: 1\n  lr: 0.5\n")
    _write(tmp_path / "bases" / "_a.yaml", "defaults: _root\ntrain:\n  max_epochs: 2\n")  # relative to bases/
    _write(tmp_path / "_b.yaml", "name: b\ntrain:\n  max_epochs: 3\n")
    child = _write(tmp_path / "child.yaml", "defaults: [bases/_a.yaml, _b]\nmode: lora\n")
    # _a (with _root under it) first, then _b over it, then the file itself.
    assert C.load_yaml(child) == {"name": "b", "use_amp": True, "train": {"max_epochs": 3, "lr": 0.5}, "mode": "lora"}


def test_defaults_null_replaces_a_base_section_and_diamonds_are_not_cycles(tmp_path):
    _write(tmp_path / "_common.yaml", "data:\n  root: /x\n")
    _write(tmp_path / "_left.yaml", "defaults: _common\nname: left\n")
    _write(tmp_path / "_right.yaml", "defaults: _common\nmode: lora\n")
    child = _write(tmp_path / "child.yaml", "defaults: [_left, _right]\ntrain: null\n")
    _write(tmp_path / "_sect.yaml", "train:\n  lr: 1.0\n")
    assert C.load_yaml(child) == {"data": {"root": "/x"}, "name": "left", "mode": "lora", "train": None}
    nulled = _write(tmp_path / "nulled.yaml", "defaults: _sect\ntrain: null\n")
    assert C.load_yaml(nulled) == {"train": None}


def test_defaults_cycles_are_named(tmp_path):
    a = _write(tmp_path / "a.yaml", "defaults: b.yaml\nname: a\n")
    _write(tmp_path / "b.yaml", "defaults: a.yaml\nname: b\n")
    with pytest.raises(C.ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        C.load_yaml(a)
    itself = _write(tmp_path / "self.yaml", "defaults: self\n")
    with pytest.raises(C.ConfigError, match="cycle"):
        C.load_yaml(itself)


@pytest.mark.parametrize("defaults", ["3", "{a: 1}", "[_ok, 4]", "''"])
def test_bad_defaults_values_name_the_file(tmp_path, defaults):
    _write(tmp_path / "_ok.yaml", "name: ok\n")
    path = _write(tmp_path / "c.yaml", f"defaults: {defaults}\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml: 'defaults' expected a file name"):
        C.load_yaml(path)


def test_missing_base_names_the_including_file(tmp_path):
    path = _write(tmp_path / "c.yaml", "defaults: _nowhere\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml: 'defaults' names '_nowhere'"):
        C.load_yaml(path)


def test_strict_parsing_names_the_dotted_key_and_the_file_it_came_from(tmp_path):
    base = _write(tmp_path / "_base.yaml", "train:\n  learnin_rate: 0.1\n")
    child = _write(tmp_path / "child.yaml", "defaults: _base\nname: c\n")
    with pytest.raises(C.ConfigError, match=rf"'train\.learnin_rate' in {re.escape(str(base.resolve()))}"):
        C.from_dict(Schema, C.load_yaml(child))
    # a wrong type in the base: the dotted key and the base file
    _write(tmp_path / "_typed.yaml", "train:\n  max_epochs: 2.5\n")
    typed = _write(tmp_path / "typed.yaml", "defaults: _typed\ntrain:\n  lr: 0.1\n")
    with pytest.raises(C.ConfigError, match=r"train\.max_epochs: expected an integer.*set in .*_typed\.yaml\)$"):
        C.from_dict(Schema, C.load_yaml(typed))
    # the file's own unknown key names the file itself; an override names the override
    _write(tmp_path / "_good.yaml", "train:\n  lr: 0.1\n")
    own = _write(tmp_path / "own.yaml", "defaults: _good\ndata:\n  rooot: /x\n")
    with pytest.raises(C.ConfigError, match=r"'data\.rooot' in .*own\.yaml"):
        C.from_dict(Schema, C.load_yaml(own))
    fixed = C.apply_overrides(C.load_yaml(typed), ["train.max_epochs=x"])
    with pytest.raises(C.ConfigError, match=r"set in override 'train\.max_epochs=x'"):
        C.from_dict(Schema, fixed)
    # overriding the bad base value with a good one parses
    assert C.from_dict(Schema, C.apply_overrides(C.load_yaml(typed), ["train.max_epochs=4"])).train.max_epochs == 4


def test_a_loaded_config_dumps_and_round_trips_as_plain_yaml(tmp_path):
    _write(tmp_path / "_base.yaml", "data:\n  root: /r\n")
    raw = C.load_yaml(_write(tmp_path / "c.yaml", "defaults: _base\nname: n\n"))
    assert yaml.safe_load(yaml.safe_dump(raw)) == {"data": {"root": "/r"}, "name": "n"}
    assert json.loads(json.dumps(raw)) == raw


def test_shipped_bases_are_found_from_anywhere_and_not_listed(tmp_path, monkeypatch):
    shipped = tmp_path / "package_configs"
    _write(shipped / "fam" / "_base.yaml", "name: shipped\ntrain:\n  lr: 0.25\n")
    _write(shipped / "fam" / "finetune.yaml", "defaults: _base\nmode: lora\n")
    real_files = importlib.resources.files
    monkeypatch.setattr(
        C.importlib.resources, "files", lambda pkg: shipped if pkg == "domainfm.configs" else real_files(pkg)
    )
    assert C.list_configs() == ["fam/finetune"] and C.list_configs("fam") == ["fam/finetune"]
    assert C.load_yaml(C.config_path("fam", "finetune")) == {"name": "shipped", "train": {"lr": 0.25}, "mode": "lora"}
    # a user's YAML elsewhere builds on a shipped config by its name
    user = _write(tmp_path / "mine" / "run.yaml", "defaults: fam/finetune\ntrain:\n  max_epochs: 9\n")
    assert C.load_yaml(user) == {"name": "shipped", "train": {"lr": 0.25, "max_epochs": 9}, "mode": "lora"}
    # a file next to the user's YAML shadows a shipped one of the same name
    _write(tmp_path / "mine" / "fam" / "finetune.yaml", "name: local\n")
    assert C.load_yaml(user)["name"] == "local"
