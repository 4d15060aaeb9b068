"""Forecast scoring, the fine-tune entry on the experiment layer, evaluate and predict."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from gluonts.model.forecast import SampleForecast

from domainfm import cli, config as cfgmod, create_model, save_pretrained
from domainfm.engine import Trainer
from domainfm.experiment import metrics as M
from domainfm.finetune import wavetoken as W
from domainfm.experiment.forecast_metrics import forecast_scores

TINY = ["train.batch_size=8", "train.progress=false", "data.windows_per_epoch=16", "eval.num_samples=4"]
SHIPPED = str(Path(W.__file__).parents[1] / "data_loaders" / "samples" / "timeseries" / "statsmodels_series.csv")


def _assert_png(path, min_size=(300, 400)):
    """A valid PNG (signature, decodes) that is not blank: its pixels vary and hold the bands' blue."""
    from matplotlib import image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)[..., :3]
    assert pixels.shape[0] >= min_size[0] and pixels.shape[1] >= min_size[1]
    assert pixels.std() > 0.02 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50
    blue = (pixels[..., 2] > pixels[..., 0] + 0.15).mean()  # tab:blue median/bands
    assert blue > 0.002


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


def test_finetune_cli_writes_both_arms_evaluate_reproduces_and_predict_uses_the_first_arm(tmp_path, capsys):
    # the test-sized model from random init (the default's shipped checkpoint is tested in models/)
    assert cli.main(["finetune", "wavetoken", "model.name=wavetoken-test", "model.pretrained=null", "train.max_steps=4", *TINY,
                     "--runs-dir", str(tmp_path), "--name", "f"]) == 0
    run = tmp_path / "wavetoken" / "f"
    report = json.loads((run / "report.json").read_text())
    # the baselines a forecaster runs first, beside the arms: in the printed table and in report.md
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "pretrained", "random", "seasonal", "naive", "AutoETS", "AutoTheta"]
    assert "| metric | pretrained | random | seasonal naive | AutoETS | AutoTheta |" in (run / "report.md").read_text()
    # AutoTheta called directly on the context the model sees (its last context_length values; monthly: season 12)
    from statsforecast.models import AutoTheta

    cfg = cfgmod.from_dict(W.Config, cfgmod.load_yaml(run / "config.yaml"))
    co2 = [w for w in W.build_task(cfg).test.windows if w["dataset"] == "co2_monthly"]
    length = create_model("wavetoken-test").context_length
    point = np.stack([AutoTheta(season_length=12).forecast(y=w["context"][-length:], h=12)["mean"] for w in co2])
    expected = M.mase(np.stack([w["future"] for w in co2]), point, [w["context"] for w in co2], 12)
    for result in report["arms"].values():
        assert result["test"]["co2_monthly.auto_theta_mase"] == pytest.approx(expected, rel=1e-9)
        assert result["zero_shot"]["test"]["auto_ets_wql_rel"] == result["test"]["auto_ets_wql_rel"]
    assert report["task"] == "forecast" and report["monitor"] == "val/wql_rel" and list(report["arms"]) == ["pretrained", "random"]
    for arm, result in report["arms"].items():
        assert result["init"].startswith("random") and result["steps"] == 4 and result["test"]["n_datasets"] == 6
        for key in ("mase_rel", "wql_rel", "co2_monthly.mase", "co2_monthly.naive_mase"):
            assert np.isfinite(result["test"][key]) and result["test"][key] > 0
        assert result["zero_shot"]["test"]["wql_rel"] > 0  # before fine-tuning
        forecasts = pd.read_csv(run / arm / "forecasts.csv")
        assert len(forecasts) == 14 * 12 and {"mean", "0.1", "0.9", "target"} <= set(forecasts.columns)
        assert (forecasts["0.1"] <= forecasts["0.9"]).all()
        # the fan chart of the test forecasts, listed relative to the run folder
        assert result["pictures"]["forecast_fan"] == f"{arm}/forecast_fan.png"
        _assert_png(run / result["pictures"]["forecast_fan"])
        # retained capability: zero-shot scores on held-out KernelSynth series, before and after
        for key in ("retained_before", "retained"):
            assert result[key]["n_series"] == 24 and np.isfinite(result[key]["wql_rel"]) and result[key]["wql_rel"] > 0
        assert result["retained"]["wql_rel"] != result["retained_before"]["wql_rel"]  # training moved the model
    assert report["retained_capability"]["metric"] == "wql_rel" and report["retained_capability"]["direction"] == "min"
    # retained_before recomputed independently: the arm's initial model rebuilt from its seed (the same random
    # init), sampled directly on the held-out KernelSynth windows and scored by forecast_scores
    from lightning_fabric.utilities.seed import seed_everything

    from domainfm.data_loaders import timeseries as T
    from domainfm.precision import autocast

    cfg = cfgmod.from_dict(W.Config, cfgmod.load_yaml(run / "config.yaml"))
    windows = T.kernel_synth_windows(24, 192, cfg.retained.seed, 12)
    seed_everything(report["arms"]["pretrained"]["seed"], verbose=False)
    initial = create_model("wavetoken-test").eval()
    context = torch.from_numpy(np.stack([T.left_pad(w["context"], initial.context_length) for w in windows]))
    with torch.no_grad(), autocast(cfg.train.precision), W.fp32_tokenizer(initial):
        samples = initial.predict(context, 12, num_samples=cfg.eval.num_samples, seed=cfg.eval.seed)
    expected = forecast_scores(windows, samples.float().numpy(), cfg.eval.quantile_levels)
    assert report["retained_before"]["wql_rel"] == pytest.approx(expected["wql_rel"], rel=1e-6)  # same process
    assert report["retained_before"]["mase_rel"] == pytest.approx(expected["mase_rel"], rel=1e-6)
    # the same seed, no stage: both arms start from the same random init and train alike
    assert report["arms"]["pretrained"]["test"] == report["arms"]["random"]["test"]
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["max_abs_diff_val"] < 1e-6
    assert evaluation["baselines"] == report["baselines"]  # evaluate prints the same baseline columns
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


@pytest.mark.slow
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


def test_a_whole_hf_repository_is_a_pretrained_source(tmp_path, hf_hub, domainfm_home):
    # model.pretrained: hf://org/repo (config.json + model.safetensors) resolves through the layer;
    # served by a local server that answers like the Hub
    torch.manual_seed(3)
    source = create_model("chronos-t5-test")
    folder = save_pretrained(source, tmp_path / "src")
    for name in ("config.json", "model.safetensors"):
        hf_hub.add("amazon/chronos-t5-mock", name, (folder / name).read_bytes(), lfs=name.endswith(".safetensors"))
    if True:
        assert cli.main(["finetune", "wavetoken", "model.name=chronos-t5-test", "model.pretrained=hf://amazon/chronos-t5-mock",
                         "stages=[]", "arms=[pretrained]", "adapt.mode=none", "eval.num_samples=2",
                         "--runs-dir", str(tmp_path), "--name", "h"]) == 0
    run = tmp_path / "wavetoken" / "h"
    arm = json.loads((run / "report.json").read_text())["arms"]["pretrained"]
    assert arm["init"].startswith("pretrained ") and "chronos-t5-mock" in arm["init"]
    saved = create_model(run / "pretrained" / "model").state_dict()
    assert all(torch.equal(value, saved[key]) for key, value in source.state_dict().items())


# --------------------------------------------------------------------------- quantile forecasts, per-sample losses


def test_quantile_forecasts_score_like_the_samples_they_summarise():
    windows = _windows()
    rng = np.random.default_rng(0)
    samples = rng.normal(8.0, 3.0, size=(2, 50, 2))
    levels = [0.1, 0.5, 0.9]
    # the samples' quantiles as GluonTS takes them (SampleForecast.quantile: a sorted sample, no interpolation)
    quantiles = np.stack([np.stack([SampleForecast(samples=paths, start_date=pd.Period("2000-01-01", freq="D"))
                                    .quantile(q) for q in levels], axis=-1) for paths in samples])  # (N, H, Q)
    assert not np.allclose(quantiles, np.moveaxis(np.quantile(samples, levels, axis=1), 0, -1))  # 50 samples: differ
    by_samples = forecast_scores(windows, samples, levels)
    by_quantiles = forecast_scores(windows, None, levels, quantiles=quantiles)
    assert by_quantiles == pytest.approx(by_samples, rel=1e-12)
    # MASE of a quantile forecast is the 0.5 level's: shifting it alone changes MASE, not the naive scores
    moved = quantiles.copy()
    moved[0, :, 1] = [4.0, 5.0]  # d1's future is [4, 6]; its seasonal scale 1.6 (see above)
    scores = forecast_scores(windows, None, levels, quantiles=moved)
    assert scores["d1.mase"] == pytest.approx((0 + 1) / 2 / 1.6) and scores["d1.naive_mase"] == by_samples["d1.naive_mase"]
    with pytest.raises(ValueError, match="include 0.5"):
        forecast_scores(windows, None, [0.1, 0.9], quantiles=quantiles[..., [0, 2]])
    with pytest.raises(ValueError, match="expected shape"):
        forecast_scores(windows, None, levels, quantiles=quantiles[:1])


def _batch(model, n=4, horizon=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(n, model.context_length, generator=g).cumsum(-1) + 20
    context[1, :10] = float("nan")  # left padding
    future = torch.randn(n, horizon, generator=g).cumsum(-1) + 20
    future[2, 3] = float("nan")  # a missing future value
    return context, future


@pytest.mark.parametrize("name", ["wavetoken-test", "chronos-bolt-test"])
def test_per_sample_loss_is_each_series_own_loss_and_averages_to_the_step_loss(name):
    torch.manual_seed(0)
    model = create_model(name).eval()
    cfg = W.Config()
    recipe = W.build_recipe(cfg, model, W.TaskData(None, None, None, task="forecast", extras={"windows": []}))
    assert isinstance(recipe, W.QuantileForecastRecipe if name.startswith("chronos-bolt") else W.ForecastEvalRecipe)
    context, future = _batch(model)
    per_sample = recipe.per_sample_loss(model, (context, future))
    assert per_sample.shape == (4,) and torch.isfinite(per_sample).all()
    loss, logs = recipe.step(model, (context, future))
    assert loss.item() == pytest.approx(per_sample.mean().item(), rel=1e-6)
    # each value is the model's own loss of that series alone (an independent reduction)
    for i in range(4):
        c, f = context[i : i + 1], future[i : i + 1]
        if name.startswith("chronos-bolt"):
            alone = model(c, torch.nan_to_num(f), torch.isfinite(f))["loss"]
        else:
            alone = model.loss(c, f)[0]
        assert per_sample[i].item() == pytest.approx(alone.item(), rel=1e-5)
    loss.backward()  # the loss trains the model
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.grad is not None)
    assert sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None) > 0


# --------------------------------------------------------------------------- predict / embed


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Seeded random wavetoken-test and chronos-bolt-test saved with save_pretrained."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in ("wavetoken-test", "chronos-bolt-test"):
        torch.manual_seed(1)
        out[name] = save_pretrained(create_model(name), root / name)
    return out


def test_predict_and_embed_through_the_cli_on_the_shipped_series(tmp_path, saved_models):
    folder = saved_models["wavetoken-test"]
    out = tmp_path / "fc.csv"
    assert cli.main(["predict", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output", str(out),
                     "--prediction-length", "6", "--num-samples", "8", "--quantiles", "0.1,0.5,0.9"]) == 0
    pred = pd.read_csv(out, parse_dates=["timestamp"])
    shipped = pd.read_csv(SHIPPED)
    assert list(pred.columns) == ["item_id", "timestamp", "mean", "0.1", "0.5", "0.9"] and len(pred) == 14 * 6
    assert list(pred.item_id.unique()) == list(shipped.item_id.unique())
    assert ((pred["0.1"] <= pred["0.5"]) & (pred["0.5"] <= pred["0.9"])).all()
    co2 = pred[pred.item_id == "co2_mauna_loa"].timestamp  # monthly, after the last shipped month
    assert co2.iloc[0] == pd.Timestamp(shipped[shipped.item_id == "co2_mauna_loa"].timestamp.iloc[-1]) + pd.offsets.MonthBegin()
    _assert_png(tmp_path / "fc.png")  # the fan chart beside the output
    # the Python function the CLI wraps gives the same forecasts
    same = W.predict(SHIPPED, folder, prediction_length=6, num_samples=8, quantile_levels=[0.1, 0.5, 0.9])
    pd.testing.assert_frame_equal(same.reset_index(drop=True), pred, check_dtype=False, atol=1e-5)
    assert cli.main(["predict", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "b.csv"), "--prediction-length", "6", "--no-plot"]) == 0
    assert not (tmp_path / "b.png").exists()
    assert cli.main(["predict", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "c.csv"), "--prediction-length", "6", "--plot", str(tmp_path / "pics" / "fan.png")]) == 0
    _assert_png(tmp_path / "pics" / "fan.png")

    # embed: one row per series of the model's width, equal to a direct masked mean of its encoder states
    assert cli.main(["embed", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "e.npz"), "--precision", "32-true"]) == 0
    z = np.load(tmp_path / "e.npz")
    model = create_model(folder).eval()
    assert z["embedding"].shape == (14, model.d_model) and z["embedding"].dtype == np.float32
    assert list(z["item_id"]) == list(shipped.item_id.unique())
    from domainfm.data_loaders.timeseries import left_pad, load_sample

    nile = next(s for s in load_sample() if s["item_id"] == "nile_volume")
    with torch.no_grad():
        ids, mask, _ = model.tokenize(torch.from_numpy(left_pad(nile["target"][:40], model.context_length))[None])
        states = model.encode(ids, mask)[0]
    expected = states[mask[0]].mean(0).numpy()
    ids_, emb = W.embed([{**nile, "target": nile["target"][:40]}], folder, precision="32-true")
    assert ids_ == ["nile_volume"] and np.allclose(emb[0], expected, atol=1e-5)
    assert mask[0].sum() < mask.shape[1]  # the padding was left out of the mean
    assert cli.main(["embed", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "e.csv"), "--precision", "32-true"]) == 0
    table = pd.read_csv(tmp_path / "e.csv")
    assert list(table.columns) == ["item_id"] + [f"e{j}" for j in range(model.d_model)]
    assert np.allclose(table.iloc[:, 1:].to_numpy(), z["embedding"], atol=1e-5)


def test_predicted_quantiles_are_gluonts_quantiles_of_the_models_own_sample_paths(saved_models):
    """predict (and forecasts.csv, the fan charts: the same _quantiles_of) take a sampling model's quantiles as
    GluonTS's SampleForecast.quantile does: a sorted sample path, no interpolation."""
    from domainfm.data_loaders.timeseries import left_pad_batch, load_sample

    folder, levels, ev = saved_models["wavetoken-test"], [0.1, 0.25, 0.5, 0.75, 0.9], W.EvalSection(num_samples=20)
    series = load_sample()[:4]
    pred = W.predict(series, folder, prediction_length=6, num_samples=20, seed=0, quantile_levels=levels,
                     precision="32-true")
    model = create_model(folder).eval()
    samples = W.model_forecast(model, left_pad_batch([s["target"] for s in series], model.context_length), 6, ev)
    for s, paths in zip(series, samples["samples"]):
        rows = pred[pred.item_id == s["item_id"]]
        forecast = SampleForecast(samples=paths, start_date=pd.Period(rows.timestamp.iloc[0], freq="M"))
        expected = np.stack([forecast.quantile(q) for q in levels], axis=-1)
        np.testing.assert_allclose(rows[[str(q) for q in levels]].to_numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(rows["mean"].to_numpy(), forecast.mean, rtol=1e-6)
    # 20 paths: linear interpolation (np.quantile, used before) gives other values
    interpolated = np.moveaxis(np.quantile(samples["samples"], levels, axis=1), 0, -1).reshape(-1, len(levels))
    assert not np.allclose(pred[[str(q) for q in levels]].to_numpy(), interpolated, rtol=1e-6)


def test_bad_input_is_the_loaders_one_line_error_and_writes_nothing(tmp_path, capsys, saved_models):
    folder = str(saved_models["wavetoken-test"])
    frame = pd.read_csv(SHIPPED)
    frame.drop(columns=["target"]).to_csv(tmp_path / "nocol.csv", index=False)
    empty = frame.copy()
    empty.loc[empty.item_id == "nile_volume", "target"] = np.nan
    empty.to_csv(tmp_path / "empty.csv", index=False)
    for command, out in (("predict", "o.csv"), ("embed", "o.npz")):
        for src, expected in (("nocol.csv", "missing column(s) ['target']"),
                              ("empty.csv", "item 'nile_volume' has no observed value")):
            assert cli.main([command, "wavetoken", "--model", folder, "--input", str(tmp_path / src),
                             "--output", str(tmp_path / out)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert expected in err[0] and src in err[0] and "Traceback" not in "\n".join(err)
            assert not (tmp_path / out).exists() and not (tmp_path / "o.png").exists()
            assert not list(tmp_path.glob(".o.*"))  # no temporary file left


def test_bf16_forecasts_stay_within_the_documented_tolerance_of_fp32(saved_models):
    from domainfm.data_loaders import timeseries as T
    from domainfm.precision import autocast

    _, test = T.split_by_time(T.load_sample(), 12, min_context=2)
    ev = W.EvalSection(num_samples=400, seed=0)  # fewer samples: the ratio is mostly sampling noise (each sample path decodes the whole 64-step token layout, so one flipped token moves all its steps)
    levels = W._with_median(ev.quantile_levels)
    for name, folder in saved_models.items():
        model = create_model(folder).eval()
        context = torch.from_numpy(np.stack([T.left_pad(w["context"], model.context_length) for w in test]))
        scores, outputs, tokens = {}, {}, {}
        for precision in ("32-true", "bf16-mixed"):
            with autocast(precision):
                scores[precision] = W._scores(test, W.model_forecast(model, context, 12, ev, levels), levels)
                with torch.no_grad():
                    if W.is_quantile_forecaster(model):
                        outputs[precision] = model(context)["quantile_preds"].float()
                    else:
                        future = torch.from_numpy(np.stack([w["future"] for w in test])).float()
                        with W.fp32_tokenizer(model):
                            tokens[precision] = model.training_tokens(context, future)
                        ids, mask, labels = tokens["32-true"]  # the same tokens: the network's difference alone
                        outputs[precision] = model(ids, mask, model.shift_right(labels)).float()
        if tokens:  # the tokenizer runs in fp32 under bf16 autocast: the same tokens
            assert all(torch.equal(x, y) for x, y in zip(tokens["32-true"], tokens["bf16-mixed"]))
        a, b = outputs["32-true"], outputs["bf16-mixed"]
        rel = float((a - b).abs().max() / a.abs().max())
        assert 0 < rel < W.BF16_TOLERANCE["logits_rel"], (name, rel)  # bf16 was applied, and stayed close
        for key in ("wql_rel", "mase_rel"):
            ratio = scores["bf16-mixed"][key] / scores["32-true"][key] - 1
            assert abs(ratio) < W.BF16_TOLERANCE["score_rel"], (name, key, ratio, scores)
    # predict() applies the precision it is given
    folder = saved_models["wavetoken-test"]
    fp32 = W.predict(SHIPPED, folder, prediction_length=4, num_samples=4, precision="32-true")
    bf16 = W.predict(SHIPPED, folder, prediction_length=4, num_samples=4, precision="bf16-mixed")
    assert not np.allclose(fp32["mean"], bf16["mean"])


def test_chronos_bolt_finetunes_predicts_and_embeds_through_the_same_paths(tmp_path, saved_models):
    folder = saved_models["chronos-bolt-test"]
    assert cli.main(["finetune", "wavetoken", "model.name=chronos-bolt-test", f"model.pretrained={folder}", "stages=[]",
                     "arms=[pretrained]", "train.max_steps=4", "train.lr=0.01", *TINY, "retained.series=8",
                     "adapt.sample_weighting=flow", "--runs-dir", str(tmp_path), "--name", "b"]) == 0
    run = tmp_path / "wavetoken" / "b"
    report = json.loads((run / "report.json").read_text())
    assert list(report["arms"]) == ["pretrained", "pretrained+flow"]  # FLOW through the recipe's per_sample_loss
    flow = report["arms"]["pretrained+flow"]
    assert 0 < flow["flow"]["weight_min"] <= flow["flow"]["weight_max"] <= 1 and np.isfinite(flow["test"]["wql_rel"])
    assert np.isfinite(flow["retained"]["wql_rel"]) and flow["test"] != report["arms"]["pretrained"]["test"]
    arm = report["arms"]["pretrained"]
    assert arm["init"].startswith("pretrained") and arm["steps"] == 4 and arm["test"]["n_datasets"] == 6
    for key in ("mase_rel", "wql_rel", "loss"):
        assert np.isfinite(arm["test"][key]) and arm["test"][key] > 0
    assert np.isfinite(arm["zero_shot"]["test"]["wql_rel"]) and arm["retained"]["n_series"] == 8
    # the quantile forecaster's report has the same baselines beside it (the same windows as the token models')
    assert list(report["baselines"]["columns"]) == ["seasonal naive", "AutoETS", "AutoTheta"]
    assert arm["zero_shot"]["test"]["auto_ets_wql_rel"] == arm["test"]["auto_ets_wql_rel"] > 0
    assert report["retained_before"]["wql_rel"] == arm["retained_before"]["wql_rel"]
    logged = [json.loads(line) for line in (run / "pretrained" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "train" and np.isfinite(r["loss"]) for r in logged)
    _assert_png(run / arm["pictures"]["forecast_fan"])
    tuned = create_model(run / "pretrained" / "model").eval()
    start = create_model(folder).eval()
    assert W.is_quantile_forecaster(tuned)
    assert any(not torch.equal(p, q) for p, q in zip(tuned.state_dict().values(), start.state_dict().values()))

    # predict: no sampling; the CSV holds the model's own quantiles (fp32)
    out = tmp_path / "bolt.csv"
    assert cli.main(["predict", "wavetoken", "--model", str(run), "--input", SHIPPED, "--output", str(out),
                     "--quantiles", "0.1,0.5,0.9", "--precision", "32-true"]) == 0
    pred = pd.read_csv(out)
    assert len(pred) == 14 * 12  # the run's data.prediction_length
    from domainfm.data_loaders.timeseries import left_pad, load_sample

    series = load_sample()
    context = torch.from_numpy(np.stack([left_pad(s["target"], tuned.context_length) for s in series]))
    quantiles, mean = tuned.predict_quantiles(context, 12, quantile_levels=[0.1, 0.5, 0.9])
    assert np.allclose(pred[["0.1", "0.5", "0.9"]].to_numpy(), quantiles.reshape(-1, 3).numpy(), atol=1e-4, rtol=1e-5)
    assert np.allclose(pred["mean"].to_numpy(), mean.reshape(-1).numpy(), atol=1e-4, rtol=1e-5)
    _assert_png(tmp_path / "bolt.png")
    # embed: Bolt's encoder states mean-pooled over observed patches and [REG]
    assert cli.main(["embed", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "b.npz"), "--precision", "32-true"]) == 0
    z = np.load(tmp_path / "b.npz")
    assert z["embedding"].shape == (14, start.d_model)
    with torch.no_grad():
        states, attention, _ = start.encode(context[:1])
    assert np.allclose(z["embedding"][0], states[0][attention[0]].mean(0).numpy(), atol=1e-5)


@pytest.mark.parametrize("option, value, expected", [
    ("--prediction-length", "0", "must be >= 1"),
    ("--prediction-length", "-3", "must be >= 1"),
    ("--num-samples", "0", "must be >= 1"),
    ("--quantiles", "abc", "'abc' is not a number"),
    ("--quantiles", "1.5,-0.2", "strictly between 0 and 1"),
])
def test_out_of_range_options_are_one_line_errors_not_defaults(tmp_path, capsys, saved_models, option, value, expected):
    """0 used to mean the default horizon (16) and --quantiles 1.5 a traceback: argparse refuses them."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["predict", "wavetoken", "--model", str(saved_models["wavetoken-test"]), "--input", SHIPPED,
                  "--output", str(tmp_path / "o.csv"), option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and expected in err and "Traceback" not in err
    assert not (tmp_path / "o.csv").exists()
