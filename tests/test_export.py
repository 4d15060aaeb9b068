"""``domainfm export`` / :func:`domainfm.export.export`: the files run outside the model's code
(onnxruntime, ``torch.export.load``) and reproduce the model's outputs; bad options are one line.

Outputs are compared with |file - model| <= 1e-4 + 1e-4 * |model| (float32 kernels of two
runtimes differ in summation order; a random CBraMod head gives logits near 70, whose float32
spacing alone is 8e-6)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn

import domainfm
from domainfm import cli, zoo
from domainfm import export as export_module
from domainfm.export import ExportError, export

TOL = dict(rtol=1e-4, atol=1e-4)


def _run_onnx(path: Path, inputs: dict[str, torch.Tensor]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(inputs)
    return session.run(None, {name: x.numpy() for name, x in inputs.items()})


def _model_outputs(model: nn.Module, inputs) -> list[np.ndarray]:
    """The model's own outputs, flattened as an exported file returns them (a dict's values in
    order, None left out)."""
    with torch.no_grad():
        out = model(*inputs)
    values = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, tuple) else [out]
    return [v.numpy() for v in values if v is not None]


def _bigger_batch(inputs) -> tuple:
    """The example with its first item appended: a batch of 3, not the 2 the file was traced with."""
    return tuple(torch.cat([x, x[:1]]) for x in inputs)


#: saved test-sized models of three families -> the names of their inputs in the ONNX file
ONNX_MODELS = {
    "cbramod-test": ["x"],
    "explora-test": ["x"],
    "fim-imputation-test": ["times", "values", "observed", "eval_times"],  # the TorchScript fallback
}


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_cli_exports_a_saved_model_to_onnx_that_onnxruntime_runs_like_torch(name, tmp_path, capsys):
    torch.manual_seed(0)
    domainfm.save_pretrained(domainfm.create_model(name), tmp_path / "model")
    out = tmp_path / "exported" / f"{name}.onnx"

    assert cli.main(["export", str(tmp_path / "model"), "--format", "onnx", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    onnx.checker.check_model(str(out), full_check=True)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # one file, no temporary left

    model = domainfm.create_model(tmp_path / "model").eval()
    example = zoo.get_card(name).example_input()
    for inputs in (example, _bigger_batch(example)):  # the batch dimension is free
        got = _run_onnx(out, dict(zip(ONNX_MODELS[name], inputs)))
        want = _model_outputs(model, inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, **TOL)
    exporter = "dynamo" if "(onnx, dynamo," in printed else "torchscript"
    assert f"(onnx, {exporter}," in printed and "batch dynamic" in printed
    if exporter == "torchscript":  # the fallback is said, with the dynamo exporter's reason
        assert "the dynamo exporter failed, the TorchScript exporter was used (dynamo exporter: " in printed


def test_pt2_of_a_folder_with_other_sizes_reloads_and_runs_like_torch(tmp_path, capsys):
    """A saved cbramod-test built with 6 channels: the card's 4-channel example is resized to 6."""
    torch.manual_seed(0)
    domainfm.save_pretrained(domainfm.create_model("cbramod-test", n_chans=6), tmp_path / "model")
    out = tmp_path / "cbramod.pt2"

    assert cli.main(["export", str(tmp_path / "model"), "--output", str(out)]) == 0
    assert "inputs: x (2, 6, 400); batch dynamic" in capsys.readouterr().out
    program = torch.export.load(str(out)).module()
    model = domainfm.create_model(tmp_path / "model").eval()
    x = torch.randn(3, 6, 400, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        np.testing.assert_allclose(program(x).numpy(), model(x).numpy(), **TOL)


def test_pt2_of_a_registered_name_is_the_model_that_name_builds(tmp_path, capsys):
    out = tmp_path / "explora.pt2"
    torch.manual_seed(0)
    assert cli.main(["export", "explora-test", "--output", str(out), "--format", "pt2"]) == 0
    assert "RANDOM initialisation" in capsys.readouterr().err
    torch.manual_seed(0)
    model = domainfm.create_model("explora-test").eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        np.testing.assert_allclose(torch.export.load(str(out)).module()(x).numpy(), model(x).numpy(), **TOL)


def test_a_backbone_without_head_exports_its_features(tmp_path, capsys):
    torch.manual_seed(0)
    domainfm.save_pretrained(domainfm.create_model("cbramod-test", n_outputs=None), tmp_path / "backbone")
    out = tmp_path / "features.pt2"
    assert cli.main(["export", str(tmp_path / "backbone"), "--output", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[0]
    assert "it has no head (a pretrained backbone): --features exports its forward_features" in err

    assert cli.main(["export", str(tmp_path / "backbone"), "--output", str(out), "--features"]) == 0
    model = domainfm.create_model(tmp_path / "backbone").eval()
    x = torch.randn(3, 4, 400)
    with torch.no_grad():
        np.testing.assert_allclose(torch.export.load(str(out)).module()(x).numpy(), model.forward_features(x).numpy(),
                                   **TOL)


def test_a_card_without_example_needs_input_shape(tiny_zoo, tmp_path, capsys):
    out = tmp_path / "tiny.onnx"
    assert cli.main(["export", "dfmtest-tiny", "--output", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith("domainfm export: error: dfmtest-tiny: its model card declares no example input")
    assert "--input-shape" in err[-2] and err[-1] == cli._DEBUG_HINT and not out.exists()

    torch.manual_seed(0)
    assert cli.main(["export", "dfmtest-tiny", "--output", str(out), "--input-shape", "4,3"]) == 0
    assert "inputs: x (4, 3); batch dynamic" in capsys.readouterr().out
    torch.manual_seed(0)
    model = tiny_zoo.Net(n_chans=3, n_outputs=2, hidden=8).eval()
    x = torch.randn(7, 3)
    np.testing.assert_allclose(_run_onnx(out, {"x": x})[0], _model_outputs(model, (x,))[0], **TOL)


def test_a_graph_model_keeps_its_shapes_fixed_and_says_why(tmp_path):
    """git's inputs are nodes and edges, no batch: the example's shapes are exported as they are."""
    torch.manual_seed(0)
    model = domainfm.create_model("git-test").eval()
    result = export(model, tmp_path / "git.onnx")
    assert not result.dynamic_batch
    assert any(note.startswith("batch fixed at the example's shapes: the outputs do not follow") for note in result.notes)
    x, edge_index = zoo.get_card("git-test").example_input()
    got = _run_onnx(tmp_path / "git.onnx", {"x": x, "edge_index": edge_index})
    np.testing.assert_allclose(got[0], _model_outputs(model, (x, edge_index))[0], **TOL)


class _SingularValues(nn.Module):
    def forward(self, x):
        return torch.linalg.svdvals(x)  # in no ONNX opset


def test_a_model_no_exporter_can_write_names_both_and_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "svd.onnx"
    with pytest.raises(ExportError) as info:
        export(_SingularValues(), out, example_inputs=(torch.randn(2, 4, 4),))
    message = str(info.value)
    assert message.startswith("cannot export to ONNX: dynamo exporter: ")
    assert "; torchscript exporter: UnsupportedOperatorError: Exporting the operator 'aten::linalg_svdvals'" in message
    assert list(tmp_path.iterdir()) == []  # no file, no temporary


def test_large_weights_go_to_a_data_file_beside_the_onnx_file(tmp_path, monkeypatch):
    """Past 2 GiB protobuf cannot hold the weights: FILE + FILE.data, committed together and
    found by onnxruntime at their final names (forced here with a threshold of 0 bytes)."""
    monkeypatch.setattr(export_module, "EXTERNAL_DATA_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.GELU(), nn.Linear(16, 2)).eval()
    (tmp_path / "out").mkdir()
    result = export(model, tmp_path / "out" / "mlp.onnx", example_inputs=(torch.randn(2, 3),))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mlp.onnx", "mlp.onnx.data"]
    assert result.extra_files == [tmp_path / "out" / "mlp.onnx.data"]
    x = torch.randn(5, 3)
    name = onnxruntime.InferenceSession(str(tmp_path / "out" / "mlp.onnx")).get_inputs()[0].name
    np.testing.assert_allclose(_run_onnx(tmp_path / "out" / "mlp.onnx", {name: x})[0], _model_outputs(model, (x,))[0],
                               **TOL)


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder / "m.onnx"
    return Path("/sys/domainfm-export-test.onnx")  # root writes anywhere a permission bit allows; sysfs refuses


@pytest.mark.parametrize("case", ["format", "suffix", "no-suffix", "folder", "parent-file", "unwritable", "shape"])
def test_bad_format_or_output_is_one_line_before_the_model_is_built(case, tmp_path, monkeypatch, capsys):
    def built(*args, **kwargs):
        raise AssertionError("the model was built before the options were checked")

    monkeypatch.setattr(export_module, "_resolve", built)
    (tmp_path / "a-file").write_text("")
    unwritable = _unwritable(tmp_path)
    output, extra, expected = {
        "format": (tmp_path / "m.onnx", ["--format", "tflite"], "--format 'tflite': expected one of onnx, pt2"),
        "suffix": (tmp_path / "m.onnx", ["--format", "pt2"],
                   f"--output {tmp_path / 'm.onnx'}: expected a .pt2 file for --format pt2, got '.onnx'"),
        "no-suffix": (tmp_path / "m.tflite", [], f"--output {tmp_path / 'm.tflite'}: cannot tell the format from "
                                                 "'.tflite'; name a .onnx or .pt2 file, or give --format onnx|pt2"),
        "folder": (tmp_path, [], f"--output {tmp_path}: is a folder; expected a file path"),
        "parent-file": (tmp_path / "a-file" / "m.onnx", [],
                        f"--output {tmp_path / 'a-file' / 'm.onnx'}: {tmp_path / 'a-file'} is a file, not a folder"),
        "unwritable": (unwritable, [], f"{unwritable}: cannot write here ("),
        "shape": (tmp_path / "m.onnx", ["--input-shape", "2,x"], "--input-shape '2,x': expected sizes >= 1"),
    }[case]
    assert cli.main(["export", "cbramod-test", "--output", str(output), *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1] == cli._DEBUG_HINT
    assert err[0].startswith(f"domainfm export: error: {expected}"), err[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "read-only") == ["a-file"]


def test_export_is_listed_and_its_help_imports_no_exporter():
    code = ("import sys\nfrom domainfm import cli\n"
            "try:\n    cli.main(['export', '--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'onnxscript', 'torch.onnx') "
            "if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--input-shape SHAPE" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"
    listed = subprocess.run([sys.executable, "-m", "domainfm.cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert "export    export a model to ONNX or a torch.export program (.pt2)" in listed.stdout
