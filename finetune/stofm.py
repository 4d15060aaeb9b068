"""SToFM downstream: ``embed`` (AnnData in, ``obsm["X_stofm"]`` out), per-cell classification
(region segmentation / cell-type annotation) on the experiment layer, zero-shot clustering, and
the baselines a scanpy user would run first.

- :func:`embed`: scanpy-style; ``adata`` first, keyword-only options, cell embeddings written to
  ``adata.obsm[key_added]`` in ``obs_names`` order (``copy=True``: into a copy, returned); nothing
  else in ``adata`` changes; same ``seed``, same embedding (random inits included).
- ``domainfm predict|embed stofm`` and ``domainfm.predict|embed`` (:data:`APPLY`, on the shared
  apply layer): per-cell class probabilities (a table) and embeddings (``.h5ad`` or ``.npz``).
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

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm import create_model, list_models
from domainfm.data_loaders import spatial
from domainfm.data_loaders.spatial import CellTaskDataset
from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, Retained, TaskData, apply
from domainfm.experiment.supervised import SupervisedRecipe
from domainfm.lora.settings import LoraSettings
from domainfm.pretrain.stofm import CellEncoderSection, SliceSettings, slice_subslices

__all__ = ["Config", "DataSection", "FAMILY", "embed", "subslice_features", "build_task", "clustering_protocol",
           "CellTaskDataset", "collate_cells", "run", "evaluate", "LORA_TARGETS", "predict", "APPLY", "ApplyOptions",
           "InferenceSettings", "retained_cell_types"]

LORA_TARGETS = ["encoder.layers.*.self_attn.q_proj", "encoder.layers.*.self_attn.k_proj",
                "encoder.layers.*.self_attn.v_proj", "encoder.layers.*.self_attn.out_proj",
                "encoder.layers.*.fc1", "encoder.layers.*.fc2"]


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
        val, test = self.val_fraction, self.test_fraction
        if not (0 < val < 1 and 0 <= test < 1 and val + test < 1):
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


def build_task(cfg: Config) -> TaskData:
    data = cfg.data
    adata = spatial.resolve_slice(data.path)
    labels, classes = spatial.obs_labels(adata, data.label_key, source=f"{data.path}", option="data.label_key")
    subs, cell_emb = slice_subslices(adata, data, seed=data.split_seed, source=str(data.path))
    split = spatial.stratified_split(labels, data.val_fraction, data.test_fraction, seed=data.split_seed)
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
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    found = spatial.leiden_clusters(features, n_neighbors=15, resolution=resolution, seed=seed)
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


def clustering_protocol(ctx) -> dict[str, Any]:
    """Zero-shot Leiden on the model's cell embeddings (ARI, NMI) beside the PCA baselines, and
    the baselines' logistic-regression scores on the same split (computed once, shared by arms)."""
    cfg, task = ctx.cfg, ctx.task
    labels, split = task.extras["labels"], task.extras["split"]
    features = subslice_features(ctx.model, task.extras["subslices"], len(labels), batch_size=cfg.train.batch_size)
    result = {"zero_shot": _cluster_scores(features, labels, cfg.cluster_resolution, cfg.train.seed)}
    if "baselines" not in task.extras:
        base = {**spatial.expression_baselines(task.extras["adata"], n_components=cfg.pca_components,
                                               spatial_key=cfg.data.spatial_key, layer=cfg.data.layer),
                "cell_encoder_only": task.extras["cell_embeddings"]}
        task.extras["baselines"] = {
            name: {"clustering": _cluster_scores(x, labels, cfg.cluster_resolution, cfg.train.seed),
                   "logistic_regression": _probe_scores(x, labels, split)}
            for name, x in base.items()}
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
    labels, _ = spatial.obs_labels(adata, key)
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


# ------------------------------------------------------------------------------ predict / embed


@dataclass
class InferenceSettings:
    """How a slice becomes a model's sub-slices: ``data`` (a fine-tuning run's, so that cells are
    encoded and grouped as in training, else the defaults), ``seed``, the run's ``classes``, a cell
    ``encoder`` module replacing ``data.cell_encoder``, whether a random cell encoder nobody chose
    is built with a warning, and the ``source`` named in errors."""

    data: SliceSettings = field(default_factory=SliceSettings)
    seed: int = 0
    classes: list[str] | None = None
    encoder: nn.Module | None = None
    warn_random_encoder: bool = False
    source: str | None = None


def _settings(ref: apply.ModelRef, model: nn.Module) -> InferenceSettings:
    cfg = ref.run_config(Config)
    if cfg is None:
        return InferenceSettings(warn_random_encoder=True)
    return InferenceSettings(cfg.data, cfg.data.split_seed, ((ref.run_report() or {}).get("data") or {}).get("classes"))


@dataclass
class ApplyOptions:
    cell_encoder: str | None = apply.option(
        None, "the cell encoder: the official cell_encoder/ folder, a save_pretrained folder or a registered name "
              "(default: the run's, else a seeded random stofm-cell-encoder, with a warning)")
    spatial_key: str | None = apply.option(None, "obsm key of the cell coordinates (default: the run's, else spatial)")
    layer: str | None = apply.option(None, "the layer holding the counts (default: the run's, else X)")
    embedding_key: str | None = apply.option(None, "precomputed cell embeddings in obsm (skips the cell encoder)")
    cells_per_subslice: int | None = apply.option(None, "cells per micro sub-slice (default: the run's, else 1000)")
    key_added: str = apply.option("X_stofm", "the obsm key the embeddings are written to (.h5ad output)",
                                  commands=("embed",))
    overwrite: bool = apply.option(False, "replace an existing obsm[--key-added] not named like an embedding (X_*)",
                                   commands=("embed",))


def _read(source, settings: InferenceSettings, options: ApplyOptions | None) -> tuple[Any, InferenceSettings]:
    """``(adata, settings)``: the slice (a file's ``obs_names`` must be unique: they key every
    per-cell output), validated under the settings with the options' overrides."""
    options = options or ApplyOptions()
    is_file = isinstance(source, (str, Path))
    adata = spatial.read_cells(source) if is_file else source
    where = str(source) if is_file else settings.source
    changes: dict[str, Any] = {k: getattr(options, k) for k in ("spatial_key", "layer", "embedding_key",
                                                               "cells_per_subslice") if getattr(options, k) is not None}
    if options.cell_encoder is not None:
        changes["cell_encoder"] = _encoder_section(options.cell_encoder, settings.data.cell_encoder.seed)
    data = dataclasses.replace(settings.data, **changes)
    spatial.validate(adata, spatial_key=data.spatial_key, layer=data.layer, source=where)
    if options.embedding_key is not None and options.embedding_key not in adata.obsm:
        raise spatial.SpatialDataError(f"{where or '<AnnData>'}: obsm[{options.embedding_key!r}] is missing "
                                       f"(embedding_key); obsm has {sorted(adata.obsm.keys())}")
    if settings.warn_random_encoder and options.cell_encoder is None and settings.encoder is None and not (
            data.cell_encoder.pretrained or data.embedding_key and data.embedding_key in adata.obsm):
        warnings.warn("stofm: no cell encoder given; using a randomly initialised stofm-cell-encoder", stacklevel=4)
    return adata, dataclasses.replace(settings, data=data, source=where)


def _per_cell(fn, subslices, n_cells: int, run: apply.Runtime) -> np.ndarray:
    """``fn(token_embeddings, distances, token_types)``'s per-token output at every cell token,
    gathered in ``obs`` order: ``(n_cells, k)`` (every cell is in exactly one sub-slice)."""
    def cell_rows(index):
        batch = spatial.collate_subslices([subslices[i] for i in index.tolist()])
        out = fn(*(batch[k].to(index.device) for k in ("token_embeddings", "distances", "token_types")))
        return out[(batch["cell_index"] >= 0).to(out.device)]  # row-major: sub-slice by sub-slice

    rows = run.batched(cell_rows, torch.arange(len(subslices))).numpy()
    order = torch.cat([s["cell_index"][s["cell_index"] >= 0] for s in subslices]).numpy()
    out = np.full((n_cells, rows.shape[1]), np.nan, dtype=np.float32)
    out[order] = rows
    return out


def subslice_features(model: nn.Module, subslices, n_cells: int, *, batch_size: int = 4) -> np.ndarray:
    """Cell representations ``(n_cells, d)`` (the last layer's cell tokens) from sub-slices, in fp32."""
    run = apply.Runtime(precision="32-true", device=_device(model), batch_size=batch_size)
    return _per_cell(model.eval().forward_features, subslices, n_cells, run)


def _predict(data, model: nn.Module, settings, options, run: apply.Runtime) -> apply.Output:
    import pandas as pd

    adata, s = data
    subslices = slice_subslices(adata, s.data, s.encoder, seed=s.seed, source=s.source)[0]
    logits = _per_cell(model, subslices, adata.n_obs, run)
    probs = torch.softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    known = s.classes is not None and len(s.classes) == probs.shape[1]
    names = list(s.classes) if known else [str(i) for i in range(probs.shape[1])]
    frame = pd.DataFrame(probs, columns=[f"p_{c}" for c in names])
    frame.insert(0, "predicted", np.asarray(names, dtype=object)[probs.argmax(1)])
    frame.insert(0, "cell", np.asarray(adata.obs_names, dtype=object))
    return apply.Output(frame, summary=f"{len(frame)} cells, {len(names)} classes")


def _embed(data, model: nn.Module, settings, options, run: apply.Runtime) -> apply.Output:
    """The slice with ``obsm[key_added]`` (``.h5ad``; in Python the AnnData given, written in place),
    or ``{cells, X}`` (``.npz``)."""
    (adata, s), options = data, options or ApplyOptions()
    to_npz = run.output is not None and run.output.suffix.lower() == ".npz"
    if not to_npz:
        spatial.check_key_added(adata, options.key_added, spatial_key=s.data.spatial_key,
                                embedding_key=s.data.embedding_key, overwrite=options.overwrite,
                                cli=run.output is not None)
    subslices = slice_subslices(adata, s.data, s.encoder, seed=s.seed, source=s.source)[0]
    x = _per_cell(model.forward_features, subslices, adata.n_obs, run)
    summary = f"{x.shape[0]} cells x {x.shape[1]}"
    if to_npz:
        return apply.Output({"cells": np.asarray(adata.obs_names, dtype=str), "X": x}, summary=summary)
    adata.obsm[options.key_added] = x
    return apply.Output(adata, summary=summary)


APPLY = apply.Applier(
    family="stofm",
    input="an .h5ad slice (or a 10x Visium folder) with counts and obsm['spatial']",
    description="With a run folder as --model, cells are encoded and grouped into sub-slices with the run's own data "
                "settings.",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=4,
    predict=apply.Command(_predict, apply.TABLE, needs_head=True,
                          what="Per-cell class probabilities of a fine-tuned SToFM (CSV: cell, predicted, p_<class>)."),
    embed=apply.Command(_embed, apply.ANNDATA + apply.ARRAYS,
                        what="SToFM cell embeddings: --output .h5ad (the input with obsm[--key-added]) or .npz "
                             "(cells, X)."),
)


def _device(model) -> Any:
    return next(model.parameters()).device if isinstance(model, nn.Module) else "cpu"


def predict(adata, model: nn.Module, data: DataSection | None = None, *, classes: list[str] | None = None,
            batch_size: int = 4, seed: int = 0, precision: str = "auto", source: str | None = None):
    """Per-cell class probabilities of a fine-tuned SToFM classifier: a DataFrame indexed by
    ``obs_names`` (``cell``) with ``predicted`` and one ``p_<class>`` column per class (rows sum
    to 1); ``data``: the sub-slicing (default :class:`DataSection`'s), ``classes``: the class names."""
    settings = InferenceSettings(data or DataSection(), seed, classes, source=source)
    return apply.run("predict", APPLY, model, adata, settings=settings, precision=precision, batch_size=batch_size,
                     device=_device(model)).value.set_index("cell")


def embed(adata, model: str | nn.Module = "stofm-base", *, key_added: str = "X_stofm", overwrite: bool = False,
          batch_size: int = 4, cell_encoder: str | nn.Module | None = None, embedding_key: str | None = None,
          spatial_key: str = "spatial", layer: str | None = None, gene_id_key: str | None = None,
          cells_per_subslice: int = 1000, leiden_resolution: float = 1.0, alpha: float = 0.2, knn: int = 50,
          seed: int = 0, copy: bool = False):
    """Write SToFM cell embeddings ``(n_obs, d)`` (fp32) to ``adata.obsm[key_added]``; scanpy's
    convention: None (written into ``adata``), or with ``copy=True`` a new AnnData holding them
    (``adata`` untouched).

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
            (:func:`domainfm.data_loaders.spatial.build_subslices`); ``seed`` also initialises a
            model or cell encoder given as a registered name (``torch.manual_seed(seed)``).
        copy: write into a copy of ``adata`` and return it (scanpy's ``copy=``).
    """
    spatial.check_anndata(adata, "embed(adata=...)")
    transformer, bundled = _resolve_model(model, seed)
    given = cell_encoder if isinstance(cell_encoder, nn.Module) else None
    settings = InferenceSettings(SliceSettings(gene_id_key=gene_id_key, cell_encoder=CellEncoderSection(seed=seed),
                                               leiden_resolution=leiden_resolution, alpha=alpha, knn=knn), seed,
                                 encoder=given or bundled, warn_random_encoder=cell_encoder is None)
    options = ApplyOptions(None if given is not None else cell_encoder, spatial_key, layer, embedding_key,
                           cells_per_subslice, key_added, overwrite)
    out = apply.run("embed", APPLY, transformer, adata.copy() if copy else adata, settings=settings,
                    precision="32-true", batch_size=batch_size, device=_device(transformer), options=options)
    return out.value if copy else None


def _resolve_model(model, seed: int) -> tuple[nn.Module | str | Path, nn.Module | None]:
    """``(model, bundled cell encoder)``: the official checkpoint folder (``se2transformer.pth`` +
    ``cell_encoder/``) and a ``se2transformer.pth`` file are loaded here, a registered name as a
    random model initialised under ``seed`` (with a warning); a model or a save_pretrained folder as
    :func:`apply.resolve` does."""
    from domainfm.models.stofm import load_official

    path = None if isinstance(model, nn.Module) else Path(str(model)).expanduser()
    if path is None or path.is_dir() and not (path / "se2transformer.pth").is_file():
        return model, None
    if path.is_dir():
        return load_official(path, cell_encoder=(path / "cell_encoder").is_dir())
    if path.is_file():
        return create_model("stofm-base", pretrained=str(path)), None
    if str(model) in list_models("stofm*"):
        warnings.warn(f"embed(model={model!r}): a registered name without weights gives a randomly initialised "
                      "model; pass the official checkpoint folder (Google Drive, see the model card) or a "
                      "fine-tuned folder", stacklevel=3)
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            torch.manual_seed(seed)
            return create_model(str(model), n_outputs=None), None
    raise FileNotFoundError(f"model={model!r}: not a model, a registered stofm variant, a folder or a checkpoint file")


def _encoder_section(cell_encoder, seed: int) -> CellEncoderSection:
    if str(cell_encoder) in list_models("stofm-cell-encoder*"):
        return CellEncoderSection(name=str(cell_encoder), seed=seed)
    return CellEncoderSection(pretrained=str(cell_encoder))
