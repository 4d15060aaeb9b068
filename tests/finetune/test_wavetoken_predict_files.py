"""``domainfm predict wavetoken`` on users' files: an item with no observation refused, long CSVs
read in chunks with the same forecasts, an empty CSV named."""
from __future__ import annotations


import pytest
import torch

from domainfm import cli


# --------------------------------------------------------------------------- predict wavetoken


def _series_csv(path, n_items=5, length=40, nan_item=None):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    frames = []
    for i in range(n_items):
        y = np.sin(np.arange(length) / (2 + i)) + 0.1 * rng.standard_normal(length)
        if nan_item == i:
            y[:] = np.nan
        frames.append(pd.DataFrame({"item_id": f"s{i}", "timestamp": pd.date_range("2020-01-01", periods=length, freq="D"),
                                    "target": y}))
    pd.concat(frames).to_csv(path, index=False)
    return path


def test_predict_refuses_an_item_with_no_observation(tmp_path, capsys):
    src = _series_csv(tmp_path / "in.csv", nan_item=3)
    out = tmp_path / "out.csv"
    assert cli.main(["predict", "wavetoken", "--input", str(src), "--prediction-length", "4", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "item 's3'" in err and "no observed value" in err and str(src) in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out.csv.tmp-*"))


def test_predict_reads_and_writes_in_chunks_with_the_same_forecasts(tmp_path):
    import pandas as pd

    src = _series_csv(tmp_path / "in.csv", n_items=70)  # two forecast batches of 64
    common = ["predict", "wavetoken", "--input", str(src), "--prediction-length", "4", "--num-samples", "4",
              "--quantiles", "0.1,0.5,0.9"]
    torch.manual_seed(0)  # the same random-init model each time
    assert cli.main([*common, "--output", str(tmp_path / "whole.csv"), "--chunk-rows", "1000000"]) == 0
    torch.manual_seed(0)
    assert cli.main([*common, "--output", str(tmp_path / "chunked.csv"), "--chunk-rows", "37"]) == 0  # cuts items
    whole = pd.read_csv(tmp_path / "whole.csv")
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "chunked.csv"), whole)
    assert len(whole) == 70 * 4 and list(whole.item_id.unique()) == [f"s{i}" for i in range(70)]
    assert list(whole.columns) == ["item_id", "timestamp", "mean", "0.1", "0.5", "0.9"]
    # items not in contiguous rows are still read (whole-file path) with the same forecasts per item
    shuffled = pd.read_csv(src).sample(frac=1.0, random_state=0)
    shuffled.to_csv(tmp_path / "shuffled.csv", index=False)
    assert cli.main([*common[:3], str(tmp_path / "shuffled.csv"), *common[4:], "--output", str(tmp_path / "sh.csv"),
                     "--chunk-rows", "37"]) == 0
    sh = pd.read_csv(tmp_path / "sh.csv")
    assert sorted(sh.item_id.unique()) == sorted(whole.item_id.unique()) and len(sh) == len(whole)


def test_empty_csv_is_an_error_naming_the_file(tmp_path):
    from domainfm.data_loaders.timeseries import TimeSeriesError, read_long

    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TimeSeriesError, match="empty.csv"):
        read_long(tmp_path / "empty.csv")
