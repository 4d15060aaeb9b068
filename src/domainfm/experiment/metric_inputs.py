"""Array inputs of the metric modules: one conversion point and one finiteness check.

Shared by :mod:`domainfm.experiment.metrics` and :mod:`domainfm.experiment.forecast_metrics`, so
that both accept numpy arrays, Python sequences and torch tensors in the same way and name
the offending argument in their errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ArrayLike", "to_numpy", "check_finite"]

ArrayLike = Any  # numpy array, torch tensor, or nested Python sequence


def to_numpy(x: ArrayLike, name: str) -> np.ndarray:
    """One conversion point: torch tensors leave autograd and the device here."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor, without importing torch
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.double()  # bf16/fp16 have no numpy equivalent; fp64 for the sums below
        x = x.numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: cannot be read as an array ({err})") from err
    if arr.dtype == object:
        raise ValueError(f"{name}: expected a numeric or label array, got ragged or object data")
    if arr.size == 0:
        raise ValueError(f"{name}: is empty; at least one value is needed")
    return arr


def check_finite(arr: np.ndarray, name: str) -> None:
    if np.issubdtype(arr.dtype, np.inexact) and not np.all(np.isfinite(arr)):
        n_nan = int(np.isnan(arr).sum())
        n_inf = int(np.isinf(arr).sum())
        raise ValueError(f"{name}: contains {n_nan} NaN and {n_inf} infinite value(s); all values must be finite")
