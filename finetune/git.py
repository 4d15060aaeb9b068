"""GIT adaptation on the experiment layer: fine-tuning (full / LoRA / linear probe), few-shot,
in-context, zero-shot and specialisation (SFT), for node, edge (relation classification), link
prediction and graph classification.

``domainfm finetune git`` (configs/git/finetune.yaml) runs offline on the shipped graphs: a short
pretraining stage of ``git-small`` on Karate (nodes), Nations (edges) and MUTAG (graphs), then on
MUTAG in-context and fine-tuned results of the pretrained encoder next to the same recipe from
random initialisation (the arms ``pretrained`` and ``random``).

Task embeddings (:mod:`domainfm.models.git.tasks`, as the official fine-tuning code) are computed
on task-trees without virtual roots (fan-out 10 for node training batches, 30 for edges, every
neighbour for evaluation) or on whole graphs. In-context episodes, zero-shot against the class
texts and SFT (:mod:`domainfm.models.git.in_context`) look at each arm's encoder before
fine-tuning; each repeat (``adapt.seeds``) draws its own in-context episodes (with the repeat's
seed) unless ``protocols.episode_seed`` fixes them, so the report's in-context figures read mean ±
std over episode draws. ``data.seed`` chooses the split of the datasets without a fixed one. Link
prediction (``data.task: link``) holds out edges against random non-edges and scores
``pooling_lin(z[u]) . pooling_lin(z[v]) / sqrt(hidden)``. Few-shot fine-tuning: ``data.few_shot_k``.
Metrics: accuracy for node and edge tasks, ROC-AUC for (binary) graph classification and link
prediction (the selection metric unless ``train.monitor`` is set).

Retained capability (forgetting): in-context accuracy of each arm's encoder on the shipped graphs
it is *not* fine-tuned on, before and after fine-tuning (:func:`retained_in_context`).

Applying a model: :func:`predict` / :func:`embed` (``domainfm predict|embed git``, :data:`APPLY`)
with the run's settings (:func:`model_settings`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from domainfm.data_loaders import graph as G
from domainfm.engine import TrainConfig
from domainfm.errors import InputError
from domainfm.experiment import (AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained,
                                 RunFolderError, StageSection, TaskData, apply)
from domainfm.lora.settings import LoraSettings
from domainfm.models.git.in_context import in_context, in_context_over, specialise, zero_shot
from domainfm.models.git.tasks import TaskCollate, TaskItems, is_link, link_forward, task_forward
from domainfm.precision import resolve_precision

__all__ = ["Config", "DataSection", "ProtocolSection", "RetainedSection", "FAMILY", "run", "evaluate",
           "load_task_dataset", "build_task", "in_context_protocol", "retained_in_context", "ApplySettings",
           "ApplyOptions", "APPLY", "model_settings", "predict", "embed", "BF16_PROBABILITY_TOLERANCE",
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
    # null: the episodes of each repeat are drawn with the repeat's seed (train.seed + adapt.seeds[k]),
    # so the report's ± on in-context figures is their spread over episode draws (and, for random
    # init, over initialisations); an int draws the same episodes in every repeat
    episode_seed: int | None = None
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
    ds = (G.load_nations(encoder, min_count=data.min_relation_count) if data.dataset == "nations"
          else G.load_dataset(data.dataset, encoder, seed=data.seed))
    return G.link_prediction_split(ds, seed=data.seed, encoder=encoder) if data.task == "link" else ds


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
    p, ds, fanout = ctx.cfg.protocols, ctx.task.extras["dataset"], ctx.cfg.data.eval_fanout
    out: dict[str, Any] = {}
    if p.in_context:
        seed = ctx.seed if p.episode_seed is None else p.episode_seed
        out["in_context"] = in_context(ctx.model, ds, n_way=p.n_way, k_shot=p.k_shot, n_query=p.n_query,
                                       n_episodes=p.n_episodes, seed=seed, fanout=fanout)
    if p.sft:
        model = specialise(ctx.model, ds, ctx.task.collate_fn, steps=p.sft_steps, lr=p.sft_lr, seed=ctx.seed,
                           batch_size=ctx.cfg.train.batch_size, accelerator=ctx.cfg.train.accelerator,
                           run_dir=ctx.run_dir / "sft")
        out["zero_shot_sft"] = zero_shot(model, ds, fanout=fanout)
    elif p.zero_shot:
        out["zero_shot"] = zero_shot(ctx.model, ds, fanout=fanout)
    return out


def retained_in_context(ctx: ArmContext) -> dict[str, Any]:
    """In-context accuracy of ``ctx.model`` on the shipped graphs not fine-tuned on (see
    :class:`RetainedSection`): ``{"accuracy": mean over graphs, "<graph>": {in-context results}}``
    (:func:`~domainfm.models.git.in_context.in_context_over`: graphs of another feature width, or
    among the shipped ones unable to host the episodes, are skipped and named)."""
    r, data = ctx.cfg.retained, ctx.cfg.data
    tuned = ctx.task.extras["dataset"].name.removesuffix("-link")
    names = list(r.datasets) if r.datasets is not None else [n for n in G.SHIPPED_DATASETS if n != tuned]
    cache = ctx.task.extras.setdefault("retained_graphs", {})
    for name in names:
        if name not in cache:
            cache[name] = load_task_dataset(DataSection(dataset=name, text_encoder=data.text_encoder, seed=data.seed))
    # a graph the user named must host the episodes
    return in_context_over(ctx.model, {n: cache[n] for n in names}, strict=r.datasets is not None, n_way=r.n_way,
                           k_shot=r.k_shot, n_query=r.n_query, n_episodes=r.n_episodes, seed=r.seed,
                           fanout=data.eval_fanout)


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
#: and ``32-true``: about 10x the differences measured on the shipped graphs (benchmarks/README.md,
#: "GIT predict/embed: bf16 vs fp32"). ``--precision 32-true`` reproduces fp32 figures exactly.
BF16_PROBABILITY_TOLERANCE = 2e-2
BF16_EMBEDDING_TOLERANCE = 3e-2


@dataclass
class ApplySettings:
    """How a model is applied to a graph.

    Attributes:
        task: the graph task its head was trained for (``node``/``edge``/``graph``; None: the input's).
        fanout: neighbours per task-tree level (-1: every neighbour, i.e. exact full-graph
            message passing at the roots; other values sample, with ``seed``).
        use_edge_attr: feed the graph's edge features to the SAGE layers.
        text_encoder: encoder of a shipped graph's texts (``minilm`` or ``hashing``).
        class_names: one name per output class, when known.
        link: a link-prediction model (no head: p(link) = sigmoid of the pooled endpoints' scaled
            dot product, :func:`~domainfm.models.git.tasks.link_forward`).
        source: where these settings come from; model: what ``--model`` named (neither recorded).
    """

    task: str | None = None
    fanout: int = -1
    use_edge_attr: bool = False
    text_encoder: str = "minilm"
    class_names: list[str] | None = None
    link: bool = False
    source: str = "defaults (no run folder: every neighbour, no edge features, MiniLM texts)"
    model: str | None = None


def _settings(ref: apply.ModelRef, model: nn.Module | None = None) -> ApplySettings:
    report = ref.run_report()
    if report is None or report.get("kind") == "pretrain":
        return ApplySettings(model=ref.label)
    if report.get("family") != "git":
        raise RunFolderError(f"{ref.run}: a {report.get('family')!r} run, not a GIT run")
    data = ref.run_config(Config).data
    link = data.task == "link"
    try:
        names = list(G.LINK_CLASS_TEXTS) if link else list(load_task_dataset(data).class_texts)
    except (G.GraphError, FileNotFoundError, KeyError, ImportError):
        names = None  # the fine-tuning data is not here any more: classes are numbered only
    return ApplySettings(task=report.get("data", {}).get("graph_task"), fanout=data.eval_fanout,
                         use_edge_attr=data.use_edge_attr, text_encoder=data.text_encoder, class_names=names,
                         link=link, source=f"run folder {ref.run} (config.yaml data section)", model=ref.label)


def model_settings(model: Any, arm: str | None = None) -> ApplySettings:
    """The settings the model was fine-tuned with when ``model`` is (inside) a GIT run folder
    (:class:`~domainfm.experiment.apply.ModelRef`): ``data.eval_fanout``, ``data.use_edge_attr``,
    ``data.text_encoder``, the task (``report.data.graph_task``; link prediction when ``data.task:
    link``) and the class texts of ``data.dataset``; otherwise :class:`ApplySettings`' defaults."""
    return _settings(apply.ModelRef.of(model, arm))


@dataclass
class ApplyOptions:
    task: str | None = apply.option(None, "node | edge | graph (default: the run's task, else the input's own)",
                                    choices=G.TASKS)
    index: Any = apply.option(None, "which tasks: a file of node/graph ids (one per line) or node pairs ('u,v' per "
                                    "line), or a .npy (ids, pairs or a boolean mask); default every node / graph / "
                                    "edge", type=str)
    split: str | None = apply.option(None, "instead of --index: the input's train|val|test tasks")
    seed: int = apply.option(0, "neighbour sampling when the fan-out is not -1", type=int)


@dataclass
class _Graph:
    source: Any  # read by the command, after the model is checked
    label: str
    index: Tensor | None


def _read(source: Any, settings: ApplySettings, options: ApplyOptions) -> _Graph:
    index = options.index
    if isinstance(index, (str, Path)):
        task = options.task or settings.task  # unknown: the file says (pairs are edges)
        index = G.read_ids(index, columns=None if task is None else 2 if task == "edge" else 1)
    label = str(source) if isinstance(source, (str, Path)) else getattr(source, "name", "the given graph")
    return _Graph(source, label, None if index is None else torch.as_tensor(index))


def _tasks(graph: _Graph, net: nn.Module, s: ApplySettings, o: ApplyOptions) -> tuple[G.GraphDataset, G.GraphDataset]:
    """(the graph, read with the model's text encoder and feature width; the tasks selected in it)."""
    encoder = G.text_encoder(s.text_encoder)
    ds = G.read_graph(graph.source, encoder=encoder, feature_dim=net.in_channels, seed=o.seed)
    task = o.task or s.task or ds.task
    if s.source != ApplySettings.source and ds.encoder not in ("unknown", encoder.name):
        print(f"warning: {graph.label} holds {ds.encoder} features but the model was fine-tuned on {encoder.name} "
              "features", file=sys.stderr)
    if s.use_edge_attr and ds.edge_attr is None:
        raise G.GraphError(f"{graph.label}: the model uses edge features (data.use_edge_attr) but the graph has no "
                           "edge_attr")
    if s.link and task != "edge":
        raise G.GraphError(f"{graph.label}: a link-prediction model scores node pairs: use task 'edge', not {task!r}")
    if s.task is not None and task != s.task:
        print(f"warning: the model was fine-tuned on {s.task} tasks; its head now reads {task} task embeddings",
              file=sys.stderr)
    return ds, G.select_tasks(ds, task, index=graph.index, split=o.split, label=graph.label)


def _forward(view: G.GraphDataset, net: nn.Module, s: ApplySettings, o: ApplyOptions, run: apply.Runtime,
             fn) -> Tensor:
    """``fn(net, batch)`` over the tasks of ``view``, batched as task-trees (whole graphs for graph tasks)."""
    collate = TaskCollate(view, s.fanout, net.num_layers, eval_fanout=s.fanout, use_edge_attr=s.use_edge_attr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(o.seed)  # only matters when the fan-out samples neighbours
        return run.batched(lambda pos: fn(net, collate(pos.tolist())[0].to(run.device)),
                           torch.arange(view.task_index.shape[-1]))


def _id_frame(view: G.GraphDataset) -> pd.DataFrame:
    ids = view.task_index
    return pd.DataFrame({"source": ids[0].numpy(), "target": ids[1].numpy()} if view.task == "edge"
                        else {view.task: ids.numpy()})


def _predict(graph: _Graph, net: nn.Module, s: ApplySettings, o: ApplyOptions, run: apply.Runtime) -> apply.Output:
    if not s.link and net.n_outputs == 0:
        # refused before the graph is read: a backbone's "logits" would be its embeddings
        raise InputError(f"{f'model {s.model}' if s.model else 'the model'}: a GIT backbone without a classifier head "
                         "(n_outputs=0); predict needs a fine-tuned model with a head (a `domainfm finetune git` run "
                         "folder or its <arm>/model); for task embeddings use `domainfm embed git`")
    ds, view = _tasks(graph, net, s, o)
    logits = _forward(view, net, s, o, run, link_forward if s.link else task_forward)
    if s.link or logits.ndim == 1 or logits.shape[1] == 1:
        p1 = torch.sigmoid(logits.reshape(-1))
        probs = torch.stack([1 - p1, p1], dim=1)
    else:
        probs = logits.softmax(-1)
    cls = probs.argmax(-1)
    frame = _id_frame(view)
    frame["class"] = cls.numpy()
    names = s.class_names
    if names is None and ds.num_classes == probs.shape[1] and ds.labels != "none" \
            and not all(t == f"class {i}" for i, t in enumerate(ds.class_texts)):
        names = ds.class_texts  # the input's own classes, when the head has as many
    if names is not None and len(names) == probs.shape[1]:
        frame["class_name"] = [names[i] for i in cls.tolist()]
    for k in range(probs.shape[1]):
        frame[f"p_{k}"] = probs[:, k].double().numpy()
    precision = resolve_precision(run.precision, run.device)
    frame.attrs.update(precision=precision, settings=s.source, task=view.task)
    return apply.Output(frame, summary=f"{len(frame)} {view.task} predictions ({probs.shape[1]} classes) "
                                       f"[precision {precision}; settings: {s.source}]")


def _embed(graph: _Graph, net: nn.Module, s: ApplySettings, o: ApplyOptions, run: apply.Runtime) -> apply.Output:
    _, view = _tasks(graph, net, s, o)
    emb = _forward(view, net, s, o, run, lambda m, inp: task_forward(m, inp, head=False)).numpy()
    ids = view.task_index.t().contiguous() if view.task == "edge" else view.task_index
    precision = resolve_precision(run.precision, run.device)
    out: Any = {"embeddings": emb.astype(np.float32), "index": ids.numpy(), "task": view.task, "model": s.model or "",
                "precision": precision}
    if run.output is not None and run.output.suffix.lower() in apply.TABLE:  # a table: id column(s), emb_<k>
        out = _id_frame(view).join(pd.DataFrame(emb, columns=[f"emb_{k}" for k in range(emb.shape[1])]))
    return apply.Output(out, summary=f"{emb.shape[0]} {view.task} embeddings of width {emb.shape[1]} "
                                     f"[precision {precision}]")


APPLY = apply.Applier(
    family="git",
    input="a torch.save'd PyG Data (node tasks) or list of Data (graph tasks), a .npz graph, or a shipped graph's "
          "name (karate, nations, mutag)",
    description="Task, fan-out, edge features, text encoder and class names as in the model's fine-tuning run "
                "(its config.yaml); else every neighbour, no edge features, MiniLM texts, the input's task.",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=256, samples=tuple(G.SHIPPED_DATASETS),
    # a link-prediction model has no head yet predicts: _predict refuses a headless backbone itself
    predict=apply.Command(_predict, apply.TABLE,
                          what="GIT predictions for the node, edge or graph tasks of a graph (CSV: the task's id "
                               "column(s), class, class_name (when known), p_<class> per class)."),
    embed=apply.Command(_embed, apply.ARRAYS + apply.TABLE,
                        what="GIT task embeddings for the node, edge or graph tasks of a graph (.npz: embeddings "
                             "(B, D), index, task, model, precision; or a CSV/Parquet table: the task's id "
                             "column(s), emb_0 ... emb_<D-1>)."),
)


def predict(graph: Any, model: Any, *, task: str | None = None, index: Tensor | None = None, split: str | None = None,
            arm: str | None = None, pretrained: Any = None, precision: str = "auto", device: str = "cpu",
            batch_size: int = 256, seed: int = 0, settings: ApplySettings | None = None):
    """Class predictions of a fine-tuned GIT for the node, edge or graph tasks of ``graph``.

    Args:
        graph: what :func:`~domainfm.data_loaders.graph.read_graph` reads: a ``torch.save``'d PyG
            ``Data`` or list of ``Data``, a ``.npz`` graph, a shipped graph's name, or such
            objects. Node features of the model's ``in_channels`` width, used as they are: encode
            them as the model's training graphs were.
        model: a registered name (with ``pretrained``: a checkpoint path, since GIT registers no
            weights), a ``save_pretrained`` folder, a GIT run folder (``arm``: default its first
            arm), or a module; applied with :func:`model_settings` (or ``settings``).
        task: ``node`` | ``edge`` | ``graph`` (default: the run's task, else the input's).
        index: which tasks: (B,) node or graph ids, a boolean mask over nodes or graphs, (2, B)
            node pairs, or a file of them (:func:`~domainfm.data_loaders.graph.read_ids`);
            default every node, every graph, or every edge task
            (:func:`~domainfm.data_loaders.graph.select_tasks`).
        split: instead of ``index``: the input's ``train``/``val``/``test`` tasks (a Data's
            ``*_mask``; a ``.npz``'s split arrays or its stratified split).
        precision: ``auto`` (bf16 where the hardware has it natively, else fp32), ``32-true`` or
            ``bf16-mixed``: within :data:`BF16_PROBABILITY_TOLERANCE` of fp32 (absolute).

    Returns a ``pandas.DataFrame``, one row per task: its id (``node`` | ``source``, ``target`` |
    ``graph``), ``class`` (the most probable), ``class_name`` (when known) and ``p_<class>`` per
    class (summing to 1; a binary head or a link model: ``p_0 = 1 - sigmoid``, ``p_1 = sigmoid``).
    """
    return apply.run("predict", APPLY, model, graph, settings=settings, arm=arm, pretrained=pretrained,
                     precision=precision, device=device, batch_size=batch_size,
                     options=ApplyOptions(task, index, split, seed)).value


def embed(graph: Any, model: Any, *, task: str | None = None, index: Tensor | None = None, split: str | None = None,
          arm: str | None = None, pretrained: Any = None, precision: str = "auto", device: str = "cpu",
          batch_size: int = 256, seed: int = 0, settings: ApplySettings | None = None) -> dict[str, Any]:
    """Task embeddings of ``graph`` (arguments as :func:`predict`): ``pooling_lin`` of the task
    root(s), the input of the classifier head, of width ``model.num_features`` (the card's
    ``hidden_channels``). Under bf16 they stay within :data:`BF16_EMBEDDING_TOLERANCE` of fp32,
    relative to the largest fp32 entry.

    Returns ``{"embeddings": (B, D) float32, "index": (B,) ids or (B, 2) node pairs, "task",
    "model", "precision"}`` (numpy arrays and strings)."""
    return apply.run("embed", APPLY, model, graph, settings=settings, arm=arm, pretrained=pretrained,
                     precision=precision, device=device, batch_size=batch_size,
                     options=ApplyOptions(task, index, split, seed)).value
