"""The apply layer (domainfm.experiment.apply), family-independent: options generated from a
dataclass, outputs checked before anything runs and written by type together, batching equal to
the unbatched computation, the family of a saved model found from its folder."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import create_model, save_pretrained
from domainfm.errors import InputError
from domainfm.experiment import apply


@dataclass
class _Options:
    stride_s: float | None = apply.option(None, "window step")
    channels: list[str] | None = apply.option(None, "channel names")
    fast: bool = apply.option(False, "a switch")
    plot: str | None = apply.option(None, "PNG", output=(".png",), default_from=".png", commands=("predict",))


def _applier(run=lambda *a: apply.Output(pd.DataFrame({"x": [1.0]}))):
    return apply.Applier(family="toy", input="a toy file", read=lambda src, settings, opts: src, options=_Options,
                         predict=apply.Command(run, apply.TABLE), embed=apply.Command(run, apply.ARRAYS))


def test_options_become_flags_with_types_and_per_command_offers():
    parser = apply.build_parser("predict", _applier())
    args = parser.parse_args(["--model", "m", "--input", "i", "--output", "o.csv", "--stride-s", "2.5",
                              "--channels", "C3, C4", "--fast", "--plot", "p.png"])
    assert (args.stride_s, args.channels, args.fast, args.plot) == (2.5, ["C3", "C4"], True, "p.png")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--input", "i", "--output", "o.csv", "--stride-s", "0"])
    embed = apply.build_parser("embed", _applier())
    assert "--plot" not in embed.format_help() and "--stride-s" in embed.format_help()


def test_outputs_are_checked_before_anything_runs(tmp_path):
    (tmp_path / "afile").write_text("x")
    cases = [({"--output": (tmp_path / "o.txt", apply.TABLE)}, "expected a .csv or .parquet or .tsv file"),
             ({"--output": (tmp_path / "afile" / "o.csv", apply.TABLE)}, "is a file, not a folder"),
             ({"--output": (tmp_path, ())}, "is a folder"),
             ({"--output": (tmp_path / "o.csv", ()), "--plot": (tmp_path / "o.csv", ())}, "are the same file")]
    for paths, message in cases:
        with pytest.raises(InputError, match=message):
            apply.check_outputs(paths)


def test_batched_equals_the_unbatched_computation_and_keeps_tuples():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    x = torch.randn(10, 5)
    run = apply.Runtime(precision="32-true", batch_size=3)
    torch.testing.assert_close(run.batched(lin, x), lin(x).detach())
    first, second = run.batched(lambda a: (lin(a), a.sum(-1)), x)
    torch.testing.assert_close(second, x.sum(-1))
    with pytest.raises(InputError, match="no items"):
        run.batched(lin, x[:0])


def test_outputs_are_written_together_and_by_type(tmp_path, capsys):
    import matplotlib.figure

    def run(data, model, settings, options, runtime):
        fig = matplotlib.figure.Figure()
        fig.add_subplot().plot([0, 1])
        return apply.Output(pd.DataFrame({"x": [1.0, 2.0]}), extras={"plot": fig}, summary="2 rows")

    torch.manual_seed(0)
    folder = save_pretrained(create_model("cbramod-test"), tmp_path / "m")
    (tmp_path / "in.txt").write_text("x")
    out = tmp_path / "o.parquet"
    assert apply.main("predict", _applier(run), ["--model", str(folder), "--input", str(tmp_path / "in.txt"),
                                                  "--output", str(out)]) == 0
    assert pd.read_parquet(out)["x"].tolist() == [1.0, 2.0]
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # default_from: OUTPUT with .png
    assert "2 rows" in capsys.readouterr().out
    arrays = tmp_path / "a.npz"
    apply.write({"x": np.arange(3)}, arrays)
    assert np.load(arrays)["x"].tolist() == [0, 1, 2]


def test_family_of_a_saved_folder_a_name_and_a_module(tmp_path):
    torch.manual_seed(0)
    model = create_model("fim-imputation-test")
    folder = save_pretrained(model, tmp_path / "fim")
    assert apply.family_of_model(folder) == apply.family_of_model("fim-imputation-test") == "fim"
    assert apply.family_of_model(model) == "fim"


def test_pretrained_none_means_random_init():
    torch.manual_seed(0)
    module, ref = apply.resolve("cbramod-test", pretrained="none")
    torch.manual_seed(0)
    fresh = create_model("cbramod-test")
    for a, b in zip(module.state_dict().values(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert ref.model_dir is None and ref.run is None


def test_the_run_of_a_model_folder_and_of_an_arm(tmp_path):
    from domainfm.experiment import ArmContext, RunFolder

    run = tmp_path / "r"
    (run / "pretrained" / "seed1" / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("x: 1\n")
    (run / "report.json").write_text("{}")
    assert RunFolder.of(run / "pretrained" / "seed1" / "model").path == run
    assert RunFolder.of(run / "pretrained").path == run and RunFolder.of(tmp_path) is None
    ctx = ArmContext(None, "random:lora", 0, None, None, run / "random-lora" / "seed2", None, "lora")
    assert ctx.run_root == run
    assert ArmContext(None, "pretrained", 0, None, None, run / "pretrained", None, "full").run_root == run


def test_a_name_without_weights_is_seeded_and_leaves_the_callers_rng(capsys):
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first, _ = apply.resolve("cbramod-test")
    assert torch.equal(torch.random.get_rng_state(), state)
    second, _ = apply.resolve("cbramod-test")
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    assert "RANDOM initialisation, seed 0" in capsys.readouterr().err
