"""CBraMod fine-tuning: EEG classification / regression with the paper's heads, metrics and
selection rules, in full, LoRA or linear-probe mode, declared on the experiment layer.

Paper settings (official ``finetune_main.py``): the reconstruction head is removed; classifier
``all_patch_reps`` (flatten -> N*200 -> 200 -> classes, ELU + dropout 0.1) or
``avgpooling_patch_reps``; 50 epochs, batch 64, AdamW (weight decay 5e-2), backbone lr 1e-4,
head lr 5e-4, cosine schedule, gradient clipping 1, label smoothing 0.1 (multiclass). Multiclass
runs are selected by validation Cohen's kappa (balanced accuracy, kappa, weighted F1 reported),
binary by ROC-AUC (balanced accuracy, PR-AUC, ROC-AUC), regression by R² (Pearson r, R², RMSE).

Data (``data.kind``):

- ``files``: recordings under ``data.root`` (globs ``data.train`` / ``data.val`` / ``data.test``),
  windowed and labelled by ``data.eeg`` (annotation events or file-path labels);
- ``npz``: pre-windowed arrays, one ``.npz`` per split with ``x`` (n, C, T) in the model's units
  (100 µV) and ``y`` (n,);
- ``demo``: the embedded default, built from the shipped recording by :func:`build_demo_task`.

Weights and arms come from :mod:`domainfm.experiment` (``model.pretrained``, ``model.fallback``,
``arms: [pretrained, random]``, ``stages``); the official converter drops the reconstruction head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from domainfm.data_loaders import eeg
from domainfm.data_loaders.eeg_demo import DEMO_LABELS_NOTE, DEMO_REGIONS, build_demo_task
from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, TaskData
from domainfm.finetune.supervised import LoraSettings

__all__ = ["Config", "DataSection", "DEMO_REGIONS", "FAMILY", "build_demo_task", "build_task", "run", "evaluate"]

LORA_TARGETS = ["encoder.layers.*.self_attn_*.in_proj", "encoder.layers.*.self_attn_*.out_proj",
                "encoder.layers.*.linear1", "encoder.layers.*.linear2"]


@dataclass
class DataSection:
    kind: str = "files"
    root: str | None = None
    train: list[str] = field(default_factory=list)
    val: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    eeg: eeg.EEGSettings = field(default_factory=eeg.EEGSettings)

    def __post_init__(self):
        if self.kind not in {"files", "npz", "demo"}:
            raise ValueError(f"data.kind={self.kind!r}: expected 'files', 'npz' or 'demo'")


@dataclass
class Config(ExperimentConfig):
    """``task``: multiclass | binary | regression; ``n_outputs``: classes (1 for binary/regression);
    ``labels_note``: what the labels are when they are constructed (printed in the report)."""

    task: str = "multiclass"
    n_outputs: int = 2
    label_smoothing: float = 0.1
    labels_note: str = ""
    model: ModelSection = field(default_factory=lambda: ModelSection(
        name="cbramod-base", pretrained=True, converter="official",
        kwargs={"head_type": "all_patch_reps", "head_dropout": 0.1}))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(
        lora=LoraSettings(targets=list(LORA_TARGETS), rank=8, alpha=16.0)))
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=50, batch_size=64, lr=1e-4, head_lr=5e-4, head_patterns=["head.*"], weight_decay=5e-2,
        clip_grad_norm=1.0, schedule="cosine", min_lr=1e-6))

    def __post_init__(self):
        super().__post_init__()
        if self.task not in {"multiclass", "binary", "regression"}:
            raise ValueError(f"task={self.task!r}: expected multiclass, binary or regression")
        if self.task != "multiclass" and self.n_outputs != 1:
            raise ValueError(f"task={self.task} needs n_outputs=1 (one logit / value), got {self.n_outputs}")


# ----------------------------------------------------------------------------- data


def _load_split(cfg: Config, patterns: list[str]):
    data = cfg.data
    regression = cfg.task == "regression"
    if data.kind == "npz":
        xs, ys = [], []
        for pattern in patterns:
            path = eeg.resolve_root(data.root) / pattern if data.root else Path(pattern)
            if not path.is_file():
                raise eeg.EEGError(f"{path}: npz split file not found")
            with np.load(path, allow_pickle=False) as arrays:
                if "x" not in arrays or "y" not in arrays:
                    raise eeg.EEGError(f"{path}: expected arrays 'x' (n, C, T) in 100 µV units and 'y' (n,); got {list(arrays)}")
                xs.append(arrays["x"])
                ys.append(arrays["y"])
        return eeg.WindowDataset(np.concatenate(xs), np.concatenate(ys), regression=regression)
    if data.eeg.events is None and data.eeg.file_labels is None:
        raise eeg.EEGError("data.kind=files needs labels: data.eeg.events (annotation -> label) or data.eeg.file_labels")
    files = list(eeg.iter_files(data.root, patterns))
    if not files:
        raise eeg.EEGError(f"data.root={data.root!r}: no file matches {patterns}")
    xs, ys = zip(*(eeg.load_windows(f, data.eeg) for f in files))
    return eeg.WindowDataset(np.concatenate(xs), np.concatenate(ys), regression=regression)


def build_datasets(cfg: Config):
    """(train, val, test or None)."""
    if cfg.data.kind == "demo":
        train, val = build_demo_task(cfg.data.eeg)
        return train, val, None
    if not cfg.data.train or not cfg.data.val:
        raise eeg.EEGError("data.train and data.val must name the training and validation files (globs under data.root)")
    test = _load_split(cfg, cfg.data.test) if cfg.data.test else None
    return _load_split(cfg, cfg.data.train), _load_split(cfg, cfg.data.val), test


def build_task(cfg: Config) -> TaskData:
    train, val, test = build_datasets(cfg)
    if cfg.task == "multiclass":
        seen = int(max(train.y.max(), val.y.max())) + 1
        if seen > cfg.n_outputs:
            raise ValueError(f"labels go up to {seen - 1} but n_outputs={cfg.n_outputs}")
    labels = cfg.labels_note or (DEMO_LABELS_NOTE if cfg.data.kind == "demo" else "recorded")
    if cfg.labels_note and not cfg.labels_note.startswith(("constructed", "synthetic", "recorded")):
        labels = f"constructed: {cfg.labels_note}"
    n_chans, n_times = int(train.x.shape[1]), int(train.x.shape[2])
    info = {"input": f"{n_chans} ch x {n_times // 200} patches (200 Hz, 100 uV units)", "n_chans": n_chans,
            "n_times": n_times, "train_examples": len(train), "val_examples": len(val)}
    if test is not None:
        info["test_examples"] = len(test)
    return TaskData(train, val, test, task=cfg.task, n_outputs=cfg.n_outputs, labels=labels, info=info)


FAMILY = Family(
    name="cbramod",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"n_chans": task.info["n_chans"], "n_times": task.info["n_times"],
                                    "n_outputs": cfg.n_outputs, "reconstruction_head": False},
    head="head",
)
run, evaluate = FAMILY.run, FAMILY.evaluate
