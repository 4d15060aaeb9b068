"""Pretraining WaveToken / Chronos models on synthetic series: KernelSynth and TSMixup.

* **KernelSynth** (Chronos, Ansari et al. 2024, Alg. 2): draw 1-5 kernels from a bank
  (ExpSineSquared with periodicities of hourly, daily, weekly, monthly, quarterly and yearly data;
  DotProduct; RBF; RationalQuadratic; White; Constant), combine them with random ``+`` / ``×``
  (a left fold, as ``functools.reduce``), and sample the Gaussian-process prior on 1024 points.
* **TSMixup** (Chronos, Alg. 1): a convex combination, with Dirichlet(``alpha``) weights, of
  windows of 1 to ``max_series`` series of one random length, each first divided by its mean
  absolute value.
* The objective is the cross-entropy of the horizon's tokens under teacher forcing (labels of
  missing values ignored), on random (context, future) windows with missing-value injection.

Chronos's recipe (reproduced by ``configs/wavetoken/pretrain*.yaml`` for each size): context 512,
horizon 64, TSMixup 0.9 + KernelSynth 0.1, 200k steps, batch 32, AdamW, lr 1e-3 with linear decay,
no weight decay, drop probability 0.2, min_past 60. Chronos's TSMixup mixes its real training
corpus; here it mixes the KernelSynth pool plus any series you list in ``data.extra_series``
(long-format CSV/Parquet), since no corpus can be downloaded at run time.

``domainfm pretrain wavetoken`` runs ``configs/wavetoken/pretrain.yaml`` (a short run of the
test-sized model); the trained model is written to ``RUN/model`` (``create_model(RUN/model)``).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from domainfm.engine import Recipe, TrainConfig, Trainer

__all__ = [
    "KERNEL_BANK",
    "KERNEL_LENGTH",
    "kernel_matrix",
    "sample_kernel_synth",
    "generate_kernel_synth",
    "ts_mixup",
    "SyntheticWindows",
    "ForecastRecipe",
    "ModelSection",
    "DataSection",
    "Config",
    "build_model",
    "run",
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
        from domainfm.data_loaders.timeseries import left_pad

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


class ForecastRecipe(Recipe):
    """Cross-entropy of the future's tokens given the context's tokens (teacher forcing).

    Tokenization runs on the raw model's tokenizer; the forward pass goes through the engine's
    wrapped module (so data parallel and mixed precision apply).
    """

    def __init__(self, model, train_dataset, val_dataset=None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset

    def _loss(self, model, batch):
        context, future = batch[0], batch[1]
        ids, mask, labels = self.model.training_tokens(context, future)
        logits = model(ids, mask, self.model.shift_right(labels))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        valid = labels != -100
        correct = ((logits.argmax(-1) == labels) & valid).sum()
        return loss, correct, valid.sum()

    def step(self, model, batch):
        loss, correct, total = self._loss(model, batch)
        return loss, {"loss": loss.detach(), "token_accuracy": (correct / total.clamp(min=1)).detach()}

    def eval_step(self, model, batch):
        loss, correct, total = self._loss(model, batch)
        n = batch[0].shape[0]
        return {"loss": loss.detach().float().reshape(1).expand(n), "correct": correct.reshape(1).expand(n) / n,
                "total": total.reshape(1).expand(n).float() / n}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean()),
                "token_accuracy": float(outputs["correct"].sum() / outputs["total"].sum().clamp(min=1))}


# --------------------------------------------------------------------------- config + entry


@dataclass
class ModelSection:
    """Which model to build: a registered variant with keyword overrides, optionally starting
    from saved weights (``init``: a directory written by ``save_pretrained``)."""

    name: str = "wavetoken-test"
    kwargs: dict[str, Any] = field(default_factory=dict)
    init: str | None = None


@dataclass
class DataSection:
    kernel_synth_series: int = 1000
    kernel_synth_length: int = 1024
    max_kernels: int = 5
    tsmixup_prob: float = 0.9
    tsmixup_max_series: int = 3
    tsmixup_alpha: float = 1.5
    tsmixup_min_length: int = 128
    tsmixup_max_length: int = 2048
    extra_series: list[str] = field(default_factory=list)
    windows_per_epoch: int = 10000
    val_windows: int = 256
    missing_prob: float = 0.2
    min_past: int = 60
    seed: int = 0


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=TrainConfig)


def build_model(section: ModelSection):
    from domainfm import create_model

    if section.init:
        return create_model(section.init, **section.kwargs)
    return create_model(section.name, **section.kwargs)


def _load_extra(paths: list[str]) -> list[np.ndarray]:
    from domainfm.data_loaders.timeseries import read_long

    out = []
    for path in paths:
        out.extend(np.asarray(s["target"], dtype=np.float32) for s in read_long(path))
    return out


def parameter_counts(model) -> dict[str, int]:
    return {"params_total": sum(p.numel() for p in model.parameters()),
            "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    import time

    from domainfm import save_pretrained
    from domainfm.engine import atomic_write_text

    run_dir = Path(run_dir)
    d = cfg.data
    if not 0 <= d.tsmixup_prob <= 1:
        raise ValueError(f"data.tsmixup_prob={d.tsmixup_prob}: expected a probability")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    start = time.perf_counter()
    kernel_synth = generate_kernel_synth(d.kernel_synth_series, length=d.kernel_synth_length, max_kernels=d.max_kernels,
                                         seed=d.seed)
    synth_seconds = time.perf_counter() - start
    extra = _load_extra(d.extra_series)
    tsmixup = dict(max_series=d.tsmixup_max_series, alpha=d.tsmixup_alpha, min_length=d.tsmixup_min_length,
                   max_length=d.tsmixup_max_length)
    common = dict(context_length=model.context_length, prediction_length=model.prediction_length,
                  tsmixup_prob=d.tsmixup_prob, missing_prob=d.missing_prob, min_past=d.min_past, tsmixup=tsmixup)
    train = SyntheticWindows(kernel_synth, extra, num_windows=d.windows_per_epoch, **common)
    val = None
    if d.val_windows > 0:
        held_out = generate_kernel_synth(max(8, d.val_windows // 8), length=d.kernel_synth_length,
                                         max_kernels=d.max_kernels, seed=d.seed + 10_000)
        val = fixed_windows(SyntheticWindows(held_out, [], num_windows=d.val_windows, **common), d.val_windows, d.seed + 1)
    trainer = Trainer(cfg.train, run_dir=run_dir)
    result = trainer.fit(ForecastRecipe(model, train, val))
    best = run_dir / "checkpoints" / "best.safetensors"
    if best.is_file():
        from safetensors.torch import load_model

        load_model(model, str(best))
    save_pretrained(model, run_dir / "model")
    report = {
        "model": getattr(model, "domainfm_name", cfg.model.name),
        "init": f"pretrained: {cfg.model.init}" if cfg.model.init else "random",
        **parameter_counts(model),
        "steps": result.global_step,
        "kernel_synth_series": d.kernel_synth_series,
        "kernel_synth_series_per_s": round(d.kernel_synth_series / max(synth_seconds, 1e-9), 1),
        "extra_series": len(extra),
        "model_dir": str(run_dir / "model"),
    }
    train_losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    if train_losses:
        report["train_loss_first"], report["train_loss_last"] = train_losses[0], train_losses[-1]
    for key, value in result.last_val.items():
        report[f"val_{key}"] = value
    report["uniform_loss"] = math.log(model.vocab_size)  # cross-entropy of a model that knows nothing
    atomic_write_text(run_dir / "pretrain_summary.json", json.dumps(report, indent=2) + "\n")
    return report
