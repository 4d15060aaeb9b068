"""SToFM predict/embed through the CLI on a tiny fine-tuned run, and the retained capability."""
from __future__ import annotations

import json

import igraph  # noqa: F401 - a required dependency (Leiden): missing, these tests fail rather than skip
import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.finetune import stofm as FT

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


def _cell_features(model, subslices, n_cells):
    """The cell tokens' last-layer features, one sub-slice at a time (no padding, no batching)."""
    out = np.full((n_cells, model.num_features), np.nan)
    with torch.no_grad():
        for s in subslices:
            f = model.forward_features(s["token_embeddings"][None], s["distances"][None], s["token_types"][None])[0]
            cells = s["cell_index"] >= 0
            out[s["cell_index"][cells].numpy()] = f[cells].double().numpy()
    return out


def test_report_carries_retained_capability(run):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import adjusted_rand_score, balanced_accuracy_score, f1_score
    from sklearn.preprocessing import StandardScaler

    from domainfm import config as cfgmod

    run_dir = run[0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["retained_capability"]["metric"] == "balanced_accuracy"
    before, after = report["retained_before"], report["arms"]["random"]["retained"]
    assert set(before) == set(after) == {"balanced_accuracy", "f1_macro", "leiden_ari", "label_key"}
    assert before["label_key"] == after["label_key"] == "cell_type"
    # recomputed independently from the saved model: its cell features (one sub-slice at a time),
    # a logistic-regression probe of cell types (train: the task's train cells; test: the rest)
    cfg = cfgmod.from_dict(FT.Config, cfgmod.load_yaml(run_dir / "config.yaml"))
    task = FT.build_task(cfg)
    adata, split = task.extras["adata"], task.extras["split"]
    model = domainfm.create_model(run_dir / "random" / "model").eval()
    x = _cell_features(model, task.extras["subslices"], adata.n_obs)
    y = adata.obs["cell_type"].astype(str).to_numpy()
    train, test = split["train"], np.concatenate([split["val"], split["test"]])
    scaler = StandardScaler().fit(x[train])
    probe = LogisticRegression(max_iter=2000).fit(scaler.transform(x[train]), y[train])
    pred = probe.predict(scaler.transform(x[test]))
    assert after["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y[test], pred), abs=1e-6)
    assert after["f1_macro"] == pytest.approx(f1_score(y[test], pred, average="macro", zero_division=0), abs=1e-6)
    found = S.leiden_clusters(x, n_neighbors=15, resolution=cfg.cluster_resolution, seed=cfg.train.seed)
    assert after["leiden_ari"] == pytest.approx(adjusted_rand_score(y, found), abs=1e-6)
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
    assert list(frame.columns) == ["predicted"] + [f"p_{c}" for c in sorted(S.NICHES)]
    probs = frame.drop(columns="predicted")
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


def test_a_model_folder_copied_out_of_its_run_predicts_as_inside_it(run, tmp_path):
    """Every arm's saved model carries its run's record (config and report): copied elsewhere it
    keeps the run's sub-slicing and class names, and its family is read from it."""
    import shutil

    import domainfm

    run_dir, slice_path = run
    arm = next(p.parent.parent for p in sorted(run_dir.glob("*/model/config.json")))
    copied = tmp_path / "elsewhere" / "model"
    shutil.copytree(arm / "model", copied)
    assert (copied / "run_record.json").is_file()
    inside, outside = tmp_path / "inside.csv", tmp_path / "outside.csv"
    for model, out in ((arm / "model", inside), (copied, outside)):
        assert main(["predict", "stofm", "--model", str(model), "--input", str(slice_path), "--output", str(out),
                     "--precision", "32-true"]) == 0
    a, b = pd.read_csv(inside, index_col="cell"), pd.read_csv(outside, index_col="cell")
    assert list(b.columns) == list(a.columns) == ["predicted"] + [f"p_{c}" for c in sorted(S.NICHES)]
    np.testing.assert_allclose(b.drop(columns="predicted").to_numpy(), a.drop(columns="predicted").to_numpy(),
                               atol=1e-6)
    frame = domainfm.predict(copied, slice_path, precision="32-true").set_index("cell")  # family from the record
    assert list(frame.index) == list(a.index)
    np.testing.assert_allclose(frame.drop(columns="predicted").to_numpy(), a.drop(columns="predicted").to_numpy(),
                               atol=1e-6)

