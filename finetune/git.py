"""GIT adaptation on the experiment layer: fine-tuning (full / LoRA / linear probe), few-shot,
in-context, zero-shot and specialisation (SFT), for node, edge (relation classification), link
prediction and graph classification.

``domainfm finetune git`` (configs/git/finetune.yaml) runs offline on the shipped graphs: a short
pretraining stage of ``git-small`` on Karate (nodes), Nations (edges) and MUTAG (graphs), then on
MUTAG in-context and fine-tuned results of the pretrained encoder next to the same recipe from
random initialisation (the arms ``pretrained`` and ``random``).

Task embeddings follow the official fine-tuning code: node ``pooling_lin(z[v])``, edge
``pooling_lin((z[u] + z[v]) / 2)``, graph ``pooling_lin(mean_pool(z))``, computed on task-trees
without virtual roots (fan-out 10 for node training batches, 30 for edges, every neighbour for
evaluation) or on whole graphs. In-context: prototypes are the means of the L2-normalised
support embeddings, logits ``-(2 - 2 cos(query, prototype))``; n-way k-shot episodes draw the
support from the training split and the queries from the test split. Zero-shot: the prototypes
are the class-description text embeddings (needs ``hidden_channels == in_channels``), usually
after specialisation: MSE between ``pooling_lin(root)`` and the true class's text embedding.
In-context, zero-shot and SFT look at each arm's encoder before fine-tuning. Link prediction
(``data.task: link``) holds out edges against random non-edges and scores
``pooling_lin(z[u]) . pooling_lin(z[v]) / sqrt(hidden)``. Few-shot fine-tuning:
``data.few_shot_k``. Metrics: accuracy for node and edge tasks, ROC-AUC for (binary) graph
classification and link prediction (the selection metric unless ``train.monitor`` is set).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from domainfm.data_loaders import graph as G
from domainfm.engine import TrainConfig, Trainer
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, StageSection, TaskData
from domainfm.finetune.in_context import SFTRecipe, in_context, zero_shot
from domainfm.finetune.supervised import LoraSettings
from domainfm.models.git.tasks import TaskCollate, TaskItems, is_link, link_forward, task_forward

__all__ = ["Config", "DataSection", "ProtocolSection", "FAMILY", "run", "evaluate", "load_task_dataset", "build_task",
           "in_context_protocol"]


@dataclass
class DataSection:
    dataset: str = "mutag"  # karate (node) | nations (edge) | mutag (graph) | a .npz graph file
    task: str = "auto"  # auto: the dataset's own task; link: link prediction on its graph
    text_encoder: str = "minilm"
    seed: int = 0
    train_fanout: int | None = None  # null: 10 for node tasks, 30 for edge tasks (official loaders)
    eval_fanout: int = -1  # -1: every neighbour
    use_edge_attr: bool = False
    min_relation_count: int = 1  # Nations: drop relations with fewer training triples
    few_shot_k: int | None = None  # fine-tune on k training tasks per class (few-shot) instead of all


@dataclass
class ProtocolSection:
    """Protocols on each arm's encoder before fine-tuning."""

    in_context: bool = True
    zero_shot: bool = False
    sft: bool = False  # specialise (SFT) before zero-shot
    n_way: int = 5
    k_shot: int = 3
    n_query: int = 3
    n_episodes: int = 20
    sft_steps: int = 50
    sft_lr: float = 1e-4


@dataclass
class Config(ExperimentConfig):
    model: ModelSection = field(default_factory=lambda: ModelSection(name="git-small"))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(lora=LoraSettings(
        targets=["layers.*.lin_l", "layers.*.lin_r", "pooling_lin"], rank=8, alpha=16.0)))
    stages: list[StageSection] = field(default_factory=list)
    data: DataSection = field(default_factory=DataSection)
    protocols: ProtocolSection = field(default_factory=ProtocolSection)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=30, batch_size=32, lr=1e-4, weight_decay=1e-6, progress=False, early_stopping_patience=10,
        monitor="val/roc_auc", monitor_mode="max", drop_last=False))


# --------------------------------------------------------------------------- tasks


def _recipe_task(ds: G.GraphDataset) -> tuple[str, int, str]:
    """(SupervisedRecipe task, head outputs, selection metric) of a dataset."""
    if is_link(ds):
        return "binary", 0, "roc_auc"  # scored by the dot product of pooled endpoints, no head
    if ds.task == "graph" and ds.num_classes == 2:
        return "binary", 1, "roc_auc"
    return "multiclass", ds.num_classes, "accuracy"


def load_task_dataset(data: DataSection) -> G.GraphDataset:
    """The dataset (and task) a fine-tune config names."""
    if data.task not in ("auto", "link"):
        raise ValueError(f"data.task={data.task!r}: expected 'auto' or 'link'")
    encoder = G.text_encoder(data.text_encoder)
    if data.dataset == "nations":
        ds = G.load_nations(encoder, min_count=data.min_relation_count)
    else:
        ds = G.load_dataset(data.dataset, encoder, seed=data.seed)
    if data.task == "link":
        ds = G.link_prediction_split(ds, seed=data.seed, encoder=encoder)
    return ds


# --------------------------------------------------------------------------- declaration


def build_task(cfg: Config) -> TaskData:
    from domainfm import zoo

    ds = load_task_dataset(cfg.data)
    print(f"GIT on {ds.name}: {ds.task} task, {ds.num_classes} classes, splits "
          + ", ".join(f"{k} {v.numel()}" for k, v in ds.splits.items()) + f"; labels {ds.labels}")
    task, n_out, metric = _recipe_task(ds)
    train_pos = ds.splits["train"]
    if cfg.data.few_shot_k is not None:
        g = torch.Generator().manual_seed(cfg.data.seed)
        train_pos = torch.cat([p[torch.randperm(p.numel(), generator=g)[:cfg.data.few_shot_k]]
                               for c in range(ds.num_classes) if (p := train_pos[ds.y[train_pos] == c]).numel()])
    num_layers = {**zoo.get_card(cfg.model.name).defaults, **cfg.model.kwargs}["num_layers"]
    collate = TaskCollate(ds, cfg.data.train_fanout or (30 if ds.task == "edge" else 10), num_layers,
                          eval_fanout=cfg.data.eval_fanout, use_edge_attr=cfg.data.use_edge_attr)
    prefix, _, rest = ds.labels.partition(":")
    labels = (ds.labels if prefix in ("recorded", "constructed", "synthetic")
              else f"recorded:{rest}" if prefix == "observed" else f"recorded: {ds.labels}")
    return TaskData(TaskItems(train_pos), TaskItems(ds.splits["val"], evaluation=True),
                    TaskItems(ds.splits["test"], evaluation=True), task=task, n_outputs=n_out, collate_fn=collate,
                    forward_fn=link_forward if is_link(ds) else task_forward, labels=labels,
                    info={"dataset": ds.name, "graph_task": ds.task, "classes": ds.num_classes, "metric": metric,
                          "text_encoder": ds.encoder, "train_tasks": int(train_pos.numel()),
                          **{f"{k}_tasks": int(v.numel()) for k, v in ds.splits.items() if k != "train"}},
                    extras={"dataset": ds})


def in_context_protocol(ctx: ArmContext) -> dict[str, Any]:
    p, ds = ctx.cfg.protocols, ctx.task.extras["dataset"]
    out: dict[str, Any] = {}
    if p.in_context:
        out["in_context"] = in_context(ctx.model, ds, n_way=p.n_way, k_shot=p.k_shot, n_query=p.n_query,
                                       n_episodes=p.n_episodes, seed=ctx.cfg.data.seed, fanout=ctx.cfg.data.eval_fanout)
    if p.zero_shot or p.sft:
        model = ctx.model
        if p.sft:
            model = copy.deepcopy(ctx.model).train()
            sft_cfg = TrainConfig(max_steps=p.sft_steps, batch_size=ctx.cfg.train.batch_size, lr=p.sft_lr,
                                  progress=False, weight_decay=0.0, seed=ctx.seed, accelerator=ctx.cfg.train.accelerator,
                                  drop_last=False, log_every_steps=max(1, p.sft_steps // 5), head_patterns=[])
            with torch.enable_grad():
                Trainer(sft_cfg, run_dir=ctx.run_dir / "sft").fit(SFTRecipe(model, ds, ctx.task.collate_fn))
            model.eval()
        out["zero_shot_sft" if p.sft else "zero_shot"] = zero_shot(model, ds, fanout=ctx.cfg.data.eval_fanout)
    return out


FAMILY = Family(
    name="git",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"in_channels": task.extras["dataset"].num_features, "n_outputs": task.n_outputs},
    # link prediction scores pooled endpoints: pooling_lin is its head
    head=lambda cfg, task: "head" if task.n_outputs else "pooling_lin",
    selection=lambda cfg, task: (task.info["metric"], "max"),
    protocols_before=[in_context_protocol],
)
run, evaluate = FAMILY.run, FAMILY.evaluate
