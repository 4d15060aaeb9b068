"""Pretraining WaveToken / Chronos models on synthetic series: KernelSynth and TSMixup.

* The series come from :mod:`domainfm.data_loaders.synthetic_series` (KernelSynth, Chronos
  Alg. 2; TSMixup, Chronos Alg. 1; random training windows with missing values).
* The objective is the cross-entropy of the horizon's tokens under teacher forcing (labels of
  missing values ignored), on random (context, future) windows with missing-value injection.

Chronos's recipe (reproduced by ``configs/wavetoken/pretrain*.yaml`` for each size): context 512,
horizon 64, TSMixup 0.9 + KernelSynth 0.1, 200k steps, batch 32, AdamW, lr 1e-3 with linear decay,
no weight decay, drop probability 0.2, min_past 60. Chronos's TSMixup mixes its real training
corpus; here it mixes the KernelSynth pool plus any series you list in ``data.extra_series``
(long-format CSV/Parquet), since no corpus can be downloaded at run time.

``domainfm pretrain wavetoken`` runs ``configs/wavetoken/pretrain.yaml`` (a short run of the
test-sized model); the trained model is written to ``RUN/model`` (``create_model(RUN/model)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from domainfm.data_loaders.synthetic_series import (
    KERNEL_BANK,
    KERNEL_LENGTH,
    SyntheticWindows,
    fixed_windows,
    generate_kernel_synth,
    kernel_matrix,
    sample_kernel_synth,
    ts_mixup,
)
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

# The KernelSynth / TSMixup names stay importable from here (benchmarks/wavetoken.py and
# older code import them from the pretraining module).
__all__ = [
    "KERNEL_BANK",
    "KERNEL_LENGTH",
    "kernel_matrix",
    "sample_kernel_synth",
    "generate_kernel_synth",
    "ts_mixup",
    "SyntheticWindows",
    "fixed_windows",
    "ForecastRecipe",
    "ModelSection",
    "DataSection",
    "Config",
    "build_model",
    "parameter_counts",
    "run",
]


class ForecastRecipe(Recipe):
    """Cross-entropy of the future's tokens given the context's tokens (teacher forcing).

    Tokenization runs on the raw model's tokenizer; the forward pass goes through the engine's
    wrapped module (so data parallel and mixed precision apply). The tokenizer itself runs in fp32
    with autocast off (``SeriesTokenizer``), so the tokens under bf16 autocast are the fp32 ones
    and no caller-side guard is needed here.
    """

    def __init__(self, model, train_dataset, val_dataset=None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset

    def _loss(self, model, batch):
        context, future = batch[0], batch[1]
        ids, mask, labels = self.model.training_tokens(context, future)
        logits = model(ids, mask, self.model.shift_right(labels))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        valid = labels != -100
        correct = ((logits.argmax(-1) == labels) & valid).sum()
        return loss, correct, valid.sum()

    def step(self, model, batch):
        loss, correct, total = self._loss(model, batch)
        return loss, {"loss": loss.detach(), "token_accuracy": (correct / total.clamp(min=1)).detach()}

    def eval_step(self, model, batch):
        loss, correct, total = self._loss(model, batch)
        n = batch[0].shape[0]
        return {"loss": loss.detach().float().reshape(1).expand(n), "correct": correct.reshape(1).expand(n) / n,
                "total": total.reshape(1).expand(n).float() / n}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean()),
                "token_accuracy": float(outputs["correct"].sum() / outputs["total"].sum().clamp(min=1))}


# --------------------------------------------------------------------------- config + entry


@dataclass
class DataSection:
    kernel_synth_series: int = 1000
    kernel_synth_length: int = 1024
    max_kernels: int = 5
    tsmixup_prob: float = 0.9
    tsmixup_max_series: int = 3
    tsmixup_alpha: float = 1.5
    tsmixup_min_length: int = 128
    tsmixup_max_length: int = 2048
    extra_series: list[str] = field(default_factory=list)
    #: statsmodels-bundled datasets added to the TSMixup pool (data_loaders.timeseries.STATSMODELS_CORPUS)
    statsmodels: list[str] = field(default_factory=list)
    windows_per_epoch: int = 10000
    val_windows: int = 256
    missing_prob: float = 0.2
    min_past: int = 60
    seed: int = 0


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="wavetoken-test"))
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=TrainConfig)


def build_model(section: ModelSection):
    """The model to train and how it was initialised: ``model.pretrained`` a ``save_pretrained``
    folder of a registered variant, the card's weights (``true``), or null (random init)."""
    return resolve(section.spec(section.pretrained or False))


def _load_extra(paths: list[str]) -> list[np.ndarray]:
    from domainfm.data_loaders.timeseries import read_long

    out = []
    for path in paths:
        out.extend(np.asarray(s["target"], dtype=np.float32) for s in read_long(path))
    return out


def parameter_counts(model) -> dict[str, int]:
    return {"params_total": sum(p.numel() for p in model.parameters()),
            "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    import time

    from domainfm import save_pretrained
    from domainfm.atomic import atomic_write_json

    run_dir = Path(run_dir)
    d = cfg.data
    if not 0 <= d.tsmixup_prob <= 1:
        raise ValueError(f"data.tsmixup_prob={d.tsmixup_prob}: expected a probability")
    torch.manual_seed(cfg.train.seed)
    model, init_info = build_model(cfg.model)
    start = time.perf_counter()
    kernel_synth = generate_kernel_synth(d.kernel_synth_series, length=d.kernel_synth_length, max_kernels=d.max_kernels,
                                         seed=d.seed)
    synth_seconds = time.perf_counter() - start
    extra = _load_extra(d.extra_series)
    if d.statsmodels:
        from domainfm.data_loaders.timeseries import statsmodels_corpus

        extra += [s["target"] for s in statsmodels_corpus(d.statsmodels)]
    tsmixup = dict(max_series=d.tsmixup_max_series, alpha=d.tsmixup_alpha, min_length=d.tsmixup_min_length,
                   max_length=d.tsmixup_max_length)
    common = dict(context_length=model.context_length, prediction_length=model.prediction_length,
                  tsmixup_prob=d.tsmixup_prob, missing_prob=d.missing_prob, min_past=d.min_past, tsmixup=tsmixup)
    train = SyntheticWindows(kernel_synth, extra, num_windows=d.windows_per_epoch, **common)
    val = None
    if d.val_windows > 0:
        held_out = generate_kernel_synth(max(8, d.val_windows // 8), length=d.kernel_synth_length,
                                         max_kernels=d.max_kernels, seed=d.seed + 10_000)
        val = fixed_windows(SyntheticWindows(held_out, [], num_windows=d.val_windows, **common), d.val_windows, d.seed + 1)
    trainer = Trainer(cfg.train, run_dir=run_dir)
    result = trainer.fit(ForecastRecipe(model, train, val))
    model = result.model  # at its best checkpoint
    saved = str(save_pretrained(model, run_dir / "model"))
    report = {
        "model": getattr(model, "domainfm_name", cfg.model.name),
        "init": init_label(cfg.model.pretrained, init_info),
        **parameter_counts(model),
        "steps": result.global_step,
        "kernel_synth_series": d.kernel_synth_series,
        "kernel_synth_series_per_s": round(d.kernel_synth_series / max(synth_seconds, 1e-9), 1),
        "extra_series": len(extra),
        "model_dir": saved,
        "saved_model": saved,  # what the experiment layer takes from a stage
    }
    train_losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    if train_losses:
        report["train_loss_first"], report["train_loss_last"] = train_losses[0], train_losses[-1]
    for key, value in result.last_val.items():
        report[f"val_{key}"] = value
    report["uniform_loss"] = math.log(model.vocab_size)  # cross-entropy of a model that knows nothing
    atomic_write_json(run_dir / "pretrain_summary.json", report)
    return report
