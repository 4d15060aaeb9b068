"""Spatial transcriptomics in, SToFM sub-slices out: AnnData (``.h5ad``, 10x Visium) -> Geneformer
tokens -> multi-scale sub-slices -> padded batches.

The pipeline of SToFM (ICML 2025; official code github.com/PharMolix/SToFM, ``preprocessing/``,
``model/extraction.py``), restated:

1. :func:`read_spatial` reads a ``.h5ad`` or a Visium folder; :func:`validate` checks
   ``obsm["spatial"]`` (present, finite, 2 columns, or 3 with z ignored as officially), counts
   (non-negative) and that the slice is not empty.
2. :func:`tokenize` turns each cell into Geneformer's rank-value encoding: counts / total counts
   x 10,000 / the gene's Genecorpus median, nonzero genes ranked in descending order, mapped to
   Geneformer's 25,426-token dictionary (``<pad>`` 0, ``<mask>`` 1), ``<cls>`` (25,426)
   prepended, at most 2,048 tokens. Genes are matched by Ensembl id; symbols go through
   Geneformer's name -> id table and mouse ids through SToFM's mouse -> human map. The tables
   ship as ``samples/spatial/geneformer_vocab.npz`` (converted once from the official pickles;
   no pickle is ever read here).
3. A cell encoder (:mod:`domainfm.models.stofm`) embeds each cell (256-d).
4. :func:`build_subslices` makes the sub-slices: coordinates centred on the bounding box and
   scaled to a diagonal of 100; *micro* scale: the slice tiled into squares of about
   ``cells_per_subslice`` cells (empty squares dropped, squares with >= 2N cells chunked);
   *macro* scale: Leiden on ``alpha`` x normalised xy + (1 - alpha) x normalised PCA(2) of the
   embeddings, each cluster a hypernode at its mean position with its mean embedding. Every
   sub-slice is ``[CLS]`` + all hypernodes + its cells, with kNN distances.
5. :func:`collate_subslices` pads a batch with token type 3.

Per-cell tasks and outputs: :func:`read_cells` (a slice whose ``obs_names`` key an output),
:func:`check_key_added` (an ``obsm`` output slot), :func:`check_anndata`, :func:`obs_labels`, :func:`stratified_split`,
:class:`CellTaskDataset`, and the baselines' :func:`expression_baselines` / :func:`leiden_clusters`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch

__all__ = ["SpatialDataError", "GeneVocabulary", "samples_dir", "read_spatial", "read_visium", "read_h5ad", "validate",
           "check_unique_obs_names", "read_cells", "check_key_added", "check_anndata", "obs_labels", "stratified_split",
           "leiden_clusters", "expression_baselines", "CellTaskDataset",
           "normalize_coordinates", "gene_ensembl_ids", "tokenize", "TokenizedCells", "split_micro",
           "hypernodes", "subslice_distances", "build_subslices", "collate_subslices", "SubsliceDataset",
           "PAD_ID", "MASK_ID", "CLS_ID", "MAX_LENGTH", "TOKEN_CELL", "TOKEN_CLS", "TOKEN_HYPERNODE", "TOKEN_PAD",
           "NON_EDGE_DISTANCE", "umap_connectivities", "make_niche_tissue", "demo_tissue",
           "encode_cells", "resolve_slice"]

PAD_ID, MASK_ID, CLS_ID = 0, 1, 25_426
MAX_LENGTH = 2048
TOKEN_CELL, TOKEN_CLS, TOKEN_HYPERNODE, TOKEN_PAD = 0, 1, 2, 3
#: distance written for pairs that are not kNN neighbours (the official constant)
NON_EDGE_DISTANCE = 100.0
#: the normalised bounding-box diagonal
DIAGONAL = 100.0


class SpatialDataError(ValueError):
    """A spatial slice that cannot be used, with the file and the field named."""


def samples_dir() -> Path:
    return Path(__file__).resolve().parent / "samples" / "spatial"


# ------------------------------------------------------------------------------ vocabulary


@dataclass(frozen=True)
class GeneVocabulary:
    """Geneformer's gene dictionary and the two id maps, from the shipped ``.npz``.

    ``gene_ids[i]`` has token ``i + 2`` and normalisation factor ``gene_medians[i]``.
    """

    gene_ids: np.ndarray
    gene_medians: np.ndarray
    symbol_to_id: dict[str, str]
    mouse_to_human: dict[str, str]
    token_of: dict[str, int]

    @staticmethod
    @lru_cache(maxsize=2)
    def load(path: str | None = None) -> "GeneVocabulary":
        path = Path(path) if path else samples_dir() / "geneformer_vocab.npz"
        with np.load(path, allow_pickle=False) as z:
            genes, medians = z["gene_ids"], z["gene_medians"]
            symbols = dict(zip(z["symbols"].tolist(), z["symbol_gene_ids"].tolist()))
            mouse = dict(zip(z["mouse_gene_ids"].tolist(), z["mouse_to_human"].tolist()))
        token_of = {g: i + 2 for i, g in enumerate(genes.tolist())}
        return GeneVocabulary(genes, medians, symbols, mouse, token_of)

    def __len__(self) -> int:
        return len(self.gene_ids) + 2


# ------------------------------------------------------------------------------ reading


def _source(adata, source: str | None) -> str:
    return source or str(getattr(adata, "filename", None) or "<AnnData>")


def read_visium(folder: str | Path, *, count_file: str = "filtered_feature_bc_matrix.h5"):
    """A 10x Visium (Space Ranger) folder -> AnnData with ``obsm["spatial"]`` (full-resolution
    pixel x, y, as scanpy), counts read with :func:`scanpy.read_10x_h5`.

    Positions come from ``spatial/tissue_positions.csv`` (Space Ranger >= 2, with a header) or
    ``spatial/tissue_positions_list.csv``; unlike :func:`scanpy.read_visium` no image is needed.
    """
    import pandas as pd
    import scanpy as sc

    folder = Path(folder)
    counts = folder / count_file
    if not counts.is_file():
        raise SpatialDataError(f"{folder}: no {count_file} (expected a Space Ranger output folder)")
    adata = sc.read_10x_h5(counts)
    adata.var_names_make_unique()
    spatial_dir = folder / "spatial"
    names = ["barcode", "in_tissue", "array_row", "array_col", "pxl_row_in_fullres", "pxl_col_in_fullres"]
    if (spatial_dir / "tissue_positions.csv").is_file():
        positions = pd.read_csv(spatial_dir / "tissue_positions.csv", header=0, names=names, index_col=0)
        pos_file = spatial_dir / "tissue_positions.csv"
    elif (spatial_dir / "tissue_positions_list.csv").is_file():
        pos_file = spatial_dir / "tissue_positions_list.csv"
        positions = pd.read_csv(pos_file, header=None, names=names, index_col=0)
    else:
        raise SpatialDataError(f"{folder}: no spatial/tissue_positions.csv or spatial/tissue_positions_list.csv")
    missing = adata.obs_names.difference(positions.index)
    if len(missing):
        raise SpatialDataError(f"{pos_file}: {len(missing)} barcode(s) of {counts.name} have no position "
                               f"(first: {missing[0]})")
    positions = positions.loc[adata.obs_names]
    adata.obs[["in_tissue", "array_row", "array_col"]] = positions[["in_tissue", "array_row", "array_col"]].to_numpy()
    adata.obsm["spatial"] = positions[["pxl_col_in_fullres", "pxl_row_in_fullres"]].to_numpy(dtype=np.float64)
    if (spatial_dir / "scalefactors_json.json").is_file():
        adata.uns["spatial"] = {folder.name: {"scalefactors": json.loads((spatial_dir / "scalefactors_json.json").read_text())}}
    return adata


def read_h5ad(path: str | Path):
    """:func:`anndata.read_h5ad`, with a file that is not AnnData (truncated, text, a CSV renamed
    ``.h5ad``, an HDF5 file of another layout) a :class:`SpatialDataError` naming the file."""
    import anndata as ad

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return ad.read_h5ad(path)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - h5py and anndata raise OSError, KeyError, TypeError... on foreign bytes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpatialDataError(f"{path}: not a readable AnnData .h5ad file ({first}); expected a file written by "
                               "anndata/scanpy (adata.write_h5ad)") from None


def check_unique_obs_names(adata, *, source: str | None = None) -> None:
    """Raise :class:`SpatialDataError` when ``obs_names`` repeat.

    Refused rather than renamed: per-cell outputs (a predictions CSV, an embeddings ``.npz``) are
    keyed by these names, and silently suffixing them (``-1``, ``-2``) would give names that
    match nothing in the user's other tables; scanpy users fix it explicitly, once, with
    ``adata.obs_names_make_unique()``.
    """
    names = adata.obs_names
    if names.is_unique:
        return
    repeated = names[names.duplicated()].unique()
    shown = ", ".join(repr(str(n)) for n in repeated[:3]) + (", ..." if len(repeated) > 3 else "")
    raise SpatialDataError(f"{_source(adata, source)}: obs_names has {len(repeated)} duplicated name(s) ({shown}); "
                           "per-cell outputs are keyed by name: make them unique first, e.g. "
                           "adata.obs_names_make_unique() then adata.write_h5ad(...)")


def check_key_added(adata, key_added: str, *, spatial_key: str, embedding_key: str | None, overwrite: bool,
                    cli: bool = False) -> None:
    """Refuse an ``obsm`` output key that would destroy data: the coordinates or embeddings the
    call reads (always), or another existing entry that is not named like an embedding (``X_*``,
    scanpy's convention: a re-run replaces its own output as ``sc.pp.pca`` replaces ``X_pca``)
    unless ``overwrite``. ``cli``: name the command-line options (``--key-added``) in the error."""
    from domainfm.errors import InputError

    where = f"--key-added {key_added!r}" if cli else f"key_added={key_added!r}"
    if key_added in (spatial_key, embedding_key):
        what = "the cell coordinates" if key_added == spatial_key else "the cell embeddings"
        raise InputError(f"{where}: obsm[{key_added!r}] holds {what} this embedding is computed from; "
                         "choose another key (default 'X_stofm')")
    if key_added in adata.obsm and not key_added.startswith("X_") and not overwrite:
        raise InputError(f"{where}: obsm[{key_added!r}] already holds data of shape "
                         f"{tuple(np.shape(adata.obsm[key_added]))}; choose another key (default 'X_stofm'), "
                         f"or pass {'--overwrite' if cli else 'overwrite=True'} to replace it")


def check_anndata(adata, where: str) -> None:
    """Refuse anything but an AnnData where a function writes into one (``where``: the argument,
    named in the error): scanpy-style functions take the object, never a path."""
    import anndata as ad

    if not isinstance(adata, ad.AnnData):
        hint = (": read the file first (domainfm.data_loaders.spatial.read_cells), or pass the path to "
                "domainfm.embed / domainfm.predict") if isinstance(adata, (str, Path)) else ""
        raise TypeError(f"{where}: expected an AnnData, got {type(adata).__name__}{hint}")


def _read_slice_file(path: Path):
    if path.is_dir():
        return read_visium(path)
    if path.suffix == ".h5ad":
        return read_h5ad(path)
    raise SpatialDataError(f"{path}: expected an .h5ad file (AnnData) or a 10x Visium folder, got "
                           f"{path.suffix or 'no suffix'!r}")


def read_spatial(path: str | Path, *, spatial_key: str = "spatial"):
    """Read a ``.h5ad`` file or a Visium folder into AnnData and :func:`validate` it."""
    path = Path(path)
    adata = _read_slice_file(path)
    adata.var_names_make_unique()
    validate(adata, spatial_key=spatial_key, source=str(path))
    return adata


def read_cells(path: str | Path):
    """The slice of a per-cell output (predictions, embeddings): a ``.h5ad`` file or a Visium
    folder whose ``obs_names``, the output's keys, are unique (:func:`check_unique_obs_names`).
    Not validated here: the caller knows which coordinates and layer it reads."""
    path = Path(path)
    adata = _read_slice_file(path)
    check_unique_obs_names(adata, source=str(path))
    return adata


def validate(adata, *, spatial_key: str = "spatial", layer: str | None = None, source: str | None = None) -> None:
    """Raise :class:`SpatialDataError` naming the problem: empty slice, missing/non-finite/
    wrongly shaped ``obsm[spatial_key]``, negative counts."""
    where = _source(adata, source)
    if adata.n_obs == 0:
        raise SpatialDataError(f"{where}: the slice is empty (0 cells/spots)")
    if spatial_key not in adata.obsm:
        raise SpatialDataError(f"{where}: obsm[{spatial_key!r}] is missing (cell coordinates x, y); "
                               f"obsm has {sorted(adata.obsm.keys())}")
    xy = np.asarray(adata.obsm[spatial_key])
    if xy.ndim != 2 or xy.shape[1] not in (2, 3):
        raise SpatialDataError(f"{where}: obsm[{spatial_key!r}] has shape {xy.shape}; expected (n_obs, 2) "
                               "(or 3 columns, z ignored)")
    if not np.issubdtype(xy.dtype, np.number):
        raise SpatialDataError(f"{where}: obsm[{spatial_key!r}] is {xy.dtype}, expected numbers")
    bad = ~np.isfinite(xy[:, :2]).all(axis=1)
    if bad.any():
        raise SpatialDataError(f"{where}: obsm[{spatial_key!r}] has {int(bad.sum())} row(s) with NaN or inf "
                               f"coordinates (first: obs {adata.obs_names[int(np.argmax(bad))]!r})")
    x = adata.layers[layer] if layer is not None else adata.X
    minimum = (x.data.min() if x.nnz else 0) if sp.issparse(x) else (np.min(x) if np.size(x) else 0)
    if minimum < 0:
        field = f"layers[{layer!r}]" if layer else "X"
        raise SpatialDataError(f"{where}: {field} has negative values (min {float(minimum):g}); expected raw "
                               "counts (pass layer= naming a counts layer)")


def normalize_coordinates(xy: np.ndarray) -> np.ndarray:
    """Centre on the bounding-box midpoint and scale its diagonal to 100 (as officially)."""
    xy = np.asarray(xy, dtype=np.float64)[:, :2]
    lo, hi = xy.min(axis=0), xy.max(axis=0)
    diagonal = float(np.hypot(*(hi - lo)))
    # a single point (or all cells at one place) has no extent: keep it at the origin
    scale = DIAGONAL / diagonal if diagonal > 0 else 1.0
    return (xy - (lo + hi) / 2) * scale


# ------------------------------------------------------------------------------ tokenisation


def gene_ensembl_ids(adata, *, gene_id_key: str | None = None, vocab: GeneVocabulary | None = None) -> np.ndarray:
    """Human Ensembl id (or ``""``) per gene of ``adata``.

    ``gene_id_key``: a ``var`` column; default the first of ``ensembl_id``/``gene_ids``/
    ``gene_id`` present, else ``var_names``. Mouse ids (``ENSMUSG``) go through the mouse ->
    human map, symbols through Geneformer's name -> id table (case-insensitively for mouse-style
    symbols such as ``Actb``).
    """
    vocab = vocab or GeneVocabulary.load()
    if gene_id_key is None:
        gene_id_key = next((k for k in ("ensembl_id", "gene_ids", "gene_id") if k in adata.var), None)
    names = adata.var[gene_id_key].astype(str).to_numpy() if gene_id_key else adata.var_names.astype(str).to_numpy()
    upper = {k.upper(): v for k, v in vocab.symbol_to_id.items()}
    out = []
    for name in names:
        base = name.split(".")[0] if name.startswith("ENS") else name
        if base.startswith("ENSMUSG"):
            out.append(vocab.mouse_to_human.get(base, ""))
        elif base.startswith("ENSG"):
            out.append(base)
        else:
            out.append(vocab.symbol_to_id.get(name) or upper.get(name.upper(), ""))
    return np.array(out, dtype=object)


@dataclass
class TokenizedCells:
    """Padded rank-value encodings: ``input_ids (n_obs, L)`` int32 with ``<cls>`` first,
    ``lengths (n_obs,)``; ``n_genes_matched`` of ``n_genes``."""

    input_ids: np.ndarray
    lengths: np.ndarray
    n_genes_matched: int
    n_genes: int

    def attention_mask(self) -> np.ndarray:
        return (np.arange(self.input_ids.shape[1])[None] < self.lengths[:, None]).astype(np.int64)


def tokenize(adata, *, layer: str | None = None, gene_id_key: str | None = None, max_length: int = MAX_LENGTH,
             vocab: GeneVocabulary | None = None, source: str | None = None) -> TokenizedCells:
    """Geneformer rank-value encoding of every cell (vectorised over cells).

    Totals count all genes (as Geneformer's ``n_counts``); the ranking uses only dictionary genes;
    ties keep the order of ``adata.var`` (a stable sort, where the official ``argsort`` breaks ties
    arbitrarily).
    """
    vocab = vocab or GeneVocabulary.load()
    where = _source(adata, source)
    ids = gene_ensembl_ids(adata, gene_id_key=gene_id_key, vocab=vocab)
    tokens = np.array([vocab.token_of.get(g, -1) for g in ids], dtype=np.int64)
    matched = np.flatnonzero(tokens >= 0)
    if matched.size == 0:
        key = gene_id_key or "var_names / var['gene_ids']"
        raise SpatialDataError(f"{where}: none of the {adata.n_vars} genes ({key}, e.g. "
                               f"{list(adata.var_names[:3])}) is in Geneformer's dictionary: 0 matched; "
                               "expected human/mouse Ensembl ids or human gene symbols")
    x = adata.layers[layer] if layer is not None else adata.X
    x = sp.csr_matrix(x, dtype=np.float64)
    totals = np.asarray(x.sum(axis=1)).ravel()
    # duplicated Ensembl ids (e.g. two symbols of one gene): Geneformer keeps every column
    sub = x[:, matched].tocsr()
    sub.eliminate_zeros()
    medians = vocab.gene_medians[tokens[matched] - 2]
    rows = np.repeat(np.arange(sub.shape[0]), np.diff(sub.indptr))
    with np.errstate(divide="ignore", invalid="ignore"):
        values = sub.data / totals[rows] * 10_000 / medians[sub.indices]
    order = np.lexsort((-values, rows))  # by cell, then descending value; stable
    rank = np.arange(order.size) - sub.indptr[rows[order]]
    keep = rank < max_length - 1
    n_genes = np.minimum(np.diff(sub.indptr), max_length - 1)
    width = int(n_genes.max()) + 1 if n_genes.size else 1
    input_ids = np.zeros((sub.shape[0], width), dtype=np.int32)
    input_ids[:, 0] = CLS_ID
    sel = order[keep]
    input_ids[rows[sel], rank[keep] + 1] = tokens[matched][sub.indices[sel]]
    return TokenizedCells(input_ids, (n_genes + 1).astype(np.int64), int(matched.size), int(adata.n_vars))


# ------------------------------------------------------------------------------ sub-slices


def split_micro(xy: np.ndarray, cells_per_subslice: int = 1000) -> list[np.ndarray]:
    """Cell indices of each micro-scale sub-slice (the official ``split_graph``, vectorised).

    A slice of <= N cells is one sub-slice. Otherwise the bounding box is tiled with squares of
    side ``sqrt(area / (n // N + 1))`` (x-major order); empty squares are dropped and a square
    holding >= 2N cells is cut into ``len // N`` consecutive chunks.
    """
    n = len(xy)
    if n <= cells_per_subslice:
        return [np.arange(n)]
    lo, hi = xy.min(axis=0), xy.max(axis=0)
    x_len, y_len = hi - lo
    pieces = n // cells_per_subslice + 1
    side = float(np.sqrt(x_len * y_len / pieces))
    if side <= 0:  # cells on a line: squares along the longer side (the official code divides by 0)
        side = float(max(x_len, y_len)) / pieces
    n_y = int(y_len // side) + 1
    cx = np.floor((xy[:, 0] - lo[0]) / side).astype(np.int64)
    cy = np.floor((xy[:, 1] - lo[1]) / side).astype(np.int64)
    square = cx * n_y + cy
    order = np.argsort(square, kind="stable")
    bounds = np.flatnonzero(np.diff(square[order])) + 1
    out: list[np.ndarray] = []
    for cells in np.split(order, bounds):
        if len(cells) // cells_per_subslice >= 2:
            out.extend(np.array_split(cells, len(cells) // cells_per_subslice))
        else:
            out.append(cells)
    return out


def hypernodes(xy: np.ndarray, embeddings: np.ndarray, *, resolution: float = 1.0, alpha: float = 0.2,
               n_neighbors: int = 10, seed: int = 0, clusters: np.ndarray | None = None):
    """Macro scale: ``(positions (C, 2), embeddings (C, d), cluster per cell (n,))``.

    Leiden (scanpy, igraph flavour as officially; kNN k=10) on ``alpha`` x xy / max|xy| +
    (1 - alpha) x PCA(2) / max|PCA|, unless ``clusters`` (one label per cell) is given.
    """
    n = len(xy)
    if clusters is None:
        if n < 3:
            clusters = np.zeros(n, dtype=np.int64)
        else:
            clusters = _leiden(xy, embeddings, resolution=resolution, alpha=alpha, n_neighbors=n_neighbors, seed=seed)
    clusters = np.asarray(clusters)
    if clusters.shape != (n,):
        raise SpatialDataError(f"clusters has shape {clusters.shape}; expected one label per cell ({n},)")
    labels, index = np.unique(clusters, return_inverse=True)
    counts = np.bincount(index, minlength=len(labels)).astype(np.float64)[:, None]
    positions = np.zeros((len(labels), 2))
    np.add.at(positions, index, xy[:, :2])
    means = np.zeros((len(labels), embeddings.shape[1]))
    np.add.at(means, index, embeddings)
    return positions / counts, means / counts, index


def _max_norm(a: np.ndarray) -> np.ndarray:
    scale = float(np.sqrt(np.max(np.sum(a ** 2, axis=1))))
    return a / scale if scale > 0 else a


def _leiden(xy, embeddings, *, resolution, alpha, n_neighbors, seed) -> np.ndarray:
    import anndata as ad
    import scanpy as sc

    try:
        import igraph  # noqa: F401
    except ImportError:
        raise ImportError("SToFM's macro scale runs Leiden through scanpy's igraph flavour, which needs "
                          "python-igraph: pip install igraph (or pass clusters= to build_subslices)") from None
    emb = ad.AnnData(np.asarray(embeddings, dtype=np.float32))
    sc.pp.pca(emb, n_comps=2, svd_solver="arpack", random_state=seed)
    features = alpha * _max_norm(np.asarray(xy, dtype=np.float64)) + (1 - alpha) * _max_norm(
        emb.obsm["X_pca"].astype(np.float64))
    return leiden_clusters(features, n_neighbors=n_neighbors, resolution=resolution, seed=seed)


def leiden_clusters(points: np.ndarray, *, n_neighbors: int = 10, resolution: float = 1.0, seed: int = 0) -> np.ndarray:
    """Leiden clusters ``(n,)`` of ``points``' kNN graph (:func:`umap_connectivities`), as the
    official code runs it: scanpy's igraph flavour, 2 iterations, undirected."""
    import anndata as ad
    import scanpy as sc

    cells = ad.AnnData(np.zeros((len(points), 0), dtype=np.float32))
    adjacency = umap_connectivities(np.asarray(points, dtype=np.float64), n_neighbors=n_neighbors)
    sc.tl.leiden(cells, adjacency=adjacency, resolution=resolution, flavor="igraph", n_iterations=2,
                 directed=False, random_state=seed)
    return cells.obs["leiden"].to_numpy().astype(np.int64)


def umap_connectivities(points: np.ndarray, *, n_neighbors: int = 10) -> sp.csr_matrix:
    """The graph ``sc.pp.neighbors`` builds (exact kNN, the point itself counted in
    ``n_neighbors``; UMAP's fuzzy-simplicial-set weights, local connectivity 1, fuzzy union),
    restated in numpy: scanpy's own path compiles UMAP's numba kernels, ~30 s per process here.
    """
    from sklearn.neighbors import NearestNeighbors

    n = len(points)
    k = max(2, min(n_neighbors, n))
    dist, idx = NearestNeighbors(n_neighbors=k).fit(points).kneighbors(points)
    target = np.log2(k)
    others = dist[:, 1:]
    positive = np.where(others > 0, others, np.inf)
    rho = np.where(np.isfinite(positive.min(axis=1)), positive.min(axis=1), 0.0)
    lo, hi, mid = np.zeros(n), np.full(n, np.inf), np.ones(n)
    for _ in range(64):  # UMAP's smooth_knn_dist bisection, all points at once
        gap = others - rho[:, None]
        psum = np.where(gap > 0, np.exp(-np.maximum(gap, 0) / mid[:, None]), 1.0).sum(axis=1)
        done = np.abs(psum - target) < 1e-5
        over = psum > target
        hi = np.where(~done & over, mid, hi)
        lo = np.where(~done & ~over, mid, lo)
        mid = np.where(done, mid, np.where(np.isinf(hi), np.where(over, mid, mid * 2), (lo + hi) / 2))
    mean_all = dist.mean()
    mean_i = dist.mean(axis=1)
    sigma = np.where(rho > 0, np.maximum(mid, 1e-3 * mean_i), np.maximum(mid, 1e-3 * mean_all))
    gap = dist - rho[:, None]
    weights = np.where(gap <= 0, 1.0, np.exp(-np.maximum(gap, 0) / sigma[:, None]))
    weights[idx == np.arange(n)[:, None]] = 0.0
    graph = sp.csr_matrix((weights.ravel(), (np.repeat(np.arange(n), k), idx.ravel())), shape=(n, n))
    product = graph.multiply(graph.T)
    graph = (graph + graph.T - product).tocsr()
    graph.eliminate_zeros()
    return graph


def subslice_distances(positions: np.ndarray, token_types: np.ndarray, *, knn: int = 50) -> np.ndarray:
    """The official sub-slice distance matrix for tokens at ``positions`` (``[CLS]`` first, at 0).

    kNN (scanpy's ``n_neighbors = min(knn, n - 1)``, the point itself included, so k - 1
    neighbours; the ``[CLS]`` point takes part in the search, as officially), made symmetric;
    hypernode rows/columns hold all distances; non-neighbours 100; the ``[CLS]`` row/column and
    the diagonal 0. A distance that is exactly 0 (two tokens at one place) counts as a
    non-neighbour, as officially.
    """
    from sklearn.neighbors import NearestNeighbors

    n = len(positions)
    d = np.zeros((n, n), dtype=np.float32)
    if n > 1:
        k = min(knn, n - 1)
        dist, idx = NearestNeighbors(n_neighbors=k).fit(positions).kneighbors(positions)
        rows = np.repeat(np.arange(n), k)
        d[rows, idx.ravel()] = dist.ravel()
        hyper = np.flatnonzero(token_types == TOKEN_HYPERNODE)
        if hyper.size:
            full = np.sqrt(((positions[hyper, None, :] - positions[None, :, :]) ** 2).sum(-1))
            d[hyper, :] = full
            d[:, hyper] = full.T
    d[d == 0] = NON_EDGE_DISTANCE
    d = np.where(d == NON_EDGE_DISTANCE, d.T, d)  # symmetric: an edge in either direction counts
    d[0, :] = 0.0
    d[:, 0] = 0.0
    np.fill_diagonal(d, 0.0)
    return d


def build_subslices(spatial: np.ndarray, cell_embeddings: np.ndarray, *, cells_per_subslice: int = 1000,
                    leiden_resolution: float = 1.0, alpha: float = 0.2, knn: int = 50, seed: int = 0,
                    clusters: np.ndarray | None = None) -> list[dict[str, torch.Tensor]]:
    """One dict per sub-slice: ``token_embeddings (T, d)``, ``distances (T, T)``,
    ``token_types (T,)``, ``cell_index (T,)`` (row in the slice, -1 for ``[CLS]`` and
    hypernodes) and ``spatial (T, 2)`` (normalised). Every cell is in exactly one sub-slice;
    every sub-slice holds the same hypernodes.
    """
    xy = np.asarray(spatial, dtype=np.float64)
    emb = np.asarray(cell_embeddings, dtype=np.float32)
    if xy.ndim != 2 or xy.shape[1] < 2 or len(xy) == 0:
        raise SpatialDataError(f"spatial has shape {xy.shape}; expected (n_cells >= 1, 2)")
    if emb.ndim != 2 or len(emb) != len(xy):
        raise SpatialDataError(f"cell_embeddings has shape {emb.shape}; expected ({len(xy)}, d)")
    if not np.isfinite(xy[:, :2]).all():
        raise SpatialDataError("spatial has NaN or inf coordinates")
    if cells_per_subslice < 1:
        raise ValueError(f"cells_per_subslice={cells_per_subslice}: must be >= 1")
    xy = normalize_coordinates(xy)
    hyper_xy, hyper_emb, _ = hypernodes(xy, emb, resolution=leiden_resolution, alpha=alpha, seed=seed,
                                        clusters=clusters)
    n_hyper = len(hyper_xy)
    out = []
    for cells in split_micro(xy, cells_per_subslice):
        positions = np.concatenate([np.zeros((1, 2)), hyper_xy, xy[cells]])
        types = np.full(len(positions), TOKEN_CELL, dtype=np.int64)
        types[0] = TOKEN_CLS
        types[1:1 + n_hyper] = TOKEN_HYPERNODE
        tokens = np.concatenate([np.zeros((1, emb.shape[1]), np.float32), hyper_emb.astype(np.float32), emb[cells]])
        out.append({
            "token_embeddings": torch.from_numpy(tokens),
            "distances": torch.from_numpy(subslice_distances(positions, types, knn=knn)),
            "token_types": torch.from_numpy(types),
            "cell_index": torch.from_numpy(np.concatenate([np.full(1 + n_hyper, -1), cells]).astype(np.int64)),
            "spatial": torch.from_numpy(positions.astype(np.float32)),
        })
    return out


_PAD_VALUES = {"token_types": TOKEN_PAD, "cell_index": -1, "labels": -100}


def collate_subslices(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad sub-slices to the longest: embeddings/coordinates/distances 0, token type 3,
    ``cell_index`` -1, per-token ``labels`` -100; square ``(T, T)`` entries padded on both axes."""
    if not items:
        raise ValueError("collate_subslices: empty batch")
    n = max(int(item["token_types"].shape[0]) for item in items)
    batch: dict[str, torch.Tensor] = {}
    for key in items[0]:
        first = items[0][key]
        square = first.dim() == 2 and first.shape[0] == first.shape[1] == items[0]["token_types"].shape[0] \
            and key == "distances"
        shape = (len(items), n, n) if square else (len(items), n, *first.shape[1:])
        out = torch.full(shape, _PAD_VALUES.get(key, 0), dtype=first.dtype)
        for i, item in enumerate(items):
            value = item[key]
            m = value.shape[0]
            if square:
                out[i, :m, :m] = value
            else:
                out[i, :m] = value
        batch[key] = out
    return batch


class SubsliceDataset(torch.utils.data.Dataset):
    """A list of sub-slice dicts as a dataset (batched with :func:`collate_subslices`)."""

    def __init__(self, subslices: Sequence[dict[str, Any]]):
        self.subslices = list(subslices)

    def __len__(self) -> int:
        return len(self.subslices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.subslices[index]


class CellTaskDataset(torch.utils.data.Dataset):
    """Sub-slices whose cell tokens carry the label of the split's cells (-100 elsewhere)."""

    def __init__(self, subslices, labels: np.ndarray, cells: np.ndarray):
        self.subslices = list(subslices)
        self.labels = np.full(len(labels), -100, dtype=np.int64)
        self.labels[cells] = labels[cells]
        self.n_labelled = int(len(cells))

    def __len__(self) -> int:
        return len(self.subslices)

    def __getitem__(self, i):
        item = dict(self.subslices[i])
        index = item["cell_index"].numpy()
        labels = np.full(len(index), -100, dtype=np.int64)
        labels[index >= 0] = self.labels[index[index >= 0]]
        item["labels"] = torch.from_numpy(labels)
        return item


@torch.no_grad()
def encode_cells(tokens: TokenizedCells, encoder: torch.nn.Module, *, batch_size: int = 32,
                 device: str | torch.device | None = None) -> np.ndarray:
    """Cell embeddings ``(n_obs, d)`` from a cell encoder (``encoder(input_ids, attention_mask)``),
    in ``obs`` order. Cells are batched by length so that padding stays small."""
    device = torch.device(device) if device is not None else next(encoder.parameters()).device
    was_training = encoder.training
    encoder.eval()
    order = np.argsort(tokens.lengths, kind="stable")
    out = None
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        width = int(tokens.lengths[rows].max())
        ids = torch.from_numpy(tokens.input_ids[rows, :width].astype(np.int64)).to(device)
        mask = (torch.arange(width, device=device)[None] < torch.from_numpy(tokens.lengths[rows]).to(device)[:, None])
        if hasattr(encoder, "pool"):  # a CellEncoder: its embedding even when it carries a classifier head
            emb = encoder.pool(encoder.forward_features(ids, mask.long()))
        else:
            emb = encoder(ids, mask.long())
        emb = emb.float().cpu().numpy()
        if out is None:
            out = np.zeros((len(order), emb.shape[1]), dtype=np.float32)
        out[rows] = emb
    encoder.train(was_training)
    return out


def resolve_slice(path: str | Path):
    """``"@demo"`` -> :func:`demo_tissue`; ``"@visium_tiny"`` -> the shipped Visium folder; else
    :func:`read_spatial`."""
    if str(path) == "@demo":
        return demo_tissue()
    if str(path) == "@visium_tiny":
        return read_spatial(samples_dir() / "visium_tiny")
    return read_spatial(Path(path).expanduser())


def obs_labels(adata, key: str, *, source: str | None = None,
               option: str = "label_key") -> tuple[np.ndarray, list[str]]:
    """``(labels (n_obs,), classes)``: ``obs[key]`` as text, encoded as indices into its sorted
    distinct values."""
    if key not in adata.obs:
        raise SpatialDataError(f"{_source(adata, source)}: obs[{key!r}] is missing ({option}); "
                               f"obs has {list(adata.obs.columns)}")
    raw = adata.obs[key].astype(str).to_numpy()
    classes = sorted(set(raw))
    return np.searchsorted(np.array(classes), raw), classes


def stratified_split(labels: np.ndarray, val_fraction: float, test_fraction: float, *,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Sorted cell indices of ``train`` / ``val`` / ``test``, drawn at random within each class
    (every class in train when it has >= 3 cells)."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val, n_test = int(round(len(idx) * val_fraction)), int(round(len(idx) * test_fraction))
        parts["val"].append(idx[:n_val])
        parts["test"].append(idx[n_val:n_val + n_test])
        parts["train"].append(idx[n_val + n_test:])
    return {k: np.sort(np.concatenate(v)) for k, v in parts.items()}


def expression_baselines(adata, *, n_components: int = 50, spatial_key: str = "spatial", layer: str | None = None,
                         n_smooth: int = 10) -> dict[str, np.ndarray]:
    """The cell features a scanpy user would try first: ``pca``, PCA of log-normalised expression
    (``normalize_total`` to 1e4, ``log1p``), and ``pca_smoothed``, its mean over each cell's
    ``n_smooth`` nearest cells (itself included)."""
    import scanpy as sc
    from sklearn.neighbors import NearestNeighbors

    work = sc.AnnData(adata.layers[layer] if layer else adata.X)
    sc.pp.normalize_total(work, target_sum=1e4)
    sc.pp.log1p(work)
    n = max(2, min(n_components, min(work.shape) - 1))
    sc.pp.pca(work, n_comps=n, random_state=0)
    pca = np.asarray(work.obsm["X_pca"], dtype=np.float64)
    xy = np.asarray(adata.obsm[spatial_key])[:, :2]
    _, idx = NearestNeighbors(n_neighbors=min(n_smooth, len(xy))).fit(xy).kneighbors(xy)
    return {"pca": pca, "pca_smoothed": pca[idx].mean(axis=1)}


# ------------------------------------------------------------------------------ embedded default data

#: the four niches of the semi-synthetic tissue, as vertical bands of a 1,000 x 1,000 square
NICHES = ("B follicle", "T zone", "myeloid zone", "mixed stroma")
# preference of each pbmc68k_reduced cell type for the niches (rows sum to 1)
_NICHE_PREFERENCE = {
    "CD19+ B": (0.85, 0.05, 0.05, 0.05),
    "CD4+/CD25 T Reg": (0.10, 0.70, 0.05, 0.15),
    "CD4+/CD45RO+ Memory": (0.10, 0.70, 0.05, 0.15),
    "CD4+/CD45RA+/CD25- Naive T": (0.10, 0.75, 0.05, 0.10),
    "CD8+ Cytotoxic T": (0.05, 0.60, 0.05, 0.30),
    "CD8+/CD45RA+ Naive Cytotoxic": (0.05, 0.65, 0.05, 0.25),
    "CD56+ NK": (0.05, 0.20, 0.10, 0.65),
    "CD14+ Monocyte": (0.05, 0.05, 0.80, 0.10),
    "Dendritic": (0.05, 0.15, 0.55, 0.25),
    "CD34+": (0.10, 0.10, 0.20, 0.60),
}


def make_niche_tissue(seed: int = 0):
    """A semi-synthetic tissue: scanpy's bundled ``pbmc68k_reduced`` (700 real PBMC profiles, 765
    genes, 10 annotated cell types) placed in four spatial niches.

    Each cell draws a niche from its type's preference (``_NICHE_PREFERENCE``) and a uniform
    position inside that niche's band (bands of width 250 across a 1,000 x 1,000 square). The
    expression is ``expm1`` of the dataset's ``raw`` (log-normalised; it ships no raw counts), so
    it is normalised expression, not counts. Labels: ``obs["region"]`` (the niche) and
    ``obs["cell_type"]``. The tissue is synthetic: only the profiles and cell types are real.
    """
    import anndata as ad
    import scanpy as sc

    pbmc = sc.datasets.pbmc68k_reduced()
    raw = pbmc.raw.to_adata()
    x = sp.csr_matrix(raw.X, dtype=np.float32)
    x.data = np.expm1(x.data).astype(np.float32)
    cell_types = pbmc.obs["bulk_labels"].astype(str).to_numpy()
    rng = np.random.default_rng(seed)
    prefs = np.array([_NICHE_PREFERENCE[t] for t in cell_types])
    region = (rng.random(len(cell_types))[:, None] > np.cumsum(prefs, axis=1)).sum(axis=1)
    xy = np.stack([region * 250.0 + rng.uniform(0, 250, len(region)), rng.uniform(0, 1000, len(region))], axis=1)
    adata = ad.AnnData(x, var=raw.var[[]].copy())
    adata.obs_names = pbmc.obs_names.astype(str)
    adata.obs["cell_type"] = cell_types
    adata.obs["region"] = np.array(NICHES)[region]
    adata.obsm["spatial"] = xy
    adata.uns["source"] = ("semi-synthetic: scanpy pbmc68k_reduced profiles (expm1 of raw) placed in 4 niches by "
                           f"domainfm.data_loaders.spatial.make_niche_tissue(seed={seed})")
    return adata


def demo_tissue():
    """The shipped semi-synthetic tissue (``samples/spatial/pbmc68k_niches.h5ad``)."""
    import scanpy as sc

    return sc.read_h5ad(samples_dir() / "pbmc68k_niches.h5ad")
