"""FLOW + WiSE-FT through the CLI on every family (issue 16): ``domainfm finetune FAMILY ...
adapt.sample_weighting=flow adapt.interpolation=wise`` runs on each family's embedded task with
its tiny model, and the report carries the forgetting measurement for every arm: the retained
capability before adaptation, after it for the fine-tuned, FLOW and WiSE arms, the WiSE curve and
the trade-off picture. The WiSE endpoints are checked exactly: alpha 1 is the fine-tuned arm,
alpha 0 the pretrained side (the model itself, or a linear probe on its frozen backbone, whose
retained capability reads the backbone only, so it equals the value measured before adaptation).
FIM's embedded default is zero-shot (adapt.mode=none): there the robust arms are skipped with the
reason."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import create_model, save_pretrained
from domainfm.cli import main

ROBUST = ["adapt.sample_weighting=flow", "adapt.interpolation=wise", "adapt.wise_alpha=[0,0.5,1]",
          "adapt.seeds=[0]", "adapt.probe_epochs=1", "arms=[pretrained]", "stages=[]", "train.precision=32-true"]
ALPHAS = ["0", "0.5", "1"]


@pytest.fixture(autouse=True)
def _torch_threads():
    """SToFM's scanpy calls launch numba's OpenMP pool, which sets the process's OpenMP thread count
    (torch's too) to the number of cores, whatever OMP_NUM_THREADS says; the families run after it
    would then fight for the cores. Put torch's count back after each test."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _saved(tmp_path, name, seed=5, **kwargs):
    torch.manual_seed(seed)
    return str(save_pretrained(create_model(name, **kwargs), tmp_path / "weights" / name))


# --------------------------------------------------------------------------- per-family tiny runs
# Overrides copied from each family's own CLI tests (tests/finetune/test_<family>*.py); the
# pretrained weights are a seeded tiny model saved in tmp_path (no pretraining stage).

def _cbramod(tmp_path):
    from domainfm.models.cbramod import to_official_state_dict

    torch.manual_seed(5)
    source = create_model("cbramod-test", n_outputs=None)  # with the reconstruction head (proj_out)
    path = tmp_path / "pretrained_weights.pth"
    torch.save(to_official_state_dict(source), path)
    return ["model.name=cbramod-test", f"model.pretrained={path}", "model.kwargs={}", "data.kind=demo",
            "n_outputs=3", "train.max_steps=3", "train.batch_size=32", "train.progress=false"]


def _git(tmp_path):
    return ["model.name=git-test", f"model.pretrained={_saved(tmp_path, 'git-test', in_channels=384, n_outputs=2)}",
            "data.dataset=karate", "train.max_epochs=2", "train.batch_size=16", "protocols.in_context=false",
            "train.monitor=val/accuracy", "retained.n_episodes=5"]


def _explora(tmp_path):
    kwargs = dict(img_size=32, patch_size=4, embed_dim=48, depth=3, num_heads=3, global_pool="avg")
    return ["model.name=explora-test", f"model.pretrained={_saved(tmp_path, 'explora-test', n_outputs=0, **kwargs)}",
            "train.max_epochs=1", "train.batch_size=64", "train.max_steps=3", "train.log_every_steps=1"]


def _wavetoken(tmp_path):
    return ["model.name=wavetoken-test", f"model.pretrained={_saved(tmp_path, 'wavetoken-test')}",
            "train.max_steps=4", "train.lr=0.01", "train.batch_size=8", "train.progress=false",
            "data.windows_per_epoch=16", "eval.num_samples=4", "retained.series=8"]


def _stofm(tmp_path):
    from domainfm.data_loaders import spatial as S

    path = tmp_path / "slice.h5ad"
    S.demo_tissue()[::6].copy().write_h5ad(path)
    return ["model.name=stofm-test", f"model.pretrained={_saved(tmp_path, 'stofm-test', n_outputs=None)}",
            "model.kwargs={}", "data.cell_encoder.name=stofm-cell-encoder-test", "data.cell_encoder.kwargs={}",
            f"data.path={path}", "data.cells_per_subslice=60", "pca_components=10", "train.max_epochs=1"]


def _fim_series(tmp_path, n=80):
    t = np.arange(n) * 0.25
    df = pd.DataFrame({"time": t, "a": np.sin(t), "b": np.cos(0.5 * t) + 2})
    df.loc[[5, 6, 7, 30, 41], "a"] = np.nan
    df.loc[[12, 13], "b"] = np.nan
    df.to_csv(tmp_path / "s.csv", index=False)
    return tmp_path / "s.csv"


def _fim(tmp_path):
    return ["model.name=fim-imputation-test", "model.kwargs={}",
            f"model.pretrained={_saved(tmp_path, 'fim-imputation-test')}", "adapt.mode=full", "data.kind=series",
            f"data.path={_fim_series(tmp_path)}", "data.window_points=32", "data.n_train=16", "train.max_steps=2",
            "train.batch_size=4", "train.progress=false", "train.lr=1e-3"]


def _wearables(tmp_path):
    stage = ("stages=[{family: wearables, config: pretrain_demo, overrides: [data.synthetic_participants=12, "
             "data.synthetic_weeks=2, train.max_steps=2, train.batch_size=8]}]")
    return ["data.synthetic_participants=30", "data.synthetic_weeks=2", stage, "adapt.mode=full",
            "train.max_steps=2", "train.batch_size=16", "probe.enabled=false"]


FAMILIES = {"cbramod": _cbramod, "git": _git, "explora": _explora, "wavetoken": _wavetoken, "stofm": _stofm,
            "fim": _fim, "wearables": _wearables}


def _finetune(tmp_path, family, overrides, name="robust"):
    assert main(["finetune", family, *ROBUST, *overrides, "--runs-dir", str(tmp_path / "runs"), "--name", name]) == 0
    run = tmp_path / "runs" / family / name
    return run, json.loads((run / "report.json").read_text())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flow_and_wise_through_the_cli(family, tmp_path):
    run, report = _finetune(tmp_path, family, FAMILIES[family](tmp_path))
    metric = report["retained_capability"]["metric"]
    arms = report["arms"]
    expected = (["pretrained"] + [f"pretrained+wise@{a}" for a in ALPHAS] + ["pretrained+flow"]
                + [f"pretrained+flow+wise@{a}" for a in ALPHAS])
    assert list(arms) == expected, list(arms)
    assert report["adapt"]["sample_weighting"] == "flow" and report["adapt"]["wise_alpha"] == [0.0, 0.5, 1.0]
    assert "skipped_arms" not in report["robust"]
    # forgetting, measured: before adaptation and after it for every arm
    before = report["retained_before"]
    assert math.isfinite(before[metric])  # checked exactly below: the alpha-0 arms measure it again
    for name in expected:
        assert "skipped" not in arms[name], (name, arms[name].get("skipped"))
        assert math.isfinite(arms[name]["retained"][metric]), name
        assert arms[name].get("val") or arms[name].get("test"), name
    # FLOW trained its own model with weights exp(-l / tau), tau the median pretrained loss
    flow = arms["pretrained+flow"]["flow"]
    assert flow["temperature_rule"] == "median" and flow["temperature"] > 0
    assert 0 < flow["weight_min"] <= flow["weight_mean"] <= flow["weight_max"] <= 1.0
    assert (run / "pretrained+flow" / "model").is_dir()
    for base in ("pretrained", "pretrained+flow"):
        one, zero = arms[f"{base}+wise@1"], arms[f"{base}+wise@0"]
        # alpha 1 is the fine-tuned arm itself: the same target metrics and retained capability
        for split in ("val", "test"):
            assert one.get(split) == arms[base].get(split), (base, split)
        assert one["retained"] == arms[base]["retained"], base
        # alpha 0 is the pretrained side, whose retained capability was measured before adaptation
        assert zero["retained"] == before, (base, zero["retained"], before)
        assert zero["derived_from"] == base and arms[f"{base}+wise@0.5"]["alpha"] == 0.5
        # the WiSE curve: one entry per alpha, the same figures as the derived arms
        curve = report["wise_curve"][base]
        assert [p["alpha"] for p in curve] == [0.0, 0.5, 1.0]
        for point, a in zip(curve, ALPHAS):
            assert point["retained"] == arms[f"{base}+wise@{a}"]["retained"]
    # both fine-tuned arms start from the same pretrained side: their alpha-0 models agree
    assert arms["pretrained+wise@0"].get("val") == arms["pretrained+flow+wise@0"].get("val")
    # the trade-off picture
    assert report["pictures"]["tradeoff"] == "tradeoff.png"
    png = (run / "tradeoff.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    from matplotlib import image

    pixels = image.imread(run / "tradeoff.png")[..., :3]  # decodes, and is not blank
    assert min(pixels.shape[:2]) >= 200 and pixels.std() > 0.02


def test_fim_zero_shot_default_skips_the_robust_arms_with_the_reason(tmp_path):
    overrides = [o for o in _fim(tmp_path) if o != "adapt.mode=full"]
    _, report = _finetune(tmp_path, "fim", [*overrides, "adapt.mode=none"], name="zs")
    assert list(report["arms"]) == ["pretrained"]
    assert report["robust"]["skipped_arms"] == {"pretrained": "adapt.mode=none does not fine-tune the backbone"}
    assert "wise_curve" not in report
    arm = report["arms"]["pretrained"]
    assert arm["retained"] == arm["retained_before"] == report["retained_before"]  # nothing trained, nothing lost


def test_fim_embedded_demo_has_nothing_to_fine_tune_so_the_robust_arms_are_skipped(tmp_path):
    # the embedded default's data (data.kind=demo) are scoring cases only; adapt.mode=full then
    # trains nothing, and FLOW / WiSE have no fine-tuned model to weight or interpolate
    overrides = ["model.name=fim-imputation-test", "model.kwargs={}",
                 f"model.pretrained={_saved(tmp_path, 'fim-imputation-test')}", "adapt.mode=full"]
    _, report = _finetune(tmp_path, "fim", overrides, name="demo")
    assert list(report["arms"]) == ["pretrained"] and "pretrained" in report["robust"]["skipped_arms"]
    assert "no training data" in report["robust"]["skipped_arms"]["pretrained"]
