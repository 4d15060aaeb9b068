"""Time series readers, splits and training windows."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm.data_loaders import timeseries as ts


def _long_frame():
    a = pd.DataFrame({"item_id": "a", "timestamp": pd.date_range("2020-01-01", periods=6, freq="MS"),
                      "target": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]})
    b = pd.DataFrame({"item_id": "b", "timestamp": pd.date_range("2021-01-01", periods=5, freq="D"),
                      "target": [10.0, None, 12.0, 13.0, 14.0]})
    b = b.drop(index=3)  # a missing row: becomes NaN on the daily grid
    return pd.concat([a, b.iloc[::-1]], ignore_index=True)  # unsorted rows are fine


def test_read_long_csv_regularises_and_infers_frequency(tmp_path):
    path = tmp_path / "series.csv"
    _long_frame().to_csv(path, index=False)
    series = ts.read_long(path)
    assert [s["item_id"] for s in series] == ["a", "b"]
    assert series[0]["freq"] == "MS" and series[1]["freq"] == "D"
    np.testing.assert_array_equal(series[0]["target"], [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(series[1]["target"], [10, np.nan, 12, np.nan, 14])
    assert series[1]["start"] == pd.Timestamp("2021-01-01")
    assert list(ts.future_index(series[0], 2)) == [pd.Timestamp("2020-07-01"), pd.Timestamp("2020-08-01")]


def test_infer_freq_with_gaps_and_errors():
    months = pd.DatetimeIndex(["2020-01-01", "2020-02-01", "2020-05-01", "2020-06-01"])
    assert ts.infer_freq(months) == "MS"
    weeks = pd.DatetimeIndex(["2020-01-04", "2020-01-11", "2020-02-01"])
    assert ts.infer_freq(weeks) == "W-SAT"
    with pytest.raises(ValueError, match="no regular frequency"):
        ts.infer_freq(pd.DatetimeIndex(["2020-01-01 00:00:00", "2020-01-01 00:00:00.5", "2020-01-01 00:00:01.7"]))
    with pytest.raises(ValueError, match="1 timestamp"):
        ts.infer_freq(pd.DatetimeIndex(["2020-01-01"]))


def test_reader_errors_name_the_problem(tmp_path):
    df = _long_frame()
    with pytest.raises(ValueError, match="missing column.*'value'"):
        ts.from_dataframe(df, target="value")
    dup = pd.concat([df, df.iloc[:1]])
    with pytest.raises(ValueError, match="item 'a' has more than one row at timestamp 2020-01-01"):
        ts.from_dataframe(dup)
    bad = df.assign(target=df["target"].astype(object))
    bad.loc[2, "target"] = "oops"
    with pytest.raises(ValueError, match="non-numeric value 'oops'"):
        ts.from_dataframe(bad)
    with pytest.raises(ValueError, match="not on the 'MS' grid"):
        ts.from_dataframe(df[df.item_id == "a"].assign(timestamp=lambda d: d.timestamp.where(d.index != 2, pd.Timestamp("2020-03-15"))), freq="MS")
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(ValueError, match="unsupported file type"):
        ts.read_long(tmp_path / "x.xlsx")
    with pytest.raises(FileNotFoundError):
        ts.read_long(tmp_path / "none.csv")


def test_from_gluonts_dicts():
    entries = [{"start": pd.Period("2020-01", freq="M"), "target": [1, 2, 3], "item_id": "x"},
               {"start": "2020-01-01", "target": np.arange(4.0), "freq": "D"}]
    series = ts.from_gluonts(entries)
    assert series[0]["freq"] == "M" and series[0]["start"] == pd.Timestamp("2020-01-01")
    assert series[1]["item_id"] == "1" and series[1]["freq"] == "D"
    with pytest.raises(ValueError, match="no frequency"):
        ts.from_gluonts([{"start": "2020-01-01", "target": [1.0]}])
    with pytest.raises(ValueError, match="1-D"):
        ts.from_gluonts([{"start": "2020-01-01", "target": [[1.0]], "freq": "D"}])


def test_split_by_time_windows():
    series = [{"item_id": "a", "target": np.arange(20.0)}]
    train, test = ts.split_by_time(series, 4, n_windows=2)
    np.testing.assert_array_equal(train[0]["target"], np.arange(12.0))
    assert [t["window"] for t in test] == [0, 1]
    np.testing.assert_array_equal(test[0]["future"], [12, 13, 14, 15])
    np.testing.assert_array_equal(test[1]["context"], np.arange(16.0))
    np.testing.assert_array_equal(test[1]["future"], [16, 17, 18, 19])
    with pytest.raises(ValueError, match="length 20 leaves fewer than 1"):
        ts.split_by_time(series, 10, n_windows=2)


def test_forecast_windows_shapes_padding_and_missing_injection():
    np.random.seed(0)
    series = [np.arange(30.0), np.arange(100.0, 105.0)]  # the second is too short and skipped
    data = ts.ForecastWindows(series, context_length=40, prediction_length=4, num_windows=50, min_past=6)
    assert data.usable == [0]
    for i in range(20):
        context, future = data[i]
        assert context.shape == (40,) and future.shape == (4,)
        last = int(future[0].item())  # values are their own indices: the context ends just before
        observed = context[~torch.isnan(context)]
        assert observed[-1].item() == last - 1 and len(observed) == last >= 6
        assert torch.equal(future, torch.arange(last, last + 4, dtype=torch.float32))
    dropped = ts.ForecastWindows([np.arange(500.0)], 200, 8, missing_prob=0.9)
    frac = np.mean([torch.isnan(dropped[i][0]).float().mean().item() for i in range(200)])
    assert 0.3 < frac < 0.6  # E[U(0, 0.9)] = 0.45 (the windows here are full length)
    with pytest.raises(ValueError, match="long enough"):
        ts.ForecastWindows(series, 40, 40)


def test_shipped_sample_series():
    series = ts.load_sample()
    assert len(series) == 14
    datasets = {s["dataset"] for s in series}
    assert datasets == {"co2_monthly", "elnino_monthly", "elec_equip_monthly", "macro_quarterly", "sunspots_yearly",
                        "nile_yearly"}
    co2 = next(s for s in series if s["item_id"] == "co2_mauna_loa")
    assert co2["freq"] == "MS" and len(co2["target"]) == 526 and np.isnan(co2["target"]).sum() == 5
    assert 310 < np.nanmin(co2["target"]) < 320 and np.nanmax(co2["target"]) > 370  # 1958-2001
    with pytest.raises(ValueError, match="unknown sample"):
        ts.load_sample("nope")


def test_seeded_forecast_windows_are_fixed_per_index_and_leave_the_global_generator_alone():
    series = [np.arange(50, dtype=np.float32) + 100 * i for i in range(3)]
    ds = ts.ForecastWindows(series, 16, 4, num_windows=20, min_past=4, missing_prob=0.5, seed=7)
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    first = [ds[i] for i in range(20)]
    assert np.array_equal(np.random.get_state()[1], before)  # the global generator was not used
    for i in (0, 5, 19):  # the same window at every read, whatever was read before
        again = ds[i]
        assert torch.equal(torch.nan_to_num(again[0], -1), torch.nan_to_num(first[i][0], -1))
        assert torch.equal(again[1], first[i][1])
    # windows differ between indices and between seeds; each future continues its context
    assert len({tuple(f[1].tolist()) for f in first}) > 10
    other = ts.ForecastWindows(series, 16, 4, num_windows=20, min_past=4, missing_prob=0.5, seed=8)
    assert any(not torch.equal(other[i][1], first[i][1]) for i in range(20))
    for context, future in first:
        assert torch.all(future[1:] - future[:-1] == 1)
        last = context[~torch.isnan(context)]
        assert len(last) == 0 or last.max() < future[0]
    assert any(torch.isnan(c[-5:]).any() for c, _ in first)  # missing values injected
    with pytest.raises(IndexError):
        ds[20]
    # unseeded windows still come from the global generator (the engine seeds and restores it)
    free = ts.ForecastWindows(series, 16, 4, num_windows=20, min_past=4)
    np.random.seed(3)
    a = free[0]
    np.random.seed(3)
    assert torch.equal(free[0][1], a[1]) and not np.array_equal(np.random.get_state()[1], before)


def test_statsmodels_corpus_keeps_each_series_longest_finite_stretch():
    import statsmodels.api as sm

    from domainfm.data_loaders.timeseries import STATSMODELS_CORPUS, TimeSeriesError, statsmodels_corpus

    corpus = statsmodels_corpus(sorted(STATSMODELS_CORPUS))
    by_id = {s["item_id"]: s["target"] for s in corpus}
    assert len(corpus) == 198 + 5 + 2  # 21 countries have fewer than 16 finite fertility years
    frame = sm.datasets.fertility.load_pandas().data
    aruba = frame.loc[frame["Country Code"] == "ABW", [str(y) for y in range(1960, 2014)]].to_numpy(float)[0]
    finite = aruba[np.isfinite(aruba)]
    np.testing.assert_allclose(by_id["fertility/ABW"], finite[: len(by_id["fertility/ABW"])], rtol=1e-6)
    assert all(np.isfinite(s).all() and len(s) >= 16 for s in by_id.values())
    danish = sm.datasets.danish_data.load_pandas().data
    np.testing.assert_allclose(by_id["danish_data/lrm"], danish["lrm"].to_numpy(), rtol=1e-6)
    assert "interest_inflation/Dp" in by_id and "interest_inflation/year" not in by_id
    with pytest.raises(TimeSeriesError, match="co2.*expected one of"):
        statsmodels_corpus(["co2"])  # in the shipped evaluation sample: never part of the corpus
