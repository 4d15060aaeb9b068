"""CBraMod fine-tuning: EEG classification / regression with the paper's heads, metrics and
selection rules, in full, LoRA or linear-probe mode.

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

Weights: ``model.pretrained: true`` loads the official checkpoint through the hub (sha256
verified). Offline without the file in the cache this fails with the path to place it at; the run
then stops, unless ``model.pretrained_fallback: random``, in which case it says so and trains
from random initialisation, and the report says ``init: random``.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from domainfm.data_loaders import eeg
from domainfm.engine import TrainConfig, Trainer
from domainfm.finetune.supervised import LoraSettings, SupervisedRecipe, prepare_mode, selection_rule

__all__ = ["Config", "ModelSection", "DataSection", "DEMO_REGIONS", "build_demo_task", "build_model", "run",
           "evaluate"]


@dataclass
class ModelSection:
    name: str = "cbramod-base"
    #: true: the card's official weights; a path/URL; false: random init
    pretrained: bool | str = True
    #: what to do when the pretrained weights cannot be had: "error" (stop) or "random" (say so, train from scratch)
    pretrained_fallback: str = "error"
    head_type: str = "all_patch_reps"
    head_dropout: float = 0.1
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.pretrained_fallback not in {"error", "random"}:
            raise ValueError(f"model.pretrained_fallback={self.pretrained_fallback!r}: expected 'error' or 'random'")


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
class Config:
    task: str = "multiclass"
    n_outputs: int = 2
    mode: str = "full"
    lora: LoraSettings = field(default_factory=lambda: LoraSettings(
        targets=["encoder.layers.*.self_attn_*.in_proj", "encoder.layers.*.self_attn_*.out_proj",
                 "encoder.layers.*.linear1", "encoder.layers.*.linear2"], rank=8, alpha=16.0))
    label_smoothing: float = 0.1
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    #: also fine-tune the same model from random init with the same settings, for comparison
    compare_random_init: bool = False
    #: what the labels are (printed in the report; required for constructed tasks)
    labels_note: str = ""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=50, batch_size=64, lr=1e-4, head_lr=5e-4, head_patterns=["head.*"], weight_decay=5e-2,
        clip_grad_norm=1.0, schedule="cosine", min_lr=1e-6))

    def __post_init__(self):
        if self.task not in {"multiclass", "binary", "regression"}:
            raise ValueError(f"task={self.task!r}: expected multiclass, binary or regression")
        if self.mode not in {"full", "lora", "linear_probe"}:
            raise ValueError(f"mode={self.mode!r}: expected full, lora or linear_probe")
        if self.task != "multiclass" and self.n_outputs != 1:
            raise ValueError(f"task={self.task} needs n_outputs=1 (one logit / value), got {self.n_outputs}")


# ----------------------------------------------------------------------------- embedded default

#: scalp regions of the demo task (EEGMMIDB 10-10 names), 16 channels each, in groups of 4 neighbours
DEMO_REGIONS = {
    "frontal": ["Fp1", "Fpz", "Fp2", "Af7", "Af3", "Afz", "Af4", "Af8", "F7", "F5", "F3", "F1", "Fz", "F2", "F4", "F6"],
    "central": ["C5", "C3", "C1", "Cz", "C2", "C4", "C6", "T7", "Cp5", "Cp3", "Cp1", "Cpz", "Cp2", "Cp4", "Cp6", "T8"],
    "posterior": ["P7", "P5", "P3", "P1", "Pz", "P2", "P4", "P6", "P8", "Po7", "Po3", "Poz", "Po4", "Po8", "O1", "O2"],
}
DEMO_LABELS_NOTE = (
    "constructed: the shipped recording (PhysioNet EEGMMIDB S001R02, eyes-closed resting baseline, "
    "whose only annotation is one T0 = rest) has no task events, so each example is 4 neighbouring "
    "channels x 4 s and its label is the scalp region those channels lie over (0 frontal: Fp/Af/F rows; "
    "1 central: C/Cp rows + T7/T8; 2 posterior: P/Po/O rows), read from the channel names. "
    "Train: windows within 0-40 s; val: windows within 41-61 s (no overlap in time)."
)


def build_demo_task(settings: eeg.EEGSettings | None = None, *, window_s: float = 4.0, stride_s: float = 2.0,
                    split_s: float = 40.0, gap_s: float = 1.0):
    """The embedded default task from the shipped ``S001R02.edf`` (see :data:`DEMO_LABELS_NOTE`).

    Returns ``(train, val)`` :class:`~domainfm.data_loaders.eeg.WindowDataset`\\ s of ``(4, 800)``
    windows (4 channels x 4 one-second patches at 200 Hz, units of 100 µV) with region labels.
    """
    settings = settings or eeg.EEGSettings(reference="average", allow_upsample=True)
    path = eeg.samples_dir() / "S001R02.edf"
    channels = [ch for region in DEMO_REGIONS.values() for ch in region]
    raw = eeg.read_raw(path)
    raw = eeg.preprocess(raw.copy().pick("eeg"), sfreq=settings.sfreq, l_freq=settings.l_freq,
                         h_freq=settings.h_freq, notch=settings.notch, reference=settings.reference,
                         allow_upsample=settings.allow_upsample)  # average reference over all 64 channels
    raw = eeg.pick_channels(raw, channels)
    splits = []
    for start, stop in ((0.0, split_s), (split_s + gap_s, None)):
        x, _ = eeg.fixed_windows(raw, window_s=window_s, stride_s=stride_s, start_s=start, stop_s=stop)
        x = eeg.to_model_units(x, uv_per_unit=settings.uv_per_unit)
        xs, ys = [], []
        for label, region in enumerate(DEMO_REGIONS):
            first = channels.index(DEMO_REGIONS[region][0])
            for g in range(0, len(DEMO_REGIONS[region]), 4):
                xs.append(x[:, first + g : first + g + 4])
                ys.append(np.full(len(x), label))
        splits.append(eeg.WindowDataset(np.concatenate(xs), np.concatenate(ys)))
    return splits[0], splits[1]


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


# ----------------------------------------------------------------------------- model


def build_model(cfg: Config, n_chans: int, n_times: int, *, pretrained: bool | str) -> tuple[torch.nn.Module, str]:
    """The fine-tuning model and its init description (``"pretrained: <source>"`` or ``"random"``)."""
    from domainfm import create_model, hub

    kwargs = {**cfg.model.kwargs, "n_chans": n_chans, "n_times": n_times, "n_outputs": cfg.n_outputs,
              "head_type": cfg.model.head_type, "head_dropout": cfg.model.head_dropout, "reconstruction_head": False}
    if pretrained is False:
        return create_model(cfg.model.name, **kwargs), "random"
    try:
        # the official converter also reads our own checkpoints (keys pass through, proj_out dropped)
        model = create_model(cfg.model.name, pretrained=pretrained, converter="official", **kwargs)
    except (hub.HubError, FileNotFoundError) as exc:
        where = "the hub cache" if pretrained is True else str(pretrained)
        message = (
            f"\n[cbramod] pretrained weights unavailable ({type(exc).__name__}): {exc}\n"
            f"[cbramod] To fine-tune the pretrained model: place pretrained_weights.pth (sha256 verified) at the "
            f"path named above, or run `domainfm download {cfg.model.name}` with network access, or pass "
            "model.pretrained=/path/to/pretrained_weights.pth.\n"
        )
        if cfg.model.pretrained_fallback != "random":
            raise SystemExit(message + f"[cbramod] Stopping (model.pretrained_fallback=error; set it to 'random' to "
                                       f"train from random initialisation instead; {where} was consulted).")
        print(message + "[cbramod] model.pretrained_fallback=random: training from RANDOM initialisation; "
              "the report says init: random.", file=sys.stderr, flush=True)
        return create_model(cfg.model.name, **kwargs), "random"
    report = model.domainfm_load_report
    return model, f"pretrained: {report.source}" + (f" (sha256 {report.sha256[:12]})" if report.sha256 else "")


def _fit(cfg: Config, model, train, val, run_dir: Path):
    from domainfm import lora

    prepare_mode(model, cfg.mode, head="head", lora=cfg.lora)
    metric, direction = selection_rule(cfg.task)
    train_cfg = dataclasses.replace(cfg.train, monitor=cfg.train.monitor or f"val/{metric}",
                                    monitor_mode=direction if cfg.train.monitor is None else cfg.train.monitor_mode)
    recipe = SupervisedRecipe(model, train, val, task=cfg.task,
                              label_smoothing=cfg.label_smoothing if cfg.task == "multiclass" else 0.0)
    result = Trainer(train_cfg, run_dir=run_dir).fit(recipe)
    summary = lora.trainable_summary(model)
    return result, recipe, summary


def _best_metrics(result, run_dir: Path) -> dict[str, float]:
    vals = [r for r in result.history if r.get("split") == "val"]
    if not vals:
        return {}
    best = next((r for r in vals if r["step"] == result.best_step), vals[-1])
    return {k: v for k, v in best.items() if k not in {"split", "step", "epoch"}}


def run(cfg: Config, run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from domainfm import lora

    run_dir = Path(run_dir)
    train, val, test = build_datasets(cfg)
    n_chans, n_times = int(train.x.shape[1]), int(train.x.shape[2])
    if cfg.task == "multiclass":
        seen = int(max(train.y.max(), val.y.max())) + 1
        if seen > cfg.n_outputs:
            raise ValueError(f"labels go up to {seen - 1} but n_outputs={cfg.n_outputs}")
    model, init = build_model(cfg, n_chans, n_times, pretrained=cfg.model.pretrained)
    result, recipe, summary = _fit(cfg, model, train, val, run_dir)
    metric, _ = selection_rule(cfg.task)
    report: dict[str, Any] = {
        "model": cfg.model.name,
        "init": init,
        "mode": cfg.mode,
        "task": cfg.task,
        "head": cfg.model.head_type,
        "input": f"{n_chans} ch x {n_times // 200} patches (200 Hz, 100 uV units)",
        "train_examples": len(train),
        "val_examples": len(val),
        "params_total": summary["total"],
        "params_trainable": summary["trainable"],
        "trainable_percent": round(summary["percent"], 3),
        "steps": result.global_step,
        "selected_by": f"val {metric}",
        "best_step": result.best_step,
    }
    if cfg.labels_note or cfg.data.kind == "demo":
        report["labels"] = cfg.labels_note or DEMO_LABELS_NOTE
    report.update({f"val_{k}": v for k, v in _best_metrics(result, run_dir).items()})
    if cfg.mode == "lora":
        lora.save_adapter(model, run_dir / "adapter", base_model_name=cfg.model.name)
        report["adapter"] = str(run_dir / "adapter")
    if test is not None and result.best_checkpoint is not None:
        model.load_state_dict(load_file(str(result.best_checkpoint)))
        trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
        report.update({f"test_{k}": v for k, v in trainer.evaluate(recipe, test, model=model).items()})
    if cfg.compare_random_init:
        if init == "random":
            report["random_init_comparison"] = "skipped: this run already started from random initialisation"
        else:
            torch.manual_seed(cfg.train.seed)
            baseline, _ = build_model(cfg, n_chans, n_times, pretrained=False)
            base_result, _, _ = _fit(cfg, baseline, train, val, run_dir / "random_init")
            report.update({f"random_init_val_{k}": v for k, v in _best_metrics(base_result, run_dir).items()})
    return report


def evaluate(cfg: Config, run_dir: Path) -> dict:
    """Metrics of ``run_dir``'s best checkpoint on the validation (and test) split."""
    from safetensors.torch import load_file

    from domainfm import lora

    run_dir = Path(run_dir)
    train, val, test = build_datasets(cfg)
    model, _ = build_model(cfg, int(train.x.shape[1]), int(train.x.shape[2]), pretrained=False)
    if cfg.mode == "lora":
        prepare_mode(model, "lora", head="head", lora=cfg.lora)
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / "best.safetensors")))
    recipe = SupervisedRecipe(model, None, val, task=cfg.task)
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    out = {f"val_{k}": v for k, v in trainer.evaluate(recipe, val, model=model).items()}
    if test is not None:
        out.update({f"test_{k}": v for k, v in trainer.evaluate(recipe, test, model=model).items()})
    return out
