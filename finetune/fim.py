"""FIM imputation on the experiment layer: zero-shot evaluation, fine-tuning on a user's series,
ODEBench-style evaluation and ``domainfm predict fim``.

* ``data.kind: demo`` (the embedded default, ``configs/fim/finetune.yaml``): with no weights a
  small FIM is pretrained in-process on the synthetic prior (a stage; said in the report), then
  imputes zero-shot the 59 real missing weeks of the Mauna Loa CO2 series (no ground truth: the
  report gives how many were filled) plus artificial gaps in the observed CO2 weeks, and
  artificial gaps in simulated Lorenz, Van der Pol and Lotka-Volterra trajectories; metrics on the
  masked entries beside linear interpolation, a cubic spline held constant beyond the end observations and a
  Gaussian process (RBF + white noise, fitted per series).
* ``data.kind: odebench``: the 63 ODEBench systems (ODEFormer's list, d'Ascoli et al. 2024: 23
  one-, 28 two-, 10 three- and 2 four-dimensional; :mod:`domainfm.data_loaders.odebench`), two
  initial conditions each, simulated on the published span ``[0, 10]`` (256 points: *our* grid;
  ODEFormer samples 150, its stored solutions 512), noise ``sigma`` (relative to each channel's
  std) and subsampling ``rho`` grid; the headline is the fraction of trajectories with R^2 > 0.9
  on the full grid; MAE / RMSE / MRE on masked entries.
* ``data.kind: series``: a user's CSV/Parquet (:mod:`domainfm.data_loaders.gapped_series`);
  evaluation hides ``gap_fraction`` of the observed points in contiguous gaps; with
  ``adapt.mode: full`` (or lora) the model is fine-tuned on the series by hiding random observed
  points and maximising their Gaussian likelihood under the imputed path (our objective: the
  official one needs the true drift, which a real series does not have).

MRE follows PyPOTS: ``sum |p - t| m / sum |t m|`` over masked entries ``m``. Measured figures (the
ODEBench grid, the embedded default, against interpolation): ``benchmarks/README.md``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from domainfm.data_loaders.gapped_series import (BASELINES, GappedSeries, HoldoutWindows, fim_windows,
                                                 gap_mask, interpolate_baseline, load_co2, masked_metrics, read_series,
                                                 to_dataframe)
from domainfm.data_loaders.odebench import DEMO_SYSTEMS, ODEBENCH, simulate
from domainfm.models.fim.fim import READOUTS, auto_window_count
from domainfm.engine import Recipe, TrainConfig
from domainfm.experiment import ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData, apply
from domainfm.experiment.inference import unit_interval

__all__ = ["Config", "DataSection", "FAMILY", "ODEBENCH", "simulate", "masked_metrics", "interpolate_baseline",
           "impute_series", "run", "evaluate", "ApplyOptions", "APPLY"]


def _ode_cases(data, rng: np.random.Generator):
    """``(name, times, clean, hidden)`` of the simulated Lorenz, Van der Pol and Lotka-Volterra
    trajectories, each with contiguous gaps hidden."""
    for name, (fn, init, t_end) in DEMO_SYSTEMS.items():
        times, clean = simulate(fn, [], init, t_end=t_end, n_points=data.n_points)
        yield name, times, clean, gap_mask(len(times), clean.shape[1], data.gap_fraction, rng)


# --------------------------------------------------------------------------- imputing

def impute_series(model, times: np.ndarray, values: np.ndarray, observed: np.ndarray, *,
                  window_points: int | None = 128, overlap: float = 0.25, readout: str | None = None
                  ) -> dict[str, np.ndarray]:
    """Impute one series on its own grid; FIM-ℓ with windows of about ``window_points`` points
    when the series is longer (the local model is pretrained on 128-point grids); ``None``: the window
    count from the observation density (``impute(windows="auto")``). A channel too sparse for its
    windows gets fewer, larger ones. ``readout``: ``official`` or ``pinned`` (through the
    observations); ``None``: the model's own."""
    if window_points is None:
        windows = auto_window_count(len(times), torch.as_tensor(np.asarray(observed))[None], overlap)
        windows = None if windows == 1 else windows
    else:
        windows = fim_windows(len(times), window_points, overlap)
    param = next(model.parameters())
    t = torch.as_tensor(times, dtype=param.dtype, device=param.device)
    v = torch.as_tensor(np.where(observed, values, np.nan), dtype=param.dtype, device=param.device)[None]
    o = torch.as_tensor(observed, device=param.device)[None]
    with torch.no_grad():
        out = model.impute(t, v, o, t, windows=windows, overlap=overlap, readout=readout)
    return {"values": out["values"][0].double().cpu().numpy(), "windows": windows,
            "values_std": out["values_std"][0].double().cpu().numpy()}


# --------------------------------------------------------------------------- config and task

@dataclass
class DataSection:
    #: demo (embedded default) | odebench | series (a user's file)
    kind: str = "demo"
    path: str | None = None
    time: str | None = None
    channels: list[str] | None = None
    #: fraction of the observed points hidden (contiguous gaps) to score the imputation
    gap_fraction: float = 0.2
    #: points per FIM-ℓ window when imputing (null: from the observation density) and per fine-tuning window
    window_points: int | None = 128
    overlap: float = 0.25
    #: official | pinned (the path through the observations); null: the model's own (its checkpoint's choice)
    readout: str | None = None
    #: ODEBench grid: relative noise levels and subsampling rates
    noise: list[float] = field(default_factory=lambda: [0.0, 0.05])
    subsample: list[float] = field(default_factory=lambda: [0.0, 0.5])
    n_points: int = 256
    #: fine-tuning (kind=series): random observed points hidden per training example
    holdout_fraction: float = 0.2
    n_train: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.kind not in {"demo", "odebench", "series"}:
            raise ValueError(f"data.kind={self.kind!r}: expected 'demo', 'odebench' or 'series'")
        if self.kind == "series" and not self.path:
            raise ValueError("data.kind=series needs data.path (a CSV or Parquet file)")
        if not 0 < self.gap_fraction < 1 or not 0 < self.holdout_fraction < 1:
            raise ValueError("data.gap_fraction and data.holdout_fraction must be in (0, 1)")
        if self.readout is not None and self.readout not in READOUTS:
            raise ValueError(f"data.readout={self.readout!r}: expected one of {', '.join(READOUTS)} (or null: the "
                             "model's own)")


@dataclass
class Config(ExperimentConfig):
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=lambda: ModelSection(name="fim-imputation-base", pretrained=None))
    arms: list[str] = field(default_factory=lambda: ["pretrained"])
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_epochs=5, batch_size=8, lr=1e-5,
                                                                   weight_decay=1e-3, clip_grad_norm=10.0))


class HoldoutRecipe(Recipe):
    """Gaussian NLL of hidden observed values under the imputed path (mean ``values``, std ``values_std``)."""

    def __init__(self, model, train_dataset, val_dataset=None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset

    def _out(self, model, batch):
        times, values, inp, hidden = batch
        if hasattr(model, "mark_forward_method") and "impute" not in model._forward_methods:
            model.mark_forward_method("impute")
        out = model.impute(times.float(), values.float(), inp, times.float())
        return out, values.float(), hidden

    def _nll(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        out, target, hidden = self._out(model, batch)
        std = out["values_std"].clamp_min(1e-6)
        return 0.5 * ((target - out["values"]) / std) ** 2 + std.log(), hidden

    def step(self, model, batch):
        nll, hidden = self._nll(model, batch)
        loss = nll[hidden].mean()
        return loss, {"loss": loss.detach()}

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """The NLL per series (mean over its hidden points), for FLOW sample weighting. Its mean
        equals :meth:`step`'s loss when every series hides the same number of points (the step
        averages over all hidden points of the batch)."""
        nll, hidden = self._nll(model, batch)
        return nll.masked_fill(~hidden, 0).flatten(1).sum(1) / hidden.flatten(1).sum(1).clamp_min(1)

    def eval_step(self, model, batch):
        out, target, hidden = self._out(model, batch)
        err = (out["values"] - target).abs().masked_fill(~hidden, 0).flatten(1)
        return {"abs_err": err.sum(1), "count": hidden.flatten(1).sum(1).float()}

    def metrics(self, outputs):
        return {"mae": float(outputs["abs_err"].sum() / outputs["count"].sum().clamp_min(1))}


def build_task(cfg: Config) -> TaskData:
    data = cfg.data
    info: dict[str, Any] = {"kind": data.kind}
    if data.kind == "series":
        series = read_series(data.path, time=data.time, channels=data.channels)
        info.update(source=data.path, n_series=len(series), channels=series[0].channels,
                    n_points=len(series[0].times), missing=int((~series[0].observed).sum()))
        points = data.window_points or 128  # fine-tuning windows: the pretraining grid when imputing chooses
        train = HoldoutWindows(series[0], data.n_train, data.holdout_fraction, data.seed, points)
        val = HoldoutWindows(series[0], max(8, data.n_train // 8), data.holdout_fraction, data.seed + 1, points)
        return TaskData(train=train, val=val, task="imputation", labels="constructed: observed points hidden at random",
                        info=info, extras={"series": series})
    if data.kind == "odebench":
        info.update(systems=len(ODEBENCH), of_published=63, noise=data.noise, subsample=data.subsample)
    else:
        info.update(cases="CO2 weekly (59 real gaps + artificial gaps), Lorenz, Van der Pol, Lotka-Volterra")
    return TaskData(train=None, val=None, task="imputation",
                    labels="constructed: artificial gaps hidden from recorded (CO2) or simulated series", info=info)


# --------------------------------------------------------------------------- protocols

def _score_case(model, times, clean, observed_input, hidden, data, noisy=None,
                known=None) -> dict[str, dict[str, float]]:
    values = clean if noisy is None else noisy
    ours = impute_series(model, times, values, observed_input, window_points=data.window_points, overlap=data.overlap,
                         readout=data.readout)
    out = {"fim": masked_metrics(ours["values"], clean, hidden, known)}
    for kind in BASELINES:
        out[kind] = masked_metrics(interpolate_baseline(times, values, observed_input, kind), clean, hidden, known)
    return out


def _mean(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {m: {k: float(np.nanmean([r[m][k] for r in rows])) for k in rows[0][m]} for m in rows[0]}


def imputation_protocol(ctx: ArmContext) -> dict[str, Any]:
    cfg, model = ctx.cfg, ctx.model.eval()
    data = cfg.data
    rng = np.random.default_rng(data.seed)
    results: dict[str, Any] = {}
    if data.kind == "demo":
        co2 = load_co2()
        t, v, obs = co2.times / 7.0, co2.values, co2.observed  # weeks
        real = impute_series(model, t, v, obs, window_points=data.window_points, overlap=data.overlap,
                         readout=data.readout)
        hidden = gap_mask(len(t), 1, data.gap_fraction, rng, n_gaps=12) & obs
        results["co2_real_gaps"] = {"missing_weeks": int((~obs).sum()),
                                    "filled_finite": int(np.isfinite(real["values"][~obs]).sum()),
                                    "fim_windows": real["windows"]}
        results["co2_artificial_gaps"] = _score_case(model, t, np.nan_to_num(v), obs & ~hidden, hidden, data,
                                                     known=obs)
        for name, times, clean, hidden in _ode_cases(data, rng):
            results[name] = _score_case(model, times, clean, ~hidden, hidden, data)
        return {"zero_shot" if ctx.mode == "none" else "imputation": results}
    if data.kind == "odebench":
        grid = {}
        for sigma in data.noise:
            for rho in data.subsample:
                rows = []
                for system in ODEBENCH:
                    for init in system["inits"]:
                        times, clean = simulate(system["f"], system["consts"], init, n_points=data.n_points)
                        noisy = clean + sigma * clean.std(axis=0, keepdims=True) * rng.standard_normal(clean.shape)
                        hidden = gap_mask(len(times), clean.shape[1], data.gap_fraction, rng, n_gaps=1)
                        observed = ~hidden & (rng.random(clean.shape) >= rho)
                        observed[0] = observed[-1] = True
                        rows.append(_score_case(model, times, clean, observed, ~observed, data, noisy=noisy))
                summary = _mean(rows)
                for method in summary:  # nan R^2 (a constant channel) counts as not > 0.9
                    summary[method]["frac_r2_gt_0.9"] = float(np.mean([r[method]["r2"] > 0.9 for r in rows]))
                grid[f"sigma={sigma:g},rho={rho:g}"] = summary
        results["odebench"] = grid
        results["odebench_systems"] = f"{len(ODEBENCH)} of 63"
        return results
    series = ctx.task.extras["series"][0]
    hidden = gap_mask(len(series.times), len(series.channels), data.gap_fraction, rng) & series.observed
    results["series_artificial_gaps"] = _score_case(model, series.times, np.nan_to_num(series.values),
                                                    series.observed & ~hidden, hidden, data, known=series.observed)
    try:  # PyPOTS SAITS on the target series, only when installed
        import pypots  # noqa: F401

        results["pypots"] = "installed; SAITS baseline not run in this version"
    except ImportError:
        results["pypots"] = "not installed (SAITS baseline skipped)"
    return {"imputation": results}


def retained_ode_imputation(ctx: ArmContext) -> dict[str, Any]:
    """Retained capability: zero-shot imputation of simulated ODE trajectories the fine-tuning
    series is not (Lorenz, Van der Pol, Lotka-Volterra; 20% hidden in contiguous gaps, a fixed
    seed): mean R^2 and MAE on the hidden entries."""
    data = ctx.cfg.data
    rng = np.random.default_rng(12345)  # the same gaps for every arm, before and after
    rows = {}
    for name, times, clean, hidden in _ode_cases(data, rng):
        ours = impute_series(ctx.model, times, clean, ~hidden, window_points=data.window_points, overlap=data.overlap,
                         readout=data.readout)
        rows[name] = masked_metrics(ours["values"], clean, hidden)
    return {"r2": float(np.mean([r["r2"] for r in rows.values()])),
            "mae": float(np.mean([r["mae"] for r in rows.values()])),
            "systems": {k: {"r2": v["r2"], "mae": v["mae"]} for k, v in rows.items()}}


FAMILY = Family(
    name="fim", config=Config, data=build_task,
    recipe=lambda cfg, model, task: HoldoutRecipe(model, task.train, task.val),
    protocols=[imputation_protocol], selection=lambda cfg, task: ("mae", "min"), head="head",
    retained=Retained(retained_ode_imputation, metric="r2", direction="max",
                      description="zero-shot imputation (mean R^2 on hidden entries) of simulated Lorenz, Van der "
                                  "Pol and Lotka-Volterra trajectories, 20% hidden in contiguous gaps"),
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# --------------------------------------------------------------------------- predict

@dataclass
class ApplyOptions:
    time: str | None = apply.option(None, "time column (default: time/timestamp/date/t/ds, else the index)")
    window_points: int = apply.option(128, "points per FIM-ℓ window: a longer series is imputed in overlapping "
                                           "windows (the local model is pretrained on 128-point grids); a channel "
                                           "too sparse for them gets fewer, larger windows")
    overlap: float = apply.option(0.25, "fraction of a window shared with the previous one, in [0, 1)",
                                  type=unit_interval)
    plot: str | None = apply.option(None, "PNG of each channel's imputed path (default: OUTPUT with .png)",
                                    output=(".png",), default_from=".png")
    readout: str | None = apply.option(None, "official (the paper's path x0 + integral of the drift) or pinned (that "
                                             "path moved onto the observations); default: the model's own (official "
                                             "for the published weights; domainfm's checkpoints record theirs)",
                                       choices=READOUTS)


def _read(source, settings, options: ApplyOptions) -> list[GappedSeries]:
    return read_series(source, time=options.time)


def _plot(series: list[GappedSeries], paths: list[dict[str, np.ndarray]]):
    """One panel per channel: the imputed path, its ±2 std band and the observed points."""
    from matplotlib.figure import Figure  # no pyplot: no backend, no global figure to close

    n_panels = sum(len(s.channels) for s in series)
    fig = Figure(figsize=(9, 2.6 * n_panels))
    axes = iter(fig.subplots(n_panels, 1, squeeze=False)[:, 0])
    for s, path in zip(series, paths):
        stamps = s.timestamps()
        for j, name in enumerate(s.channels):
            ax, mean, std, obs = next(axes), path["values"][:, j], path["values_std"][:, j], s.observed[:, j]
            ax.fill_between(stamps, mean - 2 * std, mean + 2 * std, alpha=0.25, label="±2 std")
            ax.plot(stamps, mean, lw=1, label="FIM path")
            ax.plot(np.asarray(stamps)[obs], s.values[obs, j], ".", ms=3, color="k", label="observed")
            ax.set_title(f"{s.item_id}: {name} ({int((~obs).sum())} gaps imputed)")
            ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    return fig


def _predict(series: list[GappedSeries], model, settings, options: ApplyOptions, run: apply.Runtime) -> apply.Output:
    import pandas as pd

    if next(model.parameters()).dtype != torch.float64:  # imputed in float64; a caller's module is left as it was
        model = copy.deepcopy(model).double()
    frames, paths = [], []
    for s in series:
        paths.append(impute_series(model, s.times, s.values, s.observed, window_points=options.window_points,
                                   overlap=options.overlap, readout=options.readout))
        frames.append(to_dataframe(s, paths[-1]["values"], paths[-1]["values_std"]))
        if len(series) > 1:
            frames[-1].insert(0, "item_id", s.item_id)
    extras = {"plot": _plot(series, paths)} if options.plot is not None else {}
    n_missing = sum(int((~s.observed).sum()) for s in series)
    return apply.Output(pd.concat(frames, ignore_index=True), extras, summary=f"imputed {n_missing} missing values")


APPLY = apply.Applier(
    family="fim", read=_read, options=ApplyOptions,
    input="a CSV/Parquet series (a time column and one column per channel, or long rows), NaN at gaps",
    description="Imputed in float64, one series at a time: --precision and --batch-size do not apply.",
    predict=apply.Command(_predict, apply.TABLE, default_model="fim-imputation-base",
                          default_pretrained="hf://FIM4Science/fim-imp-pointwise-base",  # the card's fim4science source
                          what="Impute the gaps (NaN cells) of a series with FIM, zero-shot (CSV: time, then per "
                               "channel <channel>, <channel>_std, <channel>_observed; item_id first for several)."),
)
