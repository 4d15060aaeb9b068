"""GIT's task-trees (ICML 2025, https://arxiv.org/abs/2412.16441): one tree per node-, edge- or
graph-level task, built over all roots of a batch at once.

Every task is a tree rooted at the task:

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

Two interchangeable paths build identical trees for a seeded generator: compiled numba kernels,
one fused pass per tree level (:mod:`domainfm.models.git._task_tree_numba`, the default), and
vectorised torch operations over :mod:`domainfm.data_loaders.graph.sampling`
(``DOMAINFM_GRAPH_BACKEND=torch``, or when numba cannot be imported). Trees are built on CPU, in
data loading, as PyG's loaders do; move a batch with :meth:`TaskTreeBatch.to`.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from torch import Tensor

from domainfm.data_loaders.graph.sampling import (
    _FLOYD_MAX_FANOUT,
    CSR,
    _nonzero,
    _sample_slots,
    _segment_arange,
    build_csr,
)
from domainfm.data_loaders.graph.validation import TASKS, GraphError, check_graph

if TYPE_CHECKING:  # pragma: no cover
    from domainfm.data_loaders.graph.datasets import GraphDataset

__all__ = ["TaskTreeBatch", "build_task_trees", "merge_task_trees", "PretrainTaskTable"]


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
        from domainfm.models.git import _task_tree_numba
    except ImportError:  # numba not installed: the vectorised torch path does the same work
        return None
    except RuntimeError as err:  # numba present but unusable here (e.g. "cannot cache function")
        if not _NUMBA_FAILED:
            warnings.warn(f"numba task-tree kernels unavailable ({err}); using the torch path", RuntimeWarning,
                          stacklevel=3)
            _NUMBA_FAILED.append(str(err))
        return None
    return _task_tree_numba


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
