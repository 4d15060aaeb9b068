"""SToFM pretraining: masked cell modelling + pairwise distance recovery, on the engine.

Both objectives as in the official collator (github PharMolix/SToFM, ``model/extraction.py``
``SToFM_Collator``) and ``SToFMForMaskedLM``:

* **Masked cell modelling.** Of each sub-slice's cells, 12% get the constant input embedding
  -100 and 3% are kept unchanged; for these 15% the L2-normalised ``lm_head`` output is pulled
  towards the cell's original embedding by the cosine embedding loss (``1 - cos``).
* **Pairwise distance recovery.** Another, independent 12% + 3% of cells are drawn; the 12% are
  moved by Gaussian noise of ``sigma = 5 sqrt(area / n_cells)`` (area of the cells' bounding box
  in normalised coordinates) and their rows/columns of the distance matrix are recomputed from the
  jittered positions (all distances, as officially); the ``pair_head`` reads the last layer's
  pair representation and regresses, by MSE, the *true* kNN distances of every edge touching one
  of the 15% (cells only; non-edges (100) and the diagonal excluded).

The official training script is not released: the two losses are summed with weight 1
(``pair_loss_weight``), our choice. Paper defaults (SToCorpus-88M, not yet released) are in
``configs/stofm/pretrain_paper.yaml``; ``configs/stofm/pretrain.yaml`` runs on the shipped
semi-synthetic tissue in about a minute.

Data: ``data.slices`` (``.h5ad`` files / Visium folders, or ``@demo``) are tokenised, encoded by
the configured cell encoder (or read from ``obsm[data.embedding_key]``) and cut into sub-slices;
with ``data.preprocess_to`` those sub-slices are written to shards once, and ``data.shards``
trains from them (read lazily, per rank)::

    domainfm pretrain stofm data.slices='[/data/a.h5ad,/data/b.h5ad]' data.preprocess_to=/data/stofm_shards
    domainfm pretrain stofm data.shards=/data/stofm_shards
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset

from domainfm.data_loaders import spatial
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "CellEncoderSection", "SliceSettings", "DataSection", "MaskingSection", "PretrainCollator",
           "SToFMPretrainRecipe", "build_datasets", "slice_subslices", "run"]


@dataclass
class CellEncoderSection:
    name: str = "stofm-cell-encoder"
    #: the official cell_encoder/ folder, a save_pretrained folder, or null (random init)
    pretrained: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 32
    #: seed of a randomly initialised encoder, so that a pretraining stage and the fine-tuning
    #: that follows it see the same cell embeddings
    seed: int = 0


@dataclass
class SliceSettings:
    """How one slice becomes sub-slices; shared by pretraining and fine-tuning (``data:`` keys)."""

    spatial_key: str = "spatial"
    layer: str | None = None
    gene_id_key: str | None = None
    #: precomputed cell embeddings in obsm (skips the cell encoder when present)
    embedding_key: str | None = None
    cell_encoder: CellEncoderSection = field(default_factory=CellEncoderSection)
    cells_per_subslice: int = 1000
    leiden_resolution: float = 1.0
    alpha: float = 0.2
    knn: int = 50


@dataclass
class DataSection(SliceSettings):
    #: .h5ad files / Visium folders ("@demo": the shipped semi-synthetic tissue)
    slices: list[str] = field(default_factory=lambda: ["@demo"])
    shards: str | None = None
    preprocess_to: str | None = None
    shard_size: int = 256
    val_fraction: float = 0.0


@dataclass
class MaskingSection:
    mask_rate: float = 0.12
    remaining_rate: float = 0.03
    pair_mask_rate: float = 0.12
    pair_remaining_rate: float = 0.03
    noise_scale: float = 5.0

    def __post_init__(self):
        for a, b, what in ((self.mask_rate, self.remaining_rate, "mask"),
                           (self.pair_mask_rate, self.pair_remaining_rate, "pair_mask")):
            if a < 0 or b < 0 or a + b > 1:
                raise ValueError(f"masking.{what}_rate + remaining rate = {a} + {b}: expected non-negative, sum <= 1")


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="stofm-base"))
    data: DataSection = field(default_factory=DataSection)
    masking: MaskingSection = field(default_factory=MaskingSection)
    pair_loss_weight: float = 1.0
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=10, batch_size=4, lr=1e-4, weight_decay=0.01, clip_grad_norm=1.0, warmup_ratio=0.05,
        schedule="cosine", monitor=None))


# ------------------------------------------------------------------------------ masking


class PretrainCollator:
    """Pads sub-slices and draws both objectives' masks (the official ``SToFM_Collator``).

    Adds ``labels (B, N, d)`` (original embeddings of the 15%, else -100) and ``pair_labels
    (B, N, N)`` (true distances on the 15%'s edges, else -100); ``token_embeddings`` and
    ``distances`` carry the masked/jittered inputs.
    """

    def __init__(self, masking: MaskingSection, generator: torch.Generator | None = None):
        self.m = masking
        self.generator = generator

    def _draw(self, n_cells: int, first: int, rate: float, keep_rate: float):
        perm = torch.randperm(n_cells, generator=self.generator) + first
        n_mask, n_keep = int(rate * n_cells), int(keep_rate * n_cells)
        return perm[:n_mask], perm[n_mask:n_mask + n_keep]

    def _one(self, item):
        emb, dist = item["token_embeddings"].float(), item["distances"].float()
        types, xy = item["token_types"], item["spatial"].float()
        cells = types == spatial.TOKEN_CELL
        n_cells = int(cells.sum())
        first = int(types.shape[0] - n_cells)  # cells follow [CLS] and the hypernodes
        # masked cell modelling
        masked, kept = self._draw(n_cells, first, self.m.mask_rate, self.m.remaining_rate)
        labels = torch.full_like(emb, spatial_mask_value())
        chosen = torch.cat([masked, kept])
        labels[chosen] = emb[chosen]
        new_emb = emb.clone()
        new_emb[masked] = spatial_mask_value()
        # pairwise distance recovery
        masked, kept = self._draw(n_cells, first, self.m.pair_mask_rate, self.m.pair_remaining_rate)
        chosen = torch.cat([masked, kept])
        touched = torch.zeros(dist.shape, dtype=torch.bool)
        touched[chosen, :] = True
        touched[:, chosen] = True
        touched[chosen, chosen] = False
        pair_labels = torch.where(touched & (dist != spatial.NON_EDGE_DISTANCE), dist,
                                  torch.full_like(dist, spatial_mask_value()))
        pair_labels[~cells, :] = spatial_mask_value()
        pair_labels[:, ~cells] = spatial_mask_value()
        new_dist = dist.clone()
        if len(masked):
            cell_xy = xy[cells]
            extent = cell_xy.max(0).values - cell_xy.min(0).values
            sigma = torch.sqrt(extent[0] * extent[1] / n_cells) * self.m.noise_scale
            moved = xy.clone()
            moved[masked] += torch.randn(len(masked), 2, generator=self.generator) * sigma
            changed = torch.cdist(moved[masked].double(), moved.double()).float()
            new_dist[masked, :] = changed
            new_dist[:, masked] = changed.t()
            new_dist[0, :] = 0.0
            new_dist[:, 0] = 0.0
            # symmetric as officially: a 100 takes the transposed entry when that is an edge
            new_dist = torch.where(new_dist == spatial.NON_EDGE_DISTANCE, new_dist.t(), new_dist)
        return {**item, "token_embeddings": new_emb, "distances": new_dist, "labels": labels,
                "pair_labels": pair_labels}

    def __call__(self, items):
        masked = [self._one(item) for item in items]
        batch = spatial.collate_subslices([{k: v for k, v in m.items() if k not in ("labels", "pair_labels")}
                                           for m in masked])
        n = batch["token_types"].shape[1]
        d = masked[0]["labels"].shape[1]
        batch["labels"] = torch.full((len(masked), n, d), spatial_mask_value())
        batch["pair_labels"] = torch.full((len(masked), n, n), spatial_mask_value())
        for i, m in enumerate(masked):
            t = m["labels"].shape[0]
            batch["labels"][i, :t] = m["labels"]
            batch["pair_labels"][i, :t, :t] = m["pair_labels"]
        return batch


def spatial_mask_value() -> float:
    from domainfm.models.stofm import MASK_VALUE

    return MASK_VALUE


def pretraining_losses(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine loss on the masked cells, MSE on the masked pairs) of one collated batch."""
    if hasattr(model, "mark_forward_method") and "forward_pretrain" not in model._forward_methods:
        model.mark_forward_method("forward_pretrain")  # route through DDP's forward when wrapped
    _, lm, pair = model.forward_pretrain(batch["token_embeddings"], batch["distances"], batch["token_types"])
    labels, pair_labels = batch["labels"], batch["pair_labels"]
    chosen = labels[..., 0] != spatial_mask_value()
    zero = lm.sum() * 0.0
    lm_loss = (1.0 - F.cosine_similarity(lm[chosen].float(), labels[chosen].float(), dim=-1)).mean() \
        if chosen.any() else zero
    pairs = pair_labels != spatial_mask_value()
    pair_loss = F.mse_loss(pair[pairs].float(), pair_labels[pairs].float()) if pairs.any() else zero
    return lm_loss, pair_loss


class SToFMPretrainRecipe(Recipe):
    def __init__(self, model, train_dataset, val_dataset=None, *, masking: MaskingSection, pair_loss_weight=1.0,
                 seed: int = 0):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.pair_loss_weight = pair_loss_weight
        self.collate_fn = PretrainCollator(masking)
        # fixed masks for validation, so that losses are comparable across epochs
        self.eval_collate_fn = PretrainCollator(masking, torch.Generator().manual_seed(seed + 1))

    def step(self, model, batch):
        lm_loss, pair_loss = pretraining_losses(model, batch)
        loss = lm_loss + self.pair_loss_weight * pair_loss
        return loss, {"loss": loss.detach(), "mcm_loss": lm_loss.detach(), "pair_loss": pair_loss.detach()}

    def eval_step(self, model, batch):
        lm_loss, pair_loss = pretraining_losses(model, batch)
        n = batch["token_types"].shape[0]
        return {"mcm_loss": lm_loss.detach().float().reshape(1).expand(n).clone(),
                "pair_loss": pair_loss.detach().float().reshape(1).expand(n).clone()}

    def metrics(self, outputs):
        mcm, pair = float(outputs["mcm_loss"].mean()), float(outputs["pair_loss"].mean())
        return {"loss": mcm + self.pair_loss_weight * pair, "mcm_loss": mcm, "pair_loss": pair}


# ------------------------------------------------------------------------------ data


def build_cell_encoder(section: CellEncoderSection):
    from domainfm import create_model
    from domainfm.models.stofm import load_official_cell_encoder

    if not section.pretrained:
        with torch.random.fork_rng():
            torch.manual_seed(section.seed)
            return create_model(section.name, **section.kwargs)
    path = Path(section.pretrained).expanduser()
    if (path / "cell_bert").is_dir():
        return load_official_cell_encoder(path, name=section.name, **section.kwargs)
    if path.is_dir():
        return create_model(path, **section.kwargs)
    return create_model(section.name, pretrained=section.pretrained, **section.kwargs)


def cell_embeddings(adata, data: SliceSettings, encoder=None, source: str | None = None) -> np.ndarray:
    """``obsm[data.embedding_key]`` when present, else the cell encoder's embeddings."""
    if data.embedding_key and data.embedding_key in adata.obsm:
        return np.asarray(adata.obsm[data.embedding_key], dtype=np.float32)
    tokens = spatial.tokenize(adata, layer=data.layer, gene_id_key=data.gene_id_key, source=source)
    encoder = encoder if encoder is not None else build_cell_encoder(data.cell_encoder)
    return spatial.encode_cells(tokens, encoder, batch_size=data.cell_encoder.batch_size)


def slice_subslices(adata, data: SliceSettings, encoder=None, *, seed: int = 0, source: str | None = None):
    """(sub-slices, cell embeddings) of one validated slice."""
    spatial.validate(adata, spatial_key=data.spatial_key, layer=data.layer, source=source)
    emb = cell_embeddings(adata, data, encoder, source)
    subs = spatial.build_subslices(np.asarray(adata.obsm[data.spatial_key])[:, :2], emb,
                                   cells_per_subslice=data.cells_per_subslice,
                                   leiden_resolution=data.leiden_resolution, alpha=data.alpha, knn=data.knn, seed=seed)
    return subs, emb


def _iter_subslices(data: DataSection, seed: int):
    encoder = None
    if not data.embedding_key:
        encoder = build_cell_encoder(data.cell_encoder)
    for path in data.slices:
        adata = spatial.resolve_slice(path)
        subs, _ = slice_subslices(adata, data, encoder, seed=seed, source=str(path))
        yield from subs


def build_datasets(data: DataSection, seed: int = 0):
    """(train, val or None, info)."""
    info: dict[str, Any] = {}
    if data.shards is None and data.preprocess_to is not None:
        spatial.write_subslice_shards(_iter_subslices(data, seed), data.preprocess_to, shard_size=data.shard_size,
                                      meta={"slices": list(data.slices)})
        data = dataclasses.replace(data, shards=data.preprocess_to)
    if data.shards is not None:
        dataset = spatial.SubsliceShardDataset(data.shards)
        info["data_source"] = f"shards: {data.shards}"
    else:
        if not data.slices:
            raise ValueError("pretraining data: set data.slices (h5ad files / Visium folders) or data.shards")
        dataset = spatial.SubsliceDataset(list(_iter_subslices(data, seed)))
        info["data_source"] = f"slices: {', '.join(map(str, data.slices))}"
    info["subslices"] = len(dataset)
    if data.val_fraction <= 0:
        return dataset, None, info
    n_val = max(1, int(round(len(dataset) * data.val_fraction)))
    if n_val >= len(dataset):
        raise ValueError(f"data.val_fraction={data.val_fraction} leaves no training sub-slice out of {len(dataset)}")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    info["val_subslices"] = n_val
    return Subset(dataset, order[n_val:]), Subset(dataset, order[:n_val]), info


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import create_model, lora, save_pretrained

    run_dir = Path(run_dir)
    train_ds, val_ds, info = build_datasets(cfg.data, seed=cfg.train.seed)
    kwargs = {**cfg.model.kwargs, "n_outputs": None, "pretrain_heads": True}
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    train_cfg = cfg.train
    if val_ds is not None and train_cfg.monitor is None:
        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    if len(train_ds) < train_cfg.batch_size and train_cfg.drop_last:
        train_cfg = dataclasses.replace(train_cfg, drop_last=False)  # a small slice still trains
    recipe = SToFMPretrainRecipe(model, train_ds, val_ds, masking=cfg.masking, pair_loss_weight=cfg.pair_loss_weight,
                                 seed=cfg.train.seed)
    result = Trainer(train_cfg, run_dir=run_dir).fit(recipe)
    # the saved model is the backbone (no pretraining heads): what fine-tuning starts from
    backbone = create_model(cfg.model.name, **{**cfg.model.kwargs, "n_outputs": None})
    trained = (result.model or model).state_dict()
    backbone.load_state_dict({k: v for k, v in trained.items() if not k.startswith(("lm_head.", "pair_head."))})
    saved = save_pretrained(backbone, run_dir / "model")
    history = [r for r in result.history if r.get("split") == "train"]
    summary = lora.trainable_summary(model)
    report = {
        "model": cfg.model.name,
        "init": init_label(cfg.model.pretrained, init_info),
        "objective": "masked cell modelling (cosine, 12%+3%) + pairwise distance recovery (MSE, 12%+3% jittered)",
        "params_total": summary["total"],
        "params_trainable": summary["trainable"],
        **info,
        "steps": result.global_step,
        "train_loss_first": history[0]["loss"] if history else math.nan,
        "train_loss_last": history[-1]["loss"] if history else math.nan,
        "saved_model": str(saved),
        "checkpoint": str(result.best_checkpoint) if result.best_checkpoint else "",
    }
    for key in ("mcm_loss", "pair_loss"):
        if history and key in history[-1]:
            report[f"train_{key}_first"] = history[0][key]
            report[f"train_{key}_last"] = history[-1][key]
    if result.last_val:
        report["val_loss"] = result.last_val["loss"]
    return report
