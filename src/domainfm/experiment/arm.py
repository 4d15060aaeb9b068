"""One arm of a fine-tuning experiment: what its protocols see (:class:`ArmContext`), the retained
capability measured on it (:class:`Retained`), and its run (:class:`ArmRunner`: weights, adaptation,
training, scores, protocols, saved model)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from domainfm.engine import Recipe, Trainer
from domainfm.experiment import pictures
from domainfm.experiment.task import TaskData
from domainfm.experiment.weights import InitInfo, resolve

__all__ = ["ArmContext", "ArmRunner", "Protocol", "Retained"]


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

    @property
    def run_root(self) -> Path:
        """The experiment's folder: ``run_dir`` is ``<root>/<arm>`` or ``<root>/<arm>/seed<k>``
        (pictures are listed relative to it; in-process stages live in ``<root>/stages``)."""
        arm_dir = Path(self.run_dir)
        safe = str(self.arm).replace(":", "-")
        return next((p.parent for p in (arm_dir, *arm_dir.parents) if p.name == safe), arm_dir.parent)


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


class ArmRunner:
    """:meth:`_run_arm`, mixed into :class:`~domainfm.experiment.family.Family`."""

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
