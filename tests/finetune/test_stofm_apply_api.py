"""``domainfm.predict`` / ``domainfm.embed`` for SToFM on the shipped sample slice
(``samples/spatial/pbmc68k_niches.h5ad``, 700 cells), against the family's own Python functions,
the CLI, and the model run by hand; and the family options in ``--help``.

Tiny random models (``stofm-test``, ``stofm-cell-encoder-test``); everything in fp32 on the CPU,
so results agree to float rounding (the batching differs: tolerance 1e-5)."""
from __future__ import annotations

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.finetune import stofm as FT
from domainfm.pretrain.stofm import CellEncoderSection, slice_subslices

SAMPLE = S.samples_dir() / "pbmc68k_niches.h5ad"
ENCODER = "stofm-cell-encoder-test"
FAMILY_OPTIONS = ["--cell-encoder", "--spatial-key", "--layer", "--embedding-key", "--cells-per-subslice"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A classifier (4 classes) and a backbone, in memory and as save_pretrained folders, and the
    sample slice with distinct precomputed cell embeddings (``obsm["X_ce"]``; the random test cell
    encoder gives nearly the same embedding to every cell), in memory and as a file."""
    root = tmp_path_factory.mktemp("api")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = domainfm.create_model("stofm-test", n_outputs=4).eval()
        backbone = domainfm.create_model("stofm-test", n_outputs=None).eval()
    domainfm.save_pretrained(head, root / "head")
    domainfm.save_pretrained(backbone, root / "backbone")
    adata = ad.read_h5ad(SAMPLE)
    adata.obsm["X_ce"] = np.random.default_rng(0).normal(size=(adata.n_obs, 256)).astype(np.float32)
    adata.write_h5ad(root / "slice.h5ad")
    return head, backbone, root, adata


def test_predict_matches_the_family_function_the_cli_and_the_model_run_by_hand(models, tmp_path):
    head, _, root, adata = models
    got = domainfm.predict(head, adata.copy(), embedding_key="X_ce", precision="32-true")
    assert list(got.columns) == ["cell", "predicted", "p_0", "p_1", "p_2", "p_3"]
    assert list(got["cell"]) == list(adata.obs_names)
    probs = got[["p_0", "p_1", "p_2", "p_3"]].to_numpy()
    data = FT.DataSection(embedding_key="X_ce")
    own = FT.predict(adata.copy(), head, data, precision="32-true")
    assert list(own.index) == list(adata.obs_names) and (own["predicted"] == got["predicted"].to_numpy()).all()
    np.testing.assert_allclose(own.drop(columns="predicted").to_numpy(), probs, rtol=0, atol=1e-5)
    # by hand: the model on each sub-slice, softmax over the cell tokens' logits
    expected = np.full((adata.n_obs, 4), np.nan)
    with torch.no_grad():
        for s in slice_subslices(adata, data, seed=0)[0]:
            logits = head(s["token_embeddings"][None], s["distances"][None], s["token_types"][None])[0]
            cells = s["cell_index"] >= 0
            expected[s["cell_index"][cells].numpy()] = torch.softmax(logits[cells].double(), -1).numpy()
    np.testing.assert_allclose(probs, expected, rtol=0, atol=1e-5)
    assert probs.std(axis=0).min() > 1e-3  # the cells' probabilities differ: a real comparison
    assert (got["predicted"] == pd.Series(expected.argmax(1)).astype(str)).all()
    # the CLI on the saved model writes the same table
    out = tmp_path / "cells.csv"
    assert main(["predict", "stofm", "--model", str(root / "head"), "--input", str(root / "slice.h5ad"), "--output",
                 str(out), "--embedding-key", "X_ce", "--precision", "32-true"]) == 0
    cli = pd.read_csv(out)
    assert list(cli.columns) == list(got.columns) and list(cli["cell"]) == list(got["cell"])
    np.testing.assert_allclose(cli[["p_0", "p_1", "p_2", "p_3"]].to_numpy(), probs, rtol=0, atol=1e-5)


def test_predict_from_the_shipped_file_with_a_cell_encoder(models):
    head = models[0]
    got = domainfm.predict(head, SAMPLE, cell_encoder=ENCODER, precision="32-true")
    own = FT.predict(ad.read_h5ad(SAMPLE), head, FT.DataSection(cell_encoder=CellEncoderSection(name=ENCODER)),
                     precision="32-true")
    assert list(got["cell"]) == list(own.index)
    np.testing.assert_allclose(got.drop(columns=["cell", "predicted"]).to_numpy(),
                               own.drop(columns="predicted").to_numpy(), rtol=0, atol=1e-5)


def test_embed_matches_the_family_function_and_the_cli(models, tmp_path):
    _, backbone, root, sample = models
    adata = sample.copy()
    before = set(adata.obsm)
    back = domainfm.embed(backbone, adata, embedding_key="X_ce", key_added="X_api", precision="32-true")
    assert back is adata and set(adata.obsm) == before | {"X_api"}  # written in place, as scanpy does
    x = adata.obsm["X_api"]
    assert x.shape == (adata.n_obs, backbone.num_features)
    own = sample.copy()
    assert FT.embed(own, backbone, embedding_key="X_ce") is None  # scanpy: copy=False returns None
    np.testing.assert_allclose(x, own.obsm["X_stofm"], rtol=0, atol=1e-5)
    gaps = np.abs(x - x.mean(0)).max(1)
    assert gaps.min() > 1e-2  # every cell's row differs from the mean row: a real comparison
    assert main(["embed", "stofm", "--model", str(root / "backbone"), "--input", str(root / "slice.h5ad"),
                 "--output", str(tmp_path / "e.npz"), "--embedding-key", "X_ce", "--precision", "32-true"]) == 0
    npz = np.load(tmp_path / "e.npz")
    assert list(npz["cells"]) == list(adata.obs_names)
    np.testing.assert_allclose(npz["X"], x, rtol=0, atol=1e-5)
    # .h5ad: the input slice with the embeddings added
    assert main(["embed", "stofm", "--model", str(root / "backbone"), "--input", str(root / "slice.h5ad"),
                 "--output", str(tmp_path / "e.h5ad"), "--embedding-key", "X_ce", "--key-added", "X_cli",
                 "--precision", "32-true"]) == 0
    written = ad.read_h5ad(tmp_path / "e.h5ad")
    assert set(written.obsm) == {"spatial", "X_ce", "X_cli"} and list(written.obs_names) == list(adata.obs_names)
    np.testing.assert_allclose(written.obsm["X_cli"], x, rtol=0, atol=1e-5)


def test_embed_without_a_cell_encoder_warns_that_it_is_random(models):
    adata = ad.read_h5ad(SAMPLE)[:10].copy()  # the full-size encoder is slow on CPU
    with pytest.warns(UserWarning, match="randomly initialised stofm-cell-encoder"):
        domainfm.embed(models[1], adata, precision="32-true")


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_help_lists_the_family_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "stofm", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in FAMILY_OPTIONS + ["--model", "--input", "--output", "--precision", "--batch-size"]:
        assert flag in text, flag
    assert ("--key-added" in text and "--overwrite" in text) == (command == "embed")
