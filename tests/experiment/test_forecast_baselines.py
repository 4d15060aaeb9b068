"""The statistical baselines (AutoETS, AutoTheta from statsforecast) scored beside every forecast:
equal to statsforecast called directly on the same contexts, quantiles from its intervals, labelled
fallbacks, and their columns in the report's table."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from statsforecast import StatsForecast
from statsforecast.models import AutoETS, AutoTheta

from domainfm.experiment import forecast_baselines as B
from domainfm.experiment.forecast_metrics import forecast_scores, mase, seasonal_naive_forecast, wql
from domainfm.experiment.report import format_table, table_rows, to_markdown

LEVELS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
H = 6


def _monthly(n: int, seed: int, missing: tuple[int, ...] = ()) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    y = 50 + 0.3 * t + 8 * np.sin(2 * np.pi * t / 12) + rng.normal(scale=1.5, size=n)
    y[list(missing)] = np.nan
    return y


def _windows():
    # monthly (season 12): two series longer than the 40 steps the model sees (one with missing values
    # in them) and a short one (20 steps: under two seasons); a dataset of two quarterly series
    out = []
    for i, (n, missing) in enumerate([(80, (50, 51, 70)), (100, ()), (20, ())]):
        y = _monthly(n + H, seed=i, missing=missing)
        out.append({"dataset": "m", "item_id": f"m{i}", "freq": "ME", "context": y[:n], "future": y[n:]})
    for i in range(2):
        y = _monthly(40 + H, seed=10 + i)
        out.append({"dataset": "q", "item_id": f"q{i}", "freq": "QS", "context": y[:40], "future": y[40:]})
    return out


def _statsforecast_direct(windows, season: int, context_length: int) -> pd.DataFrame:
    """The reference: StatsForecast's DataFrame API on the contexts cut to the model's window, gaps
    filled forward (then backward for a leading gap), intervals at 80/60/40/20%."""
    frames = []
    for w in windows:
        y = pd.Series(w["context"][-context_length:]).ffill().bfill().to_numpy()
        frames.append(pd.DataFrame({"unique_id": w["item_id"], "y": y,
                                    "ds": pd.date_range("2000-01-31", periods=len(y), freq="ME")}))
    sf = StatsForecast(models=[AutoETS(season_length=season), AutoTheta(season_length=season)], freq="ME", n_jobs=1)
    return sf.forecast(df=pd.concat(frames), h=H, level=[80, 60, 40, 20])


def _reference_quantiles(frame: pd.DataFrame, model: str) -> np.ndarray:
    columns = [f"{model}-lo-80", f"{model}-lo-60", f"{model}-lo-40", f"{model}-lo-20", model,
               f"{model}-hi-20", f"{model}-hi-40", f"{model}-hi-60", f"{model}-hi-80"]
    return frame[columns].to_numpy(np.float64)


def test_baseline_forecasts_and_scores_equal_statsforecast_called_directly():
    windows = _windows()
    monthly = [w for w in windows if w["dataset"] == "m"]
    context_length = 40
    scores = forecast_scores(windows, None, LEVELS, baselines=["auto_ets", "auto_theta"], context_length=context_length)
    # the long monthly series hold two seasons in the 40 steps the model sees: the seasonal models, as named
    long = monthly[:2]
    reference = _statsforecast_direct(long, 12, context_length)
    for key, name in (("auto_ets", "AutoETS"), ("auto_theta", "AutoTheta")):
        ours = B.baseline_forecast(key, [w["context"][-context_length:] for w in long], H, 12, LEVELS)
        assert ours.step.tolist() == [0, 0]
        for i, w in enumerate(long):
            expected = _reference_quantiles(reference[reference.unique_id == w["item_id"]], name)
            np.testing.assert_allclose(ours.quantiles[i], expected, rtol=1e-9, atol=1e-9)
            np.testing.assert_allclose(ours.mean[i], expected[:, 4], rtol=1e-9, atol=1e-9)
    # the short monthly series (30 < 2 * 12): the non-seasonal model, and labelled as a fallback
    short = _statsforecast_direct(monthly[2:], 1, context_length)
    ets_m = np.stack([_reference_quantiles(reference[reference.unique_id == w["item_id"]], "AutoETS") for w in long]
                     + [_reference_quantiles(short, "AutoETS")])
    future = np.stack([w["future"] for w in monthly])
    insample = [w["context"] for w in monthly]  # the MASE scale and seasonal naive: the whole context, as GluonTS
    assert scores["m.auto_ets_mase"] == pytest.approx(mase(future, ets_m[..., 4], insample, 12), rel=1e-9)
    assert scores["m.auto_ets_wql"] == pytest.approx(wql(future, ets_m, LEVELS), rel=1e-9)
    assert scores["m.auto_ets_fallback_windows"] == 1 and scores["m.auto_theta_fallback_windows"] == 1
    # quarterly (season 4): 40 steps hold ten seasons, no fallback, and no per-dataset fallback key
    assert "q.auto_ets_fallback_windows" not in scores
    assert scores["auto_ets_fallback_windows"] == 1 and scores["auto_theta_fallback_windows"] == 1
    # relative to seasonal naive on the same windows, geometric mean over the two datasets
    naive = seasonal_naive_forecast(insample, H, 12)
    naive_mase = mase(future, naive, insample, 12)
    assert scores["m.naive_mase"] == pytest.approx(naive_mase)
    rel_m = scores["m.auto_theta_wql"] / scores["m.naive_wql"]
    rel_q = scores["q.auto_theta_wql"] / scores["q.naive_wql"]
    assert scores["auto_theta_wql_rel"] == pytest.approx(np.sqrt(rel_m * rel_q))
    assert scores["naive_mase_rel"] == 1.0 and scores["naive_wql_rel"] == 1.0


def test_quantiles_from_intervals_are_monotone_and_the_median_is_the_point_forecast():
    levels = [0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95]
    keys = ["lo-90", "lo-80", "lo-50", "lo-20", "mean", "hi-20", "hi-50", "hi-80", "hi-90"]
    contexts = [_monthly(60, seed=s) for s in range(3)]
    moved = {}
    for name, model in (("auto_ets", AutoETS), ("auto_theta", AutoTheta)):
        fit = B.baseline_forecast(name, contexts, H, 12, levels)
        assert fit.quantiles.shape == (3, H, len(levels)) and fit.mean.shape == (3, H)
        assert np.all(np.diff(fit.quantiles, axis=-1) >= 0)
        assert np.all(fit.quantiles[..., -1] > fit.quantiles[..., 0])  # real intervals, not a point
        np.testing.assert_array_equal(fit.quantiles[..., levels.index(0.5)], fit.mean)
        # against statsforecast's own intervals: equal wherever they are nested about the point forecast;
        # a bound on the wrong side of it (AutoTheta's simulated intervals, at a few steps) lies on it
        raw = []
        for y in contexts:
            out = model(season_length=12).forecast(y=y, h=H, level=[90, 80, 50, 20])
            raw.append(np.stack([np.asarray(out[k]) for k in keys], axis=-1))
        raw = np.stack(raw)
        np.testing.assert_allclose(fit.mean, raw[..., 4], rtol=1e-12)
        differs = ~np.isclose(fit.quantiles, raw, rtol=1e-12, atol=0)
        moved[name] = int(differs.sum())
        np.testing.assert_allclose(fit.quantiles[differs], np.broadcast_to(fit.mean[..., None], raw.shape)[differs],
                                   rtol=1e-12)
    # measured on these series: AutoETS (Gaussian intervals) never moves, AutoTheta does at a few steps
    assert moved["auto_ets"] == 0 and moved["auto_theta"] > 0
    assert B.interval_levels([0.1, 0.5, 0.975]) == [(0.1, "lo-80"), (0.5, "mean"), (0.975, "hi-95")]
    with pytest.raises(ValueError, match=r"quantile_levels\[1\]=1.0"):
        B.interval_levels([0.5, 1.0])
    with pytest.raises(ValueError, match="unknown baseline 'ets'"):
        forecast_scores(_windows(), None, LEVELS, baselines=["ets"])


def test_fallbacks_are_defined_and_labelled(monkeypatch):
    short = _monthly(20, seed=3)  # under two seasons of 12
    fit = B.baseline_forecast("auto_ets", [short], H, 12, [0.1, 0.5, 0.9])
    assert fit.step.tolist() == [1] and fit.fallback_windows == 1
    direct = AutoETS(season_length=1).forecast(y=short, h=H, level=[80])
    np.testing.assert_allclose(fit.quantiles[0], np.stack([direct["lo-80"], direct["mean"], direct["hi-80"]], -1))
    # statsforecast raising on the seasonal fit: the non-seasonal model, then naive when that raises too
    from statsforecast import models

    original = models.AutoTheta.forecast

    def failing(self, y, h, **kw):
        if self.season_length > 1:
            raise RuntimeError("seasonal fit failed")
        return original(self, y=y, h=h, **kw)

    monkeypatch.setattr(models.AutoTheta, "forecast", failing)
    B._CACHE.clear()
    long = _monthly(60, seed=4)
    assert B.baseline_forecast("auto_theta", [long], H, 12, [0.5]).step.tolist() == [1]
    monkeypatch.setattr(models.AutoTheta, "forecast", lambda self, y, h, **kw: (_ for _ in ()).throw(RuntimeError()))
    B._CACHE.clear()
    fit = B.baseline_forecast("auto_theta", [long], H, 12, [0.1, 0.5])
    assert fit.step.tolist() == [2]
    np.testing.assert_array_equal(fit.mean[0], np.full(H, long[-1]))  # naive: the last value
    assert B.FALLBACK_STEPS[2].startswith("naive")
    B._CACHE.clear()
    # AutoARIMA (opt-in) never searches a season above ARIMA_MAX_SEASON (48: over 25 minutes on 7 series)
    seasons = []
    monkeypatch.setattr(models.AutoARIMA, "forecast",
                        lambda self, y, h, **kw: seasons.append(self.season_length) or {"mean": np.zeros(h)})
    assert B.baseline_forecast("auto_arima", [_monthly(100, seed=5)], H, 48, [0.5]).step.tolist() == [1]
    assert B.baseline_forecast("auto_arima", [_monthly(100, seed=5)], H, 12, [0.5]).step.tolist() == [0]
    assert seasons == [1, 12]
    # a context of one value: the non-seasonal models raise on it; naive still forecasts it
    fit = B.baseline_forecast("auto_ets", [np.array([3.0])], 2, 1, [0.1, 0.5, 0.9])
    assert fit.step.tolist() == [2] and np.all(fit.quantiles == 3.0)


def test_baselines_are_extra_columns_of_the_report_table():
    scores = {"d.mase": 2.0, "d.naive_mase": 1.0, "d.auto_ets_mase": 0.5, "mase_rel": 2.0, "naive_mase_rel": 1.0,
              "auto_ets_mase_rel": 0.5, "auto_ets_fallback_windows": 0.0}
    report = {"family": "f", "arms": {"pretrained": {"init": "x", "test": dict(scores), "zero_shot": {"test": {
        "mase_rel": 3.0, "naive_mase_rel": 1.0, "auto_ets_mase_rel": 0.5}}},
        "random": {"init": "y", "test": {**scores, "mase_rel": 4.0, "d.mase": 4.0}}},
        "baselines": {"columns": B.baseline_columns(["auto_ets"]), "description": "how"}}
    columns, rows = table_rows(report)
    assert columns == ["pretrained", "random", "seasonal naive", "AutoETS"]
    rows = dict(rows)
    assert rows["test.mase_rel"] == [2.0, 4.0, 1.0, 0.5]
    assert rows["test.d.mase"] == [2.0, 4.0, 1.0, 0.5]
    assert rows["zero_shot.test.mase_rel"] == [3.0, None, 1.0, 0.5]
    assert rows["test.fallback_windows"] == [None, None, None, 0.0]
    assert not any("auto_ets" in k or "naive" in k for k in rows)
    assert "| metric | pretrained | random | seasonal naive | AutoETS |" in to_markdown(report)
    assert "- **baselines**: how" in to_markdown(report)
    # without report["baselines"] the table is as before: one column per arm
    plain = {k: v for k, v in report.items() if k != "baselines"}
    assert table_rows(plain)[0] == ["pretrained", "random"]
    assert "test.auto_ets_mase_rel" in format_table(plain)
