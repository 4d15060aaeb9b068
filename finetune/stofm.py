"""SToFM downstream: ``embed`` (AnnData in, ``obsm["X_stofm"]`` out), per-cell classification
(region segmentation / cell-type annotation) on the experiment layer, zero-shot clustering, and
the baselines a scanpy user would run first.

- :func:`embed`: scanpy-style; ``adata`` first, keyword-only options, cell embeddings written to
  ``adata.obsm[key_added]`` in ``obs_names`` order; nothing else in ``adata`` changes.
- Per-cell classification: the slice's sub-slices are the context; cells are split at random
  (stratified) into train / val / test and only the split's cells carry labels (a transductive
  split: every cell's expression is visible as context, never a held-out label). The shared
  supervised recipe trains a per-token head (full / LoRA / linear probe); balanced accuracy,
  macro-F1 and Cohen's kappa are reported (selection: kappa).
- Protocols (per arm, on the model before adaptation): zero-shot clustering (Leiden on the cell
  embeddings; ARI, NMI against the labels) and, on the same split, the baselines: PCA of
  log-normalised expression and its spatially smoothed variant (mean over the 10 nearest cells),
  clustered the same way and classified by logistic regression.

The embedded default (``domainfm finetune stofm``) runs on the shipped **semi-synthetic** tissue
(real pbmc68k_reduced profiles placed in 4 spatial niches; labels = niche): see
``configs/stofm/finetune.yaml``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm.experiment.inference import positive_int  # argparse types
from domainfm.data_loaders import spatial
from domainfm.engine import TrainConfig
from domainfm.errors import InputError
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment.supervised import SupervisedRecipe
from domainfm.lora.settings import LoraSettings
from domainfm.pretrain.stofm import CellEncoderSection, SliceSettings, build_cell_encoder

__all__ = ["Config", "DataSection", "FAMILY", "embed", "subslice_features", "build_task", "clustering_protocol",
           "CellTaskDataset", "collate_cells", "run", "evaluate", "LORA_TARGETS", "predict", "predict_main",
           "embed_main", "retained_cell_types"]

LORA_TARGETS = ["encoder.layers.*.self_attn.q_proj", "encoder.layers.*.self_attn.k_proj",
                "encoder.layers.*.self_attn.v_proj", "encoder.layers.*.self_attn.out_proj",
                "encoder.layers.*.fc1", "encoder.layers.*.fc2"]


# ------------------------------------------------------------------------------ embed


def _resolve_model(model) -> tuple[nn.Module, nn.Module | None]:
    """An nn.Module, a registered name, a save_pretrained folder, the official checkpoint folder
    (``se2transformer.pth`` + ``cell_encoder/``) or a ``se2transformer.pth`` file."""
    from domainfm import create_model, list_models
    from domainfm.models.stofm import load_official

    if isinstance(model, nn.Module):
        return model, None
    path = Path(str(model)).expanduser()
    if path.is_dir() and (path / "se2transformer.pth").is_file():
        return load_official(path, cell_encoder=(path / "cell_encoder").is_dir())
    if path.is_dir():
        return create_model(path), None
    if path.is_file():
        return create_model("stofm-base", pretrained=str(path)), None
    if str(model) in list_models("stofm*"):
        warnings.warn(f"embed(model={model!r}): a registered name without weights gives a randomly initialised "
                      "model; pass the official checkpoint folder (Google Drive, see the model card) or a "
                      "fine-tuned folder", stacklevel=3)
        return create_model(str(model), n_outputs=None), None
    raise FileNotFoundError(f"model={model!r}: not a model, a registered stofm variant, a folder or a checkpoint file")


@torch.no_grad()
def subslice_features(model: nn.Module, subslices, n_cells: int, *, batch_size: int = 4) -> np.ndarray:
    """Cell representations ``(n_cells, d)`` (the last layer's cell tokens) from sub-slices."""
    model.eval()
    device = next(model.parameters()).device
    out = None
    for start in range(0, len(subslices), batch_size):
        batch = spatial.collate_subslices(subslices[start:start + batch_size])
        features = model.forward_features(batch["token_embeddings"].to(device), batch["distances"].to(device),
                                          batch["token_types"].to(device)).float().cpu()
        if out is None:
            out = np.zeros((n_cells, features.shape[-1]), dtype=np.float32)
        index = batch["cell_index"]
        cells = index >= 0
        out[index[cells].numpy()] = features[cells].numpy()
    return out


def _check_key_added(adata, key_added: str, *, spatial_key: str, embedding_key: str | None, overwrite: bool,
                     option: str = "key_added=") -> None:
    """Refuse an output key that would destroy data: the coordinates or embeddings this call reads
    (always), or another existing ``obsm`` entry that is not named like an embedding (``X_*``,
    scanpy's convention: a re-run replaces its own output as ``sc.pp.pca`` replaces ``X_pca``)
    unless ``overwrite``. Checked before any model is loaded."""
    where = f"{option}{key_added!r}"
    if key_added in (spatial_key, embedding_key):
        what = "the cell coordinates" if key_added == spatial_key else "the cell embeddings"
        raise InputError(f"{where}: obsm[{key_added!r}] holds {what} this embedding is computed from; "
                         "choose another key (default 'X_stofm')")
    if key_added in adata.obsm and not key_added.startswith("X_") and not overwrite:
        raise InputError(f"{where}: obsm[{key_added!r}] already holds data of shape "
                         f"{tuple(np.shape(adata.obsm[key_added]))}; choose another key (default 'X_stofm'), "
                         "or pass overwrite=True to replace it")


def embed(adata, model: str | nn.Module = "stofm-base", *, key_added: str = "X_stofm", overwrite: bool = False,
          batch_size: int = 4, cell_encoder: str | nn.Module | None = None, embedding_key: str | None = None,
          spatial_key: str = "spatial", layer: str | None = None, gene_id_key: str | None = None,
          cells_per_subslice: int = 1000, leiden_resolution: float = 1.0, alpha: float = 0.2, knn: int = 50,
          seed: int = 0) -> None:
    """Write SToFM cell embeddings ``(n_obs, d)`` to ``adata.obsm[key_added]``.

    Args:
        adata: a slice with counts in ``X`` (or ``layer``) and ``obsm[spatial_key]``.
        model: the official checkpoint folder (``se2transformer.pth`` [+ ``config.json``,
            ``cell_encoder/``]), a ``se2transformer.pth`` file, a ``save_pretrained`` folder, a
            registered name (random weights, with a warning) or a model.
        key_added: the ``obsm`` key written. It may not name this call's inputs
            (``spatial_key``, ``embedding_key``); an existing entry not named like an embedding
            (``X_*``, which a re-run replaces) is replaced only with ``overwrite=True``
            (:class:`~domainfm.errors.InputError` otherwise, before anything is computed).
        cell_encoder: the official ``cell_encoder/`` folder, a ``save_pretrained`` folder, a
            registered name or a model; default: the one in the checkpoint folder, else a
            randomly initialised ``stofm-cell-encoder`` (with a warning).
        embedding_key: use precomputed cell-encoder embeddings from ``obsm`` instead.
        cells_per_subslice, leiden_resolution, alpha, knn, seed: sub-slice construction
            (:func:`domainfm.data_loaders.spatial.build_subslices`).
    """
    spatial.validate(adata, spatial_key=spatial_key, layer=layer)
    _check_key_added(adata, key_added, spatial_key=spatial_key, embedding_key=embedding_key, overwrite=overwrite)
    transformer, bundled = _resolve_model(model)
    if embedding_key is not None:
        if embedding_key not in adata.obsm:
            raise spatial.SpatialDataError(f"obsm[{embedding_key!r}] is missing (embedding_key)")
        cells = np.asarray(adata.obsm[embedding_key], dtype=np.float32)
    else:
        encoder = cell_encoder if isinstance(cell_encoder, nn.Module) else bundled
        if encoder is None:
            if cell_encoder is None:
                warnings.warn("embed: no cell encoder given; using a randomly initialised stofm-cell-encoder",
                              stacklevel=2)
            encoder = build_cell_encoder(_encoder_section(cell_encoder))
        tokens = spatial.tokenize(adata, layer=layer, gene_id_key=gene_id_key)
        cells = spatial.encode_cells(tokens, encoder, batch_size=32)
    subs = spatial.build_subslices(np.asarray(adata.obsm[spatial_key])[:, :2], cells,
                                   cells_per_subslice=cells_per_subslice, leiden_resolution=leiden_resolution,
                                   alpha=alpha, knn=knn, seed=seed)
    adata.obsm[key_added] = subslice_features(transformer, subs, adata.n_obs, batch_size=batch_size)


def _encoder_section(cell_encoder) -> CellEncoderSection:
    if cell_encoder is None:
        return CellEncoderSection()
    from domainfm import list_models

    if str(cell_encoder) in list_models("stofm-cell-encoder*"):
        return CellEncoderSection(name=str(cell_encoder))
    return CellEncoderSection(pretrained=str(cell_encoder))


# ------------------------------------------------------------------------------ task


@dataclass
class DataSection(SliceSettings):
    """``path``: a ``.h5ad`` / Visium folder, or ``@demo`` (the shipped semi-synthetic tissue);
    ``label_key``: the ``obs`` column to predict (``region`` or ``cell_type`` on the demo); the
    sub-slice keys are :class:`~domainfm.pretrain.stofm.SliceSettings`."""

    path: str = "@demo"
    label_key: str = "region"
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    split_seed: int = 0

    def __post_init__(self):
        if not (0 < self.val_fraction < 1 and 0 <= self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1):
            raise ValueError(f"data.val_fraction={self.val_fraction}, data.test_fraction={self.test_fraction}: "
                             "expected fractions in (0, 1) leaving cells to train on")


@dataclass
class Config(ExperimentConfig):
    data: DataSection = field(default_factory=DataSection)
    #: zero-shot clustering / baselines: Leiden resolution and PCA components
    cluster_resolution: float = 1.0
    pca_components: int = 50
    #: retained capability (forgetting): an obs column the task does not train on
    retained_label_key: str = "cell_type"
    model: ModelSection = field(default_factory=lambda: ModelSection(name="stofm-base", pretrained=None))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(
        lora=LoraSettings(targets=list(LORA_TARGETS), rank=8, alpha=16.0)))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=30, batch_size=2, lr=1e-4, head_lr=1e-3, head_patterns=["head.*"], weight_decay=0.01,
        clip_grad_norm=1.0, schedule="cosine", drop_last=False))


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


def collate_cells(items):
    """``(x, y)`` for the shared recipe: ``x`` the padded sub-slices (with per-token ``labels``),
    ``y`` the labels of the labelled cells in (sub-slice, token) order."""
    batch = spatial.collate_subslices(items)
    return batch, batch["labels"][batch["labels"] != -100]


def cell_logits(model, x):
    """Logits of the labelled cells, in the order of :func:`collate_cells`' ``y``."""
    logits = model(x["token_embeddings"], x["distances"], x["token_types"])
    return logits[x["labels"] != -100]


class CellRecipe(SupervisedRecipe):
    """The shared multiclass recipe, with macro-F1 added to its metric set."""

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """One loss per *sub-slice* (the dataset item FLOW weights): the mean loss of its labelled
        cells, ``(B,)``. FLOW's paper weights training examples; here an example is a sub-slice,
        the unit the data loader draws (a per-cell weight would need per-token weights in the
        weighted dataset). The step's loss is the mean over all labelled cells of the batch, so
        the two means agree when every sub-slice has the same number of labelled cells."""
        x, y = batch
        per_cell = self._loss(self.forward_fn(model, x), y, reduction="none").reshape(len(y))
        owner = (x["labels"] != -100).nonzero()[:, 0]  # row-major, the order cell_logits selects in
        n = x["labels"].shape[0]
        total = per_cell.new_zeros(n).index_add(0, owner, per_cell)
        return total / torch.bincount(owner, minlength=n).clamp(min=1).to(per_cell.dtype)

    def logits_per_item(self, batch) -> torch.Tensor:
        """How many of :meth:`logits`' rows each sub-slice holds (its labelled cells): DaWin weighs
        a sub-slice, whose cells attend to each other, by the mean lambda of its cells."""
        x, _ = batch
        return (x["labels"] != -100).sum(1)

    def metrics(self, outputs):
        from sklearn.metrics import f1_score

        result = super().metrics(outputs)
        pred = outputs["scores"].argmax(-1).cpu().numpy()
        result["f1_macro"] = float(f1_score(outputs["target"].cpu().numpy(), pred, average="macro", zero_division=0))
        return result


def _split(labels: np.ndarray, val: float, test: float, seed: int):
    """Stratified random split of cell indices (every class in train when it has >= 3 cells)."""
    rng = np.random.default_rng(seed)
    parts = {"train": [], "val": [], "test": []}
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val, n_test = int(round(len(idx) * val)), int(round(len(idx) * test))
        parts["val"].append(idx[:n_val])
        parts["test"].append(idx[n_val:n_val + n_test])
        parts["train"].append(idx[n_val + n_test:])
    return {k: np.sort(np.concatenate(v)) for k, v in parts.items()}


def build_task(cfg: Config) -> TaskData:
    from domainfm.pretrain.stofm import slice_subslices

    data = cfg.data
    adata = spatial.resolve_slice(data.path)
    if data.label_key not in adata.obs:
        raise spatial.SpatialDataError(f"{data.path}: obs[{data.label_key!r}] is missing (data.label_key); "
                                       f"obs has {list(adata.obs.columns)}")
    raw_labels = adata.obs[data.label_key].astype(str).to_numpy()
    classes = sorted(set(raw_labels))
    labels = np.searchsorted(np.array(classes), raw_labels)
    subs, cell_emb = slice_subslices(adata, data, seed=data.split_seed, source=str(data.path))
    split = _split(labels, data.val_fraction, data.test_fraction, data.split_seed)
    datasets = {k: CellTaskDataset(subs, labels, v) if len(v) else None for k, v in split.items()}
    demo = str(data.path) == "@demo"
    note = ("synthetic: semi-synthetic tissue; real pbmc68k_reduced profiles and cell types, niches (regions) "
            "assigned by make_niche_tissue(seed=0)") if demo else "recorded"
    info = {"source": str(data.path), "cells": int(adata.n_obs), "genes": int(adata.n_vars),
            "label_key": data.label_key, "classes": classes, "subslices": len(subs),
            "split": {k: int(len(v)) for k, v in split.items()},
            "split_kind": "transductive: random stratified cells; all cells are context, labels only for the split"}
    return TaskData(datasets["train"], datasets["val"], datasets["test"], task="multiclass", n_outputs=len(classes),
                    collate_fn=collate_cells, forward_fn=cell_logits, labels=note, info=info,
                    extras={"adata": adata, "labels": labels, "split": split, "subslices": subs,
                            "cell_embeddings": cell_emb})


# ------------------------------------------------------------------------------ protocols


def _cluster_scores(features: np.ndarray, labels: np.ndarray, resolution: float, seed: int) -> dict[str, float]:
    import anndata as ad
    import scanpy as sc
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    cells = ad.AnnData(np.zeros((len(features), 0), dtype=np.float32))
    adjacency = spatial.umap_connectivities(np.asarray(features, dtype=np.float64), n_neighbors=15)
    sc.tl.leiden(cells, adjacency=adjacency, resolution=resolution, flavor="igraph", n_iterations=2,
                 directed=False, random_state=seed)
    found = cells.obs["leiden"].to_numpy()
    return {"ari": float(adjusted_rand_score(labels, found)), "nmi": float(normalized_mutual_info_score(labels, found)),
            "clusters": int(len(set(found)))}


def _probe_scores(features, labels, split) -> dict[str, Any]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score, cohen_kappa_score, f1_score
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(features[split["train"]])
    clf = LogisticRegression(max_iter=2000).fit(scaler.transform(features[split["train"]]), labels[split["train"]])
    out = {}
    for name in ("val", "test"):
        idx = split[name]
        if len(idx) == 0:
            continue
        pred = clf.predict(scaler.transform(features[idx]))
        out[name] = {"balanced_accuracy": float(balanced_accuracy_score(labels[idx], pred)),
                     "f1_macro": float(f1_score(labels[idx], pred, average="macro", zero_division=0)),
                     "cohen_kappa": float(cohen_kappa_score(labels[idx], pred))}
    return out


def _baseline_features(adata, n_components: int, spatial_key: str, layer: str | None):
    """PCA of log-normalised expression, and the mean of it over each cell's 10 nearest cells."""
    import scanpy as sc
    from sklearn.neighbors import NearestNeighbors

    work = sc.AnnData(adata.layers[layer] if layer else adata.X)
    sc.pp.normalize_total(work, target_sum=1e4)
    sc.pp.log1p(work)
    n = max(2, min(n_components, min(work.shape) - 1))
    sc.pp.pca(work, n_comps=n, random_state=0)
    pca = np.asarray(work.obsm["X_pca"], dtype=np.float64)
    xy = np.asarray(adata.obsm[spatial_key])[:, :2]
    _, idx = NearestNeighbors(n_neighbors=min(10, len(xy))).fit(xy).kneighbors(xy)
    return {"pca": pca, "pca_smoothed": pca[idx].mean(axis=1)}


def clustering_protocol(ctx) -> dict[str, Any]:
    """Zero-shot Leiden on the model's cell embeddings (ARI, NMI) beside the PCA baselines, and
    the baselines' logistic-regression scores on the same split (computed once, shared by arms)."""
    cfg, task = ctx.cfg, ctx.task
    labels, split = task.extras["labels"], task.extras["split"]
    features = subslice_features(ctx.model, task.extras["subslices"], len(labels), batch_size=cfg.train.batch_size)
    result = {"zero_shot": _cluster_scores(features, labels, cfg.cluster_resolution, cfg.train.seed)}
    if "baselines" not in task.extras:
        base = _baseline_features(task.extras["adata"], cfg.pca_components, cfg.data.spatial_key, cfg.data.layer)
        task.extras["baselines"] = {
            name: {"clustering": _cluster_scores(x, labels, cfg.cluster_resolution, cfg.train.seed),
                   "logistic_regression": _probe_scores(x, labels, split)}
            for name, x in base.items()}
        task.extras["baselines"]["cell_encoder_only"] = {
            "clustering": _cluster_scores(task.extras["cell_embeddings"], labels, cfg.cluster_resolution, cfg.train.seed),
            "logistic_regression": _probe_scores(task.extras["cell_embeddings"], labels, split)}
    result["zero_shot_probe"] = _probe_scores(features, labels, split)
    result["baselines"] = task.extras["baselines"]
    return result


def retained_cell_types(ctx) -> dict[str, Any]:
    """Retained capability: how well the arm's cell embeddings still separate a labelling the
    fine-tuning task does not train (``retained_label_key``, default cell types when the task is
    regions): a logistic-regression probe on frozen embeddings (train/test = the task's split) and
    zero-shot Leiden ARI. Same cells as the task (the slice is the context), other labels."""
    cfg, task = ctx.cfg, ctx.task
    adata = task.extras["adata"]
    key = cfg.retained_label_key
    if key == cfg.data.label_key or key not in adata.obs:
        why = "it is the fine-tuning label" if key == cfg.data.label_key else f"obs has no {key!r}"
        return {"balanced_accuracy": float("nan"), "skipped": f"retained_label_key={key!r}: {why}"}
    raw = adata.obs[key].astype(str).to_numpy()
    labels = np.searchsorted(np.array(sorted(set(raw))), raw)
    features = subslice_features(ctx.model, task.extras["subslices"], len(labels), batch_size=cfg.train.batch_size)
    split = task.extras["split"]
    probe = _probe_scores(features, labels, {"train": split["train"], "val": np.array([], dtype=int),
                                             "test": np.concatenate([split["val"], split["test"]])})["test"]
    clusters = _cluster_scores(features, labels, cfg.cluster_resolution, cfg.train.seed)
    return {"balanced_accuracy": probe["balanced_accuracy"], "f1_macro": probe["f1_macro"],
            "leiden_ari": clusters["ari"], "label_key": key}


FAMILY = Family(
    name="stofm",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"n_outputs": task.n_outputs},
    recipe=lambda cfg, model, task: _recipe(model, task),
    protocols_before=[clustering_protocol],
    head="head",
    retained=Retained(retained_cell_types, metric="balanced_accuracy", direction="max",
                      description="logistic-regression probe (balanced accuracy) and Leiden ARI of the cell "
                                  "embeddings on labels not fine-tuned on (retained_label_key, default cell_type)"),
)
run, evaluate = FAMILY.run, FAMILY.evaluate


def _recipe(model, task):
    recipe = CellRecipe(model, task.train, task.val, task="multiclass", forward_fn=task.forward_fn,
                        collate_fn=task.collate_fn)
    recipe.eval_collate_fn = task.eval_collate_fn
    return recipe


# ------------------------------------------------------------------------------ predict / embed CLI


def _slice_settings(model_arg, args) -> tuple[DataSection, int, list[str] | None]:
    """The sub-slice settings of the run ``model_arg`` belongs to (so that cells are encoded and
    grouped as in training), else the defaults with the command line's cell encoder; and the run's
    class names when known."""
    import dataclasses

    from domainfm.experiment.inference import run_config, run_report

    cfg = run_config(model_arg, Config)
    data = cfg.data if cfg is not None else DataSection()
    if args.cell_encoder is not None:
        data = dataclasses.replace(data, cell_encoder=_encoder_section(args.cell_encoder))
    for name in ("spatial_key", "layer", "embedding_key"):
        if getattr(args, name) is not None:
            data = dataclasses.replace(data, **{name: getattr(args, name)})
    if args.cells_per_subslice is not None:
        data = dataclasses.replace(data, cells_per_subslice=args.cells_per_subslice)
    report = run_report(model_arg)
    classes = (report or {}).get("data", {}).get("classes")
    return data, (data.split_seed if cfg is not None else 0), classes


@torch.no_grad()
def predict(adata, model: nn.Module, data: DataSection | None = None, *, classes: list[str] | None = None,
            batch_size: int = 4, seed: int = 0, precision: str = "auto", source: str | None = None):
    """Per-cell class probabilities of a fine-tuned SToFM classifier: a DataFrame indexed by
    ``obs_names`` with ``predicted`` and one ``p_<class>`` column per class (rows sum to 1)."""
    import pandas as pd

    from domainfm.precision import autocast
    from domainfm.pretrain.stofm import slice_subslices

    data = data or DataSection()
    _require_head(model, "the model")
    subs, _ = slice_subslices(adata, data, seed=seed, source=source)
    model.eval()
    device = next(model.parameters()).device
    probs = None
    for start in range(0, len(subs), batch_size):
        batch = spatial.collate_subslices(subs[start:start + batch_size])
        with autocast(precision, device):
            logits = model(batch["token_embeddings"].to(device), batch["distances"].to(device),
                           batch["token_types"].to(device))
        p = torch.softmax(logits.float(), dim=-1).cpu()
        if probs is None:
            probs = np.full((adata.n_obs, p.shape[-1]), np.nan, dtype=np.float64)
        index = batch["cell_index"]
        cells = index >= 0
        probs[index[cells].numpy()] = p[cells].double().numpy()
    if np.isnan(probs).any():
        missing = int(np.isnan(probs).any(axis=1).sum())
        raise RuntimeError(f"predict stofm: {missing} cells fell in no sub-slice")
    names = list(classes) if classes and len(classes) == probs.shape[1] else [str(i) for i in range(probs.shape[1])]
    frame = pd.DataFrame(probs, index=adata.obs_names, columns=[f"p_{c}" for c in names])
    frame.insert(0, "predicted", np.asarray(names, dtype=object)[probs.argmax(1)])
    frame.index.name = "cell"
    return frame


def _require_head(model: nn.Module, label: str) -> None:
    """Predictions need the per-cell classifier a fine-tuning run adds; a backbone (the pretrained
    transformer, a save_pretrained of it) has none."""
    if getattr(model, "head", None) is None:
        raise InputError(f"{label}: a SToFM backbone without a classification head; predict needs a fine-tuned "
                         "model with a head (a `domainfm finetune stofm` run folder or its <arm>/model); for cell "
                         "embeddings use `domainfm embed stofm`")


def _cli(command: str, argv: list[str]):
    import argparse

    from domainfm.experiment.inference import add_model_arguments

    parser = argparse.ArgumentParser(
        prog=f"domainfm {command} stofm",
        description=("Per-cell class probabilities of a fine-tuned SToFM (CSV: cell, predicted, p_<class>)"
                     if command == "predict" else
                     "SToFM cell embeddings: --output .h5ad (the input with obsm[--key-added]) or .npz (cells, X)")
        + ". --input: an .h5ad slice with counts and obsm['spatial']. With a run folder as --model, cells are "
          "encoded and grouped into sub-slices with the run's own data settings.")
    add_model_arguments(parser)
    parser.add_argument("--cell-encoder", default=None, help="the cell encoder (default: the run's, else a seeded "
                                                              "random stofm-cell-encoder, with a warning)")
    parser.add_argument("--spatial-key", default=None)
    parser.add_argument("--layer", default=None)
    parser.add_argument("--embedding-key", default=None, help="precomputed cell embeddings in obsm")
    parser.add_argument("--cells-per-subslice", type=positive_int, default=None)
    parser.add_argument("--batch-size", type=positive_int, default=4)
    if command == "embed":
        parser.add_argument("--key-added", default="X_stofm")
    args = parser.parse_args(argv)
    return args


def _read_input(path: str):
    """The ``--input`` slice; its ``obs_names`` must be unique (they key every per-cell output)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (--input: an .h5ad slice)")
    if p.suffix != ".h5ad":
        raise spatial.SpatialDataError(f"{p}: expected an .h5ad file (AnnData), got {p.suffix or 'no suffix'!r}")
    adata = spatial.read_h5ad(p)
    spatial.check_unique_obs_names(adata, source=str(p))
    return adata


def predict_main(argv: list[str]) -> int:
    """``domainfm predict stofm --model RUN_OR_DIR --input slice.h5ad --output cells.csv``."""
    from domainfm.atomic import atomic_path
    from domainfm.experiment.inference import load_model

    args = _cli("predict", argv)
    adata = _read_input(args.input)
    data, seed, classes = _slice_settings(args.model, args)
    spatial.validate(adata, spatial_key=data.spatial_key, layer=data.layer, source=args.input)
    model = load_model(args.model, arm=args.arm, pretrained=args.pretrained).to(args.device)
    _require_head(model, f"--model {args.model}")
    frame = predict(adata, model, data, classes=classes, batch_size=args.batch_size, seed=seed,
                    precision=args.precision, source=args.input)
    with atomic_path(Path(args.output)) as tmp:
        frame.to_csv(tmp)
    print(f"predict stofm: {len(frame)} cells, {frame.shape[1] - 1} classes -> {args.output}")
    return 0


def embed_main(argv: list[str]) -> int:
    """``domainfm embed stofm --model RUN_OR_DIR --input slice.h5ad --output out.h5ad|out.npz``."""
    from domainfm.atomic import atomic_path
    from domainfm.experiment.inference import load_model
    from domainfm.precision import autocast
    from domainfm.pretrain.stofm import slice_subslices

    args = _cli("embed", argv)
    out = Path(args.output)
    if out.suffix not in (".h5ad", ".npz"):
        raise InputError(f"--output {out}: expected a .h5ad (the input with obsm[{args.key_added!r}]) or a .npz "
                         f"(cells, X) file, got {out.suffix or 'no extension'!r}")
    adata = _read_input(args.input)
    data, seed, _ = _slice_settings(args.model, args)
    if out.suffix == ".h5ad":
        _check_key_added(adata, args.key_added, spatial_key=data.spatial_key, embedding_key=data.embedding_key,
                         overwrite=False, option="--key-added ")
    model = load_model(args.model, arm=args.arm, pretrained=args.pretrained).to(args.device)
    subs, _ = slice_subslices(adata, data, seed=seed, source=args.input)
    with autocast(args.precision, args.device):
        features = subslice_features(model, subs, adata.n_obs, batch_size=args.batch_size)
    with atomic_path(out) as tmp:
        if out.suffix == ".npz":
            with open(tmp, "wb") as fh:
                np.savez(fh, cells=np.asarray(adata.obs_names, dtype=str), X=features)
        else:
            adata.obsm[args.key_added] = features
            adata.write_h5ad(tmp)
    print(f"embed stofm: {features.shape[0]} cells x {features.shape[1]} -> {out}")
    return 0
