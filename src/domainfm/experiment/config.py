"""The sections every fine-tuning config shares. A family's ``Config`` subclasses
:class:`ExperimentConfig` and adds its own sections (``data``, protocol settings); YAML is parsed
strictly into it by :mod:`domainfm.config`, so every key has an effect or is an error."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from domainfm.engine import TrainConfig
from domainfm.finetune.supervised import LoraSettings
from domainfm.experiment.weights import FALLBACKS, ModelSpec

__all__ = ["ModelSection", "AdaptSection", "StageSection", "ExperimentConfig", "ARM_INITS", "ADAPT_MODES"]

#: what an arm starts from: the configured/stage weights, random init, or the weights a stage started from
ARM_INITS = ("pretrained", "random", "stage_init")
ADAPT_MODES = ("full", "lora", "linear_probe", "none")


@dataclass
class ModelSection:
    """``name``: a registered variant; ``pretrained``: ``true`` (the card's source), a path / URL /
    ``hf://`` source, or null (random init, or the output of ``stages`` when there are any);
    ``fallback``: ``error`` or ``random`` when the card's weights cannot be had offline;
    ``converter``: force one of the card's converters; ``kwargs``: variant overrides."""

    name: str = ""
    pretrained: bool | str | None = None
    fallback: str = "error"
    converter: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.fallback not in FALLBACKS:
            raise ValueError(f"model.fallback={self.fallback!r}: expected one of {FALLBACKS}")

    def spec(self, pretrained: bool | str | None, **kwargs: Any) -> ModelSpec:
        return ModelSpec(self.name, pretrained, self.fallback, {**self.kwargs, **kwargs}, self.converter)


@dataclass
class AdaptSection:
    """``mode``: full | lora | linear_probe | none (no training: protocols only);
    ``seeds``: repeats, each trained with ``train.seed + s`` (mean and std reported)."""

    mode: str = "full"
    lora: LoraSettings = field(default_factory=LoraSettings)
    seeds: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self):
        if self.mode not in ADAPT_MODES:
            raise ValueError(f"adapt.mode={self.mode!r}: expected one of {ADAPT_MODES}")
        if not self.seeds:
            raise ValueError("adapt.seeds: give at least one seed offset, e.g. [0]")


@dataclass
class StageSection:
    """An in-process stage before fine-tuning: ``domainfm <kind> <family>`` with ``config`` (a
    shipped config name such as ``pretrain``, or a YAML path) and ``key=value`` ``overrides``.
    Its saved model becomes the ``pretrained`` arm's starting point."""

    family: str
    config: str = "pretrain"
    overrides: list[str] = field(default_factory=list)
    kind: str = "pretrain"


@dataclass
class ExperimentConfig:
    """``model``, ``adapt``, ``arms`` (each ``INIT`` or ``INIT:MODE``, INIT in ``pretrained``,
    ``random``, ``stage_init``), optional ``stages`` and the engine's ``train``."""

    model: ModelSection = field(default_factory=ModelSection)
    adapt: AdaptSection = field(default_factory=AdaptSection)
    arms: list[str] = field(default_factory=lambda: ["pretrained", "random"])
    stages: list[StageSection] = field(default_factory=list)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        if not self.arms:
            raise ValueError("arms: name at least one arm, e.g. [pretrained, random]")
        for arm in self.arms:
            init, _, mode = arm.partition(":")
            if init not in ARM_INITS:
                raise ValueError(f"arms: {arm!r} starts from {init!r}; expected one of {ARM_INITS} (optionally INIT:MODE)")
            if mode and mode not in ADAPT_MODES:
                raise ValueError(f"arms: {arm!r} has mode {mode!r}; expected one of {ADAPT_MODES}")
            if init == "stage_init" and not self.stages:
                raise ValueError(f"arms: {arm!r} needs a stage (stages: [...]) whose starting weights it uses")
        if self.stages and self.model.pretrained not in (None, False) and not any(
                a.startswith("stage_init") for a in self.arms):
            raise ValueError(
                f"model.pretrained={self.model.pretrained!r} and stages are both set: the pretrained arm would start "
                "from model.pretrained and the stage's output would be unused; pass stages=[] (or model.pretrained=null)")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms: {self.arms} names an arm twice")
