"""GIT's protocols without fine-tuning: in-context (prototypes of few labelled support tasks),
zero-shot (prototypes are the class-description text embeddings) and specialisation (SFT) before
zero-shot.

In-context: prototypes are the means of the L2-normalised support embeddings, logits
``-(2 - 2 cos(query, prototype))``; n-way k-shot episodes draw the support from the training
split and the queries from the test split. Zero-shot needs ``hidden_channels == in_channels``.
SFT: MSE between ``pooling_lin(root)`` and the true class's text embedding.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from domainfm.data_loaders import graph as G
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import metrics as M
from domainfm.models.git.tasks import TaskCollate, TaskItems, embed_tasks, is_link, task_forward

__all__ = ["prototype_logits", "class_prototypes", "in_context", "in_context_over", "zero_shot", "SFTRecipe",
           "specialise"]


def prototype_logits(query: Tensor, prototypes: Tensor) -> Tensor:
    """``-(2 - 2 cos(query, prototype))`` for every query/prototype pair: (Q, C)."""
    return -(2 - 2 * F.normalize(query, dim=-1) @ F.normalize(prototypes, dim=-1).t())


def class_prototypes(support: Tensor, labels: Tensor, n_classes: int) -> Tensor:
    """Mean of the L2-normalised support embeddings of each class: (C, d)."""
    from torch_geometric.utils import scatter

    return scatter(F.normalize(support, dim=-1), labels, dim=0, dim_size=n_classes, reduce="mean")


def _episode_metric(task: str, logits: Tensor, y: Tensor) -> dict[str, float]:
    out = {"accuracy": M.accuracy(y, logits.argmax(-1))}
    if task in ("graph", "link") and logits.shape[1] == 2 and y.unique().numel() == 2:
        out["roc_auc"] = M.roc_auc(y, logits.softmax(-1)[:, 1])
    return out


def in_context(model: nn.Module, ds: G.GraphDataset, *, n_way: int, k_shot: int, n_query: int, n_episodes: int,
               seed: int = 0, fanout: int = -1) -> dict[str, float]:
    """n-way k-shot episodes without gradients: support from the training split, queries from the
    test split; mean (and std) of the episode metrics."""
    g = torch.Generator().manual_seed(seed)
    train, test = ds.splits["train"], ds.splits["test"]
    ok = [c for c in range(ds.num_classes)
          if (ds.y[train] == c).sum() >= k_shot and (ds.y[test] == c).sum() >= n_query]
    way = min(n_way, len(ok))
    if way < 2:
        raise G.GraphError(f"{ds.name}: in-context needs 2 classes with >= {k_shot} training and >= {n_query} test tasks")
    needed = torch.unique(torch.cat([train[torch.isin(ds.y[train], torch.tensor(ok))],
                                     test[torch.isin(ds.y[test], torch.tensor(ok))]]))
    emb = embed_tasks(model, ds, needed, fanout=fanout)
    row = {int(p): i for i, p in enumerate(needed.tolist())}
    scores: dict[str, list[float]] = {}
    for _ in range(n_episodes):
        classes = torch.tensor(ok)[torch.randperm(len(ok), generator=g)[:way]]
        s_pos, q_pos, s_y, q_y = [], [], [], []
        for new, c in enumerate(classes.tolist()):
            pool_s, pool_q = train[ds.y[train] == c], test[ds.y[test] == c]
            s_pos.append(pool_s[torch.randperm(pool_s.numel(), generator=g)[:k_shot]])
            q_pos.append(pool_q[torch.randperm(pool_q.numel(), generator=g)[:n_query]])
            s_y.append(torch.full((k_shot,), new))
            q_y.append(torch.full((n_query,), new))
        take = lambda ps: emb[[row[int(p)] for p in torch.cat(ps).tolist()]]
        logits = prototype_logits(take(q_pos), class_prototypes(take(s_pos), torch.cat(s_y), way))
        # class order is shuffled per episode: score the positive class of binary tasks
        q_true = torch.cat(q_y)
        if ds.num_classes == 2 and way == 2:
            # binary: columns back in class order, so that ROC-AUC scores the real positive class
            logits, q_true = logits[:, torch.argsort(classes)], classes[q_true]
        for k, v in _episode_metric("link" if is_link(ds) else ds.task, logits, q_true).items():
            scores.setdefault(k, []).append(v)
    out = {}
    for k, vs in scores.items():
        t = torch.tensor(vs)
        out[k] = float(t.mean())
        out[f"{k}_std"] = float(t.std()) if len(vs) > 1 else 0.0
    out["n_way"] = way
    return out


def in_context_over(model: nn.Module, graphs: Mapping[str, G.GraphDataset], *, strict: bool = False,
                    **episodes: Any) -> dict[str, Any]:
    """:func:`in_context` (with ``episodes``) on each of ``graphs``: ``{"<graph>": its results,
    "accuracy": their mean (NaN with none)}``. A graph whose feature width differs from the
    model's, or (unless ``strict``) that cannot host the episodes, is skipped and named in
    ``"skipped"``."""
    out: dict[str, Any] = {}
    scores, skipped = [], []
    for name, ds in graphs.items():
        if ds.num_features != model.in_channels:
            skipped.append(f"{name} ({ds.num_features}-d features, model {model.in_channels}-d)")
            continue
        try:
            out[name] = in_context(model, ds, **episodes)
        except G.GraphError as exc:
            if strict:
                raise
            # among the shipped graphs, e.g. Cuneiform: 30 signs, under 3 test graphs each
            skipped.append(f"{name} ({exc})")
            continue
        scores.append(out[name]["accuracy"])
    out["accuracy"] = float(np.mean(scores)) if scores else math.nan
    if skipped:
        out["skipped"] = "; ".join(skipped)
    return out


def zero_shot(model: nn.Module, ds: G.GraphDataset, *, fanout: int = -1) -> dict[str, float]:
    """Classify the test split against the class-description embeddings (no labels used)."""
    if model.hidden_channels != ds.class_emb.shape[1]:
        raise G.GraphError(f"zero-shot compares pooling_lin outputs ({model.hidden_channels}-d) with class texts "
                           f"({ds.class_emb.shape[1]}-d): needs hidden_channels == in_channels")
    test = ds.splits["test"]
    logits = prototype_logits(embed_tasks(model, ds, test, fanout=fanout), ds.class_emb)
    return _episode_metric("link" if is_link(ds) else ds.task, logits, ds.y[test])


class SFTRecipe(Recipe):
    """Specialisation: MSE between ``pooling_lin(root)`` and the true class's text embedding."""

    def __init__(self, model: nn.Module, ds: G.GraphDataset, collate: TaskCollate):
        self.model, self.train_dataset, self.collate_fn = model, TaskItems(ds.splits["train"]), collate
        self.class_emb = ds.class_emb

    def step(self, model, batch):
        inp, y = batch
        loss = F.mse_loss(task_forward(model, inp, head=False), self.class_emb.to(y.device)[y])
        return loss, {"loss": loss.detach()}


def specialise(model: nn.Module, ds: G.GraphDataset, collate: TaskCollate, *, steps: int, lr: float,
               batch_size: int, seed: int = 0, accelerator: str = "auto", run_dir: str | Path | None = None
               ) -> nn.Module:
    """A copy of ``model`` specialised (SFT, :class:`SFTRecipe`) for ``steps`` on the training
    split of ``ds``, in eval mode; ``model`` itself is not changed."""
    model = copy.deepcopy(model).train()
    cfg = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, progress=False, weight_decay=0.0, seed=seed,
                      accelerator=accelerator, drop_last=False, log_every_steps=max(1, steps // 5), head_patterns=[])
    with torch.enable_grad():
        Trainer(cfg, run_dir=run_dir).fit(SFTRecipe(model, ds, collate))
    return model.eval()
