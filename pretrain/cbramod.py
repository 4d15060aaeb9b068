"""CBraMod pretraining: masked patch reconstruction on the engine.

Each (channel, patch) of a window is masked independently with probability ``mask_ratio`` (0.5)
and replaced by the model's fixed mask encoding; the model reconstructs every patch and the loss
is the MSE over the masked patches only (paper Sec. 3.4; official ``pretrain_trainer.py``).
Paper defaults (``configs/cbramod/pretrain.yaml``): TUEG, 19 channels, 30 s windows, AdamW lr
5e-4, weight decay 5e-2, gradient clipping 1, cosine per step to 1e-5, batch 128, 40 epochs.

Data: either ``data.shards`` (a folder written by :func:`domainfm.data_loaders.eeg.write_shards`,
memory-mapped and read across ranks), or recordings under ``data.root`` matching ``data.files``
(globs), windowed with ``data.eeg``; with ``data.preprocess_to`` those recordings are written to
shards first (do this once for a large corpus), e.g.::

    domainfm pretrain cbramod data.root=/data/tueg data.preprocess_to=/data/tueg_shards
    domainfm pretrain cbramod data.shards=/data/tueg_shards
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
from torch import nn
from torch.utils.data import Subset

from domainfm.data_loaders import eeg
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "DataSection", "MaskedReconstructionRecipe", "random_patch_mask",
           "masked_reconstruction_error", "run", "evaluate", "build_datasets"]


def _tueg_settings() -> eeg.EEGSettings:
    return eeg.EEGSettings(channels=list(eeg.TUEG_19), sfreq=200.0, l_freq=0.3, h_freq=75.0, notch=[60.0],
                           window_s=30.0, min_duration_s=300.0, trim_s=60.0, reject_uv=100.0)


@dataclass
class DataSection:
    shards: str | None = None
    root: str | None = None
    files: list[str] = field(default_factory=lambda: ["**/*.edf"])
    eeg: eeg.EEGSettings = field(default_factory=_tueg_settings)
    #: write the windows of data.root/files into shards here, then train from them
    preprocess_to: str | None = None
    shard_size: int = 4096
    #: recordings that fail a check (missing channel, too short, ...) are skipped and counted, as officially
    skip_bad_files: bool = True
    val_fraction: float = 0.0


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
    """MSE between reconstructed and original patches, on masked patches only."""

    def __init__(self, model, train_dataset, val_dataset=None, *, mask_ratio: float = 0.5):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.mask_ratio = mask_ratio

    def _loss(self, model, x, generator=None):
        if hasattr(model, "mark_forward_method") and "forward_reconstruction" not in model._forward_methods:
            # route the call through DDP's forward (gradient sync) when Fabric wraps the model
            model.mark_forward_method("forward_reconstruction")
        patches = x if x.dim() == 4 else x.reshape(x.shape[0], x.shape[1], -1, 200)
        b, c, n, _ = patches.shape
        mask = random_patch_mask(b, c, n, self.mask_ratio, generator=generator, device=x.device)
        rec = model.forward_reconstruction(patches, mask)
        return F.mse_loss(rec.float()[mask], patches.float()[mask])

    def step(self, model, batch):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        loss = self._loss(model, x)
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        # a fixed mask per batch content, so validation losses are comparable across epochs
        seed = int(torch.as_tensor(x.shape).prod()) + int((x[..., :8].float().abs().sum() * 1e3).item()) % (2**31)
        loss = self._loss(model, x, generator=torch.Generator().manual_seed(seed))
        return {"loss": loss.detach().float().reshape(1).expand(len(x)).clone()}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean())}


def _recordings(data: DataSection) -> list[Path]:
    if data.root is None:
        raise ValueError(
            "pretraining data: set data.shards=DIR (shards from a previous data.preprocess_to run) or "
            "data.root=DIR with data.files globs (e.g. the TUEG edf tree)"
        )
    files = list(eeg.iter_files(data.root, data.files))
    if not files:
        raise ValueError(f"data.root={data.root!r}: no file matches data.files={data.files}")
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


def build_datasets(data: DataSection, seed: int = 0):
    """(train, val or None, info) for the data section."""
    skipped: list[str] = []
    info: dict[str, Any] = {}
    if data.shards is None and data.preprocess_to is not None:
        eeg.write_shards(_windows(data, skipped), data.preprocess_to, shard_size=data.shard_size,
                         meta={"settings": dataclasses.asdict(data.eeg), "skipped": skipped})
        data = dataclasses.replace(data, shards=data.preprocess_to)
    if data.shards is not None:
        dataset = eeg.ShardDataset(data.shards)
        info["data_source"] = f"shards: {data.shards}"
    else:
        windows = list(_windows(data, skipped))
        if not windows:
            raise ValueError(
                f"no usable windows in data.root={data.root!r} (recordings skipped: {skipped[:3]}); if none was "
                f"skipped, data.eeg.reject_uv={data.eeg.reject_uv} rejected every window")
        dataset = eeg.WindowDataset(np.concatenate(windows))
        info["data_source"] = f"recordings: {data.root}"
    info["windows"] = len(dataset)
    info["files_skipped"] = len(skipped)
    if skipped:
        print(f"skipped {len(skipped)} recording(s); first: {skipped[0]}")
    if data.val_fraction <= 0:
        return dataset, None, info
    n_val = max(1, int(round(len(dataset) * data.val_fraction)))
    if n_val >= len(dataset):
        raise ValueError(f"data.val_fraction={data.val_fraction} leaves no training windows out of {len(dataset)}")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    info["val_windows"] = n_val
    return Subset(dataset, order[n_val:]), Subset(dataset, order[:n_val]), info


def _window_shape(dataset) -> tuple[int, int]:
    first = dataset[0]
    first = first[0] if isinstance(first, (tuple, list)) else first
    return int(first.shape[0]), int(first.shape[1])


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import lora, save_pretrained

    train_ds, val_ds, info = build_datasets(cfg.data, seed=cfg.train.seed)
    n_chans, n_times = _window_shape(train_ds)
    kwargs = {**cfg.model.kwargs, "n_chans": n_chans, "n_times": n_times, "n_outputs": None, "reconstruction_head": True}
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    init = init_label(cfg.model.pretrained, init_info)
    train_cfg = cfg.train
    if val_ds is not None and train_cfg.monitor is None:
        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    result = Trainer(train_cfg, run_dir=run_dir).fit(
        MaskedReconstructionRecipe(model, train_ds, val_ds, mask_ratio=cfg.mask_ratio))
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    summary = lora.trainable_summary(model)
    report = {
        "model": cfg.model.name,
        "init": init,
        "objective": f"masked patch reconstruction (MSE on masked patches, mask ratio {cfg.mask_ratio})",
        "params_total": summary["total"],
        "params_trainable": summary["trainable"],
        "input": f"{n_chans} ch x {n_times // 200} patches",
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
    """Masked-reconstruction loss of ``run_dir``'s selected model (``RUN/model``) on the configured data."""
    from domainfm import create_model

    train_ds, val_ds, _ = build_datasets(dataclasses.replace(cfg.data, preprocess_to=None), seed=cfg.train.seed)
    dataset = val_ds if val_ds is not None else train_ds
    model = create_model(Path(run_dir) / "model")
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    return trainer.evaluate(MaskedReconstructionRecipe(model, None, dataset, mask_ratio=cfg.mask_ratio), dataset)
