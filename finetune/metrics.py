"""Evaluation metrics for fine-tuning and forecasting, in plain numpy.

Every function accepts numpy arrays, Python sequences or torch tensors (converted once,
on the CPU, in float64 for real-valued inputs) and returns a Python ``float`` (or an array
where stated). scikit-learn is *not* needed at run time; the classification and regression
metrics reproduce its definitions and the test suite checks them against it.

Classification
    :func:`accuracy`, :func:`top_k_accuracy`, :func:`balanced_accuracy`, :func:`cohen_kappa`,
    :func:`f1_weighted`, :func:`roc_auc`, :func:`pr_auc`.
Regression
    :func:`mae`, :func:`rmse`, :func:`r2`, :func:`pearson_r`.
Forecasting (GluonTS definitions, as used by the Chronos benchmarks)
    :func:`mase`, :func:`quantile_loss`, :func:`wql`, :func:`seasonality`,
    :func:`seasonal_naive_forecast`, :func:`geometric_mean`.
Recipes
    :func:`compute` (the metric set of a task) and :data:`SELECTION` (the metric a run is
    selected by).

Errors. Inputs that make a metric meaningless raise ``ValueError`` naming the argument and
what was expected: mismatched lengths, empty inputs, NaN/inf, a single class for ROC-AUC /
PR-AUC / Cohen's kappa, a constant target for R² / Pearson's r, a zero seasonal scale for
MASE, a zero target sum for WQL. The one exception is a property of the *model's output*
rather than the data: constant predictions make Pearson's r undefined, and it returns
``nan`` so that an early-training epoch cannot crash a run.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

__all__ = [
    "accuracy",
    "top_k_accuracy",
    "balanced_accuracy",
    "cohen_kappa",
    "f1_weighted",
    "roc_auc",
    "pr_auc",
    "mae",
    "rmse",
    "r2",
    "pearson_r",
    "mase",
    "quantile_loss",
    "wql",
    "seasonality",
    "seasonal_naive_forecast",
    "geometric_mean",
    "compute",
    "SELECTION",
    "TASKS",
]

ArrayLike = Any  # numpy array, torch tensor, or nested Python sequence

# Row sums of class-probability scores may drift from 1 in low precision (bf16 softmax).
_PROB_SUM_ATOL = 1e-3


# ----------------------------------------------------------------------------- inputs


def _to_numpy(x: ArrayLike, name: str) -> np.ndarray:
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


def _check_finite(arr: np.ndarray, name: str) -> None:
    if np.issubdtype(arr.dtype, np.inexact) and not np.all(np.isfinite(arr)):
        n_nan = int(np.isnan(arr).sum())
        n_inf = int(np.isinf(arr).sum())
        raise ValueError(f"{name}: contains {n_nan} NaN and {n_inf} infinite value(s); all values must be finite")


def _as_1d(x: ArrayLike, name: str) -> np.ndarray:
    arr = _to_numpy(x, name)
    if arr.ndim == 2 and arr.shape[1] == 1:  # (n, 1) outputs of a one-unit head
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected shape (n,) or (n, 1), got {arr.shape}")
    _check_finite(arr, name)
    return arr


def _labels_pair(y_true: ArrayLike, y_pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = _as_1d(y_true, "y_true")
    p = _as_1d(y_pred, "y_pred")
    if len(t) != len(p):
        raise ValueError(f"y_true and y_pred have different lengths: {len(t)} vs {len(p)}")
    if (t.dtype.kind in "US") != (p.dtype.kind in "US"):
        raise ValueError(f"y_true and y_pred hold different kinds of labels: {t.dtype} vs {p.dtype}")
    return t, p


def _float_pair(y_true: ArrayLike, y_pred: ArrayLike, name_pred: str = "y_pred") -> tuple[np.ndarray, np.ndarray]:
    t = _as_1d(y_true, "y_true").astype(np.float64)
    p = _as_1d(y_pred, name_pred).astype(np.float64)
    if len(t) != len(p):
        raise ValueError(f"y_true and {name_pred} have different lengths: {len(t)} vs {len(p)}")
    return t, p


def _confusion(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """Confusion matrix over the sorted union of labels (sklearn's default ``labels``)."""
    _, inverse = np.unique(np.concatenate([y_true, y_pred]), return_inverse=True)
    inverse = inverse.reshape(-1)
    n = len(y_true)
    k = int(inverse.max()) + 1
    counts = np.bincount(inverse[:n] * k + inverse[n:], minlength=k * k)
    return counts.reshape(k, k).astype(np.float64)


# ----------------------------------------------------------------------------- classification


def accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Fraction of exact label matches.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels (ints, bools or strings).
    """
    t, p = _labels_pair(y_true, y_pred)
    return float(np.mean(t == p))


def top_k_accuracy(y_true: ArrayLike, scores: ArrayLike, k: int) -> float:
    """Fraction of samples whose true class is among the ``k`` highest scores.

    Equals ``sklearn.metrics.top_k_accuracy_score(y_true, scores, k=k, labels=range(K))``,
    including its tie rule: among equal scores the higher class index ranks first.
    ``k >= K`` gives 1.0.

    Shapes:
        ``y_true``: (n,) integer classes in ``[0, K)``. ``scores``: (n, K), any monotone scores
        (logits or probabilities).
    """
    t = _as_1d(y_true, "y_true")
    s = _scores_2d(scores, len(t))
    _check_class_indices(t, s.shape[1])
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected a positive integer, got {k!r}")
    # Stable ascending sort, reversed: the same order (and tie-breaking) as scikit-learn.
    ranked = np.argsort(s, axis=1, kind="mergesort")[:, ::-1][:, :k]
    return float(np.mean((ranked == t.astype(np.int64)[:, None]).any(axis=1)))


def balanced_accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Mean per-class recall over the classes present in ``y_true``.

    Same as ``sklearn.metrics.balanced_accuracy_score`` (``adjusted=False``): classes that
    occur only in ``y_pred`` have no recall and are left out.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    cm = _confusion(t, p)
    support = cm.sum(axis=1)
    present = support > 0
    return float(np.mean(np.diag(cm)[present] / support[present]))


def cohen_kappa(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    r"""Cohen's kappa, :math:`\kappa = (p_o - p_e) / (1 - p_e)`, unweighted.

    Same as ``sklearn.metrics.cohen_kappa_score``. It is undefined when chance agreement is
    certain (:math:`p_e = 1`: ``y_true`` and ``y_pred`` hold one and the same single label),
    which raises ``ValueError`` here where scikit-learn returns ``nan`` with a warning.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    cm = _confusion(t, p)
    n = cm.sum()
    observed_disagreement = (n - np.trace(cm)) / n
    expected = np.outer(cm.sum(axis=1), cm.sum(axis=0)) / (n * n)
    expected_disagreement = 1.0 - np.trace(expected)
    if expected_disagreement <= 0.0:
        raise ValueError(
            f"cohen_kappa: undefined because y_true and y_pred contain the single label {t[0]!r} only "
            "(chance agreement is 1); evaluate on data with more than one class"
        )
    return float(1.0 - observed_disagreement / expected_disagreement)


def f1_weighted(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Support-weighted mean of per-class F1.

    Same as ``sklearn.metrics.f1_score(average="weighted", zero_division=0)``: per-class
    :math:`F_1 = 2TP / (2TP + FP + FN)`, weighted by the class count in ``y_true``; a class
    seen only in ``y_pred`` has weight 0.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    cm = _confusion(t, p)
    tp = np.diag(cm)
    support = cm.sum(axis=1)
    denom = support + cm.sum(axis=0)  # 2TP + FN + FP
    f1 = np.divide(2.0 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
    return float(np.sum(f1 * support) / np.sum(support))


def _scores_2d(scores: ArrayLike, n: int) -> np.ndarray:
    s = _to_numpy(scores, "scores").astype(np.float64)
    if s.ndim != 2 or s.shape[1] < 2:
        raise ValueError(f"scores: expected shape (n, K) with K >= 2 classes, got {s.shape}")
    if s.shape[0] != n:
        raise ValueError(f"y_true and scores have different lengths: {n} vs {s.shape[0]}")
    _check_finite(s, "scores")
    return s


def _check_class_indices(t: np.ndarray, n_classes: int) -> None:
    if t.dtype.kind == "f":
        if not np.all(t == np.round(t)):
            raise ValueError("y_true: expected integer class indices, got non-integer values")
    elif t.dtype.kind not in "iub":
        raise ValueError(f"y_true: expected integer class indices, got dtype {t.dtype}")
    bad = (t < 0) | (t >= n_classes)
    if np.any(bad):
        raise ValueError(
            f"y_true: class index {t[bad][0]!r} is outside [0, {n_classes}) given by scores with {n_classes} columns"
        )


def _binary_positive(t: np.ndarray, metric: str) -> np.ndarray:
    """Boolean positives; the larger of the two labels is the positive class (sklearn's rule)."""
    classes = np.unique(t)
    if len(classes) == 1:
        raise ValueError(
            f"{metric}: y_true contains only one class ({classes[0]!r}); it is undefined without both classes"
        )
    if len(classes) > 2:
        raise ValueError(
            f"{metric}: y_true has {len(classes)} classes but scores are 1-D; pass (n, K) class "
            "probabilities for one-vs-rest"
        )
    return t == classes[1]


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the mean of their positions (as ``scipy.stats.rankdata``)."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.concatenate([[0], np.flatnonzero(xs[1:] != xs[:-1]) + 1])
    ends = np.concatenate([starts[1:], [len(x)]])
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def _binary_roc_auc(positive: np.ndarray, s: np.ndarray) -> float:
    # Mann-Whitney U: AUC = P(score_pos > score_neg) + 0.5 P(tie), exactly the trapezoidal
    # area under the ROC curve, with ties resolved by average ranks.
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    rank_sum = _average_ranks(s)[positive].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _binary_average_precision(positive: np.ndarray, s: np.ndarray) -> float:
    # Step-wise sum_n (R_n - R_{n-1}) P_n over distinct thresholds, highest first; no
    # interpolation (the trapezoid over-estimates on PR curves).
    order = np.argsort(-s, kind="mergesort")
    s_sorted = s[order]
    last_of_tie = np.concatenate([np.flatnonzero(s_sorted[1:] != s_sorted[:-1]), [len(s) - 1]])
    tp = np.cumsum(positive[order])[last_of_tie].astype(np.float64)
    precision = tp / (last_of_tie + 1)
    recall = tp / tp[-1]
    return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def _one_vs_rest(y_true: ArrayLike, scores: ArrayLike, metric: str, binary_fn, require_probabilities: bool) -> float:
    t = _as_1d(y_true, "y_true")
    s_arr = _to_numpy(scores, "scores")
    if s_arr.ndim == 2 and s_arr.shape[1] == 1:
        s_arr = s_arr[:, 0]
    if s_arr.ndim == 1:
        s = s_arr.astype(np.float64)
        if len(s) != len(t):
            raise ValueError(f"y_true and scores have different lengths: {len(t)} vs {len(s)}")
        _check_finite(s, "scores")
        return binary_fn(_binary_positive(t, metric), s)
    s = _scores_2d(s_arr, len(t))
    n_classes = s.shape[1]
    _check_class_indices(t, n_classes)
    missing = np.setdiff1d(np.arange(n_classes), t.astype(np.int64))
    if len(missing):
        raise ValueError(
            f"{metric}: classes {missing.tolist()} of the {n_classes} score columns never occur in y_true; "
            "one-vs-rest needs every class present"
        )
    if require_probabilities:
        row_sums = s.sum(axis=1)
        if not np.allclose(row_sums, 1.0, rtol=0.0, atol=_PROB_SUM_ATOL):
            raise ValueError(
                f"scores: rows must be class probabilities summing to 1 for multiclass {metric} "
                f"(got sums in [{row_sums.min():.4g}, {row_sums.max():.4g}]); apply softmax to logits"
            )
    t = t.astype(np.int64)
    return float(np.mean([binary_fn(t == c, s[:, c]) for c in range(n_classes)]))


def roc_auc(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Area under the ROC curve.

    Binary (1-D ``scores``): the score of the positive class, which is the larger of the two
    labels in ``y_true``; ties count one half (average ranks), so the value equals
    ``sklearn.metrics.roc_auc_score``. Multiclass ((n, K) ``scores``): one-vs-rest, macro
    average, as ``roc_auc_score(multi_class="ovr")``; rows must be probabilities (sum to 1)
    and every class in ``[0, K)`` must occur in ``y_true``.

    Shapes:
        ``y_true``: (n,). ``scores``: (n,) or (n, K).
    """
    return _one_vs_rest(y_true, scores, "roc_auc", _binary_roc_auc, require_probabilities=True)


def pr_auc(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Average precision, the step-wise area under the precision-recall curve.

    Equals ``sklearn.metrics.average_precision_score``: :math:`\\sum_n (R_n - R_{n-1}) P_n`
    over score thresholds, not the trapezoid. Binary (1-D ``scores``): the positive class is
    the larger label. Multiclass ((n, K) ``scores``): one-vs-rest macro average.

    Shapes:
        ``y_true``: (n,). ``scores``: (n,) or (n, K).
    """
    return _one_vs_rest(y_true, scores, "pr_auc", _binary_average_precision, require_probabilities=False)


# ----------------------------------------------------------------------------- regression


def mae(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Mean absolute error. Shapes: ``y_true``, ``y_pred``: (n,) or (n, 1)."""
    t, p = _float_pair(y_true, y_pred)
    return float(np.mean(np.abs(t - p)))


def rmse(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Root mean squared error. Shapes: ``y_true``, ``y_pred``: (n,) or (n, 1)."""
    t, p = _float_pair(y_true, y_pred)
    return float(np.sqrt(np.mean((t - p) ** 2)))


def _require_varying(t: np.ndarray, metric: str) -> None:
    if np.ptp(t) == 0:
        raise ValueError(f"{metric}: y_true is constant ({t[0]!r}), so the metric is undefined")


def r2(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Coefficient of determination, :math:`1 - SS_{res} / SS_{tot}`.

    Same as ``sklearn.metrics.r2_score``, except that a constant ``y_true`` (zero
    :math:`SS_{tot}`) raises ``ValueError`` instead of being forced to 0 or 1.

    Shapes:
        ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    _require_varying(t, "r2")
    return float(1.0 - np.sum((t - p) ** 2) / np.sum((t - t.mean()) ** 2))


def pearson_r(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Pearson correlation coefficient between targets and predictions.

    A constant ``y_true`` raises ``ValueError``; constant predictions return ``nan`` (a
    collapsed model, not bad data).

    Shapes:
        ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    _require_varying(t, "pearson_r")
    if np.ptp(p) == 0:
        return float("nan")
    dt = t - t.mean()
    dp = p - p.mean()
    r = np.sum(dt * dp) / np.sqrt(np.sum(dt**2) * np.sum(dp**2))
    return float(np.clip(r, -1.0, 1.0))


# ----------------------------------------------------------------------------- forecasting


def _forecast_pair(y_true: ArrayLike, y_pred: ArrayLike, name_pred: str) -> tuple[np.ndarray, np.ndarray]:
    t = _to_numpy(y_true, "y_true").astype(np.float64)
    p = _to_numpy(y_pred, name_pred).astype(np.float64)
    if t.shape != p.shape:
        raise ValueError(f"y_true and {name_pred} have different shapes: {t.shape} vs {p.shape}")
    _check_finite(t, "y_true")
    _check_finite(p, name_pred)
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
        series = [_to_numpy(s, f"{name}[{i}]").astype(np.float64) for i, s in enumerate(insample)]
        single = False
    else:
        arr = _to_numpy(insample, name).astype(np.float64)
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
    levels = np.array(
        [_check_quantile_level(q, f"quantile_levels[{i}]") for i, q in enumerate(np.atleast_1d(quantile_levels))]
    )
    if levels.size == 0:
        raise ValueError("quantile_levels: is empty; give at least one level")
    t = _to_numpy(y_true, "y_true").astype(np.float64)
    qp = _to_numpy(quantile_preds, "quantile_preds").astype(np.float64)
    if qp.shape != t.shape + (len(levels),):
        raise ValueError(
            f"quantile_preds: expected shape {t.shape + (len(levels),)} (y_true's shape plus one axis of "
            f"{len(levels)} quantile levels), got {qp.shape}"
        )
    _check_finite(t, "y_true")
    _check_finite(qp, "quantile_preds")
    abs_sum = float(np.sum(np.abs(t)))
    if abs_sum == 0.0:
        raise ValueError("y_true: all values are 0, so the weighted quantile loss (divided by sum |y|) is undefined")
    return float(np.mean([_quantile_loss_sum(t, qp[..., i], q) for i, q in enumerate(levels)]) / abs_sum)


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
    v = _to_numpy(values, "values").astype(np.float64).reshape(-1)
    _check_finite(v, "values")
    if np.any(v <= 0):
        raise ValueError(f"values: the geometric mean needs positive values, got {v[v <= 0][0]!r}")
    return float(np.exp(np.mean(np.log(v))))


# ----------------------------------------------------------------------------- recipes

TASKS = ("multiclass", "binary", "regression")

# The metric a fine-tuning run is selected by, and its direction (CBraMod's rules:
# multiclass by Cohen's kappa, binary by ROC-AUC).
SELECTION: dict[str, tuple[str, str]] = {
    "multiclass": ("cohen_kappa", "max"),
    "binary": ("roc_auc", "max"),
    "regression": ("r2", "max"),
}


def compute(task: str, y_true: ArrayLike, y_pred_or_scores: ArrayLike) -> dict[str, float]:
    """The metric set of a fine-tuning task.

    - ``"multiclass"``: ``y_pred_or_scores`` are labels (n,) or scores/logits (n, K), reduced
      by argmax; returns balanced_accuracy, cohen_kappa, f1_weighted, accuracy.
    - ``"binary"``: ``y_true`` in {0, 1} and positive-class probabilities (n,) in [0, 1];
      labels for balanced_accuracy and accuracy are ``p > 0.5`` (CBraMod's rule); returns
      balanced_accuracy, pr_auc, roc_auc, accuracy. pr_auc is average precision, the
      step-wise area; CBraMod's published PR-AUC is the trapezoid over the PR curve
      (``auc(recall, precision)``), which reads slightly higher.
    - ``"regression"``: predictions (n,) or (n, 1); returns pearson_r, r2, rmse, mae.
    """
    if task == "multiclass":
        out = _to_numpy(y_pred_or_scores, "y_pred_or_scores")
        if out.ndim == 2 and out.shape[1] > 1:
            _check_finite(out, "y_pred_or_scores")
            out = np.argmax(out, axis=1)
        return {
            "balanced_accuracy": balanced_accuracy(y_true, out),
            "cohen_kappa": cohen_kappa(y_true, out),
            "f1_weighted": f1_weighted(y_true, out),
            "accuracy": accuracy(y_true, out),
        }
    if task == "binary":
        t = _as_1d(y_true, "y_true")
        if not np.all((t == 0) | (t == 1)):
            raise ValueError(f"y_true: binary task expects labels 0 and 1, got values {np.unique(t)[:5].tolist()}")
        probs = _to_numpy(y_pred_or_scores, "y_pred_or_scores")
        if probs.ndim == 2 and probs.shape[1] != 1:
            raise ValueError(
                f"y_pred_or_scores: binary task expects the positive-class probability per sample, shape (n,), "
                f"got {probs.shape}"
            )
        probs = _as_1d(probs, "y_pred_or_scores").astype(np.float64)
        if probs.min() < 0.0 or probs.max() > 1.0:
            raise ValueError(
                f"y_pred_or_scores: binary task expects probabilities in [0, 1], got range "
                f"[{probs.min():.4g}, {probs.max():.4g}]; apply a sigmoid to logits"
            )
        labels = (probs > 0.5).astype(np.int64)
        return {
            "balanced_accuracy": balanced_accuracy(t, labels),
            "pr_auc": pr_auc(t, probs),
            "roc_auc": roc_auc(t, probs),
            "accuracy": accuracy(t, labels),
        }
    if task == "regression":
        return {
            "pearson_r": pearson_r(y_true, y_pred_or_scores),
            "r2": r2(y_true, y_pred_or_scores),
            "rmse": rmse(y_true, y_pred_or_scores),
            "mae": mae(y_true, y_pred_or_scores),
        }
    raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
