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

import numpy as np
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
    from domainfm.launch import config_file, family_entry

    module = family_entry(stage.kind, stage.family)
    path = config_file(stage.family, stage.kind, stage.config)
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

    def robust_skip_reason(self, cfg, arm: str, stage_reports: list[dict[str, Any]], task: TaskData) -> str | None:
        """Why FLOW / WiSE / DaWin do not apply to ``arm`` (``None`` when they do): they need an arm
        that starts from pretrained weights and trains its backbone on the task's training data."""
        init_kind, _, arm_mode = arm.partition(":")
        mode = arm_mode or cfg.adapt.mode
        if init_kind == "random":
            return "starts from random weights: there is no pretrained model to keep"
        if self._arm_source(cfg, init_kind, stage_reports) is None:
            return "no pretrained weights (model.pretrained is null and there is no stage)"
        if mode in ("none", "linear_probe"):
            return f"adapt.mode={mode} does not fine-tune the backbone"
        if task.train is None:
            return "the task has no training data: nothing is fine-tuned"
        return None

    def _probe_applies(self, cfg, task: TaskData, model: nn.Module) -> bool:
        """A task with a trained head (classifier, regression) gets its pretrained-side head from a
        linear probe on the frozen backbone; a model whose pretrained output already is the task's
        (forecasting, in-context) is used as it is."""
        if task.n_outputs is None or task.train is None:
            return False
        heads = self._head_names(cfg, task)
        heads = [heads] if isinstance(heads, str) else list(heads)
        names = [n for n, _ in model.named_parameters()]
        return any(n == h or n.startswith(h + ".") for h in heads for n in names)

    def _linear_probe(self, cfg, model: nn.Module, task: TaskData, seed: int, run_dir: Path) -> dict[str, torch.Tensor]:
        """Train a linear probe on a copy of the frozen pretrained ``model`` with the family's own
        recipe and ``adapt.probe_epochs`` epochs (best epoch by the arm's selection rule); returns
        the copy's state (backbone unchanged, head = the probe)."""
        import copy

        from domainfm.experiment.supervised import prepare_mode

        probe = copy.deepcopy(model)
        prepare_mode(probe, "linear_probe", head=self._head_names(cfg, task))
        if self.prepare is not None:
            self.prepare(cfg, probe, "linear_probe")
        recipe = self.build_recipe(cfg, probe, task)
        monitor, direction = self.monitor(cfg, task)
        train_cfg = dataclasses.replace(cfg.train, seed=seed, max_epochs=cfg.adapt.probe_epochs, max_steps=None,
                                        monitor=monitor, monitor_mode=direction, early_stopping_patience=None,
                                        progress=False)
        fit = Trainer(train_cfg, run_dir=run_dir).fit(recipe)
        return {k: v.detach().cpu().clone() for k, v in fit.model.state_dict().items()}

    def _robust_setup(self, cfg, arm: str, seed: int, model: nn.Module, task: TaskData, arm_dir: Path,
                      flow: bool, cache: dict) -> dict[str, Any]:
        """Before adaptation: the pretrained side (state with the probe head), and FLOW's weights."""
        out: dict[str, Any] = {}
        key = (arm, seed)
        if key not in cache:
            entry: dict[str, Any] = {}
            if self._probe_applies(cfg, task, model):
                entry["state"] = self._linear_probe(cfg, model, task, seed, arm_dir / "probe")
                entry["probe"] = True
            else:
                entry["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                entry["probe"] = False
            cache[key] = entry
        entry = cache[key]
        out["pretrained_state"] = entry["state"]
        out["probe"] = entry["probe"]
        if flow:
            if "weights" not in entry:
                ref = model
                if entry["probe"]:
                    import copy

                    ref = copy.deepcopy(model)
                    ref.load_state_dict(entry["state"])
                ref.eval()
                recipe = self.build_recipe(cfg, ref, task)
                trainer = Trainer(dataclasses.replace(cfg.train, progress=False, seed=seed), run_dir=None)
                from domainfm.experiment import robust

                losses = robust.per_sample_losses(trainer, recipe, task.train, ref.to(trainer.fabric.device), self.name)
                weights = robust.flow_weights(losses, cfg.adapt.flow_temperature)
                entry["weights"] = weights
                entry["flow"] = {"temperature": cfg.adapt.flow_temperature if cfg.adapt.flow_temperature is not None
                                 else float(np.median(losses.double().numpy())),
                                 "temperature_rule": "given" if cfg.adapt.flow_temperature is not None else "median",
                                 "pretrained_loss": "linear probe on the frozen pretrained backbone" if entry["probe"]
                                 else "the pretrained model as it is",
                                 "pretrained_loss_mean": float(losses.mean()), "weight_mean": float(weights.mean()),
                                 "weight_min": float(weights.min()), "weight_max": float(weights.max())}
            out["weights"], out["flow"] = entry["weights"], entry["flow"]
        return out

    def _derived_arms(self, cfg, name: str, seed: int, model: nn.Module, task: TaskData, arm_dir: Path,
                      init: InitInfo, mode: str, setup: dict[str, Any], trainer: Trainer, recipe: Recipe) -> dict[str, Any]:
        """The arms interpolated from the fine-tuned ``model`` (before any LoRA merge) and the
        pretrained side: ``<name>+wise@<alpha>`` and ``<name>+dawin``. Each is scored on val/test
        with the arm's recipe and measured with the retained capability; the model is left at its
        fine-tuned weights."""
        from domainfm.experiment import robust
        from domainfm.lora.inject import base_parameters, wrappers

        methods = cfg.adapt.interpolations
        if not methods:
            return {}
        derived: dict[str, Any] = {}
        pre = setup["pretrained_state"]
        try:
            if wrappers(model):
                # the pretrained side of what trained in full beside the adapters (head, lora.unfreeze);
                # the base weights inside the wrappers never changed
                adapter_ids = {id(p) for w in wrappers(model).values() for _, p in w.adapter_named_parameters()}
                base_names = {id(p): n for n, p, _ in base_parameters(model)}
                trained = {n: p for n, p in model.named_parameters() if n in setup["trained"] and id(p) not in adapter_ids}
                pre_params = {}
                for n, p in trained.items():
                    src = base_names.get(id(p), n)
                    if src not in pre:
                        raise KeyError(f"parameter {src!r} has no pretrained value")
                    pre_params[n] = pre[src].to(p.device, p.dtype)
                interp = robust.LoraInterpolator(model, pre_params)
            else:
                interp = robust.StateInterpolator(model, pre)
        except (ValueError, KeyError) as exc:
            reason = f"not applicable: {exc}"
            return {f"{name}+{m}": {"derived_from": name, "method": m, "skipped": reason} for m in methods}

        def score(alpha_model: nn.Module, out: dict[str, Any]) -> dict[str, Any]:
            alpha_model.eval()
            if task.val is not None:
                out["val"] = trainer.evaluate(recipe, task.val, model=alpha_model)
            if task.test is not None:
                out["test"] = trainer.evaluate(recipe, task.test, model=alpha_model)
            return out

        def retained(alpha_model: nn.Module, arm_name: str) -> dict[str, Any] | None:
            if self.retained is None:
                return None
            ctx = ArmContext(cfg, arm_name, seed, alpha_model, task, arm_dir, init, mode, trainer=trainer, recipe=recipe)
            return self.retained(ctx)

        base_info = {"derived_from": name, "init": str(init), "mode": mode, "seed": seed,
                     "pretrained_side": "linear-probe head on the pretrained backbone" if setup["probe"]
                     else "the pretrained model"}
        try:
            if "wise" in methods:
                for alpha in cfg.adapt.wise_alpha:
                    arm_name = f"{name}+wise@{alpha:g}"
                    m = interp.set(alpha)
                    out = score(m, {**base_info, "method": "wise", "alpha": alpha})
                    r = retained(m, arm_name)
                    if r is not None:
                        out["retained"] = r
                    derived[arm_name] = out
                interp.restore()
            if "dawin" in methods:
                arm_name = f"{name}+dawin"
                reason = None
                if task.task not in ("multiclass", "binary"):
                    reason = (f"not applicable: task {task.task!r} has no class logits (DaWin weighs two models by the "
                              "entropy of their class predictions)")
                elif not callable(getattr(recipe, "logits", None)):
                    reason = (f"not applicable: family {self.name!r} recipe {type(recipe).__name__} has no "
                              "logits(model, batch) -> Tensor[B, K] (or Tensor[B] for one binary logit)")
                if reason is not None:
                    derived[arm_name] = {"derived_from": name, "method": "dawin", "skipped": reason}
                else:
                    out = {**base_info, "method": "dawin", "dawin": {}}
                    lam_means = []
                    for split, ds in (("val", task.val), ("test", task.test)):
                        if ds is None:
                            continue
                        res = robust.dawin_scores(trainer, recipe, ds, interp, components=cfg.adapt.dawin_components,
                                                  seed=seed)
                        out[split] = res["metrics"]
                        out["dawin"][split] = {"lambda_mean": res["lambda_mean"], **res["mixture"]}
                        lam_means.append(res["lambda_mean"])
                    if self.retained is not None and lam_means:
                        # the retained data has no per-sample lambda of the task: measured at the
                        # task's mean lambda (test split when there is one), one merged model
                        alpha = lam_means[-1]
                        out["retained_alpha"] = alpha
                        out["retained"] = retained(interp.set(alpha), arm_name)
                    derived[arm_name] = out
        finally:
            interp.restore()
        return derived

    # ------------------------------------------------------------------ one arm, one seed

    def _run_arm(self, cfg, arm: str, seed: int, task: TaskData, arm_dir: Path,
                 stage_reports: list[dict[str, Any]], save: bool, *, flow: bool = False, robust: bool = False,
                 cache: dict | None = None, name: str | None = None) -> dict[str, Any]:
        """One arm, one seed. ``flow``: train with FLOW's weighted loss; ``robust``: the arm is
        eligible for the robust methods (the probe, interpolations). Returns the arm's result, with
        the derived (interpolated) arms under the private key ``"_derived"``."""
        from lightning_fabric.utilities.seed import seed_everything

        from domainfm import lora, save_pretrained
        from domainfm.experiment.supervised import prepare_mode

        name = name or arm
        cache = {} if cache is None else cache
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
        ctx = ArmContext(cfg, name, seed, model, task, arm_dir, init, mode, results=result)
        if self.protocols_before:
            model.eval()
            with torch.no_grad():
                for protocol in self.protocols_before:
                    _merge(result, protocol(ctx))
        if self.retained is not None:
            result["retained_before"] = self.retained(ctx)
        setup: dict[str, Any] = {}
        if robust:
            if flow or cfg.adapt.interpolations:
                seed_everything(seed, verbose=False)
                setup = self._robust_setup(cfg, arm, seed, model, task, arm_dir, flow, cache)
                if flow:
                    result["flow"] = dict(setup["flow"])
                if setup["probe"]:
                    # LP-FT: fine-tuning starts from the probe (FLOW's official vision code loads the
                    # linear-probe checkpoint before fine-tuning; WiSE-FT starts from the zero-shot
                    # head), so alpha runs along one fine-tuning path from the pretrained side
                    model.load_state_dict(setup["pretrained_state"])
                    result["head_init"] = "linear probe on the frozen pretrained backbone (LP-FT)"
            # the plain arm and its +flow twin adapt from the same random state (LoRA init), probe or not
            seed_everything(seed, verbose=False)
        total = sum(p.numel() for p in model.parameters())
        if mode != "none":
            head = self._head_names(cfg, task)
            prepare_mode(model, mode, head=head, lora=cfg.adapt.lora)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        if self.prepare is not None:
            self.prepare(cfg, model, mode)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result["params"] = {"total": total, "trainable": trainable}
        if setup:  # what this mode trains (a head-only round later changes requires_grad)
            setup["trained"] = {n for n, p in model.named_parameters() if p.requires_grad}
        recipe = self.build_recipe(cfg, model, task)
        monitor, direction = self.monitor(cfg, task)
        train_cfg = dataclasses.replace(cfg.train, seed=seed, monitor=monitor, monitor_mode=direction)
        if mode != "none" and task.train is not None:
            if flow:
                from domainfm.experiment.robust import FlowRecipe

                fit = Trainer(train_cfg, run_dir=arm_dir).fit(FlowRecipe(recipe, setup["weights"], self.name))
                model = fit.model
                if cfg.adapt.flow_head_epochs > 0:
                    # the official vision recipe's second round: the head alone, plain loss
                    head_names = self._head_names(cfg, task)
                    head_names = [head_names] if isinstance(head_names, str) else list(head_names)
                    for n, p in model.named_parameters():
                        p.requires_grad_(any(n == h or n.startswith(h + ".") for h in head_names))
                    if any(p.requires_grad for p in model.parameters()):
                        recipe.model = model
                        head_fit = Trainer(dataclasses.replace(train_cfg, max_epochs=cfg.adapt.flow_head_epochs,
                                                               max_steps=None, early_stopping_patience=None),
                                           run_dir=arm_dir / "flow_head").fit(recipe)
                        model = head_fit.model
                        result["flow"]["head_epochs"] = cfg.adapt.flow_head_epochs
                        result["flow"]["head_best_step"] = head_fit.best_step
            else:
                fit = Trainer(train_cfg, run_dir=arm_dir).fit(recipe)
                model = fit.model
            result.update(best_step=fit.best_step, steps=fit.global_step)
        model.eval()
        recipe.model = model
        eval_trainer = Trainer(dataclasses.replace(train_cfg, progress=False), run_dir=None)
        result["precision"] = eval_trainer.precision  # what train.precision (e.g. auto) resolved to
        derived: dict[str, Any] = {}
        if setup and cfg.adapt.interpolations:
            # before the LoRA merge: with adapters, interpolation is scaling their delta
            derived = self._derived_arms(cfg, name, seed, model, task, arm_dir, init, mode, setup, eval_trainer, recipe)
        if mode == "lora":
            if save:
                lora.save_adapter(model, arm_dir / "adapter", base_model_name=cfg.model.name)
            lora.merge(model, unload=True)  # RUN/<arm>/model holds the merged weights
        model.eval()
        recipe.model = model
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
        if derived:
            result["_derived"] = derived
        return result

    # ------------------------------------------------------------------ public

    def run(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Run every stage, arm and seed of ``cfg`` into ``run_dir``; returns the nested report.

        With ``adapt.sample_weighting=flow`` every eligible arm ``A`` is followed by ``A+flow``
        (its own folder and saved model); with ``adapt.interpolation`` each eligible arm (plain and
        ``+flow``) is followed by its interpolated arms ``A+wise@<alpha>`` / ``A+dawin`` (scores and
        retained capability only; nothing saved) and ``report["wise_curve"][A]``."""
        start = time.perf_counter()
        folder = RunFolder(run_dir)
        stage_reports = []
        for i, stage in enumerate(cfg.stages):
            stage_reports.append(run_stage(stage, folder.stage_dir(i, stage.family), seed=cfg.train.seed,
                                            resume=bool(cfg.train.resume)))
        task = self.data(cfg)
        adapt = cfg.adapt
        report: dict[str, Any] = {
            "family": self.name, "kind": "finetune", "task": task.task, "model": cfg.model.name,
            "labels": task.labels, "data": task.info,
            "adapt": {"mode": adapt.mode, "seeds": list(adapt.seeds)},
            "monitor": self.monitor(cfg, task)[0],
        }
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
        self._model_cards(report, folder)
        return report

    def _model_cards(self, report: dict[str, Any], folder: RunFolder) -> None:
        """Each saved arm's model card (``RUN/<arm>/model/README.md``) gets the run's metrics for
        that arm, so that the folder can be uploaded to the Hub as it is (``hf upload``)."""
        from domainfm.hub import write_model_card

        for arm in report.get("arms", {}):
            model_dir = folder.model_dir(arm)
            if (model_dir / "config.json").is_file():
                from domainfm import create_model

                write_model_card(model_dir, create_model(model_dir), report, arm=arm)

    def _tradeoff_picture(self, report: dict[str, Any], run_dir: Path) -> str | None:
        """``RUN/tradeoff.png``: the monitored target metric (test split when there is one) against
        the retained capability, for every arm and along each WiSE curve."""
        from domainfm.experiment.robust import plot_tradeoff

        metric = report["monitor"].split("/", 1)[-1]
        retained_metric = self.retained.metric

        def point(entry: dict[str, Any]) -> tuple[Any, Any]:
            split = "test" if metric in entry.get("test", {}) else "val"
            return entry.get(split, {}).get(metric), entry.get("retained", {}).get(retained_metric)

        points = []
        for name, entry in report["arms"].items():
            if entry.get("method") == "wise" or "skipped" in entry:
                continue
            target, kept = point(entry)
            points.append({"arm": name, "target": target, "retained": kept})
        curves = {name: [{"alpha": p["alpha"], **dict(zip(("target", "retained"), point(p)))} for p in curve]
                  for name, curve in report.get("wise_curve", {}).items()}
        if not any(p["target"] is not None and p["retained"] is not None for p in points) and not curves:
            return None
        split = "test" if any(metric in e.get("test", {}) for e in report["arms"].values()) else "val"
        plot_tradeoff(points, curves, run_dir / "tradeoff.png", target=f"{split} {metric}",
                      retained=f"{retained_metric} ({'higher' if self.retained.direction == 'max' else 'lower'} is better)",
                      title=f"{self.name}: target vs retained capability",
                      retained_before=report.get("retained_before", {}).get(retained_metric))
        return "tradeoff.png"

    def evaluate(self, cfg, run_dir: str | Path) -> dict[str, Any]:
        """Score every arm's saved model (``RUN/<arm>/model``) on validation and test again and
        compare with the report (``max_abs_diff_val``). Interpolated arms (``+wise@``, ``+dawin``)
        have no saved model: they are listed with the reason, not re-scored."""
        from domainfm import create_model

        folder = RunFolder(run_dir)
        report = folder.read_report()
        task = self.data(cfg)
        out: dict[str, Any] = {"family": self.name, "arms": {}}
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
