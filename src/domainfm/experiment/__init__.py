"""The experiment layer: what every fine-tuning run shares, written once.

A family declares (see ``finetune/cbramod.py`` for the shortest example)::

    @dataclass
    class Config(ExperimentConfig):              # model, adapt, arms, stages, train + the family's sections
        data: DataSection = field(default_factory=DataSection)

    FAMILY = Family("cbramod", Config, data=build_task, model_kwargs=..., protocols=[...])
    run, evaluate = FAMILY.run, FAMILY.evaluate   # what `domainfm finetune|evaluate` call

- :mod:`.weights`: ``ModelSpec`` + ``resolve(spec) -> (model, InitInfo)``; the only place where a
  random fallback can happen, and only for a card's own source being unreachable.
- :mod:`.task`: ``TaskData``, what a family's data function returns.
- :mod:`.config`: ``ExperimentConfig`` (``model``, ``adapt``, ``arms``, ``stages``, ``train``);
  ``adapt.sample_weighting`` / ``adapt.interpolation`` add FLOW / WiSE-FT / DaWin arms
  (:mod:`domainfm.experiment.robust`).
- :mod:`.family`: ``Family.run`` / ``Family.evaluate``: arms x seeds, stages, best checkpoint,
  protocols, saved models.
- :mod:`.report`: the nested report, seed aggregation, the per-arm table.
- :mod:`.run_folder`: ``RunFolder``, the owner of every file of ``runs/<family>/<name>/``.
"""
from domainfm.experiment.config import (ADAPT_MODES, ARM_INITS, INTERPOLATIONS, SAMPLE_WEIGHTINGS, AdaptSection, ExperimentConfig,
                                        ModelSection, StageSection)
from domainfm.experiment.family import ArmContext, Family, Retained, run_stage
from domainfm.experiment.report import aggregate_seeds, format_table, print_table, to_markdown
from domainfm.experiment.run_folder import RunFolder, RunFolderError
from domainfm.experiment.task import TaskData
from domainfm.experiment.weights import InitInfo, ModelSpec, WeightsUnavailable, init_label, resolve

__all__ = [
    "ADAPT_MODES", "ARM_INITS", "INTERPOLATIONS", "SAMPLE_WEIGHTINGS", "AdaptSection", "ArmContext", "ExperimentConfig", "Family", "InitInfo", "ModelSection",
    "ModelSpec", "Retained", "RunFolder", "RunFolderError", "StageSection", "TaskData", "WeightsUnavailable", "aggregate_seeds",
    "format_table", "init_label", "print_table", "resolve", "run_stage", "to_markdown",
]
