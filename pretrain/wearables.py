"""WBM pretraining: contrastive self-supervision (InfoNCE) on participant-weeks, on the engine.

Each example is one participant-week (168 hours x V variables, z-scored, with its observed mask).
Two views are made of it — or, with ``positives: participant``, of it and another week of the same
participant — and each view is augmented independently:

* a small time shift of up to ``augment.max_shift`` hours (hours shifted in are unobserved);
* random masking of hours (probability ``augment.mask_hours``) and of whole variables
  (``augment.mask_variables``);
* per-variable scaling by ``1 + N(0, augment.scale_std)`` and Gaussian noise ``augment.noise_std``.

The projections ``z = g(f(view))`` of both views are L2-normalised and the loss is the symmetric
InfoNCE (NT-Xent) with temperature ``temperature``: each view must pick its partner among the
batch's other views. Pairs from the same participant that are not partners are removed from the
negatives (they are not negatives when weeks of one person are positives).

Paper-like defaults (``configs/wearables/pretrain.yaml``): the paper (arXiv 2507.00191) states a
Mamba-2 backbone on TST tokens of hourly weeks trained contrastively; it does not publish the
augmentation probabilities, temperature or optimiser settings we know of, so these are
**inferred**: temperature 0.1, hour masking 0.2, variable masking 0.1, shifts up to 3 h, scaling SD
0.1, AdamW lr 1e-3 with weight decay 0.05 and cosine decay, batch 256.

Data (``data.kind``): ``synthetic`` (the simulator of
:mod:`domainfm.data_loaders.wearables_synthetic`: said plainly, not real data), ``healthkit``
(``export.xml`` files), ``fitbit`` (export folders), ``long`` (CSV/Parquet ``timestamp, variable,
value``) — one path per participant in ``data.paths`` — or ``npz`` (arrays ``values``, ``observed``,
``participant`` already cut into weeks and z-scored).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from domainfm.data_loaders import wearables as W
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "DataSection", "AugmentSection", "WeekDataset", "ContrastiveRecipe", "augment",
           "info_nce", "load_weeks", "run", "evaluate"]


@dataclass
class DataSection:
    kind: str = "synthetic"
    #: one file / folder per participant (healthkit, fitbit, long) or one .npz (npz)
    paths: list[str] = field(default_factory=list)
    #: hourly variables in model order (default: all the reader's / the simulator's)
    variables: list[str] | None = None
    #: drop weeks with fewer hours than this that have any observation
    min_hours: int = 24
    val_fraction: float = 0.1
    synthetic_participants: int = 200
    synthetic_weeks: int = 4
    synthetic_seed: int = 0

    def __post_init__(self):
        if self.kind not in {"synthetic", "healthkit", "fitbit", "long", "npz"}:
            raise ValueError(f"data.kind={self.kind!r}: expected synthetic, healthkit, fitbit, long or npz")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction}: expected a fraction in [0, 1)")


@dataclass
class AugmentSection:
    max_shift: int = 3
    mask_hours: float = 0.2
    mask_variables: float = 0.1
    scale_std: float = 0.1
    noise_std: float = 0.0

    def __post_init__(self):
        for name in ("mask_hours", "mask_variables"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"augment.{name}={getattr(self, name)}: expected a probability in [0, 1)")
        if self.max_shift < 0 or self.scale_std < 0 or self.noise_std < 0:
            raise ValueError("augment: max_shift, scale_std and noise_std must be >= 0")


@dataclass
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(name="wbm-base"))
    data: DataSection = field(default_factory=DataSection)
    augment: AugmentSection = field(default_factory=AugmentSection)
    temperature: float = 0.1
    #: views: two augmentations of the same week; participant: the second view is another week of the same person
    positives: str = "views"
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=100, batch_size=256, lr=1e-3, weight_decay=0.05, warmup_ratio=0.05, schedule="cosine",
        clip_grad_norm=1.0, monitor=None))

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be positive")
        if self.positives not in {"views", "participant"}:
            raise ValueError(f"positives={self.positives!r}: expected 'views' or 'participant'")


# --------------------------------------------------------------------------- data


class WeekDataset(Dataset):
    """Participant-weeks: item ``i`` is ``(values (168, V), observed (168, V), participant, partner)``;
    ``partner`` is a second week (values, observed) of the same participant when ``positives`` is
    ``participant`` and the participant has one, else the same week.

    ``seed=None`` (training): each partner is drawn from torch's global RNG, which the engine's
    checkpoints save and restore on every rank, so a resumed run draws what the uninterrupted run
    would have (a generator of the dataset's own would be state no checkpoint holds). ``seed``
    given (evaluation): one fixed partner per week, a function of ``(seed, i)`` only."""

    def __init__(self, values: np.ndarray, observed: np.ndarray, participant: np.ndarray, *, positives: str = "views",
                 seed: int | None = None):
        self.values = torch.as_tensor(np.asarray(values, dtype=np.float32))
        self.observed = torch.as_tensor(np.asarray(observed, dtype=bool))
        self.participant = torch.as_tensor(np.asarray(participant, dtype=np.int64))
        if not (len(self.values) == len(self.observed) == len(self.participant)):
            raise ValueError("WeekDataset: values, observed and participant must have the same length")
        self.positives = positives
        self.seed = seed
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(self.participant.tolist()):
            groups.setdefault(p, []).append(i)
        self.groups = groups

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        j = i
        if self.positives == "participant":
            others = [k for k in self.groups[int(self.participant[i])] if k != i]
            if others:
                if self.seed is None:
                    pick = int(torch.randint(len(others), ()).item())
                else:
                    pick = int(np.random.default_rng((self.seed, i)).integers(len(others)))
                j = others[pick]
        return self.values[i], self.observed[i], self.participant[i], self.values[j], self.observed[j]


def _read_table(kind: str, path: str, variables):
    if kind == "healthkit":
        return W.read_healthkit(path, variables=variables)
    if kind == "fitbit":
        return W.read_fitbit(path)
    return W.read_long(path)


def load_weeks(data: DataSection, *, stats: W.ZScoreStats | None = None):
    """``(values, observed, participant, variables, stats, info)`` for the data section; z-score
    statistics are fitted on all participants' hours unless given."""
    if data.kind == "npz":
        if len(data.paths) != 1:
            raise ValueError("data.kind=npz: give one file in data.paths (arrays values, observed, participant)")
        with np.load(data.paths[0], allow_pickle=False) as z:
            missing = [k for k in ("values", "observed", "participant") if k not in z]
            if missing:
                raise W.HealthDataError(f"{data.paths[0]}: missing array(s) {missing}; expected values (N, 168, V), "
                                        "observed (N, 168, V), participant (N,)")
            values, observed, participant = z["values"], z["observed"].astype(bool), z["participant"]
            variables = [str(v) for v in z["variables"]] if "variables" in z else data.variables
        if values.ndim != 3 or values.shape != observed.shape or len(participant) != len(values):
            raise W.HealthDataError(f"{data.paths[0]}: values {values.shape}, observed {observed.shape}, participant "
                                    f"{participant.shape}: expected (N, 168, V), (N, 168, V), (N,)")
        variables = variables or [f"var{i}" for i in range(values.shape[-1])]
        return values, observed, participant, list(variables), None, {"data_source": f"npz: {data.paths[0]}"}
    if data.kind == "synthetic":
        from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort

        cohort = synthetic_cohort(data.synthetic_participants, data.synthetic_weeks, seed=data.synthetic_seed)
        tables = cohort.tables
        variables = list(data.variables or SYNTHETIC_VARIABLES)
        source = (f"SYNTHETIC cohort (simulated, not real data): {data.synthetic_participants} participants x "
                  f"{data.synthetic_weeks} weeks, seed {data.synthetic_seed}")
    else:
        if not data.paths:
            raise ValueError(f"data.kind={data.kind}: list one file or folder per participant in data.paths")
        tables = [_read_table(data.kind, p, data.variables) for p in data.paths]
        variables = list(data.variables or [c for c in W.VARIABLES if any(c in t.columns for t in tables)] +
                         sorted({c for t in tables for c in t.columns} - set(W.VARIABLES)))
        source = f"{data.kind}: {len(data.paths)} participant file(s)"
    if stats is None:
        import pandas as pd

        stats = W.ZScoreStats.fit(pd.concat([t.reindex(columns=variables) for t in tables]), variables)
    values, observed, participant = [], [], []
    for pid, table in enumerate(tables):
        weeks = W.to_weeks(table, variables=variables, stats=stats, min_hours=data.min_hours)
        values.append(weeks.values)
        observed.append(weeks.observed)
        participant.append(np.full(len(weeks), pid))
    values, observed, participant = np.concatenate(values), np.concatenate(observed), np.concatenate(participant)
    if not len(values):
        raise ValueError(f"no week has data.min_hours={data.min_hours} observed hours ({source})")
    return values, observed, participant, variables, stats, {"data_source": source}


def _split(participant: np.ndarray, val_fraction: float, seed: int):
    """Train / validation by participant (no person in both)."""
    people = np.unique(participant)
    if val_fraction <= 0 or len(people) < 2:
        return np.arange(len(participant)), np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    n_val = max(1, int(round(len(people) * val_fraction)))
    val_people = rng.permutation(people)[:n_val]
    in_val = np.isin(participant, val_people)
    return np.flatnonzero(~in_val), np.flatnonzero(in_val)


# --------------------------------------------------------------------------- objective


def augment(values: torch.Tensor, observed: torch.Tensor, settings: AugmentSection, *,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One random view of a batch ``(B, T, V)``: time shift, hour and variable masking, scaling, noise.

    Unobserved entries of the result are 0 (the z-score mean) and ``False`` in the mask.
    """
    b, t, v = values.shape
    dev = values.device

    def rand(*shape):
        return torch.rand(*shape, generator=generator).to(dev)

    if settings.max_shift:
        shift = torch.randint(-settings.max_shift, settings.max_shift + 1, (b, 1), generator=generator).to(dev)
        source = torch.arange(t, device=dev).unsqueeze(0) - shift  # hour h shows hour h - shift
        inside = (source >= 0) & (source < t)
        index = source.clamp(0, t - 1).unsqueeze(-1).expand(b, t, v)
        values = torch.gather(values, 1, index)
        observed = torch.gather(observed, 1, index) & inside.unsqueeze(-1)
    keep = (rand(b, t, 1) >= settings.mask_hours) & (rand(b, 1, v) >= settings.mask_variables)
    observed = observed & keep
    if settings.scale_std:
        values = values * (1 + settings.scale_std * torch.randn(b, 1, v, generator=generator).to(dev))
    if settings.noise_std:
        values = values + settings.noise_std * torch.randn(b, t, v, generator=generator).to(dev)
    return torch.where(observed, values, torch.zeros_like(values)), observed


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float, group: torch.Tensor | None = None):
    """Symmetric InfoNCE between partner rows of ``z1`` and ``z2`` ``(B, D)``.

    ``logits = cos(z1_i, z2_j) / temperature``; row ``i``'s target is column ``i``. With ``group``
    (participant ids ``(B,)``), pairs ``i != j`` of the same group are excluded from the negatives.
    Returns ``(loss, top-1 accuracy of picking the partner)``.
    """
    z1, z2 = F.normalize(z1.float(), dim=-1), F.normalize(z2.float(), dim=-1)
    logits = z1 @ z2.T / temperature
    target = torch.arange(len(z1), device=z1.device)
    if group is not None:
        same = (group[:, None] == group[None, :]) & ~torch.eye(len(z1), dtype=torch.bool, device=z1.device)
        logits = logits.masked_fill(same, -math.inf)
    loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    accuracy = (logits.argmax(1) == target).float().mean()
    return loss, accuracy


class ContrastiveRecipe(Recipe):
    """InfoNCE between the projections of two augmented views (module docstring)."""

    def __init__(self, model, train_dataset, val_dataset=None, *, settings: AugmentSection, temperature: float):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.settings, self.temperature = settings, temperature

    def _loss(self, model, batch, generator=None):
        if hasattr(model, "mark_forward_method") and "forward_projection" not in model._forward_methods:
            model.mark_forward_method("forward_projection")  # through DDP's forward when Fabric wraps the model
        x1, m1, pid, x2, m2 = batch
        v1, o1 = augment(x1, m1, self.settings, generator=generator)
        v2, o2 = augment(x2, m2, self.settings, generator=generator)
        z = model.forward_projection(torch.cat([v1, v2]), torch.cat([o1, o2]))
        return info_nce(z[: len(x1)], z[len(x1):], self.temperature, pid)

    def step(self, model, batch):
        loss, acc = self._loss(model, batch)
        return loss, {"loss": loss.detach(), "acc": acc.detach()}

    def eval_step(self, model, batch):
        # fixed views per batch content, so validation losses are comparable across epochs
        seed = int(batch[2].sum().item() * 7919 + len(batch[2])) % (2**31)
        loss, acc = self._loss(model, batch, generator=torch.Generator().manual_seed(seed))
        n = len(batch[0])
        return {"loss": loss.detach().float().reshape(1).expand(n).clone(),
                "acc": acc.detach().float().reshape(1).expand(n).clone()}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean()), "acc": float(outputs["acc"].mean())}


# --------------------------------------------------------------------------- entry points


def build_datasets(cfg: Config):
    values, observed, participant, variables, stats, info = load_weeks(cfg.data)
    train_idx, val_idx = _split(participant, cfg.data.val_fraction, cfg.train.seed)
    make = lambda idx, seed: WeekDataset(values[idx], observed[idx], participant[idx],  # noqa: E731
                                         positives=cfg.positives, seed=seed)
    train = make(train_idx, None)
    val = make(val_idx, cfg.train.seed) if len(val_idx) else None
    info.update({"weeks": int(len(values)), "participants": int(len(np.unique(participant))),
                 "train_weeks": int(len(train_idx)), "val_weeks": int(len(val_idx)),
                 "observed_fraction": round(float(observed.mean()), 4)})
    return train, val, variables, stats, info


def run(cfg: Config, run_dir: Path) -> dict:
    from domainfm import lora, save_pretrained

    run_dir = Path(run_dir)
    train_ds, val_ds, variables, stats, info = build_datasets(cfg)
    if len(train_ds) < 2:
        raise ValueError(f"contrastive pretraining needs at least 2 training weeks, got {len(train_ds)}")
    kwargs = {**cfg.model.kwargs, "n_chans": len(variables), "n_times": 168, "variables": variables,
              "n_outputs": None}
    model, init_info = resolve(cfg.model.spec(cfg.model.pretrained or False, **kwargs))
    if stats is not None:
        model.set_zscore(stats.mean, stats.std)
    train_cfg = cfg.train
    if train_cfg.batch_size > len(train_ds):
        train_cfg = dataclasses.replace(train_cfg, batch_size=len(train_ds))
    if val_ds is not None and train_cfg.monitor is None:
        train_cfg = dataclasses.replace(train_cfg, monitor="val/loss", monitor_mode="min")
    recipe = ContrastiveRecipe(model, train_ds, val_ds, settings=cfg.augment, temperature=cfg.temperature)
    result = Trainer(train_cfg, run_dir=run_dir).fit(recipe)
    model = result.model if result.model is not None else model
    saved = save_pretrained(model, run_dir / "model")
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    summary = lora.trainable_summary(model)
    report = {
        "model": cfg.model.name,
        "init": init_label(cfg.model.pretrained, init_info),
        "objective": f"InfoNCE between two augmented views (positives: {cfg.positives}, temperature "
                     f"{cfg.temperature})",
        "params_total": summary["total"],
        "params_trainable": summary["trainable"],
        "variables": ",".join(variables),
        **info,
        "steps": result.global_step,
        "train_loss_first": losses[0] if losses else math.nan,
        "train_loss_last": losses[-1] if losses else math.nan,
        "saved_model": str(saved),
    }
    if result.best_val:
        report["val_loss"] = result.best_val.get("loss")
        report["val_acc"] = result.best_val.get("acc")
    return report


def evaluate(cfg: Config, run_dir: Path) -> dict:
    """Contrastive loss and partner accuracy of the saved model on the configured data."""
    from domainfm import create_model

    model = create_model(Path(run_dir) / "model").eval()
    values, observed, participant, variables, _, _ = load_weeks(cfg.data, stats=W.ZScoreStats.from_model(model)
                                                                if model.variables else None)
    _, val_idx = _split(participant, cfg.data.val_fraction, cfg.train.seed)
    idx = val_idx if len(val_idx) else np.arange(len(values))
    dataset = WeekDataset(values[idx], observed[idx], participant[idx], positives=cfg.positives, seed=cfg.train.seed)
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    return trainer.evaluate(ContrastiveRecipe(model, None, dataset, settings=cfg.augment,
                                              temperature=cfg.temperature), dataset)
