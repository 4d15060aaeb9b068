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

Retained capability (forgetting, ``report["retained_before"]`` and ``arms[ARM]["retained"]``):
in-context accuracy of the arm's encoder on the shipped graphs it is *not* fine-tuned on (of
karate / nations / mutag, the ones other than ``data.dataset``; ``retained.datasets`` overrides),
with the same episodes before and after fine-tuning; ``accuracy`` is their mean.

Applying a model: :func:`predict` / :func:`embed` (``domainfm predict git`` / ``domainfm embed
git``, see :func:`predict_main`).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from domainfm.experiment.inference import positive_int  # argparse types
from domainfm.data_loaders import graph as G
from domainfm.engine import TrainConfig, Trainer
from domainfm.errors import InputError
from domainfm.experiment import (AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained,
                                 StageSection, TaskData)
from domainfm.models.git.in_context import SFTRecipe, in_context, zero_shot
from domainfm.lora.settings import LoraSettings
from domainfm.models.git.tasks import TaskCollate, TaskItems, is_link, link_forward, task_forward

__all__ = ["Config", "DataSection", "ProtocolSection", "RetainedSection", "FAMILY", "run", "evaluate",
           "load_task_dataset", "build_task", "in_context_protocol", "retained_in_context", "ApplySettings",
           "model_settings", "predict", "embed", "predict_main", "embed_main", "BF16_PROBABILITY_TOLERANCE",
           "BF16_EMBEDDING_TOLERANCE"]


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
class RetainedSection:
    """The retained capability: in-context episodes on shipped graphs outside the fine-tuning task.
    ``datasets``: null for every shipped graph other than ``data.dataset``. The episodes are drawn
    with ``seed`` (the same before and after fine-tuning, so the difference is paired)."""

    datasets: list[str] | None = None
    n_way: int = 5
    k_shot: int = 3
    n_query: int = 3
    n_episodes: int = 100
    seed: int = 0


@dataclass
class Config(ExperimentConfig):
    model: ModelSection = field(default_factory=lambda: ModelSection(name="git-small"))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(lora=LoraSettings(
        targets=["layers.*.lin_l", "layers.*.lin_r", "pooling_lin"], rank=8, alpha=16.0)))
    stages: list[StageSection] = field(default_factory=list)
    data: DataSection = field(default_factory=DataSection)
    protocols: ProtocolSection = field(default_factory=ProtocolSection)
    retained: RetainedSection = field(default_factory=RetainedSection)
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


def retained_in_context(ctx: ArmContext) -> dict[str, Any]:
    """In-context accuracy of ``ctx.model`` on the shipped graphs not fine-tuned on (see
    :class:`RetainedSection`): ``{"accuracy": mean over graphs, "<graph>": {in-context results}}``.
    A graph whose feature width differs from the model's is skipped and named; with none left,
    ``accuracy`` is NaN."""
    r, data = ctx.cfg.retained, ctx.cfg.data
    tuned = ctx.task.extras["dataset"].name.removesuffix("-link")
    names = list(r.datasets) if r.datasets is not None else [n for n in G.SHIPPED_DATASETS if n != tuned]
    cache = ctx.task.extras.setdefault("retained_graphs", {})
    out: dict[str, Any] = {}
    scores, skipped = [], []
    for name in names:
        if name not in cache:
            cache[name] = load_task_dataset(DataSection(dataset=name, text_encoder=data.text_encoder, seed=data.seed))
        ds = cache[name]
        if ds.num_features != ctx.model.in_channels:
            skipped.append(f"{name} ({ds.num_features}-d features, model {ctx.model.in_channels}-d)")
            continue
        try:
            res = in_context(ctx.model, ds, n_way=r.n_way, k_shot=r.k_shot, n_query=r.n_query,
                             n_episodes=r.n_episodes, seed=r.seed, fanout=data.eval_fanout)
        except G.GraphError as exc:
            if r.datasets is not None:  # a graph the user named must host the episodes
                raise
            # among the shipped graphs, e.g. Cuneiform: 30 signs, under 3 test graphs each
            skipped.append(f"{name} ({exc})")
            continue
        out[name] = res
        scores.append(res["accuracy"])
    out["accuracy"] = float(np.mean(scores)) if scores else math.nan
    if skipped:
        out["skipped"] = "; ".join(skipped)
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
    retained=Retained(retained_in_context, metric="accuracy", direction="max",
                      description="in-context accuracy (prototype episodes, no training) of the encoder on the "
                                  "shipped graphs other than the fine-tuning dataset (retained.datasets), mean "
                                  "over graphs"),
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# --------------------------------------------------------------------------- predict / embed

#: largest |p_bf16 - p_fp32| of a class probability, and largest |e_bf16 - e_fp32| / max|e_fp32| of
#: an embedding, accepted between ``--precision bf16-mixed`` (``auto`` on CPUs with native bf16)
#: and ``32-true``. Measured on the shipped graphs with git-small (384-d) fine-tuned 30 epochs
#: on each (karate nodes, nations edges, MUTAG graphs; also node tasks of nations and MUTAG):
#: probabilities differ by at most 1.6e-3 (nations, 55 classes), embeddings by at most 5.4e-3
#: of their largest entry (bf16 keeps 8 mantissa bits: ~4e-3 relative per rounding), and the
#: predicted class was the same for every task; the tolerances leave a factor of ~5-10 for
#: other graphs and weights (sharper logits move probabilities more). Pass
#: ``--precision 32-true`` (or DOMAINFM_PRECISION=32-true) to reproduce fp32 figures exactly.
BF16_PROBABILITY_TOLERANCE = 2e-2
BF16_EMBEDDING_TOLERANCE = 3e-2


@dataclass
class ApplySettings:
    """How a model is applied to a graph.

    Attributes:
        task: the graph task its head was trained for (``node``/``edge``/``graph``; None: unknown,
            the input's own task is used).
        fanout: neighbours per task-tree level (-1: every neighbour, i.e. exact full-graph
            message passing at the roots; other values sample, with ``seed``).
        use_edge_attr: feed the graph's edge features to the SAGE layers.
        text_encoder: encoder of a shipped graph's texts (``minilm`` or ``hashing``).
        class_names: one name per output class, when known.
        link: a link-prediction model (no head: p(link) = sigmoid of the pooled endpoints' scaled
            dot product, :func:`~domainfm.models.git.tasks.link_forward`).
        source: where these settings come from.
    """

    task: str | None = None
    fanout: int = -1
    use_edge_attr: bool = False
    text_encoder: str = "minilm"
    class_names: list[str] | None = None
    link: bool = False
    source: str = "defaults (no run folder: every neighbour, no edge features, MiniLM texts)"


def _run_folder_of(model: Any) -> Path | None:
    """The ``domainfm finetune git`` run folder behind ``model``: the run folder itself, or a
    ``RUN/<arm>/model`` folder inside one."""
    if isinstance(model, nn.Module):
        return None
    path = Path(model)
    if not path.is_dir():
        return None
    for run in (path, path.parent.parent):
        if (run / "config.yaml").is_file() and (run / "report.json").is_file() and not (run / "config.json").is_file():
            if run == path or path.name == "model":
                return run
    return None


def model_settings(model: Any) -> ApplySettings:
    """The settings the model was fine-tuned with when ``model`` is (inside) a GIT run folder:
    ``data.eval_fanout``, ``data.use_edge_attr``, ``data.text_encoder``, the task
    (``report.data.graph_task``; link prediction when ``data.task: link``) and the class texts of
    ``data.dataset``; otherwise :class:`ApplySettings`' defaults."""
    from domainfm import config as cfgmod
    from domainfm.experiment import RunFolderError

    run = _run_folder_of(model)
    if run is None:
        return ApplySettings()
    report = json.loads((run / "report.json").read_text())
    if report.get("family") != "git":
        raise RunFolderError(f"{run}: a {report.get('family')!r} run, not a GIT run")
    raw = cfgmod.load_yaml(run / "config.yaml")
    data = cfgmod.from_dict(DataSection, raw.get("data", {}), "data")
    link = data.task == "link"
    try:
        names = list(G.LINK_CLASS_TEXTS) if link else list(load_task_dataset(data).class_texts)
    except (G.GraphError, FileNotFoundError, KeyError, ImportError):
        names = None  # the fine-tuning data is not here any more: classes are numbered only
    return ApplySettings(task=report.get("data", {}).get("graph_task"), fanout=data.eval_fanout,
                         use_edge_attr=data.use_edge_attr, text_encoder=data.text_encoder, class_names=names,
                         link=link, source=f"run folder {run} (config.yaml data section)")


def _load(model: Any, arm: str | None, pretrained: Any) -> tuple[nn.Module, ApplySettings]:
    from domainfm.experiment.inference import load_model

    return load_model(model, arm=arm, pretrained=pretrained), model_settings(model)


def _unordered_edges(edge_index: Tensor) -> Tensor:
    pairs = torch.sort(edge_index, dim=0).values
    return torch.unique(pairs, dim=1) if pairs.numel() else pairs


def _task_view(ds: G.GraphDataset, task: str, index: Tensor | None, split: str | None, label: str) -> G.GraphDataset:
    """``ds`` with the tasks to apply the model to (module docs of :func:`predict`)."""
    n = ds.x.shape[0]
    ptr = ds.ptr if ds.ptr is not None else torch.tensor([0, n])
    n_graphs = ptr.numel() - 1
    if split is not None:
        if index is not None:
            raise ValueError("give index or split, not both")
        if split not in ds.splits:
            raise G.GraphError(f"{label}: no split {split!r} (has {sorted(ds.splits) or 'none'})")
        if ds.task != task:
            raise G.GraphError(f"{label}: its splits hold {ds.task} tasks, not {task} tasks")
        tasks = ds.task_index[..., ds.splits[split]]
    elif index is not None:
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            size = {"node": n, "graph": n_graphs}.get(task)
            if size is None or index.ndim != 1 or index.numel() != size:
                raise G.GraphError(f"{label}: a boolean mask selects nodes or graphs: expected {size} entries for "
                                   f"{task} tasks, got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        tasks = index.long()
        if task == "edge" and (tasks.ndim != 2 or tasks.shape[0] != 2):
            raise G.GraphError(f"{label}: edge tasks need node pairs of shape (2, B), got {tuple(tasks.shape)}")
        if task != "edge" and tasks.ndim != 1:
            raise G.GraphError(f"{label}: {task} tasks need ids of shape (B,), got {tuple(tasks.shape)}")
        bound = n_graphs if task == "graph" else n
        if tasks.numel() and (int(tasks.min()) < 0 or int(tasks.max()) >= bound):
            raise G.GraphError(f"{label}: {task} id {int(tasks.max()) if int(tasks.max()) >= bound else int(tasks.min())} "
                               f"is outside [0, {bound})")
    elif task == "node":
        tasks = torch.arange(n)
    elif task == "graph":
        tasks = torch.arange(n_graphs)
    elif ds.task == "edge":
        tasks = ds.task_index  # the dataset's own edge tasks (e.g. Nations' triples)
    else:
        tasks = _unordered_edges(ds.edge_index)
    b = tasks.shape[-1]
    return G.GraphDataset(name=ds.name, task=task, x=ds.x, edge_index=ds.edge_index, task_index=tasks,
                          y=torch.full((b,), -1, dtype=torch.long), splits={}, class_texts=[],
                          class_emb=ds.x.new_zeros(0, ds.num_features), labels="none", encoder=ds.encoder,
                          edge_attr=ds.edge_attr, ptr=ptr if task == "graph" else ds.ptr, _csr=ds._csr)


@dataclass
class _Applied:
    task: str
    ids: Tensor  # (B,) node/graph ids or (2, B) pairs
    embeddings: Tensor  # (B, D) float32
    logits: Tensor | None  # (B, K) float32, or (B,) for a binary / link model
    settings: ApplySettings
    precision: str
    model: nn.Module
    graph: G.GraphDataset


def _apply(graph: Any, model: Any, *, task: str | None, index: Tensor | None, split: str | None, arm: str | None,
           pretrained: Any, precision: str, device: str, batch_size: int, seed: int, head: bool,
           settings: ApplySettings | None) -> _Applied:
    from domainfm.models.git.tasks import TaskCollate, link_forward, task_forward
    from domainfm.precision import autocast

    net, found = _load(model, arm, pretrained)
    settings = settings or found
    if head and not settings.link and net.n_outputs == 0:
        # refused before the graph is read: a backbone's "logits" would be its embeddings
        what = f"model {model}" if isinstance(model, (str, Path)) else "the model"
        raise InputError(f"{what}: a GIT backbone without a classifier head (n_outputs=0); predict needs a "
                         "fine-tuned model with a head (a `domainfm finetune git` run folder or its <arm>/model); "
                         "for task embeddings use `domainfm embed git`")
    label = str(graph) if isinstance(graph, (str, Path)) else getattr(graph, "name", "the given graph")
    encoder = G.text_encoder(settings.text_encoder)
    ds = G.read_graph(graph, encoder=encoder, feature_dim=net.in_channels, seed=seed)
    task = task or settings.task or ds.task
    if task not in G.TASKS:
        raise ValueError(f"task={task!r}: expected one of {G.TASKS}")
    if settings.source.startswith("run folder") and ds.encoder not in ("unknown", encoder.name):
        print(f"warning: {label} holds {ds.encoder} features but the model was fine-tuned on {encoder.name} features",
              file=sys.stderr)
    if settings.use_edge_attr and ds.edge_attr is None:
        raise G.GraphError(f"{label}: the model uses edge features (data.use_edge_attr) but the graph has no edge_attr")
    if settings.link and task != "edge":
        raise G.GraphError(f"{label}: a link-prediction model scores node pairs: use task 'edge', not {task!r}")
    if settings.task is not None and task != settings.task:
        print(f"warning: the model was fine-tuned on {settings.task} tasks; its head now reads {task} task "
              "embeddings", file=sys.stderr)
    view = _task_view(ds, task, index, split, label)
    collate = TaskCollate(view, settings.fanout, net.num_layers, eval_fanout=settings.fanout,
                          use_edge_attr=settings.use_edge_attr)
    device_t = torch.device(device)
    net = net.to(device_t).eval()
    embs, outs = [], []
    positions = torch.arange(view.task_index.shape[-1])
    with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast(precision, device_t) as resolved:
        torch.manual_seed(seed)  # only matters when fanout samples neighbours
        for start in range(0, positions.numel(), batch_size):
            inp, _ = collate(positions[start:start + batch_size].tolist())
            inp = inp.to(device_t)
            if settings.link and head:
                outs.append(link_forward(net, inp).float().cpu())
                embs.append(torch.zeros(0))
                continue
            emb = task_forward(net, inp, head=False)
            embs.append(emb.float().cpu())
            if head:
                outs.append(net.forward_head(emb).float().cpu())
    embeddings = torch.cat(embs) if embs else torch.zeros(0, net.num_features)
    logits = (torch.cat(outs) if outs else torch.zeros(0, max(net.n_outputs, 1))) if head else None
    return _Applied(task, view.task_index, embeddings, logits, settings, resolved, net, ds)


def _id_columns(task: str, ids: Tensor) -> dict[str, np.ndarray]:
    if task == "edge":
        return {"source": ids[0].numpy(), "target": ids[1].numpy()}
    return {task: ids.numpy()}


def predict(graph: Any, model: Any, *, task: str | None = None, index: Tensor | None = None, split: str | None = None,
            arm: str | None = None, pretrained: Any = None, precision: str = "auto", device: str = "cpu",
            batch_size: int = 256, seed: int = 0, settings: ApplySettings | None = None):
    """Class predictions of a fine-tuned GIT for the node, edge or graph tasks of ``graph``.

    Args:
        graph: a ``torch.save``'d PyG ``Data`` (node tasks) or list of ``Data`` (graph tasks),
            read weights-only; a ``.npz`` graph (:func:`~domainfm.data_loaders.graph.load_graph_dir`);
            a shipped graph's name (``karate``, ``nations``, ``mutag``, encoded with the model's
            text encoder); or such objects. Node features must have the model's ``in_channels``
            width (else a :class:`~domainfm.data_loaders.graph.GraphError` naming the graph and
            both widths): features are used as they are, so encode them as the model's training
            graphs were.
        model: a registered name (with ``pretrained``: a checkpoint path, since GIT registers no
            weights), a ``save_pretrained`` folder, a GIT run folder (``arm``: default its first
            arm), or a module. From a run folder (or
            ``RUN/<arm>/model``) the fine-tuning settings are used (:func:`model_settings`: task,
            eval fan-out, edge features, text encoder, class names); otherwise every neighbour,
            no edge features, MiniLM texts, the input's own task.
        task: ``node`` | ``edge`` | ``graph`` (default: the run's task, else the input's).
        index: which tasks: (B,) node or graph ids, a boolean mask over nodes or graphs, or (2, B)
            node pairs. Default: every node; every graph; for edges, the input's own edge tasks
            when it is an edge dataset (e.g. Nations' triples, one row per relation fact), else
            every distinct unordered edge ``u <= v`` of ``edge_index`` once.
        split: instead of ``index``: the input's ``train``/``val``/``test`` tasks (a Data's
            ``*_mask``; a ``.npz``'s split arrays or its stratified split).
        precision: ``auto`` (bf16 autocast where the hardware has native bf16, e.g. this CPU;
            fp32 elsewhere), ``32-true`` or ``bf16-mixed``; under bf16 the class probabilities
            stay within :data:`BF16_PROBABILITY_TOLERANCE` of fp32 (absolute).

    Returns:
        a ``pandas.DataFrame``, one row per task: the task's id (``node`` | ``source``,
        ``target`` | ``graph``), ``class`` (the most probable class id), ``class_name`` (when
        known) and ``p_<class id>`` for every class (summing to 1). A binary head (one logit) or
        a link-prediction model gives ``p_0 = 1 - sigmoid``, ``p_1 = sigmoid``.
    """
    import pandas as pd

    out = _apply(graph, model, task=task, index=index, split=split, arm=arm, pretrained=pretrained,
                 precision=precision, device=device, batch_size=batch_size, seed=seed, head=True, settings=settings)
    logits = out.logits
    if out.settings.link or logits.ndim == 1 or logits.shape[1] == 1:
        p1 = torch.sigmoid(logits.reshape(-1))
        probs = torch.stack([1 - p1, p1], dim=1)
    else:
        probs = logits.softmax(-1)
    cls = probs.argmax(-1)
    frame = pd.DataFrame(_id_columns(out.task, out.ids))
    frame["class"] = cls.numpy()
    names = out.settings.class_names
    if names is None and out.graph.num_classes == probs.shape[1] and out.graph.labels != "none" \
            and not all(t == f"class {i}" for i, t in enumerate(out.graph.class_texts)):
        names = out.graph.class_texts  # the input's own classes, when the head has as many
    if names is not None and len(names) == probs.shape[1]:
        frame["class_name"] = [names[i] for i in cls.tolist()]
    for k in range(probs.shape[1]):
        frame[f"p_{k}"] = probs[:, k].double().numpy()
    frame.attrs.update(precision=out.precision, settings=out.settings.source, task=out.task)
    return frame


def embed(graph: Any, model: Any, *, task: str | None = None, index: Tensor | None = None, split: str | None = None,
          arm: str | None = None, pretrained: Any = None, precision: str = "auto", device: str = "cpu",
          batch_size: int = 256, seed: int = 0, settings: ApplySettings | None = None) -> dict[str, Any]:
    """Task embeddings of ``graph`` (arguments as :func:`predict`): ``pooling_lin`` of the task
    root(s), the input of the classifier head, of width ``model.num_features`` (the card's
    ``hidden_channels``). Under bf16 they stay within :data:`BF16_EMBEDDING_TOLERANCE` of fp32,
    relative to the largest fp32 entry.

    Returns ``{"task", "index": (B,) ids or (B, 2) node pairs, "embeddings": (B, D) float32,
    "precision"}`` (numpy arrays)."""
    out = _apply(graph, model, task=task, index=index, split=split, arm=arm, pretrained=pretrained,
                 precision=precision, device=device, batch_size=batch_size, seed=seed, head=False, settings=settings)
    ids = out.ids.t().contiguous() if out.task == "edge" else out.ids
    return {"task": out.task, "index": ids.numpy(), "embeddings": out.embeddings.numpy().astype(np.float32),
            "precision": out.precision}


def _apply_parser(command: str) -> argparse.ArgumentParser:
    from domainfm.experiment.inference import add_model_arguments

    what = ("a CSV: the task's id column(s), class, class_name (when known), p_<class> per class"
            if command == "predict" else "a .npz: embeddings (B, D), index, task, model, precision")
    parser = argparse.ArgumentParser(
        prog=f"domainfm {command} git",
        description=f"GIT {'predictions' if command == 'predict' else 'embeddings'} for the node, edge or graph tasks of a graph: --input is a torch.save'd PyG "
                    "Data (or list of Data), a .npz graph, or a shipped graph's name (karate, nations, mutag); "
                    f"--output is {what}.")
    add_model_arguments(parser)
    parser.add_argument("--task", choices=G.TASKS, default=None,
                        help="node | edge | graph (default: the run's task, else the input's own)")
    parser.add_argument("--index", default=None,
                        help="which tasks: a file of node/graph ids (one per line) or node pairs ('u,v' per line), "
                             "or a .npy (ids, pairs or a boolean mask); default every node / graph / edge")
    parser.add_argument("--split", default=None, help="instead of --index: the input's train|val|test tasks")
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="neighbour sampling when the fan-out is not -1")
    return parser


def _cli_kwargs(args) -> dict[str, Any]:
    index = None
    if args.index is not None:
        task = args.task or model_settings(args.model).task  # unknown: the file says (pairs are edges)
        index = G.read_ids(args.index, columns=None if task is None else 2 if task == "edge" else 1)
    return dict(task=args.task, index=index, split=args.split, arm=args.arm, pretrained=args.pretrained,
                precision=args.precision, device=args.device, batch_size=args.batch_size, seed=args.seed)


def predict_main(argv: Sequence[str]) -> int:
    """``domainfm predict git --model RUN_OR_MODEL --input GRAPH --output out.csv [--task ...]``."""
    from domainfm.atomic import atomic_path

    args = _apply_parser("predict").parse_args(list(argv))
    frame = predict(args.input, args.model, **_cli_kwargs(args))
    with atomic_path(args.output) as tmp:
        frame.to_csv(tmp, index=False, float_format="%.8g")
    n_classes = sum(c.startswith("p_") for c in frame.columns)
    print(f"wrote {len(frame)} {frame.attrs['task']} predictions ({n_classes} classes) to {args.output} "
          f"[precision {frame.attrs['precision']}; settings: {frame.attrs['settings']}]")
    return 0


def embed_main(argv: Sequence[str]) -> int:
    """``domainfm embed git --model RUN_OR_MODEL --input GRAPH --output emb.npz [--task ...]``."""
    from domainfm.atomic import atomic_path

    args = _apply_parser("embed").parse_args(list(argv))
    out = embed(args.input, args.model, **_cli_kwargs(args))
    with atomic_path(args.output, suffix=".npz") as tmp:
        np.savez(tmp, embeddings=out["embeddings"], index=out["index"], task=np.array(out["task"]),
                 model=np.array(str(args.model)), precision=np.array(out["precision"]))
    print(f"wrote {out['embeddings'].shape[0]} {out['task']} embeddings of width {out['embeddings'].shape[1]} to "
          f"{args.output} [precision {out['precision']}]")
    return 0
