"""GIT adaptation: fine-tuning (full / LoRA / linear probe), few-shot, in-context, zero-shot and
specialisation (SFT), for node, edge (relation classification) and graph classification.

``domainfm finetune git`` (configs/git/finetune.yaml) runs offline on the shipped graphs: a short
pretraining of ``git-small`` on Karate (nodes), Nations (edges) and MUTAG (graphs), then on
MUTAG in-context and fine-tuned results of the pretrained encoder next to the same recipe from
random initialisation (the non-pretrained baseline).

Task embeddings follow the official fine-tuning code: node ``pooling_lin(z[v])``, edge
``pooling_lin((z[u] + z[v]) / 2)``, graph ``pooling_lin(mean_pool(z))``, computed on task-trees
without virtual roots (fan-out 10 for node training batches, 30 for edges, every neighbour for
evaluation) or on whole graphs. In-context: prototypes are the means of the L2-normalised
support embeddings, logits ``-(2 - 2 cos(query, prototype))``; n-way k-shot episodes draw the
support from the training split and the queries from the test split. Zero-shot: the prototypes
are the class-description text embeddings (needs ``hidden_channels == in_channels``), usually
after specialisation: MSE between ``pooling_lin(root)`` and the true class's text embedding.
Link prediction (``data.task: link``) holds out edges of the graph against random non-edges and
scores ``pooling_lin(z[u]) . pooling_lin(z[v]) / sqrt(hidden)``. Fine-tuning can be repeated over
seeds (``adapt.seeds``; mean and std reported; ``RUN/model`` is the first repeat's model).
Metrics: accuracy for node and edge tasks, ROC-AUC for (binary) graph classification and link
prediction.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from domainfm.data_loaders import graph as G
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.finetune import metrics as M
from domainfm.finetune.supervised import LoraSettings, SupervisedRecipe, prepare_mode

__all__ = ["Config", "run", "evaluate", "prototype_logits", "in_context", "zero_shot", "TaskItems",
           "GraphBatchInput", "TaskCollate", "embed_tasks"]

MODES = ("in_context", "finetune", "few_shot", "zero_shot", "sft")


@dataclass
class ModelSection:
    name: str = "git-small"
    pretrained: str | None = None  # a path / URL / "true"; null: use the in-process pretraining below
    pretrained_fallback: str = "error"  # "random": continue from random init when weights are unavailable
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.pretrained_fallback not in ("error", "random"):
            raise ValueError(f"model.pretrained_fallback={self.pretrained_fallback!r}: expected 'error' or 'random'")


@dataclass
class PretrainSection:
    """A short in-process pretraining, used when ``model.pretrained`` is null and ``enabled``."""

    enabled: bool = True
    datasets: list[str] = field(default_factory=lambda: ["karate", "nations", "mutag"])
    task_types: list[str] = field(default_factory=lambda: ["node", "edge", "graph"])
    max_steps: int = 150
    batch_size: int = 256
    lr: float = 1e-3
    fanout: int = 10
    num_hops: int = 2
    align_lambda: float = 10.0


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


@dataclass
class AdaptSection:
    modes: list[str] = field(default_factory=lambda: ["in_context", "finetune"])
    mode: str = "full"  # full | lora | linear_probe (for finetune / few_shot)
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(
        targets=["layers.*.lin_l", "layers.*.lin_r", "pooling_lin"], rank=8, alpha=16.0))
    baseline: bool = True  # also run every mode from random initialisation
    n_way: int = 5
    k_shot: int = 3
    n_query: int = 3
    n_episodes: int = 20
    few_shot_k: int = 3
    seeds: list[int] = field(default_factory=lambda: [0])  # fine-tune / few-shot repeats (train.seed + s): mean and std
    sft_steps: int = 50
    sft_lr: float = 1e-4

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"adapt.modes: unknown {bad}; expected any of {MODES}")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    pretrain: PretrainSection = field(default_factory=PretrainSection)
    data: DataSection = field(default_factory=DataSection)
    adapt: AdaptSection = field(default_factory=AdaptSection)
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


# --------------------------------------------------------------------------- runs


def _load_encoder(cfg: Config, width: int, run_dir: Path, log=print) -> tuple[nn.Module, str]:
    from domainfm import create_model
    from domainfm.hub import HubError

    kwargs = {"in_channels": width, "n_outputs": 0, **cfg.model.overrides}
    if cfg.model.pretrained:
        source: Any = True if cfg.model.pretrained.lower() == "true" else cfg.model.pretrained
        try:
            model = create_model(cfg.model.name, pretrained=source, **kwargs)
            return model, f"pretrained: {cfg.model.pretrained}"
        except (HubError, FileNotFoundError, OSError) as exc:
            message = (f"could not load pretrained weights for {cfg.model.name} from {cfg.model.pretrained!r}: {exc}\n"
                       "  -> run `domainfm pretrain git` and pass model.pretrained=RUN/encoder, place the file at the "
                       "path named above, or set model.pretrained_fallback=random to continue from random init")
            if cfg.model.pretrained_fallback != "random":
                raise SystemExit(message) from exc
            log(message + "\n  continuing from RANDOM initialisation (model.pretrained_fallback=random)")
            return create_model(cfg.model.name, **kwargs), "random"
    if cfg.pretrain.enabled:
        from domainfm.pretrain import git as P

        p = cfg.pretrain
        pcfg = P.Config(
            model=P.ModelSection(name=cfg.model.name, overrides=dict(cfg.model.overrides)),
            data=P.DataSection(datasets=list(p.datasets), task_types=list(p.task_types), text_encoder=cfg.data.text_encoder,
                               fanout=p.fanout, num_hops=p.num_hops, seed=cfg.data.seed),
            objective=P.ObjectiveSection(align_lambda=p.align_lambda),
            train=TrainConfig(max_steps=p.max_steps, batch_size=p.batch_size, lr=p.lr, weight_decay=1e-8, clip_grad_norm=1.0,
                              warmup_ratio=0.05, progress=False, log_every_steps=max(1, p.max_steps // 10), head_patterns=[],
                              seed=cfg.train.seed, accelerator=cfg.train.accelerator, drop_last=True),
        )
        encoder, report = P.pretrain_encoder(pcfg, run_dir / "pretrain", log=log)
        log(f"in-process pretraining: {report['steps']} steps, loss {report['first_loss']:.4f} -> {report['final_loss']:.4f}")
        return encoder, f"pretrained: in-process GIT pretraining on {'+'.join(p.datasets)} ({report['steps']} steps)"
    return create_model(cfg.model.name, **kwargs), "random"


def _is_link(ds: G.GraphDataset) -> bool:
    return ds.name.endswith("-link")


def _recipe_task(ds: G.GraphDataset) -> tuple[str, int, str]:
    """(SupervisedRecipe task, head outputs, selection metric) of a dataset."""
    if _is_link(ds):
        return "binary", 0, "roc_auc"  # scored by the dot product of pooled endpoints, no head
    if ds.task == "graph" and ds.num_classes == 2:
        return "binary", 1, "roc_auc"
    return "multiclass", ds.num_classes, "accuracy"


def _fine_tune(encoder: nn.Module, ds: G.GraphDataset, cfg: Config, run_dir: Path, train_pos: Tensor,
               ) -> tuple[nn.Module, dict[str, float], dict[str, Any]]:
    from domainfm.zoo import count_parameters

    task, n_out, metric = _recipe_task(ds)
    model = copy.deepcopy(encoder)
    torch.manual_seed(cfg.train.seed)  # the new head's init follows the run's seed
    model.reset_classifier(n_out)
    head = "head" if n_out > 0 else "pooling_lin"  # link prediction scores pooled endpoints: pooling_lin is its head
    prepare_mode(model, cfg.adapt.mode, head=head, lora=cfg.adapt.lora)
    train_fanout = cfg.data.train_fanout or (30 if ds.task == "edge" else 10)
    collate = TaskCollate(ds, train_fanout, model.num_layers, eval_fanout=cfg.data.eval_fanout,
                          use_edge_attr=cfg.data.use_edge_attr)
    forward = link_forward if _is_link(ds) else (lambda m, inp: task_forward(m, inp))
    recipe = SupervisedRecipe(model, TaskItems(train_pos), TaskItems(ds.splits["val"], evaluation=True), task=task,
                              forward_fn=forward, collate_fn=collate)
    train_cfg = copy.deepcopy(cfg.train)
    train_cfg.monitor, train_cfg.monitor_mode = f"val/{metric}", "max"
    trainer = Trainer(train_cfg, run_dir=run_dir)
    result = trainer.fit(recipe)
    if result.best_checkpoint is not None and Path(result.best_checkpoint).is_file():
        from safetensors.torch import load_model

        load_model(model, str(result.best_checkpoint), strict=True)
    test = trainer.evaluate(recipe, TaskItems(ds.splits["test"], evaluation=True), model=model)
    info = {"params_total": count_parameters(model),
            "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "best_val": result.best_metric, "steps": result.global_step}
    return model, test, info


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


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from domainfm import save_pretrained

    run_dir = Path(run_dir)
    torch.manual_seed(cfg.train.seed)
    ds = load_task_dataset(cfg.data)
    print(f"GIT on {ds.name}: {ds.task} task, {ds.num_classes} classes, splits "
          + ", ".join(f"{k} {v.numel()}" for k, v in ds.splits.items()) + f"; labels {ds.labels}")
    pretrained, init = _load_encoder(cfg, ds.num_features, run_dir)
    _, _, metric = _recipe_task(ds)
    report: dict[str, Any] = {"dataset": ds.name, "task": ds.task, "model": cfg.model.name, "init": init,
                              "text_encoder": ds.encoder, "labels": ds.labels, "metric": metric}
    inits = [("pretrained" if init != "random" else "random", pretrained)]
    if cfg.adapt.baseline and init != "random":
        from domainfm import create_model

        torch.manual_seed(cfg.train.seed)
        baseline = create_model(cfg.model.name, in_channels=ds.num_features, n_outputs=0, **cfg.model.overrides)
        inits.append(("random", baseline))
    a = cfg.adapt
    for tag, enc in inits:
        if "in_context" in a.modes:
            ic = in_context(enc, ds, n_way=a.n_way, k_shot=a.k_shot, n_query=a.n_query, n_episodes=a.n_episodes,
                            seed=cfg.data.seed, fanout=cfg.data.eval_fanout)
            report.update({f"in_context_{k}_{tag}": v for k, v in ic.items() if k != "n_way"})
            report["in_context_n_way"] = ic["n_way"]
        if "zero_shot" in a.modes or "sft" in a.modes:
            spec = enc
            if "sft" in a.modes:
                spec = copy.deepcopy(enc)
                collate = TaskCollate(ds, cfg.data.train_fanout or (30 if ds.task == "edge" else 10), spec.num_layers,
                                      eval_fanout=cfg.data.eval_fanout)
                sft_cfg = TrainConfig(max_steps=a.sft_steps, batch_size=cfg.train.batch_size, lr=a.sft_lr, progress=False,
                                      weight_decay=0.0, seed=cfg.train.seed, accelerator=cfg.train.accelerator,
                                      drop_last=False, log_every_steps=max(1, a.sft_steps // 5), head_patterns=[])
                Trainer(sft_cfg, run_dir=run_dir / f"sft-{tag}").fit(SFTRecipe(spec, ds, collate))
            zs = zero_shot(spec, ds, fanout=cfg.data.eval_fanout)
            prefix = "zero_shot_sft" if "sft" in a.modes else "zero_shot"
            report.update({f"{prefix}_{k}_{tag}": v for k, v in zs.items()})
        for mode in ("finetune", "few_shot"):
            if mode not in a.modes:
                continue
            train_pos = ds.splits["train"]
            if mode == "few_shot":
                g = torch.Generator().manual_seed(cfg.data.seed)
                train_pos = torch.cat([p[torch.randperm(p.numel(), generator=g)[:a.few_shot_k]]
                                       for c in range(ds.num_classes) if (p := train_pos[ds.y[train_pos] == c]).numel()])
            tests, vals = [], []
            for i, repeat in enumerate(a.seeds):
                run_cfg = copy.deepcopy(cfg)
                run_cfg.train.seed = cfg.train.seed + repeat
                sub = f"{mode}-{tag}" + (f"-seed{repeat}" if len(a.seeds) > 1 else "")
                model, test, info = _fine_tune(enc, ds, run_cfg, run_dir / sub, train_pos)
                tests.append(test)
                vals.append(info["best_val"])
                if i == 0 and tag == inits[0][0]:
                    report.update(params_total=info["params_total"], params_trainable=info["params_trainable"],
                                  finetune_mode=cfg.adapt.mode)
                    if mode == "finetune":
                        if cfg.adapt.mode == "lora":
                            from domainfm import lora

                            lora.save_adapter(model, run_dir / "adapter", base_model_name=cfg.model.name)
                            lora.merge(model, unload=True)  # RUN/model holds the merged weights
                        report["model_dir"] = str(save_pretrained(model, run_dir / "model"))
                        report["model_seed"] = run_cfg.train.seed  # RUN/model: the first repeat's model
            keys = [metric] + (["accuracy"] if metric != "accuracy" and "accuracy" in tests[0] else [])
            for k in keys:
                values = torch.tensor([t[k] for t in tests], dtype=torch.float64)
                report[f"{mode}_test_{k}_{tag}"] = float(values.mean())
                if len(tests) > 1:
                    report[f"{mode}_test_{k}_std_{tag}"] = float(values.std())
            report[f"{mode}_best_val_{metric}_{tag}"] = float(torch.tensor(vals, dtype=torch.float64).mean())
            if len(tests) > 1:
                report[f"{mode}_test_{metric}_runs_{tag}"] = [t[metric] for t in tests]
    return report


def evaluate(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Test metrics of the fine-tuned model saved by :func:`run` (``RUN/model``)."""
    from domainfm import create_model

    run_dir = Path(run_dir)
    model = create_model(run_dir / "model").eval()
    ds = load_task_dataset(cfg.data)
    task, _, metric = _recipe_task(ds)
    test = ds.splits["test"]
    collate = TaskCollate(ds, cfg.data.eval_fanout, model.num_layers, eval_fanout=cfg.data.eval_fanout,
                          use_edge_attr=cfg.data.use_edge_attr)
    forward = link_forward if _is_link(ds) else task_forward
    with torch.no_grad():
        out = torch.cat([forward(model, collate(test[i:i + 256].tolist())[0]) for i in range(0, test.numel(), 256)])
    scores = torch.sigmoid(out.reshape(-1)) if task == "binary" else out
    result = M.compute(task, ds.y[test], scores)
    return {f"test_{k}": v for k, v in result.items()}
