"""Synthetic training series for forecasting models: KernelSynth and TSMixup (Chronos).

* **KernelSynth** (Chronos, Ansari et al. 2024, Alg. 2): draw 1-5 kernels from a bank
  (ExpSineSquared with periodicities of hourly, daily, weekly, monthly, quarterly and yearly data;
  DotProduct; RBF; RationalQuadratic; White; Constant), combine them with random ``+`` / ``×``
  (a left fold, as ``functools.reduce``), and sample the Gaussian-process prior on 1024 points.
* **TSMixup** (Chronos, Alg. 1): a convex combination, with Dirichlet(``alpha``) weights, of
  windows of 1 to ``max_series`` series of one random length, each first divided by its mean
  absolute value. Each component is a real series with probability ``real_share``, chosen before
  the length so that short real series take part as often as asked.
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
    "mix_series",
    "cut_window",
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


def mix_series(parts: list[np.ndarray], rng: np.random.Generator, *, alpha: float = 1.5, min_length: int = 128,
               max_length: int = 2048) -> np.ndarray:
    """TSMixup (Chronos Alg. 1) of the given series: Dirichlet(``alpha``) weights over windows of
    one random length at random offsets, each divided by its mean |x|. The length is drawn per mix
    from what its series allow: between ``min(min_length, shortest)`` and ``min(max_length,
    shortest)``, so a real series shorter than ``min_length`` still takes part (as a shorter mix)."""
    high = min(max_length, min(len(p) for p in parts))
    length = int(rng.integers(min(min_length, high), high + 1))
    weights = rng.dirichlet(np.full(len(parts), alpha))
    out = np.zeros(length, dtype=np.float64)
    for w, series in zip(weights, parts):
        start = int(rng.integers(0, len(series) - length + 1))
        window = np.asarray(series[start : start + length], dtype=np.float64)
        observed = np.abs(window[np.isfinite(window)])
        scale = observed.mean() if observed.size else 0.0
        out += w * window / (scale if scale > 0 else 1.0)
    return out.astype(np.float32)


def ts_mixup(pool: list[np.ndarray], rng: np.random.Generator, *, max_series: int = 3, alpha: float = 1.5,
             min_length: int = 128, max_length: int = 2048, real: list[np.ndarray] = (), real_share: float = 0.0,
             sources: list[str] | None = None) -> np.ndarray:
    """One TSMixup series: a Dirichlet(``alpha``)-weighted mix (:func:`mix_series`) of windows of
    1..``max_series`` series, each drawn from ``real`` with probability ``real_share`` (when
    ``real`` holds any series, and always when ``pool`` is empty), otherwise from ``pool``. The
    components are chosen before the length, whatever their lengths, so the share of real series
    in the mixes is ``real_share`` (Chronos mixes its real corpus only: ``real_share=1``).
    ``sources``, when given, receives ``"real"`` or ``"synthetic"`` per component."""
    if not len(pool) and not len(real):
        raise ValueError("ts_mixup: no series to mix (the pool and the real series are both empty)")
    if not 0 <= real_share <= 1:
        raise ValueError(f"real_share={real_share}: expected a probability")
    k = int(rng.integers(1, max_series + 1))
    parts = []
    for _ in range(k):
        from_real = len(real) > 0 and (not len(pool) or rng.random() < real_share)
        source = real if from_real else pool
        parts.append(source[int(rng.integers(len(source)))])
        if sources is not None:
            sources.append("real" if from_real else "synthetic")
    return mix_series(parts, rng, alpha=alpha, min_length=min_length, max_length=max_length)


def cut_window(series: np.ndarray, draw_end, *, min_past: int, prediction_length: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(past values, future of ``prediction_length``) cut from ``series`` at a random point.

    A series of at least ``min_past + prediction_length`` values ends its future at ``draw_end(low,
    high)`` (an integer in ``[low, high]``), with at least ``min_past`` values before it. A shorter
    series (a real yearly or quarterly series; Chronos filters them out) is kept: at least half of
    it (up to ``min_past`` values) is context, the rest (at least one step) future, right-padded
    with NaN to ``prediction_length`` (the loss ignores the missing tail)."""
    series = np.asarray(series, dtype=np.float32)
    n = len(series)
    need = min_past + prediction_length
    if n >= need:
        end = int(draw_end(need, n))
        return series[: end - prediction_length], series[end - prediction_length : end]
    if n < 2:
        raise ValueError(f"cut_window: a series of {n} value(s) has no context and future to split into")
    past = max(1, min(min_past, n // 2))
    split = int(draw_end(past, n - 1))
    future = series[split : split + prediction_length]
    return series[:split], np.concatenate([future, np.full(prediction_length - len(future), np.nan, dtype=np.float32)])


class SyntheticWindows(Dataset):
    """Random training windows: with probability ``tsmixup_prob`` from a fresh TSMixup series,
    otherwise from a KernelSynth series of the pool; then context/future split and missing values
    injected into the context (probability ``U(0, missing_prob)`` per value). Draws use numpy's
    global generator (seeded and restored by the engine)."""

    def __init__(self, kernel_synth: np.ndarray, extra: list[np.ndarray], *, context_length: int, prediction_length: int,
                 num_windows: int, tsmixup_prob: float = 0.9, missing_prob: float = 0.2, min_past: int = 60,
                 tsmixup: dict[str, Any] | None = None):
        self.kernel_synth = [np.asarray(s, dtype=np.float32) for s in kernel_synth]
        self.real = [np.asarray(s, dtype=np.float32) for s in extra]
        self.context_length, self.prediction_length = context_length, prediction_length
        self.num_windows, self.tsmixup_prob, self.missing_prob = num_windows, tsmixup_prob, missing_prob
        self.min_past = min(min_past, context_length)
        self.tsmixup = dict(tsmixup or {})
        self.tsmixup.setdefault("min_length", self.min_past + prediction_length)
        # Chronos mixes its real corpus only; without real series the mixes are of KernelSynth
        self.tsmixup.setdefault("real_share", 1.0)

    def __len__(self) -> int:
        return self.num_windows

    def series(self) -> np.ndarray:
        rng = np.random.default_rng(np.random.randint(0, 2**31 - 1))
        if rng.random() < self.tsmixup_prob:
            return ts_mixup(self.kernel_synth, rng, real=self.real, **self.tsmixup)
        return self.kernel_synth[int(rng.integers(len(self.kernel_synth)))]

    def __getitem__(self, index: int):
        past, future = cut_window(self.series(), lambda low, high: np.random.randint(low, high + 1),
                                  min_past=self.min_past, prediction_length=self.prediction_length)
        context = left_pad(past, self.context_length)
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
