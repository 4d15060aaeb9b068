"""Numeric options of every predict/embed command are range-checked by argparse: 0, negatives and
out-of-range fractions are one-line exit-2 errors naming the option, never a default in disguise
(ExPLoRA --stride 0 used to mean the tile size) or a ZeroDivisionError (FIM --overlap 1.0)."""
from __future__ import annotations

import pytest

from domainfm import cli

CASES = [
    ("predict", "cbramod", "--batch-size", "0", "must be >= 1"),
    ("predict", "cbramod", "--stride-s", "0", "must be a finite number > 0"),
    ("predict", "explora", "--stride", "0", "must be >= 1"),
    ("predict", "explora", "--tile-size", "-4", "must be >= 1"),
    ("predict", "explora", "--batch-size", "0", "must be >= 1"),
    ("predict", "fim", "--window-points", "0", "must be >= 1"),
    ("predict", "fim", "--overlap", "1.0", "must lie in [0, 1)"),
    ("predict", "fim", "--overlap", "-0.1", "must lie in [0, 1)"),
    ("predict", "git", "--batch-size", "0", "must be >= 1"),
    ("embed", "stofm", "--cells-per-subslice", "0", "must be >= 1"),
    ("embed", "stofm", "--batch-size", "0", "must be >= 1"),
    ("embed", "wavetoken", "--batch-size", "0", "must be >= 1"),
    ("predict", "wavetoken", "--num-samples", "0", "must be >= 1"),
    ("predict", "wavetoken", "--prediction-length", "0", "must be >= 1"),  # used to mean the default, 16
    ("predict", "wavetoken", "--quantiles", "abc", "'abc' is not a number"),
    ("predict", "wavetoken", "--quantiles", "1.5,-0.2", "strictly between 0 and 1"),
    ("predict", "wavetoken", "--quantiles", "0.1,-0.2", "strictly between 0 and 1"),
    ("predict", "wearables", "--min-hours", "0", "must be >= 1"),
    ("predict", "fim", "--window-points", "abc", "'abc' is not an integer"),
]


@pytest.mark.parametrize("command, family, option, value, expected", CASES)
def test_out_of_range_numeric_options_are_refused_by_name(tmp_path, capsys, command, family, option, value, expected):
    argv = [command, family, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), option, value]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()
