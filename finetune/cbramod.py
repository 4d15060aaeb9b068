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

Retained capability (forgetting, :data:`RETAINED`): CBraMod's own pretraining objective, the
masked-reconstruction MSE, of each arm's backbone before and after fine-tuning, on windows the
fine-tuning task never sees (``retained:`` section; by default channels of the shipped recording
outside the task). Applying a model: :func:`predict` / :func:`embed` and ``domainfm predict|embed
cbramod`` (see :func:`inference_settings` for where the windowing comes from).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm.data_loaders import eeg
from domainfm.data_loaders.eeg_demo import DEMO_LABELS_NOTE, DEMO_REGIONS, build_demo_task
from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment import apply
from domainfm.pretrain.cbramod import masked_reconstruction_error, random_patch_mask
from domainfm.lora.settings import LoraSettings

__all__ = ["Config", "DataSection", "RetainedSection", "DEMO_REGIONS", "FAMILY", "RETAINED", "InferenceSettings",
           "APPLY", "build_demo_task", "build_task", "class_names", "embed", "evaluate", "inference_settings",
           "masked_reconstruction_error", "predict", "retained_windows", "run"]

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
class RetainedSection:
    """Where the retained capability is measured: ``files`` under ``root`` (default the shipped
    recording), ``channels`` (null: on the demo task the 16 channels of the recording outside
    :data:`DEMO_REGIONS`, otherwise CBraMod's 19 pretraining channels; the shipped recording is a
    resting baseline, a run that no CBraMod downstream task uses), cut into ``window_s`` windows and
    preprocessed with ``data.eeg``'s filters; each (channel, patch) masked with probability
    ``mask_ratio`` by a mask drawn once from ``seed`` (the same for every arm, before and after)."""

    enabled: bool = True
    root: str = eeg.SAMPLES_TOKEN
    files: list[str] = field(default_factory=lambda: ["S001R02.edf"])
    channels: list[str] | None = None
    window_s: float = 4.0
    mask_ratio: float = 0.5
    seed: int = 0
    max_windows: int = 64


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
    retained: RetainedSection = field(default_factory=RetainedSection)
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


def _load_split(cfg: Config, patterns: list[str], settings: eeg.EEGSettings | None = None):
    data, settings = cfg.data, settings or cfg.data.eeg
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
    xs, ys = zip(*(eeg.load_windows(f, settings) for f in files))
    return eeg.WindowDataset(np.concatenate(xs), np.concatenate(ys), regression=regression, channels=settings.channels)


def build_datasets(cfg: Config):
    """(train, val, test or None)."""
    if cfg.data.kind == "demo":
        train, val = build_demo_task(cfg.data.eeg)
        return train, val, None
    if not cfg.data.train or not cfg.data.val:
        raise eeg.EEGError("data.train and data.val must name the training and validation files (globs under data.root)")
    # every file read by name in one channel order: data.eeg's, else the first training file's
    files = cfg.data.kind == "files"
    named = eeg.name_channels(cfg.data.eeg, eeg.iter_files(cfg.data.root, cfg.data.train)) if files else None
    test = _load_split(cfg, cfg.data.test, named) if cfg.data.test else None
    return _load_split(cfg, cfg.data.train, named), _load_split(cfg, cfg.data.val, named), test


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
            "n_times": n_times, "train_examples": len(train), "val_examples": len(val),
            **({"channels": train.channels} if train.channels else {})}
    classes = class_names(cfg)
    if classes is not None:
        info["classes"] = classes
    if test is not None:
        info["test_examples"] = len(test)
    return TaskData(train, val, test, task=cfg.task, n_outputs=cfg.n_outputs, labels=labels, info=info)


def class_names(cfg: Config) -> list[str] | None:
    """The class names of a classification config: the demo's regions, the annotation names of
    ``data.eeg.events`` (names sharing a label joined by ``|``), or None (labels are indices)."""
    if cfg.task == "regression":
        return None
    n = cfg.n_outputs if cfg.task == "multiclass" else 2
    if cfg.data.kind == "demo":
        names = list(DEMO_REGIONS)
        return names if len(names) == n else None
    events = cfg.data.eeg.events
    if not events:
        return None
    by_label: dict[int, list[str]] = {}
    for name, label in events.items():
        if float(label) != int(label) or not 0 <= int(label) < n:
            return None
        by_label.setdefault(int(label), []).append(str(name))
    return ["|".join(by_label[i]) if i in by_label else str(i) for i in range(n)]


# ----------------------------------------------------------------------------- retained capability

#: the shipped recording's channels outside the demo task (Fc row, F8, Ft7/8, T9/10, Tp7/8, Oz, Iz)
DEMO_HELD_OUT = ["Fc5", "Fc3", "Fc1", "Fcz", "Fc2", "Fc4", "Fc6", "F8", "Ft7", "Ft8", "T9", "T10", "Tp7", "Tp8",
                 "Oz", "Iz"]

_WINDOW_CACHE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def retained_windows(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, mask)``: the retained-capability windows ``(n, C, T)`` (model units) and their fixed
    patch mask ``(n, C, N)`` (see :class:`RetainedSection`). Cached per settings in the process."""
    section = cfg.retained
    channels = section.channels
    if channels is None:
        channels = DEMO_HELD_OUT if cfg.data.kind == "demo" else list(eeg.TUEG_19)
    settings = dataclasses.replace(cfg.data.eeg, channels=list(channels), bipolar=None, window_s=section.window_s,
                                   stride_s=None, events=None, file_labels=None, reject_uv=None,
                                   # the shipped recording is 160 Hz: upsampled as the demo pipeline does
                                   allow_upsample=cfg.data.eeg.allow_upsample or section.root == eeg.SAMPLES_TOKEN)
    key = json.dumps([dataclasses.asdict(settings), dataclasses.asdict(section), cfg.data.kind], sort_keys=True,
                     default=str)
    if key not in _WINDOW_CACHE:
        files = list(eeg.iter_files(section.root, section.files))
        if not files:
            raise eeg.EEGError(f"retained.root={section.root!r}: no file matches retained.files={section.files}")
        # the demo task references over all 64 channels before picking: the same here
        xs = [eeg.recording_windows(f, settings, reference_all=cfg.data.kind == "demo", notify=False)[0] for f in files]
        x = torch.from_numpy(np.concatenate(xs)[: section.max_windows])
        n_patches = x.shape[-1] // 200
        if n_patches == 0 or x.shape[-1] % 200:
            raise ValueError(f"retained.window_s={section.window_s}: must be a whole number of 1-s patches")
        mask = random_patch_mask(len(x), x.shape[1], n_patches, section.mask_ratio,
                                 generator=torch.Generator().manual_seed(section.seed))
        _WINDOW_CACHE[key] = (x, mask)
    return _WINDOW_CACHE[key]


def _reconstruction_source(ctx) -> str | bool | None:
    """The pretrained model whose reconstruction head is put back: ``model.pretrained``, else the
    saved model of the last in-process stage of this run."""
    cfg = ctx.cfg
    if cfg.model.pretrained not in (None, False):
        return cfg.model.pretrained
    if not cfg.stages:
        return None
    stage = cfg.stages[-1]
    name = f"{len(cfg.stages) - 1}-{stage.family}"
    report = ctx.run_root / "stages" / name / "report.json"
    if report.is_file():
        saved = json.loads(report.read_text()).get("saved_model")
        return saved if saved and Path(saved).is_dir() else None
    return None


def _reconstruction_head(ctx) -> tuple[nn.Module | None, str]:
    cache = ctx.task.extras.setdefault("cbramod_reconstruction_head", {})
    source = _reconstruction_source(ctx)
    if source is None:
        return None, "no pretrained model (model.pretrained is null and there is no stage)"
    if str(source) not in cache:
        from domainfm.experiment import resolve

        kwargs = {k: v for k, v in ctx.cfg.model.kwargs.items() if k not in ("head_type", "head_dropout")}
        try:
            model, init = resolve(ctx.cfg.model.spec(source, **kwargs, n_chans=None, n_times=None, n_outputs=None,
                                                     reconstruction_head=True))
        except Exception as exc:  # e.g. a fine-tuned checkpoint without proj_out
            cache[str(source)] = (None, f"the pretrained model {source} has no usable reconstruction head ({exc})")
        else:
            cache[str(source)] = ((model.proj_out.eval(), f"{init}") if init.kind == "pretrained" else
                                  (None, f"the pretrained weights {source} were unavailable ({init})"))
    return cache[str(source)]


def _retained(ctx) -> dict[str, Any]:
    if not ctx.cfg.retained.enabled:
        return {"masked_mse": math.nan, "note": "retained.enabled=false"}
    proj_out, origin = _reconstruction_head(ctx)
    if proj_out is None:
        return {"masked_mse": math.nan, "note": origin}
    x, mask = retained_windows(ctx.cfg)
    device = next(ctx.model.parameters()).device
    # Our choice: a fine-tuned classifier has no reconstruction head, so the *pretrained* model's
    # head (proj_out) goes back on top of the arm's backbone; the error then says how far the
    # backbone's patch features drifted from what that head decodes, on EEG the task never saw.
    error = masked_reconstruction_error(ctx.model, proj_out.to(device), x, mask)
    patches = x.reshape(*mask.shape, -1)
    # the scale to read it against: the error of reconstructing every masked patch as zeros
    zero = float((patches[mask].double() ** 2).mean())
    return {"masked_mse": error, "zero_mse": zero, "windows": int(len(x)), "masked_patches": int(mask.sum())}


RETAINED = Retained(
    _retained, metric="masked_mse", direction="min",
    description="CBraMod's pretraining objective kept: masked-patch reconstruction MSE (fixed mask, ratio "
                "retained.mask_ratio) of the arm's backbone + the pretrained model's reconstruction head, on "
                "windows outside the task (default: channels of the shipped recording the task does not use)")


FAMILY = Family(
    name="cbramod",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"n_chans": task.info["n_chans"], "n_times": task.info["n_times"],
                                    "n_outputs": cfg.n_outputs, "reconstruction_head": False},
    head="head",
    protocols=[lambda ctx: _save_inference_settings(ctx)],
    retained=RETAINED,
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# ----------------------------------------------------------------------------- predict / embed

#: written beside a fine-tuned arm's saved model: how recordings become its inputs
SETTINGS_FILE = apply.SETTINGS_FILE
_LEGACY_SETTINGS_FILE = "eeg_settings.json"  # the name runs before the shared apply layer wrote


@dataclass
class InferenceSettings:
    """How a recording becomes a model's windows, and what its outputs mean.

    ``eeg``: channels (or bipolar pairs; None: every EEG channel of the file, in file order),
    reference, sampling rate, band-pass, notch, units and ``window_s``; ``reference_all``:
    average-reference over all of the file's EEG channels before picking (the demo task);
    ``task`` and ``classes`` (None: class indices); ``source``: where these settings came from."""

    eeg: eeg.EEGSettings
    reference_all: bool = False
    task: str = "multiclass"
    classes: list[str] | None = None
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("events", "file_labels", "event_offset_s", "min_duration_s", "trim_s", "reject_uv", "stride_s"):
            out["eeg"].pop(key, None)  # training-only: labels and window selection
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> "InferenceSettings":
        from domainfm import config as cfgmod

        try:
            settings = cfgmod.from_dict(eeg.EEGSettings, dict(data.get("eeg", {})))
        except Exception as exc:
            raise eeg.EEGError(f"{source}: 'eeg' is not a valid EEG settings section ({exc})") from exc
        return cls(settings, bool(data.get("reference_all", False)), str(data.get("task", "multiclass")),
                   data.get("classes"), source)


def _window_s(model: nn.Module, fallback: float) -> float:
    n_times = getattr(model, "n_times", None)
    return n_times / 200.0 if n_times else fallback


def settings_from_config(cfg: Config, model: nn.Module, *, source: str, channels: list | None = None) -> InferenceSettings:
    """The windowing a fine-tuning config used: ``data.eeg`` (files; ``channels``: those the task's
    windows had), the demo's (the scalp channels average-referenced, then 4 neighbouring channels x
    4 s: by default the first frontal group), or for ``npz`` runs, whose windows were made outside
    domainfm and whose preprocessing is not recorded, ``data.eeg`` as configured (default: 0.3-75
    Hz, 60 Hz notch, 200 Hz, 100 µV) with the model's own ``n_times``."""
    demo = DEMO_REGIONS["frontal"][:4] if cfg.data.kind == "demo" else None  # it takes any 4 neighbours
    settings = dataclasses.replace(cfg.data.eeg, channels=channels or cfg.data.eeg.channels or demo,
                                   window_s=_window_s(model, cfg.data.eeg.window_s))
    note = {"demo": f"; demo task: scalp channels average-referenced, then 4 neighbouring ones (default {demo})",
            "npz": "; npz windows: preprocessing not recorded, data.eeg as configured"}.get(cfg.data.kind, "")
    return InferenceSettings(settings, reference_all=cfg.data.kind == "demo", task=cfg.task,
                             classes=class_names(cfg), source=source + note)


def _card_settings(model: nn.Module) -> InferenceSettings:
    # A model without a recorded pipeline: the card's input spec (200 Hz, 100 µV) and the official
    # TUEG preprocessing (0.3-75 Hz band-pass, 60 Hz notch, no re-referencing); its 19 pretraining
    # channels when the model takes 19, else every EEG channel of the file.
    n_chans = getattr(model, "n_chans", None)
    channels = list(eeg.TUEG_19) if n_chans in (None, 19) else None
    n_out = getattr(model, "n_outputs", None)
    return InferenceSettings(eeg.EEGSettings(channels=channels, window_s=_window_s(model, 30.0)),
                             task="multiclass" if (n_out or 0) > 1 else "binary",
                             source="model card (200 Hz, 0.3-75 Hz, 60 Hz notch, 100 uV; no recorded pipeline)")


def _settings(ref: apply.ModelRef, model: nn.Module) -> InferenceSettings:
    for name in (SETTINGS_FILE, _LEGACY_SETTINGS_FILE):
        recorded = ref.recorded(name)
        if recorded is not None:
            data, path = recorded
            return InferenceSettings.from_json(data, str(path))
    cfg = ref.run_config(Config)
    if cfg is not None:
        return settings_from_config(cfg, model, source=f"run config of {ref.label}")
    return _card_settings(model)


def inference_settings(model_arg: Any, model: nn.Module, *, arm: str | None = None) -> InferenceSettings:
    """Where predict/embed take the windowing from, first found: the settings a fine-tuning run
    writes beside each arm's saved model (``apply_settings.json``); the run's ``config.yaml`` when
    ``model_arg`` is (or lies in) a run folder; the model card's input spec otherwise."""
    return _settings(apply.ModelRef.of(model_arg, arm), model)


def _save_inference_settings(ctx) -> dict[str, Any]:
    """Record how recordings become this arm's inputs beside its saved model, so that a copied
    model folder predicts as it was trained."""
    cfg = ctx.cfg
    if ctx.seed != cfg.train.seed + cfg.adapt.seeds[0]:
        return {}  # only the first seed's model is saved
    settings = settings_from_config(cfg, ctx.model, source="fine-tuning config", channels=ctx.task.info.get("channels"))
    apply.write_settings(Path(ctx.run_dir) / "model", settings.to_json())
    return {}


@dataclass
class ApplyOptions:
    channels: list[str] | None = apply.option(
        None, "comma-separated channel names replacing the model's (same count and order; found by name)")
    stride_s: float | None = apply.option(None, "window step in seconds (default: the window length)")
    allow_upsample: bool = apply.option(False, "accept a recording sampled below the model's rate (upsampled; adds "
                                               "no content)")
    fill_missing: str | None = apply.option(None, "zeros: feed channels the recording lacks as zeros", choices=["zeros"])


def _apply_overrides(settings: InferenceSettings, *, channels: list[str] | None = None,
                     allow_upsample: bool = False) -> InferenceSettings:
    changes: dict[str, Any] = {}
    if channels:
        changes.update(channels=list(channels), bipolar=None)
    if allow_upsample:
        changes["allow_upsample"] = True
    return dataclasses.replace(settings, eeg=dataclasses.replace(settings.eeg, **changes)) if changes else settings


@dataclass
class _Windows:
    x: np.ndarray
    starts: np.ndarray
    settings: InferenceSettings
    source: str
    channel_note: str = ""  # how the model's channels were found in the recording (for the summary)


def _read(recording, settings: InferenceSettings, options: ApplyOptions | None) -> _Windows:
    options = options or ApplyOptions()
    settings = _apply_overrides(settings, channels=options.channels, allow_upsample=options.allow_upsample)
    source = str(recording) if isinstance(recording, (str, Path)) else getattr(recording, "filenames_for_errors", None)
    x, starts, match = eeg.recording_windows(recording, settings.eeg, stride_s=options.stride_s, return_match=True,
                                             reference_all=settings.reference_all, source=source,
                                             fill_missing=options.fill_missing)
    if x.shape[-1] % 200:
        raise eeg.EEGError(f"{source or '<recording>'}: window_s={settings.eeg.window_s} gives {x.shape[-1]} samples, "
                           "not whole 1-s patches")
    return _Windows(x, starts.astype(np.float64), settings, source or "<recording>", f"; {match}" if match else "")


def _check_channels(data: _Windows, model: nn.Module) -> None:
    n_chans, head = getattr(model, "n_chans", None), getattr(model, "head", None)
    # heads whose input size fixes the channels: ours over all patches, and braindecode's classifier
    fixed = getattr(head, "head_type", None) in ("all_patch_reps", "flatten_emb")
    if n_chans and head is not None and fixed and data.x.shape[1] != n_chans:
        picked = data.settings.eeg.channels or "every EEG channel of the file"
        raise eeg.EEGError(
            f"{data.source}: the model takes {n_chans} channels but the recording gives "
            f"{data.x.shape[1]} ({picked}); name {n_chans} channels with --channels (Python: channels=[...]), in the "
            "order the model was trained on")


def _predict(data: _Windows, model: nn.Module, settings, options, run: apply.Runtime) -> apply.Output:
    import pandas as pd

    _check_channels(data, model)
    logits = run.batched(model, torch.from_numpy(data.x))
    frame = pd.DataFrame({"start_s": data.starts, "end_s": data.starts + data.settings.eeg.window_s})
    summary = f"{len(frame)} windows (settings: {data.settings.source}{data.channel_note})"
    if data.settings.task == "regression":
        frame["predicted"] = logits.reshape(len(logits), -1)[:, 0].double().numpy()
        return apply.Output(frame, summary=summary)
    if logits.shape[-1] == 1:
        p1 = torch.sigmoid(logits.reshape(-1).double())
        probs = torch.stack([1 - p1, p1], dim=1).numpy()
    else:
        probs = torch.softmax(logits.double(), dim=-1).numpy()
    names = data.settings.classes
    if not names or len(names) != probs.shape[1]:
        names = [str(i) for i in range(probs.shape[1])]
    frame["predicted"] = np.asarray(names, dtype=object)[probs.argmax(axis=1)]
    for i, name in enumerate(names):
        frame[f"p_{name}"] = probs[:, i]
    return apply.Output(frame, summary=f"{summary[:-1]}; {len(names)} classes)")


def _embed(data: _Windows, model: nn.Module, settings, options, run: apply.Runtime) -> apply.Output:
    _check_channels(data, model)

    def pooled(x):
        features = model.forward_features(x)
        return (model.forward_head(features, pre_logits=True) if getattr(model, "head", None) is not None
                else features.mean(dim=(1, 2)))

    emb = run.batched(pooled, torch.from_numpy(data.x)).numpy()
    out = {"start_s": data.starts, "end_s": data.starts + data.settings.eeg.window_s, "embeddings": emb,
           "channels": np.asarray(data.settings.eeg.channels or [], dtype=str)}
    return apply.Output(out, summary=f"{emb.shape[0]} windows x {emb.shape[1]} (settings: {data.settings.source}{data.channel_note})")


APPLY = apply.Applier(
    family="cbramod",
    input="one EEG recording (EDF/BDF/FIF/BrainVision .vhdr/EEGLAB .set)",
    description="The recording is windowed as the model was trained: from the apply_settings.json beside a fine-tuned "
                "model, the run's config.yaml, or the model card (200 Hz, 0.3-75 Hz, 60 Hz notch, 100 uV).",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=32,
    predict=apply.Command(_predict, apply.TABLE, needs_head=True,
                          what="CBraMod class probabilities per window (CSV: start_s, end_s, predicted, p_<class>)."),
    embed=apply.Command(_embed, apply.ARRAYS, default_model="cbramod-base",
                        what="Per-window CBraMod embeddings (.npz: start_s, end_s, embeddings (n, num_features), "
                             "channels)."),
)


def predict(recording, model: str | Path | nn.Module, settings: InferenceSettings | None = None, *,
            channels: list[str] | None = None, stride_s: float | None = None, allow_upsample: bool = False,
            batch_size: int = 32, precision: str = "auto", arm: str | None = None, fill_missing: str | None = None):
    """Class probabilities of a fine-tuned CBraMod for every window of one recording.

    Args:
        recording: an EDF/BDF/FIF/BrainVision (.vhdr)/EEGLAB (.set) file, or an MNE ``Raw``.
        model: a fine-tuned model, a ``save_pretrained`` folder or a run folder (``arm``).
        settings: the windowing (default :func:`inference_settings` of ``model``).
        channels: the model's channels, found by name in the recording (default those it was trained on);
            ``fill_missing="zeros"`` feeds those the recording lacks as zeros (default: an error).
        stride_s: window step (default the window length: consecutive, non-overlapping windows).
        precision: ``auto`` (bf16 autocast where the device has native bf16, else fp32),
            ``32-true`` or ``bf16-mixed``. Tolerance (tested): bf16 logits differ from fp32 by
            less than 2 % of the largest |logit|; probabilities by less than 0.02 on average, and
            the predicted class is the same in >= 90 % of windows (measured figures:
            ``benchmarks/README.md``). Pass ``precision="32-true"`` for reproducible figures.

    Returns a ``pandas.DataFrame``, one row per window: ``start_s``, ``end_s`` (seconds from the
    first sample), ``predicted`` (the class name where known, else its index) and ``p_<class>``
    per class (rows sum to 1; binary tasks: ``p_<neg>``, ``p_<pos>`` from the sigmoid). A
    regression model gives ``predicted`` only.
    """
    return apply.run("predict", APPLY, model, recording, settings=settings, arm=arm, precision=precision,
                     batch_size=batch_size, options=ApplyOptions(channels, stride_s, allow_upsample, fill_missing)).value


def embed(recording, model: str | Path | nn.Module = "cbramod-base", settings: InferenceSettings | None = None, *,
          channels: list[str] | None = None, stride_s: float | None = None, allow_upsample: bool = False,
          batch_size: int = 32, precision: str = "auto", arm: str | None = None, pretrained: Any = None,
          fill_missing: str | None = None) -> dict[str, np.ndarray]:
    """Per-window CBraMod embeddings of one recording: ``{"start_s", "end_s", "embeddings" (n,
    num_features), "channels"}``. The patch features (``forward_features``, ``(C, N, d)``) are
    pooled as the model's head sees them: the head's ``pre_logits`` (the ``all_patch_reps`` MLP's
    last hidden layer, or the mean over channels and patches for ``avgpooling_patch_reps``); a
    model without a head (a pretrained backbone) gives the mean over channels and patches.
    Arguments as :func:`predict`; ``pretrained`` picks the weights of a model given by name."""
    return apply.run("embed", APPLY, model, recording, settings=settings, arm=arm, pretrained=pretrained,
                     precision=precision, batch_size=batch_size,
                     options=ApplyOptions(channels, stride_s, allow_upsample, fill_missing)).value
