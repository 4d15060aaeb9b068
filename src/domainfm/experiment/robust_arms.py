"""The robust fine-tuning arms of an experiment (FLOW sample weighting, WiSE-FT / DaWin
interpolation): when they apply, their setup, the arms derived from a fine-tuned one, and the
trade-off picture; mixed into :class:`~domainfm.experiment.family.Family`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm.engine import Recipe, Trainer
from domainfm.experiment.task import TaskData
from domainfm.experiment.arm import ArmContext
from domainfm.experiment.weights import InitInfo

__all__ = ["RobustArms"]


class RobustArms:
    """The robust methods of :class:`~domainfm.experiment.family.Family`."""

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
