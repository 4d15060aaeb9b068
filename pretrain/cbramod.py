"""CBraMod pretraining: masked patch reconstruction on the engine.

Each (channel, patch) of a window is masked independently with probability ``mask_ratio`` (0.5)
and replaced by the model's fixed mask encoding; the model reconstructs every patch and the loss
is the MSE over the masked patches only (paper Sec. 3.4; official ``pretrain_trainer.py``).
Paper defaults (``configs/cbramod/pretrain.yaml``): TUEG, 19 channels, 30 s windows, AdamW lr
5e-4, weight decay 5e-2, gradient clipping 1, cosine per step to 1e-5, batch 128, 40 epochs.

A window's mask is drawn when the window is read (:class:`MaskedWindows`), from
:class:`~domainfm.engine.SampleSeeds` at (run seed, epoch, index), and the loss is divided by the
number of masked values of the *global* batch (summed over ranks): a run on W processes with batch
B per process computes the loss and gradient of one process with batch W·B, step for step, up to
the order of float sums. Only with the backbone's dropout off (``model.kwargs.dropout=0``): the
model draws its dropout masks from each process's RNG, so with dropout (the paper's 0.1) the two
agree in distribution, not draw for draw.

Data (``data.kind``):

* ``memory`` (default, small data): the recordings under ``data.root`` matching ``data.files``
  (globs), windowed with ``data.eeg`` and held in memory.
* ``streaming`` (a corpus, e.g. TUEG): recordings converted once by ``domainfm prepare cbramod``
  (:data:`PREPARE`: each read with MNE and windowed with :class:`CorpusSettings`, the paper's TUEG
  pipeline by default) and read from ``data.path`` (a folder, or its copy at ``s3://...``); the
  corpus's settings must equal ``data.eeg`` field by field::

    domainfm prepare cbramod --input /data/tueg/edf --output /data/tueg_corpus
    domainfm pretrain cbramod data.kind=streaming data.path=/data/tueg_corpus
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from domainfm import streaming
from domainfm.distributed import global_batch_mean
from domainfm.data_loaders import eeg
from domainfm.engine import Recipe, SampleSeeds, TrainConfig, Trainer
from domainfm.errors import InputError
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "DataSection", "CorpusSettings", "PREPARE", "prepare_recording",
           "MaskedWindows", "MaskedReconstructionRecipe", "random_patch_mask", "masked_reconstruction_error",
           "check_corpus_settings", "run", "evaluate", "build_datasets"]

_FAMILY = "cbramod"
#: the epoch whose seeds draw the validation masks: fixed across training (validation losses
#: compare between epochs) and never a training epoch's
_VALIDATION_EPOCH = -1


# --------------------------------------------------------------------------- corpus preparation


@dataclass
class CorpusSettings(eeg.EEGSettings):
    """What ``domainfm prepare cbramod`` does to each recording: the fields of ``data.eeg``
    (:class:`~domainfm.data_loaders.eeg.EEGSettings`) with the paper's TUEG pipeline as defaults
    (19 channels, 200 Hz, 0.3-75 Hz, 60 Hz notch, 30 s windows, recordings under 5 min dropped, the
    first and last minute trimmed, windows reaching 100 µV rejected), so a corpus prepared without
    settings matches ``configs/cbramod/pretrain.yaml``.

    ``skip_bad_files``: a recording that fails a check (a channel missing, too short, ...) gives
    no windows, with a warning naming it, as officially; false: it fails the preparation."""

    channels: list[str] | None = field(default_factory=lambda: list(eeg.TUEG_19))
    min_duration_s: float | None = 300.0
    trim_s: float = 60.0
    reject_uv: float | None = 100.0
    skip_bad_files: bool = True

    def eeg_settings(self) -> eeg.EEGSettings:
        return eeg.EEGSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(eeg.EEGSettings)})


def prepare_recording(settings: CorpusSettings, path: str) -> list[dict[str, np.ndarray]]:
    """The windows of one recording as corpus samples ``{"x": float32 (C, T)}`` in model units
    (100 µV), read with MNE and windowed as :func:`~domainfm.data_loaders.eeg.load_windows` does
    for ``data.kind=memory``."""
    try:
        x, _ = eeg.load_windows(path, settings.eeg_settings())
    except eeg.EEGError as exc:
        if not settings.skip_bad_files:
            raise
        warnings.warn(f"skipped (skip_bad_files=true): {exc}", UserWarning, stacklevel=2)
        return []
    return [{"x": np.ascontiguousarray(window, dtype=np.float32)} for window in x]


#: ``domainfm prepare cbramod --input FILES/DIRS --output DIR [key=value ...]`` (keys: :class:`CorpusSettings`)
PREPARE = streaming.Preparation(
    convert=prepare_recording, settings=CorpusSettings, suffixes=(".edf", ".bdf", ".fif", ".fif.gz", ".vhdr", ".set"),
    what="EEG recordings (EDF/BDF/FIF/BrainVision/EEGLAB, read with MNE) -> windows in units of 100 µV, the paper's "
         "TUEG pipeline unless key=value settings say otherwise")


# --------------------------------------------------------------------------- config


def _tueg_settings() -> eeg.EEGSettings:
    return CorpusSettings().eeg_settings()


@dataclass
class DataSection:
    #: "memory": recordings under root/files, windowed in memory; "streaming": a prepared corpus at path
    kind: str = "memory"
    #: streaming: a folder written by `domainfm prepare cbramod`, or its copy (s3://bucket/corpus)
    path: str | None = None
    #: streaming from object storage: where the chunks read are cached (default: LitData's)
    cache_dir: str | None = None
    root: str | None = None
    files: list[str] = field(default_factory=lambda: ["**/*.edf"])
    #: how recordings become windows; with data.kind=streaming, what the corpus must have been prepared with
    eeg: eeg.EEGSettings = field(default_factory=_tueg_settings)
    #: recordings that fail a check (missing channel, too short, ...) are skipped and counted, as officially
    skip_bad_files: bool = True
    val_fraction: float = 0.0

    def __post_init__(self):
        if self.kind not in ("memory", "streaming"):
            raise ValueError(f"data.kind={self.kind!r}: expected 'memory' (recordings under data.root) or "
                             "'streaming' (a corpus from `domainfm prepare cbramod` at data.path)")
        if self.kind == "streaming" and not self.path:
            raise ValueError("data.kind=streaming: set data.path to a corpus from `domainfm prepare cbramod` "
                             "(a folder, or s3://...)")


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="cbramod-base"))
    data: DataSection = field(default_factory=DataSection)
    mask_ratio: float = 0.5
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=40, batch_size=128, lr=5e-4, weight_decay=5e-2, clip_grad_norm=1.0, schedule="cosine",
        min_lr=1e-5, monitor=None))

    def __post_init__(self):
        if not 0.0 < self.mask_ratio < 1.0:
            raise ValueError(f"mask_ratio={self.mask_ratio}: expected a probability in (0, 1)")


# --------------------------------------------------------------------------- the objective


def random_patch_mask(batch: int, n_chans: int, n_patches: int, ratio: float, *, generator=None,
                      device=None) -> torch.Tensor:
    """Bool ``(B, C, N)``: each (channel, patch) masked independently with probability ``ratio``;
    at least one patch per example is masked (the loss needs one)."""
    mask = torch.rand(batch, n_chans, n_patches, generator=generator, device="cpu") < ratio
    empty = ~mask.flatten(1).any(dim=1)
    if empty.any():
        flat = mask.view(batch, -1)
        pick = torch.randint(0, n_chans * n_patches, (int(empty.sum()),), generator=generator)
        flat[empty.nonzero().flatten(), pick] = True
    return mask.to(device) if device is not None else mask


class MaskedWindows(Dataset):
    """Windows ``(C, T)`` with the objective's patch mask: item ``i`` is ``(x, mask)``, ``mask``
    bool ``(C, T / patch_size)`` as :func:`random_patch_mask` draws it for one window, from
    :class:`~domainfm.engine.SampleSeeds` at ``(seed, epoch, i)``. The same window gets the same
    mask on any rank and in any batch; each epoch draws new masks (the engine calls
    :meth:`set_epoch`). ``blocks``: those of ``windows`` (a prepared corpus's chunks), if any."""

    def __init__(self, windows: Dataset, *, mask_ratio: float, patch_size: int = 200, seed: int = 0):
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio={mask_ratio}: expected a probability in (0, 1)")
        self.windows, self.mask_ratio, self.patch_size = windows, float(mask_ratio), int(patch_size)
        self.seeds = SampleSeeds(seed)

    @property
    def blocks(self) -> list[tuple[int, int]] | None:
        return getattr(self.windows, "blocks", None)

    def set_epoch(self, epoch: int) -> None:
        self.seeds.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.windows[index]
        n_chans, n_times = x.shape
        mask = random_patch_mask(1, n_chans, n_times // self.patch_size, self.mask_ratio,
                                 generator=self.seeds.generator(index))[0]
        return x, mask


@torch.no_grad()
def masked_reconstruction_error(backbone: nn.Module, proj_out: nn.Module, x: torch.Tensor, mask: torch.Tensor,
                                *, batch_size: int = 16) -> float:
    """CBraMod's pretraining loss with a given mask: MSE between ``proj_out`` of ``backbone``'s
    features of the masked input and the original patches, over the masked patches only."""
    backbone.eval()
    device = next(backbone.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(x), batch_size):
        patches = backbone.patchify(x[start:start + batch_size].to(device))
        m = mask[start:start + batch_size].to(device)
        rec = proj_out(backbone.encoder(backbone.patch_embedding(patches, m))).float()
        total += float(((rec - patches.float())[m] ** 2).sum())
        count += int(m.sum()) * patches.shape[-1]
    return total / count


class MaskedReconstructionRecipe(Recipe):
    """MSE between reconstructed and original patches, on masked patches only; batches are
    ``(x, mask)`` from :class:`MaskedWindows`."""

    def __init__(self, model, train_dataset, val_dataset=None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset

    @staticmethod
    def _squared_errors(model, x, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Per window: the summed squared error over its masked patches, and how many values that is."""
        if hasattr(model, "mark_forward_method") and "forward_reconstruction" not in model._forward_methods:
            # route the call through DDP's forward (gradient sync) when Fabric wraps the model
            model.mark_forward_method("forward_reconstruction")
        b, c, n = mask.shape
        patches = x if x.dim() == 4 else x.reshape(b, c, n, -1)
        rec = model.forward_reconstruction(patches, mask)
        error = (rec.float() - patches.float()).pow(2).sum(dim=-1) * mask
        return error.flatten(1).sum(dim=1), mask.flatten(1).sum(dim=1) * patches.shape[-1]

    def _loss(self, model, x, mask) -> torch.Tensor:
        # the mean over the global batch's masked values, whatever share each rank's windows hold
        squared, counts = self._squared_errors(model, x, mask)
        return global_batch_mean(squared.sum(), counts.sum().double())

    def step(self, model, batch):
        x, mask = batch
        loss = self._loss(model, x, mask)
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        x, mask = batch
        squared, counts = self._squared_errors(model, x, mask)
        return {"squared_error": squared.detach().double(), "count": counts.detach().double()}

    def metrics(self, outputs):
        # the mean over every masked value of the set, however it was batched or split over ranks
        return {"loss": float(outputs["squared_error"].sum() / outputs["count"].sum())}


# --------------------------------------------------------------------------- data


def _recordings(data: DataSection) -> list[Path]:
    if data.root is None:
        raise InputError(
            "pretraining data: set data.root=DIR with data.files globs (recordings read in memory), or "
            "data.kind=streaming data.path=DIR (a corpus from `domainfm prepare cbramod`, e.g. of the TUEG edf tree)"
        )
    files = list(eeg.iter_files(data.root, data.files))
    if not files:
        raise InputError(f"data.root={data.root!r}: no file matches data.files={data.files}")
    return files


def _windows(data: DataSection, skipped: list[str]):
    for path in _recordings(data):
        try:
            x, _ = eeg.load_windows(path, data.eeg)
        except eeg.EEGError as exc:
            if not data.skip_bad_files:
                raise
            skipped.append(str(exc))
            continue
        if len(x):
            yield x


#: the old 10-20 names of the sites the 10-10 system renamed (T3 and T7 are one electrode)
_RENAMED_1020 = {"T3": "T7", "T4": "T8", "T5": "P7", "T6": "P8"}


def _canonical_channel(name: str) -> str:
    name = eeg.normalize_channel_name(name)
    return _RENAMED_1020.get(name, name)


def _same(field_name: str, have: Any, want: Any) -> bool:
    if field_name == "channels" and have is not None and want is not None:
        return [_canonical_channel(c) for c in have] == [_canonical_channel(c) for c in want]
    if isinstance(have, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(have) == len(want) and all(_same("", a, b) for a, b in zip(have, want))
    if isinstance(have, bool) or isinstance(want, bool):
        return have is want
    if isinstance(have, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(float(have), float(want), rel_tol=1e-9, abs_tol=1e-12)
    return have == want


def check_corpus_settings(corpus: streaming.PreparedCorpus, settings: eeg.EEGSettings, *, patch_size: int = 200) -> None:
    """Refuse a corpus prepared otherwise than ``settings`` (the config's ``data.eeg``), naming
    every field that differs with both values (channels compared as sites: ``T3`` is ``T7``, case
    and reference suffixes aside), and one whose windows are not ``(channels, window_s·sfreq)``
    samples in whole patches."""
    prepared = corpus.settings
    wanted = json.loads(json.dumps(dataclasses.asdict(settings)))
    names = [f.name for f in dataclasses.fields(eeg.EEGSettings)]
    unrecorded = [name for name in names if name not in prepared]
    if unrecorded:
        raise streaming.PrepareError(
            f"data.path {corpus.path}: the corpus records no setting {unrecorded} (prepared by another version?); "
            f"prepare it again with `domainfm prepare {_FAMILY}`")
    differ = [name for name in names if not _same(name, prepared[name], wanted[name])]
    if differ:
        listed = "; ".join(f"{name}={prepared[name]!r} (config: data.eeg.{name}={wanted[name]!r})" for name in differ)
        raise streaming.PrepareError(
            f"data.path {corpus.path}: the corpus was prepared with other settings than the config's data.eeg: "
            f"{listed}. Set data.eeg.{differ[0]} (and the others) to the corpus's values to train on it, or "
            "prepare it again with the config's")
    pairs = settings.pairs()
    n_chans = len(pairs) if pairs is not None else (len(settings.channels) if settings.channels is not None else None)
    n_times = int(round(settings.window_s * settings.sfreq))
    shape = tuple(corpus[0].shape)
    if (n_chans is not None and shape[0] != n_chans) or shape[1] != n_times:
        raise streaming.PrepareError(
            f"data.path {corpus.path}: windows of shape {shape}, expected ({n_chans if n_chans is not None else 'C'}, "
            f"{n_times}) from data.eeg (channels, window_s={settings.window_s:g} s at sfreq={settings.sfreq:g} Hz)")
    if n_times % patch_size:
        raise streaming.PrepareError(
            f"data.path {corpus.path}: data.eeg.window_s={settings.window_s:g} s is {n_times} samples, not a "
            f"multiple of the model's {patch_size}-sample patches")


def _window_tensor(item: dict) -> torch.Tensor:
    return torch.as_tensor(np.asarray(item["x"], dtype=np.float32))


class _Part(Dataset):
    """The windows of ``dataset`` at ``indices`` (sorted); ``blocks``: the dataset's chunks as
    runs of these positions, so that reading a part still goes chunk by chunk."""

    def __init__(self, dataset: Dataset, indices):
        self.dataset, self.indices = dataset, sorted(int(i) for i in indices)
        base = getattr(dataset, "blocks", None)
        self.blocks = None
        if base is not None:
            spans = [(bisect.bisect_left(self.indices, a), bisect.bisect_left(self.indices, b)) for a, b in sorted(base)]
            self.blocks = [(a, b) for a, b in spans if b > a]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[self.indices[index]]


def build_datasets(data: DataSection, seed: int = 0):
    """(train, val or None, info) for the data section: windows ``(C, T)`` float32 in model units."""
    skipped: list[str] = []
    info: dict[str, Any] = {}
    if data.kind == "streaming":
        dataset = streaming.PreparedCorpus(data.path, family=_FAMILY, cache_dir=data.cache_dir,
                                           transform=_window_tensor)
        check_corpus_settings(dataset, data.eeg)
        info["data_source"] = dataset.describe()
        info["files"] = len(dataset.manifest.get("inputs") or [])
    else:
        windows = list(_windows(data, skipped))
        if not windows:
            raise InputError(
                f"no usable windows in data.root={data.root!r} (recordings skipped: {skipped[:3]}); if none was "
                f"skipped, data.eeg.reject_uv={data.eeg.reject_uv} rejected every window")
        dataset = eeg.WindowDataset(np.concatenate(windows))
        info["data_source"] = f"recordings: {data.root}"
        info["files_skipped"] = len(skipped)
        if skipped:
            print(f"skipped {len(skipped)} recording(s); first: {skipped[0]}")
    info["windows"] = len(dataset)
    if data.val_fraction <= 0:
        return dataset, None, info
    n_val = max(1, int(round(len(dataset) * data.val_fraction)))
    if n_val >= len(dataset):
        raise InputError(f"data.val_fraction={data.val_fraction} leaves no training windows out of {len(dataset)}")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    info["val_windows"] = n_val
    return _Part(dataset, order[n_val:]), _Part(dataset, order[:n_val]), info


def _masked(train_ds, val_ds, cfg: Config, patch_size: int):
    train = None if train_ds is None else MaskedWindows(train_ds, mask_ratio=cfg.mask_ratio, patch_size=patch_size,
                                                         seed=cfg.train.seed)
    val = None
    if val_ds is not None:
        val = MaskedWindows(val_ds, mask_ratio=cfg.mask_ratio, patch_size=patch_size, seed=cfg.train.seed)
        val.set_epoch(_VALIDATION_EPOCH)
    return train, val


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import lora, save_pretrained

    train_ds, val_ds, info = build_datasets(cfg.data, seed=cfg.train.seed)
    n_chans, n_times = (int(n) for n in train_ds[0].shape)
    kwargs = {**cfg.model.kwargs, "n_chans": n_chans, "n_times": n_times, "n_outputs": None, "reconstruction_head": True}
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    init = init_label(cfg.model.pretrained, init_info)
    patch_size = int(getattr(model, "patch_size", 200))
    train_ds, val_ds = _masked(train_ds, val_ds, cfg, patch_size)
    train_cfg = cfg.train
    if val_ds is not None and train_cfg.monitor is None:
        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    result = Trainer(train_cfg, run_dir=run_dir).fit(MaskedReconstructionRecipe(model, train_ds, val_ds))
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    summary = lora.trainable_summary(model)
    report = {
        "model": cfg.model.name,
        "init": init,
        "objective": f"masked patch reconstruction (MSE on masked patches, mask ratio {cfg.mask_ratio})",
        "params_total": summary["total"],
        "params_trainable": summary["trainable"],
        "input": f"{n_chans} ch x {n_times // patch_size} patches",
        "data_kind": cfg.data.kind,
        **info,
        "steps": result.global_step,
        "train_loss_first": losses[0] if losses else math.nan,
        "train_loss_last": losses[-1] if losses else math.nan,
        "checkpoint": str(result.best_checkpoint) if result.best_checkpoint else "",
        # the selected (best-validation) model, as a fine-tuning stage or `create_model(RUN/model)` loads it
        "saved_model": str(save_pretrained(result.model, Path(run_dir) / "model")),
    }
    if result.last_val:
        report["val_loss"] = result.last_val["loss"]
        report["best_val_loss"] = result.best_metric if result.best_metric is not None else result.last_val["loss"]
    return report


def evaluate(cfg: Config, run_dir: Path) -> dict:
    """Masked-reconstruction loss of ``run_dir``'s selected model (``RUN/model``) on the configured
    data (its validation windows, with the validation masks, if it has them)."""
    from domainfm import create_model

    train_ds, val_ds, _ = build_datasets(cfg.data, seed=cfg.train.seed)
    model = create_model(Path(run_dir) / "model")
    patch_size = int(getattr(model, "patch_size", 200))
    if val_ds is not None:
        _, dataset = _masked(None, val_ds, cfg, patch_size)
    else:
        dataset, _ = _masked(train_ds, None, cfg, patch_size)
        dataset.set_epoch(_VALIDATION_EPOCH)
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    return trainer.evaluate(MaskedReconstructionRecipe(model, None, dataset), dataset)
