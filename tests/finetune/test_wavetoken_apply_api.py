"""``domainfm.predict`` / ``domainfm.embed`` (the shared apply layer) for WaveToken / Chronos on the
shipped series: the same values as the family's own Python functions and its command line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm import cli, create_model, save_pretrained
from domainfm.finetune import wavetoken as W

SHIPPED = str(Path(W.__file__).parents[1] / "data_loaders" / "samples" / "timeseries" / "statsmodels_series.csv")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(2)
    return save_pretrained(create_model("wavetoken-test"), tmp_path_factory.mktemp("models") / "wavetoken-test")


def test_domainfm_predict_and_embed_equal_the_family_functions_and_the_cli(tmp_path, folder):
    options = {"prediction_length": 5, "num_samples": 6, "quantiles": [0.1, 0.5, 0.9], "seed": 3}
    frame = domainfm.predict(str(folder), SHIPPED, family="wavetoken", precision="32-true", **options)
    assert list(frame.columns) == ["item_id", "timestamp", "mean", "0.1", "0.5", "0.9"] and len(frame) == 14 * 5
    same = W.predict(SHIPPED, folder, prediction_length=5, num_samples=6, quantile_levels=[0.1, 0.5, 0.9], seed=3,
                     precision="32-true")
    pd.testing.assert_frame_equal(frame, same, atol=1e-6)
    # a module names its own family
    by_module = domainfm.predict(create_model(folder), SHIPPED, precision="32-true", **options)
    pd.testing.assert_frame_equal(by_module, frame, atol=1e-6)
    out = tmp_path / "fc.csv"
    assert cli.main(["predict", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output", str(out),
                     "--prediction-length", "5", "--num-samples", "6", "--quantiles", "0.1,0.5,0.9", "--seed", "3",
                     "--precision", "32-true", "--no-plot"]) == 0
    written = pd.read_csv(out, parse_dates=["timestamp"])
    pd.testing.assert_frame_equal(written, frame, check_dtype=False, atol=1e-5)

    z = domainfm.embed(str(folder), SHIPPED, family="wavetoken", precision="32-true")
    ids, emb = W.embed(SHIPPED, folder, precision="32-true")
    assert list(z["item_id"]) == ids == list(pd.read_csv(SHIPPED).item_id.unique())
    assert z["embedding"].dtype == np.float32 and np.allclose(z["embedding"], emb, atol=1e-6)
    assert cli.main(["embed", "wavetoken", "--model", str(folder), "--input", SHIPPED, "--output",
                     str(tmp_path / "e.npz"), "--precision", "32-true"]) == 0
    with np.load(tmp_path / "e.npz") as npz:
        assert list(npz["item_id"]) == ids and np.allclose(npz["embedding"], emb, atol=1e-6)


@pytest.mark.parametrize("command, listed, absent", [
    ("predict", ["--item-id", "--chunk-rows", "--prediction-length", "--num-samples", "--quantiles", "--seed", "--plot",
                 "--no-plot"], []),
    ("embed", ["--item-id", "--timestamp", "--target", "--freq", "--chunk-rows", "--batch-size"],
     ["--num-samples", "--plot"]),
])
def test_help_lists_the_family_options(capsys, command, listed, absent):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "wavetoken", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in listed) and not any(flag in out for flag in absent), out
