"""The one training engine for pretraining and fine-tuning, on Lightning Fabric.

A *recipe* says what a step is; the :class:`Trainer` does everything else: device placement,
data parallel (DDP over gloo on CPU / nccl on GPU, FSDP for large variants; launched by
``torchrun`` or Fabric), mixed precision, gradient accumulation and clipping, AdamW with
warmup + cosine (optional layer-wise lr decay and a separate head lr), checkpoints with exact
resume (model, optimizer, scheduler, step, RNG, sampler position), best-by-metric selection,
early stopping, a JSONL metrics log and a progress bar. A recipe never writes its own loop::

    class MyRecipe(Recipe):
        def step(self, model, batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            return loss, {"loss": loss.detach()}

    trainer = Trainer(TrainConfig(max_epochs=3, lr=1e-3), run_dir="runs/demo/a")
    result = trainer.fit(MyRecipe(model, train_ds, val_ds))
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from domainfm.atomic import atomic_path, atomic_torch_save, atomic_write_text, remove_stale_temps

__all__ = [
    "TrainConfig",
    "Recipe",
    "Trainer",
    "FitResult",
    "ResumeError",
    "ResumableSampler",
    "SampleSeeds",
    "build_param_groups",
    "warmup_cosine",
    "atomic_torch_save",
    "atomic_write_text",
]


class ResumeError(RuntimeError):
    """``train.resume=true`` but there is nothing to resume from."""


# --------------------------------------------------------------------------- config


#: the metric writers ``train.loggers`` may name
LOGGERS = ("jsonl", "csv", "tensorboard")


def _accelerator_device(accelerator: str) -> str:
    if accelerator in ("auto", "gpu", "cuda"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator if accelerator in ("cpu", "cuda", "mps") else "cpu"


def _fabric_loggers(names: Sequence[str], run_dir: Path | None) -> list[Any]:
    """Lightning Fabric's loggers for ``names`` other than jsonl (the engine's own writer)."""
    if run_dir is None:
        return []
    out = []
    if "csv" in names:
        from lightning_fabric.loggers import CSVLogger

        out.append(CSVLogger(str(run_dir / "logs"), name="csv", version=""))
    if "tensorboard" in names:
        try:
            from lightning_fabric.loggers import TensorBoardLogger

            out.append(TensorBoardLogger(str(run_dir / "logs"), name="tensorboard", version=""))
        except ModuleNotFoundError as exc:
            raise ValueError("train.loggers: tensorboard needs its package: pip install 'domainfm[tensorboard]'") from exc
    return out


@dataclass
class TrainConfig:
    """Everything the engine needs; a recipe's YAML ``train:`` block is parsed into this.

    Steps are *optimizer* steps (one per ``grad_accum`` micro-batches). ``batch_size`` is the
    micro-batch per process; the effective batch is ``batch_size * grad_accum * world_size``.
    """

    max_epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    eval_batch_size: int | None = None
    lr: float = 1e-3
    head_lr: float | None = None
    head_patterns: list[str] = field(default_factory=lambda: ["head.*", "classifier.*", "fc.*"])
    layer_decay: float | None = None
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    schedule: str = "cosine"
    min_lr: float = 0.0
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    #: ``auto``: bf16 autocast with fp32 master weights where the device multiplies bf16 natively
    #: (CPUs with AMX/AVX512-BF16, CUDA GPUs with bf16), fp32 elsewhere (see domainfm.precision);
    #: or one of Lightning Fabric's names (``32-true``, ``bf16-mixed``, ...)
    precision: str = "auto"
    #: where metrics go: ``jsonl`` (RUN/metrics.jsonl, always kept: resume and pictures read it),
    #: plus Lightning Fabric's ``csv`` (RUN/logs/csv) and ``tensorboard`` (RUN/logs/tensorboard;
    #: ``pip install domainfm[tensorboard]``)
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    accelerator: str = "auto"
    strategy: str = "auto"
    devices: int | str = 1
    num_nodes: int = 1
    seed: int = 0
    monitor: str | None = None
    monitor_mode: str = "min"
    early_stopping_patience: int | None = None
    eval_every_epochs: int = 1
    checkpoint_every_steps: int | None = None
    log_every_steps: int = 10
    num_workers: int = 0
    shuffle: bool = True
    drop_last: bool = True
    progress: bool = True
    resume: bool = False
    #: with ``resume``: accept a config whose data, task or optimisation differ from the run's
    #: (the run's ``run.json`` and report record what changed); the model, adaptation, stages and
    #: arms stay locked
    resume_changed: bool = False

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if self.schedule not in {"cosine", "linear", "constant"}:
            raise ValueError(f"train.schedule={self.schedule!r}: expected 'cosine', 'linear' or 'constant'")
        if self.monitor_mode not in {"min", "max"}:
            raise ValueError(f"train.monitor_mode={self.monitor_mode!r}: expected 'min' or 'max'")
        if self.grad_accum < 1:
            raise ValueError(f"train.grad_accum={self.grad_accum}: must be >= 1")
        if self.batch_size < 1:
            raise ValueError(f"train.batch_size={self.batch_size}: must be >= 1")
        if self.max_steps is None and self.max_epochs < 1:
            raise ValueError("train: set max_epochs >= 1 or max_steps")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise ValueError(f"train.layer_decay={self.layer_decay}: expected a value in (0, 1]")
        from domainfm.precision import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}: expected one of {PRECISIONS}")
        self.loggers = list(self.loggers)
        unknown = sorted(set(self.loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"train.loggers: unknown logger(s) {unknown}; expected some of {list(LOGGERS)}")
        if "jsonl" not in self.loggers:
            raise ValueError(f"train.loggers={self.loggers}: keep 'jsonl' (resume and the run's pictures read "
                             "RUN/metrics.jsonl); add csv or tensorboard beside it")
        if self.early_stopping_patience is not None and self.monitor is None:
            raise ValueError("train.early_stopping_patience needs train.monitor (the metric to watch)")
        if "fsdp" in str(self.strategy).lower() and (self.accelerator == "cpu" or not torch.cuda.is_available()):
            # Lightning Fabric's FSDP strategy runs on CUDA devices only
            raise ValueError(f"train.strategy={self.strategy!r} needs CUDA GPUs (Lightning Fabric's FSDP is GPU-only; "
                             f"accelerator {self.accelerator!r}, CUDA available: {torch.cuda.is_available()}); "
                             "on CPU use train.strategy=ddp")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "TrainConfig":
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown train setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


# --------------------------------------------------------------------------- recipe


class Recipe:
    """What a task contributes to training: the model, datasets, a step and its metrics.

    Subclasses set ``model``, ``train_dataset`` (and optionally ``val_dataset``,
    ``collate_fn``) and implement :meth:`step`. For evaluation, :meth:`eval_step` returns a dict
    of tensors whose first dimension is the batch (e.g. ``{"scores": ..., "target": ...}``); the
    engine concatenates them over batches and processes and hands them to :meth:`metrics`.
    """

    model: nn.Module
    train_dataset: Dataset | None = None
    val_dataset: Dataset | None = None
    collate_fn: Callable | None = None
    eval_collate_fn: Callable | None = None  # default: collate_fn

    def step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        loss, _ = self.step(model, batch)
        return {"loss": loss.detach().float().reshape(1)}

    def metrics(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"loss": float(outputs["loss"].mean())}

    def param_groups(self, model: nn.Module, config: TrainConfig) -> list[dict[str, Any]] | None:
        """Optional: custom optimizer parameter groups (default: :func:`build_param_groups`)."""
        return None

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, step: int, total_steps: int) -> None:
        """Optional hook before optimizer step ``step`` (0-based) with the live optimizer, e.g. a
        weight-decay schedule set on ``optimizer.param_groups``. Called on every step, also after a
        resume, so per-step schedules need no state of their own."""

    def on_train_step_end(self, model: nn.Module, step: int, total_steps: int) -> None:
        """Optional hook after each optimizer step (e.g. an EMA teacher update)."""


# --------------------------------------------------------------------------- optimizer


_LAYER_RE = re.compile(r"(?:^|\.)(?:blocks|layers|layer|block|encoder\.layers)\.(\d+)\.")


def _layer_id(name: str, num_layers: int, is_head: bool) -> int:
    if is_head:
        return num_layers + 1
    match = _LAYER_RE.search(name)
    return int(match.group(1)) + 1 if match else 0


def build_param_groups(model: nn.Module, config: TrainConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups: no weight decay on 1-D tensors (norms, biases, tokens);
    ``head_lr`` for parameters matching ``head_patterns``; with ``layer_decay`` the lr of layer
    ``i`` (from ``blocks.i.``/``layers.i.`` in the name) is scaled by ``decay**(L + 1 - i)``,
    embeddings counting as layer 0 and the head as ``L + 1`` (BEiT/MAE convention).
    """
    import fnmatch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    layer_ids = [_LAYER_RE.search(n) for n, _ in named]
    num_layers = max((int(m.group(1)) + 1 for m in layer_ids if m), default=0)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in named:
        is_head = any(fnmatch.fnmatchcase(name, pat) for pat in config.head_patterns)
        lr = config.head_lr if (is_head and config.head_lr is not None) else config.lr
        scale = 1.0
        if config.layer_decay is not None:
            scale = config.layer_decay ** (num_layers + 1 - _layer_id(name, num_layers, is_head))
        decay = 0.0 if param.ndim <= 1 or name.endswith(".bias") else config.weight_decay
        key = (lr * scale, decay)
        group = groups.setdefault(key, {"params": [], "lr": lr * scale, "weight_decay": decay, "names": []})
        group["params"].append(param)
        group["names"].append(name)
    return list(groups.values())


def warmup_cosine(step: int, total: int, warmup: int, floor: float, schedule: str = "cosine") -> float:
    """Multiplier of the base lr at optimizer ``step``: linear warmup from 0, then cosine (or
    linear) decay to ``floor`` (a fraction of the base lr) at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- per-sample randomness


class SampleSeeds:
    """Seeds for per-sample randomness (masks, augmented views, sampled partners) that depend on
    the run's seed, the epoch and the sample's index only: a sample gets the same draw whether it
    lands on rank 0 or 1, in a batch of 8 or of 16, in a run resumed mid-epoch or not. That is what
    makes a 2-rank run equal one process at the same global batch. A dataset holds one and draws
    in ``__getitem__``; the engine calls the dataset's ``set_epoch`` at each epoch start.

    >>> seeds = SampleSeeds(seed=0)
    >>> g = seeds.generator(index=5)   # torch.Generator for sample 5 of the current epoch
    """

    def __init__(self, seed: int = 0):
        self.seed, self.epoch = int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def value(self, index: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{self.epoch}:{int(index)}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)

    def generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.value(index))

    def numpy(self, index: int) -> np.random.Generator:
        return np.random.default_rng(self.value(index))


# --------------------------------------------------------------------------- sampler


class ResumableSampler(Sampler[int]):
    """Shuffled, rank-sharded sampler that can start part-way through an epoch.

    Epoch ``e`` uses the permutation drawn from ``seed + e`` (identical on every rank); rank
    ``r`` takes indices ``r, r + world, …`` of it (padded by wrap-around so every rank gets the
    same count, as torch's DistributedSampler does). ``start`` skips the first samples of this
    rank's share, which is how a resumed run continues from the exact batch it stopped at.

    The global order depends on the seed and epoch only, never on the number of ranks: with
    batch ``B`` per rank, global step ``s`` takes positions ``[s·B·world, (s+1)·B·world)`` of it,
    the same samples one process with batch ``B·world`` takes.

    ``blocks`` (``[start, end)`` ranges covering the dataset, e.g. a streamed corpus's chunks):
    the blocks are shuffled, then the samples within each run of ``window`` consecutive blocks,
    so that reads stay within a few chunks at a time instead of jumping across the corpus.
    """

    def __init__(self, length: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 blocks: Sequence[tuple[int, int]] | None = None, window: int = 4):
        if length <= 0:
            raise ValueError("cannot sample from an empty dataset")
        if blocks is not None:
            covered = sorted((int(a), int(b)) for a, b in blocks)
            if not covered or covered[0][0] != 0 or covered[-1][1] != length or \
                    any(b0 != a1 for (_, b0), (a1, _) in zip(covered, covered[1:])):
                raise ValueError(f"blocks {covered[:3]}...: must tile [0, {length}) without gaps or overlaps")
        if window < 1:
            raise ValueError(f"window={window}: expected at least 1 block")
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.blocks = None if blocks is None else [(int(a), int(b)) for a, b in blocks]
        self.window = window
        self.epoch, self.start = 0, 0
        self.per_rank = math.ceil(length / num_replicas)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.shuffle and self.blocks is not None:
            blocks = [self.blocks[i] for i in torch.randperm(len(self.blocks), generator=g).tolist()]
            order = []
            for w in range(0, len(blocks), self.window):
                members = torch.cat([torch.arange(a, b) for a, b in blocks[w:w + self.window]])
                order += members[torch.randperm(len(members), generator=g)].tolist()
        elif self.shuffle:
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        total = self.per_rank * self.num_replicas
        order = (order * math.ceil(total / self.length))[:total]
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        return self.per_rank - self.start


# --------------------------------------------------------------------------- atomic files


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return float(value)


# --------------------------------------------------------------------------- trainer


@dataclass
class FitResult:
    global_step: int
    epochs_completed: int
    best_metric: float | None
    best_step: int | None
    best_checkpoint: Path | None
    last_val: dict[str, float]
    history: list[dict[str, Any]]
    stopped_early: bool
    wall_time_s: float
    #: validation metrics of the selected step (``{}`` without validation)
    best_val: dict[str, float] = field(default_factory=dict)
    #: the recipe's model, holding the weights of the selected step when a best checkpoint exists
    model: nn.Module | None = None


class _DropPrecisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Automatic Mixed Precision" not in record.getMessage()


@contextlib.contextmanager
def _without_precision_notice():
    """Lightning logs "Using bfloat16 Automatic Mixed Precision (AMP)" each time a Fabric is built,
    i.e. once per Trainer (a fine-tuning run builds dozens: arms, seeds, probes, evaluation). The
    precision is recorded in each run's report instead; other Lightning messages pass."""
    logger = logging.getLogger("lightning_fabric.utilities.rank_zero")
    notice = _DropPrecisionNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


class Trainer:
    """Runs a :class:`Recipe` under a :class:`TrainConfig` and writes everything to ``run_dir``.

    ``run_dir`` receives ``metrics.jsonl`` and ``checkpoints/`` (``last.ckpt`` for resume,
    ``best.safetensors`` for the selected model). ``run_dir=None`` trains without writing.
    """

    def __init__(self, config: TrainConfig | Mapping[str, Any] | None = None, run_dir: str | os.PathLike | None = None, fabric=None):
        self.config = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if fabric is None:
            from lightning_fabric import Fabric

            from domainfm.precision import resolve_precision

            self.precision = resolve_precision(self.config.precision, _accelerator_device(self.config.accelerator))
            with _without_precision_notice():
                fabric = Fabric(
                    accelerator=self.config.accelerator,
                    strategy=self.config.strategy,
                    devices=self.config.devices,
                    num_nodes=self.config.num_nodes,
                    precision=self.precision,
                    loggers=_fabric_loggers(self.config.loggers, self.run_dir),
                )
            if fabric.world_size > 1 and not getattr(fabric, "_launched", False):
                # Under torchrun this only joins the process group; otherwise Fabric spawns
                # the other processes itself.
                fabric.launch()
        self.fabric = fabric
        if not hasattr(self, "precision"):
            self.precision = str(getattr(getattr(fabric, "_precision", None), "precision", self.config.precision))
        self.global_step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best_metric: float | None = None
        self.best_step: int | None = None
        self.bad_epochs = 0
        # whether the epoch-end work (validation, selection, early stopping, the epoch's checkpoint)
        # is done for the current step: a step checkpoint taken before it says False, so a run
        # killed between the last step's checkpoint and its validation validates on resume
        self.epoch_closed = True
        self.history: list[dict[str, Any]] = []

    # -- helpers --------------------------------------------------------------

    @property
    def is_global_zero(self) -> bool:
        return self.fabric.is_global_zero

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.run_dir / "checkpoints" if self.run_dir is not None else None

    def log(self, record: dict[str, Any]) -> None:
        record = {k: (_to_float(v) if isinstance(v, (torch.Tensor, np.floating)) else v) for k, v in record.items()}
        self.history.append(record)
        if self.run_dir is not None and self.is_global_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if self.fabric.loggers and isinstance(record.get("step"), int):
                split = record.get("split", "event")
                numbers = {f"{split}/{k}": float(v) for k, v in record.items()
                           if k not in ("step", "split") and isinstance(v, (int, float)) and not isinstance(v, bool)}
                if numbers:
                    self.fabric.log_dict(numbers, step=record["step"])

    def _loader(self, dataset: Dataset, collate_fn, *, train: bool) -> tuple[DataLoader, ResumableSampler]:
        cfg = self.config
        sampler = ResumableSampler(
            len(dataset),
            num_replicas=self.fabric.world_size,
            rank=self.fabric.global_rank,
            shuffle=cfg.shuffle and train,
            seed=cfg.seed,
            blocks=getattr(dataset, "blocks", None),  # a prepared corpus's chunks
        )
        batch_size = cfg.batch_size if train else (cfg.eval_batch_size or cfg.batch_size)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            num_workers=cfg.num_workers,
            drop_last=cfg.drop_last and train,
            # The loader draws its worker base seed from this generator, not from the global RNG,
            # so that creating an iterator (e.g. on resume, or for evaluation) does not shift
            # the dropout/masking random stream: resume is then bit-exact.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        # Not passed through fabric.setup_dataloaders: it may rebuild the loader around a copy of
        # the sampler, and the engine must keep hold of the sampler it positions on resume.
        return loader, sampler

    def _steps_per_epoch(self, sampler: ResumableSampler) -> int:
        per_rank = sampler.per_rank
        micro = per_rank // self.config.batch_size if self.config.drop_last else math.ceil(per_rank / self.config.batch_size)
        if micro // self.config.grad_accum == 0:
            world = sampler.num_replicas
            raise ValueError(
                f"{sampler.length} training samples make no full optimizer step: train.batch_size="
                f"{self.config.batch_size} per process x {world} process(es) x train.grad_accum={self.config.grad_accum}"
                " (train.drop_last drops a short last batch); lower train.batch_size or train.grad_accum, or set "
                "train.drop_last=false")
        return micro // self.config.grad_accum

    # -- checkpoints ----------------------------------------------------------

    def _state(self, model, optimizer, scheduler) -> dict[str, Any]:
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler.state_dict(),
            "trainer": {
                "global_step": self.global_step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "best_metric": self.best_metric,
                "best_step": self.best_step,
                "bad_epochs": self.bad_epochs,
                "epoch_closed": self.epoch_closed,
                # metrics.jsonl records written up to this checkpoint: a resume cuts the log back
                # to them, so the history is one run with no step repeated
                "log_records": len(self.history),
            },
            "rng": _rng_state(),
            # each rank draws its own augmentations and masks: a resume restores each rank's own
            # stream, so that a 2-rank run resumed mid-epoch equals the uninterrupted one
            "rng_ranks": self._rng_states_of_all_ranks(),
        }

    def _rng_states_of_all_ranks(self) -> list[dict[str, Any]]:
        if self.fabric.world_size == 1:
            return [_rng_state()]
        import torch.distributed as dist

        states: list[Any] = [None] * self.fabric.world_size
        dist.all_gather_object(states, _rng_state())
        return states

    def save_checkpoint(self, model, optimizer, scheduler, name: str = "last.ckpt") -> Path | None:
        if self.checkpoint_dir is None:
            return None
        path = self.checkpoint_dir / name
        if self._sharded():
            tmp = path.with_name(f".{path.name}.tmp")
            self.fabric.save(tmp, self._state(model, optimizer, scheduler))
            self.fabric.barrier()
            if self.is_global_zero:
                if path.exists():
                    import shutil

                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                os.replace(tmp, path)
        else:
            state = self._state(model, optimizer, scheduler)
            state["model"] = self._raw_model.state_dict()
            state["optimizer"] = optimizer.state_dict()
            if self.is_global_zero:
                atomic_torch_save(state, path)
        self.fabric.barrier()
        return path

    def _sharded(self) -> bool:
        return "fsdp" in type(self.fabric.strategy).__name__.lower()

    def load_checkpoint(self, model, optimizer, scheduler, path: Path) -> None:
        if self._sharded():
            state = {"model": model, "optimizer": optimizer}
            rest = self.fabric.load(path, state)
        else:
            rest = torch.load(path, map_location="cpu", weights_only=True)
            self._raw_model.load_state_dict(rest.pop("model"))
            optimizer.load_state_dict(rest.pop("optimizer"))
        scheduler.load_state_dict(rest["scheduler"])
        trainer_state = dict(rest["trainer"])
        log_records = trainer_state.pop("log_records", None)
        for key, value in trainer_state.items():
            setattr(self, key, value)
        ranks = rest.get("rng_ranks") or []
        # a checkpoint from another world size (or from before rng_ranks): rank 0's stream
        _set_rng_state(ranks[self.fabric.global_rank] if len(ranks) == self.fabric.world_size else rest["rng"])
        self._restore_history(log_records)

    def _restore_history(self, log_records: int | None) -> None:
        """Read the interrupted run's ``metrics.jsonl`` back as this trainer's history, cut to what
        was logged up to the checkpoint (records after it are repeated by the resumed run).
        Checkpoints without a record count keep the records up to the checkpoint's step."""
        if self.run_dir is None:
            return
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        kept, records = [], []
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                break
            if log_records is not None and len(records) >= log_records:
                break
            if log_records is None and isinstance(record.get("step"), int) and record["step"] > self.global_step:
                break
            kept.append(line)
            records.append(record)
        self.history = records
        if self.is_global_zero and len(kept) != len(lines):
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def _save_best(self, model) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        from safetensors.torch import save_model

        path = self.checkpoint_dir / "best.safetensors"
        state_model = self._raw_model
        if self._sharded():  # gather a full state dict on every rank, write on rank 0
            state = self.fabric.strategy.get_module_state_dict(model) if hasattr(self.fabric.strategy, "get_module_state_dict") else model.state_dict()
            if self.is_global_zero:
                from safetensors.torch import save_file

                with atomic_path(path) as tmp:
                    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
            self.fabric.barrier()
            return path
        if self.is_global_zero:
            with atomic_path(path) as tmp:
                save_model(state_model, str(tmp))
        self.fabric.barrier()
        return path

    # -- evaluation -------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, recipe: Recipe, dataset: Dataset | None = None, *, model=None) -> dict[str, float]:
        """Run ``recipe.eval_step`` over ``dataset`` (default: the recipe's validation set) on
        every process, gather the outputs and return ``recipe.metrics`` of them."""
        dataset = dataset if dataset is not None else recipe.val_dataset
        if dataset is None:
            raise ValueError("evaluate: no dataset given and the recipe has no val_dataset")
        if model is None:
            model = getattr(self, "_model", None)
            if model is None:
                model = self._model = self.fabric.setup_module(recipe.model)
        loader, sampler = self._loader(dataset, recipe.eval_collate_fn or recipe.collate_fn, train=False)
        was_training = model.training
        model.eval()
        collected: dict[str, list[torch.Tensor]] = {}
        for batch in loader:
            batch = self.fabric.to_device(batch)
            with self.fabric.autocast():
                out = recipe.eval_step(model, batch)
            for key, value in out.items():
                value = torch.as_tensor(value).detach().cpu()
                value = value.float() if value.is_floating_point() else value
                collected.setdefault(key, []).append(value.reshape(1) if value.ndim == 0 else value)
        model.train(was_training)
        outputs = {k: torch.cat(vs) for k, vs in collected.items()}
        if self.fabric.world_size > 1:
            outputs = self._gather(outputs, len(dataset))
        return {k: float(v) for k, v in recipe.metrics(outputs).items()}

    def _gather(self, outputs: dict[str, torch.Tensor], n_items: int) -> dict[str, torch.Tensor]:
        gathered = {}
        for key, value in outputs.items():
            g = self.fabric.all_gather(value.to(self.fabric.device))  # (world, n, ...)
            # interleave back into dataset order (rank r holds items r, r+world, ...), drop padding
            g = g.transpose(0, 1).reshape(-1, *g.shape[2:]).cpu()
            gathered[key] = g[:n_items] if g.shape[0] >= n_items else g
        return gathered

    # -- training ---------------------------------------------------------------

    def fit(self, recipe: Recipe) -> FitResult:
        cfg = self.config
        if recipe.train_dataset is None:
            raise ValueError("fit: the recipe has no train_dataset")
        start_time = time.perf_counter()
        from lightning_fabric.utilities.seed import seed_everything

        seed_everything(cfg.seed, verbose=False)
        self._raw_model = recipe.model
        groups = recipe.param_groups(recipe.model, cfg) or build_param_groups(recipe.model, cfg)
        for g in groups:
            g.pop("names", None)
            g.setdefault("initial_lr", g["lr"])
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        model, optimizer = self.fabric.setup(recipe.model, optimizer)
        if self.fabric.world_size > 1:
            # the model is set up (its weights broadcast from rank 0): from here on each rank draws
            # its own stream, so that dropout masks are not the same on every rank's half of the
            # batch; per-sample draws that must not depend on the rank come from SampleSeeds
            torch.manual_seed((cfg.seed + 1_000_003 * self.fabric.global_rank) % (2 ** 63))
        self._model = model
        raw_optimizer = getattr(optimizer, "optimizer", optimizer)
        # One process on one device in fp32 or bf16 autocast: the step calls the module, backward
        # and the optimizer directly (the same arithmetic as through Fabric's wrappers, without
        # their per-call Python: input/output conversion, forward context, strategy dispatch).
        direct = self.fabric.world_size == 1 and type(self.fabric.strategy).__name__ == "SingleDeviceStrategy" \
            and self.precision in ("32-true", "bf16-mixed")
        device = self.fabric.device
        on_cpu = device.type == "cpu"
        if direct:
            import contextlib

            autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if self.precision == "bf16-mixed" \
                else contextlib.nullcontext
            step_model = self._raw_model
        else:
            autocast, step_model = self.fabric.autocast, model
        loader, sampler = self._loader(recipe.train_dataset, recipe.collate_fn, train=True)
        steps_per_epoch = self._steps_per_epoch(sampler)
        total_steps = cfg.max_steps if cfg.max_steps is not None else steps_per_epoch * cfg.max_epochs
        max_epochs = cfg.max_epochs if cfg.max_steps is None else math.ceil(total_steps / steps_per_epoch)
        warmup = cfg.warmup_steps or int(round(cfg.warmup_ratio * total_steps))
        floor = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
        scheduler = torch.optim.lr_scheduler.LambdaLR(  # on the optimizer itself: the direct path steps it
            raw_optimizer, lambda s: warmup_cosine(s, total_steps, warmup, floor, cfg.schedule)
        )

        last = self.checkpoint_dir / "last.ckpt" if self.checkpoint_dir is not None else None
        if self.run_dir is not None and self.is_global_zero:
            remove_stale_temps(self.run_dir)  # temporary files of a write killed mid-way
        if cfg.resume and last is not None:
            if last.exists():
                self.load_checkpoint(model, optimizer, scheduler, last)
                self.log({"event": "resumed", "step": self.global_step, "epoch": self.epoch})
            elif self.run_dir.is_dir() and any(self.run_dir.iterdir()):
                # an earlier attempt wrote here but never completed a checkpoint: starting over
                # silently would present a fresh run as a resumed one
                raise ResumeError(
                    f"train.resume=true but there is nothing to resume in {self.run_dir}: no checkpoint "
                    f"{last} (the earlier run stopped before its first checkpoint). Start a new run with "
                    "another --name (or remove the folder).")
            # else: this part of a resumed experiment never started (e.g. its second arm): from the start

        best_path = self.checkpoint_dir / "best.safetensors" if self.checkpoint_dir is not None and self.best_step is not None else None
        stopped_early = False
        last_val: dict[str, float] = {}
        bar = None
        if cfg.progress and self.is_global_zero:
            from tqdm.auto import tqdm

            bar = tqdm(total=total_steps, initial=self.global_step, desc="train", dynamic_ncols=True, leave=False)
        running_loss = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync per step
        nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        running_n = 0
        first_unchecked = self.global_step
        model.train()
        try:
            while (self.epoch < max_epochs and self.global_step < total_steps) or not self.epoch_closed:
                micro_per_step = cfg.grad_accum
                sampler.set_epoch(self.epoch, start=self.batch_in_epoch * micro_per_step * cfg.batch_size)
                if callable(getattr(recipe.train_dataset, "set_epoch", None)):
                    # per-sample randomness drawn from (seed, epoch, index) in the dataset: the same
                    # masks and views for a sample whatever rank or batch it lands in (see SampleSeeds)
                    recipe.train_dataset.set_epoch(self.epoch)
                micro = 0
                # only whole optimizer steps per epoch: leftover micro-batches would leak their
                # gradients into the next epoch's first step
                # (none when the steps are done and only the epoch-end work is left, after a resume)
                micro_limit = 0 if self.global_step >= total_steps else (steps_per_epoch - self.batch_in_epoch) * micro_per_step
                for batch in loader:
                    if micro >= micro_limit:
                        break
                    if not on_cpu:
                        batch = self.fabric.to_device(batch)
                    accumulating = (micro + 1) % micro_per_step != 0
                    if direct:
                        with autocast():
                            loss, logs = recipe.step(step_model, batch)
                        if on_cpu and not torch.isfinite(loss.detach()):
                            raise FloatingPointError(f"loss is {float(loss)} at step {self.global_step}")
                        (loss / micro_per_step).backward()
                    else:
                        with self.fabric.no_backward_sync(model, enabled=accumulating):
                            with autocast():
                                loss, logs = recipe.step(model, batch)
                            if on_cpu and not torch.isfinite(loss.detach()):
                                raise FloatingPointError(f"loss is {float(loss)} at step {self.global_step}")
                            self.fabric.backward(loss / micro_per_step)
                    if not on_cpu:  # checked at the next log step, without a host sync per step
                        nonfinite |= ~torch.isfinite(loss.detach())
                    running_loss += loss.detach().double()
                    running_n += 1
                    micro += 1
                    if accumulating:
                        continue
                    if cfg.clip_grad_norm is not None:
                        self.fabric.clip_gradients(model, optimizer, max_norm=cfg.clip_grad_norm, error_if_nonfinite=False)
                    recipe.before_optimizer_step(optimizer, self.global_step, total_steps)
                    if direct:
                        raw_optimizer.step()
                        raw_optimizer.zero_grad(set_to_none=True)
                    else:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    self.global_step += 1
                    self.batch_in_epoch += 1
                    self.epoch_closed = False
                    recipe.on_train_step_end(self._raw_model, self.global_step, total_steps)
                    if bar is not None:
                        bar.update(1)
                    if self.global_step % cfg.log_every_steps == 0 or self.global_step == total_steps:
                        if not on_cpu and bool(nonfinite):
                            raise FloatingPointError(f"the loss was not finite between step {first_unchecked} "
                                                     f"and step {self.global_step}")
                        first_unchecked = self.global_step
                        mean_loss = running_loss / max(1, running_n)
                        if self.fabric.world_size > 1:
                            # the global batch's loss (ranks hold equal shares), not rank 0's half
                            mean_loss = self.fabric.all_reduce(mean_loss, reduce_op="mean")
                        record = {"split": "train", "step": self.global_step, "epoch": self.epoch,
                                  "loss": float(mean_loss), "lr": optimizer.param_groups[0]["lr"]}
                        record.update({k: _to_float(v) for k, v in logs.items() if k != "loss"})
                        self.log(record)
                        if bar is not None:
                            bar.set_postfix(loss=f"{record['loss']:.4f}")
                        running_loss.zero_()
                        running_n = 0
                    if cfg.checkpoint_every_steps and self.global_step % cfg.checkpoint_every_steps == 0:
                        self.save_checkpoint(model, optimizer, scheduler)
                    if self.global_step >= total_steps:
                        break
                epoch_finished = self.global_step < total_steps or self.batch_in_epoch >= steps_per_epoch
                if epoch_finished:
                    self.epoch += 1
                    self.batch_in_epoch = 0
                if recipe.val_dataset is not None and (self.epoch % cfg.eval_every_epochs == 0 or self.global_step >= total_steps):
                    last_val = self.evaluate(recipe, model=model)
                    self.log({"split": "val", "step": self.global_step, "epoch": self.epoch, **last_val})
                    stop, best_path = self._select(model, last_val, best_path)
                    if stop:
                        stopped_early = True
                        self.epoch_closed = True
                        self.save_checkpoint(model, optimizer, scheduler)
                        break
                elif recipe.val_dataset is None and self.checkpoint_dir is not None:
                    best_path = self._save_best(model)
                    self.best_step = self.global_step
                self.epoch_closed = True
                self.save_checkpoint(model, optimizer, scheduler)
        finally:
            if bar is not None:
                bar.close()
            for logger in self.fabric.loggers:
                logger.finalize("success")
        if best_path is not None and Path(best_path).is_file() and not self._sharded():
            # the caller gets the selected model, never the last epoch's by accident
            from safetensors.torch import load_model

            load_model(self._raw_model, str(best_path), strict=True)
        best_val = next((
            {k: v for k, v in r.items() if k not in {"split", "step", "epoch"}}
            for r in reversed(self.history) if r.get("split") == "val" and r.get("step") == self.best_step), {})
        return FitResult(
            global_step=self.global_step,
            epochs_completed=self.epoch,
            best_metric=self.best_metric,
            best_step=self.best_step,
            best_checkpoint=best_path,
            last_val=last_val,
            history=self.history,
            stopped_early=stopped_early,
            wall_time_s=time.perf_counter() - start_time,
            best_val=best_val,
            model=self._raw_model,
        )

    def _select(self, model, metrics: dict[str, float], best_path: Path | None) -> tuple[bool, Path | None]:
        cfg = self.config
        if cfg.monitor is None:
            if self.checkpoint_dir is not None:
                best_path = self._save_best(model)
                self.best_step = self.global_step
            return False, best_path
        key = cfg.monitor.split("/", 1)[-1]
        if key not in metrics:
            raise KeyError(f"train.monitor={cfg.monitor!r} but evaluation returned {sorted(metrics)}")
        value = metrics[key]
        better = self.best_metric is None or (value > self.best_metric if cfg.monitor_mode == "max" else value < self.best_metric)
        if better:
            self.best_metric, self.best_step, self.bad_epochs = value, self.global_step, 0
            best_path = self._save_best(model)
        else:
            self.bad_epochs += 1
        stop = cfg.early_stopping_patience is not None and self.bad_epochs >= cfg.early_stopping_patience
        return stop, best_path

