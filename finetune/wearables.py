"""WBM fine-tuning and linear-probe evaluation, declared on the experiment layer.

The paper's evaluation (arXiv 2507.00191; OpenMHC's protocol) is a **linear probe** on frozen
embeddings: each participant-week is embedded, the weekly embeddings are averaged per
participant, and a per-task logistic regression (ridge for continuous targets) is fitted on the
training participants, optionally after PCA (OpenMHC: 50 components). The ``probe`` protocol does
this for every arm (pretrained, random init) on the model *before* adaptation, reports AUROC, AUPRC
and balanced accuracy on the test participants (the regularisation ``C`` chosen by validation
AUROC), runs per-week probes for weekly (time-varying) labels, and runs the same probe on
hand-made features (per-variable means and SDs, and the 24-hour cosinor amplitude of each
variable) as a baseline. The Transformer backbone is the other baseline:
``configs/wearables/finetune_transformer.yaml`` runs the same protocol on ``wbm-transformer-*``.

Fine-tuning in ``full``, ``lora`` or ``linear_probe`` mode (the shared layer) trains the model's
``head`` on one ``target`` label, each week an example labelled with its participant's (or its
own weekly) label; validation AUROC selects the checkpoint.

Data (``data.kind``): ``synthetic`` — the simulator of
:mod:`domainfm.data_loaders.wearables_synthetic` (SYNTHETIC: labels are functions of simulated
physiology, not health records) — or ``npz``: ``data.path`` with arrays ``values`` (N, 168, V) in the
variables' units (NaN = missing), ``participant`` (N,), optional ``variables``, and ``data.labels``,
a CSV with a ``participant`` column and one column per task (plus ``week`` for weekly labels in
``data.weekly_labels``, matched by week index within the participant).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from domainfm.experiment.inference import positive_int  # argparse types
from domainfm.data_loaders import wearables as W
from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.lora.settings import LoraSettings

__all__ = ["Config", "DataSection", "ProbeSection", "FAMILY", "build_task", "probe_protocol", "handmade_features",
           "linear_probe", "run", "evaluate", "read_weeks", "predict", "embed", "predict_main", "embed_main",
           "retained_other_tasks"]

LORA_TARGETS = ["layers.*.mixer.in_proj", "layers.*.mixer.out_proj"]
SYNTHETIC_NOTE = ("synthetic: SIMULATED cohort (data_loaders/wearables_synthetic.py); labels are functions of the "
                  "simulated physiology (short_sleep: habitual sleep < 6.5 h; low_fitness: fitness z < -0.5; "
                  "shift_work: simulated shift worker; short_sleep_week: that week's mean sleep < 6.5 h), not health "
                  "records")


@dataclass
class DataSection:
    kind: str = "synthetic"
    path: str | None = None
    labels: str | None = None
    weekly_labels: str | None = None
    variables: list[str] | None = None
    min_hours: int = 24
    val_fraction: float = 0.2
    test_fraction: float = 0.2
    synthetic_participants: int = 200
    synthetic_weeks: int = 4
    synthetic_seed: int = 0

    def __post_init__(self):
        if self.kind not in {"synthetic", "npz"}:
            raise ValueError(f"data.kind={self.kind!r}: expected 'synthetic' or 'npz'")
        if self.val_fraction <= 0 or self.test_fraction <= 0 or self.val_fraction + self.test_fraction >= 1:
            raise ValueError("data.val_fraction and data.test_fraction must be positive and sum to less than 1")


@dataclass
class ProbeSection:
    """``tasks``: participant-level labels to probe (default: every one the data has);
    ``weekly_tasks``: per-week labels; ``pca``: components before the probe (null: none);
    ``c_grid``: inverse regularisation strengths tried (chosen by validation); ``handmade``: also
    probe hand-made features."""

    enabled: bool = True
    tasks: list[str] | None = None
    weekly_tasks: list[str] | None = None
    pca: int | None = None
    c_grid: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0])
    handmade: bool = True
    batch_size: int = 256


@dataclass
class Config(ExperimentConfig):
    """``target``: the label the head is fine-tuned on (participant-level or weekly)."""

    target: str = "low_fitness"
    data: DataSection = field(default_factory=DataSection)
    probe: ProbeSection = field(default_factory=ProbeSection)
    model: ModelSection = field(default_factory=lambda: ModelSection(name="wbm-base", pretrained=None))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(
        mode="linear_probe", lora=LoraSettings(targets=list(LORA_TARGETS), rank=8, alpha=16.0)))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=10, batch_size=64, lr=1e-3, weight_decay=0.01, schedule="cosine", head_patterns=["head.*"]))


# ----------------------------------------------------------------------------- data


class LabelledWeeks(Dataset):
    """``((values, observed), y)`` per week; values in the variables' units (0 where unobserved)."""

    def __init__(self, values, observed, y):
        self.values = torch.as_tensor(values, dtype=torch.float32)
        self.observed = torch.as_tensor(observed, dtype=torch.bool)
        self.y = torch.as_tensor(y, dtype=torch.float32)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return (self.values[i], self.observed[i]), self.y[i]


def _load(cfg: Config):
    data = cfg.data
    if data.kind == "synthetic":
        from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort

        cohort = synthetic_cohort(data.synthetic_participants, data.synthetic_weeks, seed=data.synthetic_seed)
        variables = list(data.variables or SYNTHETIC_VARIABLES)
        identity = W.ZScoreStats(tuple(variables), np.zeros(len(variables)), np.ones(len(variables)))
        values, observed, participant, week_start = [], [], [], []
        for pid, table in enumerate(cohort.tables):
            weeks = W.to_weeks(table, variables=variables, stats=identity, min_hours=data.min_hours)
            values.append(weeks.values)
            observed.append(weeks.observed)
            participant.append(np.full(len(weeks), pid))
            week_start.extend(weeks.week_starts)
        labels = cohort.labels.set_index("participant")[list(cohort.PARTICIPANT_TASKS)]
        weekly = cohort.weekly.set_index(["participant", "week_start"])[list(cohort.WEEKLY_TASKS)]
        keys = pd.MultiIndex.from_arrays([np.concatenate(participant), pd.DatetimeIndex(week_start)])
        week_labels = weekly.reindex(keys).reset_index(drop=True)
        source = (f"SYNTHETIC cohort (simulated): {data.synthetic_participants} participants x {data.synthetic_weeks} "
                  f"weeks, seed {data.synthetic_seed}")
        return (np.concatenate(values), np.concatenate(observed), np.concatenate(participant), variables, labels,
                week_labels, source, SYNTHETIC_NOTE)
    if not data.path or not data.labels:
        raise ValueError("data.kind=npz needs data.path (weeks .npz) and data.labels (CSV: participant, tasks...)")
    with np.load(data.path, allow_pickle=False) as z:
        missing = [k for k in ("values", "participant") if k not in z]
        if missing:
            raise W.HealthDataError(f"{data.path}: missing array(s) {missing}; expected values (N, 168, V) and "
                                    "participant (N,)")
        raw, participant = z["values"].astype(np.float32), z["participant"]
        variables = [str(v) for v in z["variables"]] if "variables" in z else (
            data.variables or [f"var{i}" for i in range(raw.shape[-1])])
    if raw.ndim != 3 or raw.shape[1] != 168 or len(participant) != len(raw):
        raise W.HealthDataError(f"{data.path}: values {raw.shape}, participant {participant.shape}: expected "
                                "(N, 168, V) and (N,)")
    observed = np.isfinite(raw)
    labels = pd.read_csv(data.labels)
    if "participant" not in labels.columns:
        raise W.HealthDataError(f"{data.labels}: no 'participant' column (columns: {list(labels.columns)})")
    labels = labels.set_index("participant")
    week_labels = pd.DataFrame(index=range(len(raw)))
    if data.weekly_labels:
        weekly = pd.read_csv(data.weekly_labels)
        if not {"participant", "week"} <= set(weekly.columns):
            raise W.HealthDataError(f"{data.weekly_labels}: expected columns participant, week and weekly tasks")
        week_idx = pd.Series(participant).groupby(participant).cumcount().to_numpy()
        keys = pd.MultiIndex.from_arrays([participant, week_idx])
        week_labels = weekly.set_index(["participant", "week"]).reindex(keys).reset_index(drop=True)
    return (np.where(observed, raw, 0.0), observed, participant, variables, labels, week_labels,
            f"npz: {data.path}", "recorded")


def _split(participant: np.ndarray, data: DataSection, seed: int) -> dict[str, np.ndarray]:
    people = np.random.default_rng(seed).permutation(np.unique(participant))
    n_val = max(1, int(round(len(people) * data.val_fraction)))
    n_test = max(1, int(round(len(people) * data.test_fraction)))
    if n_val + n_test >= len(people):
        raise ValueError(f"{len(people)} participants are too few for validation and test splits")
    groups = {"test": people[:n_test], "val": people[n_test:n_test + n_val], "train": people[n_test + n_val:]}
    return {k: np.flatnonzero(np.isin(participant, v)) for k, v in groups.items()}


def build_task(cfg: Config) -> TaskData:
    values, observed, participant, variables, labels, week_labels, source, note = _load(cfg)
    split = _split(participant, cfg.data, cfg.train.seed)
    if cfg.target in week_labels.columns:
        y = week_labels[cfg.target].to_numpy(float)
    elif cfg.target in labels.columns:
        y = labels[cfg.target].reindex(participant).to_numpy(float)
    else:
        raise ValueError(f"target={cfg.target!r}: not a label of the data; participant labels {list(labels.columns)}, "
                         f"weekly labels {list(week_labels.columns)}")
    binary = set(np.unique(y[np.isfinite(y)])) <= {0.0, 1.0}
    # z-score statistics from the training participants' observed hours (the random arm's; a
    # pretrained model brings its own, loaded with its weights)
    train_vals = values[split["train"]].reshape(-1, len(variables))
    train_obs = observed[split["train"]].reshape(-1, len(variables))
    mean = np.array([train_vals[train_obs[:, k], k].mean() if train_obs[:, k].any() else 0.0
                     for k in range(len(variables))])
    std = np.array([train_vals[train_obs[:, k], k].std() if train_obs[:, k].any() else 1.0
                    for k in range(len(variables))])
    std = np.where(std > 1e-8, std, 1.0)
    datasets = {}
    for name, idx in split.items():
        keep = idx[np.isfinite(y[idx])]
        datasets[name] = LabelledWeeks(values[keep], observed[keep], y[keep])
    info = {"data_source": source, "variables": ",".join(variables), "n_chans": len(variables), "weeks": len(values),
            "participants": int(len(np.unique(participant))), "target": cfg.target,
            **{f"{k}_weeks": len(v) for k, v in datasets.items()},
            "observed_fraction": round(float(observed.mean()), 4)}
    extras = {"values": values, "observed": observed, "participant": participant, "split": split,
              "labels": labels, "week_labels": week_labels, "variables": variables,
              "zscore": (mean.tolist(), std.tolist())}
    return TaskData(datasets["train"], datasets["val"], datasets["test"], task="binary" if binary else "regression",
                    n_outputs=1, forward_fn=lambda model, x: model(x[0], x[1], raw=True),
                    labels=note, info=info, extras=extras)


# ----------------------------------------------------------------------------- probes


def handmade_features(values: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Per week and variable: mean and SD over observed hours, and the 24-hour cosinor amplitude
    (least-squares fit of ``m + a cos(2 pi h / 24) + b sin(2 pi h / 24)`` to the observed hours;
    amplitude ``sqrt(a^2 + b^2)``). Missing statistics are filled with the variable's mean later.

    **Shapes:** ``(N, 168, V)`` -> ``(N, 3 V)``.
    """
    w = observed.astype(float)
    n = w.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (values * w).sum(1) / n
        sd = np.sqrt((((values - mean[:, None]) ** 2) * w).sum(1) / n)
        angle = 2 * np.pi * (np.arange(168) % 24) / 24
        basis = np.stack([np.ones(168), np.cos(angle), np.sin(angle)], 1)  # (168, 3)
        # weighted normal equations per (week, variable): (B' W B) beta = B' W y
        gram = np.einsum("hk,nhv,hl->nvkl", basis, w, basis) + 1e-6 * np.eye(3)
        rhs = np.einsum("hk,nhv->nvk", basis, w * values)
        beta = np.linalg.solve(gram, rhs[..., None])[..., 0]
        amp = np.hypot(beta[..., 1], beta[..., 2])
        amp[n < 24] = np.nan
    return np.concatenate([mean, sd, amp], axis=1)


def _metrics_binary(y, p) -> dict[str, float]:
    from sklearn.metrics import average_precision_score, balanced_accuracy_score, roc_auc_score

    if len(np.unique(y)) < 2:
        return {"auroc": float("nan"), "auprc": float("nan"), "balanced_accuracy": float("nan")}
    return {"auroc": float(roc_auc_score(y, p)), "auprc": float(average_precision_score(y, p)),
            "balanced_accuracy": float(balanced_accuracy_score(y, p >= 0.5))}


def _metrics_regression(y, p) -> dict[str, float]:
    from sklearn.metrics import r2_score

    return {"r2": float(r2_score(y, p)), "pearson": float(np.corrcoef(y, p)[0, 1])}


def linear_probe(features: dict[str, np.ndarray], targets: dict[str, np.ndarray], *, pca: int | None = None,
                 c_grid=(0.01, 0.1, 1.0, 10.0)) -> dict[str, float]:
    """Fit on ``features["train"]``, choose ``C`` (logistic) or ``alpha = 1/C`` (ridge) by validation
    AUROC / R², report the test metrics. Standardised (train statistics), optional PCA; NaN
    features are filled with the training mean. Binary targets: class-balanced logistic regression."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-missing feature: filled with 0 below
        fill = np.nanmean(features["train"], axis=0)
    fill = np.where(np.isfinite(fill), fill, 0.0)
    X = {k: np.where(np.isfinite(v), v, fill) for k, v in features.items()}
    y = targets
    binary = set(np.unique(y["train"])) <= {0.0, 1.0}
    if binary and len(np.unique(y["train"])) < 2:
        return {"auroc": float("nan"), "auprc": float("nan"), "balanced_accuracy": float("nan"), "note": "one class"}
    best = None
    for c in c_grid:
        steps = [StandardScaler()]
        if pca:
            steps.append(PCA(n_components=min(pca, X["train"].shape[1], len(X["train"]) - 1), random_state=0))
        steps.append(LogisticRegression(C=c, max_iter=2000, class_weight="balanced") if binary else Ridge(alpha=1 / c))
        model = make_pipeline(*steps).fit(X["train"], y["train"])
        predict = (lambda m, x: m.predict_proba(x)[:, 1]) if binary else (lambda m, x: m.predict(x))
        val = (_metrics_binary if binary else _metrics_regression)(y["val"], predict(model, X["val"]))
        score = val["auroc" if binary else "r2"]
        score = -np.inf if not np.isfinite(score) else score
        if best is None or score > best[0]:
            best = (score, c, model, predict)
    _, c, model, predict = best
    out = (_metrics_binary if binary else _metrics_regression)(y["test"], predict(model, X["test"]))
    return {**out, "C": c}


def _probe_all(cfg: Config, task: TaskData, week_features: np.ndarray) -> dict[str, Any]:
    ex = task.extras
    participant, split = ex["participant"], ex["split"]
    labels, week_labels = ex["labels"], ex["week_labels"]
    people = np.unique(participant)
    inverse = np.searchsorted(people, participant)
    # mean weekly embedding per participant (NaN-aware, for hand-made features with gaps)
    sums = np.zeros((len(people), week_features.shape[1]))
    counts = np.zeros((len(people), week_features.shape[1]))
    finite = np.isfinite(week_features)
    np.add.at(sums, inverse, np.where(finite, week_features, 0.0))
    np.add.at(counts, inverse, finite)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_person = sums / counts
    out: dict[str, Any] = {}
    tasks = cfg.probe.tasks if cfg.probe.tasks is not None else list(labels.columns)
    for name in tasks:
        if name not in labels.columns:
            raise ValueError(f"probe.tasks: {name!r} is not a participant label ({list(labels.columns)})")
        feats, targets = {}, {}
        for part, idx in split.items():
            who = np.unique(participant[idx])
            y = labels[name].reindex(who).to_numpy(float)
            ok = np.isfinite(y)
            feats[part], targets[part] = per_person[np.searchsorted(people, who)][ok], y[ok]
        out[name] = linear_probe(feats, targets, pca=cfg.probe.pca, c_grid=cfg.probe.c_grid)
    weekly = cfg.probe.weekly_tasks if cfg.probe.weekly_tasks is not None else list(week_labels.columns)
    for name in weekly:
        if name not in week_labels.columns:
            raise ValueError(f"probe.weekly_tasks: {name!r} is not a weekly label ({list(week_labels.columns)})")
        y_all = week_labels[name].to_numpy(float)
        feats = {part: week_features[idx][np.isfinite(y_all[idx])] for part, idx in split.items()}
        targets = {part: y_all[idx][np.isfinite(y_all[idx])] for part, idx in split.items()}
        out[f"{name} (per week)"] = linear_probe(feats, targets, pca=cfg.probe.pca, c_grid=cfg.probe.c_grid)
    return out


@torch.no_grad()
def _embed(model, task: TaskData, batch_size: int) -> np.ndarray:
    ex = task.extras
    values, observed = ex["values"], ex["observed"]
    device = next(model.parameters()).device
    model.eval()
    chunks = []
    for i in range(0, len(values), batch_size):
        v = torch.as_tensor(values[i:i + batch_size], dtype=torch.float32, device=device)
        o = torch.as_tensor(observed[i:i + batch_size], dtype=torch.bool, device=device)
        chunks.append(model.forward_features(v, o, raw=True).float().cpu().numpy())
    return np.concatenate(chunks)


def probe_protocol(ctx: ArmContext) -> dict[str, Any]:
    """Linear probes on this arm's frozen embeddings (and, once per run, on hand-made features)."""
    cfg, task = ctx.cfg, ctx.task
    if not cfg.probe.enabled:
        return {}
    out = {"probe": _probe_all(cfg, task, _embed(ctx.model, task, cfg.probe.batch_size))}
    if cfg.probe.handmade:
        if "handmade_probe" not in task.extras:  # the same for every arm: computed once
            feats = handmade_features(task.extras["values"], task.extras["observed"])
            task.extras["handmade_probe"] = _probe_all(cfg, task, feats)
        out["probe_handmade"] = task.extras["handmade_probe"]
    return out


def _model_kwargs(cfg: Config, task: TaskData) -> dict[str, Any]:
    mean, std = task.extras["zscore"]
    return {"n_chans": task.info["n_chans"], "n_times": 168, "n_outputs": 1, "variables": task.extras["variables"],
            "zscore_mean": mean, "zscore_std": std}


def retained_other_tasks(ctx: ArmContext) -> dict[str, Any]:
    """Retained capability: linear-probe AUROC (the OpenMHC protocol of :func:`probe_protocol`) of
    this arm's frozen embeddings on the binary tasks the fine-tuning target is not (the other
    participant labels and the weekly ones), test participants; their mean is the summary."""
    cfg, task = ctx.cfg, ctx.task
    others = [c for c in task.extras["labels"].columns if c != cfg.target]
    weekly = [c for c in task.extras["week_labels"].columns if c != cfg.target]
    import dataclasses

    probe_cfg = dataclasses.replace(cfg, probe=dataclasses.replace(cfg.probe, tasks=others, weekly_tasks=weekly))
    scores = _probe_all(probe_cfg, task, _embed(ctx.model, task, cfg.probe.batch_size))
    aurocs = {k: v["auroc"] for k, v in scores.items() if "auroc" in v and np.isfinite(v["auroc"])}
    return {"auroc": float(np.mean(list(aurocs.values()))) if aurocs else float("nan"), "tasks": aurocs}


FAMILY = Family(
    name="wearables",
    config=Config,
    data=build_task,
    model_kwargs=_model_kwargs,
    protocols_before=[probe_protocol],
    head="head",
    retained=Retained(retained_other_tasks, metric="auroc", direction="max",
                      description="mean linear-probe AUROC of the frozen embeddings on the labels other than the "
                                  "fine-tuning target (participant and weekly tasks; test participants)"),
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# ----------------------------------------------------------------------------- predict / embed


_NO_VARIABLES = ("the model records no variable names (domainfm.model_kwargs.variables in its config.json: the "
                 "names of its inputs, in order), so a file's columns cannot be mapped to its inputs; save it with "
                 "create_model(..., variables=[...]) (fine-tuning runs record them) or add the list to its config.json")


def read_weeks(path: str, model, *, min_hours: int = 24, tz: str | None = None) -> W.Weeks:
    """A participant's file -> the model's weeks (its variables, in its order; values in the
    variables' units, z-scored inside the model as in training): an Apple Health ``export.xml``
    (:func:`~domainfm.data_loaders.wearables.read_healthkit`) or the unzipped ``apple_health_export``
    folder holding it, a long CSV/Parquet ``timestamp, variable, value``
    (:func:`~domainfm.data_loaders.wearables.read_long`) or a Fitbit export folder."""
    from pathlib import Path

    from domainfm.errors import InputError

    variables = list(getattr(model, "variables", None) or [])
    if not variables:
        raise InputError(_NO_VARIABLES)
    p = Path(path)
    healthkit = W.healthkit_export_file(p) if p.is_dir() else None
    if healthkit is not None:
        table = W.read_healthkit(healthkit, variables=[v for v in variables if v in W.VARIABLES])
    elif p.is_dir():
        table = W.read_fitbit(p, variables=[v for v in variables if v in W.VARIABLES] or None, tz=tz)
    elif not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (--input: export.xml or its apple_health_export folder, a long "
                                "CSV/Parquet or a Fitbit folder)")
    elif p.suffix.lower() == ".xml":
        table = W.read_healthkit(p, variables=[v for v in variables if v in W.VARIABLES])
    elif p.suffix.lower() in (".csv", ".parquet"):
        table = W.read_long(p)
    else:
        raise W.HealthDataError(f"{p}: expected an Apple Health export.xml, a long .csv/.parquet (timestamp, "
                                f"variable, value) or a Fitbit folder, got {p.suffix or 'no suffix'!r}")
    present = [v for v in variables if v in table.columns and table[v].notna().any()]
    if not present:
        raise W.HealthDataError(f"{p}: none of the model's variables {variables} is in the file (it has "
                                f"{list(table.columns)})")
    identity = W.ZScoreStats(tuple(variables), np.zeros(len(variables)), np.ones(len(variables)))
    weeks = W.to_weeks(table, variables=variables, stats=identity, min_hours=min_hours)
    if not len(weeks.values):
        raise W.HealthDataError(f"{p}: no week with at least {min_hours} observed hours")
    return weeks


@torch.no_grad()
def _apply(model, weeks: W.Weeks, what: str, precision: str, device, batch_size: int = 64) -> np.ndarray:
    from domainfm.precision import autocast

    model.eval()
    out = []
    for i in range(0, len(weeks.values), batch_size):
        v = torch.as_tensor(weeks.values[i:i + batch_size], dtype=torch.float32, device=device)
        o = torch.as_tensor(weeks.observed[i:i + batch_size], dtype=torch.bool, device=device)
        with autocast(precision, device):
            y = model.forward_features(v, o, raw=True) if what == "embed" else model(v, o, raw=True)
        out.append(y.float().cpu().numpy())
    return np.concatenate(out)


def _frame(weeks: W.Weeks) -> pd.DataFrame:
    starts = pd.DatetimeIndex(weeks.week_starts)
    return pd.DataFrame({"week_start": starts, "week_end": starts + pd.Timedelta(hours=168),
                         "hours_observed": weeks.observed.any(-1).sum(-1)})


def predict(path: str, model, *, target: str = "output", task: str = "binary", min_hours: int = 24,
            precision: str = "auto", device: str = "cpu") -> pd.DataFrame:
    """Per-week predictions of a fine-tuned WBM: ``week_start, week_end, hours_observed`` and
    ``p_<target>`` (binary: the sigmoid of the head) or ``<target>`` (regression)."""
    weeks = read_weeks(path, model, min_hours=min_hours)
    out = _apply(model, weeks, "predict", precision, device).reshape(len(weeks.values), -1)[:, 0]
    frame = _frame(weeks)
    if task == "binary":
        frame[f"p_{target}"] = 1.0 / (1.0 + np.exp(-out))
    else:
        frame[target] = out
    return frame


def embed(path: str, model, *, min_hours: int = 24, precision: str = "auto", device: str = "cpu"):
    """(the weeks' frame, embeddings ``(W, num_features)``)."""
    weeks = read_weeks(path, model, min_hours=min_hours)
    return _frame(weeks), _apply(model, weeks, "embed", precision, device)


def _parse(command: str, argv: list[str]):
    import argparse

    from domainfm.experiment.inference import add_model_arguments

    parser = argparse.ArgumentParser(
        prog=f"domainfm {command} wearables",
        description=("Per-week predictions of a fine-tuned WBM (CSV: week_start, week_end, hours_observed, "
                     "p_<target>)" if command == "predict" else "Per-week WBM embeddings (.npz: week_start, X)")
        + ". --input: an Apple Health export.xml (or its unzipped apple_health_export folder), a long CSV/Parquet "
          "(timestamp, variable, value) or a Fitbit export folder of one participant.")
    add_model_arguments(parser)
    parser.add_argument("--min-hours", type=positive_int, default=24, help="drop weeks with fewer observed hours")
    return parser.parse_args(argv)


def _load_for_apply(args, command: str):
    from domainfm.errors import InputError
    from domainfm.experiment.inference import load_model, resolve_model_dir, run_report

    model = load_model(args.model, arm=args.arm, pretrained=args.pretrained).to(args.device)
    where = resolve_model_dir(args.model, args.arm) or args.model
    if not getattr(model, "variables", None):
        raise InputError(f"{where}: {_NO_VARIABLES}")
    if command == "predict" and getattr(model, "head", None) is None:
        raise InputError(f"{where}: the model has no head (a pretrained backbone); use "
                         "`domainfm embed wearables` for its embeddings, or fine-tune it first")
    report = run_report(args.model) or {}
    return model, report


def predict_main(argv: list[str]) -> int:
    """``domainfm predict wearables --model RUN_OR_DIR --input export.xml --output weeks.csv``."""
    from domainfm.atomic import atomic_write_text

    args = _parse("predict", argv)
    model, report = _load_for_apply(args, "predict")
    target = report.get("data", {}).get("target") or "output"
    frame = predict(args.input, model, target=target, task=report.get("task", "binary"), min_hours=args.min_hours,
                    precision=args.precision, device=args.device)
    atomic_write_text(args.output, frame.to_csv(index=False))
    print(f"predict wearables: {len(frame)} weeks -> {args.output}")
    return 0


def embed_main(argv: list[str]) -> int:
    """``domainfm embed wearables --model RUN_OR_DIR --input export.xml --output weeks.npz``."""
    from domainfm.atomic import atomic_path

    args = _parse("embed", argv)
    model, _ = _load_for_apply(args, "embed")
    frame, features = embed(args.input, model, min_hours=args.min_hours, precision=args.precision, device=args.device)
    with atomic_path(args.output) as tmp:
        with open(tmp, "wb") as fh:
            np.savez(fh, week_start=frame["week_start"].astype(str).to_numpy(), X=features,
                     hours_observed=frame["hours_observed"].to_numpy())
    print(f"embed wearables: {features.shape[0]} weeks x {features.shape[1]} -> {args.output}")
    return 0
