"""``domainfm predict fim`` on awkward input, through the CLI: a channel with one observation,
timestamps with a UTC offset (one, or several across a daylight-saving change), empty and
header-only files, and outputs committed together (an unwritable ``--plot`` leaves no CSV)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from domainfm import cli

MODEL = ["--model", "fim-imputation-test", "--pretrained", "none"]


def _predict(inp, out, *extra) -> int:
    try:
        return cli.main(["predict", "fim", "--input", str(inp), "--output", str(out), *MODEL, *extra])
    except SystemExit as exc:  # argparse-style exits count the same
        return exc.code


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_channel_with_one_observation_is_refused_naming_file_and_column(tmp_path, capsys):
    # one point defines neither a time range nor a value range, which FIM scales every channel by;
    # before: exit 0, std inf, the observed 1.0 written back as about -1e2..-1e4
    path = tmp_path / "single.csv"
    path.write_text("time,a,b\n0,1.0,0\n1,,1\n2,,2\n3,,3\n")
    out = tmp_path / "o.csv"
    assert _predict(path, out) == 2
    err = _one_line_error(capsys)
    assert "single.csv" in err and "column 'a'" in err and "only one observed value" in err
    assert "at least two" in err
    assert not out.exists()


def _stamps(hours, offset):
    return [f"2024-01-01 {h:02d}:00:00{offset}" for h in hours]


def test_timezone_aware_stamps_are_written_back_with_their_offset(tmp_path):
    stamps = _stamps(range(6), "+01:00")
    a = [1.0, np.nan, 3.0, 4.0, np.nan, 6.0]
    pd.DataFrame({"time": stamps, "a": a}).to_csv(tmp_path / "tz.csv", index=False)
    out = tmp_path / "o.csv"
    assert _predict(tmp_path / "tz.csv", out) == 0
    got = pd.read_csv(out)
    assert len(got) == len(stamps)  # rows 1:1 with the input's rows
    assert got["time"].tolist() == stamps  # the same text, offset included
    assert all(s.endswith("+01:00") for s in got["time"])
    parsed = pd.to_datetime(got["time"])
    assert (parsed == pd.to_datetime(pd.Series(stamps))).all()  # the same instants
    assert got["a_observed"].tolist() == [not np.isnan(v) for v in a]
    assert np.isfinite(got["a"]).all()


def test_mixed_utc_offsets_across_dst_keep_each_rows_stamp(tmp_path):
    # Europe/Berlin, 31 March 2024: 02:00+01:00 becomes 03:00+02:00; the rows are one hour apart.
    # before: AttributeError (pandas parsed the column as objects)
    stamps = ["2024-03-31 00:00:00+01:00", "2024-03-31 01:00:00+01:00", "2024-03-31 03:00:00+02:00",
              "2024-03-31 04:00:00+02:00", "2024-03-31 05:00:00+02:00"]
    path = tmp_path / "dst.csv"
    pd.DataFrame({"time": stamps, "a": [1.0, 2.0, np.nan, 4.0, 5.0]}).to_csv(path, index=False)
    from domainfm.data_loaders.gapped_series import read_series

    (series,) = read_series(path)
    np.testing.assert_allclose(series.times * 24, [0, 1, 2, 3, 4], atol=1e-9)  # hours, on one clock
    out = tmp_path / "o.csv"
    assert _predict(path, out) == 0
    got = pd.read_csv(out)
    assert got["time"].tolist() == stamps
    assert (pd.to_datetime(got["time"], utc=True) == pd.to_datetime(pd.Series(stamps), utc=True)).all()
    assert got["a_observed"].tolist() == [True, True, False, True, True]


def test_mixing_stamps_with_and_without_offset_is_refused(tmp_path, capsys):
    # a stamp without offset has no instant next to ones that have one: refuse, name the row
    path = tmp_path / "naive.csv"
    path.write_text("time,a\n2024-01-01 00:00:00+01:00,1\n2024-01-01 01:00:00+01:00,2\n"
                    "2024-01-01 02:00:00,3\n")
    assert _predict(path, tmp_path / "o.csv") == 2
    err = _one_line_error(capsys)
    assert "naive.csv, column 'time', row 4" in err and "UTC offset" in err
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize("text, expected", [
    ("", "empty file"),
    ("time,a\n", "no data rows"),
])
def test_empty_and_header_only_csv_are_one_line_errors(tmp_path, capsys, text, expected):
    # before: the empty file's message did not name it; the header-only one gave an IndexError traceback
    path = tmp_path / "in.csv"
    path.write_text(text)
    assert _predict(path, tmp_path / "o.csv") == 2
    err = _one_line_error(capsys)
    assert str(path) in err and expected in err
    assert not (tmp_path / "o.csv").exists()


def _series_csv(path):
    t = np.arange(30) * 0.5
    a = np.sin(t)
    a[[4, 5, 17]] = np.nan
    pd.DataFrame({"time": t, "a": a}).to_csv(path, index=False)
    return path


def test_plot_under_a_regular_file_leaves_no_csv(tmp_path, capsys):
    # before: the CSV was written first and stayed behind when the plot failed
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "o.csv"
    assert _predict(_series_csv(tmp_path / "s.csv"), out, "--plot", str(tmp_path / "afile" / "p.png")) == 2
    err = _one_line_error(capsys)
    assert "--plot" in err and "afile" in err
    assert not out.exists()
    assert not list(tmp_path.glob(".*tmp-*"))


def test_failing_plot_write_commits_neither_output(tmp_path, capsys, monkeypatch):
    # the write itself fails (a full disk, say) after the CSV is ready: neither file appears
    from matplotlib.figure import Figure

    def refuse(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", refuse)
    out, plot = tmp_path / "o.csv", tmp_path / "p.png"
    assert _predict(_series_csv(tmp_path / "s.csv"), out, "--plot", str(plot)) == 2
    _one_line_error(capsys)
    assert not out.exists() and not plot.exists()
    assert not list(tmp_path.glob(".*tmp-*"))


def test_output_and_plot_on_the_same_path_is_refused(tmp_path, capsys):
    # the default plot is OUTPUT with .png: an output named .png would be overwritten by its own plot.
    # The table and the plot take disjoint extensions, so the shared layer refuses either collision
    # as the wrong kind of file, naming the option, before anything is computed or written
    series = _series_csv(tmp_path / "s.csv")
    out = tmp_path / "o.png"
    assert _predict(series, out) == 2
    err = _one_line_error(capsys)
    assert "--output" in err and "o.png" in err and ".csv" in err
    assert not out.exists()
    out = tmp_path / "o.csv"
    assert _predict(series, out, "--plot", str(out)) == 2
    err = _one_line_error(capsys)
    assert "--plot" in err and "o.csv" in err and ".png" in err
    assert not out.exists()
