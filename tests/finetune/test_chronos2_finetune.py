"""Chronos-2 fine-tuning with covariates on the experiment layer, its loss per sample, predict and errors."""
from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import default_collate

import domainfm
from domainfm import cli, config as cfgmod, create_model
from domainfm.finetune import chronos2 as C2

TINY = ["train.max_steps=3", "train.batch_size=16", "train.progress=false"]
LEVELS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The shipped default (LoRA, past-only and known-future covariates) with a tiny max_steps."""
    runs = tmp_path_factory.mktemp("runs")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["finetune", "chronos2", "--runs-dir", str(runs), "--name", "lora", *TINY]) == 0
    folder = runs / "chronos2" / "lora"
    (runs / "printed.txt").write_text(printed.getvalue())  # the command's table, for the tests below
    return folder, json.loads((folder / "report.json").read_text())


def test_autoets_and_autotheta_are_scored_on_the_models_context_windows_and_shown_beside_the_arms(lora_run):
    from statsforecast.models import AutoETS

    from domainfm.experiment.forecast_metrics import mase

    folder, report = lora_run
    assert report["baselines"]["columns"] == {"seasonal naive": "naive", "AutoETS": "auto_ets", "AutoTheta": "auto_theta"}
    # the printed table and report.md: one column per arm, then seasonal naive, AutoETS, AutoTheta
    printed = (folder.parents[1] / "printed.txt").read_text()
    header = next(line for line in printed.splitlines() if line.startswith("metric"))
    assert header.split() == ["metric", "pretrained", "random", "seasonal", "naive", "AutoETS", "AutoTheta"]
    markdown = (folder / "report.md").read_text()
    assert "| metric | pretrained | random | seasonal naive | AutoETS | AutoTheta |" in markdown
    assert "- **baselines**: seasonal naive (on the whole context, as GluonTS) and AutoETS, AutoTheta" in markdown
    # AutoETS called directly on each item's target over the context the model sees (quarterly: season 4)
    task = C2.build_task(_config(*TINY))
    c, h = task.info["context_length"], 8
    windows = task.test.windows()
    contexts = [w["context"][-c:] for w in windows]
    point = np.stack([AutoETS(season_length=4).forecast(y=y, h=h)["mean"] for y in contexts])
    expected = mase(np.stack([w["future"] for w in windows]), point, [w["context"] for w in windows], 4)
    for arm in report["arms"].values():
        test = arm["test"]
        assert test["target.auto_ets_mase"] == pytest.approx(expected, rel=1e-9)
        assert test["auto_ets_mase_rel"] == pytest.approx(test["target.auto_ets_mase"] / test["target.naive_mase"])
        assert test["auto_ets_fallback_windows"] == 0 and test["auto_theta_fallback_windows"] == 0
        # the zero-shot protocol and the retained capability carry the baselines too
        assert arm["zero_shot"]["test"]["auto_theta_wql_rel"] == test["auto_theta_wql_rel"]
        assert arm["retained"]["auto_ets_wql_rel"] == arm["retained_before"]["auto_ets_wql_rel"] > 0


def _config(*overrides: str) -> C2.Config:
    raw = cfgmod.load_yaml(cfgmod.config_path("chronos2", "finetune"))
    return cfgmod.from_dict(C2.Config, cfgmod.apply_overrides(raw, list(overrides)))


def test_lora_finetune_with_known_future_covariates_reports_baseline_retained_init_and_pictures(lora_run):
    folder, report = lora_run
    assert report["adapt"]["mode"] == "lora"
    assert report["data"]["past_covariates"] == ["unemp", "tbilrate"]
    assert report["data"]["future_covariates"] == ["quarter"]
    assert set(report["arms"]) == {"pretrained", "random"}
    # chronos-2-test has no weights: the pretrained arm says it fell back to random init
    assert report["arms"]["pretrained"]["init"].startswith("random (fallback")
    assert report["arms"]["random"]["init"].startswith("random")
    for arm in report["arms"].values():
        test = arm["test"]
        # seasonal naive beside the model (GluonTS conventions), and the geometric mean relative to it
        assert test["target.naive_wql"] > 0 and test["target.naive_mase"] > 0
        assert test["wql_rel"] == pytest.approx(test["target.wql"] / test["target.naive_wql"], rel=1e-6)
        assert arm["params"]["trainable"] < arm["params"]["total"]
        assert arm["retained"]["n_series"] == 3 and math.isfinite(arm["retained"]["wql_rel"])
        # paired: training moved the retained (held-out items) score
        assert arm["retained"]["wql_rel"] != arm["retained_before"]["wql_rel"]
    assert report["retained_capability"]["metric"] == "wql_rel"
    adapter = json.loads((folder / "pretrained" / "adapter" / "adapter_config.json").read_text())
    # LoRA on both attentions' q/k/v/o and the feed-forward of every block; the quantile head trains fully
    assert len(adapter["target_modules"]) == 2 * (2 * 4 + 2)
    assert {t.split(".", 3)[-1] for t in adapter["target_modules"]} == {
        f"{a}.{p}" for a in ("time_attn", "group_attn") for p in "qkvo"} | {"ffn.wi", "ffn.wo"}
    assert adapter["modules_to_save"] == ["quantile_head"]
    for arm in ("pretrained", "random"):
        fan = folder / report["arms"][arm]["pictures"]["forecast_fan"]
        assert fan.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        forecasts = pd.read_csv(folder / arm / "forecasts.csv")
        assert len(forecasts) == 5 * 8 and {"target", "mean", "0.1", "0.9"} <= set(forecasts.columns)
    assert (folder / report["pictures"]["tradeoff"]).is_file()


def test_loss_per_sample_is_the_step_loss_and_chronos2s_forward_loss():
    cfg = _config()
    task = C2.build_task(cfg)
    torch.manual_seed(0)
    model = create_model("chronos-2-test").train()
    recipe = C2.build_recipe(cfg, model, task)
    batch = default_collate([task.train[i] for i in (0, 7, 40, 90)])
    per_sample = recipe.per_sample_loss(model, batch)
    loss, _ = recipe.step(model, batch)
    assert per_sample.shape == (4,) and len(set(per_sample.tolist())) == 4
    assert loss.item() == pytest.approx(per_sample.mean().item(), rel=1e-6)
    context, group_ids, future, target = C2._grouped(batch, 1)
    forward = model(context, group_ids, future, math.ceil(8 / model.output_patch_size), future_target=target)["loss"]
    assert forward.item() == pytest.approx(per_sample.mean().item(), rel=1e-5)
    # paired: the known-future covariate (quarter) reaches the loss
    without = (batch[0], torch.full_like(batch[1], float("nan")), batch[2])
    assert recipe.per_sample_loss(model, without).mean().item() != pytest.approx(loss.item(), rel=1e-6)
    # the windows hold the covariates where Chronos-2's tasks put them: targets, past-only, known-future
    context, future, target = task.train[0]
    assert context.shape[0] == 4 and torch.isnan(future[:3]).all() and torch.isfinite(future[3]).all()


def _inputs(tmp_path, horizon=8):
    shipped = pd.read_csv(C2.SHIPPED)
    shipped = shipped[shipped.item_id.isin(["realgdp", "realinv", "cpi"])]
    ahead = shipped.groupby("item_id").cumcount(ascending=False) < horizon  # each item's last steps
    history, future = shipped[~ahead], shipped.loc[ahead, ["item_id", "timestamp", "quarter"]]
    history.to_csv(tmp_path / "long.csv", index=False)
    future.to_csv(tmp_path / "future.csv", index=False)
    return history, future


def test_predict_writes_the_models_predict_df_and_a_fan_chart(lora_run, tmp_path):
    folder, _ = lora_run
    history, future = _inputs(tmp_path)
    out, fan = tmp_path / "out.csv", tmp_path / "fan.png"
    # 32-true: the direct call below runs in fp32 (auto may pick bf16 on a CPU that has it)
    assert cli.main(["predict", "wavetoken", "--model", str(folder), "--arm", "pretrained", "--input",
                     str(tmp_path / "long.csv"), "--future-covariates", str(tmp_path / "future.csv"),
                     "--output", str(out), "--plot", str(fan), "--precision", "32-true"]) == 0
    written = pd.read_csv(out)
    model = create_model(folder / "pretrained" / "model").eval()
    expected = model.predict_df(pd.read_csv(tmp_path / "long.csv"), pd.read_csv(tmp_path / "future.csv"),
                                id_column="item_id", timestamp_column="timestamp", target="target",
                                prediction_length=8, quantile_levels=LEVELS)
    assert list(written.columns) == list(expected.columns) and len(written) == 3 * 8
    assert (written["item_id"] == expected["item_id"]).all()
    assert (pd.to_datetime(written["timestamp"]) == pd.to_datetime(expected["timestamp"])).all()
    for column in ["predictions", *map(str, LEVELS)]:
        np.testing.assert_allclose(written[column], expected[column], rtol=1e-5, atol=1e-4)
    assert fan.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run's own family and the Python API reach the same forecasts
    again = tmp_path / "again.csv"
    assert cli.main(["predict", "chronos2", "--model", str(folder), "--input", str(tmp_path / "long.csv"),
                     "--future-covariates", str(tmp_path / "future.csv"), "--output", str(again), "--no-plot",
                     "--precision", "32-true"]) == 0
    np.testing.assert_allclose(pd.read_csv(again)["0.9"], expected["0.9"], rtol=1e-5, atol=1e-4)
    python = domainfm.predict(folder, pd.read_csv(tmp_path / "long.csv"), precision="32-true",
                              future_covariates=str(tmp_path / "future.csv"))
    np.testing.assert_allclose(python["predictions"], expected["predictions"], rtol=1e-5, atol=1e-4)
    # the known-future covariate changes the forecast (paired with the same inputs without it)
    unknown = model.predict_df(pd.read_csv(tmp_path / "long.csv"), None, id_column="item_id",
                               timestamp_column="timestamp", target="target", prediction_length=8,
                               quantile_levels=LEVELS)
    assert not np.allclose(unknown["predictions"], expected["predictions"])


def test_predict_by_registered_name_with_random_weights(tmp_path):
    _inputs(tmp_path)
    out = tmp_path / "out.csv"
    assert cli.main(["predict", "wavetoken", "--model", "chronos-2-test", "--pretrained", "none", "--input",
                     str(tmp_path / "long.csv"), "--future-covariates", str(tmp_path / "future.csv"),
                     "--output", str(out), "--prediction-length", "8", "--no-plot"]) == 0
    written = pd.read_csv(out)
    assert len(written) == 3 * 8 and {"predictions", "0.1", "0.5", "0.9"} <= set(written.columns)


def test_a_covariate_column_missing_from_the_file_is_a_one_line_error(tmp_path, capsys):
    data = pd.read_csv(C2.SHIPPED).drop(columns=["tbilrate"])
    path = tmp_path / "series.csv"
    data.to_csv(path, index=False)
    rc = cli.main(["finetune", "chronos2", "--runs-dir", str(tmp_path / "runs"), *TINY, f"data.path={path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert str(path) in err[0] and "'tbilrate'" in err[0] and "data.past_covariates" in err[0]
    # predict: a future file without the id column
    _inputs(tmp_path)
    pd.read_csv(tmp_path / "future.csv").drop(columns=["item_id"]).to_csv(tmp_path / "bad.csv", index=False)
    rc = cli.main(["predict", "wavetoken", "--model", "chronos-2-test", "--pretrained", "none", "--input",
                   str(tmp_path / "long.csv"), "--future-covariates", str(tmp_path / "bad.csv"),
                   "--output", str(tmp_path / "o.csv"), "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "bad.csv" in err[0] and "'item_id'" in err[0]
