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
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from domainfm.data_loaders import graph as G
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, StageSection, TaskData
from domainfm.finetune import metrics as M
from domainfm.finetune.supervised import LoraSettings

__all__ = ["Config", "FAMILY", "run", "evaluate", "prototype_logits", "in_context", "zero_shot", "TaskItems",
           "GraphBatchInput", "TaskCollate", "embed_tasks", "load_task_dataset", "build_task"]


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


# --------------------------------------------------------------------------- batches


class TaskItems(Dataset):
    """Positions into a dataset's labelled tasks; the collate function builds the batch. Items of
    an ``evaluation`` set are marked, so that one collate function samples training trees with the
    training fan-out and evaluation trees with the evaluation fan-out."""

    def __init__(self, positions: Tensor, evaluation: bool = False):
        self.positions, self.evaluation = positions.long(), evaluation

    def __len__(self) -> int:
        return self.positions.numel()

    def __getitem__(self, i: int) -> tuple[int, bool]:
        return int(self.positions[i]), self.evaluation


@dataclass
class GraphBatchInput:
    """Whole graphs as one disjoint union (graph tasks)."""

    x: Tensor
    edge_index: Tensor
    batch: Tensor
    edge_attr: Tensor | None = None

    def to(self, device) -> "GraphBatchInput":
        return GraphBatchInput(*(t.to(device) if t is not None else None for t in
                                 (self.x, self.edge_index, self.batch, self.edge_attr)))


class TaskCollate:
    """Builds ``(input, labels)`` for :class:`TaskItems` (or plain positions) of ``ds``: task-trees
    without virtual roots (node/edge), sampled with ``fanout`` (``eval_fanout`` for evaluation
    items), or a batch of whole graphs (graph)."""

    def __init__(self, ds: G.GraphDataset, fanout: int, num_layers: int, *, eval_fanout: int = -1,
                 use_edge_attr: bool = False):
        self.ds, self.num_layers, self.fanout, self.eval_fanout = ds, num_layers, fanout, eval_fanout
        self.edge_attr = ds.edge_attr if use_edge_attr else None

    def __call__(self, items) -> tuple[Any, Tensor]:
        items = list(items)
        evaluation = bool(items) and isinstance(items[0], tuple) and items[0][1]
        pos = torch.as_tensor([i[0] if isinstance(i, tuple) else i for i in items], dtype=torch.long)
        fanouts = [self.eval_fanout if evaluation else self.fanout] * self.num_layers
        ds, y = self.ds, self.ds.y[pos]
        if ds.task == "graph":
            x, ei, batch, attr = ds.graphs(ds.task_index[pos])
            return GraphBatchInput(x, ei, batch, attr if self.edge_attr is not None else None), y
        index = ds.task_index[..., pos]
        trees = G.build_task_trees(ds.x, None, ds.task, index, fanouts, csr=ds.csr, virtual_root=False,
                                   shared=True, edge_attr=self.edge_attr)
        return trees, y


def link_forward(model: nn.Module, inp: G.TaskTreeBatch) -> Tensor:
    """Link logits: ``pooling_lin(z[u]) . pooling_lin(z[v]) / sqrt(hidden)``.

    The official link prediction scores ``sigmoid(pooling_lin(z[u]) . pooling_lin(z[v]))``; the
    ``1/sqrt(hidden)`` scale (same ranking, so the same ROC-AUC) keeps the initial logits of a
    768-wide model out of the saturated range where BCE gradients vanish."""
    z = model.forward_features(inp.x, inp.edge_index, inp.edge_attr)
    p = model.pooling_lin(z)
    return (p.index_select(0, inp.roots[0]) * p.index_select(0, inp.roots[1])).sum(-1) / math.sqrt(p.shape[-1])


def task_forward(model: nn.Module, inp: Any, *, head: bool = True) -> Tensor:
    """Task embeddings (``head=False``) or logits of a batch built by :class:`TaskCollate`."""
    if isinstance(inp, GraphBatchInput):
        z = model.forward_features(inp.x, inp.edge_index, inp.edge_attr)
        emb = model.task_embedding(z, "graph", inp.batch)
    else:
        z = model.forward_features(inp.x, inp.edge_index, inp.edge_attr)
        emb = model.task_embedding(z, inp.task, inp.roots)
    return model.forward_head(emb) if head else emb


@torch.no_grad()
def embed_tasks(model: nn.Module, ds: G.GraphDataset, positions: Tensor, *, fanout: int = -1,
                batch_size: int = 256, use_edge_attr: bool = False) -> Tensor:
    """Eval-mode task embeddings (after ``pooling_lin``) of ``positions``, in chunks."""
    was = model.training
    model.eval()
    collate = TaskCollate(ds, fanout, model.num_layers, eval_fanout=fanout, use_edge_attr=use_edge_attr)
    out = [task_forward(model, collate(positions[i:i + batch_size].tolist())[0], head=False)
           for i in range(0, positions.numel(), batch_size)]
    model.train(was)
    return torch.cat(out)


# --------------------------------------------------------------------------- prototypes


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
        for k, v in _episode_metric("link" if _is_link(ds) else ds.task, logits, q_true).items():
            scores.setdefault(k, []).append(v)
    out = {}
    for k, vs in scores.items():
        t = torch.tensor(vs)
        out[k] = float(t.mean())
        out[f"{k}_std"] = float(t.std()) if len(vs) > 1 else 0.0
    out["n_way"] = way
    return out


def zero_shot(model: nn.Module, ds: G.GraphDataset, *, fanout: int = -1) -> dict[str, float]:
    """Classify the test split against the class-description embeddings (no labels used)."""
    if model.hidden_channels != ds.class_emb.shape[1]:
        raise G.GraphError(f"zero-shot compares pooling_lin outputs ({model.hidden_channels}-d) with class texts "
                           f"({ds.class_emb.shape[1]}-d): needs hidden_channels == in_channels")
    test = ds.splits["test"]
    logits = prototype_logits(embed_tasks(model, ds, test, fanout=fanout), ds.class_emb)
    return _episode_metric("link" if _is_link(ds) else ds.task, logits, ds.y[test])


class SFTRecipe(Recipe):
    """Specialisation: MSE between ``pooling_lin(root)`` and the true class's text embedding."""

    def __init__(self, model: nn.Module, ds: G.GraphDataset, collate: TaskCollate):
        self.model, self.train_dataset, self.collate_fn = model, TaskItems(ds.splits["train"]), collate
        self.class_emb = ds.class_emb

    def step(self, model, batch):
        inp, y = batch
        loss = F.mse_loss(task_forward(model, inp, head=False), self.class_emb.to(y.device)[y])
        return loss, {"loss": loss.detach()}


# --------------------------------------------------------------------------- tasks


def _is_link(ds: G.GraphDataset) -> bool:
    return ds.name.endswith("-link")


def _recipe_task(ds: G.GraphDataset) -> tuple[str, int, str]:
    """(SupervisedRecipe task, head outputs, selection metric) of a dataset."""
    if _is_link(ds):
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
                    forward_fn=link_forward if _is_link(ds) else task_forward, labels=labels,
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
