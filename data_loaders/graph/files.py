"""A graph to apply a model to, from whatever the user has: a PyG ``Data`` (or a list of them)
saved with ``torch.save``, a ``.npz`` graph as :func:`~.datasets.load_graph_dir` reads it, or
the name of a shipped graph (``karate``, ``nations``, ``mutag``: the PyG-style datasets this
package resolves offline).

``torch.save`` files are read with ``torch.load(weights_only=True)`` and only PyG's ``Data``
class and its storage classes allow-listed (:data:`PYG_SAFE_GLOBALS`): a file that needs any other
class is refused, never unpickled.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .datasets import SHIPPED_DATASETS, GraphDataset, load_dataset, load_graph_dir
from .text import TextEncoder
from .validation import TASKS, GraphError, check_graph

__all__ = ["read_graph", "read_pyg_file", "pyg_safe_globals", "graph_from_pyg", "read_ids", "select_tasks"]


def pyg_safe_globals() -> list[type]:
    """The classes a pickled PyG ``Data`` refers to (and nothing else)."""
    from torch_geometric.data import Data
    from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
    from torch_geometric.data.storage import EdgeStorage, GlobalStorage, NodeStorage

    return [Data, DataEdgeAttr, DataTensorAttr, GlobalStorage, NodeStorage, EdgeStorage]


def read_pyg_file(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` with only PyG's ``Data`` classes allow-listed.
    A file that is not a torch archive, or that needs another class, is a :class:`GraphError`
    naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such graph file")
    try:
        with torch.serialization.safe_globals(pyg_safe_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        # torch names the refused class and advises torch.serialization.add_safe_globals: advice for
        # code that calls torch.load itself, which would have the user trust a class this reader
        # never unpickles; only the class name is kept
        found = re.search(r"GLOBAL\s+([\w.]+)", str(exc))
        refused = found.group(1) if found else None
        if refused and refused.startswith("torch_geometric.data.batch"):
            raise GraphError(f"{path}: holds a PyG Batch, which is not read (unpickling a Batch needs its dynamically "
                             "created class); save its graphs instead: torch.save(batch.to_data_list(), path) "
                             "(a list of Data: one task per graph)") from None
        detail = f"it needs {refused}" if refused else "weights-only load failed"
        raise GraphError(f"{path}: refused: only a PyG Data (or a list of Data) saved with torch.save is read, "
                         f"and nothing that needs other classes to be unpickled ({detail})") from None
    except Exception as exc:  # noqa: BLE001 - damaged or foreign bytes raise anything from KeyError to RuntimeError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraphError(f"{path}: not a graph saved with torch.save (expected a PyG Data or a list of Data, "
                         f"a .npz graph, or one of {sorted(SHIPPED_DATASETS)}): {first}") from None


def _node_labels(data, name: str) -> Tensor | None:
    y = getattr(data, "y", None)
    if y is None or not isinstance(y, Tensor) or y.numel() != data.num_nodes or y.is_floating_point():
        return None  # no per-node integer labels: predictions need none
    return y.long().view(-1)


def graph_from_pyg(data: Any, *, name: str = "pyg") -> GraphDataset:
    """A :class:`GraphDataset` from one PyG ``Data`` (a node-level graph: its tasks are its nodes;
    ``data.y`` per node and the masks ``train_mask``/``val_mask``/``test_mask`` kept when present)
    or from a list of ``Data`` (a graph-level set: one task per graph). Labels are optional:
    unlabelled tasks get ``y = -1`` and no classes."""
    from torch_geometric.data import Batch, Data

    if isinstance(data, Data):
        x, edge_index = data.x, data.edge_index
        if x is None:
            raise GraphError(f"{name}: the Data object has no node features x")
        if edge_index is None:
            edge_index = torch.zeros(2, 0, dtype=torch.long)
        n = check_graph(x, edge_index, name=name, edge_attr=getattr(data, "edge_attr", None))
        y = _node_labels(data, name)
        splits = {}
        for split in ("train", "val", "test"):
            mask = getattr(data, f"{split}_mask", None)
            if isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.numel() == n:
                splits[split] = mask.nonzero().flatten()
        task, ptr, task_index = "node", None, torch.arange(n)
        edge_attr = data.edge_attr if getattr(data, "edge_attr", None) is not None else None
    elif isinstance(data, (list, tuple)) and data and all(isinstance(d, Data) for d in data):
        for i, d in enumerate(data):
            if d.x is None:
                raise GraphError(f"{name}: graph {i} has no node features x")
            check_graph(d.x, d.edge_index if d.edge_index is not None else torch.zeros(2, 0, dtype=torch.long),
                        name=f"{name}: graph {i}", feature_dim=data[0].x.shape[1])
        batch = Batch.from_data_list(list(data))
        x, edge_index, ptr = batch.x, batch.edge_index, batch.ptr
        edge_attr = batch.edge_attr if getattr(batch, "edge_attr", None) is not None else None
        ys = [getattr(d, "y", None) for d in data]
        y = (torch.stack([v.view(-1)[0] for v in ys]).long()
             if all(isinstance(v, Tensor) and v.numel() >= 1 and not v.is_floating_point() for v in ys) else None)
        task, task_index, splits = "graph", torch.arange(len(data)), {}
    else:
        kind = type(data).__name__ + (f" of {len(data)} items" if isinstance(data, (list, tuple)) else "")
        raise GraphError(f"{name}: holds a {kind}; expected a PyG Data (a graph whose nodes are the tasks) "
                         "or a non-empty list of Data (a set of graphs)")
    n_tasks = task_index.numel()
    n_classes = int(y.max()) + 1 if y is not None and y.numel() and int(y.min()) >= 0 else 0
    if n_classes == 0:
        y = torch.full((n_tasks,), -1, dtype=torch.long)
    return GraphDataset(
        name=name, task=task, x=x.float(), edge_index=edge_index.long(), task_index=task_index, y=y, splits=splits,
        class_texts=[f"class {i}" for i in range(n_classes)], class_emb=torch.zeros(n_classes, x.shape[1]),
        labels=f"from {name}" if n_classes else "none", encoder="unknown",
        edge_attr=edge_attr.float() if edge_attr is not None else None, ptr=ptr)


def read_graph(source: str | os.PathLike | Any, *, encoder: TextEncoder | None = None, seed: int = 0,
               feature_dim: int | None = None) -> GraphDataset:
    """The graph ``source`` names, as a :class:`GraphDataset`.

    Args:
        source: a shipped graph's name (encoded with ``encoder``, default MiniLM), a ``.npz``
            file, a ``torch.save`` file of a PyG ``Data`` / list of ``Data`` (any other suffix),
            or such objects / a :class:`GraphDataset` directly.
        feature_dim: the node-feature width the model expects: another width is a
            :class:`GraphError` naming the source and both widths.
    """
    from torch_geometric.data import Data

    if isinstance(source, GraphDataset):
        ds, label = source, source.name
    elif isinstance(source, Data) or (isinstance(source, (list, tuple)) and source):
        ds, label = graph_from_pyg(source), "the given PyG graph"
    else:
        label = str(source)
        path = Path(source)
        if label in SHIPPED_DATASETS and not path.exists():
            ds = load_dataset(label, encoder, seed=seed)
        elif path.suffix == ".npz":
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such graph file")
            ds = load_graph_dir(path, seed=seed)[0]
        elif path.is_dir():
            raise GraphError(f"{path}: a folder; name one graph file (.npz or a torch.save'd PyG Data)")
        elif not path.exists():
            raise FileNotFoundError(f"{path}: no such graph file, and not one of the shipped graphs "
                                    f"{sorted(SHIPPED_DATASETS)}")
        else:
            ds = graph_from_pyg(read_pyg_file(path), name=str(path))
    if feature_dim is not None and ds.num_features != feature_dim:
        check_graph(ds.x, ds.edge_index, name=label, feature_dim=feature_dim)  # the loader's own message
    return ds


def read_ids(path: str | os.PathLike, *, columns: int | None = None) -> Tensor:
    """Integer ids from a text/CSV file (one id, or ``u,v`` when ``columns=2``, per line; a
    header line is skipped) or a ``.npy`` (ints, or a boolean mask whose true entries are taken
    when ``columns=1``). ``columns=None``: whatever the file holds (two per line or a 2-D array:
    node pairs). Returns (B,) or (2, B)."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such index file")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as exc:
            raise GraphError(f"{path}: not a .npy of plain integers: {exc}") from None
        if columns is None:
            columns = 2 if arr.ndim == 2 else 1
        if arr.dtype == bool and columns == 1 and arr.ndim == 1:
            arr = np.nonzero(arr)[0]
    else:
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            parts = [p for p in line.replace(",", " ").split() if p]
            if not parts:
                continue
            try:
                rows.append([int(p) for p in parts])
            except ValueError:
                if rows or lineno > 1:
                    raise GraphError(f"{path}: line {lineno}: expected {columns} integer id(s), got {line!r}") from None
                continue  # a header
        if columns is None:
            columns = len(rows[0]) if rows and len(rows[0]) == 2 else 1
        if any(len(r) != columns for r in rows):
            raise GraphError(f"{path}: every line must hold {columns} integer id(s)")
        arr = np.asarray(rows, dtype=np.int64).reshape(-1, columns) if rows else np.zeros((0, columns), np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise GraphError(f"{path}: ids must be integers, got {arr.dtype}")
    t = torch.from_numpy(np.ascontiguousarray(arr)).long()
    if columns == 1:
        return t.reshape(-1)
    if t.ndim == 2 and t.shape[1] == 2:
        return t.t().contiguous()
    if t.ndim == 2 and t.shape[0] == 2:
        return t
    raise GraphError(f"{path}: expected node pairs, shape (B, 2) or (2, B); got {tuple(t.shape)}")


def _unordered_edges(edge_index: Tensor) -> Tensor:
    pairs = torch.sort(edge_index, dim=0).values
    return torch.unique(pairs, dim=1) if pairs.numel() else pairs


def select_tasks(ds: GraphDataset, task: str, *, index: Tensor | None = None, split: str | None = None,
                 label: str | None = None) -> GraphDataset:
    """``ds`` holding only the ``task`` tasks (``node`` | ``edge`` | ``graph``) a model is applied
    to, unlabelled (``y = -1``).

    Args:
        index: (B,) node or graph ids, a boolean mask over nodes or graphs, or (2, B) node pairs.
            Default: every node; every graph; for edges, the graph's own edge tasks when it is an
            edge dataset (e.g. Nations' triples), else every distinct unordered edge ``u <= v``
            of ``edge_index`` once.
        split: instead of ``index``: the graph's ``train``/``val``/``test`` tasks.
        label: names the graph in errors (default ``ds.name``).
    """
    label = label or ds.name
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {TASKS}")
    n = ds.x.shape[0]
    ptr = ds.ptr if ds.ptr is not None else torch.tensor([0, n])
    n_graphs = ptr.numel() - 1
    if split is not None:
        if index is not None:
            raise ValueError("give index or split, not both")
        if split not in ds.splits:
            raise GraphError(f"{label}: no split {split!r} (has {sorted(ds.splits) or 'none'})")
        if ds.task != task:
            raise GraphError(f"{label}: its splits hold {ds.task} tasks, not {task} tasks")
        tasks = ds.task_index[..., ds.splits[split]]
    elif index is not None:
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            size = {"node": n, "graph": n_graphs}.get(task)
            if size is None or index.ndim != 1 or index.numel() != size:
                raise GraphError(f"{label}: a boolean mask selects nodes or graphs: expected {size} entries for "
                                 f"{task} tasks, got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        tasks = index.long()
        if task == "edge" and (tasks.ndim != 2 or tasks.shape[0] != 2):
            raise GraphError(f"{label}: edge tasks need node pairs of shape (2, B), got {tuple(tasks.shape)}")
        if task != "edge" and tasks.ndim != 1:
            raise GraphError(f"{label}: {task} tasks need ids of shape (B,), got {tuple(tasks.shape)}")
        bound = n_graphs if task == "graph" else n
        if tasks.numel() and (int(tasks.min()) < 0 or int(tasks.max()) >= bound):
            bad = int(tasks.max()) if int(tasks.max()) >= bound else int(tasks.min())
            raise GraphError(f"{label}: {task} id {bad} is outside [0, {bound})")
    elif task == "node":
        tasks = torch.arange(n)
    elif task == "graph":
        tasks = torch.arange(n_graphs)
    elif ds.task == "edge":
        tasks = ds.task_index
    else:
        tasks = _unordered_edges(ds.edge_index)
    b = tasks.shape[-1]
    return GraphDataset(name=ds.name, task=task, x=ds.x, edge_index=ds.edge_index, task_index=tasks,
                        y=torch.full((b,), -1, dtype=torch.long), splits={}, class_texts=[],
                        class_emb=ds.x.new_zeros(0, ds.num_features), labels="none", encoder=ds.encoder,
                        edge_attr=ds.edge_attr, ptr=ptr if task == "graph" else ds.ptr, _csr=ds._csr)
