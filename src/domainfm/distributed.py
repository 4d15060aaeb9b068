"""Which process of a multi-process launch this is, read from the launcher's environment before
any process group exists, so the CLI can decide who owns the run folder.

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

__all__ = ["launch_rank", "launched_world_size", "RUN_DIR_ENV"]

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


def launched_world_size() -> int:
    """How many processes the launcher started (1 when nothing says otherwise)."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = _int(name)
        if value:
            return value
    return 1
