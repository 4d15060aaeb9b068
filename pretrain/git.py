"""GIT pretraining: task-tree reconstruction across a mixture of graphs and task types.

Objective (official ``model/pretrain_model.py``): two corrupted views of every batch of
task-trees (feature-column masking with ``feat_p``, edge dropping with ``edge_p``); root
embeddings ``r1, r2`` (:meth:`GIT.virtual_root_embedding`); a predictor MLP
(Linear, ReLU, BatchNorm, Dropout 0.5, Linear) and

    L = mean_i [ (1 - cos(sg(r1_i), P(r2_i))) + (1 - cos(sg(r2_i), P(r1_i))) ] / 2
        + align_lambda * mean_i KL( softmax(mean_j r1_j) || softmax(r1_i) )

with optional "multitask" terms: feature reconstruction (MSE) and topology reconstruction (BCE
of inner products on tree edges against random pairs).

Choices that differ from the official code, and why:

* lr 1e-4 with linear warmup (5%) and one cosine decay over the whole run, instead of lr 1e-7
  and a cosine schedule stepped per batch with a period of ``epochs`` (it restarts every few
  batches): at 1e-7 AdamW barely moves a 768-wide encoder in 10 epochs, which the paper's own
  results (pretraining helps) contradict; 1e-4 is the paper's fine-tuning lr.
* The predictor and the alignment regulariser see the root embeddings only; the official code
  also feeds the pooled embeddings of every non-root node of the sampled subgraph into them
  (its BatchNorm statistics and the alignment mean then depend on subgraph sizes).
* Edge dropping never removes a virtual root's edges to its task nodes: without them the tree
  no longer describes its task (the root embedding would collapse to ``pooling_lin(0)``).
* Each layer runs only on the nodes whose output can reach a root (``objective.trim``, PyG's
  "trim to layer"); the official code runs every layer on every node of the subgraph. The root
  embeddings are the same computation; BatchNorm statistics in training mode come from the
  computed nodes only.
* Feature reconstruction targets the mean input features of the root's task nodes; the
  official target is ``x[:batch_size]``, which are the virtual nodes' all-zero rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from domainfm.data_loaders import graph as G
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "DataSection", "ObjectiveSection", "GITPretrainer", "Predictor",
           "git_pretrain_loss", "corrupt_view", "PretrainRecipe", "run", "pretrain_encoder"]


@dataclass
class DataSection:
    datasets: list[str] = field(default_factory=lambda: ["karate", "nations", "mutag"])
    task_types: list[str] = field(default_factory=lambda: ["node", "edge", "graph"])
    text_encoder: str = "minilm"
    fanout: int = 10
    num_hops: int = 2  # levels below the virtual root (the root spends one of the model's hops)
    seed: int = 0


@dataclass
class ObjectiveSection:
    feat_p: float = 0.2
    edge_p: float = 0.2
    align_lambda: float = 10.0
    predictor_dropout: float = 0.5
    multitask: bool = False
    sem_lambda: float = 1.0
    feat_lambda: float = 1.0
    topo_lambda: float = 1.0
    topo_ratio: float = 0.1
    trim: bool = True  # compute each layer only where it can reach the roots (see GIT.forward_features)

    def __post_init__(self):
        for name in ("feat_p", "edge_p", "predictor_dropout"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"objective.{name}={value}: expected a probability in [0, 1)")


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="git-base"))
    data: DataSection = field(default_factory=DataSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=10, batch_size=4096, lr=1e-4, weight_decay=1e-8, clip_grad_norm=1.0, warmup_ratio=0.05,
        progress=False, log_every_steps=10, head_patterns=[]))


# --------------------------------------------------------------------------- objective


class Predictor(nn.Module):
    """The official predictor ``MLP(hidden, hidden, hidden, 2 layers, dropout)``:
    Linear, ReLU, BatchNorm, Dropout, Linear."""

    def __init__(self, dim: int, dropout: float = 0.5):
        super().__init__()
        self.lin1, self.norm, self.lin2 = nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor) -> Tensor:
        return self.lin2(self.dropout(self.norm(F.relu(self.lin1(h)))))


def git_pretrain_loss(r1: Tensor, r2: Tensor, predictor: nn.Module, align_lambda: float) -> tuple[Tensor, Tensor]:
    """The two terms of the objective (module docs): ``(sem_loss, align_reg)``, ``align_reg``
    already multiplied by ``align_lambda``; the pretraining loss is their sum."""
    h1, h2 = predictor(r1), predictor(r2)
    t1, t2 = F.normalize(r1.detach(), dim=-1), F.normalize(r2.detach(), dim=-1)
    sem = ((1 - (t1 * F.normalize(h2, dim=-1)).sum(-1)) + (1 - (t2 * F.normalize(h1, dim=-1)).sum(-1))) / 2
    align = r1.new_zeros(())
    if align_lambda > 0:
        # KL(softmax(mean r1) || softmax(r1_i)), averaged over roots (F.kl_div(log q, p) = sum p (log p - log q))
        align = F.kl_div(r1.log_softmax(-1), r1.mean(0).softmax(-1), reduction="batchmean") * align_lambda
    return sem.mean(), align


def corrupt_view(trees: G.TaskTreeBatch, feat_p: float, edge_p: float, generator: torch.Generator | None = None
                 ) -> tuple[Tensor, Tensor]:
    """One augmented view: zero a random ``feat_p`` share of feature *columns* (the same columns
    for every node, as PyG's ``mask_feature(mode='col')``) and drop each tree edge with
    probability ``edge_p``, except the virtual roots' edges (module docs)."""
    x, edge_index = trees.x, trees.edge_index
    device = x.device
    if feat_p > 0:
        keep_cols = torch.rand(x.shape[1], generator=generator, device=device if generator is None else "cpu") >= feat_p
        x = x * keep_cols.to(device=device, dtype=x.dtype)
    if edge_p > 0 and edge_index.numel():
        keep = torch.rand(edge_index.shape[1], generator=generator, device=device if generator is None else "cpu") >= edge_p
        keep = keep.to(device) | (trees.depth[edge_index[1]] == 0)
        edge_index = edge_index[:, keep]
    return x, edge_index


class GITPretrainer(nn.Module):
    """GIT encoder + predictor (+ optional reconstruction decoders) for pretraining."""

    def __init__(self, encoder: nn.Module, objective: ObjectiveSection):
        super().__init__()
        self.encoder = encoder
        hidden = encoder.hidden_channels
        self.predictor = Predictor(hidden, objective.predictor_dropout)
        self.objective = objective
        if objective.multitask:
            self.feat_decoder = nn.Linear(hidden, encoder.in_channels)
            self.topo_decoder = nn.Linear(hidden, hidden)

    def roots(self, x: Tensor, edge_index: Tensor, trees: G.TaskTreeBatch) -> tuple[Tensor, Tensor]:
        # Only the roots' children feed the loss: skip the work that cannot reach them, unless
        # the topology term needs every node's embedding.
        trim = self.objective.trim and not self.objective.multitask
        z = self.encoder.forward_features(x, edge_index, depth=trees.depth if trim else None, keep_depth=1)
        return z, self.encoder.virtual_root_embedding(z, edge_index, trees.roots)

    def forward(self, trees: G.TaskTreeBatch) -> tuple[Tensor, dict[str, Tensor]]:
        obj = self.objective
        x1, e1 = corrupt_view(trees, obj.feat_p, obj.edge_p)
        x2, e2 = corrupt_view(trees, obj.feat_p, obj.edge_p)
        z1, r1 = self.roots(x1, e1, trees)
        z2, r2 = self.roots(x2, e2, trees)
        sem, align = git_pretrain_loss(r1, r2, self.predictor, obj.align_lambda)
        logs = {"sem_loss": sem.detach(), "align_reg": align.detach()}
        if not obj.multitask:
            return sem + align, logs
        feat = (self._feat_loss(r1, trees) + self._feat_loss(r2, trees)) / 2
        topo = (self._topo_loss(z1, e1, trees) + self._topo_loss(z2, e2, trees)) / 2
        logs.update(feat_loss=feat.detach(), topo_loss=topo.detach())
        return obj.sem_lambda * sem + align + obj.feat_lambda * feat + obj.topo_lambda * topo, logs

    def _feat_loss(self, r: Tensor, trees: G.TaskTreeBatch) -> Tensor:
        child, parent = trees.edge_index
        first = trees.depth[parent] == 0
        slot = torch.full((trees.x.shape[0],), -1, dtype=torch.long, device=r.device)
        slot[trees.roots] = torch.arange(trees.roots.numel(), device=r.device)
        from torch_geometric.utils import scatter

        target = scatter(trees.x[child[first]], slot[parent[first]], dim=0, dim_size=r.shape[0], reduce="mean")
        return F.mse_loss(self.feat_decoder(r), target)

    def _topo_loss(self, z: Tensor, edge_index: Tensor, trees: G.TaskTreeBatch) -> Tensor:
        real = (trees.node_id[edge_index[0]] >= 0) & (trees.node_id[edge_index[1]] >= 0)
        pos = edge_index[:, real]
        if pos.shape[1] == 0 or self.objective.topo_ratio <= 0:
            return z.new_zeros(())
        n_pos = max(1, int(pos.shape[1] * self.objective.topo_ratio))
        pos = pos[:, torch.randperm(pos.shape[1], device=z.device)[:n_pos]]
        neg = torch.randint(0, z.shape[0], (2, n_pos), device=z.device)
        h = self.topo_decoder(z)
        score = lambda e: (h.index_select(0, e[0]) * h.index_select(0, e[1])).sum(-1)
        return F.binary_cross_entropy_with_logits(score(pos), torch.ones(n_pos, device=z.device)) + \
            F.binary_cross_entropy_with_logits(score(neg), torch.zeros(n_pos, device=z.device))


class PretrainRecipe(Recipe):
    def __init__(self, module: GITPretrainer, table: G.PretrainTaskTable):
        self.model, self.train_dataset, self.collate_fn = module, table, table.collate
        self.roots_seen = 0

    def step(self, model, batch):
        self.roots_seen += batch.num_trees
        loss, logs = model(batch)
        return loss, {"loss": loss.detach(), **logs}


# --------------------------------------------------------------------------- entry


def load_pretraining_graphs(data: DataSection) -> list[G.GraphDataset]:
    encoder = G.text_encoder(data.text_encoder)
    graphs = []
    for name in data.datasets:
        if name in G.SHIPPED_DATASETS:
            graphs.append(G.load_dataset(name, encoder, seed=data.seed))
        else:
            graphs.extend(G.load_graph_dir(name, seed=data.seed))
    return graphs


def pretrain_encoder(cfg: Config, run_dir: Path | None, *, log=print) -> tuple[nn.Module, dict[str, Any]]:
    """Pretrain and return ``(encoder, report)``; also used in-process by the fine-tune entry."""
    from domainfm.zoo import count_parameters

    graphs = load_pretraining_graphs(cfg.data)
    width = graphs[0].num_features
    kwargs = {"in_channels": width, "n_outputs": 0, **cfg.model.kwargs}
    torch.manual_seed(cfg.train.seed)  # the initial weights are part of the run: same config, same run
    encoder, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    if encoder.in_channels != width:
        raise G.GraphError(f"model {cfg.model.name} takes {encoder.in_channels}-d features but the graphs have {width}")
    table = G.PretrainTaskTable(graphs, cfg.data.task_types, [cfg.data.fanout] * cfg.data.num_hops)
    log(f"GIT pretraining on {len(table)} task-trees: " + ", ".join(f"{k} {v}" for k, v in table.counts().items()))
    module = GITPretrainer(encoder, cfg.objective)
    recipe = PretrainRecipe(module, table)
    start = time.perf_counter()
    result = Trainer(cfg.train, run_dir=run_dir).fit(recipe)
    seconds = time.perf_counter() - start
    losses = [r for r in result.history if r.get("split") == "train"]
    report = {
        "model": cfg.model.name,
        "init": init_label(cfg.model.pretrained, init_info),
        "params_encoder": count_parameters(encoder),
        "params_total": count_parameters(module),
        "tasks": len(table),
        "task_mix": table.counts(),
        "steps": result.global_step,
        "first_loss": losses[0]["loss"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "final_sem_loss": losses[-1].get("sem_loss") if losses else None,
        "final_align_reg": losses[-1].get("align_reg") if losses else None,
        "roots_per_s": round(recipe.roots_seen / seconds, 1) if seconds > 0 else None,
        "text_encoder": graphs[0].encoder,
    }
    return encoder, report


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    from domainfm import save_pretrained

    encoder, report = pretrain_encoder(cfg, run_dir)
    path = save_pretrained(encoder, Path(run_dir) / "encoder")
    report["encoder_dir"] = report["saved_model"] = str(path)  # saved_model: read by fine-tuning stages
    print(f"pretrained encoder written to {path} (fine-tune with model.pretrained={path})")
    return report
