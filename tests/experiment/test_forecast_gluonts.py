"""Sample forecasts scored as GluonTS scores them: quantiles of sample paths by GluonTS's rule
(``SampleForecast.quantile``), and MASE / weighted quantile loss from ``forecast_scores`` equal to
``gluonts.evaluation.Evaluator`` on the shipped real series, per series and per dataset."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from gluonts.evaluation import Evaluator
from gluonts.model.forecast import SampleForecast
from gluonts.time_feature import get_seasonality

from domainfm.data_loaders import timeseries as T
from domainfm.experiment.forecast_metrics import (forecast_scores, seasonal_naive_forecast, seasonality,
                                                  sample_quantiles)

LEVELS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # the WaveToken family's default eval.quantile_levels
EDGE_LEVELS = [0.0, 1e-9, 0.01, 0.025, 0.05, 0.25, 0.75, 0.95, 0.975, 0.99, 1 - 1e-9, 1.0]


def _gluonts_quantiles(samples: np.ndarray, levels) -> np.ndarray:
    """(H, Q) from GluonTS itself: ``SampleForecast.quantile`` of one (S, H) forecast, level by level."""
    forecast = SampleForecast(samples=samples, start_date=pd.Period("2000-01-01", freq="D"))
    return np.stack([forecast.quantile(float(q)) for q in levels], axis=-1)


@pytest.mark.parametrize("num_samples", [1, 2, 4, 7, 20, 21, 100, 101])
def test_sample_quantiles_are_gluonts_sample_forecast_quantiles(num_samples):
    """Even sample counts put some levels exactly half-way between two sorted samples ((S - 1) q = k + 1/2):
    GluonTS rounds half to even there (``np.round``), so e.g. S = 20's median is the 11th smallest sample."""
    rng = np.random.default_rng(num_samples)
    levels = sorted(set(LEVELS + EDGE_LEVELS + list(np.round(rng.uniform(0, 1, 30), 6)) + [k / 40 for k in range(41)]))
    samples = rng.standard_t(3, size=(3, num_samples, 5)) * 10 + 50  # (N, S, H), heavy tails
    samples[0, :, 0] = np.round(samples[0, :, 0])  # ties
    ours = sample_quantiles(samples, levels)
    assert ours.shape == (3, 5, len(levels))
    for n in range(3):
        np.testing.assert_array_equal(ours[n], _gluonts_quantiles(samples[n], levels))
    np.testing.assert_array_equal(sample_quantiles(samples[1], levels), ours[1])  # one (S, H) forecast
    # every value is one of the sample paths' own values (no interpolation)
    assert all(np.isin(ours[n, h], samples[n, :, h]).all() for n in range(3) for h in range(5))


def test_sample_quantiles_differ_from_linear_interpolation():
    """The case that moved scores: S = 20, the median is sample 11 of 20, not the mean of samples 10 and 11."""
    samples = np.arange(20.0)[:, None]  # (S=20, H=1)
    assert sample_quantiles(samples, [0.5])[0, 0] == 10.0 and np.quantile(samples, 0.5) == 9.5
    assert sample_quantiles(samples, [0.1, 0.9])[0].tolist() == [2.0, 17.0]  # round(1.9) = 2, round(17.1) = 17


@pytest.mark.parametrize("samples, levels, message", [
    (np.zeros(5), [0.5], r"samples: expected shape \(\.\.\., num_samples, prediction_length\)"),
    (np.full((4, 3), np.nan), [0.5], "samples: contains 12 NaN"),
    (np.zeros((4, 3)), [1.5], r"quantile_levels\[0\]: expected a quantile level in \[0, 1\], got 1.5"),
    (np.zeros((4, 3)), [], "quantile_levels: is empty"),
])
def test_sample_quantiles_reject_bad_input_by_name(samples, levels, message):
    with pytest.raises(ValueError, match=message):
        sample_quantiles(samples, levels)


# ----------------------------------------------------------------------------- Evaluator on real series


def _shipped_windows(horizon: int = 12) -> list[dict]:
    """The test window of every shipped series (the WaveToken family's default data: 14 real series in 6
    datasets; co2's context has 5 missing months)."""
    return T.split_by_time(T.load_sample(), horizon, min_context=2)[1]


def _bootstrap_samples(windows, num_samples: int, seed: int = 0) -> np.ndarray:
    """(N, S, H) sample paths: each series' seasonal-naive forecast plus its own seasonal differences drawn
    at random, spread growing with the number of seasons ahead, so the paths look like a real forecaster's."""
    rng = np.random.default_rng(seed)
    out = []
    for w in windows:
        m, h = seasonality(w["freq"]), len(w["future"])
        context = np.asarray(w["context"], dtype=np.float64)
        diffs = (context[m:] - context[:-m])
        diffs = diffs[np.isfinite(diffs)]
        naive = seasonal_naive_forecast(context, h, m)
        steps = np.sqrt(1 + np.arange(h) // m)
        out.append(naive + rng.choice(diffs, size=(num_samples, h)) * steps)
    return np.stack(out)


def _gluonts_evaluate(windows, samples, levels, season):
    """GluonTS ``Evaluator`` on the windows: each target the whole series (context + future) on a
    ``PeriodIndex``, each ``SampleForecast`` starting at the first future period."""
    targets, forecasts = [], []
    for w, s in zip(windows, samples):
        values = np.r_[w["context"], w["future"]]
        index = pd.date_range(w["start"], periods=len(values), freq=w["freq"]).to_period()
        targets.append(pd.Series(values, index=index))
        forecasts.append(SampleForecast(samples=s, start_date=index[len(w["context"])], item_id=w["item_id"]))
        # GluonTS's own seasonality of the period frequency agrees with ours of the pandas alias
        assert get_seasonality(index.freqstr) == season
    evaluator = Evaluator(quantiles=levels, seasonality=season, num_workers=0)
    return evaluator(iter(targets), iter(forecasts), num_series=len(targets))


@pytest.mark.parametrize("num_samples", [20, 21])
def test_forecast_scores_equal_gluonts_evaluator_on_the_shipped_series(num_samples):
    """Which GluonTS number is which of ours:
    - per series: ``item_metrics["MASE"]`` = ``forecast_scores`` of that one window (``<item>.mase``), and the
      mean over levels of ``QuantileLoss[q] / abs_target_sum`` = its ``<item>.wql``;
    - per dataset, as we report them: the aggregate ``MASE`` (GluonTS: the mean of the per-series MASE) =
      ``<dataset>.mase`` (the mean of scaled errors over all series and steps, equal horizons), and
      ``mean_wQuantileLoss`` (each level's loss summed over series over the summed |target|, then averaged
      over levels) = ``<dataset>.wql``."""
    windows = _shipped_windows()
    samples = _bootstrap_samples(windows, num_samples)
    per_series = forecast_scores([{**w, "dataset": w["item_id"]} for w in windows], samples, LEVELS)
    per_dataset = forecast_scores(windows, samples, LEVELS)
    datasets = sorted({w["dataset"] for w in windows})
    assert len(datasets) == 6 and per_dataset["n_datasets"] == 6
    for name in datasets:
        idx = [i for i, w in enumerate(windows) if w["dataset"] == name]
        totals, items = _gluonts_evaluate([windows[i] for i in idx], samples[idx], LEVELS,
                                          seasonality(windows[idx[0]]["freq"]))
        assert per_dataset[f"{name}.mase"] == pytest.approx(totals["MASE"], rel=1e-6)
        assert per_dataset[f"{name}.wql"] == pytest.approx(totals["mean_wQuantileLoss"], rel=1e-6)
        for i, (_, row) in zip(idx, items.iterrows()):
            item = windows[i]["item_id"]
            assert row["item_id"] == item
            assert per_series[f"{item}.mase"] == pytest.approx(row["MASE"], rel=1e-6)
            wql = np.mean([row[f"QuantileLoss[{q}]"] for q in LEVELS]) / row["abs_target_sum"]
            assert per_series[f"{item}.wql"] == pytest.approx(wql, rel=1e-6)
