"""Evaluation metrics of fine-tuning: thin, strict wrappers over scikit-learn and scipy.

Every function accepts numpy arrays, Python sequences or torch tensors (converted once,
on the CPU, in float64 for real-valued inputs), checks them, hands them to the
scikit-learn (or scipy) function named in its docstring and returns a Python ``float``.
What this module adds is the input contract and the selection rules, not the arithmetic.

Classification
    :func:`accuracy`, :func:`top_k_accuracy`, :func:`balanced_accuracy`, :func:`cohen_kappa`,
    :func:`f1_weighted`, :func:`roc_auc`, :func:`pr_auc`.
Regression
    :func:`mae`, :func:`rmse`, :func:`r2`, :func:`pearson_r`.
Forecasting
    GluonTS-exact, in :mod:`domainfm.experiment.forecast_metrics` (re-exported here):
    :func:`mase`, :func:`quantile_loss`, :func:`wql`, :func:`seasonality`,
    :func:`seasonal_naive_forecast`, :func:`geometric_mean`.
Recipes
    :func:`compute` (the metric set of a task) and :data:`SELECTION` (the metric a run is
    selected by).

Errors. Inputs that make a metric meaningless raise ``ValueError`` naming the argument and
what was expected: mismatched lengths, empty inputs, NaN/inf, a single class for ROC-AUC /
PR-AUC / Cohen's kappa, a constant target for R² / Pearson's r (scikit-learn would return
``nan`` or a forced 0/1 with a warning). The one exception is a property of the *model's
output* rather than the data: constant predictions make Pearson's r undefined, and it
returns ``nan`` so that an early-training epoch cannot crash a run.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.stats
from sklearn import metrics as skm

from domainfm.experiment.forecast_metrics import (
    forecast_scores,
    geometric_mean,
    mase,
    quantile_loss,
    sample_quantiles,
    seasonal_naive_forecast,
    seasonality,
    wql,
)
from domainfm.experiment.metric_inputs import ArrayLike, check_finite, to_numpy

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
    "forecast_scores",
    "sample_quantiles",
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

# Row sums of class-probability scores may drift from 1 in low precision (bf16 softmax).
_PROB_SUM_ATOL = 1e-3


# ----------------------------------------------------------------------------- inputs


def _quiet(fn, *args, **kwargs):
    """Call a scikit-learn metric without its warnings: every case it warns about (a class
    seen only in ``y_pred``, ``k >= n_classes``) is either checked here first or documented
    as intended behaviour."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _as_1d(x: ArrayLike, name: str) -> np.ndarray:
    arr = to_numpy(x, name)
    if arr.ndim == 2 and arr.shape[1] == 1:  # (n, 1) outputs of a one-unit head
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected shape (n,) or (n, 1), got {arr.shape}")
    check_finite(arr, name)
    return arr


def _labels_pair(y_true: ArrayLike, y_pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = _as_1d(y_true, "y_true")
    p = _as_1d(y_pred, "y_pred")
    if len(t) != len(p):
        raise ValueError(f"y_true and y_pred have different lengths: {len(t)} vs {len(p)}")
    if (t.dtype.kind in "US") != (p.dtype.kind in "US"):
        raise ValueError(f"y_true and y_pred hold different kinds of labels: {t.dtype} vs {p.dtype}")
    return t, p


def _float_pair(y_true: ArrayLike, y_pred: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    t = _as_1d(y_true, "y_true").astype(np.float64)
    p = _as_1d(y_pred, "y_pred").astype(np.float64)
    if len(t) != len(p):
        raise ValueError(f"y_true and y_pred have different lengths: {len(t)} vs {len(p)}")
    return t, p


def _scores_2d(scores: ArrayLike, n: int) -> np.ndarray:
    s = to_numpy(scores, "scores").astype(np.float64)
    if s.ndim != 2 or s.shape[1] < 2:
        raise ValueError(f"scores: expected shape (n, K) with K >= 2 classes, got {s.shape}")
    if s.shape[0] != n:
        raise ValueError(f"y_true and scores have different lengths: {n} vs {s.shape[0]}")
    check_finite(s, "scores")
    return s


def _check_class_indices(t: np.ndarray, n_classes: int) -> np.ndarray:
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
    return t.astype(np.int64)


# ----------------------------------------------------------------------------- classification


def accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Fraction of exact label matches (``sklearn.metrics.accuracy_score``).

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels (ints, bools or strings).
    """
    t, p = _labels_pair(y_true, y_pred)
    return float(skm.accuracy_score(t, p))


def top_k_accuracy(y_true: ArrayLike, scores: ArrayLike, k: int) -> float:
    """Fraction of samples whose true class is among the ``k`` highest scores.

    ``sklearn.metrics.top_k_accuracy_score(y_true, scores, k=k, labels=range(K))``, with its
    tie rule: among equal scores the higher class index ranks first. ``k >= K`` gives 1.0.
    With K = 2 scikit-learn wants a 1-D score instead, so two columns are ranked here by the
    same rule (class 1 wins a tie).

    Shapes:
        ``y_true``: (n,) integer classes in ``[0, K)``. ``scores``: (n, K), any monotone scores
        (logits or probabilities).
    """
    t = _as_1d(y_true, "y_true")
    s = _scores_2d(scores, len(t))
    n_classes = s.shape[1]
    t = _check_class_indices(t, n_classes)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected a positive integer, got {k!r}")
    if k >= n_classes:
        return 1.0
    if n_classes == 2:  # k == 1
        return float(np.mean((s[:, 1] >= s[:, 0]).astype(np.int64) == t))
    return float(_quiet(skm.top_k_accuracy_score, t, s, k=k, labels=np.arange(n_classes)))


def balanced_accuracy(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Mean per-class recall over the classes present in ``y_true``.

    ``sklearn.metrics.balanced_accuracy_score`` (``adjusted=False``): classes that occur only
    in ``y_pred`` have no recall and are left out.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    return float(_quiet(skm.balanced_accuracy_score, t, p))


def cohen_kappa(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    r"""Cohen's kappa, :math:`\kappa = (p_o - p_e) / (1 - p_e)`, unweighted.

    ``sklearn.metrics.cohen_kappa_score``. It is undefined when chance agreement is certain
    (:math:`p_e = 1`: ``y_true`` and ``y_pred`` hold one and the same single label), which
    raises ``ValueError`` here where scikit-learn returns ``nan`` with a warning.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    if len(np.unique(np.concatenate([t, p]))) == 1:
        raise ValueError(
            f"cohen_kappa: undefined because y_true and y_pred contain the single label {t[0]!r} only "
            "(chance agreement is 1); evaluate on data with more than one class"
        )
    return float(skm.cohen_kappa_score(t, p))


def f1_weighted(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Support-weighted mean of per-class F1.

    ``sklearn.metrics.f1_score(average="weighted", zero_division=0)``: per-class
    :math:`F_1 = 2TP / (2TP + FP + FN)`, weighted by the class count in ``y_true``; a class
    seen only in ``y_pred`` has weight 0.

    Shapes:
        ``y_true``, ``y_pred``: (n,) labels.
    """
    t, p = _labels_pair(y_true, y_pred)
    return float(_quiet(skm.f1_score, t, p, average="weighted", zero_division=0))


def _binary_positive(t: np.ndarray, metric: str) -> np.ndarray:
    """0/1 positives; the larger of the two labels is the positive class (sklearn's rule)."""
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
    return (t == classes[1]).astype(np.int64)


def _ranking_metric(y_true: ArrayLike, scores: ArrayLike, metric: str, sk_fn, require_probabilities: bool) -> float:
    """Binary (1-D scores) or one-vs-rest macro average ((n, K) scores) of ``sk_fn``."""
    t = _as_1d(y_true, "y_true")
    s_arr = to_numpy(scores, "scores")
    if s_arr.ndim == 2 and s_arr.shape[1] == 1:
        s_arr = s_arr[:, 0]
    if s_arr.ndim == 1:
        s = s_arr.astype(np.float64)
        if len(s) != len(t):
            raise ValueError(f"y_true and scores have different lengths: {len(t)} vs {len(s)}")
        check_finite(s, "scores")
        return float(sk_fn(_binary_positive(t, metric), s))
    s = _scores_2d(s_arr, len(t))
    n_classes = s.shape[1]
    t = _check_class_indices(t, n_classes)
    missing = np.setdiff1d(np.arange(n_classes), t)
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
    # One-vs-rest through the label indicator matrix: exactly what scikit-learn's "ovr" does
    # after binarizing, without its sum-to-one check at float64 tolerance, which bf16 softmax
    # outputs fail (checked above at _PROB_SUM_ATOL instead).
    indicator = (t[:, None] == np.arange(n_classes)).astype(np.int64)
    return float(sk_fn(indicator, s, average="macro"))


def roc_auc(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Area under the ROC curve (``sklearn.metrics.roc_auc_score``).

    Binary (1-D ``scores``): the score of the positive class, which is the larger of the two
    labels in ``y_true``; ties count one half. Multiclass ((n, K) ``scores``): one-vs-rest,
    macro average, as ``roc_auc_score(multi_class="ovr")``; rows must be probabilities (sum
    to 1 within 1e-3) and every class in ``[0, K)`` must occur in ``y_true``.

    Shapes:
        ``y_true``: (n,). ``scores``: (n,) or (n, K).
    """
    return _ranking_metric(y_true, scores, "roc_auc", skm.roc_auc_score, require_probabilities=True)


def pr_auc(y_true: ArrayLike, scores: ArrayLike) -> float:
    """Average precision, the step-wise area under the precision-recall curve.

    ``sklearn.metrics.average_precision_score``: :math:`\\sum_n (R_n - R_{n-1}) P_n` over score
    thresholds, not the trapezoid. Binary (1-D ``scores``): the positive class is the larger
    label. Multiclass ((n, K) ``scores``): one-vs-rest macro average.

    Shapes:
        ``y_true``: (n,). ``scores``: (n,) or (n, K).
    """
    return _ranking_metric(y_true, scores, "pr_auc", skm.average_precision_score, require_probabilities=False)


# ----------------------------------------------------------------------------- regression


def mae(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Mean absolute error (``sklearn.metrics.mean_absolute_error``).

    Shapes: ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    return float(skm.mean_absolute_error(t, p))


def rmse(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Root mean squared error (square root of ``sklearn.metrics.mean_squared_error``).

    Shapes: ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    return float(np.sqrt(skm.mean_squared_error(t, p)))


def _require_varying(t: np.ndarray, metric: str) -> None:
    if np.ptp(t) == 0:
        raise ValueError(f"{metric}: y_true is constant ({t[0]!r}), so the metric is undefined")


def r2(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Coefficient of determination, :math:`1 - SS_{res} / SS_{tot}` (``sklearn.metrics.r2_score``).

    A constant ``y_true`` (zero :math:`SS_{tot}`) raises ``ValueError`` where scikit-learn
    forces the value to 0 or 1.

    Shapes:
        ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    _require_varying(t, "r2")
    return float(skm.r2_score(t, p))


def pearson_r(y_true: ArrayLike, y_pred: ArrayLike) -> float:
    """Pearson correlation coefficient between targets and predictions (``scipy.stats.pearsonr``).

    A constant ``y_true`` raises ``ValueError``; constant predictions return ``nan`` (a
    collapsed model, not bad data).

    Shapes:
        ``y_true``, ``y_pred``: (n,) or (n, 1).
    """
    t, p = _float_pair(y_true, y_pred)
    _require_varying(t, "pearson_r")
    if np.ptp(p) == 0:
        return float("nan")
    return float(scipy.stats.pearsonr(t, p)[0])


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
        out = to_numpy(y_pred_or_scores, "y_pred_or_scores")
        if out.ndim == 2 and out.shape[1] > 1:
            check_finite(out, "y_pred_or_scores")
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
        probs = to_numpy(y_pred_or_scores, "y_pred_or_scores")
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
