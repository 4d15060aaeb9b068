from dataclasses import dataclass, field
from typing import Literal

import pytest

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
