"""domainfm.experiment.metrics (thin wrappers over scikit-learn / scipy) against values computed
by hand and against direct scikit-learn calls, its edge-case contract (single class, constant
targets, bf16 probabilities, K = 2 top-k), and domainfm.experiment.forecast_metrics against
values computed by hand (GluonTS definitions)."""

import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from sklearn import metrics as skm

from domainfm.experiment import metrics

SEEDS = [0, 1, 2, 3]


def _softmax(logits):
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def _labels(rng, n, n_classes, imbalanced):
    p = np.array([0.7] + [0.3 / (n_classes - 1)] * (n_classes - 1)) if imbalanced else None
    return rng.choice(n_classes, size=n, p=p)


def _noisy_predictions(rng, y, n_classes, flip=0.4):
    flipped = rng.random(len(y)) < flip
    return np.where(flipped, rng.integers(0, n_classes, len(y)), y)


def _sk(fn, *args, **kwargs):
    with warnings.catch_warnings():  # scikit-learn warns about classes seen only in y_pred
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- classification vs scikit-learn


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n_classes,imbalanced", [(2, False), (2, True), (4, False), (5, True)])
def test_label_metrics_match_sklearn(seed, n_classes, imbalanced):
    rng = np.random.default_rng(seed)
    y = _labels(rng, 300, n_classes, imbalanced)
    pred = _noisy_predictions(rng, y, n_classes)
    assert metrics.accuracy(y, pred) == pytest.approx(skm.accuracy_score(y, pred), abs=1e-12)
    assert metrics.balanced_accuracy(y, pred) == pytest.approx(_sk(skm.balanced_accuracy_score, y, pred), abs=1e-12)
    assert metrics.cohen_kappa(y, pred) == pytest.approx(skm.cohen_kappa_score(y, pred), abs=1e-12)
    assert metrics.f1_weighted(y, pred) == pytest.approx(
        skm.f1_score(y, pred, average="weighted", zero_division=0), abs=1e-12
    )


def test_label_metrics_with_a_class_only_in_predictions():
    # Class 3 never occurs in y_true: balanced accuracy leaves it out, F1 gives it weight 0,
    # and kappa counts it in the chance agreement.
    rng = np.random.default_rng(7)
    y = rng.integers(0, 3, 50)
    pred = np.where(rng.random(50) < 0.3, 3, y)
    pred[:5] = (y[:5] + 1) % 3
    assert metrics.balanced_accuracy(y, pred) == pytest.approx(_sk(skm.balanced_accuracy_score, y, pred), abs=1e-12)
    assert metrics.f1_weighted(y, pred) == pytest.approx(
        _sk(skm.f1_score, y, pred, average="weighted", zero_division=0), abs=1e-12
    )
    assert metrics.cohen_kappa(y, pred) == pytest.approx(skm.cohen_kappa_score(y, pred), abs=1e-12)


def test_label_metrics_on_string_labels():
    y = np.array(["W", "N1", "N2", "N2", "REM", "W", "N3"])
    pred = np.array(["W", "N2", "N2", "N1", "REM", "N1", "N3"])
    assert metrics.balanced_accuracy(y, pred) == pytest.approx(skm.balanced_accuracy_score(y, pred))
    assert metrics.cohen_kappa(y, pred) == pytest.approx(skm.cohen_kappa_score(y, pred))
    assert metrics.f1_weighted(y, pred) == pytest.approx(skm.f1_score(y, pred, average="weighted", zero_division=0))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_accuracy_matches_sklearn_with_ties(seed, k):
    rng = np.random.default_rng(seed)
    n_classes = 5
    y = _labels(rng, 200, n_classes, imbalanced=seed % 2 == 1)
    scores = rng.integers(0, 4, size=(200, n_classes)).astype(float)  # many ties
    expected = _sk(skm.top_k_accuracy_score, y, scores, k=k, labels=np.arange(n_classes))
    assert metrics.top_k_accuracy(y, scores, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("imbalanced", [False, True])
def test_binary_roc_auc_and_pr_auc_match_sklearn_with_ties(seed, imbalanced):
    rng = np.random.default_rng(seed)
    y = (rng.random(400) < (0.1 if imbalanced else 0.5)).astype(int)
    scores = np.round(np.clip(0.3 * y + rng.random(400) * 0.7, 0, 1), 1)  # ties at 0.1 steps
    assert len(np.unique(scores)) < 15
    assert metrics.roc_auc(y, scores) == pytest.approx(skm.roc_auc_score(y, scores), abs=1e-12)
    assert metrics.pr_auc(y, scores) == pytest.approx(skm.average_precision_score(y, scores), abs=1e-12)
    # Continuous scores, no ties.
    cont = 0.5 * y + rng.normal(size=400)
    assert metrics.roc_auc(y, cont) == pytest.approx(skm.roc_auc_score(y, cont), abs=1e-12)
    assert metrics.pr_auc(y, cont) == pytest.approx(skm.average_precision_score(y, cont), abs=1e-12)


def test_binary_positive_class_is_the_larger_label():
    rng = np.random.default_rng(11)
    y01 = rng.integers(0, 2, 100)
    scores = 0.4 * y01 + rng.random(100)
    y12 = y01 + 1
    ypm = 2 * y01 - 1
    assert metrics.roc_auc(y12, scores) == pytest.approx(skm.roc_auc_score(y12, scores))
    assert metrics.roc_auc(y12, scores) == pytest.approx(metrics.roc_auc(y01, scores))
    assert metrics.pr_auc(ypm, scores) == pytest.approx(skm.average_precision_score(ypm, scores))


def test_pr_auc_is_step_wise_not_trapezoid():
    # y = [1, 0, 1], scores [0.9, 0.8, 0.7]: thresholds give (R, P) = (1/2, 1), (1/2, 1/2), (1, 2/3).
    # AP = 1/2 * 1 + 0 * 1/2 + 1/2 * 2/3 = 5/6; the trapezoid would give a different value.
    y, s = [1, 0, 1], [0.9, 0.8, 0.7]
    assert metrics.pr_auc(y, s) == pytest.approx(5 / 6)
    precision, recall, _ = skm.precision_recall_curve(y, s)
    assert skm.auc(recall, precision) != pytest.approx(5 / 6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n_classes", [3, 5])
def test_multiclass_roc_auc_and_pr_auc_match_sklearn_ovr_macro(seed, n_classes):
    rng = np.random.default_rng(seed)
    y = _labels(rng, 300, n_classes, imbalanced=seed % 2 == 1)
    y[:n_classes] = np.arange(n_classes)  # every class present
    logits = rng.integers(0, 3, size=(300, n_classes)).astype(float)  # tied rows -> tied probabilities
    logits[np.arange(300), y] += rng.random(300) < 0.5
    probs = _softmax(logits)
    assert metrics.roc_auc(y, probs) == pytest.approx(skm.roc_auc_score(y, probs, multi_class="ovr"), abs=1e-12)
    assert metrics.pr_auc(y, probs) == pytest.approx(skm.average_precision_score(y, probs), abs=1e-12)


def test_torch_tensors_are_accepted():
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 64)
    scores = rng.random(64).astype(np.float32)
    ty = torch.from_numpy(y)
    ts = torch.from_numpy(scores).to(torch.bfloat16).requires_grad_(True)
    bf16_scores = ts.detach().float().numpy()
    assert metrics.roc_auc(ty, ts) == pytest.approx(skm.roc_auc_score(y, bf16_scores), abs=1e-12)
    assert metrics.accuracy(ty, torch.from_numpy(y)) == 1.0
    assert metrics.mae(torch.ones(3, 1), torch.zeros(3)) == 1.0
    # forecasting: tensors, and a ragged list of tensor contexts (values of test_mase_by_hand)
    context = [torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0]), torch.tensor([0.0, 2.0, 4.0])]
    assert metrics.mase(torch.tensor([[6.0, 5.0], [1.0, 1.0]]), torch.tensor([[5.0, 7.0], [3.0, 1.0]]), context, 2) == (
        pytest.approx(0.575)
    )


def test_label_metrics_by_hand():
    # y = [0, 0, 1, 1, 2], pred = [0, 1, 1, 1, 0]
    # accuracy 3/5; recalls 1/2, 2/2, 0/1 -> balanced 1/2
    # kappa: p_o = 3/5; row sums (2, 2, 1), column sums (2, 3, 0) -> p_e = (4 + 6 + 0)/25 = 2/5
    #   -> (3/5 - 2/5) / (1 - 2/5) = 1/3
    # F1: class 0 2*1/(2+2) = 1/2, class 1 2*2/(2+3) = 4/5, class 2 0 -> (2*1/2 + 2*4/5 + 0)/5 = 0.52
    y, pred = [0, 0, 1, 1, 2], [0, 1, 1, 1, 0]
    assert metrics.accuracy(y, pred) == pytest.approx(0.6)
    assert metrics.balanced_accuracy(y, pred) == pytest.approx(0.5)
    assert metrics.cohen_kappa(y, pred) == pytest.approx(1 / 3)
    assert metrics.f1_weighted(y, pred) == pytest.approx(0.52)


def test_single_class_in_y_true():
    # Only class 1 in y_true: balanced accuracy is that class's recall (2/3); kappa is defined
    # (p_e = 2/3 < 1) and equals 0, since agreement is exactly chance; ROC-AUC raises.
    y, pred = [1, 1, 1], [1, 0, 1]
    assert metrics.balanced_accuracy(y, pred) == pytest.approx(2 / 3)
    assert metrics.cohen_kappa(y, pred) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="only one class"):
        metrics.compute("binary", [1, 1, 1], [0.2, 0.7, 0.9])
    # The same single label on both sides: kappa is undefined and raises.
    with pytest.raises(ValueError, match="single label"):
        metrics.compute("multiclass", [1, 1, 1], [1, 1, 1])


def test_top_k_accuracy_by_hand_including_two_classes():
    scores = np.array([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2]])
    y = [2, 0, 1]
    # top-1: [1, 2, 0] -> no hit; top-2: {1, 2}, {2, 1 (tie with 0: higher index first)}, {0, 2 (tie)}
    # -> hits for sample 0 only
    assert metrics.top_k_accuracy(y, scores, 1) == 0.0
    assert metrics.top_k_accuracy(y, scores, 2) == pytest.approx(1 / 3)
    assert metrics.top_k_accuracy(y, scores, 3) == 1.0
    assert metrics.top_k_accuracy(y, scores, 7) == 1.0
    # K = 2 (scikit-learn refuses two columns): a tie goes to class 1, as for K > 2.
    two = np.array([[0.2, 0.8], [0.5, 0.5], [0.9, 0.1], [0.6, 0.4]])
    assert metrics.top_k_accuracy([1, 1, 1, 0], two, 1) == pytest.approx(3 / 4)
    assert metrics.top_k_accuracy([1, 0, 1, 0], two, 1) == pytest.approx(2 / 4)
    assert metrics.top_k_accuracy([1, 0, 1, 0], two, 2) == 1.0


def test_multiclass_roc_auc_accepts_bf16_probability_drift():
    # Rows summing to 1 within 1e-3 (a bf16 softmax) are accepted, where scikit-learn's own
    # "ovr" path rejects them; the value is the mean of the per-class binary AUCs.
    rng = np.random.default_rng(9)
    y = np.arange(60) % 3
    probs = _softmax(rng.normal(size=(60, 3)) + 2.0 * np.eye(3)[y])
    drifted = probs * (1.0 + 5e-4)
    with pytest.raises(ValueError):
        skm.roc_auc_score(y, drifted, multi_class="ovr")
    per_class = [skm.roc_auc_score(y == c, drifted[:, c]) for c in range(3)]
    assert metrics.roc_auc(y, drifted) == pytest.approx(np.mean(per_class), abs=1e-12)
    assert metrics.roc_auc(y, probs) == pytest.approx(skm.roc_auc_score(y, probs, multi_class="ovr"), abs=1e-12)


def test_forecast_metrics_are_one_module_re_exported():
    from domainfm.experiment import forecast_metrics

    for name in forecast_metrics.__all__:
        assert getattr(metrics, name) is getattr(forecast_metrics, name)
        assert name in metrics.__all__


# ----------------------------------------------------------------------------- regression vs scikit-learn / scipy


@pytest.mark.parametrize("seed", SEEDS)
def test_regression_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=200) * 3 + 1
    pred = y + rng.normal(size=200)
    assert metrics.mae(y, pred) == pytest.approx(skm.mean_absolute_error(y, pred), rel=1e-12)
    assert metrics.rmse(y, pred) == pytest.approx(np.sqrt(skm.mean_squared_error(y, pred)), rel=1e-12)
    assert metrics.r2(y, pred) == pytest.approx(skm.r2_score(y, pred), rel=1e-12)
    assert metrics.pearson_r(y, pred) == pytest.approx(scipy.stats.pearsonr(y, pred)[0], rel=1e-12)
    # A (n, 1) head output is read as (n,).
    assert metrics.r2(y[:, None], pred[:, None]) == pytest.approx(skm.r2_score(y, pred), rel=1e-12)


def test_pearson_r_of_constant_predictions_is_nan():
    assert np.isnan(metrics.pearson_r([1.0, 2.0, 3.0], [0.5, 0.5, 0.5]))


# ----------------------------------------------------------------------------- forecasting, by hand


def test_quantile_loss_by_hand():
    # q = 0.25, y = [1, 2, 3], q_pred = [2, 2, 1]
    #   y=1 <= 2: |(1-2) * (1 - 0.25)| = 0.75
    #   y=2 <= 2: |0 * 0.75|           = 0
    #   y=3 >  1: |(3-1) * (0 - 0.25)| = 0.5
    # 2 * (0.75 + 0 + 0.5) = 2.5
    assert metrics.quantile_loss([1, 2, 3], [2, 2, 1], 0.25) == pytest.approx(2.5)
    # At q = 0.5 it is the summed absolute error: |1-2| + 0 + |3-1| = 3.
    assert metrics.quantile_loss([1, 2, 3], [2, 2, 1], 0.5) == pytest.approx(3.0)


def test_wql_by_hand():
    y = np.array([[1.0, 2.0], [3.0, 4.0]])  # sum |y| = 10
    q10 = [[0, 2], [3, 3]]  # misses: y=1 > 0 -> 1*0.1, y=4 > 3 -> 1*0.1; QL = 2 * 0.2 = 0.4
    q50 = [[1, 2], [4, 4]]  # miss: y=3 <= 4 -> 1*0.5; QL = 2 * 0.5 = 1.0
    q90 = [[2, 3], [3, 5]]  # y=1<=2, y=2<=3, y=4<=5 -> 3 * (1*0.1); QL = 2 * 0.3 = 0.6
    preds = np.stack([q10, q50, q90], axis=-1).astype(float)
    # mean(0.4, 1.0, 0.6) / 10 = (2/3) / 10 = 1/15
    assert metrics.wql(y, preds, [0.1, 0.5, 0.9]) == pytest.approx(1 / 15)


def test_wql_is_a_dataset_aggregate_not_a_mean_over_series():
    y = np.array([[1.0, 2.0], [3.0, 5.0]])  # sum |y| = 11
    median = np.array([[1.0, 2.0], [4.0, 4.0]])  # QL_0.5 = 2 * (0.5 + 0.5) = 2, all from series 1
    # dataset: 2 / 11; per-series mean would be (0/3 + 2/8) / 2 = 0.125
    assert metrics.wql(y, median[..., None], [0.5]) == pytest.approx(2 / 11)


def test_mase_by_hand():
    # insample [1, 3, 2, 5, 4], m = 2: |2-1|, |5-3|, |4-2| = 1, 2, 2 -> scale 5/3
    # y_true [6, 5], median [5, 7]: mean(|6-5|, |5-7|) = 1.5 -> MASE = 1.5 / (5/3) = 0.9
    assert metrics.mase([6, 5], [5, 7], [1, 3, 2, 5, 4], 2) == pytest.approx(0.9)


def test_mase_ignores_nan_in_insample():
    # insample [1, nan, 2, 5, 4], m = 2: pairs (1, 2) -> 1, (nan, 5) skipped, (2, 4) -> 2 -> scale 1.5
    # mean(|6-5|, |5-7|) = 1.5 -> MASE = 1.0
    assert metrics.mase([6, 5], [5, 7], [1, np.nan, 2, 5, 4], 2) == pytest.approx(1.0)


def test_mase_falls_back_to_lag_one_when_insample_is_not_longer_than_a_season():
    # insample [1, 2, 4], m = 3 >= T = 3 -> m = 1: |2-1|, |4-2| -> scale 1.5; |5 - 2| / 1.5 = 2
    assert metrics.mase([5], [2], [1, 2, 4], 3) == pytest.approx(2.0)


def test_mase_of_a_batch_averages_scaled_errors_over_all_series():
    # series A as in test_mase_by_hand: scaled errors 1/(5/3), 2/(5/3) = 0.6, 1.2
    # series B: insample [0, 2, 4], m = 2: |4-0| -> scale 4; y [1, 1], median [3, 1]: 2/4, 0/4 = 0.5, 0
    # mean(0.6, 1.2, 0.5, 0) = 0.575 (= mean of per-series MASE 0.9 and 0.25)
    y = [[6, 5], [1, 1]]
    median = [[5, 7], [3, 1]]
    assert metrics.mase(y, median, [[1, 3, 2, 5, 4], [0, 2, 4]], 2) == pytest.approx(0.575)
    # Equal-length contexts as one 2-D array: series B' = [0, 0, 4, 4, 8] -> |4-0|, |4-0|, |8-4| -> 4.
    assert metrics.mase(y, median, np.array([[1, 3, 2, 5, 4], [0, 0, 4, 4, 8]]), 2) == pytest.approx(0.575)


@pytest.mark.parametrize(
    "freq,expected",
    [
        # GluonTS's own test cases (test/time_feature/test_seasonality.py)
        ("30min", 48), ("5B", 1), ("1B", 5), ("2W", 1), ("1D", 1), ("7D", 1), ("8D", 1),
        ("MS", 12), ("3MS", 4), ("M", 12), ("ME", 12), ("3ME", 4),
        ("QS", 4), ("2QS", 2), ("Q", 4), ("QE", 4), ("2QE", 2), ("3QE", 1),
        ("1h", 24), ("H", 24), ("h", 24), ("2h", 12), ("3h", 8), ("4h", 6), ("15h", 1),
        ("YE", 1), ("2YE", 1), ("YS", 1), ("2YS", 1), ("A", 1), ("Y", 1),
        # base periods of DEFAULT_SEASONALITIES and divisibility
        ("T", 1440), ("min", 1440), ("15min", 96), ("7min", 1), ("S", 3600), ("s", 3600),
        ("10s", 360), ("7s", 1), ("D", 1), ("B", 5), ("W", 1), ("W-SUN", 1), ("Q-DEC", 4),
        ("ms", 1), ("bh", 1),
    ],
)
def test_seasonality_matches_gluonts(freq, expected):
    assert metrics.seasonality(freq) == expected


@pytest.mark.parametrize("freq", ["fortnight", "", "0h", "-1h", 24, None, "h30"])
def test_seasonality_rejects_unknown_frequencies(freq):
    with pytest.raises(ValueError, match="freq"):
        metrics.seasonality(freq)


def test_seasonal_naive_forecast_by_hand():
    # last season of [1, 2, 3, 4, 5] with m = 2 is [4, 5], repeated over 5 steps
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast([1, 2, 3, 4, 5], 5, 2), [4, 5, 4, 5, 4])
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast([1, 2, 3, 4, 5], 3, 1), [5, 5, 5])
    # shorter than a season (T = 3 < m = 4): the mean (1 + 2 + 6) / 3 = 3, as GluonTS
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast([1, 2, 6], 2, 4), [3, 3])
    # NaN -> last observed value, leading NaN -> first observed: [nan, 2, nan, 4, nan] -> [2, 2, 2, 4, 4];
    # last season (m = 3) [2, 4, 4]; m = 5 repeats the whole imputed series
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast([np.nan, 2, np.nan, 4, np.nan], 4, 3), [2, 4, 4, 2])
    np.testing.assert_array_equal(
        metrics.seasonal_naive_forecast([np.nan, 2, np.nan, 4, np.nan], 6, 5), [2, 2, 2, 4, 4, 2]
    )
    # a batch: 2-D array and ragged list
    batch = np.array([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast(batch, 2, 2), [[2, 3], [5, 6]])
    ragged = [[1, 2, 3], [7, 8]]  # the second series is shorter than m = 3: mean 7.5
    np.testing.assert_array_equal(metrics.seasonal_naive_forecast(ragged, 3, 3), [[1, 2, 3], [7.5, 7.5, 7.5]])


def test_seasonal_naive_mase_on_a_trend_by_hand():
    # x = 0..9, m = 2: scale = 2; forecast [8, 9, 8, 9] for truth [10, 11, 12, 13]
    # errors 2, 2, 4, 4 -> mean 3 -> MASE 1.5
    x = np.arange(10.0)
    forecast = metrics.seasonal_naive_forecast(x, 4, 2)
    np.testing.assert_array_equal(forecast, [8, 9, 8, 9])
    assert metrics.mase(np.arange(10.0, 14.0), forecast, x, 2) == pytest.approx(1.5)


def test_seasonal_naive_mase_is_one_on_a_linear_trend():
    # On a linear trend c*t, every seasonal difference is c*m and so is every seasonal-naive
    # error within one season: the baseline's MASE is exactly 1, whatever c, m, T and H.
    rng = np.random.default_rng(0)
    for _ in range(5):
        m = int(rng.integers(1, 8))
        n = int(rng.integers(m + 2, 40))
        h = int(rng.integers(1, m + 1))
        c = float(rng.uniform(0.5, 3.0))
        context, future = c * np.arange(n), c * np.arange(n, n + h)
        baseline = metrics.mase(future, metrics.seasonal_naive_forecast(context, h, m), context, m)
        assert baseline == pytest.approx(1.0)


def test_relative_mase_aggregated_over_datasets_by_hand():
    # The benchmark aggregate: each dataset's MASE divided by the seasonal-naive MASE on that
    # dataset, then the geometric mean over datasets.
    # Dataset A: context [1, 3, 2, 5, 4], m = 2, scale 5/3 (test_mase_by_hand), truth [6, 5].
    #   seasonal naive repeats the last season [5, 4]: errors 1, 1 -> MASE 1 / (5/3) = 0.6
    #   model [5, 7]: errors 1, 2 -> MASE 1.5 / (5/3) = 0.9; relative 0.9 / 0.6 = 1.5
    # Dataset B: context [0, 2, 4], m = 2, scale |4 - 0| = 4, truth [1, 1].
    #   seasonal naive [2, 4]: errors 1, 3 -> MASE 2 / 4 = 0.5
    #   model [3, 1]: errors 2, 0 -> MASE 1 / 4 = 0.25; relative 0.25 / 0.5 = 0.5
    # geometric mean sqrt(1.5 * 0.5) = sqrt(0.75) (the arithmetic mean would be 1.0)
    datasets = [([1.0, 3, 2, 5, 4], [6.0, 5], [5.0, 7]), ([0.0, 2, 4], [1.0, 1], [3.0, 1])]
    relative = []
    for context, truth, model in datasets:
        naive = metrics.seasonal_naive_forecast(context, 2, 2)
        relative.append(metrics.mase(truth, model, context, 2) / metrics.mase(truth, naive, context, 2))
    np.testing.assert_allclose(metrics.seasonal_naive_forecast(datasets[0][0], 2, 2), [5, 4])
    np.testing.assert_allclose(metrics.seasonal_naive_forecast(datasets[1][0], 2, 2), [2, 4])
    assert relative == pytest.approx([1.5, 0.5])
    assert metrics.geometric_mean(relative) == pytest.approx(np.sqrt(0.75))


def test_geometric_mean():
    assert metrics.geometric_mean([1.0, 4.0]) == pytest.approx(2.0)
    assert metrics.geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    v = np.random.default_rng(3).uniform(0.2, 3.0, 12)
    assert metrics.geometric_mean(v) == pytest.approx(scipy.stats.gmean(v))


# ----------------------------------------------------------------------------- compute / SELECTION


def test_compute_multiclass_from_logits():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 100)
    logits = rng.normal(size=(100, 4))
    logits[np.arange(100), y] += 1.0
    pred = logits.argmax(axis=1)
    out = metrics.compute("multiclass", y, torch.from_numpy(logits))
    assert out == pytest.approx(
        {
            "balanced_accuracy": skm.balanced_accuracy_score(y, pred),
            "cohen_kappa": skm.cohen_kappa_score(y, pred),
            "f1_weighted": skm.f1_score(y, pred, average="weighted", zero_division=0),
            "accuracy": skm.accuracy_score(y, pred),
        }
    )
    assert metrics.compute("multiclass", y, pred) == out


def test_compute_binary_thresholds_at_one_half():
    y = np.array([0, 0, 1, 1, 1, 0])
    p = np.array([0.2, 0.5, 0.9, 0.9, 0.6, 0.7])  # 0.5 is not above the threshold -> label 0
    labels = np.array([0, 0, 1, 1, 1, 1])
    out = metrics.compute("binary", y, p)
    # 5 of 6 right (only the last sample is wrong); recall 2/3 for class 0 and 1 for class 1
    assert out["accuracy"] == pytest.approx(5 / 6)
    assert out["balanced_accuracy"] == pytest.approx((2 / 3 + 1) / 2)
    assert out == pytest.approx(
        {
            "balanced_accuracy": skm.balanced_accuracy_score(y, labels),
            "pr_auc": skm.average_precision_score(y, p),
            "roc_auc": skm.roc_auc_score(y, p),
            "accuracy": skm.accuracy_score(y, labels),
        }
    )


def test_compute_regression():
    rng = np.random.default_rng(2)
    y = rng.normal(size=50)
    pred = y + 0.3 * rng.normal(size=50)
    out = metrics.compute("regression", y, pred[:, None])
    assert out == pytest.approx(
        {
            "pearson_r": scipy.stats.pearsonr(y, pred)[0],
            "r2": skm.r2_score(y, pred),
            "rmse": np.sqrt(skm.mean_squared_error(y, pred)),
            "mae": skm.mean_absolute_error(y, pred),
        }
    )


def test_selection_names_a_metric_that_compute_returns():
    assert set(metrics.SELECTION) == set(metrics.TASKS)
    assert metrics.SELECTION["multiclass"] == ("cohen_kappa", "max")
    assert metrics.SELECTION["binary"] == ("roc_auc", "max")
    rng = np.random.default_rng(4)
    y = np.array([0, 1] * 10)
    inputs = {
        "multiclass": (y, y),
        "binary": (y, rng.random(20)),
        "regression": (rng.normal(size=20), rng.normal(size=20)),
    }
    for task, (name, _) in metrics.SELECTION.items():
        assert name in metrics.compute(task, *inputs[task])


# ----------------------------------------------------------------------------- errors


BAD_INPUT = [
    (lambda: metrics.accuracy([0, 1, 1], [0, 1]), "different lengths"),
    (lambda: metrics.mae([1.0, 2.0], [1.0, 2.0, 3.0]), "different lengths"),
    (lambda: metrics.roc_auc([0, 1, 1], [0.1, 0.2]), "different lengths"),
    (lambda: metrics.mase([1.0, 2.0], [1.0], [1.0, 2.0, 3.0], 1), "different shapes"),
    (lambda: metrics.mae([1.0, np.nan], [1.0, 2.0]), "NaN"),
    (lambda: metrics.roc_auc([0, 1], [0.3, np.nan]), "NaN"),
    (lambda: metrics.balanced_accuracy([0.0, np.nan], [0, 1]), "NaN"),
    (lambda: metrics.mase([1.0, np.nan], [1.0, 2.0], [1.0, 2.0, 3.0], 1), "NaN"),
    (lambda: metrics.wql([1.0, 2.0], [[1.0], [np.nan]], [0.5]), "NaN"),
    (lambda: metrics.accuracy([], []), "empty"),
    (lambda: metrics.accuracy(["W", "N1"], [0, 1]), "different kinds of labels"),
    (lambda: metrics.roc_auc([1, 1, 1], [0.1, 0.5, 0.9]), "only one class"),
    (lambda: metrics.pr_auc([0, 0, 0], [0.1, 0.5, 0.9]), "only one class"),
    (lambda: metrics.roc_auc([0, 1, 2], [0.1, 0.5, 0.9]), "one-vs-rest"),
    (lambda: metrics.roc_auc([0, 1, 1], _softmax(np.eye(3))), r"classes \[2\]"),
    (lambda: metrics.roc_auc([0, 1, 2], np.eye(3) * 3.0), "softmax"),
    (lambda: metrics.top_k_accuracy([0, 4], np.ones((2, 3)), 1), "outside"),
    (lambda: metrics.top_k_accuracy([0, 1], np.ones((2, 3)), 0), "k"),
    (lambda: metrics.cohen_kappa([2, 2, 2], [2, 2, 2]), "single label"),
    (lambda: metrics.r2([3.0, 3.0, 3.0], [1.0, 2.0, 3.0]), "constant"),
    (lambda: metrics.pearson_r([3.0, 3.0, 3.0], [1.0, 2.0, 3.0]), "constant"),
    (lambda: metrics.mase([1.0, 2.0], [1.0, 2.0], [5.0, 5.0, 5.0, 5.0], 2), "seasonal scale 0"),
    (lambda: metrics.mase([1.0], [1.0], [5.0, np.nan, np.nan, 7.0], 2), "no two observed values"),
    (lambda: metrics.mase([1.0], [1.0], [5.0], 1), "at least 2"),
    (lambda: metrics.mase([1.0], [1.0], [1.0, 2.0], 0), "season_length"),
    (lambda: metrics.mase([[1.0]], [[1.0]], [[1.0, 2.0], [1.0, 3.0]], 1), "2 series"),
    (lambda: metrics.mase([[1.0]], [[1.0]], [1.0, 2.0], 1), "single series"),
    (lambda: metrics.wql([0.0, 0.0], [[1.0], [2.0]], [0.5]), "all values are 0"),
    (lambda: metrics.wql([1.0, 2.0], [1.0, 2.0], [0.5]), "expected shape"),
    (lambda: metrics.quantile_loss([1.0], [1.0], 1.5), "quantile level"),
    (lambda: metrics.seasonal_naive_forecast([np.nan, np.nan], 2, 1), "every value is NaN"),
    (lambda: metrics.seasonal_naive_forecast([1.0, 2.0], 0, 1), "prediction_length"),
    (lambda: metrics.geometric_mean([1.0, 0.0]), "positive"),
    (lambda: metrics.compute("ranking", [0, 1], [0, 1]), "task"),
    (lambda: metrics.compute("binary", [0, 1], [-2.0, 3.0]), "sigmoid"),
    (lambda: metrics.compute("binary", [0, 1], np.eye(2)), "positive-class probability"),
    (lambda: metrics.compute("binary", [1, 2], [0.2, 0.8]), "labels 0 and 1"),
]


@pytest.mark.parametrize("call,match", BAD_INPUT, ids=[match for _, match in BAD_INPUT])
def test_bad_input_raises_a_named_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
