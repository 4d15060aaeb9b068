"""The statistical baselines a forecaster runs first: AutoETS, AutoTheta (and, opt-in, AutoARIMA)
from statsforecast, as probabilistic forecasts scored beside every model forecast.

Each baseline is fitted on exactly the context a model sees (one fit per window), with the season
length of the GluonTS rule (:func:`~domainfm.experiment.forecast_metrics.seasonality`). Missing
values in a context are first filled with the last observed value (leading gaps with the first),
as :func:`~domainfm.experiment.forecast_metrics.seasonal_naive_forecast` does, because the
statsforecast models take no NaN.

**Quantiles from prediction intervals.** statsforecast gives a point forecast (``mean``) and the
bounds of central prediction intervals ``lo-L`` / ``hi-L`` at levels ``L`` (percent). The
q-quantile is the lower bound of the level ``L = 100 (1 - 2q)`` for q < 0.5, the upper bound of
``L = 100 (2q - 1)`` for q > 0.5, and the point forecast for q = 0.5. So ``[0.1, ..., 0.9]`` asks
for the levels 80, 60, 40, 20. AutoETS's intervals are Gaussian about its point forecast; AutoTheta's
come from simulated paths and are not centred on it exactly: at some steps its narrowest bound lies
a hair beyond the point forecast (measured: 0.003 on a level of 76, the 20% interval). The quantiles
are therefore made monotone outward from the point forecast (:func:`_monotone_about_point`): a bound
on the wrong side of the point forecast, or inside a narrower interval's bound, is moved onto it.
Where the intervals are nested about the point forecast (always for AutoETS) nothing moves.

**Fallbacks, always labelled.** A window is forecast by the first step of this chain that fits and
returns finite values:

1. the model with the season (``season_length = m``), only when the context holds at least two
   full seasons (``len >= 2 m``) and, for AutoARIMA, ``m <= ARIMA_MAX_SEASON`` (24); with ``m = 1``
   this step is the non-seasonal model itself;
2. the model without a season (``season_length = 1``);
3. statsforecast's ``Naive`` (the last value, intervals from its residuals);
4. the last value at every quantile (no spread), for a context too short even for 3.

:func:`baseline_forecast` returns the step used per window (:data:`FALLBACK_STEPS`), and
:func:`~domainfm.experiment.forecast_metrics.forecast_scores` reports how many windows fell back
(``<baseline>_fallback_windows``, and ``<dataset>.<baseline>_fallback_windows`` for each dataset
where any did), so that no figure silently comes from a different model than its name.

**Cost.** statsforecast's import takes about 2 CPU-seconds; AutoETS about 0.1 s and AutoTheta
0.01 s per window of ~100 monthly steps (measured on 2 cores). AutoARIMA is off by default: its
first fit compiles for several seconds and a season of 48 ran for more than 25 minutes on 7 series
(issue 34), so its seasonal fit is capped at :data:`ARIMA_MAX_SEASON`. Forecasts are cached per (baseline, context, horizon, season, levels), so that the same
windows scored again (every validation, the zero-shot protocol) are fitted once per process.
"""
from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["BASELINES", "DEFAULT_BASELINES", "FALLBACK_STEPS", "ARIMA_MAX_SEASON", "BaselineForecast", "baseline_forecast",
           "interval_levels", "check_baselines", "baseline_columns", "describe_baselines"]

#: key -> (statsforecast model class name, display name)
BASELINES = {
    "auto_ets": ("AutoETS", "AutoETS"),
    "auto_theta": ("AutoTheta", "AutoTheta"),
    "auto_arima": ("AutoARIMA", "AutoARIMA"),
}
#: the baselines every forecasting report shows unless its config says otherwise (AutoARIMA: opt-in)
DEFAULT_BASELINES = ("auto_ets", "auto_theta")
#: AutoARIMA's seasonal search above this season is skipped (a fallback, counted): a season of 48 ran for more
#: than 25 minutes on 7 series (issue 34)
ARIMA_MAX_SEASON = 24
#: what each step of the fallback chain is (the index :func:`baseline_forecast` returns per window)
FALLBACK_STEPS = ("as named (with the season when the context holds two)", "without season",
                  "naive (statsforecast Naive)", "last value, no spread")

_CACHE: OrderedDict[tuple, tuple[np.ndarray, np.ndarray, int]] = OrderedDict()
_CACHE_SIZE = 20_000


@dataclass
class BaselineForecast:
    """Forecasts of one baseline for a batch of windows.

    Shapes:
        ``quantiles``: (N, H, Q) at the requested levels; ``mean``: (N, H), the point forecast;
        ``step``: (N,) the fallback step used per window (an index of :data:`FALLBACK_STEPS`).
    """

    quantiles: np.ndarray
    mean: np.ndarray
    step: np.ndarray

    @property
    def fallback_windows(self) -> int:
        """Windows not forecast by the first step of their chain."""
        return int(np.sum(self.step > 0))


def check_baselines(names: Sequence[str], label: str = "baselines") -> list[str]:
    """``names`` as a list, each a key of :data:`BASELINES` (an error names the unknown one)."""
    out = []
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"{label}: unknown baseline {name!r}; expected some of {sorted(BASELINES)}")
        out.append(str(name))
    return out


def baseline_columns(names: Sequence[str]) -> dict[str, str]:
    """Report columns (display name -> key prefix of the scores): seasonal naive, then ``names``."""
    return {"seasonal naive": "naive", **{BASELINES[n][1]: n for n in check_baselines(names)}}


def describe_baselines(names: Sequence[str]) -> str:
    """One line for a report: which baselines, fitted how, with which fallbacks."""
    from importlib.metadata import version

    names = check_baselines(names)
    if not names:
        return "seasonal naive only (eval.baselines is empty)"
    shown = ", ".join(BASELINES[n][1] for n in names)
    return (f"seasonal naive (on the whole context, as GluonTS) and {shown} (statsforecast "
            f"{version('statsforecast')}), each fitted on every scored window's context as the model sees it, with "
            "the season of the GluonTS rule; missing context values filled with the last observed value; quantiles "
            "from the prediction intervals (q = 0.5: the point forecast; a bound crossing it is moved onto it); "
            "fallbacks, counted in fallback_windows (per dataset where any): no season when the context holds under "
            "two seasons or the seasonal fit fails, then naive, then the last value")


def interval_levels(quantile_levels: Sequence[float]) -> list[tuple[float, str | None]]:
    """For each quantile level: ``(q, key)`` with ``key`` the statsforecast output holding it
    (``"lo-80"`` for 0.1, ``"hi-80"`` for 0.9, ``"mean"`` for 0.5).

    Raises:
        ValueError: for a level outside (0, 1) (statsforecast's intervals have levels below 100%).
    """
    out = []
    for i, q in enumerate(quantile_levels):
        q = float(q)
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile_levels[{i}]={q}: the baselines' quantiles come from prediction intervals "
                             "and need a level strictly between 0 and 1")
        if abs(q - 0.5) < 1e-9:
            out.append((q, "mean"))
            continue
        level = round(100.0 * abs(1.0 - 2.0 * q), 9)
        level = int(level) if level == int(level) else level
        out.append((q, f"{'lo' if q < 0.5 else 'hi'}-{level}"))
    return out


def _levels_arg(keys: list[str | None]) -> list[int | float]:
    levels = []
    for key in keys:
        if key != "mean":
            value = key.split("-", 1)[1]
            value = float(value) if "." in value else int(value)
            if value not in levels:
                levels.append(value)
    return sorted(levels)


def _model(name: str, season_length: int):
    from statsforecast import models

    return getattr(models, BASELINES[name][0])(season_length=season_length)


def _monotone_about_point(quantiles: np.ndarray, mean: np.ndarray, levels: Sequence[float]) -> np.ndarray:
    """(H, Q) quantiles made non-decreasing in the level, keeping the point forecast as the 0.5
    quantile: walking outward from the point forecast, each bound is at least as far from it as the
    one before (a lower bound is at most the point forecast and every narrower lower bound; an upper
    bound likewise). Unchanged when the intervals are nested about the point forecast."""
    levels = np.asarray(levels, dtype=np.float64)
    out = quantiles.copy()
    below = np.flatnonzero(levels < 0.5)
    below = below[np.argsort(-levels[below])]  # nearest to the median first
    above = np.flatnonzero(levels > 0.5)
    above = above[np.argsort(levels[above])]
    if below.size:
        out[:, below] = np.minimum.accumulate(np.minimum(quantiles[:, below], mean[:, None]), axis=1)
    if above.size:
        out[:, above] = np.maximum.accumulate(np.maximum(quantiles[:, above], mean[:, None]), axis=1)
    return out


def _fit(model, y: np.ndarray, h: int, keys: list[str], levels: Sequence[float]) -> tuple[np.ndarray, np.ndarray] | None:
    """(H, Q) quantiles and (H,) point forecast of ``model`` on ``y``, or None when it raises or
    returns anything non-finite."""
    interval = _levels_arg(keys)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.forecast(y=y, h=h, level=interval) if interval else model.forecast(y=y, h=h)
    except Exception:  # any failure of the fit moves to the next step of the chain, which is counted
        return None
    mean = np.asarray(out["mean"], dtype=np.float64)
    quantiles = np.stack([np.asarray(out[k], dtype=np.float64) for k in keys], axis=-1)
    if mean.shape != (h,) or not (np.all(np.isfinite(mean)) and np.all(np.isfinite(quantiles))):
        return None
    return _monotone_about_point(quantiles, mean, levels), mean


def _forecast_one(name: str, y: np.ndarray, h: int, m: int, keys: list[str],
                  levels: Sequence[float]) -> tuple[np.ndarray, np.ndarray, int]:
    from statsforecast.models import Naive

    seasonal = m > 1
    chain = []
    if seasonal and len(y) >= 2 * m and not (name == "auto_arima" and m > ARIMA_MAX_SEASON):
        chain.append((0, _model(name, m)))
    chain.append((1 if seasonal else 0, _model(name, 1)))
    chain.append((2, Naive()))
    for step, model in chain:
        fitted = _fit(model, y, h, keys, levels)
        if fitted is not None:
            return (*fitted, step)
    last = np.full(h, y[-1])
    return np.repeat(last[:, None], len(keys), axis=1), last, 3


def baseline_forecast(name: str, insample: Sequence[np.ndarray], prediction_length: int, season_length: int,
                      quantile_levels: Sequence[float]) -> BaselineForecast:
    """Probabilistic forecasts of one baseline (``auto_ets``, ``auto_theta``, ``auto_arima``) for
    each context of ``insample`` (NaN: missing, filled with the last observed value).

    Args:
        name: a key of :data:`BASELINES`.
        insample: N 1-D contexts, any lengths.
        prediction_length: horizon ``H``.
        season_length: ``m``, from :func:`~domainfm.experiment.forecast_metrics.seasonality`.
        quantile_levels: levels in (0, 1) (see :func:`interval_levels`).

    Shapes:
        Returns :class:`BaselineForecast` with (N, H, Q) quantiles, (N, H) mean, (N,) step.
    """
    from domainfm.experiment.forecast_metrics import _check_positive_int, _impute_last_value, _series_list

    check_baselines([name], "name")
    h = _check_positive_int(prediction_length, "prediction_length")
    m = _check_positive_int(season_length, "season_length")
    pairs = interval_levels(quantile_levels)
    keys = [k for _, k in pairs]
    series, _ = _series_list(list(insample))
    quantiles, means, steps = [], [], []
    for i, s in enumerate(series):
        y = _impute_last_value(s, f"insample[{i}]")
        key = (name, h, m, tuple(keys), len(y), hashlib.sha1(np.ascontiguousarray(y).tobytes()).hexdigest())
        hit = _CACHE.get(key)
        if hit is None:
            hit = _forecast_one(name, y, h, m, keys, [q for q, _ in pairs])
            _CACHE[key] = hit
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        quantiles.append(hit[0])
        means.append(hit[1])
        steps.append(hit[2])
    return BaselineForecast(np.stack(quantiles), np.stack(means), np.asarray(steps, dtype=np.int64))

