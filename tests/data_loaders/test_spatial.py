"""Spatial data: reading/validation, Geneformer tokenisation, multi-scale sub-slices, collation."""
from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from domainfm.data_loaders import spatial as S


@pytest.fixture(scope="module")
def vocab():
    return S.GeneVocabulary.load()


def test_shipped_vocabulary_is_geneformers(vocab):
    assert len(vocab.gene_ids) == 25_424 and len(vocab) == S.CLS_ID == 25_426
    assert vocab.token_of["ENSG00000000003"] == 2 and (vocab.gene_medians > 0).all()
    assert vocab.symbol_to_id["ACTB"] == "ENSG00000075624"
    assert vocab.mouse_to_human["ENSMUSG00000064341"] == "ENSG00000198888"


def _adata(vocab, n_cells=6, seed=0):
    rng = np.random.default_rng(seed)
    human = list(vocab.gene_ids[:5])
    symbol = "ACTB"  # -> ENSG00000075624
    mouse = "ENSMUSG00000064341"  # -> ENSG00000198888
    genes = human + [symbol, mouse, "NOT_A_GENE"]
    counts = rng.poisson(2.0, (n_cells, len(genes))).astype(np.float32)
    counts[0, :] = 0
    counts[0, 2] = 5  # one expressed gene
    counts[1, 0] = counts[1, 1] = 3  # a tie
    adata = ad.AnnData(sp.csr_matrix(counts), var={"gene_ids": genes})
    adata.var_names = [f"g{i}" for i in range(len(genes))]
    adata.obs_names = [f"c{i}" for i in range(n_cells)]
    adata.obsm["spatial"] = rng.uniform(0, 100, (n_cells, 2))
    return adata, counts, genes


def _reference_tokens(counts, genes, vocab, max_length):
    """Geneformer's tokenize_cell per cell, restated with a loop (stable ties)."""
    ensembl = []
    for g in genes:
        ensembl.append(vocab.mouse_to_human.get(g) if g.startswith("ENSMUSG") else
                       g if g.startswith("ENSG") else vocab.symbol_to_id.get(g, ""))
    out = []
    for row in counts:
        total = row.sum()
        scored = []
        for j, g in enumerate(ensembl):
            if g in vocab.token_of and row[j] > 0:
                median = vocab.gene_medians[vocab.token_of[g] - 2]
                scored.append((-(row[j] / total * 10_000 / median), j, vocab.token_of[g]))
        scored.sort()
        out.append([S.CLS_ID] + [t for _, _, t in scored][: max_length - 1])
    return out


@pytest.mark.parametrize("max_length", [2048, 3])
def test_tokenize_matches_a_per_cell_reference(vocab, max_length):
    adata, counts, genes = _adata(vocab)
    tok = S.tokenize(adata, max_length=max_length)
    assert tok.n_genes_matched == 7 and tok.n_genes == 8
    want = _reference_tokens(counts, genes, vocab, max_length)
    for i, seq in enumerate(want):
        assert tok.lengths[i] == len(seq)
        assert tok.input_ids[i, : len(seq)].tolist() == seq
        assert (tok.input_ids[i, len(seq):] == S.PAD_ID).all()
    assert tok.input_ids[0, :2].tolist() == [S.CLS_ID, vocab.token_of[genes[2]]]
    assert tok.attention_mask().sum(1).tolist() == tok.lengths.tolist()


def test_validation_errors_name_the_problem(vocab):
    adata, _, _ = _adata(vocab)
    no_xy = adata.copy()
    del no_xy.obsm["spatial"]
    with pytest.raises(S.SpatialDataError, match=r"obsm\['spatial'\] is missing"):
        S.validate(no_xy, source="slice.h5ad")
    nan = adata.copy()
    nan.obsm["spatial"][2, 1] = np.nan
    with pytest.raises(S.SpatialDataError, match="NaN or inf.*'c2'"):
        S.validate(nan)
    with pytest.raises(S.SpatialDataError, match="shape"):
        bad = adata.copy()
        bad.obsm["spatial"] = np.zeros((adata.n_obs, 1))
        S.validate(bad)
    with pytest.raises(S.SpatialDataError, match="empty"):
        S.validate(adata[:0].copy())
    negative = adata.copy()
    negative.X = sp.csr_matrix(-np.ones(adata.shape, np.float32))
    with pytest.raises(S.SpatialDataError, match="negative"):
        S.validate(negative)
    unknown = adata.copy()
    unknown.var["gene_ids"] = [f"XYZ{i}" for i in range(adata.n_vars)]
    with pytest.raises(S.SpatialDataError, match="0 matched"):
        S.tokenize(unknown)
    S.validate(adata)


def test_read_shipped_visium_folder():
    adata = S.read_spatial(S.samples_dir() / "visium_tiny")
    assert adata.shape == (100, 100) and adata.obsm["spatial"].shape == (100, 2)
    import pandas as pd

    pos = pd.read_csv(S.samples_dir() / "visium_tiny" / "spatial" / "tissue_positions_list.csv", header=None, index_col=0)
    np.testing.assert_array_equal(adata.obsm["spatial"], pos.loc[adata.obs_names, [5, 4]].to_numpy())
    tok = S.tokenize(adata)
    assert tok.n_genes_matched > 50 and (tok.input_ids[:, 0] == S.CLS_ID).all()


# ------------------------------------------------------------------------------ sub-slices


def _slice(n=900, seed=0):
    rng = np.random.default_rng(seed)
    xy = np.concatenate([rng.uniform(0, 300, (n // 2, 2)), rng.uniform(500, 800, (n - n // 2, 2)) * [1, 0.5]])
    emb = rng.normal(size=(n, 16)).astype(np.float32)
    clusters = (xy[:, 0] > 400).astype(int) * 2 + (xy[:, 1] > np.where(xy[:, 0] > 400, 325, 150)).astype(int)
    return xy, emb, clusters


def _official_split(nodes, num):
    """The official split_graph loop over squares, restated."""
    if len(nodes) <= num:
        return [np.arange(len(nodes))]
    (min_x, min_y), (max_x, max_y) = nodes.min(0), nodes.max(0)
    side = np.sqrt((max_x - min_x) * (max_y - min_y) / (len(nodes) // num + 1))
    out = []
    for i in range(int((max_x - min_x) / side) + 1):
        for j in range(int((max_y - min_y) // side) + 1):
            m = ((nodes[:, 0] >= min_x + i * side) & (nodes[:, 0] < min_x + (i + 1) * side)
                 & (nodes[:, 1] >= min_y + j * side) & (nodes[:, 1] < min_y + (j + 1) * side))
            idx = np.where(m)[0]
            if len(idx) == 0:
                continue
            out.extend(np.array_split(idx, len(idx) // num) if len(idx) // num >= 2 else [idx])
    return out


def test_micro_split_equals_the_official_squares():
    xy, _, _ = _slice()
    norm = S.normalize_coordinates(xy)
    ours, theirs = S.split_micro(norm, 100), _official_split(norm, 100)
    assert len(ours) == len(theirs) > 4
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    assert len(S.split_micro(norm, 5000)) == 1


def test_subslices_cover_cells_once_share_hypernodes_and_have_official_distances():
    xy, emb, clusters = _slice()
    subs = S.build_subslices(xy, emb, cells_per_subslice=150, knn=8, clusters=clusters)
    assert len(subs) > 3
    cells = np.concatenate([s["cell_index"][s["cell_index"] >= 0].numpy() for s in subs])
    assert sorted(cells.tolist()) == list(range(len(xy)))
    norm = S.normalize_coordinates(xy)
    np.testing.assert_allclose(np.hypot(*(norm.max(0) - norm.min(0))), 100.0)
    np.testing.assert_allclose(norm.max(0) + norm.min(0), 0.0, atol=1e-9)
    for s in subs:
        types = s["token_types"].numpy()
        assert types[0] == S.TOKEN_CLS and (types[1:5] == S.TOKEN_HYPERNODE).all() and (types[5:] == S.TOKEN_CELL).all()
        # the same four hypernodes everywhere: cluster mean positions and embeddings
        for c in range(4):
            np.testing.assert_allclose(s["spatial"][1 + c].numpy(), norm[clusters == c].mean(0), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(s["token_embeddings"][1 + c].numpy(), emb[clusters == c].mean(0), atol=1e-5)
        idx = s["cell_index"].numpy()
        np.testing.assert_allclose(s["spatial"][5:].numpy(), norm[idx[5:]], atol=1e-4)
        np.testing.assert_array_equal(s["token_embeddings"][5:].numpy(), emb[idx[5:]])
        d = s["distances"].numpy()
        pos = s["spatial"].numpy().astype(np.float64)
        full = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1))
        n = len(d)
        np.testing.assert_array_equal(d, d.T)
        assert (d[0] == 0).all() and (np.diag(d) == 0).all()
        np.testing.assert_allclose(d[1:5, 1:], np.where(np.eye(4, n - 1, 0, bool), 0, full[1:5, 1:]), rtol=1e-5, atol=1e-4)
        edge = (d != S.NON_EDGE_DISTANCE) & (d != 0)
        np.testing.assert_allclose(d[edge], full[edge], rtol=1e-5, atol=1e-4)
        # the kNN graph (k = 8 with the point itself, [CLS] at the origin included), made symmetric
        order = np.argsort(full, axis=1, kind="stable")[:, :8]
        knn = np.zeros((n, n), bool)
        knn[np.repeat(np.arange(n), 8), order.ravel()] = True
        knn |= knn.T
        knn[1:5, :] = knn[:, 1:5] = True
        knn[0, :] = knn[:, 0] = False
        np.fill_diagonal(knn, False)
        np.testing.assert_array_equal(edge, knn)
        assert (d[1:, 1:][~knn[1:, 1:] & ~np.eye(n - 1, dtype=bool)] == S.NON_EDGE_DISTANCE).all()


def test_leiden_hypernodes_through_scanpy():
    rng = np.random.default_rng(1)
    xy = np.concatenate([rng.normal(0, 5, (150, 2)), rng.normal(200, 5, (150, 2))])
    emb = np.concatenate([rng.normal(0, 1, (150, 8)) + 5, rng.normal(0, 1, (150, 8)) - 5]).astype(np.float32)
    pos, means, index = S.hypernodes(S.normalize_coordinates(xy), emb, resolution=1.0)
    assert len(pos) >= 2
    # no cluster mixes the two blobs
    for c in range(len(pos)):
        members = index == c
        assert members[:150].all() or not members[:150].any() or not members[150:].any()
    subs = S.build_subslices(xy, emb, cells_per_subslice=100)
    assert all((s["token_types"] == S.TOKEN_HYPERNODE).sum() == len(pos) for s in subs)


def test_collate_pads_with_type_3():
    xy, emb, clusters = _slice(n=300)
    subs = S.build_subslices(xy, emb, cells_per_subslice=100, knn=6, clusters=clusters)
    subs[0]["labels"] = torch.arange(len(subs[0]["token_types"]))
    for s in subs[1:]:
        s["labels"] = torch.zeros(len(s["token_types"]), dtype=torch.long)
    batch = S.collate_subslices(subs)
    n = max(len(s["token_types"]) for s in subs)
    assert batch["distances"].shape == (len(subs), n, n)
    for i, s in enumerate(subs):
        m = len(s["token_types"])
        assert (batch["token_types"][i, m:] == S.TOKEN_PAD).all() and (batch["cell_index"][i, m:] == -1).all()
        assert (batch["distances"][i, m:] == 0).all() and (batch["distances"][i, :, m:] == 0).all()
        assert torch.equal(batch["distances"][i, :m, :m], s["distances"])
        assert (batch["labels"][i, m:] == -100).all()


def test_shipped_demo_tissue_is_reproducible():
    shipped = S.demo_tissue()
    fresh = S.make_niche_tissue(seed=0)
    assert shipped.shape == fresh.shape == (700, 765)
    np.testing.assert_array_equal(shipped.obsm["spatial"], fresh.obsm["spatial"])
    assert (shipped.obs["region"].to_numpy() == fresh.obs["region"].to_numpy()).all()
    assert (shipped.obs["cell_type"].to_numpy() == fresh.obs["cell_type"].to_numpy()).all()
    # float32 expm1 differs by SIMD width across CPUs (3e-5 seen on AVX2 vs AVX-512): a tolerance, not bits
    difference = abs(shipped.X - fresh.X).max()
    assert difference <= 1e-4 * max(1.0, abs(shipped.X).max()), difference
    assert set(shipped.obs["region"]) == set(S.NICHES)
    S.validate(shipped)
    assert S.tokenize(shipped).n_genes_matched > 600

