"""Forecasting metrics with the GluonTS definitions used by the Chronos benchmarks.

No light library provides these exactly (GluonTS is a heavy dependency), so they are written
here in plain numpy and checked against hand computations in ``tests/experiment/test_metrics.py``
and against GluonTS itself (``SampleForecast.quantile``, ``Evaluator``) in
``tests/experiment/test_forecast_gluonts.py``.

:func:`mase`, :func:`quantile_loss`, :func:`wql`, :func:`sample_quantiles`, :func:`seasonality`,
:func:`seasonal_naive_forecast`, :func:`geometric_mean`, and :func:`forecast_scores` (the Chronos
benchmark protocol over held-out windows: per dataset and geometric mean relative to seasonal naive,
optionally beside statsforecast's AutoETS / AutoTheta / AutoARIMA: ``forecast_baselines.py``).

Errors. Inputs that make a metric meaningless raise ``ValueError`` naming the argument and
what was expected: mismatched shapes, empty inputs, NaN (except NaN as a missing value in
an in-sample series) or infinite values, a zero seasonal scale for MASE, a zero target sum
for WQL.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from domainfm.experiment.metric_inputs import ArrayLike, check_finite, to_numpy

__all__ = [
    "mase",
    "quantile_loss",
    "wql",
    "sample_quantiles",
    "seasonality",
    "seasonal_naive_forecast",
    "geometric_mean",
    "forecast_scores",
]


def _forecast_pair(y_true: ArrayLike, y_pred: ArrayLike, name_pred: str) -> tuple[np.ndarray, np.ndarray]:
    t = to_numpy(y_true, "y_true").astype(np.float64)
    p = to_numpy(y_pred, name_pred).astype(np.float64)
    if t.shape != p.shape:
        raise ValueError(f"y_true and {name_pred} have different shapes: {t.shape} vs {p.shape}")
    check_finite(t, "y_true")
    check_finite(p, name_pred)
    return t, p


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _series_list(insample: ArrayLike, name: str = "insample") -> tuple[list[np.ndarray], bool]:
    """A batch of 1-D float series, and whether a single series was given.

    Accepts one series (T,), a 2-D batch (N, T), or a sequence of N 1-D series of any lengths.
    NaN marks a missing value; infinities are rejected.
    """
    is_sequence = isinstance(insample, (list, tuple)) and len(insample) > 0 and all(
        isinstance(s, (list, tuple)) or getattr(s, "ndim", 0) >= 1 for s in insample
    )
    if is_sequence:
        series = [to_numpy(s, f"{name}[{i}]").astype(np.float64) for i, s in enumerate(insample)]
        single = False
    else:
        arr = to_numpy(insample, name).astype(np.float64)
        if arr.ndim not in (1, 2):
            raise ValueError(f"{name}: expected shape (T,) or (n_series, T), got {arr.shape}")
        single = arr.ndim == 1
        series = [arr] if single else list(arr)
    for i, s in enumerate(series):
        label = name if single else f"{name}[{i}]"
        if s.ndim != 1:
            raise ValueError(f"{label}: expected a 1-D series, got shape {s.shape}")
        if np.any(np.isinf(s)):
            raise ValueError(f"{label}: contains infinite values; use NaN for missing values")
    return series, single


def _seasonal_scale(series: np.ndarray, season_length: int, label: str) -> float:
    # GluonTS `calculate_seasonal_error`: mean |y[t] - y[t-m]|, falling back to m = 1 when the
    # series is not longer than a season. Pairs touching a NaN are skipped (GluonTS masks them).
    n = len(series)
    if n < 2:
        raise ValueError(f"{label}: has {n} value(s); the seasonal scale needs at least 2")
    m = season_length if season_length < n else 1
    diffs = np.abs(series[m:] - series[:-m])
    diffs = diffs[~np.isnan(diffs)]
    if diffs.size == 0:
        raise ValueError(f"{label}: no two observed values are {m} step(s) apart; the seasonal scale is undefined")
    scale = float(diffs.mean())
    if scale == 0.0:
        raise ValueError(
            f"{label}: the in-sample series does not change over lag {m} (seasonal scale 0), so MASE is "
            "undefined (GluonTS would return inf/nan)"
        )
    return scale


def mase(y_true: ArrayLike, y_pred_median: ArrayLike, insample: ArrayLike, season_length: int) -> float:
    r"""Mean absolute scaled error, as GluonTS defines it.

    .. math::

        \mathrm{MASE} = \frac{\frac{1}{H}\sum_{h=1}^{H} |y_{T+h} - \hat y_{T+h}|}
                             {\frac{1}{T-m}\sum_{t=m}^{T-1} |y_t - y_{t-m}|}

    where :math:`\hat y` is the median (0.5-quantile) forecast and the denominator, the
    seasonal error, comes from the in-sample (context) series only, skipping pairs with a
    NaN. If the in-sample series has at most ``season_length`` values, ``m = 1`` is used
    (GluonTS ``calculate_seasonal_error``). For a batch, the scaled absolute errors are
    averaged over all series and steps (GluonTS ``MASE`` aggregated over the whole dataset),
    which is the mean of the per-series MASE values when horizons are equal.

    Args:
        y_true: observed future values.
        y_pred_median: median forecast.
        insample: the context series that precede ``y_true``.
        season_length: seasonal period ``m`` (see :func:`seasonality`).

    Raises:
        ValueError: on a zero seasonal scale (constant in-sample series); GluonTS would
            return inf/nan.

    Shapes:
        ``y_true``, ``y_pred_median``: (H,) with ``insample`` (T,); or (N, H) with
        ``insample`` (N, T) or a sequence of N 1-D series of any length.
    """
    m = _check_positive_int(season_length, "season_length")
    t, p = _forecast_pair(y_true, y_pred_median, "y_pred_median")
    if t.ndim not in (1, 2):
        raise ValueError(f"y_true: expected shape (H,) or (n_series, H), got {t.shape}")
    series, single = _series_list(insample)
    if single != (t.ndim == 1):
        raise ValueError(
            f"insample: a single series goes with 1-D y_true and a batch with 2-D y_true; got "
            f"{'one series' if single else f'{len(series)} series'} and y_true of shape {t.shape}"
        )
    t2 = t.reshape(-1, t.shape[-1])
    p2 = p.reshape(t2.shape)
    if len(series) != len(t2):
        raise ValueError(f"insample has {len(series)} series but y_true has {len(t2)}")
    scales = np.array(
        [_seasonal_scale(s, m, "insample" if single else f"insample[{i}]") for i, s in enumerate(series)]
    )
    return float(np.mean(np.abs(t2 - p2) / scales[:, None]))


def _check_quantile_level(q: Any, name: str) -> float:
    try:
        q = float(q)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: expected a number in [0, 1], got {q!r}") from err
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"{name}: expected a quantile level in [0, 1], got {q}")
    return q


def _quantile_levels(quantile_levels: Sequence[float]) -> np.ndarray:
    levels = np.array(
        [_check_quantile_level(q, f"quantile_levels[{i}]") for i, q in enumerate(np.atleast_1d(quantile_levels))]
    )
    if levels.size == 0:
        raise ValueError("quantile_levels: is empty; give at least one level")
    return levels


def _quantile_loss_sum(t: np.ndarray, pred: np.ndarray, q: float) -> float:
    return float(2.0 * np.sum(np.abs((t - pred) * ((t <= pred) - q))))


def quantile_loss(y: ArrayLike, q_pred: ArrayLike, q: float) -> float:
    r"""Summed quantile (pinball) loss of one quantile forecast, GluonTS scaling.

    .. math:: \mathrm{QL}_q = 2 \sum_t \left| (y_t - \hat y^{(q)}_t)(\mathbb 1[y_t \le \hat y^{(q)}_t] - q) \right|

    A sum (not a mean) over every element; at ``q = 0.5`` it is the summed absolute error.

    Shapes:
        ``y``, ``q_pred``: any shape, equal.
    """
    q = _check_quantile_level(q, "q")
    t, p = _forecast_pair(y, q_pred, "q_pred")
    return _quantile_loss_sum(t, p, q)


def wql(y_true: ArrayLike, quantile_preds: ArrayLike, quantile_levels: Sequence[float]) -> float:
    r"""Weighted quantile loss over a whole dataset (GluonTS ``mean_weighted_sum_quantile_loss``).

    .. math:: \mathrm{WQL} = \frac{1}{|Q|} \sum_{q \in Q} \frac{\mathrm{QL}_q}{\sum_{i,t} |y_{i,t}|}

    Both sums run over *all* series and time steps before the division, so this is a
    dataset-level aggregate: it is not the mean of per-series WQL values. Call it once on the
    stacked test set of a dataset, as the Chronos benchmarks do.

    Raises:
        ValueError: if :math:`\sum |y| = 0`.

    Shapes:
        ``y_true``: any shape S, e.g. (H,) or (N, H). ``quantile_preds``: S + (len(quantile_levels),).
    """
    levels = _quantile_levels(quantile_levels)
    t = to_numpy(y_true, "y_true").astype(np.float64)
    qp = to_numpy(quantile_preds, "quantile_preds").astype(np.float64)
    if qp.shape != t.shape + (len(levels),):
        raise ValueError(
            f"quantile_preds: expected shape {t.shape + (len(levels),)} (y_true's shape plus one axis of "
            f"{len(levels)} quantile levels), got {qp.shape}"
        )
    check_finite(t, "y_true")
    check_finite(qp, "quantile_preds")
    abs_sum = float(np.sum(np.abs(t)))
    if abs_sum == 0.0:
        raise ValueError("y_true: all values are 0, so the weighted quantile loss (divided by sum |y|) is undefined")
    return float(np.mean([_quantile_loss_sum(t, qp[..., i], q) for i, q in enumerate(levels)]) / abs_sum)


def sample_quantiles(samples: ArrayLike, quantile_levels: Sequence[float]) -> np.ndarray:
    r"""Quantiles of sample paths by GluonTS's rule (``SampleForecast.quantile``): no interpolation.

    With the ``S`` samples of a step sorted, :math:`x_{(0)} \le \dots \le x_{(S-1)}`, the
    ``q``-quantile is :math:`x_{(k)}`, :math:`k = \mathrm{round}((S - 1)\,q)`, rounding half to
    even as ``np.round`` does. So with S = 20 the median is the 11th smallest sample, where
    ``np.quantile``/``np.median`` (linear interpolation) would average the 10th and 11th: on the
    shipped series' test windows that put one series' MASE 14.5% away from GluonTS's (20 samples
    of a small pretrained WaveToken). Every quantile, median and score of a sample forecast goes
    through this function, so that scores equal GluonTS's ``Evaluator``.

    Args:
        samples: sample paths, the sample axis second to last.
        quantile_levels: levels in [0, 1].

    Raises:
        ValueError: on samples with fewer than 2 dimensions or with NaN/infinite values (sorting
            would silently move them to one end), or on a level outside [0, 1].

    Shapes:
        ``samples``: (..., S, H), e.g. (S, H) for one forecast or (N, S, H) for N series.
        Returns (..., H, Q), Q = ``len(quantile_levels)``; numpy input keeps its dtype.
    """
    s = to_numpy(samples, "samples")
    if s.ndim < 2:
        raise ValueError(f"samples: expected shape (..., num_samples, prediction_length), got {s.shape}")
    check_finite(s, "samples")
    levels = _quantile_levels(quantile_levels)
    index = np.round((s.shape[-2] - 1) * levels).astype(np.intp)
    return np.moveaxis(np.sort(s, axis=-2)[..., index, :], -2, -1)


# GluonTS `DEFAULT_SEASONALITIES` (gluonts/time_feature/seasonality.py), keyed by pandas alias,
# old and new spellings. GluonTS maps start-anchored aliases to the end ones ("MS" -> "M"/"ME").
_BASE_SEASONALITY = {
    "S": 3600, "s": 3600,  # seconds: one hour
    "T": 1440, "min": 1440,  # minutes: one day
    "H": 24, "h": 24,  # hours: one day
    "D": 1,
    "B": 5,  # business days: one week
    "W": 1,
    "M": 12, "ME": 12, "MS": 12,
    "Q": 4, "QE": 4, "QS": 4,
}
# Other pandas aliases: valid frequencies without a default season in GluonTS (seasonality 1).
_OTHER_ALIASES = frozenset(
    "A AS Y YE YS BA BAS BY BYE BYS BQ BQE BQS BM BME BMS CBM CBME CBMS SM SME SMS "
    "C BH bh CBH cbh L ms U us N ns".split()
)
_FREQ_PATTERN = re.compile(r"^\s*(\d*)\s*([A-Za-z]+)(?:-[A-Za-z]+)?\s*$")


def seasonality(freq: str) -> int:
    """Default seasonal period of a pandas frequency string, as GluonTS ``get_seasonality``.

    Base periods: seconds 3600, minutes ("T"/"min") 1440, hours ("H"/"h") 24, days 1, business
    days ("B") 5, weeks 1, months ("M"/"ME"/"MS") 12, quarters ("Q"/"QE"/"QS") 4, and 1 for
    every other frequency (years included). A multiple ``n`` divides the base period when it
    divides evenly ("15min" -> 96, "2h" -> 12) and gives 1 otherwise ("7min", "2W").
    Anchors are ignored ("W-SUN", "Q-DEC").

    Raises:
        ValueError: if ``freq`` is not a pandas frequency alias.
    """
    match = _FREQ_PATTERN.match(freq) if isinstance(freq, str) else None
    if match is None or (match.group(2) not in _BASE_SEASONALITY and match.group(2) not in _OTHER_ALIASES):
        raise ValueError(f"freq: expected a pandas frequency string such as 'h', '15min', 'D', 'W', 'ME', got {freq!r}")
    multiple = int(match.group(1)) if match.group(1) else 1
    if multiple < 1:
        raise ValueError(f"freq: the multiple must be positive, got {freq!r}")
    base = _BASE_SEASONALITY.get(match.group(2), 1)
    period, remainder = divmod(base, multiple)
    return period if remainder == 0 else 1


def _impute_last_value(series: np.ndarray, label: str) -> np.ndarray:
    # GluonTS `LastValueImputation`: carry the last observed value forward; leading gaps take
    # the first observed value.
    missing = np.isnan(series)
    if not missing.any():
        return series
    if missing.all():
        raise ValueError(f"{label}: every value is NaN; a forecast needs at least one observation")
    index = np.where(missing, 0, np.arange(len(series)))
    np.maximum.accumulate(index, out=index)
    filled = series[index]
    filled[np.isnan(filled)] = series[np.flatnonzero(~missing)[0]]
    return filled


def seasonal_naive_forecast(insample: ArrayLike, prediction_length: int, season_length: int) -> np.ndarray:
    r"""The seasonal-naive reference forecast, as GluonTS ``SeasonalNaivePredictor``.

    :math:`\hat y_{T+k} = y_{T - m + (k \bmod m)}`, ``k = 0 .. prediction_length - 1``: the
    last season repeated. A series shorter than one season is forecast by its mean (GluonTS's
    fallback, the mean since 2023; not naive-1). Missing values (NaN) are first filled with the
    last observed value.

    Shapes:
        ``insample``: (T,) -> returns (prediction_length,); (N, T) or a sequence of N 1-D series
        -> returns (N, prediction_length).
    """
    h = _check_positive_int(prediction_length, "prediction_length")
    m = _check_positive_int(season_length, "season_length")
    series, single = _series_list(insample)
    forecasts = np.empty((len(series), h), dtype=np.float64)
    for i, s in enumerate(series):
        s = _impute_last_value(s, "insample" if single else f"insample[{i}]")
        n = len(s)
        forecasts[i] = s[n - m + np.arange(h) % m] if n >= m else s.mean()
    return forecasts[0] if single else forecasts


def geometric_mean(values: ArrayLike) -> float:
    """Geometric mean of positive scores, the aggregate over datasets of relative scores.

    The Chronos / GluonTS benchmark protocol divides each dataset's score (MASE, WQL) by the
    seasonal-naive score on that dataset and aggregates the ratios with this mean, so that no
    single dataset's scale dominates.

    Shapes:
        ``values``: (n_datasets,) positive, finite.
    """
    v = to_numpy(values, "values").astype(np.float64).reshape(-1)
    check_finite(v, "values")
    if np.any(v <= 0):
        raise ValueError(f"values: the geometric mean needs positive values, got {v[v <= 0][0]!r}")
    return float(np.exp(np.mean(np.log(v))))


def forecast_scores(windows: list[dict[str, Any]], samples: np.ndarray | None, quantile_levels, *,
                    quantiles: np.ndarray | None = None, baselines: Sequence[str] = (),
                    context_length: int | None = None) -> dict[str, float]:
    """MASE and WQL per dataset for model and seasonal naive (and the statistical ``baselines``),
    and their geometric means relative to seasonal naive across datasets.

    Args:
        windows: held-out windows (``context``, ``future``, ``freq``, optional ``dataset``).
        samples: (N, S, H) forecast samples (MASE scores their median, WQL their quantiles at
            ``quantile_levels``, both by GluonTS's rule: :func:`sample_quantiles`); ``None`` with
            ``quantiles=None`` scores only the seasonal-naive baseline (then there is no model
            score and no relative score).
        quantiles: (N, H, Q) quantile forecasts at ``quantile_levels`` (a quantile forecaster such
            as Chronos-Bolt; GluonTS ``QuantileForecast``): WQL scores them as they are and MASE
            scores the 0.5 level, which ``quantile_levels`` must then contain. Exclusive with
            ``samples``.
        baselines: statistical baselines fitted on the same contexts with the same season
            (keys of :data:`~domainfm.experiment.forecast_baselines.BASELINES`: ``auto_ets``,
            ``auto_theta``, ``auto_arima``; :func:`~domainfm.experiment.forecast_baselines.baseline_forecast`),
            scored like the model (MASE on the point forecast, its 0.5 quantile; WQL on the
            quantiles at ``quantile_levels``): ``<dataset>.<b>_mase``, ``<dataset>.<b>_wql``,
            ``<b>_mase_rel``, ``<b>_wql_rel``, ``<b>_fallback_windows`` (the windows a fallback
            forecast, see ``forecast_baselines``; also ``<dataset>.<b>_fallback_windows`` for each
            dataset where there are any); with any baseline, also ``naive_mase_rel = naive_wql_rel = 1``.
        context_length: the baselines are fitted on the last ``context_length`` values of each
            context, the window the model sees (None: the whole context). Seasonal naive and the
            MASE scale use the whole context, as GluonTS does.

    Keys: ``<dataset>.mase``, ``<dataset>.wql``, ``<dataset>.naive_mase``, ``<dataset>.naive_wql``,
    ``mase_rel``, ``wql_rel`` (with a model), the baselines' keys above, and ``n_datasets``.
    """
    from domainfm.experiment.forecast_baselines import baseline_forecast, check_baselines

    baselines = check_baselines(baselines)
    if context_length is not None:
        context_length = _check_positive_int(context_length, "context_length")
    levels = [float(q) for q in quantile_levels]
    if quantiles is not None:
        if samples is not None:
            raise ValueError("forecast_scores: pass samples or quantiles, not both")
        quantiles = np.asarray(quantiles, dtype=np.float64)
        if quantiles.ndim != 3 or quantiles.shape[0] != len(windows) or quantiles.shape[-1] != len(levels):
            raise ValueError(f"quantiles: expected shape ({len(windows)}, H, {len(levels)}) (windows, horizon, "
                             f"quantile levels), got {quantiles.shape}")
        medians = [i for i, q in enumerate(levels) if abs(q - 0.5) < 1e-9]
        if not medians:
            raise ValueError(f"quantile_levels={levels}: MASE scores the median; include 0.5 with quantile forecasts")
    has_model = samples is not None or quantiles is not None
    by_dataset: dict[str, list[int]] = {}
    for i, w in enumerate(windows):
        by_dataset.setdefault(w.get("dataset", "series"), []).append(i)
    out: dict[str, float] = {}
    rel_mase, rel_wql = [], []
    rel_baseline: dict[str, tuple[list[float], list[float]]] = {b: ([], []) for b in baselines}
    fallbacks = {b: 0 for b in baselines}
    for name, idx in by_dataset.items():
        freqs = {windows[i]["freq"] for i in idx}
        if len(freqs) > 1:
            raise ValueError(f"dataset {name!r} mixes frequencies {sorted(freqs)}")
        season = seasonality(freqs.pop())
        insample = [np.asarray(windows[i]["context"], dtype=np.float64) for i in idx]
        future = np.stack([np.asarray(windows[i]["future"], dtype=np.float64) for i in idx])
        naive = seasonal_naive_forecast(insample, future.shape[1], season)
        out[f"{name}.naive_mase"] = mase(future, naive, insample, season)
        out[f"{name}.naive_wql"] = wql(future, np.repeat(naive[..., None], len(levels), -1), levels)
        for b in baselines:
            seen = insample if context_length is None else [s[-context_length:] for s in insample]
            fit = baseline_forecast(b, seen, future.shape[1], season, levels)
            out[f"{name}.{b}_mase"] = mase(future, fit.mean, insample, season)
            out[f"{name}.{b}_wql"] = wql(future, fit.quantiles, levels)
            if fit.fallback_windows:  # labelled where it happened; the total is always reported
                out[f"{name}.{b}_fallback_windows"] = float(fit.fallback_windows)
            fallbacks[b] += fit.fallback_windows
            rel_baseline[b][0].append(out[f"{name}.{b}_mase"] / out[f"{name}.naive_mase"])
            rel_baseline[b][1].append(out[f"{name}.{b}_wql"] / out[f"{name}.naive_wql"])
        if has_model:
            if samples is not None:
                s = np.asarray(samples, dtype=np.float64)[idx]
                q_pred = sample_quantiles(s, levels)  # (n, H, Q)
                median = sample_quantiles(s, [0.5])[..., 0]  # GluonTS's median: its 0.5 quantile
            else:
                q_pred = quantiles[idx]
                median = q_pred[..., medians[0]]
            out[f"{name}.mase"] = mase(future, median, insample, season)
            out[f"{name}.wql"] = wql(future, q_pred, levels)
            rel_mase.append(out[f"{name}.mase"] / out[f"{name}.naive_mase"])
            rel_wql.append(out[f"{name}.wql"] / out[f"{name}.naive_wql"])
    if has_model:  # geometric mean over datasets of model / seasonal naive
        out["mase_rel"], out["wql_rel"] = geometric_mean(rel_mase), geometric_mean(rel_wql)
    if baselines:
        out["naive_mase_rel"] = out["naive_wql_rel"] = 1.0
    for b, (rm, rw) in rel_baseline.items():
        out[f"{b}_mase_rel"], out[f"{b}_wql_rel"] = geometric_mean(rm), geometric_mean(rw)
        out[f"{b}_fallback_windows"] = float(fallbacks[b])
    out["n_datasets"] = float(len(by_dataset))
    return out
