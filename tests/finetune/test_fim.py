"""FIM on the experiment layer: metrics and baselines, the ODEBench systems, ``predict fim``
through the CLI (values for every gap, std column, PNG, errors), and a fine-tuning run on a series."""
from __future__ import annotations

import re

import json

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import cli
from domainfm.data_loaders.gapped_series import GappedSeriesError
from domainfm.data_loaders.odebench import ODEBENCH, simulate
from domainfm.finetune.fim import interpolate_baseline, masked_metrics


def test_masked_metrics_follow_pypots():
    target = np.array([[1.0], [2.0], [-4.0], [3.0]])
    pred = np.array([[1.0], [3.0], [-2.0], [9.0]])
    mask = np.array([[False], [True], [True], [False]])
    m = masked_metrics(pred, target, mask)
    assert m["mae"] == pytest.approx(1.5) and m["rmse"] == pytest.approx(np.sqrt(2.5))
    assert m["mre"] == pytest.approx(3.0 / 6.0)  # sum |p-t| m / sum |t m|
    assert m["r2"] == pytest.approx(1 - 41.0 / 29.0)  # mean 0.5: ss_tot = 0.25 + 2.25 + 20.25 + 6.25
    # R^2 only where the truth is known (a real gap's 0 placeholder must not count)
    known = np.array([[True], [True], [True], [False]])
    assert masked_metrics(pred, target, mask, known)["r2"] == pytest.approx(1 - 5.0 / (1 / 9 + 16 / 9 + 169 / 9))


def test_baselines_recover_what_they_should():
    t = np.linspace(0, 1, 50)
    x = np.stack([2 * t + 1, np.sin(3 * t)], axis=1)
    obs = np.ones_like(x, dtype=bool)
    obs[10:20] = False
    np.testing.assert_allclose(interpolate_baseline(t, x, obs, "linear")[:, 0], x[:, 0])
    spline = interpolate_baseline(t, x, obs, "spline")[:, 1]
    assert np.abs(spline - x[:, 1]).max() < 1e-2 < np.abs(interpolate_baseline(t, x, obs, "linear")[:, 1] - x[:, 1]).max()


def test_odebench_systems_simulate_and_match_their_equations():
    assert len(ODEBENCH) == 63 and [s["id"] for s in ODEBENCH] == list(range(1, 64))
    # published split: 23 one-, 28 two-, 10 three-, 2 four-dimensional systems, two initial conditions each
    assert [sum(s["dim"] == d for s in ODEBENCH) for d in (1, 2, 3, 4)] == [23, 28, 10, 2]
    for system in ODEBENCH:
        for init in system["inits"]:
            assert len(init) == system["dim"]
    logistic = ODEBENCH[2]  # x' = r x (1 - x/K): closed form
    t, x = simulate(logistic["f"], logistic["consts"], logistic["inits"][0], n_points=64)
    r, k = logistic["consts"]
    x0 = logistic["inits"][0][0]
    np.testing.assert_allclose(x[:, 0], k / (1 + (k / x0 - 1) * np.exp(-r * t)), rtol=1e-5)
    osc = ODEBENCH[23]  # x'' = -c x
    t, x = simulate(osc["f"], osc["consts"], osc["inits"][0], n_points=64)
    w = np.sqrt(osc["consts"][0])
    x0, v0 = osc["inits"][0]
    np.testing.assert_allclose(x[:, 0], x0 * np.cos(w * t) + v0 / w * np.sin(w * t), atol=1e-6)


@pytest.mark.parametrize("system", ODEBENCH, ids=lambda s: f"ode{s['id']}")
def test_odebench_rhs_and_simulation_finite(system):
    assert len(system["inits"]) == 2
    for init in system["inits"]:
        rhs = np.asarray(system["f"](np.asarray(init, dtype=float), system["consts"]), dtype=float)
        assert rhs.shape == (system["dim"],) and np.isfinite(rhs).all()
        t, x = simulate(system["f"], system["consts"], init, n_points=64)  # the published span [0, 10]
        assert t[0] == 0 and t[-1] == 10 and x.shape == (64, system["dim"]) and np.isfinite(x).all()
        np.testing.assert_allclose(x[0], init)


def _system(id_):
    return next(s for s in ODEBENCH if s["id"] == id_)


def test_odebench_new_systems_keep_their_invariants():
    # 63, SEIR in proportions: S' + E' + I' + R' = 0, so the total stays 1 and every share in [0, 1]
    seir = _system(63)
    for init in seir["inits"]:
        _, x = simulate(seir["f"], seir["consts"], init, n_points=128)
        np.testing.assert_allclose(x.sum(axis=1), 1.0, atol=1e-8)
        assert (x > -1e-9).all() and (x < 1 + 1e-9).all()
        assert x[-1, 3] > x[0, 3] + 0.1 and x[-1, 0] < x[0, 0]  # recovered grow, susceptibles shrink
    # 34, frictionless bead on a rotating hoop, x'' = sin x (cos x - g): conserved energy
    # E = v^2/2 - sin(x)^2/2 - g cos(x)
    hoop = _system(34)
    (g,) = hoop["consts"]
    for init in hoop["inits"]:
        _, x = simulate(hoop["f"], hoop["consts"], init, n_points=128)
        energy = x[:, 1] ** 2 / 2 - np.sin(x[:, 0]) ** 2 / 2 - g * np.cos(x[:, 0])
        np.testing.assert_allclose(energy, energy[0], atol=1e-6)
        assert np.ptp(x[:, 0]) > 0.5  # it actually moves
    # 32, damped double well, x'' = -c x' + x - x^3: E = v^2/2 - x^2/2 + x^4/4 loses exactly c * int v^2 dt
    well = _system(32)
    (c,) = well["consts"]
    from scipy.integrate import simpson

    for init in well["inits"]:
        t, x = simulate(well["f"], well["consts"], init, n_points=4001)
        energy = x[:, 1] ** 2 / 2 - x[:, 0] ** 2 / 2 + x[:, 0] ** 4 / 4
        dissipated = c * simpson(x[:, 1] ** 2, x=t)
        assert dissipated > 1.0
        np.testing.assert_allclose(energy[0] - energy[-1], dissipated, rtol=1e-6)


def _gapped_csv(path, n=60):
    t = np.arange(n) * 0.25
    df = pd.DataFrame({"time": t, "a": np.sin(t), "b": np.cos(0.5 * t) + 2})
    df.loc[[5, 6, 7, 30, 41], "a"] = np.nan
    df.loc[[12, 13], "b"] = np.nan
    df.to_csv(path, index=False)
    return df


def test_predict_through_cli_fills_every_gap(tmp_path):
    df = _gapped_csv(tmp_path / "s.csv")
    out = tmp_path / "imputed.csv"
    assert cli.main(["predict", "fim", "--input", str(tmp_path / "s.csv"), "--output", str(out),
                     "--model", "fim-imputation-test", "--pretrained", "none", "--window-points", "40"]) == 0
    got = pd.read_csv(out)
    assert list(got.columns) == ["time", "a", "a_std", "a_observed", "b", "b_std", "b_observed"]
    assert got[["a", "b", "a_std", "b_std"]].notna().all().all() and (got[["a_std", "b_std"]] > 0).all().all()
    assert (~got["a_observed"]).sum() == 5 and (~got["b_observed"]).sum() == 2
    np.testing.assert_allclose(got["time"], df["time"])
    png = (tmp_path / "imputed.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_predict_bad_input_names_file_column_row(tmp_path, capsys):
    # the CLI turns loader errors into one line naming file, column and row, exit 2
    (tmp_path / "bad.csv").write_text("time,a\n0,1\n2,2\n1,3\n")
    assert cli.main(["predict", "fim", "--input", str(tmp_path / "bad.csv"), "--output", str(tmp_path / "o.csv"),
                     "--model", "fim-imputation-test", "--pretrained", "none"]) == 2
    assert re.search(r"bad.csv, column 'time', row 4: times are not sorted", capsys.readouterr().err)


def test_predict_sparse_series_merges_windows_instead_of_failing(tmp_path):
    # a 45-row hole: with windows of 20 points, whole windows hold no observation; this failed until
    # issue 35 (GappedSeriesError "has no observed point"); now those rows get fewer, larger windows
    t = np.arange(100.0)
    a = np.sin(0.1 * t)
    a[30:75] = np.nan
    pd.DataFrame({"time": t, "a": a}).to_csv(tmp_path / "holes.csv", index=False)
    for extra in (["--window-points", "20"], []):  # given, and chosen from the observation density
        out = tmp_path / f"o{len(extra)}.csv"
        assert cli.main(["predict", "fim", "--input", str(tmp_path / "holes.csv"), "--output", str(out),
                         "--model", "fim-imputation-test", "--pretrained", "none", "--readout", "pinned", *extra]) == 0
        got = pd.read_csv(out)
        assert got["a"].notna().all()
        np.testing.assert_allclose(got["a"][~np.isnan(a)], a[~np.isnan(a)], atol=1e-6)


def test_finetune_on_a_users_series(tmp_path):
    _gapped_csv(tmp_path / "s.csv", n=80)
    args = ["finetune", "fim", "model.name=fim-imputation-test", "model.kwargs={}", "stages=[]", "arms=[random]",
            "adapt.mode=full", "data.kind=series", f"data.path={tmp_path / 's.csv'}", "data.window_points=32",
            "data.n_train=16", "train.max_steps=2", "train.batch_size=4", "train.progress=false", "train.lr=1e-3",
            "--runs-dir", str(tmp_path / "runs"), "--name", "ft"]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "runs" / "fim" / "ft" / "report.json").read_text())
    arm = report["arms"]["random"]
    assert report["task"] == "imputation" and arm["steps"] == 2 and np.isfinite(arm["val"]["mae"])
    gaps = arm["imputation"]["series_artificial_gaps"]
    for method in ("fim", "linear", "spline", "gp"):
        assert set(gaps[method]) == {"mae", "rmse", "mre", "r2"} and np.isfinite(gaps[method]["mae"])
    # forgetting: the retained capability (zero-shot imputation of ODE trajectories) before and after
    assert report["retained_capability"]["metric"] == "r2"
    assert set(report["retained_before"]["systems"]) == set(arm["retained"]["systems"]) == {
        "lorenz", "van_der_pol", "lotka_volterra"}
    assert np.isfinite(report["retained_before"]["r2"]) and np.isfinite(arm["retained"]["mae"])
    # the run folder itself serves as --model (its arm's saved model)
    out = tmp_path / "imputed.csv"
    assert cli.main(["predict", "fim", "--input", str(tmp_path / "s.csv"), "--output", str(out),
                     "--model", str(tmp_path / "runs" / "fim" / "ft"), "--window-points", "40"]) == 0
    assert pd.read_csv(out)[["a", "b"]].notna().all().all()


def test_holdout_per_sample_loss_matches_the_step():
    from domainfm import create_model
    from domainfm.finetune.fim import HoldoutRecipe

    torch.manual_seed(0)
    model = create_model("fim-imputation-test").eval()
    t = torch.linspace(0, 1, 24).expand(3, 24)
    values = torch.sin(6 * t).unsqueeze(-1)
    hidden = torch.zeros(3, 24, 1, dtype=torch.bool)
    hidden[:, 5:9] = True  # the same number hidden in every series: the means agree
    batch = (t, values, ~hidden, hidden)
    recipe = HoldoutRecipe(model, None)
    loss, _ = recipe.step(model, batch)
    per = recipe.per_sample_loss(model, batch)
    assert per.shape == (3,)
    torch.testing.assert_close(per.mean(), loss)


def test_predict_readout_option_and_a_saved_models_own(tmp_path):
    from domainfm import create_model, save_pretrained

    df = _gapped_csv(tmp_path / "s.csv")
    obs_a, obs_b = df["a"].notna().to_numpy(), df["b"].notna().to_numpy()
    torch.manual_seed(0)
    model = create_model("fim-imputation-test")
    folder = save_pretrained(model, tmp_path / "official-model", card=False)
    model.readout = "pinned"  # the same weights, saved with the pinned readout in their config
    model.domainfm_kwargs = {**model.domainfm_kwargs, "readout": "pinned"}
    pinned_folder = save_pretrained(model, tmp_path / "pinned-model", card=False)

    def predict(folder, name, *extra):
        assert cli.main(["predict", "fim", "--input", str(tmp_path / "s.csv"), "--model", str(folder),
                         "--window-points", "40", "--output", str(tmp_path / name), *extra]) == 0
        return pd.read_csv(tmp_path / name)

    official, pinned = predict(folder, "official.csv"), predict(folder, "pinned.csv", "--readout", "pinned")
    # pinned: the path passes through every observation (FIM-l, 2 windows here); the official path does not
    np.testing.assert_allclose(pinned["a"][obs_a], df["a"][obs_a], atol=1e-6)
    np.testing.assert_allclose(pinned["b"][obs_b], df["b"][obs_b], atol=1e-6)
    assert np.abs(official["a"][obs_a] - df["a"][obs_a]).max() > 1e-2
    np.testing.assert_allclose(pinned["a_std"], official["a_std"])  # only the path changes
    # a saved model with readout=pinned in its config is pinned without the option, and the option wins
    np.testing.assert_allclose(predict(pinned_folder, "own.csv")[["a", "b"]], pinned[["a", "b"]], rtol=1e-12)
    np.testing.assert_allclose(predict(pinned_folder, "back.csv", "--readout", "official")[["a", "b"]],
                               official[["a", "b"]], rtol=1e-12)
    with pytest.raises(SystemExit):
        cli.main(["predict", "fim", "--input", str(tmp_path / "s.csv"), "--model", str(folder), "--output",
                  str(tmp_path / "x.csv"), "--readout", "snapped"])
