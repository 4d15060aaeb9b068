"""Forecast scoring, the fine-tune entry on the experiment layer, evaluate and predict."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import cli, config as cfgmod, create_model, save_pretrained
from domainfm.engine import Trainer
from domainfm.finetune import metrics as M
from domainfm.finetune import wavetoken as W
from domainfm.finetune.forecast_metrics import forecast_scores

TINY = ["train.batch_size=8", "train.progress=false", "data.windows_per_epoch=16", "eval.num_samples=4"]


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


def test_seasonal_naive_scores_one_relative_to_itself_and_baseline_only_scores():
    windows = _windows()
    naive = np.stack([M.seasonal_naive_forecast(w["context"], 2, M.seasonality(w["freq"])) for w in windows])
    scores = forecast_scores(windows, np.repeat(naive[:, None, :], 5, axis=1), [0.1, 0.5, 0.9])
    assert scores["mase_rel"] == pytest.approx(1.0) and scores["wql_rel"] == pytest.approx(1.0)
    assert scores["d2.mase"] == pytest.approx((3 + 1) / 2 / (2 / 3))  # the naive forecast's own hand value
    # without samples: the baseline's scores alone (the same values), and no model or relative score
    baseline = forecast_scores(windows, None, [0.1, 0.5, 0.9])
    assert set(baseline) == {"d1.naive_mase", "d1.naive_wql", "d2.naive_mase", "d2.naive_wql", "n_datasets"}
    assert all(baseline[k] == pytest.approx(scores[k]) for k in baseline)


def test_finetune_cli_writes_both_arms_evaluate_reproduces_and_predict_uses_the_first_arm(tmp_path):
    assert cli.main(["finetune", "wavetoken", "stages=[]", "train.max_steps=4", *TINY,
                     "--runs-dir", str(tmp_path), "--name", "f"]) == 0
    run = tmp_path / "wavetoken" / "f"
    report = json.loads((run / "report.json").read_text())
    assert report["task"] == "forecast" and report["monitor"] == "val/wql_rel" and list(report["arms"]) == ["pretrained", "random"]
    for arm, result in report["arms"].items():
        assert result["init"].startswith("random") and result["steps"] == 4 and result["test"]["n_datasets"] == 6
        for key in ("mase_rel", "wql_rel", "co2_monthly.mase", "co2_monthly.naive_mase"):
            assert np.isfinite(result["test"][key]) and result["test"][key] > 0
        assert result["zero_shot"]["test"]["wql_rel"] > 0  # before fine-tuning
        forecasts = pd.read_csv(run / arm / "forecasts.csv")
        assert len(forecasts) == 14 * 12 and {"mean", "0.1", "0.9", "target"} <= set(forecasts.columns)
        assert (forecasts["0.1"] <= forecasts["0.9"]).all()
    # the same seed, no stage: both arms start from the same random init and train alike
    assert report["arms"]["pretrained"]["test"] == report["arms"]["random"]["test"]
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["max_abs_diff_val"] < 1e-6
    for key, value in report["arms"]["random"]["test"].items():  # seeded sampling: the same numbers
        assert evaluation["arms"]["random"]["test"][key] == pytest.approx(value, abs=1e-6)

    series = pd.DataFrame({"item_id": ["x"] * 30 + ["y"] * 20,
                           "timestamp": list(pd.date_range("2020-01-01", periods=30, freq="D")) +
                                        list(pd.date_range("2021-01-01", periods=20, freq="h")),
                           "target": np.r_[np.sin(np.arange(30)), np.arange(20.0)]})
    series.to_csv(tmp_path / "in.csv", index=False)
    common = ["--input", str(tmp_path / "in.csv"), "--prediction-length", "5", "--quantiles", "0.1,0.5,0.9"]
    assert cli.main(["predict", "wavetoken", *common, "--output", str(tmp_path / "out.csv"), "--model", str(run)]) == 0
    pred = pd.read_csv(tmp_path / "out.csv", parse_dates=["timestamp"])
    assert list(pred.columns) == ["item_id", "timestamp", "mean", "0.1", "0.5", "0.9"]
    assert len(pred) == 10
    assert pred.timestamp.iloc[0] == pd.Timestamp("2020-01-31") and pred.timestamp.iloc[5] == pd.Timestamp("2021-01-01 20:00")
    assert ((pred["0.1"] <= pred["0.5"]) & (pred["0.5"] <= pred["0.9"])).all()
    # a run folder as --model reads RUN/<first arm>/model with the run's eval settings (eval.num_samples=4):
    # the same forecasts as naming that folder with --pretrained and those settings
    assert cli.main(["predict", "wavetoken", *common, "--output", str(tmp_path / "same.csv"), "--model", "wavetoken-test",
                     "--pretrained", str(run / "pretrained" / "model"), "--num-samples", "4", "--no-plot"]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "same.csv", parse_dates=["timestamp"]), pred)


def test_reported_validation_describes_the_selected_model_not_the_last_evaluation(tmp_path):
    # Defect (old finetune/wavetoken.py): val_* came from the LAST evaluation while the model was
    # reloaded at the best step. Force best != last: n_datasets is constant, so the first
    # evaluation (step 2 of 6) stays the best under "min" (strict improvement).
    assert cli.main(["finetune", "wavetoken", "stages=[]", "arms=[random]", "train.max_steps=6", "train.lr=0.01",
                     "train.monitor=val/n_datasets", "train.monitor_mode=min", *TINY,
                     "--runs-dir", str(tmp_path), "--name", "d"]) == 0
    run = tmp_path / "wavetoken" / "d"
    arm = json.loads((run / "report.json").read_text())["arms"]["random"]
    assert arm["best_step"] == 2 and arm["steps"] == 6
    logged = [json.loads(line) for line in (run / "random" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in logged if r.get("split") == "val"}
    assert sorted(logged) == [2, 4, 6]
    assert logged[6]["wql_rel"] != pytest.approx(arm["val"]["wql_rel"], abs=1e-6)  # the old report's figure
    assert logged[2]["wql_rel"] == pytest.approx(arm["val"]["wql_rel"], abs=1e-6)  # the selected step's
    # a fresh evaluation of the saved model gives the reported figures
    cfg = cfgmod.from_dict(W.Config, cfgmod.load_yaml(run / "config.yaml"))
    model = create_model(run / "random" / "model").eval()
    task = W.build_task(cfg)
    fresh = Trainer(dataclasses.replace(cfg.train, progress=False)).evaluate(W.build_recipe(cfg, model, task), task.val,
                                                                             model=model)
    assert set(fresh) == set(arm["val"])
    assert all(fresh[k] == pytest.approx(arm["val"][k], abs=1e-6) for k in fresh)
    assert cli.main(["evaluate", str(run)]) == 0
    assert json.loads((run / "evaluation.json").read_text())["max_abs_diff_val"] < 1e-6


def test_missing_card_weights_fail_or_fall_back_and_named_sources_always_fail(tmp_path, monkeypatch, capsys):
    from domainfm import hub
    from domainfm.experiment import WeightsUnavailable

    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    args = ["finetune", "wavetoken", "model.name=chronos-t5-test", "model.pretrained=true", "stages=[]",
            "arms=[pretrained]", "adapt.mode=none", "eval.num_samples=2", "--runs-dir", str(tmp_path)]
    with pytest.raises(WeightsUnavailable, match="model.fallback=random"):  # chronos cards have no registered source
        cli.main(["--debug", *args, "--name", "a"])
    assert cli.main(args + ["model.fallback=random", "--name", "b"]) == 0
    arm = json.loads((tmp_path / "wavetoken" / "b" / "report.json").read_text())["arms"]["pretrained"]
    assert arm["init"].startswith("random (fallback") and arm["params"]["trainable"] == 0 and "best_step" not in arm
    assert "zero_shot" not in arm and arm["test"]["n_datasets"] == 6  # mode none: the test scores are zero-shot
    assert "RANDOM" in capsys.readouterr().err
    with pytest.raises(hub.HubError):  # a source the user named never falls back
        cli.main(["--debug", *args, "model.pretrained=hf://org/repo/w.safetensors", "model.fallback=random", "--name", "c"])
    # without --debug the same refusal is one line, exit 2
    assert cli.main(args + ["model.pretrained=hf://org/repo/w.safetensors", "model.fallback=random", "--name", "d"]) == 2
    assert "domainfm finetune: error:" in capsys.readouterr().err


def test_a_whole_hf_repository_is_a_pretrained_source(tmp_path, http_server, monkeypatch, domainfm_home):
    # model.pretrained: hf://org/repo (config.json + model.safetensors) resolves through the layer;
    # served from 127.0.0.1 through a patched Hub endpoint
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", http_server.base)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", http_server.base + "/{repo_id}/resolve/{revision}/{filename}")
    torch.manual_seed(3)
    source = create_model("chronos-t5-test")
    folder = save_pretrained(source, tmp_path / "src")
    for name in ("config.json", "model.safetensors"):
        http_server.serve(f"/amazon/chronos-t5-mock/resolve/main/{name}", (folder / name).read_bytes())
    with pytest.warns(UserWarning, match="no recorded sha256"):
        assert cli.main(["finetune", "wavetoken", "model.name=chronos-t5-test", "model.pretrained=hf://amazon/chronos-t5-mock",
                         "stages=[]", "arms=[pretrained]", "adapt.mode=none", "eval.num_samples=2",
                         "--runs-dir", str(tmp_path), "--name", "h"]) == 0
    run = tmp_path / "wavetoken" / "h"
    arm = json.loads((run / "report.json").read_text())["arms"]["pretrained"]
    assert arm["init"].startswith("pretrained ") and "chronos-t5-mock" in arm["init"]
    saved = create_model(run / "pretrained" / "model").state_dict()
    assert all(torch.equal(value, saved[key]) for key, value in source.state_dict().items())
