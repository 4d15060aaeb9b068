"""A family declared, not scripted: :class:`Family` runs every fine-tuning experiment the same way.

For each arm (``pretrained``, ``random``, ``stage_init``, optionally ``INIT:MODE``) and each seed:
resolve the weights (:func:`~domainfm.experiment.weights.resolve`), run the protocols that look at
the model *before* adaptation, adapt it (``full`` / ``lora`` / ``linear_probe`` / ``none``), train
with the engine (the best checkpoint by ``train.monitor``, default the task's selection rule),
score validation and test with the saved model, run the protocols *after* adaptation, and save
the arm's model (``RUN/<arm>/model``, LoRA merged; the adapter beside it). Seeds are aggregated
(mean, std, per-seed results) and all arms land in one nested report.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from domainfm.engine import Recipe, Trainer
from domainfm.experiment import pictures
from domainfm.experiment.arm import ArmContext, ArmRunner, Protocol, Retained
from domainfm.experiment.config import ExperimentConfig
from domainfm.experiment.report import aggregate_seeds
from domainfm.experiment.run_folder import RunFolder, RunFolderError
from domainfm.experiment.robust_arms import RobustArms
from domainfm.experiment.stages import run_stage
from domainfm.experiment.task import TaskData

__all__ = ["Family", "ArmContext", "Retained", "run_stage"]


@dataclass
class Family(RobustArms, ArmRunner):
    """A family's fine-tuning, declared.

    Args:
        name: the family (``domainfm finetune <name>``).
        config: its ``Config`` dataclass (a subclass of :class:`ExperimentConfig`).
        data: ``fn(cfg) -> TaskData``.
        model_kwargs: ``fn(cfg, task) -> dict`` of keywords for ``create_model`` (input spec, head size).
        recipe: ``fn(cfg, model, task) -> Recipe``; default the shared supervised recipe.
        protocols_before: ``fn(ctx) -> dict`` run on each arm's model before adaptation (zero-shot,
            in-context); results are stored under the arm.
        protocols: the same, after adaptation (on the selected model).
        head: module name(s) trained in ``linear_probe`` and kept trainable under LoRA, or
            ``fn(cfg, task) -> names`` when it depends on the task.
        prepare: ``fn(cfg, model, mode)`` after the shared mode preparation (e.g. refreeze buffers).
        selection: ``fn(cfg, task) -> (metric, direction)``, the checkpoint selection rule when
            ``train.monitor`` is unset (default: the shared supervised rule for the task).
        retained: the family's :class:`Retained` capability (forgetting), measured before and after.
        baselines: ``fn(cfg, task) -> {"columns": {column name: score key prefix}, "description":
            line}`` or None: reference forecasts (not trained arms) whose scores the recipe puts in
            every arm's sections as ``<prefix>_<metric>``; stored as ``report["baselines"]``, they
            become extra columns of the report's table (:func:`~domainfm.experiment.report.table_rows`).
    """

    name: str
    config: type
    data: Callable[[Any], TaskData]
    model_kwargs: Callable[[Any, TaskData], dict[str, Any]] = lambda cfg, task: {}
    recipe: Callable[[Any, nn.Module, TaskData], Recipe] | None = None
    protocols_before: Sequence[Protocol] = ()
    protocols: Sequence[Protocol] = ()
    head: str | Sequence[str] | Callable[[Any, TaskData], str | Sequence[str]] = "head"
    prepare: Callable[[Any, nn.Module, str], None] | None = None
    selection: Callable[[Any, TaskData], tuple[str, str]] | None = None
    retained: Retained | None = None
    baselines: Callable[[Any, TaskData], dict[str, Any] | None] | None = None

    def __post_init__(self):
        if not (dataclasses.is_dataclass(self.config) and issubclass(self.config, ExperimentConfig)):
            raise TypeError(f"Family {self.name!r}: config must be a dataclass subclassing ExperimentConfig")

    # ------------------------------------------------------------------ pieces

    def build_recipe(self, cfg, model: nn.Module, task: TaskData) -> Recipe:
        if self.recipe is not None:
            return self.recipe(cfg, model, task)
        from domainfm.experiment.supervised import SupervisedRecipe

        smoothing = getattr(cfg, "label_smoothing", 0.0) if task.task == "multiclass" else 0.0
        recipe = SupervisedRecipe(model, task.train, task.val, task=task.task, label_smoothing=smoothing,
                                  forward_fn=task.forward_fn, collate_fn=task.collate_fn)
        recipe.eval_collate_fn = task.eval_collate_fn
        return recipe

    def monitor(self, cfg, task: TaskData) -> tuple[str, str]:
        """``train.monitor`` as configured; when unset, the task's selection rule."""
        if cfg.train.monitor is not None:
            return cfg.train.monitor, cfg.train.monitor_mode
        if self.selection is not None:
            metric, direction = self.selection(cfg, task)
        else:
            from domainfm.experiment.supervised import selection_rule

            metric, direction = selection_rule(task.task)
        return f"val/{metric}", direction

    def _arm_source(self, cfg, init: str, stage_reports: list[dict[str, Any]]) -> bool | str | None:
        if init == "random":
            return None
        if init == "stage_init":
            source = stage_reports[-1].get("saved_init")
            if source is None:
                raise ValueError(f"arm stage_init: the last stage ({cfg.stages[-1].family}) saved no starting weights "
                                 "('saved_init' in its report)")
            return source
        if cfg.model.pretrained is not None and cfg.model.pretrained is not False:
            return cfg.model.pretrained
        return stage_reports[-1]["saved_model"] if stage_reports else None

    # ------------------------------------------------------------------ robust fine-tuning

    def _head_names(self, cfg, task: TaskData) -> str | Sequence[str]:
        return self.head(cfg, task) if callable(self.head) else self.head

    def run(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Run every stage, arm and seed of ``cfg`` into ``run_dir``; returns the nested report.

        With ``adapt.sample_weighting=flow`` every eligible arm ``A`` is followed by ``A+flow``
        (its own folder and saved model); with ``adapt.interpolation`` each eligible arm (plain and
        ``+flow``) is followed by its interpolated arms ``A+wise@<alpha>`` / ``A+dawin`` (scores and
        retained capability only; nothing saved) and ``report["wise_curve"][A]``."""
        start = time.perf_counter()
        folder = RunFolder(run_dir)
        choice = None
        if cfg.model.prefer:  # official weights first; the data may depend on the variant, so before it
            from domainfm.experiment.weights import prefer_official

            name, choice = prefer_official(cfg.model.prefer, cfg.model.name, converter=cfg.model.converter)
            # this run's copy: the caller's config (written back to config.yaml on resume) stays as given
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name))
        stage_reports = []
        for i, stage in enumerate(cfg.stages):
            stage_reports.append(run_stage(stage, folder.stage_dir(i, stage.family), seed=cfg.train.seed,
                                            resume=bool(cfg.train.resume)))
        if cfg.train.resume and folder.report_file.is_file() and not any(
                p.relative_to(folder.path).parts[0] != "stages" for p in folder.path.glob("*/**/last.ckpt")):
            # a finished experiment keeps no arm checkpoints (RunFolder.prune_checkpoints): its stages are
            # reused, its arms train again from their seeds
            import shutil

            print("[domainfm] the experiment had finished and kept no arm checkpoints: its arms train again from "
                  "their seeds", file=sys.stderr, flush=True)
            for sub in folder.path.iterdir():
                if sub.is_dir() and sub.name != "stages":
                    shutil.rmtree(sub)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=False))
        task = self.data(cfg)
        adapt = cfg.adapt
        report: dict[str, Any] = {
            "family": self.name, "kind": "finetune", "task": task.task, "model": cfg.model.name,
            "labels": task.labels, "data": task.info,
            "adapt": {"mode": adapt.mode, "seeds": list(adapt.seeds)},
            "monitor": self.monitor(cfg, task)[0],
        }
        if choice is not None:
            report["model_choice"] = choice
        baselines = self.baselines(cfg, task) if self.baselines is not None else None
        if baselines:
            report["baselines"] = baselines
        if adapt.robust:
            report["adapt"].update(sample_weighting=adapt.sample_weighting, interpolation=adapt.interpolation)
            if adapt.sample_weighting == "flow":
                report["adapt"].update(flow_temperature=adapt.flow_temperature, flow_head_epochs=adapt.flow_head_epochs)
            if "wise" in adapt.interpolations:
                report["adapt"]["wise_alpha"] = list(adapt.wise_alpha)
            if "dawin" in adapt.interpolations:
                report["adapt"]["dawin_components"] = adapt.dawin_components
            report["adapt"]["probe_epochs"] = adapt.probe_epochs
        if stage_reports:
            report["stages"] = [{k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))} for r in stage_reports]
        arms: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        wise_curve: dict[str, list[dict[str, Any]]] = {}
        cache: dict = {}
        for arm in cfg.arms:
            reason = self.robust_skip_reason(cfg, arm, stage_reports, task) if adapt.robust else None
            if reason is not None:
                skipped[arm] = reason
            eligible = adapt.robust and reason is None
            variants = [(arm, False)]
            if eligible and adapt.sample_weighting == "flow":
                variants.append((f"{arm}+flow", True))
            for name, flow in variants:
                runs, derived_runs = [], {}
                for k, offset in enumerate(adapt.seeds):
                    arm_dir = folder.arm_dir(name, offset if len(adapt.seeds) > 1 else None)
                    result = self._run_arm(cfg, arm, cfg.train.seed + offset, task, arm_dir, stage_reports,
                                           save=k == 0, flow=flow, robust=eligible, cache=cache, name=name)
                    for dname, dres in result.pop("_derived", {}).items():
                        derived_runs.setdefault(dname, []).append(dres)
                    runs.append(result)
                    if k == 0 and len(adapt.seeds) > 1:  # the first repeat's model is the arm's model
                        import shutil

                        for sub in ("model", "adapter"):
                            if (arm_dir / sub).is_dir():
                                shutil.move(str(arm_dir / sub), str(folder.arm_dir(name) / sub))
                                runs[0][f"{sub}_dir"] = str(folder.arm_dir(name) / sub)
                arms[name] = aggregate_seeds(runs)
                for dname, dres in derived_runs.items():
                    arms[dname] = aggregate_seeds(dres) if "skipped" not in dres[0] else dres[0]
                curve = [dict(alpha=arms[d]["alpha"], **{s: arms[d][s] for s in ("val", "test", "retained", "val_std",
                                                                                   "test_std", "retained_std")
                                                         if s in arms[d]})
                         for d in derived_runs if arms[d].get("method") == "wise" and "skipped" not in arms[d]]
                if curve:
                    wise_curve[name] = curve
        first = next(iter(arms.values()))
        report["params"] = first.get("params", {})
        report["arms"] = arms
        if adapt.robust:
            report["robust"] = {"skipped_arms": skipped} if skipped else {}
        if wise_curve:
            report["wise_curve"] = wise_curve
        if self.retained is not None:
            source = arms.get("pretrained") or first
            report["retained_capability"] = {"metric": self.retained.metric, "direction": self.retained.direction,
                                             "description": self.retained.description}
            report["retained_before"] = source.get("retained_before", {})
        report.update(pictures.run_pictures(report, folder.path))
        if self.retained is not None:
            picture = self._tradeoff_picture(report, folder.path)
            if picture is not None:
                report.setdefault("pictures", {})["tradeoff"] = picture
        report["wall_time_s"] = round(time.perf_counter() - start, 2)
        self._model_cards(cfg, report, folder)
        return report

    def _model_cards(self, cfg, report: dict[str, Any], folder: RunFolder) -> None:
        """Each saved arm's model card (``RUN/<arm>/model/README.md``) gets the run's metrics for
        that arm, so that the folder can be uploaded to the Hub as it is (``hf upload``); beside
        it the run's record (config and report), so that the folder applies as it was trained
        wherever it is copied."""
        from domainfm import create_model
        from domainfm.experiment.apply import write_run_record
        from domainfm.hub import write_model_card

        for arm in report.get("arms", {}):
            model_dir = folder.model_dir(arm)
            if (model_dir / "config.json").is_file():
                write_model_card(model_dir, create_model(model_dir), report, arm=arm)
                write_run_record(model_dir, family=self.name, config=cfg, report=report)

    def evaluate(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Score every arm's saved model (``RUN/<arm>/model``) on validation and test again and
        compare with the report (``max_abs_diff_val``). Interpolated arms (``+wise@``, ``+dawin``)
        have no saved model: they are listed with the reason, not re-scored."""
        from domainfm import create_model

        folder = RunFolder(run_dir)
        report = folder.read_report()
        task = self.data(cfg)
        out: dict[str, Any] = {"family": self.name, "arms": {}}
        if report.get("baselines"):  # the same baseline columns beside the re-scored arms
            out["baselines"] = report["baselines"]
        worst = 0.0
        for arm, recorded in report["arms"].items():
            if "derived_from" in recorded:
                out["arms"][arm] = {"skipped": f"derived from {recorded['derived_from']!r} by {recorded.get('method')} "
                                               "interpolation, not saved: `domainfm finetune` recomputes it"}
                continue
            model_dir = folder.model_dir(arm)
            if not model_dir.is_dir():
                raise RunFolderError(f"{model_dir}: no saved model for arm {arm!r}")
            model = create_model(model_dir).eval()
            recipe = self.build_recipe(cfg, model, task)
            recipe.model = model
            trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
            arm_out: dict[str, Any] = {}
            if task.val is not None:
                arm_out["val"] = trainer.evaluate(recipe, task.val, model=model)
            if task.test is not None:
                arm_out["test"] = trainer.evaluate(recipe, task.test, model=model)
            first_seed = recorded["seeds"][0] if "seeds" in recorded else recorded
            for key, value in arm_out.get("val", {}).items():
                if key in first_seed.get("val", {}):
                    worst = max(worst, abs(value - first_seed["val"][key]))
            out["arms"][arm] = arm_out
        out["max_abs_diff_val"] = worst
        return out
