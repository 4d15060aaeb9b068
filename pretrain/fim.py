"""FIM imputation pretraining: a synthetic prior of ODE solutions and the official objective.

**The prior.** The official training set (2M ODE solutions) is not released; its path names say
``torch_2M_ode_chebyshev_max_deg_100_rbf_gp_2_5_and_2_10_length_128_avg_min_8``. From these facts
we build a generator of drift-defined 1-D ODEs ``dx/dt = f(t)``, solved on a 128-point grid:

* half of the drifts are Chebyshev series ``f(t) = sum_{k<=K} c_k T_k(2t/T_max - 1)`` with a
  degree ``K ~ U{1..100}``; the other half are RBF Gaussian-process draws. *Inferred*: the
  coefficient decay ``c_k ~ N(0, (1+k)^-1.5)`` (smooth but not trivial), the GP length-scales
  (log-uniform over ``gp_length_scales``, read from "2_5 and 2_10" as [0.2, 0.5] and
  [0.2, 1.0] of the unit interval), the time span ``[0, 1]`` and the drift amplitude.
* ``x(t) = x_0 + ∫ f``, integrated exactly (Chebyshev: antiderivative series) or with the
  trapezoid rule on an 8x finer grid (GP), then read on the 128 grid points; ``x_0 ~ N(0, 1)``.
* The observation pattern (``sample_prior``'s ``observed`` and ``regular``): a share ``regular_fraction`` of the series is
  observed at a regular stride starting at ``t_0`` (every ``s``-th point, ``s`` drawn uniformly among
  the strides that give ``min_observed..max_observed`` points), the rest at a uniform random subset of
  ``n_obs ~ U{min_observed..max_observed}`` points (*inferred*: "avg_min_8" read as at least 8). The
  official training samples bundled with OpenFIM's tests are observed at a regular stride from
  ``t_0``; how the official set mixes patterns is not known, so the default mixes half/half.
* Additive Gaussian noise with std ``U(noise_min, noise_max) * std(x)``: the official samples carry
  noise at 4-35% of the path's std (as measured on them for issue 35; the official generator's
  distribution is not released), so ``noise_max`` defaults to 0.35 and ``noise_min`` to 0 (clean
  observations stay in the prior).

Until issue 35 the prior was ``regular_fraction: 0``, ``noise_max: 0.1`` (the first recipe of the
shipped checkpoint, ``configs/fim/pretrain_synthetic_prior*.yaml``, sets them so; with those values
a seed draws exactly the series it drew then).

**The objective** (official ``FIMImpPointBase.loss``): Gaussian NLL of the drift on the fine grid +
Gaussian NLL of ``x(t_0)`` + 10 x the one-step residual ``sum_k (x_{k+1} - x_k - f̂(t_k) h_k)^2``
(``loss_scale_*`` 1, 1, 10). ``loss_units``: ``"original"`` computes it in the series' own scale
(the official code's choice, so a series of range 10 weighs ~100x one of range 1 in the residual);
``"normalised"`` (default) in the model's own MinMax units (values over the observed range, times
over the observed span: drift ``f * t_range / x_range``, ``x_0`` from ``x_min`` over ``x_range``,
residual over ``x_range^2``), so every series weighs the same whatever its scale: the loss is
invariant to rescaling a series. Paper defaults (``configs/fim/pretrain.yaml``): Adam lr 1e-5,
weight decay 1e-3, clipping 10, batch 1024, 900 epochs, cosine to 1e-7.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "PriorSection", "sample_prior", "regular_strides",
           "SyntheticODEDataset", "FIMRecipe", "fim_loss", "LOSS_UNITS", "run"]

LOSS_UNITS = ("normalised", "original")


@dataclass
class PriorSection:
    n_samples: int = 2_000_000
    n_val: int = 0
    grid_size: int = 128
    t_max: float = 1.0
    min_observed: int = 8
    max_observed: int = 64
    regular_fraction: float = 0.5
    noise_min: float = 0.0
    noise_max: float = 0.35
    max_degree: int = 100
    chebyshev_fraction: float = 0.5
    gp_length_scales: list[float] = field(default_factory=lambda: [0.2, 1.0])
    refine: int = 8
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_observed <= self.max_observed <= self.grid_size:
            raise ValueError(f"prior: need 1 <= min_observed ({self.min_observed}) <= max_observed "
                             f"({self.max_observed}) <= grid_size ({self.grid_size})")
        if not 0 <= self.noise_min <= self.noise_max or not 0 <= self.chebyshev_fraction <= 1:
            raise ValueError(f"prior: need 0 <= noise_min ({self.noise_min}) <= noise_max ({self.noise_max}) and "
                             f"chebyshev_fraction ({self.chebyshev_fraction}) in [0, 1]")
        if not 0 <= self.regular_fraction <= 1:
            raise ValueError(f"prior: regular_fraction={self.regular_fraction}; expected a share in [0, 1]")
        if self.regular_fraction > 0 and not len(regular_strides(self.grid_size, self.min_observed, self.max_observed)):
            raise ValueError(f"prior: no regular stride observes {self.min_observed}-{self.max_observed} of "
                             f"{self.grid_size} points; widen the range or set regular_fraction: 0")


def regular_strides(grid_size: int, min_observed: int, max_observed: int) -> np.ndarray:
    """The strides ``s`` for which every ``s``-th point from the first (``ceil(G / s)`` points) is
    between ``min_observed`` and ``max_observed`` of a ``grid_size``-point grid."""
    s = np.arange(1, grid_size + 1)
    count = -(-grid_size // s)
    return s[(count >= min_observed) & (count <= max_observed)]


def _chebyshev(rng, n, s, max_degree):
    """Drift and its antiderivative (in ``s`` in [-1, 1]) for ``n`` random Chebyshev series."""
    k = np.arange(max_degree + 1)
    degree = rng.integers(1, max_degree + 1, size=n)
    coef = rng.standard_normal((n, max_degree + 1)) * (1.0 + k) ** -1.5 * (k[None] <= degree[:, None])
    basis = np.polynomial.chebyshev.chebvander(s, max_degree)  # (G, K+1)
    anti = np.stack([np.polynomial.chebyshev.chebval(s, np.polynomial.chebyshev.chebint(np.eye(max_degree + 1)[j]))
                     for j in range(max_degree + 1)], axis=1)  # antiderivatives of each T_j (offset removed later)
    return coef @ basis.T, coef @ anti.T


def _gp(rng, n, t_fine, scales):
    lo, hi = math.log(min(scales)), math.log(max(scales))
    bins = np.exp(np.linspace(lo, hi, 8))
    which = rng.integers(0, len(bins), size=n)
    out = np.empty((n, len(t_fine)))
    diff = (t_fine[:, None] - t_fine[None]) / (t_fine[-1] - t_fine[0])
    for b, ell in enumerate(bins):
        rows = np.flatnonzero(which == b)
        if len(rows):
            chol = np.linalg.cholesky(np.exp(-0.5 * (diff / ell) ** 2) + 1e-6 * np.eye(len(t_fine)))
            out[rows] = rng.standard_normal((len(rows), len(t_fine))) @ chol.T
    return out


def sample_prior(n: int, prior: PriorSection, seed: int | None = None) -> dict[str, np.ndarray]:
    """``n`` samples: ``times (G,)``, ``values, drift, noisy (n, G)`` float64, ``observed (n, G)`` bool,
    ``noise_std``, ``is_chebyshev``, ``regular`` (observed at a regular stride from ``t_0``) ``(n,)``.
    Deterministic in ``seed`` (default ``prior.seed``)."""
    rng = np.random.default_rng(prior.seed if seed is None else seed)
    g = prior.grid_size
    times = np.linspace(0.0, prior.t_max, g)
    is_cheb = rng.random(n) < prior.chebyshev_fraction
    drift = np.empty((n, g))
    values = np.empty((n, g))
    x0 = rng.standard_normal(n)
    amplitude = np.exp(rng.uniform(np.log(0.5), np.log(5.0), size=n)) / prior.t_max
    nc = int(is_cheb.sum())
    if nc:
        f, big_f = _chebyshev(rng, nc, 2 * times / prior.t_max - 1, prior.max_degree)
        scale = amplitude[is_cheb] / (np.abs(f).max(axis=1) + 1e-12)
        drift[is_cheb] = f * scale[:, None]
        values[is_cheb] = big_f * (scale * prior.t_max / 2)[:, None]  # ds = 2 dt / t_max
    ng = n - nc
    if ng:
        fine = np.linspace(0.0, prior.t_max, (g - 1) * prior.refine + 1)
        f = _gp(rng, ng, fine, prior.gp_length_scales) * amplitude[~is_cheb, None]
        steps = np.diff(fine)
        path = np.concatenate([np.zeros((ng, 1)), np.cumsum(0.5 * (f[:, 1:] + f[:, :-1]) * steps, axis=1)], axis=1)
        drift[~is_cheb] = f[:, :: prior.refine]
        values[~is_cheb] = path[:, :: prior.refine]
    values = values - values[:, :1] + x0[:, None]
    counts = rng.integers(prior.min_observed, prior.max_observed + 1, size=n)
    ranks = np.argsort(rng.random((n, g)), axis=1).argsort(axis=1)
    observed = ranks < counts[:, None]
    noise_std = rng.uniform(prior.noise_min, prior.noise_max, size=n) * values.std(axis=1)
    noisy = values + rng.standard_normal((n, g)) * noise_std[:, None]
    regular = np.zeros(n, dtype=bool)
    if prior.regular_fraction > 0:  # drawn last, so that regular_fraction: 0 reproduces the draws before issue 35
        regular = rng.random(n) < prior.regular_fraction
        stride = rng.choice(regular_strides(g, prior.min_observed, prior.max_observed), size=n)
        observed[regular] = (np.arange(g)[None] % stride[regular, None]) == 0
    return {"times": times, "values": values, "drift": drift, "noisy": noisy, "observed": observed,
            "noise_std": noise_std, "is_chebyshev": is_cheb, "regular": regular}


class SyntheticODEDataset(Dataset):
    """The prior, generated once (in chunks) and held in memory as float32 tensors.
    Items: ``(times, noisy, observed, values, drift)`` each ``(G,)``."""

    def __init__(self, n: int, prior: PriorSection, seed: int, chunk: int = 4096):
        parts = [sample_prior(min(chunk, n - i), prior, seed=seed * 1_000_003 + i) for i in range(0, n, chunk)]
        self.times = torch.as_tensor(parts[0]["times"], dtype=torch.float32)
        cat = lambda k, dt: torch.as_tensor(np.concatenate([p[k] for p in parts]), dtype=dt)  # noqa: E731
        self.noisy, self.values, self.drift = (cat(k, torch.float32) for k in ("noisy", "values", "drift"))
        self.observed = cat("observed", torch.bool)

    def __len__(self):
        return len(self.noisy)

    def __getitem__(self, i):
        return self.times, self.noisy[i], self.observed[i], self.values[i], self.drift[i]


def fim_loss(model, batch, scales=(1.0, 1.0, 10.0), units: str = "normalised"
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The official objective on a batch ``(times, noisy, observed, values, drift)`` of ``(N, G)``, in
    ``units`` (``"normalised"``: the model's MinMax units of each series; ``"original"``: the series' own)."""
    if units not in LOSS_UNITS:
        raise ValueError(f"fim_loss: units={units!r}; expected one of {', '.join(LOSS_UNITS)}")
    times, noisy, observed, values, drift = batch
    out = model.concepts(times, noisy, ~observed, times)
    mean, log_std, x0, x0_log_std = out["drift_mean"], out["drift_log_std"], out["init_mean"], out["init_log_std"]
    x_ref, x_scale = torch.zeros_like(x0), torch.ones_like(x0)
    drift_scale = torch.ones_like(x0)
    if units == "normalised":  # the model's own normalisation of each row (what it sees and predicts)
        x_ref, x_scale, t_scale = out["x_min"], out["x_range"], out["t_range"]
        drift_scale = x_scale / t_scale
    mean, drift, log_std = mean / drift_scale[:, None], drift / drift_scale[:, None], log_std - drift_scale.log()[:, None]
    x0, x0_true, x0_log_std = (x0 - x_ref) / x_scale, (values[:, 0] - x_ref) / x_scale, x0_log_std - x_scale.log()
    nll_drift = (0.5 * (drift - mean) ** 2 * torch.exp(-2 * log_std) + log_std).mean()
    nll_x0 = (0.5 * (x0_true - x0) ** 2 * torch.exp(-2 * x0_log_std) + x0_log_std).mean()
    step = times[:, 1:] - times[:, :-1]
    # (x_{k+1} - x_k - f h) / x_scale, written with the scaled drift: f h / x_scale = (f / drift_scale) h / t_scale
    t_scale = x_scale / drift_scale
    residual = (((values[:, 1:] - values[:, :-1]) / x_scale[:, None] - mean[:, :-1] * step / t_scale[:, None]) ** 2
                ).sum(dim=1).mean()
    loss = scales[0] * nll_drift + scales[1] * nll_x0 + scales[2] * residual
    return loss, {"loss": loss.detach(), "nll_drift": nll_drift.detach(), "nll_x0": nll_x0.detach(),
                  "euler_residual": residual.detach()}


class FIMRecipe(Recipe):
    """Drift NLL + initial-condition NLL + 10 x one-step residual (official loss scales)."""

    def __init__(self, model, train_dataset, val_dataset=None, scales=(1.0, 1.0, 10.0), units: str = "normalised"):
        self.model, self.train_dataset, self.val_dataset, self.scales = model, train_dataset, val_dataset, scales
        self.units = units

    def step(self, model, batch):
        if hasattr(model, "mark_forward_method") and "concepts" not in model._forward_methods:
            # route the call through DDP's forward (gradient sync) when Fabric wraps the model
            model.mark_forward_method("concepts")
        return fim_loss(model, batch, self.scales, self.units)

    def eval_step(self, model, batch):
        loss, logs = self.step(model, batch)
        n = len(batch[1])
        return {k: v.float().reshape(1).expand(n).clone() for k, v in logs.items()}

    def metrics(self, outputs):
        return {k: float(v.mean()) for k, v in outputs.items()}


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="fim-imputation-base"))
    prior: PriorSection = field(default_factory=PriorSection)
    loss_scales: list[float] = field(default_factory=lambda: [1.0, 1.0, 10.0])
    loss_units: str = "normalised"
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=900, batch_size=1024, lr=1e-5, weight_decay=1e-3, clip_grad_norm=10.0, schedule="cosine",
        min_lr=1e-7, monitor=None))


def run(cfg: Config, run_dir: Path) -> dict:
    """Pretrain on the synthetic prior; saves the model to ``run_dir / "model"``."""
    import domainfm

    if cfg.loss_units not in LOSS_UNITS:
        raise ValueError(f"loss_units={cfg.loss_units!r}; expected one of {', '.join(LOSS_UNITS)}")
    run_dir = Path(run_dir)
    train = SyntheticODEDataset(cfg.prior.n_samples, cfg.prior, seed=cfg.prior.seed)
    val = SyntheticODEDataset(cfg.prior.n_val, cfg.prior, seed=cfg.prior.seed + 1) if cfg.prior.n_val else None
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False))
    train_cfg = cfg.train
    if val is not None and train_cfg.monitor is None:
        import dataclasses

        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    result = Trainer(train_cfg, run_dir=run_dir).fit(FIMRecipe(model, train, val, tuple(cfg.loss_scales), cfg.loss_units))
    best = result.model if result.model is not None else model
    saved = domainfm.save_pretrained(best, run_dir / "model")
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    report = {
        "model": cfg.model.name,
        "init": init_label(cfg.model.pretrained, init_info),
        "objective": "drift NLL + x0 NLL + {:g} x one-step residual (official FIMImpPointBase loss), in {} units".format(
            cfg.loss_scales[2], cfg.loss_units),
        "prior": f"{cfg.prior.n_samples} synthetic ODE solutions (Chebyshev deg<= {cfg.prior.max_degree} / RBF GP "
                 f"drifts), {cfg.prior.grid_size}-point grid, {cfg.prior.min_observed}-{cfg.prior.max_observed} observed "
                 f"({cfg.prior.regular_fraction:g} at a regular stride from t0, the rest at random), noise "
                 f"{cfg.prior.noise_min:g}-{cfg.prior.noise_max:g} x the path's std",
        "params_total": sum(p.numel() for p in model.parameters()),
        "steps": result.global_step,
        "train_loss_first": losses[0] if losses else math.nan,
        "train_loss_last": losses[-1] if losses else math.nan,
        "saved_model": str(saved),
    }
    if result.last_val:
        report["val_loss"] = result.last_val["loss"]
    return report
