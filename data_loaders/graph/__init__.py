"""Graphs for GIT: validation, CSR neighbour sampling, text features, datasets; task-trees re-exported.

One idea per module (PyG's layout):

* :mod:`.validation`: :class:`GraphError`, :func:`check_graph`;
* :mod:`.sampling`: :class:`CSR`, :func:`build_csr`, :func:`sample_neighbors`;
* :mod:`.text`: text encoders (all-MiniLM-L6-v2 offline, hashing fallback), the shipped embedding
  table and the on-disk cache;
* :mod:`.datasets`: :class:`GraphDataset`, the shipped graphs, TUDataset / ``.npz`` / PyG loaders,
  link-prediction splits;
* :mod:`.files`: :func:`read_graph` (a ``torch.save``'d PyG ``Data``, read weights-only with
  PyG's classes allow-listed; a ``.npz``; a shipped graph's name), :func:`read_ids`,
  :func:`select_tasks` (the tasks a model is applied to);
* task-trees (:class:`TaskTreeBatch`, :func:`build_task_trees`, :func:`merge_task_trees`,
  :class:`PretrainTaskTable`) live beside GIT's model in :mod:`domainfm.models.git.task_trees`,
  with their numba kernels, and are re-exported here.

Everything works on plain torch + torch-geometric from PyPI (no pyg-lib / torch-sparse).

Bad input raises :class:`GraphError` naming the graph and the field. Documented handling:
isolated nodes are allowed (their tree has no children; a mean over no neighbours is 0, so a SAGE
layer gives ``lin_l.bias + lin_r(x)``); self-loops and parallel edges are kept as given; empty
graphs (no nodes), node features that are not 2-D, feature widths that differ across graphs,
non-finite features and edge indices outside ``[0, num_nodes)`` are errors.
"""
from __future__ import annotations

import importlib

from .datasets import (
    LINK_CLASS_TEXTS,
    SHIPPED_DATASETS,
    GraphDataset,
    _stratified_split,  # noqa: F401  (used by tests of the fine-tuning recipe)
    from_pyg,
    link_prediction_split,
    load_dataset,
    load_graph_dir,
    load_karate,
    load_cuneiform,
    load_solubility,
    load_nci,
    load_kinships,
    load_mutag,
    load_nations,
    load_tu_dataset,
    shipped_texts,
)
from .files import graph_from_pyg, pyg_safe_globals, read_graph, read_ids, read_pyg_file, select_tasks
from .sampling import CSR, build_csr, sample_neighbors
from .text import (
    MINILM,
    MINILM_DIM,
    SHIPPED_EMBEDDINGS,
    CachedTextEncoder,
    HashingTextEncoder,
    SentenceTransformerEncoder,
    ShippedEmbeddings,
    TextEncoder,
    samples_dir,
    text_encoder,
    write_embedding_table,
)
from .validation import TASKS, GraphError, check_graph

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
    "load_kinships",
    "load_cuneiform",
    "load_solubility",
    "load_nci",
    "load_graph_dir",
    "from_pyg",
    "graph_from_pyg",
    "read_graph",
    "read_ids",
    "read_pyg_file",
    "select_tasks",
    "pyg_safe_globals",
    "link_prediction_split",
    "merge_task_trees",
    "PretrainTaskTable",
    "shipped_texts",
    "write_embedding_table",
    "load_dataset",
    "samples_dir",
    "SHIPPED_DATASETS",
    "SHIPPED_EMBEDDINGS",
    "LINK_CLASS_TEXTS",
    "MINILM",
    "MINILM_DIM",
]

# Task-trees are resolved on first use: domainfm.models.git.task_trees imports this package's
# sampling and validation modules, so an eager import here would be circular whenever the
# task-tree module is imported first.
_TASK_TREE_NAMES = ("TaskTreeBatch", "build_task_trees", "merge_task_trees", "PretrainTaskTable")


def __getattr__(name: str):
    if name in _TASK_TREE_NAMES:
        value = getattr(importlib.import_module("domainfm.models.git.task_trees"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TASK_TREE_NAMES))
