"""Compiled (numba) kernels for task-tree construction: one fused pass per tree level.

The vectorised torch path in :mod:`domainfm.models.git.task_trees` needs about twenty passes over
the sampled neighbours of a level (segment offsets, gathers, the first-occurrence dedupe of the
shared form); these kernels do the same work in one loop. They consume the same random numbers
in the same order and place nodes in the same first-occurrence order, so for a seeded generator
both paths build *identical* task-trees (tests/data_loaders/test_graph.py checks it), and either
can be used (``DOMAINFM_GRAPH_BACKEND=torch|numba``).

numba comes with scanpy (a dependency of domainfm); when it cannot be imported the torch path is
used.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def count_big(rowptr, front, k):  # pragma: no cover - compiled; covered through the equivalence tests
    """Number of ``front`` nodes with more than ``k`` in-neighbours (the rows Floyd samples)."""
    big = 0
    for r in range(front.shape[0]):
        v = front[r]
        if rowptr[v + 1] - rowptr[v] > k:
            big += 1
    return big


@njit(cache=True, nogil=True)
def expand_level(rowptr, col, eid, front, k, u, pos, base, size, shared, want_eid):  # pragma: no cover
    """Sample up to ``k`` (all when ``k < 0``) distinct in-neighbours of every ``front`` node and
    place them as the next tree level.

    Rows with more than ``k`` neighbours use Floyd's algorithm with column ``b`` of ``u`` (the b-th
    such row): for j = d-k .. d-1, t = min(floor(u[i, b] * (j + 1)), j), replaced by j when
    already chosen -- exactly the torch path's :func:`graph._floyd`. Shared form: a neighbour
    seen before in this build (``pos[v] >= base``) reuses its node, a new one gets position
    ``size + n_new`` and ``pos[v] = base + position``. Unrolled form: every sample is a new node.

    Returns (child positions, parent rows, graph-edge ids or an empty array, ids of the new nodes).
    """
    n = front.shape[0]
    total = 0
    for r in range(n):
        v = front[r]
        d = rowptr[v + 1] - rowptr[v]
        total += d if (k < 0 or d <= k) else k
    child_pos = np.empty(total, np.int64)
    parent = np.empty(total, np.int64)
    eids = np.empty(total if want_eid else 0, np.int64)
    new_ids = np.empty(total, np.int64)
    chosen = np.empty(max(k, 1), np.int64)
    n_new = 0
    o = 0
    b = 0
    for r in range(n):
        v = front[r]
        s = rowptr[v]
        d = rowptr[v + 1] - s
        sampled = k >= 0 and d > k
        m = k if sampled else d
        narrow = d < 63  # "already chosen" as one bit test, as in the torch path
        mask = np.int64(0)
        for i in range(m):
            if sampled:
                j = d - k + i
                t = min(np.int64(u[i, b] * (j + 1)), j)
                if narrow:
                    if (mask >> t) & 1:
                        t = j
                    mask |= np.int64(1) << t
                else:
                    for q in range(i):
                        if chosen[q] == t:
                            t = j
                            break
                    chosen[i] = t
            else:
                t = i
            slot = s + t
            w = col[slot]
            parent[o] = r
            if want_eid:
                eids[o] = eid[slot]
            if shared:
                p = pos[w]
                if p < base:
                    p = base + size + n_new
                    pos[w] = p
                    new_ids[n_new] = w
                    n_new += 1
                child_pos[o] = p - base
            else:
                child_pos[o] = size + o
                new_ids[o] = w
            o += 1
        if sampled:
            b += 1
    if not shared:
        n_new = total
    return child_pos, parent, eids, new_ids[:n_new]
