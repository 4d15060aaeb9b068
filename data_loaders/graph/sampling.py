"""CSR in-neighbour lists and uniform neighbour sampling without replacement, vectorised over all
nodes of a batch (no Python loop per node or per edge; plain torch + NumPy, no pyg-lib).

Rows with more neighbours than the fan-out are sampled by Floyd's algorithm (``fanout`` vectorised
steps) up to :data:`_FLOYD_MAX_FANOUT`, above it by ranking random keys within each row. The
task-tree kernels (:mod:`domainfm.models.git.task_trees`) draw the same random numbers the same way,
so both paths sample the same neighbours for a seeded generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["CSR", "build_csr", "sample_neighbors"]


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
