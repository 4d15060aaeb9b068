"""SToFM downstream: embed (AnnData in, obsm out), the per-cell task, one LoRA fine-tune via the CLI."""
from __future__ import annotations

import json

import igraph  # noqa: F401 - a required dependency (Leiden): missing, these tests fail rather than skip
import numpy as np
import pytest
import torch

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.finetune import stofm as FT


@pytest.fixture(scope="module")
def tissue():
    adata = S.demo_tissue()[:100].copy()
    return adata


def test_embed_writes_obsm_in_obs_order_and_changes_nothing_else(tissue):
    adata = tissue.copy()
    before = (adata.X.copy(), adata.obs.copy(), dict(adata.obsm), adata.var_names.copy())
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    encoder = domainfm.create_model("stofm-cell-encoder-test").eval()
    assert FT.embed(adata, model, cell_encoder=encoder, cells_per_subslice=100, batch_size=2) is None
    x = adata.obsm["X_stofm"]
    assert x.shape == (adata.n_obs, 32) and np.isfinite(x).all() and np.abs(x).sum(1).min() > 0
    assert set(adata.obsm) == {"spatial", "X_stofm"}
    assert abs(adata.X - before[0]).max() == 0 and adata.obs.equals(before[1])


def test_embed_keeps_obs_order(tissue):
    # cells in obs order: embedding a permuted slice permutes the rows (sub-slices and distances
    # come from coordinates, so every cell keeps its context). Distinct inputs and a model whose
    # input projection is not tiny make every cell's row different.
    adata = tissue[:100].copy()
    adata.obsm["X_ce"] = np.random.default_rng(0).normal(size=(100, 256)).astype(np.float32)
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    with torch.no_grad():
        model.embedding_layer.weight.normal_(0, 0.5)
    FT.embed(adata, model, embedding_key="X_ce", key_added="X_s")
    perm = np.random.default_rng(1).permutation(adata.n_obs)
    shuffled = adata[perm].copy()
    FT.embed(shuffled, model, embedding_key="X_ce", key_added="X_s")
    x = adata.obsm["X_s"]
    gaps = np.linalg.norm(x[:, None] - x[None], axis=-1)[~np.eye(100, dtype=bool)]
    assert gaps.min() > 0.05
    # Leiden depends on node order, so a cell may change cluster and the hypernodes shift a little
    np.testing.assert_allclose(shuffled.obsm["X_s"], x[perm], atol=2e-3)


def test_embed_at_the_released_width(tissue):
    adata = tissue[:60].copy()
    model = domainfm.create_model("stofm-base", n_outputs=None, n_layers=1)
    adata.obsm["X_ce"] = np.random.default_rng(0).normal(size=(60, 256)).astype(np.float32)
    FT.embed(adata, model, embedding_key="X_ce", cells_per_subslice=1000)
    assert adata.obsm["X_stofm"].shape == (60, 256)


def test_embed_errors_name_the_problem(tissue):
    model = domainfm.create_model("stofm-test", n_outputs=None)
    bad = tissue[:20].copy()
    del bad.obsm["spatial"]
    with pytest.raises(S.SpatialDataError, match="spatial"):
        FT.embed(bad, model)
    nan = tissue[:20].copy()
    nan.obsm["spatial"][0, 0] = np.nan
    with pytest.raises(S.SpatialDataError, match="NaN"):
        FT.embed(nan, model)
    with pytest.raises(S.SpatialDataError, match="empty"):
        FT.embed(tissue[:0].copy(), model)
    unknown = tissue[:20].copy()
    unknown.var_names = [f"UNKNOWN{i}" for i in range(unknown.n_vars)]
    with pytest.raises(S.SpatialDataError, match="0 matched"):
        FT.embed(unknown, model, cell_encoder=domainfm.create_model("stofm-cell-encoder-test"))


def test_collate_cells_pairs_logits_with_labels():
    xy = np.random.default_rng(0).uniform(0, 100, (90, 2))
    emb = np.random.default_rng(1).normal(size=(90, 256)).astype(np.float32)
    subs = S.build_subslices(xy, emb, cells_per_subslice=40, knn=6, clusters=(xy[:, 0] > 50).astype(int))
    labels = np.arange(90) % 3
    ds = FT.CellTaskDataset(subs, labels, np.arange(0, 90, 2))
    x, y = FT.collate_cells([ds[i] for i in range(len(ds))])
    assert len(y) == 45
    model = domainfm.create_model("stofm-test", n_outputs=3)
    logits = FT.cell_logits(model, x)
    assert logits.shape == (45, 3)
    cells = x["cell_index"][x["labels"] != -100]
    assert torch.equal(torch.from_numpy(labels)[cells], y) and (cells % 2 == 0).all()


def test_cli_lora_finetune_with_a_pretraining_stage(tmp_path, tissue):
    path = tmp_path / "slice.h5ad"
    S.demo_tissue()[::3].copy().write_h5ad(path)  # 234 cells of the demo tissue, read from a file
    stage = ["model.name=stofm-test", "model.kwargs={}", "data.cell_encoder.name=stofm-cell-encoder-test",
             "data.cell_encoder.kwargs={}", f"data.slices=[{path}]", "data.cells_per_subslice=120",
             "train.max_steps=2", "train.progress=false"]
    rc = main(["finetune", "stofm", "model.name=stofm-test", "model.kwargs={}", "adapt.mode=lora", "arms=[pretrained, random]",
               "data.cell_encoder.name=stofm-cell-encoder-test", "data.cell_encoder.kwargs={}", f"data.path={path}",
               "data.cells_per_subslice=120", "train.max_epochs=2", "pca_components=10",
               "stages=" + json.dumps([{"family": "stofm", "config": "pretrain", "overrides": stage}]),
               "--runs-dir", str(tmp_path), "--name", "r"])
    assert rc == 0
    report = json.loads((tmp_path / "stofm" / "r" / "report.json").read_text())
    assert report["labels"] == "recorded" and report["data"]["classes"] == sorted(S.NICHES)
    # the test split's metrics, recomputed with sklearn from the saved model's predictions
    from sklearn.metrics import balanced_accuracy_score, cohen_kappa_score, f1_score

    regions = S.demo_tissue()[::3].obs["region"].astype(str).to_numpy()
    test = S.stratified_split(np.searchsorted(sorted(S.NICHES), regions), 0.2, 0.2, seed=0)["test"]
    assert len(test) == report["data"]["split"]["test"]
    for arm in ("pretrained", "random"):
        result = report["arms"][arm]
        assert result["mode"] == "lora" and result["params"]["trainable"] < result["params"]["total"]
        cells = domainfm.predict(tmp_path / "stofm" / "r", path, family="stofm", arm=arm, precision="32-true")
        truth, pred = regions[test], cells["predicted"].to_numpy()[test]
        assert result["test"]["cohen_kappa"] == pytest.approx(cohen_kappa_score(truth, pred), abs=1e-6)
        assert result["test"]["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(truth, pred), abs=1e-6)
        assert result["test"]["f1_macro"] == pytest.approx(f1_score(truth, pred, average="macro"), abs=1e-6)
        assert -1 <= result["zero_shot"]["ari"] <= 1 and 0 <= result["zero_shot"]["nmi"] <= 1
        assert set(result["baselines"]) == {"pca", "pca_smoothed", "cell_encoder_only"}
        assert "test" in result["baselines"]["pca_smoothed"]["logistic_regression"]
    assert "stage" in report["arms"]["pretrained"]["init"] and "random" in report["arms"]["random"]["init"]
    model = domainfm.create_model(tmp_path / "stofm" / "r" / "pretrained" / "model")
    assert model.head[-1].out_features == 4


def test_cell_recipe_per_sample_loss_is_the_mean_over_each_subslices_labelled_cells():
    """FLOW weights dataset items; SToFM's items are sub-slices holding many labelled cells, so the
    per-sample loss is each sub-slice's mean cell loss (by hand), and with equal counts the mean of
    the per-sample losses is the step's loss."""
    import torch.nn.functional as F

    from domainfm.finetune.stofm import CellRecipe

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 4, generator=g)
    labels = torch.full((3, 5), -100)
    labels[0, [0, 2]] = torch.tensor([1, 3])
    labels[1, [1]] = torch.tensor([0])
    labels[2, [0, 1, 4]] = torch.tensor([2, 2, 1])
    x = {"labels": labels, "logits": logits}
    y = labels[labels != -100]
    recipe = CellRecipe(torch.nn.Identity(), None, None, task="multiclass",
                        forward_fn=lambda model, x: x["logits"][x["labels"] != -100])
    got = recipe.per_sample_loss(None, (x, y))
    expected = torch.stack([F.cross_entropy(logits[i][labels[i] != -100], labels[i][labels[i] != -100])
                            for i in range(3)])
    assert got.shape == (3,)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    same = torch.full((3, 5), -100)  # two labelled cells in every sub-slice
    same[0, [0, 2]] = torch.tensor([1, 3])
    same[1, [1, 2]] = torch.tensor([0, 1])
    same[2, [0, 4]] = torch.tensor([2, 1])
    step = F.cross_entropy(logits[same != -100], same[same != -100])
    per = recipe.per_sample_loss(None, ({"labels": same, "logits": logits}, same[same != -100]))
    torch.testing.assert_close(per.mean(), step, rtol=1e-6, atol=1e-7)
