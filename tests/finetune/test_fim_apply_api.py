"""``domainfm.predict`` for FIM on the shipped sample (weekly Mauna Loa CO2, 59 missing weeks) agrees
with ``domainfm predict fim`` on the same model (a module, its folder, a DataFrame or the file), leaves
a caller's module as it was, and ``--help`` lists the family's options."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm import cli
from domainfm.data_loaders import gapped_series

SAMPLE = Path(gapped_series.__file__).parent / "samples" / "fim" / "co2_weekly.csv"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("fim") / "model"
    domainfm.save_pretrained(domainfm.create_model("fim-imputation-test"), folder)
    return folder


def test_python_predict_matches_the_cli_on_the_shipped_sample(model_dir, tmp_path):
    raw = pd.read_csv(SAMPLE)  # read here, not through the loader: the counts are the file's own
    module = domainfm.create_model(model_dir)
    got = domainfm.predict(module, SAMPLE, window_points=96, overlap=0.25)
    assert next(module.parameters()).dtype == torch.float32  # imputed in float64 on a copy: the caller's is kept
    assert list(got.columns) == ["date", "co2", "co2_std", "co2_observed"]
    assert got["date"].tolist() == raw["date"].tolist()
    assert (~got["co2_observed"]).sum() == raw["co2"].isna().sum() == 59
    assert np.isfinite(got["co2"]).all() and (got["co2_std"] > 0).all()

    out = tmp_path / "imputed.csv"
    assert cli.main(["predict", "fim", "--input", str(SAMPLE), "--output", str(out), "--model", str(model_dir),
                     "--window-points", "96", "--overlap", "0.25"]) == 0
    cli_table = pd.read_csv(out)
    assert cli_table["date"].tolist() == got["date"].tolist()
    assert cli_table["co2_observed"].tolist() == got["co2_observed"].tolist()
    # the CSV holds the floats' shortest round-trip text: equal up to float64 formatting
    np.testing.assert_allclose(cli_table["co2"], got["co2"], rtol=1e-12)
    np.testing.assert_allclose(cli_table["co2_std"], got["co2_std"], rtol=1e-12)
    assert (tmp_path / "imputed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the model folder itself, and a DataFrame in place of the file: the same numbers
    again = domainfm.predict(model_dir, raw, family="fim", window_points=96, overlap=0.25)
    np.testing.assert_allclose(again["co2"], got["co2"], rtol=1e-10)


def test_help_lists_the_family_options_and_embed_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["predict", "fim", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--time", "--window-points", "--overlap", "--plot", "--model", "--input", "--output"):
        assert flag in text, flag
    assert "fim-imputation-base" in text  # the default model
    assert cli.main(["embed", "fim", "--input", "x.csv", "--output", "x.npz"]) == 2
    assert "has no embed command" in capsys.readouterr().err
