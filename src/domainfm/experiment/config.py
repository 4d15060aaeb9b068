"""The sections every fine-tuning config shares. A family's ``Config`` subclasses
:class:`ExperimentConfig` and adds its own sections (``data``, protocol settings); YAML is parsed
strictly into it by :mod:`domainfm.config`, so every key has an effect or is an error."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from domainfm.engine import TrainConfig
from domainfm.lora.settings import LoraSettings
from domainfm.experiment.weights import FALLBACKS, ModelSpec

__all__ = ["ModelSection", "AdaptSection", "StageSection", "ExperimentConfig", "ARM_INITS", "ADAPT_MODES",
           "SAMPLE_WEIGHTINGS", "INTERPOLATIONS"]

#: what an arm starts from: the configured/stage weights, random init, or the weights a stage started from
ARM_INITS = ("pretrained", "random", "stage_init")
ADAPT_MODES = ("full", "lora", "linear_probe", "none")


@dataclass
class ModelSection:
    """``name``: a registered variant; ``pretrained``: ``true`` (the card's source), a path / URL /
    ``hf://`` source, or null (random init, or the output of ``stages`` when there are any);
    ``fallback``: ``error`` or ``random`` when the card's weights cannot be had offline;
    ``converter``: force one of the card's converters; ``kwargs``: variant overrides;
    ``prefer``: a variant with official weights to use instead of ``name`` whenever its card's
    weights are in the cache or reachable (with ``pretrained: true``); otherwise the run says so and
    uses ``name`` (e.g. domainfm's shipped checkpoint). Every arm uses the chosen variant."""

    name: str = ""
    pretrained: bool | str | None = None
    fallback: str = "error"
    converter: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    prefer: str | None = None

    def __post_init__(self):
        if self.fallback not in FALLBACKS:
            raise ValueError(f"model.fallback={self.fallback!r}: expected one of {FALLBACKS}")
        if self.prefer is not None and self.pretrained is not True:
            raise ValueError(f"model.prefer={self.prefer!r} needs model.pretrained: true (the preferred card's weights), "
                             f"got {self.pretrained!r}")

    def spec(self, pretrained: bool | str | None, **kwargs: Any) -> ModelSpec:
        return ModelSpec(self.name, pretrained, self.fallback, {**self.kwargs, **kwargs}, self.converter)


SAMPLE_WEIGHTINGS = ("none", "flow")
INTERPOLATIONS = ("none", "wise", "dawin")


@dataclass
class AdaptSection:
    """``mode``: full | lora | linear_probe | none (no training: protocols only);
    ``seeds``: repeats, each trained with ``train.seed + s`` (mean and std reported).

    Fine-tuning that keeps what pretraining taught (:mod:`domainfm.experiment.robust`); each method
    adds arms beside the plain ones, for every arm that starts from pretrained weights and trains:

    - ``sample_weighting: flow``: the arm ``<arm>+flow``, trained with FLOW's loss
      mean(w_i * l_i), w_i = exp(-l_i^pre / tau) (``flow_temperature``: tau, null = the median of
      the pretrained losses). ``flow_head_epochs``: after the weighted stage, train the head alone
      with the plain loss for that many epochs (the official vision recipe's second round); the
      default 0 keeps ``<arm>+flow`` different from ``<arm>`` by the weighting only, so the two
      columns compare the method itself; set it (e.g. 5) to follow the official recipe.
    - ``interpolation: wise``: the arms ``<arm>+wise@<alpha>`` for each ``wise_alpha`` (a number
      or a list; default the sweep 0, 0.25, 0.5, 0.75, 1, also reported as ``wise_curve``), the
      weights (1 - alpha) * pretrained + alpha * fine-tuned. ``dawin``: the arm ``<arm>+dawin``
      (per-sample interpolation from the two models' entropies, ``dawin_components`` Beta
      components, one merge each); classifiers only (others say ``not applicable`` in the
      report). ``wise+dawin`` gives both.
    - ``probe_epochs``: epochs of the linear probe on the frozen pretrained backbone that gives
      classifiers their pretrained-side head (FLOW's pretrained losses, the alpha = 0 model).
    """

    mode: str = "full"
    lora: LoraSettings = field(default_factory=LoraSettings)
    seeds: list[int] = field(default_factory=lambda: [0])
    sample_weighting: str = "none"
    flow_temperature: float | None = None
    flow_head_epochs: int = 0
    interpolation: str = "none"
    wise_alpha: float | list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    dawin_components: int = 3
    probe_epochs: int = 5

    def __post_init__(self):
        if self.mode not in ADAPT_MODES:
            raise ValueError(f"adapt.mode={self.mode!r}: expected one of {ADAPT_MODES}")
        if not self.seeds:
            raise ValueError("adapt.seeds: give at least one seed offset, e.g. [0]")
        if self.sample_weighting not in SAMPLE_WEIGHTINGS:
            raise ValueError(f"adapt.sample_weighting={self.sample_weighting!r}: expected one of {SAMPLE_WEIGHTINGS}")
        methods = self.interpolation.split("+")
        if any(m not in INTERPOLATIONS for m in methods) or ("none" in methods and len(methods) > 1) or \
                len(set(methods)) != len(methods):
            raise ValueError(f"adapt.interpolation={self.interpolation!r}: expected one of {INTERPOLATIONS} "
                             "(or wise+dawin for both)")
        if self.flow_temperature is not None and not self.flow_temperature > 0:
            raise ValueError(f"adapt.flow_temperature={self.flow_temperature}: expected a number > 0, or null for the median")
        if self.flow_head_epochs < 0:
            raise ValueError(f"adapt.flow_head_epochs={self.flow_head_epochs}: expected >= 0")
        if self.probe_epochs < 1:
            raise ValueError(f"adapt.probe_epochs={self.probe_epochs}: expected >= 1")
        if self.dawin_components < 1:
            raise ValueError(f"adapt.dawin_components={self.dawin_components}: expected >= 1")
        alphas = [self.wise_alpha] if isinstance(self.wise_alpha, (int, float)) else list(self.wise_alpha)
        if not alphas or any(not (isinstance(a, (int, float)) and 0.0 <= a <= 1.0) for a in alphas):
            raise ValueError(f"adapt.wise_alpha={self.wise_alpha!r}: expected numbers in [0, 1]")
        self.wise_alpha = sorted({float(a) for a in alphas})

    @property
    def interpolations(self) -> list[str]:
        """The interpolation methods asked for (``[]`` for none)."""
        return [] if self.interpolation == "none" else self.interpolation.split("+")

    @property
    def robust(self) -> bool:
        """Whether any robust fine-tuning method is asked for."""
        return self.sample_weighting != "none" or bool(self.interpolations)


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
    ``random``, ``stage_init``), optional ``stages`` and the engine's ``train``.
    ``keep_checkpoints``: keep every arm's and stage's training checkpoints (``last.ckpt``,
    ``best.safetensors``) once the experiment has finished; by default only the selected models
    (``<arm>/model``, ``adapter``) stay."""

    model: ModelSection = field(default_factory=ModelSection)
    adapt: AdaptSection = field(default_factory=AdaptSection)
    arms: list[str] = field(default_factory=lambda: ["pretrained", "random"])
    stages: list[StageSection] = field(default_factory=list)
    train: TrainConfig = field(default_factory=TrainConfig)
    keep_checkpoints: bool = False

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
