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

Both losses are means over the global batch (all masked cells, all masked pairs), as the
official batched losses. The official training script is not released: the two losses are
summed with weight 1 (``pair_loss_weight``), our choice. Paper defaults (SToCorpus-88M, not yet
released) are in ``configs/stofm/pretrain_paper.yaml``; ``configs/stofm/pretrain.yaml`` runs on
the shipped semi-synthetic tissue in about a minute.

**Randomness per sample.** The masks, the jitter and the dropout of each sub-slice are drawn from
:class:`~domainfm.engine.SampleSeeds` (the run's seed, the epoch, the sub-slice's index) in
:class:`PretrainSubslices`, and each sub-slice goes through the model on its own (no padding);
the losses are normalised by the global batch's counts of masked cells and pairs. So a run on
``W`` ranks with batch ``B`` each takes the same steps as one process with batch ``W * B``.

**Data.** ``data.kind: memory`` (default): ``data.slices`` (``.h5ad`` files / Visium folders, or
``@demo``) are tokenised, encoded by the configured cell encoder (or read from
``obsm[data.embedding_key]``) and cut into sub-slices in memory. ``data.kind: streaming``: a
corpus written once by ``domainfm prepare stofm`` (:data:`PREPARE`: the same steps, one
``.h5ad`` per worker, the cell embeddings computed by the configured cell encoder *at
preparation*) is read from ``data.path`` (a folder or ``s3://...``); its settings must equal the
config's ``data:`` keys::

    domainfm prepare stofm --input /data/slices --output /data/stofm_corpus cells_per_subslice=1000
    domainfm pretrain stofm --config pretrain_paper data.kind=streaming data.path=/data/stofm_corpus
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from domainfm import streaming
from domainfm.distributed import all_reduce_sum, process_group_size
from domainfm.data_loaders import spatial
from domainfm.engine import Recipe, SampleSeeds, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "CellEncoderSection", "SliceSettings", "CorpusSettings", "DataSection",
           "MaskingSection", "PREPARE", "convert_slice", "subslice_sample", "sample_subslice", "check_corpus_settings",
           "mask_subslice", "PretrainSubslices", "pretraining_sums", "pretraining_losses", "SToFMPretrainRecipe",
           "build_datasets", "slice_subslices", "run"]


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
class CorpusSettings(SliceSettings):
    """``domainfm prepare stofm`` settings (``key=value``): :class:`SliceSettings` and the seed of
    Leiden and its PCA (in-memory pretraining uses ``train.seed``). Recorded in the corpus's
    manifest; pretraining refuses a corpus whose settings differ from its ``data:`` keys."""

    seed: int = 0


@dataclass
class DataSection(SliceSettings):
    #: ``memory``: sub-slices of ``slices`` built at start; ``streaming``: a prepared corpus at ``path``
    kind: Literal["memory", "streaming"] = "memory"
    #: .h5ad files / Visium folders ("@demo": the shipped semi-synthetic tissue); kind=memory
    slices: list[str] = field(default_factory=lambda: ["@demo"])
    #: a folder written by ``domainfm prepare stofm``, or its copy in object storage (s3://...); kind=streaming
    path: str | None = None
    val_fraction: float = 0.0

    def __post_init__(self):
        if self.kind == "memory" and self.path is not None:
            raise ValueError(f"data.path={self.path}: a prepared corpus is read with data.kind=streaming "
                             "(data.kind=memory builds sub-slices from data.slices)")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction={self.val_fraction}: expected a fraction in [0, 1)")


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


def spatial_mask_value() -> float:
    from domainfm.models.stofm import MASK_VALUE

    return MASK_VALUE


def _draw(n_cells: int, first: int, rate: float, keep_rate: float, generator: torch.Generator):
    perm = torch.randperm(n_cells, generator=generator) + first
    n_mask, n_keep = int(rate * n_cells), int(keep_rate * n_cells)
    return perm[:n_mask], perm[n_mask:n_mask + n_keep]


def mask_subslice(item: dict[str, torch.Tensor], masking: MaskingSection,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Both objectives' draws on one sub-slice (the official ``SToFM_Collator``, per sub-slice).

    Adds ``labels (T, d)`` (original embeddings of the 15%, else -100) and ``pair_labels (T, T)``
    (true distances on the 15%'s edges, else -100); ``token_embeddings`` and ``distances`` carry
    the masked/jittered inputs. Draws, in this order, from ``generator``: the masked-cell
    permutation, the pair permutation, the jitter.
    """
    m = masking
    emb, dist = item["token_embeddings"].float(), item["distances"].float()
    types, xy = item["token_types"], item["spatial"].float()
    cells = types == spatial.TOKEN_CELL
    n_cells = int(cells.sum())
    first = int(types.shape[0] - n_cells)  # cells follow [CLS] and the hypernodes
    # masked cell modelling
    masked, kept = _draw(n_cells, first, m.mask_rate, m.remaining_rate, generator)
    labels = torch.full_like(emb, spatial_mask_value())
    chosen = torch.cat([masked, kept])
    labels[chosen] = emb[chosen]
    new_emb = emb.clone()
    new_emb[masked] = spatial_mask_value()
    # pairwise distance recovery
    masked, kept = _draw(n_cells, first, m.pair_mask_rate, m.pair_remaining_rate, generator)
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
        sigma = torch.sqrt(extent[0] * extent[1] / n_cells) * m.noise_scale
        moved = xy.clone()
        moved[masked] += torch.randn(len(masked), 2, generator=generator) * sigma
        changed = torch.cdist(moved[masked].double(), moved.double()).float()
        new_dist[masked, :] = changed
        new_dist[:, masked] = changed.t()
        new_dist[0, :] = 0.0
        new_dist[:, 0] = 0.0
        # symmetric as officially: a 100 takes the transposed entry when that is an edge
        new_dist = torch.where(new_dist == spatial.NON_EDGE_DISTANCE, new_dist.t(), new_dist)
    return {**item, "token_embeddings": new_emb, "distances": new_dist, "labels": labels, "pair_labels": pair_labels}


class PretrainSubslices(torch.utils.data.Dataset):
    """Sub-slices (a list, or a :class:`~domainfm.streaming.PreparedCorpus` of
    :func:`subslice_sample` samples), masked for pretraining as they are read.

    Item ``i`` is masked (:func:`mask_subslice`) with a generator from ``SampleSeeds(seed)`` keyed
    by ``(epoch, i)`` and carries ``dropout_seed``, the seed of the model's dropout on it, from the
    same generator: a sub-slice gets the same draws on any rank, in any batch, in a resumed run.
    :meth:`set_epoch` (called by the engine) moves to the next epoch's draws; a validation set
    is never moved, so its masks are the same at every evaluation.

    Args:
        subslices: indexable sub-slices.
        masking: the objectives' rates.
        seed: the run's seed.
        indices: the sub-slices (positions in ``subslices``) this dataset holds, e.g. the train
            part of a split; read in ascending order so that a corpus's chunks stay contiguous
            (:attr:`blocks`).
    """

    def __init__(self, subslices, masking: MaskingSection, *, seed: int = 0, indices: Sequence[int] | None = None):
        self.subslices = subslices
        self.masking = masking
        self.seeds = SampleSeeds(seed)
        self.indices = None if indices is None else np.sort(np.asarray(indices, dtype=np.int64))

    def set_epoch(self, epoch: int) -> None:
        self.seeds.set_epoch(epoch)

    @property
    def blocks(self) -> list[tuple[int, int]] | None:
        """The source's chunks (a prepared corpus), as ranges of this dataset's indices."""
        blocks = getattr(self.subslices, "blocks", None)
        if blocks is None or self.indices is None:
            return blocks
        out, position = [], 0
        for a, b in blocks:
            n = int(np.searchsorted(self.indices, b) - np.searchsorted(self.indices, a))
            if n:
                out.append((position, position + n))
                position += n
        return out

    def __len__(self) -> int:
        return len(self.subslices) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = int(index)
        source = index if self.indices is None else int(self.indices[index])
        item = self.subslices[source]
        if "edge_index" in item:  # a prepared corpus's sample
            item = sample_subslice(item)
        generator = self.seeds.generator(index)
        out = mask_subslice(item, self.masking, generator)
        out["dropout_seed"] = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        return out


def collate_list(items):
    """A batch is the list of its sub-slices: each goes through the model on its own."""
    return list(items)


@contextlib.contextmanager
def _sample_rng(seed: int, device: torch.device):
    # the dropout of one sub-slice from its own seed, whatever ran before it in this process
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        yield


def pretraining_sums(model, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per sub-slice ``(B,)``: ``mcm_sum`` (summed ``1 - cos`` over its masked cells), ``mcm_count``,
    ``pair_sum`` (summed squared error over its masked pairs), ``pair_count``.

    Each sub-slice goes through the model alone (no padding), in training mode under its
    ``dropout_seed``; the sums keep their graph."""
    if hasattr(model, "mark_forward_method") and "forward_pretrain" not in model._forward_methods:
        model.mark_forward_method("forward_pretrain")  # route through DDP's forward when wrapped
    sums: dict[str, list] = {"mcm_sum": [], "mcm_count": [], "pair_sum": [], "pair_count": []}
    mask = spatial_mask_value()
    for item in items:
        emb, dist, types = item["token_embeddings"], item["distances"], item["token_types"]
        rng = _sample_rng(int(item["dropout_seed"]), emb.device) \
            if model.training and "dropout_seed" in item else contextlib.nullcontext()
        with rng:
            _, lm, pair = model.forward_pretrain(emb[None], dist[None], types[None])
        labels, pair_labels = item["labels"], item["pair_labels"]
        chosen = labels[:, 0] != mask
        pairs = pair_labels != mask
        # an empty selection still sums to a 0 that is part of the graph (every rank backpropagates)
        sums["mcm_sum"].append((1.0 - F.cosine_similarity(lm[0][chosen].float(), labels[chosen].float(), dim=-1)).sum())
        sums["pair_sum"].append(((pair[0][pairs].float() - pair_labels[pairs].float()) ** 2).sum())
        sums["mcm_count"].append(chosen.sum())
        sums["pair_count"].append(pairs.sum())
    return {k: torch.stack(v).float() for k, v in sums.items()}


def pretraining_losses(model, items: Sequence[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine loss over all masked cells, MSE over all masked pairs) of a batch of masked sub-slices."""
    s = pretraining_sums(model, items)
    mcm = s["mcm_sum"].sum() / s["mcm_count"].sum().clamp(min=1)
    return mcm, s["pair_sum"].sum() / s["pair_count"].sum().clamp(min=1)


class SToFMPretrainRecipe(Recipe):
    def __init__(self, model, train_dataset, val_dataset=None, *, pair_loss_weight=1.0):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.pair_loss_weight = pair_loss_weight
        self.collate_fn = collate_list

    def step(self, model, batch):
        s = pretraining_sums(model, batch)
        local = torch.stack([s["mcm_sum"].sum(), s["mcm_count"].sum(), s["pair_sum"].sum(), s["pair_count"].sum()])
        totals, world = all_reduce_sum(local), process_group_size()
        # each rank's share of the global batch's means: the gradients DDP averages over ranks,
        # and the loss the engine averages for the log, are those of one process with the whole batch
        lm_loss = local[0] * world / totals[1].clamp(min=1).float()
        pair_loss = local[2] * world / totals[3].clamp(min=1).float()
        loss = lm_loss + self.pair_loss_weight * pair_loss
        mcm, pair = totals[0] / totals[1].clamp(min=1), totals[2] / totals[3].clamp(min=1)
        return loss, {"loss": (mcm + self.pair_loss_weight * pair).float(), "mcm_loss": mcm.float(),
                      "pair_loss": pair.float()}

    def eval_step(self, model, batch):
        return {k: v.detach() for k, v in pretraining_sums(model, batch).items()}

    def metrics(self, outputs):
        mcm = float(outputs["mcm_sum"].sum() / outputs["mcm_count"].sum().clamp(min=1))
        pair = float(outputs["pair_sum"].sum() / outputs["pair_count"].sum().clamp(min=1))
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


# ------------------------------------------------------------------------------ prepared corpus


def subslice_sample(subslice: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A sub-slice as a corpus sample of arrays: ``token_embeddings (T, d)`` float32,
    ``token_types (T,)`` int8, ``spatial (T, 2)`` float32, ``cell_index (T,)`` int64, and the
    distances as their edges, ``edge_index`` (flat positions in the ``T x T`` matrix) and
    ``edge_distance``: every entry other than 0 and 100, which :func:`sample_subslice` restores
    (100 off the edges, 0 on the diagonal and the ``[CLS]`` row/column), about 20x smaller."""
    distances = subslice["distances"].numpy().reshape(-1)
    edges = np.flatnonzero((distances != 0) & (distances != spatial.NON_EDGE_DISTANCE))
    n = len(subslice["token_types"])
    return {
        "token_embeddings": subslice["token_embeddings"].numpy().astype(np.float32),
        "token_types": subslice["token_types"].numpy().astype(np.int8),
        "spatial": subslice["spatial"].numpy().astype(np.float32),
        "cell_index": subslice["cell_index"].numpy().astype(np.int64),
        "edge_index": edges.astype(np.int32 if n * n < 2 ** 31 else np.int64),
        "edge_distance": distances[edges].astype(np.float32),
    }


def sample_subslice(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The sub-slice of a :func:`subslice_sample` sample, with its dense distance matrix."""
    types = torch.as_tensor(np.asarray(sample["token_types"]), dtype=torch.int64)
    n = len(types)
    distances = torch.full((n * n,), spatial.NON_EDGE_DISTANCE, dtype=torch.float32)
    distances[torch.as_tensor(np.asarray(sample["edge_index"]), dtype=torch.int64)] = \
        torch.as_tensor(np.asarray(sample["edge_distance"]), dtype=torch.float32)
    distances = distances.view(n, n)
    distances[0, :] = 0.0
    distances[:, 0] = 0.0
    distances.fill_diagonal_(0.0)
    return {
        "token_embeddings": torch.as_tensor(np.asarray(sample["token_embeddings"]), dtype=torch.float32),
        "distances": distances,
        "token_types": types,
        "cell_index": torch.as_tensor(np.asarray(sample["cell_index"]), dtype=torch.int64),
        "spatial": torch.as_tensor(np.asarray(sample["spatial"]), dtype=torch.float32),
    }


_ENCODERS: dict[str, torch.nn.Module] = {}


def _corpus_encoder(section: CellEncoderSection):
    # one encoder per worker process and setting, not one per file
    key = json.dumps(dataclasses.asdict(section), sort_keys=True, default=str)
    if key not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[key] = build_cell_encoder(section)
    return _ENCODERS[key]


def convert_slice(settings: CorpusSettings, path: str) -> list[dict[str, np.ndarray]]:
    """The sub-slices of one ``.h5ad`` slice as corpus samples (:func:`subslice_sample`): read and
    validated by :func:`~domainfm.data_loaders.spatial.read_spatial`, cell embeddings from
    ``obsm[embedding_key]`` or computed here by the configured cell encoder (on CPU), then the
    sub-slices of :func:`slice_subslices`."""
    adata = spatial.read_spatial(path, spatial_key=settings.spatial_key)
    encoder = None
    if not (settings.embedding_key and settings.embedding_key in adata.obsm):
        encoder = _corpus_encoder(settings.cell_encoder)
    subs, _ = slice_subslices(adata, settings, encoder, seed=settings.seed, source=str(path))
    return [subslice_sample(s) for s in subs]


#: ``domainfm prepare stofm``: one ``.h5ad`` slice -> its sub-slices
PREPARE = streaming.Preparation(
    convert=convert_slice, settings=CorpusSettings, suffixes=(".h5ad",),
    what="spatial slices (.h5ad with obsm['spatial']) -> SToFM sub-slices (cell embeddings, kNN distances)")

#: settings that do not change what a corpus holds: not checked against the config
_UNCHECKED = {"seed", "cell_encoder.batch_size"}


def _flat(values: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and key == "cell_encoder":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_corpus_settings(corpus: streaming.PreparedCorpus, data: SliceSettings) -> None:
    """Refuse a corpus prepared with other sub-slicing settings than the config's ``data:`` keys
    (:class:`SliceSettings`), naming ``data.path`` and each field that differs."""
    wanted = {f.name: getattr(data, f.name) for f in dataclasses.fields(SliceSettings)}
    wanted = _flat(json.loads(json.dumps(
        {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in wanted.items()}, default=str)))
    held = _flat(corpus.settings)
    missing = object()
    differ = [(k, held.get(k, missing), v) for k, v in wanted.items()
              if k not in _UNCHECKED and held.get(k, missing) != v]
    if not differ:
        return
    shown = "; ".join(f"data.{k}={v!r} but the corpus was prepared with "
                      + ("no such setting" if h is missing else f"{k}={h!r}") for k, h, v in differ)
    fix = " ".join(f"{k}={json.dumps(v)}" for k, _, v in differ)
    raise streaming.PrepareError(
        f"data.path {corpus.path}: {shown}; prepare a corpus with the config's settings "
        f"(domainfm prepare stofm ... {fix}) or set the config's data keys to the corpus's")


def build_datasets(data: DataSection, seed: int = 0, masking: MaskingSection | None = None):
    """(train, val or None, info): :class:`PretrainSubslices` over the sub-slices of
    ``data.slices`` (``kind: memory``) or of the corpus at ``data.path`` (``kind: streaming``);
    ``data.val_fraction`` of them, drawn with ``seed``, held out with fixed masks."""
    masking = masking or MaskingSection()
    info: dict[str, Any] = {}
    if data.kind == "streaming":
        if not data.path:
            raise streaming.PrepareError("data.kind=streaming: set data.path to a corpus written by "
                                         "`domainfm prepare stofm --input ... --output DIR` (or its s3:// copy)")
        source = streaming.PreparedCorpus(data.path, family="stofm")
        check_corpus_settings(source, data)
        info["data_source"] = source.describe()
    else:
        if not data.slices:
            raise ValueError("pretraining data: set data.slices (h5ad files / Visium folders), or data.kind=streaming "
                             "with data.path (a corpus from `domainfm prepare stofm`)")
        source = spatial.SubsliceDataset(list(_iter_subslices(data, seed)))
        info["data_source"] = f"slices: {', '.join(map(str, data.slices))}"
    info["subslices"] = len(source)
    if data.val_fraction <= 0:
        return PretrainSubslices(source, masking, seed=seed), None, info
    n_val = max(1, int(round(len(source) * data.val_fraction)))
    if n_val >= len(source):
        raise ValueError(f"data.val_fraction={data.val_fraction} leaves no training sub-slice out of {len(source)}")
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed)).tolist()
    info["val_subslices"] = n_val
    # the held-out masks from another seed, never moved by set_epoch: comparable across evaluations
    return (PretrainSubslices(source, masking, seed=seed, indices=order[n_val:]),
            PretrainSubslices(source, masking, seed=seed + 1, indices=order[:n_val]), info)


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import create_model, lora, save_pretrained

    run_dir = Path(run_dir)
    train_ds, val_ds, info = build_datasets(cfg.data, seed=cfg.train.seed, masking=cfg.masking)
    kwargs = {**cfg.model.kwargs, "n_outputs": None, "pretrain_heads": True}
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    train_cfg = cfg.train
    if val_ds is not None and train_cfg.monitor is None:
        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    if len(train_ds) < train_cfg.batch_size and train_cfg.drop_last:
        train_cfg = dataclasses.replace(train_cfg, drop_last=False)  # a small slice still trains
    recipe = SToFMPretrainRecipe(model, train_ds, val_ds, pair_loss_weight=cfg.pair_loss_weight)
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
