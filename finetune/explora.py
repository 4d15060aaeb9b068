"""ExPLoRA fine-tuning: image classification (top-1 / top-5) in LoRA, full or linear-probe mode,
declared on the experiment layer.

The paper's fine-tuning (fMoW-RGB): LoRA rank 8 on every block (q, v of the fused qkv here),
the head and ``fc_norm`` trained in full, global average pooling + ``fc_norm``, 120 epochs,
base lr 1e-3, weight decay 0, drop path 0.2, label smoothing 0.1 (RandAugment m9 is not
reproduced: it is RGB-only; flips are used). Linear probing trains only the head on frozen
features. ``configs/explora/finetune_fmow_rgb.yaml`` / ``linear_probe_fmow_rgb.yaml`` hold these
settings; runs are selected by validation top-1 unless ``train.monitor`` says otherwise.

Weights come from :func:`domainfm.experiment.resolve`: an official ExPLoRA file or a ``backbone/``
folder of ``domainfm pretrain explora``, through the card's ``official`` converter (``norm`` ->
``fc_norm`` for average pooling, position table resampled; the head keeps its fresh init).

The embedded default (``domainfm finetune explora``, ``configs/explora/finetune.yaml``) runs
offline in a few minutes on the shipped Sentinel-2 scene: a short ExPLoRA extended pretraining of
a test-sized ViT (the ``stages`` entry; from random init, as there are no DINOv2 weights offline),
then LoRA fine-tuning on a 4-class tile task whose labels are **derived from spectral indices**,
in two arms: ``pretrained`` (the stage's exported backbone) and ``stage_init`` (the very same
starting weights without extended pretraining).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, TaskData
from domainfm.finetune import metrics as M
from domainfm.finetune.supervised import LoraSettings, SupervisedRecipe

__all__ = ["Config", "DataSection", "ClassificationRecipe", "FAMILY", "LABELS_NOTE", "build_task", "run", "evaluate"]

LABELS_NOTE = (
    "constructed: each 12x12-px (720 m) tile of the shipped Sentinel-2 scene is labelled from spectral indices "
    "of its own pixels (water: >=50% pixels NDWI>0; shore_mixed: >=10%; else moderate/dense vegetation by mean "
    "NDVI < / >= 0.45). The model sees only RGB (B04,B03,B02). Not ground truth."
)


@dataclass
class DataSection:
    #: ``sample`` (shipped scene + spectral-index labels), ``folder`` (root/<class>/*.tif) or ``csv``
    source: str = "sample"
    path: str | None = None
    val_path: str | None = None
    bands: list[str] = field(default_factory=lambda: ["B04", "B03", "B02"])
    band_indices: list[int] | None = None
    n_bands: int | None = None
    tile_size: int = 12
    img_size: int = 32
    mean: list[float] | None = None
    std: list[float] | None = None
    #: sample: tiles in blocks of ``split_block`` x ``split_block`` tiles, every ``split_every``-th diagonal block validates
    split_block: int = 4
    split_every: int = 4
    #: folder/csv without val_path: fraction held out (seeded by ``train.seed``)
    val_fraction: float = 0.2

    def __post_init__(self):
        if self.source not in {"sample", "folder", "csv"}:
            raise ValueError(f"data.source={self.source!r}: expected sample, folder or csv")


@dataclass
class Config(ExperimentConfig):
    label_smoothing: float = 0.1
    model: ModelSection = field(default_factory=lambda: ModelSection(
        name="explora-test", converter="official", kwargs={"global_pool": "avg", "drop_path_rate": 0.2}))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(mode="lora", lora=LoraSettings(
        targets=["blocks.*.attn.qkv@q,v"], rank=8, alpha=8.0, unfreeze=["fc_norm.*"])))
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-3, weight_decay=0.0))


class ClassificationRecipe(SupervisedRecipe):
    """Multiclass classification reporting top-1 and top-5 beside the shared metric set."""

    def metrics(self, outputs):
        result = super().metrics(outputs)
        result["top1"] = result["accuracy"]
        if outputs["scores"].shape[1] > 5:  # with <= 5 classes top-5 is always 1
            result["top5"] = M.top_k_accuracy(outputs["target"], outputs["scores"], k=5)
        return result


# ----------------------------------------------------------------------------- data


class _Mapped(torch.utils.data.Dataset):
    def __init__(self, ds, indices, transform):
        self.ds, self.indices, self.transform = ds, indices, transform

    def __len__(self):
        return len(self.indices) if self.indices is not None else len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[self.indices[i] if self.indices is not None else i]
        return self.transform(x), y


def _sample_datasets(data: DataSection, train_tf, eval_tf):
    from domainfm.data_loaders import satellite as S

    full = S.load_scene("sample", bands=None)  # every band: the labels need B03/B04/B08
    scene = S.load_scene("sample", bands=data.bands, mean=data.mean, std=data.std)
    raw = torch.from_numpy(full.raw)
    ts, blk, every = data.tile_size, data.split_block, data.split_every

    def is_val(r: int, c: int) -> bool:
        return ((r // ts) // blk + (c // ts) // blk) % every == 0

    label = lambda tile: S.spectral_index_classes(tile, full.band_names)  # noqa: E731
    train = S.SceneTiles(scene.image, ts, transform=train_tf, labels_fn=label, keep=lambda r, c: not is_val(r, c), raw=raw)
    val = S.SceneTiles(scene.image, ts, transform=eval_tf, labels_fn=label, keep=is_val, raw=raw)
    return train, val, list(S.INDEX_CLASSES), train.labels.tolist(), val.labels.tolist()


def _file_datasets(data: DataSection, train_tf, eval_tf, seed: int):
    from domainfm.data_loaders import satellite as S

    if data.mean is None or data.std is None or data.path is None:
        raise ValueError(f"data.source={data.source!r} needs data.path, data.mean and data.std (per-band statistics)")
    kw = dict(n_bands=data.n_bands, bands=data.band_indices, stats=S.BandStats(data.mean, data.std))
    make = S.ImageFolder if data.source == "folder" else S.CsvManifest
    full = make(data.path, **kw)
    classes = list(full.classes) if full.classes is not None else None
    labels = [int(lbl) for _, lbl in full.samples]
    if data.val_path:
        val_ds = make(data.val_path, **kw) if data.source == "folder" else make(data.val_path, classes=classes, **kw)
        train_idx, val_idx, val_labels = None, None, [int(lbl) for _, lbl in val_ds.samples]
    else:
        order = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = max(1, int(round(data.val_fraction * len(full))))
        train_idx, val_idx, val_ds = order[n_val:], order[:n_val], full
        val_labels = [labels[i] for i in val_idx]
    train_labels = labels if train_idx is None else [labels[i] for i in train_idx]
    classes = classes or [str(i) for i in range(max(labels) + 1)]
    return _Mapped(full, train_idx, train_tf), _Mapped(val_ds, val_idx, eval_tf), classes, train_labels, val_labels


def build_task(cfg: Config) -> TaskData:
    """The classification task of ``cfg.data``; ``info`` carries the majority-class top-1 on
    validation (the class most frequent in training), the floor any model must beat."""
    from domainfm.data_loaders import satellite as S

    train_tf, eval_tf = S.Resize(cfg.data.img_size, flip=True), S.Resize(cfg.data.img_size)
    if cfg.data.source == "sample":
        train, val, classes, y_train, y_val = _sample_datasets(cfg.data, train_tf, eval_tf)
    else:
        train, val, classes, y_train, y_val = _file_datasets(cfg.data, train_tf, eval_tf, cfg.train.seed)
    majority = int(np.bincount(y_train).argmax())
    info = {"classes": classes, "n_train": len(train), "n_val": len(val),
            "majority_class_top1": float(np.mean(np.asarray(y_val) == majority))}
    return TaskData(train, val, None, task="multiclass", n_outputs=len(classes), info=info,
                    labels=LABELS_NOTE if cfg.data.source == "sample" else "recorded")


def _prepare(cfg, model, mode):
    from domainfm.models.explora.satmae import freeze_fixed_encodings

    freeze_fixed_encodings(model)  # sin-cos tables of the group-channel ViT stay fixed, also in full mode


FAMILY = Family(
    name="explora",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"n_outputs": task.n_outputs},
    recipe=lambda cfg, model, task: ClassificationRecipe(model, task.train, task.val, task="multiclass",
                                                         label_smoothing=cfg.label_smoothing),
    selection=lambda cfg, task: ("top1", "max"),
    head="head",
    prepare=_prepare,
)
run, evaluate = FAMILY.run, FAMILY.evaluate
