"""Supervised fine-tuning shared by every family: task losses, metric sets, and the three
adaptation modes (full, LoRA, linear probe).

A family's fine-tune entry builds its model and datasets, calls :func:`prepare_mode`, and hands
a :class:`SupervisedRecipe` to :class:`domainfm.engine.Trainer`. Datasets yield ``(x, y)``
pairs (``x`` may be a tuple or dict passed to ``forward_fn``).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from domainfm.engine import Recipe
from domainfm.lora.settings import LoraSettings
from domainfm.experiment import metrics as M

__all__ = ["LoraSettings", "SupervisedRecipe", "prepare_mode", "selection_rule", "MODES"]

MODES = ("full", "lora", "linear_probe")


def selection_rule(task: str) -> tuple[str, str]:
    """(metric, "max"|"min") used to pick the best epoch for a task type."""
    return M.SELECTION[task]


def prepare_mode(model: nn.Module, mode: str, *, head: str | list[str] = "head", lora: LoraSettings | None = None) -> nn.Module:
    """Set which parameters train.

    - ``full``: everything.
    - ``lora``: adapters from ``lora`` (targets/preset) plus the head (always trained in full).
    - ``linear_probe``: only the head; the backbone is frozen.
    """
    heads = [head] if isinstance(head, str) else list(head)
    # only heads that exist as parameters (a model with tied output embeddings has none)
    names = [n for n, _ in model.named_parameters()]
    heads = [h for h in heads if any(n == h or n.startswith(h + ".") for n in names)]
    head_patterns = [f"{h}.*" for h in heads]
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    _keep_frozen_in_eval(model, None)
    if mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if mode == "lora":
        from domainfm import lora as L

        settings = lora or LoraSettings()
        if not settings.targets and settings.preset is None:
            raise ValueError("mode=lora needs lora.targets (module name patterns) or lora.preset")
        L.apply(model, **settings.apply_kwargs(model, extra_unfreeze=head_patterns))
        return model
    for name, p in model.named_parameters():
        p.requires_grad_(any(name == h or name.startswith(h + ".") for h in heads))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"linear_probe: no parameter found under head {heads}")
    _keep_frozen_in_eval(model, heads)
    return model


def _train_keeping_frozen_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    type(self).train(self, mode)
    if mode:
        frozen = self._domainfm_frozen_eval
        for name, module in self.named_modules():
            if name in frozen:
                module.training = False
    return self


def _keep_frozen_in_eval(model: nn.Module, heads: list[str] | None) -> None:
    """A linear probe's backbone is frozen including its statistics: its modules stay in eval mode
    when the trainer calls ``model.train()`` (BatchNorm keeps its running statistics, dropout is
    off, so the probe learns on the features the frozen model gives at inference), while the head
    trains as usual. ``heads=None`` removes the rule (full fine-tuning, LoRA). The rule is an
    instance override of ``train``, so a deep copy keeps it, bound to the copy."""
    if heads is None:
        model.__dict__.pop("train", None)
        model.__dict__.pop("_domainfm_frozen_eval", None)
        return

    def in_head(name: str) -> bool:
        return any(name == h or name.startswith(h + ".") for h in heads)

    model._domainfm_frozen_eval = frozenset(
        name for name, module in model.named_modules()
        if name and not in_head(name) and not any(p.requires_grad for p in module.parameters()))
    model.train = types.MethodType(_train_keeping_frozen_eval, model)
    model.train(model.training)


class SupervisedRecipe(Recipe):
    """Classification (multiclass/binary) or regression on ``(x, y)`` batches.

    Args:
        model: returns logits (B, K) for multiclass, (B,) or (B, 1) for binary/regression.
        task: ``"multiclass"``, ``"binary"`` or ``"regression"``.
        label_smoothing: for multiclass cross-entropy (CBraMod uses 0.1).
        forward_fn: ``fn(model, x) -> output``; default ``model(x)``.
    """

    def __init__(self, model: nn.Module, train_dataset, val_dataset=None, *, task: str = "multiclass",
                 label_smoothing: float = 0.0, forward_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
                 collate_fn: Callable | None = None):
        if task not in M.TASKS:
            raise ValueError(f"task={task!r}: expected one of {M.TASKS}")
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.task, self.label_smoothing = task, label_smoothing
        self.forward_fn = forward_fn or (lambda m, x: m(x))
        self.collate_fn = collate_fn

    def _loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.task == "multiclass":
            return F.cross_entropy(out.float(), y.long(), label_smoothing=self.label_smoothing, reduction=reduction)
        out = out.float().reshape(-1)
        if self.task == "binary":
            return F.binary_cross_entropy_with_logits(out, y.float().reshape(-1), reduction=reduction)
        return F.mse_loss(out, y.float().reshape(-1), reduction=reduction)

    def step(self, model, batch):
        x, y = batch
        loss = self._loss(self.forward_fn(model, x), y)
        return loss, {"loss": loss.detach()}

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """The training loss of each sample of a training batch, unreduced: ``(B,)``; its mean is
        :meth:`step`'s loss. FLOW (``adapt.sample_weighting=flow``) weights these."""
        x, y = batch
        return self._loss(self.forward_fn(model, x), y, reduction="none").reshape(len(y))

    def logits(self, model, batch) -> torch.Tensor:
        """The model's class logits for an evaluation batch: ``(B, K)`` (multiclass) or ``(B,)``
        (binary, one logit); what DaWin's entropies are computed from."""
        x, y = batch
        out = self.forward_fn(model, x).float()
        return out if self.task == "multiclass" else out.reshape(len(y))

    def eval_step(self, model, batch):
        x, y = batch
        raw = self.forward_fn(model, x).float()
        loss = self._loss(raw, y).reshape(1).expand(len(y))  # per-sample copy: gathers like the scores
        if self.task == "binary":
            scores = torch.sigmoid(raw.reshape(-1))
        elif self.task == "regression":
            scores = raw.reshape(-1)
        else:
            scores = raw
        return {"scores": scores, "target": y, "loss": loss}

    def metrics(self, outputs):
        result = M.compute(self.task, outputs["target"], outputs["scores"])
        result["loss"] = float(outputs["loss"].mean())
        return result
