"""SToFM predict/embed through the CLI on a tiny fine-tuned run, and the retained capability."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S

pytest.importorskip("igraph")

TINY = ["model.name=stofm-test", "model.kwargs={}", "data.cell_encoder.name=stofm-cell-encoder-test",
        "data.cell_encoder.kwargs={}", "data.cells_per_subslice=120", "pca_components=10", "stages=[]",
        "arms=[random]", "train.max_epochs=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stofm")
    path = root / "slice.h5ad"
    S.demo_tissue()[::3].copy().write_h5ad(path)
    assert main(["finetune", "stofm", *TINY, f"data.path={path}", "--runs-dir", str(root), "--name", "r"]) == 0
    return root / "stofm" / "r", path


def test_report_carries_retained_capability(run):
    report = json.loads((run[0] / "report.json").read_text())
    assert report["retained_capability"]["metric"] == "balanced_accuracy"
    before, after = report["retained_before"], report["arms"]["random"]["retained"]
    assert before["label_key"] == "cell_type" and after["label_key"] == "cell_type"
    for value in (before["balanced_accuracy"], after["balanced_accuracy"]):
        assert 0 <= value <= 1
    assert -1 <= after["leiden_ari"] <= 1
    # the arm's saved model folder is Hub-ready: its model card carries the run's metrics
    import yaml

    card = (run[0] / "random" / "model" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "domainfm" and "balanced_accuracy" in card


def test_predict_cli_writes_probabilities_per_cell(run, tmp_path):
    run_dir, slice_path = run
    out = tmp_path / "cells.csv"
    assert main(["predict", "stofm", "--model", str(run_dir), "--input", str(slice_path), "--output", str(out),
                 "--precision", "32-true"]) == 0
    frame = pd.read_csv(out, index_col="cell")
    adata = S.demo_tissue()[::3]
    assert list(frame.index) == list(adata.obs_names)
    probs = frame[[c for c in frame.columns if c.startswith("p_")]]
    assert [c[2:] for c in probs.columns] == sorted(S.NICHES)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    assert (frame["predicted"] == probs.idxmax(axis=1).str[2:]).all()
    # bf16 (auto on this CPU) agrees with fp32 to the documented tolerance
    out16 = tmp_path / "cells16.csv"
    assert main(["predict", "stofm", "--model", str(run_dir), "--input", str(slice_path), "--output", str(out16),
                 "--precision", "bf16-mixed"]) == 0
    p16 = pd.read_csv(out16, index_col="cell")[probs.columns]
    assert np.abs(p16.to_numpy() - probs.to_numpy()).max() < 0.05


def test_embed_cli_h5ad_and_npz(run, tmp_path):
    run_dir, slice_path = run
    model = domainfm.create_model(run_dir / "random" / "model")
    assert main(["embed", "stofm", "--model", str(run_dir), "--input", str(slice_path),
                 "--output", str(tmp_path / "e.npz"), "--precision", "32-true"]) == 0
    npz = np.load(tmp_path / "e.npz")
    assert npz["X"].shape == (len(npz["cells"]), model.num_features) and np.isfinite(npz["X"]).all()
    assert main(["embed", "stofm", "--model", str(run_dir), "--input", str(slice_path),
                 "--output", str(tmp_path / "e.h5ad"), "--precision", "32-true"]) == 0
    import anndata as ad

    back = ad.read_h5ad(tmp_path / "e.h5ad")
    np.testing.assert_allclose(back.obsm["X_stofm"], npz["X"], rtol=1e-6, atol=1e-6)


def test_bad_input_is_one_line_error(run, tmp_path, capsys):
    bad = tmp_path / "slice.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["predict", "stofm", "--model", str(run[0]), "--input", str(bad), "--output",
                 str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "slice.csv" in err and ".h5ad" in err and not (tmp_path / "o.csv").exists()
