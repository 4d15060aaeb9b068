"""Which process of a multi-process launch this is, read from the launcher's environment before
any process group exists, so the CLI can decide who owns the run folder; and the few collectives
the pretraining objectives share (the process group's size, sums and means over the global batch;
torch is imported only by those).

Launchers and what they set:

* Lightning Fabric's own launcher (``train.devices=N``): the process the user started is rank 0
  and sets nothing; it re-runs the same command line for ranks ``1..N-1`` with ``LOCAL_RANK``
  (and ``NODE_RANK``, ``WORLD_SIZE``) set. It also passes its own environment on, which is how
  rank 0 hands the run folder it opened to the others (:data:`RUN_DIR_ENV`).
* ``torchrun``: every rank starts at once with ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``.
* SLURM (``srun``): ``SLURM_PROCID`` is the global rank when several tasks run the command.
"""
from __future__ import annotations

import os

__all__ = ["launch_rank", "RUN_DIR_ENV", "process_group_size", "all_reduce_sum", "global_batch_mean"]

#: set by the rank that opened the run folder, read by the ranks it launches
RUN_DIR_ENV = "DOMAINFM_RUN_DIR"


def _int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer (a launcher's process rank)") \
            from None


def launch_rank() -> int:
    """This process's global rank as the launcher set it; 0 for a process started on its own."""
    rank = _int("RANK")
    if rank is not None:
        return rank
    local, node = _int("LOCAL_RANK"), _int("NODE_RANK")
    if local is not None or node is not None:
        # Fabric's launcher: global rank 0 is local rank 0 on node 0; the exact number of the
        # others does not matter here, only whether this process is rank 0
        return 0 if not local and not node else max(1, (node or 0) * 1_000 + (local or 0))
    if (_int("SLURM_NTASKS") or 1) > 1:
        return _int("SLURM_PROCID") or 0
    return 0


def process_group_size() -> int:
    """Ranks in the initialised process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(x):
    """``x`` summed over the ranks, as a detached float64 copy (``x`` itself untouched; one
    process: the copy). Counts of masked values or tokens are exact in float64."""
    import torch

    total = x.detach().to(dtype=torch.float64).clone()
    if process_group_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(total)
    return total


def global_batch_mean(summed, count):
    """This rank's share of the mean over the global batch: ``summed · world / Σ_ranks count``.

    A loss whose terms (masked values, tokens) fall unevenly on the ranks: each rank's own mean
    would weigh its terms by how many it happens to hold. With this, DDP's averaging of the
    gradients over ranks gives exactly the gradient of one process holding the whole batch, and
    the mean the engine logs over ranks is that process's loss. One process: ``summed / count``
    (``count`` at least 1)."""
    world = process_group_size()
    if world == 1:
        return summed / count.clamp(min=1).to(summed.dtype)
    return summed * (world / all_reduce_sum(count).clamp(min=1)).to(summed.dtype)
