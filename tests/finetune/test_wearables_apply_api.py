"""``domainfm.predict`` / ``domainfm.embed`` on a WBM: the same figures as the family's own
functions, the CLI and the model applied by hand, on the shipped simulator's participant (as a
long CSV, a long DataFrame and an hourly table); and ``--help`` lists the family's option."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm import cli, create_model, save_pretrained
from domainfm.data_loaders import wearables as W
from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort
from domainfm.finetune import wearables as ft


@pytest.fixture(scope="module")
def person(tmp_path_factory):
    """A tiny fine-tunable WBM saved as a model folder, and one simulated participant (3 weeks)."""
    folder = tmp_path_factory.mktemp("wbm")
    torch.manual_seed(0)
    model = create_model("wbm-test", n_chans=len(SYNTHETIC_VARIABLES), n_times=168, n_outputs=1,
                         variables=list(SYNTHETIC_VARIABLES))
    save_pretrained(model, folder / "model")
    table = synthetic_cohort(1, 3, seed=5).tables[0]
    long = table.rename_axis("timestamp").reset_index().melt("timestamp", var_name="variable").dropna()
    long.to_csv(folder / "person.csv", index=False)
    return folder, table, long


def _by_hand(model_dir, table, min_hours=24):
    model = create_model(model_dir).eval()
    weeks = W.to_weeks(table, variables=list(model.variables), stats=W.ZScoreStats.identity(model.variables),
                       min_hours=min_hours)
    with torch.no_grad():
        v, o = torch.as_tensor(weeks.values), torch.as_tensor(weeks.observed)
        return weeks, torch.sigmoid(model(v, o, raw=True)).reshape(-1).numpy(), model.forward_features(v, o, raw=True)


def test_predict_equals_the_family_function_the_cli_and_the_model_by_hand(person, tmp_path):
    folder, table, long = person
    model_dir, csv = folder / "model", folder / "person.csv"
    weeks, p, _ = _by_hand(model_dir, table)
    # family= : apply.family_of_model does not yet read a model folder's config.json key "model_name"
    frame = domainfm.predict(str(model_dir), str(csv), family="wearables", precision="32-true")
    assert list(frame.columns) == ["week_start", "week_end", "hours_observed", "p_output"]  # no run: no target name
    assert list(frame["week_start"]) == list(weeks.week_starts) and len(frame) == 3
    np.testing.assert_array_equal(frame["hours_observed"], weeks.observed.any(-1).sum(-1))
    np.testing.assert_allclose(frame["p_output"], p, rtol=1e-5, atol=1e-6)
    own = ft.predict(str(csv), create_model(model_dir), precision="32-true")
    pd.testing.assert_frame_equal(own, frame)
    assert list(ft.predict(str(csv), create_model(model_dir), target="fit", precision="32-true").columns)[-1] == "p_fit"
    for source in (long, table):  # Python objects: a long DataFrame, an hourly table
        pd.testing.assert_frame_equal(domainfm.predict(create_model(model_dir), source, precision="32-true"), frame)
    out = tmp_path / "weeks.csv"
    assert cli.main(["predict", "wearables", "--model", str(model_dir), "--input", str(csv), "--output", str(out),
                     "--precision", "32-true"]) == 0
    written = pd.read_csv(out)
    np.testing.assert_allclose(written["p_output"], frame["p_output"], rtol=1e-6)
    assert list(written["week_start"]) == [str(d.date()) for d in frame["week_start"]]
    # the family's option: weeks with fewer observed hours are dropped
    hours = frame["hours_observed"].to_numpy()
    threshold = int(np.sort(hours)[1])  # keeps the two best-observed weeks
    fewer = domainfm.predict(str(model_dir), str(csv), family="wearables", precision="32-true", min_hours=threshold)
    assert len(fewer) == 2
    np.testing.assert_allclose(fewer["p_output"], frame["p_output"][hours >= threshold], rtol=1e-6)
    with pytest.raises(TypeError, match="unknown option"):
        domainfm.predict(str(model_dir), str(csv), family="wearables", stride=2)


def test_embed_equals_the_family_function_the_cli_and_the_model_by_hand(person, tmp_path):
    folder, table, _ = person
    model_dir, csv = folder / "model", folder / "person.csv"
    weeks, _, features = _by_hand(model_dir, table)
    arrays = domainfm.embed(create_model(model_dir), str(csv), precision="32-true")
    assert sorted(arrays) == ["X", "hours_observed", "week_start"]
    np.testing.assert_allclose(arrays["X"], features.numpy(), rtol=1e-5, atol=1e-6)
    frame, X = ft.embed(str(csv), create_model(model_dir), precision="32-true")
    np.testing.assert_array_equal(X, arrays["X"])
    assert list(frame["week_start"]) == list(weeks.week_starts)
    out = tmp_path / "e.npz"
    assert cli.main(["embed", "wearables", "--model", str(model_dir), "--input", str(csv), "--output", str(out),
                     "--precision", "32-true"]) == 0
    with np.load(out) as saved:  # plain arrays: loads without pickle
        np.testing.assert_array_equal(saved["X"], arrays["X"])
        assert list(saved["week_start"]) == ["2024-01-01", "2024-01-08", "2024-01-15"]
        np.testing.assert_array_equal(saved["hours_observed"], frame["hours_observed"])


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_help_lists_the_family_option(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "wearables", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--min-hours" in text and "drop weeks with fewer observed hours" in text
    assert "--input" in text and "Apple Health" in text and "--batch-size" in text
