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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from domainfm.engine import Recipe, Trainer
from domainfm.experiment import pictures
from domainfm.experiment.config import ExperimentConfig, StageSection
from domainfm.experiment.report import aggregate_seeds
from domainfm.experiment.run_folder import RunFolder, RunFolderError
from domainfm.experiment.task import TaskData
from domainfm.experiment.weights import InitInfo, resolve

__all__ = ["Family", "ArmContext", "Retained", "run_stage"]


@dataclass
class ArmContext:
    """What a protocol sees: the config, the arm, its model (eval mode; adapted and at its best
    checkpoint for protocols after adaptation), the task data, the arm's folder and its init."""

    cfg: Any
    arm: str
    seed: int
    model: nn.Module
    task: TaskData
    run_dir: Path
    init: InitInfo
    mode: str
    trainer: Trainer | None = None
    recipe: Recipe | None = None
    results: dict[str, Any] = field(default_factory=dict)


Protocol = Callable[[ArmContext], dict[str, Any]]


def _merge(result: dict[str, Any], out: dict[str, Any]) -> None:
    """A protocol's results join the arm's; its ``pictures`` ({name: path}) join the arm's pictures."""
    out = dict(out)
    if "pictures" in out:
        result.setdefault("pictures", {}).update(out.pop("pictures"))
    result.update(out)


@dataclass
class Retained:
    """A family's *retained capability*: something its pretrained model can do that the
    downstream task does not train, scored on data outside the fine-tuning task. It is measured
    on every arm before adaptation (``arms[ARM]["retained_before"]``; the pretrained arm's value is
    the report's ``retained_before``) and after (``arms[ARM]["retained"]``), so that forgetting
    reads as the difference.

    Args:
        fn: ``fn(ctx) -> {metric: value}``; ``ctx.model`` is in eval mode, gradients are off.
        metric: the key of ``fn``'s output that summarises the capability (plotted against the
            target metric).
        direction: ``max`` when higher is better, ``min`` otherwise.
        description: one line saying what is measured and on which data (copied into the report).
    """

    fn: Callable[[ArmContext], dict[str, Any]]
    metric: str
    direction: str = "max"
    description: str = ""

    def __post_init__(self):
        if self.direction not in ("max", "min"):
            raise ValueError(f"Retained.direction={self.direction!r}: expected 'max' or 'min'")

    def __call__(self, ctx: ArmContext) -> dict[str, Any]:
        was_training = ctx.model.training
        ctx.model.eval()
        with torch.no_grad():
            out = dict(self.fn(ctx))
        ctx.model.train(was_training)
        if self.metric not in out:
            raise KeyError(f"retained capability returned {sorted(out)}, without its metric {self.metric!r}")
        return out


def run_stage(stage: StageSection, stage_dir: Path, *, seed: int | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``domainfm <kind> <family>`` in this process from its config file + overrides (never
    translated field by field). Returns the stage's report (with ``saved_model``)."""
    from domainfm import config as cfgmod
    from domainfm.cli import family_entry

    module = family_entry(stage.kind, stage.family)
    path = Path(stage.config)
    if path.suffix not in {".yaml", ".yml"}:
        path = cfgmod.config_path(stage.family, stage.config)
    overrides = list(stage.overrides)
    if resume and (stage_dir / "report.json").is_file():
        # a resumed experiment reuses its finished stage instead of training it again
        done = RunFolder(stage_dir).read_report()
        if Path(done.get("saved_model", "")).is_dir():
            return done
    if resume and (stage_dir / "checkpoints" / "last.ckpt").is_file():
        overrides.append("train.resume=true")  # an interrupted stage continues from its checkpoint
    raw = cfgmod.apply_overrides(cfgmod.load_yaml(path), overrides)
    stage_cfg = cfgmod.from_dict(module.Config, raw)
    folder = RunFolder.create(stage_dir, resume=resume)
    folder.write_config(stage_cfg)
    folder.write_meta(family=stage.family, kind=stage.kind, config_source=str(path), overrides=list(stage.overrides))
    if seed is not None:
        from lightning_fabric.utilities.seed import seed_everything

        seed_everything(seed, verbose=False)
    print(f"[domainfm] stage: {stage.kind} {stage.family} ({path.name} {' '.join(stage.overrides)}) -> {stage_dir}",
          file=sys.stderr, flush=True)
    report = dict(module.run(stage_cfg, stage_dir) or {})
    folder.write_report({"family": stage.family, "kind": stage.kind, **report})
    if "saved_model" not in report:
        raise RuntimeError(f"domainfm.{stage.kind}.{stage.family}.run must return 'saved_model' (the folder written "
                           "by save_pretrained) to be used as a stage")
    return report


@dataclass
class Family:
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

    def __post_init__(self):
        if not (dataclasses.is_dataclass(self.config) and issubclass(self.config, ExperimentConfig)):
            raise TypeError(f"Family {self.name!r}: config must be a dataclass subclassing ExperimentConfig")

    # ------------------------------------------------------------------ pieces

    def build_recipe(self, cfg, model: nn.Module, task: TaskData) -> Recipe:
        if self.recipe is not None:
            return self.recipe(cfg, model, task)
        from domainfm.finetune.supervised import SupervisedRecipe

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
            from domainfm.finetune.supervised import selection_rule

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

    # ------------------------------------------------------------------ one arm, one seed

    def _run_arm(self, cfg, arm: str, seed: int, task: TaskData, arm_dir: Path,
                 stage_reports: list[dict[str, Any]], save: bool) -> dict[str, Any]:
        from lightning_fabric.utilities.seed import seed_everything

        from domainfm import lora, save_pretrained
        from domainfm.finetune.supervised import prepare_mode

        init_kind, _, arm_mode = arm.partition(":")
        mode = arm_mode or cfg.adapt.mode
        seed_everything(seed, verbose=False)  # the same seed gives the same head / random init in every arm
        source = self._arm_source(cfg, init_kind, stage_reports)
        model, init = resolve(cfg.model.spec(source, **self.model_kwargs(cfg, task)))
        if init_kind == "pretrained" and source is None:
            init = dataclasses.replace(init, reason="model.pretrained is null and there is no stage")
        elif stage_reports and init_kind != "random" and cfg.model.pretrained is None:
            started = stage_reports[-1].get("init")  # what the stage itself started from (e.g. random)
            init = dataclasses.replace(init, reason=f"{'output' if init_kind == 'pretrained' else 'start'} of the "
                                                    f"in-process {cfg.stages[-1].kind} stage"
                                                    + (f", which started from {started}" if started else ""))
        result: dict[str, Any] = {"init": str(init), "mode": mode, "seed": seed}
        ctx = ArmContext(cfg, arm, seed, model, task, arm_dir, init, mode, results=result)
        if self.protocols_before:
            model.eval()
            with torch.no_grad():
                for protocol in self.protocols_before:
                    _merge(result, protocol(ctx))
        if self.retained is not None:
            result["retained_before"] = self.retained(ctx)
        total = sum(p.numel() for p in model.parameters())
        if mode != "none":
            head = self.head(cfg, task) if callable(self.head) else self.head
            prepare_mode(model, mode, head=head, lora=cfg.adapt.lora)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        if self.prepare is not None:
            self.prepare(cfg, model, mode)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result["params"] = {"total": total, "trainable": trainable}
        recipe = self.build_recipe(cfg, model, task)
        monitor, direction = self.monitor(cfg, task)
        train_cfg = dataclasses.replace(cfg.train, seed=seed, monitor=monitor, monitor_mode=direction)
        if mode != "none" and task.train is not None:
            fit = Trainer(train_cfg, run_dir=arm_dir).fit(recipe)
            model = fit.model
            result.update(best_step=fit.best_step, steps=fit.global_step)
        if mode == "lora":
            if save:
                lora.save_adapter(model, arm_dir / "adapter", base_model_name=cfg.model.name)
            lora.merge(model, unload=True)  # RUN/<arm>/model holds the merged weights
        model.eval()
        recipe.model = model
        eval_trainer = Trainer(dataclasses.replace(train_cfg, progress=False), run_dir=None)
        # scored with the model as saved, so that `domainfm evaluate` reproduces these figures
        if task.val is not None:
            result["val"] = eval_trainer.evaluate(recipe, task.val, model=model)
        if task.test is not None:
            result["test"] = eval_trainer.evaluate(recipe, task.test, model=model)
        ctx.model, ctx.trainer, ctx.recipe = model, eval_trainer, recipe
        with torch.no_grad():
            for protocol in self.protocols:
                _merge(result, protocol(ctx))
            _merge(result, pictures.arm_pictures(ctx))
        if self.retained is not None:
            result["retained"] = self.retained(ctx)
        if save:
            result["model_dir"] = str(save_pretrained(model, arm_dir / "model"))
        return result

    # ------------------------------------------------------------------ public

    def run(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Run every stage, arm and seed of ``cfg`` into ``run_dir``; returns the nested report."""
        start = time.perf_counter()
        folder = RunFolder(run_dir)
        stage_reports = []
        for i, stage in enumerate(cfg.stages):
            stage_reports.append(run_stage(stage, folder.stage_dir(i, stage.family), seed=cfg.train.seed,
                                            resume=bool(cfg.train.resume)))
        task = self.data(cfg)
        report: dict[str, Any] = {
            "family": self.name, "kind": "finetune", "task": task.task, "model": cfg.model.name,
            "labels": task.labels, "data": task.info,
            "adapt": {"mode": cfg.adapt.mode, "seeds": list(cfg.adapt.seeds)},
            "monitor": self.monitor(cfg, task)[0],
        }
        if stage_reports:
            report["stages"] = [{k: v for k, v in r.items() if isinstance(v, (int, float, str, bool))} for r in stage_reports]
        arms: dict[str, Any] = {}
        for arm in cfg.arms:
            runs = []
            for k, offset in enumerate(cfg.adapt.seeds):
                arm_dir = folder.arm_dir(arm, offset if len(cfg.adapt.seeds) > 1 else None)
                runs.append(self._run_arm(cfg, arm, cfg.train.seed + offset, task, arm_dir, stage_reports,
                                          save=k == 0))
                if k == 0 and len(cfg.adapt.seeds) > 1:  # the first repeat's model is the arm's model
                    import shutil

                    for name in ("model", "adapter"):
                        if (arm_dir / name).is_dir():
                            shutil.move(str(arm_dir / name), str(folder.arm_dir(arm) / name))
                            runs[0][f"{name}_dir"] = str(folder.arm_dir(arm) / name)
            arms[arm] = aggregate_seeds(runs)
        first = next(iter(arms.values()))
        report["params"] = first.get("params", {})
        report["arms"] = arms
        if self.retained is not None:
            source = arms.get("pretrained") or first
            report["retained_capability"] = {"metric": self.retained.metric, "direction": self.retained.direction,
                                             "description": self.retained.description}
            report["retained_before"] = source.get("retained_before", {})
        report.update(pictures.run_pictures(report, folder.path))
        report["wall_time_s"] = round(time.perf_counter() - start, 2)
        return report

    def evaluate(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Score every arm's saved model (``RUN/<arm>/model``) on validation and test again and
        compare with the report (``max_abs_diff_val``)."""
        from domainfm import create_model

        folder = RunFolder(run_dir)
        report = folder.read_report()
        task = self.data(cfg)
        out: dict[str, Any] = {"family": self.name, "arms": {}}
        worst = 0.0
        for arm, recorded in report["arms"].items():
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

