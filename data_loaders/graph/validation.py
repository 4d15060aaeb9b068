"""Graph validation: :class:`GraphError` and :func:`check_graph`, shared by the samplers, the
task-trees and the datasets. Bad input raises :class:`GraphError` naming the graph and the field."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GraphError", "TASKS", "check_graph"]

TASKS = ("node", "edge", "graph")


class GraphError(ValueError):
    """A graph (or a task on it) that cannot be used; the message names graph, field and expectation."""



def check_graph(x: Tensor | None, edge_index: Tensor, num_nodes: int | None = None, *, edge_attr: Tensor | None = None,
                name: str = "graph", feature_dim: int | None = None) -> int:
    """Validate one graph; returns its number of nodes.

    Raises :class:`GraphError` for an empty graph, ``x`` that is not a finite 2-D float tensor (or
    whose width differs from ``feature_dim``), ``edge_index`` that is not an integer (2, E) tensor,
    indices outside ``[0, num_nodes)`` and ``edge_attr`` whose row count is not E.
    """
    if x is not None:
        if not isinstance(x, Tensor) or x.ndim != 2:
            raise GraphError(f"{name}: node features x must be a 2-D tensor (num_nodes, num_features), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        if not x.is_floating_point():
            raise GraphError(f"{name}: node features x must be floating point, got {x.dtype}")
        if num_nodes is not None and x.shape[0] != num_nodes:
            raise GraphError(f"{name}: x has {x.shape[0]} rows but num_nodes={num_nodes}")
        num_nodes = x.shape[0]
        if feature_dim is not None and x.shape[1] != feature_dim:
            raise GraphError(f"{name}: node features have {x.shape[1]} columns but the model/other graphs "
                             f"expect {feature_dim}; encode every graph with the same text encoder")
        if not torch.isfinite(x).all():
            raise GraphError(f"{name}: node features x contain NaN or inf")
    if num_nodes is None:
        raise GraphError(f"{name}: give x or num_nodes")
    if num_nodes <= 0:
        raise GraphError(f"{name}: the graph is empty (0 nodes); remove it from the dataset")
    if not isinstance(edge_index, Tensor) or edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise GraphError(f"{name}: edge_index must have shape (2, num_edges), got "
                         f"{tuple(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__}")
    if edge_index.is_floating_point() or edge_index.dtype == torch.bool:
        raise GraphError(f"{name}: edge_index must hold integer node ids, got {edge_index.dtype}")
    if edge_index.numel():
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= num_nodes:
            bad = lo if lo < 0 else hi
            raise GraphError(f"{name}: edge_index contains node id {bad}, outside [0, {num_nodes}) "
                             f"for a graph with {num_nodes} nodes")
    if edge_attr is not None and edge_attr.shape[0] != edge_index.shape[1]:
        raise GraphError(f"{name}: edge_attr has {edge_attr.shape[0]} rows for {edge_index.shape[1]} edges")
    return int(num_nodes)
