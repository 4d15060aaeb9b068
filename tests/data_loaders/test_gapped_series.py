"""Gapped series: wide/long CSV, Parquet and DataFrames in; NaN = missing; clear errors naming
file, column and row; the shipped CO2 sample."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from domainfm.data_loaders.gapped_series import GappedSeriesError, check_windows, load_co2, read_series, to_dataframe


def test_wide_csv_with_timestamps_and_gaps(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("date,x,y\n2020-01-01,1.0,\n2020-01-02,,5\n2020-01-04,3.5,6\n")
    (s,) = read_series(path)
    assert s.channels == ["x", "y"]
    np.testing.assert_allclose(s.times, [0.0, 1.0, 3.0])  # days since the first stamp, irregular
    assert s.observed.tolist() == [[True, False], [False, True], [True, True]]
    t, v, o = s.tensors()
    assert v.shape == (3, 2) and bool(o[0, 0]) and not bool(o[0, 1]) and np.isnan(float(v[1, 0]))
    assert str(s.timestamps()[2].date()) == "2020-01-04"
    df = to_dataframe(s, np.ones((3, 2)), np.zeros((3, 2)))
    assert list(df.columns) == ["date", "x", "x_std", "x_observed", "y", "y_std", "y_observed"]


def test_long_layout_and_parquet_and_dataframe(tmp_path):
    long = pd.DataFrame({"item_id": ["a"] * 4 + ["b"] * 2, "time": [0.5, 0.0, 0.0, 2.0, 1.0, 3.0],
                         "channel": ["u", "u", "v", "v", "u", "u"], "value": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    a, b = read_series(long)
    np.testing.assert_allclose(a.times, [0.0, 0.5, 2.0])
    np.testing.assert_allclose(a.values, [[2.0, 3.0], [1.0, np.nan], [np.nan, 4.0]])
    assert b.item_id == "b" and b.values.shape == (2, 1)
    path = tmp_path / "w.parquet"
    pd.DataFrame({"t": [0.0, 1.0, 1.5], "z": [1.0, np.nan, 2.0]}).to_parquet(path)
    (s,) = read_series(path)
    assert s.observed[:, 0].tolist() == [True, False, True]


@pytest.mark.parametrize("text, match", [
    ("time,x\n0,1\n2,2\n1,3\n", r"s.csv, column 'time', row 4: times are not sorted"),
    ("time,x\n0,1\n1,2\n1,3\n", r"s.csv, column 'time', row 4: duplicate time 1"),
    ("time,x\n0,1\n,2\n", r"s.csv, column 'time', row 3: time nan is not finite"),
    ("time,x\n0,1\ninf,2\n", r"row 3: time inf is not finite"),
    ("time,x\n0,\n1,\n", r"s.csv, column 'x': no observed value"),
    ("time,x\n0,1\n1,abc\n", r"s.csv, column 'x', row 3: 'abc' is not a number"),
    # one point defines no time or value range (FIM scales by both): refused, not imputed as inf
    ("time,x,y\n0,1,\n1,2,5\n2,,\n", r"s.csv, column 'y': only one observed value \(row 3\) in channel 'y'; .*at least two"),
    ("", r"s.csv: empty file"),
    ("time,x\n", r"s.csv: no data rows"),
])
def test_bad_inputs_name_file_column_row(tmp_path, text, match):
    path = tmp_path / "s.csv"
    path.write_text(text)
    with pytest.raises(GappedSeriesError, match=match):
        read_series(path)


def test_window_without_observation_is_named(tmp_path):
    x = np.arange(40.0)
    x[10:21] = np.nan  # windows (4, overlap 0.1): rows 0-10, 10-20, 20-30, 29-39
    (s,) = read_series(pd.DataFrame({"time": np.arange(40.0), "x": x}), source="mem")
    check_windows(s, 2)
    with pytest.raises(GappedSeriesError, match=r"mem, column 'x': window 1 of 4 \(rows 10..20"):
        check_windows(s, 4, overlap=0.1)


def test_window_with_one_observation_is_named():
    x = np.arange(40.0)
    x[10:21] = np.nan
    x[15] = 1.0  # window 1 (rows 10..20) sees one point: its time range is 0, FIM's scaling blows up
    (s,) = read_series(pd.DataFrame({"time": np.arange(40.0), "x": x}), source="mem")
    with pytest.raises(GappedSeriesError, match=r"mem, column 'x': window 1 of 4 \(rows 10..20.*only one observed"):
        check_windows(s, 4, overlap=0.1)


def test_timestamps_keep_their_offset_and_text():
    stamps = ["2024-03-31 01:00:00+01:00", "2024-03-31 03:00:00+02:00", "2024-03-31 04:00:00+02:00"]
    (s,) = read_series(pd.DataFrame({"time": stamps, "x": [1.0, np.nan, 3.0]}), source="mem")
    np.testing.assert_allclose(s.times * 24, [0.0, 1.0, 2.0], atol=1e-9)  # one hour apart across the change
    assert to_dataframe(s, np.zeros((3, 1)), np.ones((3, 1)))["time"].tolist() == stamps
    (one,) = read_series(pd.DataFrame({"time": stamps[1:], "x": [1.0, 3.0]}), source="mem")
    back = one.timestamps()[1]  # via float days: exact to well below a microsecond, offset kept for plots
    assert back.utcoffset() == pd.Timedelta(hours=2) and abs(back - pd.Timestamp(stamps[2])) < pd.Timedelta("1us")
    # long layout: the rows' own text too
    long = pd.DataFrame({"time": [stamps[2], stamps[0], stamps[1], stamps[0]], "channel": ["u", "u", "v", "v"],
                         "value": [1.0, 2.0, 3.0, 4.0]})
    (s,) = read_series(long, source="mem")
    assert to_dataframe(s, np.zeros((3, 2)), np.ones((3, 2)))["time"].tolist() == stamps


def test_shipped_co2_has_the_59_real_gaps():
    s = load_co2()
    assert s.values.shape == (2284, 1) and int((~s.observed).sum()) == 59
    np.testing.assert_allclose(np.diff(s.times), 7.0)
    assert 310 < np.nanmin(s.values) and np.nanmax(s.values) < 380


def test_spline_baseline_holds_the_end_values_beyond_the_observations():
    # a cubic observed only on [0.25, 0.75]: a natural spline extrapolates its end slopes (here ~0.19 per unit
    # at t = 0 and 1); the baseline holds the first/last observed value constant outside them instead
    from scipy.interpolate import CubicSpline

    from domainfm.data_loaders.gapped_series import interpolate_baseline

    t = np.linspace(0.0, 1.0, 41)
    x = (40 * (t - 0.5) ** 3)[:, None]
    obs = ((t >= 0.25) & (t <= 0.75))[:, None]
    out = interpolate_baseline(t, x, obs, "spline")[:, 0]
    inside = obs[:, 0]
    reference = CubicSpline(t[inside], x[inside, 0], bc_type="natural")(t[inside])
    np.testing.assert_allclose(out[inside], reference, atol=1e-12)
    np.testing.assert_allclose(out[t < 0.25], x[t == 0.25, 0][0], atol=1e-12)
    np.testing.assert_allclose(out[t > 0.75], x[t == 0.75, 0][0], atol=1e-12)


def test_gp_baseline_matches_sklearn_and_recovers_a_smooth_gap():
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, WhiteKernel

    from domainfm.data_loaders.gapped_series import interpolate_baseline

    t = np.linspace(0.0, 1.0, 60)
    x = np.stack([np.sin(4 * t), 100 + 30 * np.cos(3 * t)], axis=1)
    obs = np.ones_like(x, dtype=bool)
    obs[20:32, 0] = False
    obs[40:50, 1] = False
    out = interpolate_baseline(t, x, obs, "gp")
    for j in range(2):
        gp = GaussianProcessRegressor(RBF(length_scale=0.1, length_scale_bounds=(1e-3, 1e3))
                                      + WhiteKernel(1e-2, (1e-8, 1e1)), normalize_y=True, n_restarts_optimizer=0,
                                      random_state=0)
        gp.fit(t[obs[:, j], None], x[obs[:, j], j])
        np.testing.assert_allclose(out[:, j], gp.predict(t[:, None]), rtol=1e-6, atol=1e-6)
    # smooth series: the GP fills the gap far better than a straight line across it
    lin = interpolate_baseline(t, x, obs, "linear")
    hidden = ~obs
    assert np.abs(out - x)[hidden].mean() < 0.2 * np.abs(lin - x)[hidden].mean()


def test_baseline_kind_is_checked():
    from domainfm.data_loaders.gapped_series import interpolate_baseline

    t = np.linspace(0.0, 1.0, 8)
    with pytest.raises(ValueError, match="kind='cubic'.*linear.*spline.*gp"):
        interpolate_baseline(t, t[:, None], np.ones((8, 1), bool), "cubic")


def test_gp_baseline_on_a_long_series_fits_its_kernel_on_a_subsample():
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, WhiteKernel

    from domainfm.data_loaders import gapped_series as gs

    t = np.linspace(0.0, 1.0, 1000)
    x = np.sin(12 * t)[:, None]
    obs = np.ones_like(x, dtype=bool)
    obs[500:540] = False
    out = gs.interpolate_baseline(t, x, obs, "gp")[:, 0]
    to, xo = t[obs[:, 0]], x[obs[:, 0], 0]
    sub = np.unique(np.linspace(0, len(to) - 1, gs.GP_FIT_POINTS).round().astype(int))
    fitted = GaussianProcessRegressor(RBF(0.1, (1e-3, 1e3)) + WhiteKernel(1e-2, (1e-8, 1e1)), normalize_y=True,
                                      random_state=0).fit(to[sub, None], xo[sub]).kernel_
    want = GaussianProcessRegressor(fitted, normalize_y=True, optimizer=None).fit(to[:, None], xo).predict(t[:, None])
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert np.abs(out - x[:, 0])[~obs[:, 0]].max() < 1e-2  # a smooth 40-point gap, filled
