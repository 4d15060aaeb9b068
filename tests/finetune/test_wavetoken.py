"""Forecast scoring, the fine-tune entry, evaluate and predict."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from domainfm import cli
from domainfm.finetune import metrics as M
from domainfm.finetune.wavetoken import forecast_scores


def _windows():
    ctx_a = np.array([1.0, 3.0, 2.0, 4.0, 3.0, 5.0])
    ctx_b = np.array([10.0, 10.0, 12.0, 12.0])
    return [
        {"dataset": "d1", "item_id": "a", "freq": "D", "context": ctx_a, "future": np.array([4.0, 6.0])},
        {"dataset": "d2", "item_id": "b", "freq": "QS", "context": ctx_b, "future": np.array([13.0, 11.0])},
    ]


def test_mase_and_wql_equal_hand_computed_values():
    windows = _windows()
    # sample paths whose median is [5, 5] and whose quantiles are all 5 for d1; d2 all 12
    samples = np.stack([np.full((3, 2), 5.0), np.full((3, 2), 12.0)])
    scores = forecast_scores(windows, samples, [0.5])
    # d1 (daily: season 1): scale = mean |diff| of [1,3,2,4,3,5] = (2+1+2+1+2)/5 = 1.6; errors |4-5|, |6-5|
    assert scores["d1.mase"] == pytest.approx((1 + 1) / 2 / 1.6)
    # WQL at q=0.5: 2 * sum |y - yhat| * 0.5 / sum |y| = (1 + 1) / (4 + 6)
    assert scores["d1.wql"] == pytest.approx(2 / 10)
    # seasonal naive for d1 (season 1) repeats the last value 5: same errors
    assert scores["d1.naive_mase"] == pytest.approx(scores["d1.mase"])
    # d2 (quarterly: season 4, but only 4 values so m falls back to 1): scale = (0 + 2 + 0) / 3
    assert scores["d2.mase"] == pytest.approx((1 + 1) / 2 / (2 / 3))
    # naive: season 4 and 4 values -> repeat the last season [10, 10, 12, 12][:2] = [10, 10]
    assert scores["d2.naive_mase"] == pytest.approx((3 + 1) / 2 / (2 / 3))
    assert scores["d2.naive_wql"] == pytest.approx((3 + 1) / 24)
    # relative scores: geometric mean over datasets of model / naive
    assert scores["mase_rel"] == pytest.approx(np.sqrt(1.0 * (1 / 2)))
    assert scores["wql_rel"] == pytest.approx(np.sqrt(1.0 * ((2 / 24) / (4 / 24))))
    assert scores["n_datasets"] == 2


def test_seasonal_naive_scores_one_relative_to_itself():
    windows = _windows()
    naive = np.stack([M.seasonal_naive_forecast(w["context"], 2, M.seasonality(w["freq"])) for w in windows])
    scores = forecast_scores(windows, np.repeat(naive[:, None, :], 5, axis=1), [0.1, 0.5, 0.9])
    assert scores["mase_rel"] == pytest.approx(1.0) and scores["wql_rel"] == pytest.approx(1.0)
    baseline_only = forecast_scores(windows, None, [0.5])
    assert baseline_only["mase_rel"] == 1.0


def test_finetune_cli_evaluate_and_predict(tmp_path):
    code = cli.main(["finetune", "wavetoken", "pretrain.enabled=false", "train.max_steps=4", "train.batch_size=8",
                     "train.progress=false", "data.windows_per_epoch=16", "eval.num_samples=4",
                     "--runs-dir", str(tmp_path), "--name", "f"])
    assert code == 0
    run = tmp_path / "wavetoken" / "f"
    report = json.loads((run / "report.json").read_text())
    assert report["init"] == "random" and report["steps"] == 4 and report["test_n_datasets"] == 6
    for key in ("test_mase_rel", "test_wql_rel", "test_co2_monthly.mase", "test_co2_monthly.naive_mase"):
        assert np.isfinite(report[key]) and report[key] > 0
    val = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"val"' in line]
    assert val and "wql_rel" in val[-1]
    forecasts = pd.read_csv(run / "forecasts.csv")
    assert len(forecasts) == 14 * 12 and {"mean", "0.1", "0.9", "target"} <= set(forecasts.columns)
    assert (forecasts["0.1"] <= forecasts["0.9"]).all()
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["test_mase_rel"] == pytest.approx(report["test_mase_rel"])  # seeded sampling: same numbers

    series = pd.DataFrame({"item_id": ["x"] * 30 + ["y"] * 20,
                           "timestamp": list(pd.date_range("2020-01-01", periods=30, freq="D")) +
                                        list(pd.date_range("2021-01-01", periods=20, freq="h")),
                           "target": np.r_[np.sin(np.arange(30)), np.arange(20.0)]})
    series.to_csv(tmp_path / "in.csv", index=False)
    out = tmp_path / "out.csv"
    assert cli.main(["predict", "wavetoken", "--input", str(tmp_path / "in.csv"), "--prediction-length", "5",
                     "--output", str(out), "--run", str(run), "--quantiles", "0.1,0.5,0.9"]) == 0
    pred = pd.read_csv(out, parse_dates=["timestamp"])
    assert list(pred.columns) == ["item_id", "timestamp", "mean", "0.1", "0.5", "0.9"]
    assert len(pred) == 10
    assert pred.timestamp.iloc[0] == pd.Timestamp("2020-01-31") and pred.timestamp.iloc[5] == pd.Timestamp("2021-01-01 20:00")
    assert ((pred["0.1"] <= pred["0.5"]) & (pred["0.5"] <= pred["0.9"])).all()


def test_missing_pretrained_weights_fail_or_fall_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    args = ["finetune", "wavetoken", "pretrain.enabled=false", "mode=zero_shot", "model.pretrained=hf://org/repo/w.safetensors",
            "eval.num_samples=2"]
    from domainfm import hub

    with pytest.raises(hub.HubError):
        cli.main(args + ["--runs-dir", str(tmp_path), "--name", "a"])
    assert cli.main(args + ["model.pretrained_fallback=random", "--runs-dir", str(tmp_path), "--name", "b"]) == 0
    report = json.loads((tmp_path / "wavetoken" / "b" / "report.json").read_text())
    assert report["init"] == "random" and report["params_trainable"] == 0
    assert "RANDOM" in capsys.readouterr().err
