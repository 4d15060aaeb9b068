"""Synthetic training series for forecasting models: KernelSynth and TSMixup (Chronos).

* **KernelSynth** (Chronos, Ansari et al. 2024, Alg. 2): draw 1-5 kernels from a bank
  (ExpSineSquared with periodicities of hourly, daily, weekly, monthly, quarterly and yearly data;
  DotProduct; RBF; RationalQuadratic; White; Constant), combine them with random ``+`` / ``×``
  (a left fold, as ``functools.reduce``), and sample the Gaussian-process prior on 1024 points.
* **TSMixup** (Chronos, Alg. 1): a convex combination, with Dirichlet(``alpha``) weights, of
  windows of 1 to ``max_series`` series of one random length, each first divided by its mean
  absolute value.
* :class:`SyntheticWindows` serves random (context, future) training windows drawn from both,
  with missing values injected into the context; :func:`fixed_windows` freezes ``n`` of them
  into a validation set.

**Shapes:** a series is ``(T,)`` float32; a window is ``(context_length,)`` context (NaN =
missing, left-padded) and ``(prediction_length,)`` future.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from domainfm.data_loaders.timeseries import left_pad

__all__ = [
    "KERNEL_BANK",
    "KERNEL_LENGTH",
    "kernel_matrix",
    "sample_kernel_synth",
    "generate_kernel_synth",
    "ts_mixup",
    "SyntheticWindows",
    "fixed_windows",
]

KERNEL_LENGTH = 1024  # Chronos: series of 1024 points on [0, 1]; periodicities are given in these units


def _per(n: float) -> tuple[str, dict]:
    return ("exp_sine_squared", {"periodicity": n / KERNEL_LENGTH, "length_scale": 1.0})


# Chronos's kernel bank (scripts/kernel-synth.py): periodicities for hourly (24, 48, 96, x7),
# daily (7, 14, 30, 60, 365, 730), weekly (4, 26, 52), monthly (4, 6, 12), quarterly (4, 40)
# and yearly (10) data, plus linear, smooth, rough and noise kernels.
KERNEL_BANK: tuple[tuple[str, dict], ...] = (
    _per(24), _per(48), _per(96), _per(24 * 7), _per(48 * 7), _per(96 * 7),
    _per(7), _per(14), _per(30), _per(60), _per(365), _per(365 * 2),
    _per(4), _per(26), _per(52),
    _per(4), _per(6), _per(12),
    _per(4), _per(4 * 10),
    _per(10),
    ("dot_product", {"sigma_0": 0.0}), ("dot_product", {"sigma_0": 1.0}), ("dot_product", {"sigma_0": 10.0}),
    ("rbf", {"length_scale": 0.1}), ("rbf", {"length_scale": 1.0}), ("rbf", {"length_scale": 10.0}),
    ("rational_quadratic", {"alpha": 0.1, "length_scale": 1.0}), ("rational_quadratic", {"alpha": 1.0, "length_scale": 1.0}),
    ("rational_quadratic", {"alpha": 10.0, "length_scale": 1.0}),
    ("white", {"noise_level": 0.1}), ("white", {"noise_level": 1.0}),
    ("constant", {"constant_value": 1.0}),
)


def kernel_matrix(spec: tuple[str, dict], x: np.ndarray) -> np.ndarray:
    """Covariance matrix of one bank kernel on points ``x`` (as scikit-learn's kernels define it)."""
    kind, p = spec
    d = x[:, None] - x[None, :]
    if kind == "exp_sine_squared":
        return np.exp(-2.0 * np.sin(np.pi * np.abs(d) / p["periodicity"]) ** 2 / p["length_scale"] ** 2)
    if kind == "dot_product":
        return p["sigma_0"] ** 2 + np.outer(x, x)
    if kind == "rbf":
        return np.exp(-0.5 * d**2 / p["length_scale"] ** 2)
    if kind == "rational_quadratic":
        return (1.0 + d**2 / (2.0 * p["alpha"] * p["length_scale"] ** 2)) ** (-p["alpha"])
    if kind == "white":
        return p["noise_level"] * np.eye(len(x))
    if kind == "constant":
        return np.full((len(x), len(x)), p["constant_value"])
    raise ValueError(f"unknown kernel kind {kind!r}")


def _sample_gaussian(cov: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    n = len(cov)
    z = rng.standard_normal(n)
    jitter = 1e-8 * max(1.0, float(np.mean(np.diag(cov))))
    try:
        return np.linalg.cholesky(cov + jitter * np.eye(n)) @ z
    except np.linalg.LinAlgError:
        # not numerically positive definite (e.g. a product of periodic kernels): eigh, clipped
        vals, vecs = np.linalg.eigh(cov)
        return vecs @ (np.sqrt(np.clip(vals, 0, None)) * z)


def sample_kernel_synth(rng: np.random.Generator, *, length: int = KERNEL_LENGTH, max_kernels: int = 5) -> np.ndarray:
    """One KernelSynth series of ``length`` points (time ``i / (1024 - 1)``, so periodicities keep
    their meaning in samples at any length)."""
    if max_kernels < 1:
        raise ValueError(f"max_kernels={max_kernels}: must be >= 1")
    x = np.arange(length, dtype=np.float64) / (KERNEL_LENGTH - 1)
    chosen = rng.integers(0, len(KERNEL_BANK), size=rng.integers(1, max_kernels + 1))
    ops = rng.integers(0, 2, size=len(chosen) - 1)  # 0: +, 1: ×, equally likely
    mats = [kernel_matrix(KERNEL_BANK[i], x) for i in chosen]
    cov = functools.reduce(lambda acc, pair: acc * pair[1] if pair[0] else acc + pair[1], zip(ops, mats[1:]), mats[0])
    series = _sample_gaussian(cov, rng)
    if not np.all(np.isfinite(series)):  # pragma: no cover - guarded by the eigh fallback
        return sample_kernel_synth(rng, length=length, max_kernels=max_kernels)
    return series


def generate_kernel_synth(n: int, *, length: int = KERNEL_LENGTH, max_kernels: int = 5, seed: int = 0) -> np.ndarray:
    """``n`` KernelSynth series, (n, length) float32, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return np.stack([sample_kernel_synth(rng, length=length, max_kernels=max_kernels) for _ in range(n)]).astype(np.float32)


def ts_mixup(pool: list[np.ndarray], rng: np.random.Generator, *, max_series: int = 3, alpha: float = 1.5,
             min_length: int = 128, max_length: int = 2048) -> np.ndarray:
    """One TSMixup series: a Dirichlet(``alpha``)-weighted mix of windows of 1..``max_series``
    series from ``pool``, each of the same random length and divided by its mean |x|."""
    k = int(rng.integers(1, max_series + 1))
    longest = max(len(p) for p in pool)
    high = min(max_length, longest)
    length = int(rng.integers(min(min_length, high), high + 1))
    weights = rng.dirichlet(np.full(k, alpha))
    out = np.zeros(length, dtype=np.float64)
    for w in weights:
        candidates = [p for p in pool if len(p) >= length] or [max(pool, key=len)]
        series = candidates[int(rng.integers(len(candidates)))]
        start = int(rng.integers(0, len(series) - min(length, len(series)) + 1))
        window = np.asarray(series[start : start + length], dtype=np.float64)
        if len(window) < length:  # shorter than asked: left-pad with its first value
            window = np.concatenate([np.full(length - len(window), window[0]), window])
        scale = np.nanmean(np.abs(window))
        out += w * window / (scale if scale > 0 else 1.0)
    return out.astype(np.float32)


class SyntheticWindows(Dataset):
    """Random training windows: with probability ``tsmixup_prob`` from a fresh TSMixup series,
    otherwise from a KernelSynth series of the pool; then context/future split and missing values
    injected into the context (probability ``U(0, missing_prob)`` per value). Draws use numpy's
    global generator (seeded and restored by the engine)."""

    def __init__(self, kernel_synth: np.ndarray, extra: list[np.ndarray], *, context_length: int, prediction_length: int,
                 num_windows: int, tsmixup_prob: float = 0.9, missing_prob: float = 0.2, min_past: int = 60,
                 tsmixup: dict[str, Any] | None = None):
        self.kernel_synth = [np.asarray(s, dtype=np.float32) for s in kernel_synth]
        self.pool = self.kernel_synth + [np.asarray(s, dtype=np.float32) for s in extra]
        self.context_length, self.prediction_length = context_length, prediction_length
        self.num_windows, self.tsmixup_prob, self.missing_prob = num_windows, tsmixup_prob, missing_prob
        self.min_past = min(min_past, context_length)
        self.tsmixup = dict(tsmixup or {})
        self.tsmixup.setdefault("min_length", self.min_past + prediction_length)

    def __len__(self) -> int:
        return self.num_windows

    def series(self) -> np.ndarray:
        rng = np.random.default_rng(np.random.randint(0, 2**31 - 1))
        if rng.random() < self.tsmixup_prob:
            return ts_mixup(self.pool, rng, **self.tsmixup)
        return self.kernel_synth[int(rng.integers(len(self.kernel_synth)))]

    def __getitem__(self, index: int):
        series = self.series()
        need = self.min_past + self.prediction_length
        if len(series) < need:
            series = np.concatenate([np.full(need - len(series), np.nan, dtype=np.float32), series])
        end = np.random.randint(need, len(series) + 1)
        future = series[end - self.prediction_length : end]
        context = left_pad(series[: end - self.prediction_length], self.context_length)
        if self.missing_prob > 0:
            drop = np.random.rand(self.context_length) < np.random.uniform(0, self.missing_prob)
            context = np.where(drop, np.float32(np.nan), context)
        return torch.from_numpy(np.ascontiguousarray(context, dtype=np.float32)), torch.from_numpy(
            np.ascontiguousarray(future, dtype=np.float32))


def fixed_windows(dataset: Dataset, n: int, seed: int) -> TensorDataset:
    """``n`` windows of ``dataset`` drawn once under ``seed`` (a validation set that never changes),
    leaving numpy's global generator as it was."""
    state = np.random.get_state()
    try:
        np.random.seed(seed)
        items = [dataset[i] for i in range(n)]
    finally:
        np.random.set_state(state)
    return TensorDataset(torch.stack([c for c, _ in items]), torch.stack([f for _, f in items]))
