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

from domainfm import streaming
from domainfm.distributed import process_group_size
from domainfm.data_loaders import wearables as W
from domainfm.engine import Recipe, SampleSeeds, TrainConfig, Trainer
from domainfm.experiment import ModelSection, init_label, resolve

__all__ = ["Config", "ModelSection", "DataSection", "AugmentSection", "WeekDataset", "CorpusWeeks", "ContrastiveRecipe",
           "augment", "info_nce", "load_weeks", "run", "evaluate", "PREPARE", "PrepareSettings", "prepare_participant"]


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
    #: data.kind=streaming: a corpus written by `domainfm prepare wearables` (a folder or s3://...)
    path: str | None = None
    #: data.kind=streaming: the z-score statistics are fitted on up to this many training participants
    stats_participants: int = 2000

    def __post_init__(self):
        if self.kind not in {"synthetic", "healthkit", "fitbit", "long", "npz", "streaming"}:
            raise ValueError(f"data.kind={self.kind!r}: expected synthetic, healthkit, fitbit, long, npz or streaming")
        if self.kind == "streaming" and not self.path:
            raise ValueError("data.kind=streaming: set data.path to a corpus written by `domainfm prepare wearables`")
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
    """Participant-weeks: item ``i`` is ``(view 1, observed 1, participant, view 2, observed 2)``,
    each ``(168, V)``: two views of week ``i`` or, with ``positives="participant"``, of week ``i``
    and another week of the same participant (drawn among the others), each augmented with
    ``augment`` (``None``: the weeks as they are).

    All randomness of an item (the partner and both views) comes from :class:`SampleSeeds`
    keyed by ``(seed, epoch, i)``: a week gets the same views on any rank, in any batch, in a run
    resumed mid-epoch or not (so 2 ranks at batch B equal one process at batch 2B). The engine
    calls :meth:`set_epoch`; a dataset never given an epoch (validation) has fixed views."""

    def __init__(self, values: np.ndarray, observed: np.ndarray, participant: np.ndarray, *, positives: str = "views",
                 seed: int = 0, augment: AugmentSection | None = None):
        self.values = torch.as_tensor(np.asarray(values, dtype=np.float32))
        self.observed = torch.as_tensor(np.asarray(observed, dtype=bool))
        self.participant = torch.as_tensor(np.asarray(participant, dtype=np.int64))
        if not (len(self.values) == len(self.observed) == len(self.participant)):
            raise ValueError("WeekDataset: values, observed and participant must have the same length")
        self.positives, self.settings = positives, augment
        self.seeds = SampleSeeds(seed)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(self.participant.tolist()):
            groups.setdefault(p, []).append(i)
        self.groups = groups

    def set_epoch(self, epoch: int) -> None:
        self.seeds.set_epoch(epoch)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        g = self.seeds.generator(i)
        j = i
        if self.positives == "participant":
            others = [k for k in self.groups[int(self.participant[i])] if k != i]
            if others:
                j = others[int(torch.randint(len(others), (), generator=g))]
        return _views(self.values[i], self.observed[i], self.values[j], self.observed[j], self.participant[i],
                      self.settings, g)


def _views(x1, m1, x2, m2, participant, settings: AugmentSection | None, generator: torch.Generator):
    if settings is not None:
        (x1,), (m1,) = augment(x1[None], m1[None], settings, generator=generator)
        (x2,), (m2,) = augment(x2[None], m2[None], settings, generator=generator)
    return x1, m1, participant, x2, m2


class CorpusWeeks(Dataset):
    """The participants of a prepared corpus (``domainfm prepare wearables``: one sample per
    participant, its weeks unscaled) as training items: an item is one participant, one of their
    weeks drawn per epoch and its partner (another of their weeks with
    ``positives="participant"``), z-scored with ``stats`` and augmented; all draws from
    :class:`SampleSeeds` keyed by the corpus index. An epoch visits every participant once (the
    in-memory path visits every week)."""

    def __init__(self, corpus, indices: np.ndarray, stats: "W.ZScoreStats", *, positives: str, seed: int,
                 augment: AugmentSection | None):
        self.corpus, self.indices = corpus, np.asarray(indices, dtype=np.int64)
        self.mean = torch.as_tensor(np.asarray(stats.mean, dtype=np.float32))
        self.std = torch.as_tensor(np.asarray(stats.std, dtype=np.float32))
        self.positives, self.settings, self.seeds = positives, augment, SampleSeeds(seed)
        # the corpus's chunks, as ranges of this subset's positions (indices are sorted)
        self.blocks = [(int(a), int(b)) for a, b in (
            (np.searchsorted(self.indices, lo), np.searchsorted(self.indices, hi)) for lo, hi in corpus.blocks) if b > a]

    def set_epoch(self, epoch: int) -> None:
        self.seeds.set_epoch(epoch)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, k):
        index = int(self.indices[k])
        item = self.corpus[index]
        values = torch.as_tensor(np.asarray(item["values"], dtype=np.float32))
        observed = torch.as_tensor(np.asarray(item["observed"]).astype(bool))
        values = torch.where(observed, (values - self.mean) / self.std, torch.zeros_like(values))
        g = self.seeds.generator(index)
        n = len(values)
        w = int(torch.randint(n, (), generator=g))
        j = w
        if self.positives == "participant" and n > 1:
            j = int(torch.randint(n - 1, (), generator=g))
            j += int(j >= w)
        return _views(values[w], observed[w], values[j], observed[j], torch.tensor(int(item["participant"])),
                      self.settings, g)


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


def _gather_global_batch(x: torch.Tensor) -> torch.Tensor:
    """The rows of every rank, in rank order, differentiably (one process: ``x`` itself).

    Every rank then computes InfoNCE over the global batch, with the same negatives one process
    at that batch has. The gather's backward sums the identical gradients of the W ranks into
    each rank's own rows (a factor W) and DDP averages over ranks (a factor 1/W): the parameter
    gradient is exactly the one-process gradient."""
    import torch.distributed as dist

    world = process_group_size()
    if world == 1:
        return x
    if not x.requires_grad:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)
    import warnings

    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated name of the same differentiable gather
        warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*")
        return torch.cat(all_gather(x.contiguous()))


class ContrastiveRecipe(Recipe):
    """InfoNCE between the projections of two augmented views (module docstring)."""

    def __init__(self, model, train_dataset, val_dataset=None, *, settings: AugmentSection, temperature: float):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.settings, self.temperature = settings, temperature

    def _loss(self, model, batch):
        if hasattr(model, "mark_forward_method") and "forward_projection" not in model._forward_methods:
            model.mark_forward_method("forward_projection")  # through DDP's forward when Fabric wraps the model
        v1, o1, pid, v2, o2 = batch  # views made by the dataset (WeekDataset / CorpusWeeks)
        z = model.forward_projection(torch.cat([v1, v2]), torch.cat([o1, o2]))
        z1, z2 = _gather_global_batch(z[: len(v1)]), _gather_global_batch(z[len(v1):])
        return info_nce(z1, z2, self.temperature, _gather_global_batch(pid))

    def step(self, model, batch):
        loss, acc = self._loss(model, batch)
        return loss, {"loss": loss.detach(), "acc": acc.detach()}

    def eval_step(self, model, batch):
        # the validation dataset's views are fixed per week (it is never given an epoch)
        loss, acc = self._loss(model, batch)
        n = len(batch[0])
        return {"loss": loss.detach().float().reshape(1).expand(n).clone(),
                "acc": acc.detach().float().reshape(1).expand(n).clone()}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean()), "acc": float(outputs["acc"].mean())}


# --------------------------------------------------------------------------- entry points


def build_datasets(cfg: Config):
    if cfg.data.kind == "streaming":
        return _corpus_datasets(cfg)
    values, observed, participant, variables, stats, info = load_weeks(cfg.data)
    train_idx, val_idx = _split(participant, cfg.data.val_fraction, cfg.train.seed)
    make = lambda idx: WeekDataset(values[idx], observed[idx], participant[idx],  # noqa: E731
                                   positives=cfg.positives, seed=cfg.train.seed, augment=cfg.augment)
    train = make(train_idx)
    val = make(val_idx) if len(val_idx) else None
    info.update({"weeks": int(len(values)), "participants": int(len(np.unique(participant))),
                 "train_weeks": int(len(train_idx)), "val_weeks": int(len(val_idx)),
                 "observed_fraction": round(float(observed.mean()), 4)})
    return train, val, variables, stats, info


# --------------------------------------------------------------------------- streamed corpora


@dataclass
class PrepareSettings:
    """``domainfm prepare wearables`` settings: which hourly variables, in model order (default:
    every variable the readers know), the fewest observed hours that keep a week, and the time
    zone of Fitbit exports."""

    variables: list[str] | None = None
    min_hours: int = 24
    tz: str | None = None


def prepare_participant(settings: PrepareSettings, path: str) -> list[dict]:
    """One participant's file or folder (Apple Health export.zip/export.xml, a Fitbit export, a long
    CSV/Parquet) -> one sample: their weeks unscaled (``values``/``observed`` ``(n, 168, V)``), a
    participant id from the file's path, and the week starts; no sample without a kept week."""
    import hashlib

    variables = list(settings.variables or W.VARIABLES)
    table = W.read_participant(path, variables, tz=settings.tz)
    weeks = W.to_weeks(table, variables=variables, stats=W.ZScoreStats.identity(variables),
                       min_hours=settings.min_hours)
    if not len(weeks):
        return []
    pid = int.from_bytes(hashlib.sha256(str(Path(path).resolve()).encode()).digest()[:7], "little")
    return [{"values": weeks.values.astype(np.float32), "observed": weeks.observed.astype(np.uint8),
             "participant": pid, "weeks": len(weeks)}]


PREPARE = streaming.Preparation(
    convert=prepare_participant, settings=PrepareSettings, suffixes=(".zip", ".xml", ".csv", ".parquet"),
    what="one participant per file (Apple Health export.zip/export.xml, long CSV/Parquet) -> their weeks, unscaled")


def _corpus_datasets(cfg: Config):
    corpus = streaming.PreparedCorpus(cfg.data.path, family="wearables")
    settings = corpus.settings
    variables = list(settings.get("variables") or W.VARIABLES)
    if cfg.data.variables is not None and list(cfg.data.variables) != variables:
        raise streaming.PrepareError(f"data.path {cfg.data.path}: prepared with variables {variables}, the config "
                                     f"asks data.variables={list(cfg.data.variables)}")
    if int(settings.get("min_hours", cfg.data.min_hours)) != cfg.data.min_hours:
        raise streaming.PrepareError(f"data.path {cfg.data.path}: prepared with min_hours={settings.get('min_hours')}, "
                                     f"the config asks data.min_hours={cfg.data.min_hours}")
    # a participant split by corpus index (one sample per participant): the same on every rank,
    # without reading the corpus
    seeds = SampleSeeds(cfg.train.seed)
    in_val = np.array([seeds.value(i) % 1_000_000 < cfg.data.val_fraction * 1_000_000 for i in range(len(corpus))])
    if cfg.data.val_fraction > 0 and not in_val.any() and len(corpus) > 1:
        in_val[len(corpus) - 1] = True
    train_idx, val_idx = np.flatnonzero(~in_val), np.flatnonzero(in_val)
    # z-score statistics from up to stats_participants training participants, evenly spread
    take = train_idx[np.linspace(0, len(train_idx) - 1, min(len(train_idx), cfg.data.stats_participants)).astype(int)]
    items = [corpus[int(i)] for i in np.unique(take)]
    stats = W.ZScoreStats.fit_weeks(np.concatenate([np.asarray(it["values"]) for it in items]),
                                    np.concatenate([np.asarray(it["observed"]).astype(bool) for it in items]), variables)
    make = lambda idx: CorpusWeeks(corpus, idx, stats, positives=cfg.positives, seed=cfg.train.seed,  # noqa: E731
                                   augment=cfg.augment)
    weeks = sum(int(it["weeks"]) for it in items)
    info = {"data_source": corpus.describe(), "participants": len(corpus), "train_participants": len(train_idx),
            "val_participants": len(val_idx), "stats_from_participants": len(items),
            "stats_from_weeks": weeks}
    return make(train_idx), (make(val_idx) if len(val_idx) else None), variables, stats, info


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
    dataset = WeekDataset(values[idx], observed[idx], participant[idx], positives=cfg.positives, seed=cfg.train.seed,
                          augment=cfg.augment)
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    return trainer.evaluate(ContrastiveRecipe(model, None, dataset, settings=cfg.augment,
                                              temperature=cfg.temperature), dataset)
