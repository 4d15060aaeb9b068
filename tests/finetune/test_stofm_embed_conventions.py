"""``finetune.stofm.embed`` follows scanpy's conventions: ``copy=False`` writes ``obsm[key_added]``
into the AnnData and returns None (as ``sc.pp.pca(adata)`` does), ``copy=True`` returns a new
AnnData with it and leaves the input untouched; and a model or cell encoder given as a registered
name (random weights) is initialised from ``seed``: same seed, same embedding.

Exact equality (``assert_array_equal``) is used only between calls in one process on one machine,
where the same seed gives the same weights and the same float operations run in the same order."""
from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import torch

import domainfm
from domainfm.data_loaders import spatial as S
from domainfm.finetune import stofm as FT

ENCODER = "stofm-cell-encoder-test"
RANDOM = "randomly initialised"  # both warnings: the registered model and the default cell encoder


@pytest.fixture(scope="module")
def tissue():
    return S.demo_tissue()[:16].copy()  # the default (full-size) random cell encoder is slow on CPU


def _dense(x):
    return np.array(x.toarray() if hasattr(x, "toarray") else x, copy=True)


def test_copy_true_twice_gives_identical_embeddings_and_leaves_the_input_untouched(tissue):
    adata = tissue.copy()
    obsm, x, obs = {k: np.array(v, copy=True) for k, v in adata.obsm.items()}, _dense(adata.X), adata.obs.copy()
    with pytest.warns(UserWarning, match=RANDOM):
        first = FT.embed(adata, "stofm-test", copy=True, seed=0)
    with pytest.warns(UserWarning, match=RANDOM):
        second = FT.embed(adata, "stofm-test", copy=True, seed=0)
    assert isinstance(first, ad.AnnData) and first is not adata and second is not first
    assert first.obsm["X_stofm"].shape == (adata.n_obs, 32)
    np.testing.assert_array_equal(first.obsm["X_stofm"], second.obsm["X_stofm"])
    # the input: no key added, every obsm entry, X and obs as they were
    assert "X_stofm" not in adata.obsm and set(adata.obsm) == set(obsm)
    for key, value in obsm.items():
        np.testing.assert_array_equal(np.asarray(adata.obsm[key]), value)
    np.testing.assert_array_equal(_dense(adata.X), x)
    assert adata.obs.equals(obs)
    # the copy is the input plus the key
    assert set(first.obsm) == set(obsm) | {"X_stofm"} and list(first.obs_names) == list(adata.obs_names)
    np.testing.assert_array_equal(first.obsm["spatial"], obsm["spatial"])


def test_copy_false_returns_none_and_writes_what_copy_true_returns(tissue):
    adata = tissue.copy()
    with pytest.warns(UserWarning, match=RANDOM):
        copied = FT.embed(adata, "stofm-test", cell_encoder=ENCODER, key_added="X_s", copy=True, seed=0)
    with pytest.warns(UserWarning, match=RANDOM):
        returned = FT.embed(adata, "stofm-test", cell_encoder=ENCODER, key_added="X_s", seed=0)
    assert returned is None
    assert set(adata.obsm) == {"spatial", "X_s"}
    np.testing.assert_array_equal(adata.obsm["X_s"], copied.obsm["X_s"])


def test_seed_initialises_registered_names_as_manual_seed_and_different_seeds_differ(tissue):
    """``seed=s`` with registered names gives what the same models built under
    ``torch.manual_seed(s)`` by hand give; the caller's random stream is not consumed."""
    embeddings = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = domainfm.create_model("stofm-test", n_outputs=None)
        torch.manual_seed(seed)
        encoder = domainfm.create_model(ENCODER)
        by_hand = FT.embed(tissue, model.eval(), cell_encoder=encoder.eval(), copy=True, seed=seed)
        state = torch.get_rng_state()
        with pytest.warns(UserWarning, match=RANDOM):
            named = FT.embed(tissue, "stofm-test", cell_encoder=ENCODER, copy=True, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)
        np.testing.assert_array_equal(named.obsm["X_stofm"], by_hand.obsm["X_stofm"])
        embeddings[seed] = named.obsm["X_stofm"]
    # other seeds, other weights: the embeddings differ on the scale of the embeddings themselves
    gap = np.abs(embeddings[0] - embeddings[1]).max()
    assert gap > 0.1 * np.abs(embeddings[0]).max()


def test_the_default_cell_encoder_is_seeded_from_seed(tissue):
    """No cell encoder given (and no precomputed cell embeddings): the random
    ``stofm-cell-encoder`` is the one built under ``torch.manual_seed(seed)``."""
    torch.manual_seed(0)
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    torch.manual_seed(1)
    encoder = domainfm.create_model("stofm-cell-encoder").eval()
    by_hand = FT.embed(tissue, model, cell_encoder=encoder, copy=True, seed=1).obsm["X_stofm"]
    with pytest.warns(UserWarning, match=RANDOM):
        default = FT.embed(tissue, model, copy=True, seed=1).obsm["X_stofm"]
    np.testing.assert_array_equal(default, by_hand)


def test_a_path_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"embed\(adata=\.\.\.\): expected an AnnData, got PosixPath: read the file"):
        FT.embed(S.samples_dir() / "pbmc68k_niches.h5ad", "stofm-test")
