"""GIT on labelled tasks: positions of a :class:`~domainfm.data_loaders.graph.GraphDataset`'s tasks
become batches (task-trees without virtual roots for node/edge tasks, disjoint unions of whole
graphs for graph tasks), and a GIT encoder turns them into task embeddings, logits or link scores.

Task embeddings follow the official fine-tuning code: node ``pooling_lin(z[v])``, edge
``pooling_lin((z[u] + z[v]) / 2)``, graph ``pooling_lin(mean_pool(z))``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from domainfm.data_loaders import graph as G

__all__ = ["TaskItems", "GraphBatchInput", "TaskCollate", "link_forward", "task_forward", "embed_tasks", "is_link"]


def is_link(ds: G.GraphDataset) -> bool:
    """A link-prediction dataset (made by :func:`~domainfm.data_loaders.graph.link_prediction_split`)."""
    return ds.name.endswith("-link")


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
