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
physiology, not health records) — or ``npz``: weeks in ``data.path`` and labels in ``data.labels``
(+ ``data.weekly_labels``), as :func:`~domainfm.data_loaders.wearables.read_weeks_npz` and
:func:`~domainfm.data_loaders.wearables.read_labels` describe.

``domainfm predict|embed wearables`` (and :func:`predict` / :func:`embed`) apply a model to one
participant's Apple Health, Fitbit or long-table export, week by week.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import StackDataset

from domainfm.data_loaders import wearables as W
from domainfm.data_loaders.wearables import handmade_features  # noqa: F401  (re-exported: the probe's baseline)
from domainfm.engine import TrainConfig
from domainfm.errors import InputError
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment import apply
from domainfm.lora.settings import LoraSettings

__all__ = ["Config", "DataSection", "ProbeSection", "FAMILY", "build_task", "probe_protocol", "handmade_features",
           "linear_probe", "run", "evaluate", "read_weeks", "predict", "embed", "APPLY", "ApplyOptions",
           "ApplySettings", "retained_other_tasks"]

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


def _load(cfg: Config):
    data = cfg.data
    if data.kind == "synthetic":
        from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort

        cohort = synthetic_cohort(data.synthetic_participants, data.synthetic_weeks, seed=data.synthetic_seed)
        variables = list(data.variables or SYNTHETIC_VARIABLES)
        values, observed, participant, week_start = W.cohort_weeks(cohort.tables, variables, min_hours=data.min_hours)
        labels = cohort.labels.set_index("participant")[list(cohort.PARTICIPANT_TASKS)]
        weekly = cohort.weekly.set_index(["participant", "week_start"])[list(cohort.WEEKLY_TASKS)]
        week_labels = weekly.reindex(pd.MultiIndex.from_arrays([participant, week_start])).reset_index(drop=True)
        source = (f"SYNTHETIC cohort (simulated): {data.synthetic_participants} participants x {data.synthetic_weeks} "
                  f"weeks, seed {data.synthetic_seed}")
        return values, observed, participant, variables, labels, week_labels, source, SYNTHETIC_NOTE
    if not data.path or not data.labels:
        raise ValueError("data.kind=npz needs data.path (weeks .npz) and data.labels (CSV: participant, tasks...)")
    values, observed, participant, variables = W.read_weeks_npz(data.path, data.variables)
    labels, week_labels = W.read_labels(data.labels, participant, data.weekly_labels)
    return values, observed, participant, variables, labels, week_labels, f"npz: {data.path}", "recorded"


def build_task(cfg: Config) -> TaskData:
    values, observed, participant, variables, labels, week_labels, source, note = _load(cfg)
    split = W.split_participants(participant, val_fraction=cfg.data.val_fraction,
                                 test_fraction=cfg.data.test_fraction, seed=cfg.train.seed)
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
    zscore = W.ZScoreStats.fit_weeks(values[split["train"]], observed[split["train"]], variables)
    datasets = {}
    for name, idx in split.items():  # items ((values, observed), y): values in the variables' units, 0 unobserved
        keep = idx[np.isfinite(y[idx])]
        datasets[name] = StackDataset(StackDataset(torch.as_tensor(values[keep], dtype=torch.float32),
                                                   torch.as_tensor(observed[keep])),
                                      torch.as_tensor(y[keep], dtype=torch.float32))
    info = {"data_source": source, "variables": ",".join(variables), "n_chans": len(variables), "weeks": len(values),
            "participants": int(len(np.unique(participant))), "target": cfg.target,
            **{f"{k}_weeks": len(v) for k, v in datasets.items()},
            "observed_fraction": round(float(observed.mean()), 4)}
    extras = {"values": values, "observed": observed, "participant": participant, "split": split,
              "labels": labels, "week_labels": week_labels, "variables": variables,
              "zscore": (zscore.mean.tolist(), zscore.std.tolist())}
    return TaskData(datasets["train"], datasets["val"], datasets["test"], task="binary" if binary else "regression",
                    n_outputs=1, forward_fn=lambda model, x: model(x[0], x[1], raw=True),
                    labels=note, info=info, extras=extras)


# ----------------------------------------------------------------------------- probes


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


def _week_embeddings(model, task: TaskData, batch_size: int) -> np.ndarray:
    model.eval()
    runtime = apply.Runtime(precision="32-true", device=next(model.parameters()).device, batch_size=batch_size)
    return runtime.batched(lambda v, o: model.forward_features(v, o, raw=True),
                           task.extras["values"], task.extras["observed"]).numpy()


def probe_protocol(ctx: ArmContext) -> dict[str, Any]:
    """Linear probes on this arm's frozen embeddings (and, once per run, on hand-made features)."""
    cfg, task = ctx.cfg, ctx.task
    if not cfg.probe.enabled:
        return {}
    out = {"probe": _probe_all(cfg, task, _week_embeddings(ctx.model, task, cfg.probe.batch_size))}
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
    probe_cfg = dataclasses.replace(cfg, probe=dataclasses.replace(cfg.probe, tasks=others, weekly_tasks=weekly))
    scores = _probe_all(probe_cfg, task, _week_embeddings(ctx.model, task, cfg.probe.batch_size))
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


def read_weeks(path, model, *, min_hours: int = 24, tz: str | None = None) -> W.Weeks:
    """A participant's file (any of :func:`~domainfm.data_loaders.wearables.read_participant`) ->
    the model's weeks: its variables, in its order, in their units (the model z-scores them)."""
    variables = list(getattr(model, "variables", None) or [])
    if not variables:
        raise InputError(_NO_VARIABLES)
    return W.participant_weeks(path, variables, min_hours=min_hours, tz=tz)


@dataclass
class ApplySettings:
    """The model's ``variables`` (inputs, in order), the ``target`` and ``task`` its head was
    fine-tuned on (from the run's report); ``where``: the model, as errors name it."""

    variables: list[str]
    target: str = "output"
    task: str = "binary"
    where: str = "the model"


@dataclass
class ApplyOptions:
    min_hours: int = apply.option(24, "drop weeks with fewer observed hours")


def _settings(ref: apply.ModelRef, model) -> ApplySettings:
    where = str(ref.model_dir or ref.label)
    if not getattr(model, "variables", None):
        raise InputError(f"{where}: {_NO_VARIABLES}")
    report = ref.run_report() or {}
    return ApplySettings(list(model.variables), report.get("data", {}).get("target") or "output",
                         report.get("task", "binary"), where)


def _read(source, settings: ApplySettings, options: ApplyOptions | None):
    # read by each command (``data()``), so that predict refuses a model without a head, naming
    # its folder, before the file is read
    min_hours = (options or ApplyOptions()).min_hours
    return lambda: W.participant_weeks(source, settings.variables, min_hours=min_hours)


def _frame(week_starts, hours_observed) -> pd.DataFrame:
    starts = pd.DatetimeIndex(week_starts)
    return pd.DataFrame({"week_start": starts, "week_end": starts + pd.Timedelta(hours=168),
                         "hours_observed": hours_observed})


def _predict(data, model, settings: ApplySettings, options, run: apply.Runtime) -> apply.Output:
    if getattr(model, "head", None) is None:
        raise InputError(f"{settings.where}: the model has no head (a pretrained backbone); use "
                         "`domainfm embed wearables` for its embeddings, or fine-tune it first")
    weeks = data()
    out = run.batched(lambda v, o: model(v, o, raw=True), weeks.values, weeks.observed)
    out = out.reshape(len(weeks), -1)[:, 0].numpy()
    frame = _frame(weeks.week_starts, weeks.observed.any(-1).sum(-1))
    if settings.task == "binary":
        frame[f"p_{settings.target}"] = 1.0 / (1.0 + np.exp(-out))
    else:
        frame[settings.target] = out
    return apply.Output(frame, summary=f"{len(frame)} weeks")


def _embed(data, model, settings: ApplySettings, options, run: apply.Runtime) -> apply.Output:
    weeks = data()
    X = run.batched(lambda v, o: model.forward_features(v, o, raw=True), weeks.values, weeks.observed).numpy()
    out = {"week_start": np.asarray(weeks.week_starts.astype(str), dtype=str), "X": X,
           "hours_observed": weeks.observed.any(-1).sum(-1)}
    return apply.Output(out, summary=f"{X.shape[0]} weeks x {X.shape[1]}")


APPLY = apply.Applier(
    family="wearables",
    input="an Apple Health export.zip (or its export.xml, or the apple_health_export folder it unzips to), a long "
          "CSV/Parquet (timestamp, variable, value) or a Fitbit export folder of one participant",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=64,
    predict=apply.Command(_predict, apply.TABLE,
                          what="Per-week predictions of a fine-tuned WBM (CSV: week_start, week_end, hours_observed, "
                               "p_<target>)."),
    embed=apply.Command(_embed, apply.ARRAYS,
                        what="Per-week WBM embeddings (.npz: week_start, X (weeks, num_features), hours_observed)."),
)


def predict(path, model, *, target: str = "output", task: str = "binary", min_hours: int = 24,
            precision: str = "auto", device: str = "cpu") -> pd.DataFrame:
    """Per-week predictions of a fine-tuned WBM: ``week_start, week_end, hours_observed`` and
    ``p_<target>`` (binary: the sigmoid of the head) or ``<target>`` (regression). ``path``: any
    input of :func:`read_weeks` (or a DataFrame); ``domainfm.predict`` takes ``target``/``task``
    from the run instead."""
    module, ref = apply.resolve(model, device=device)
    settings = dataclasses.replace(_settings(ref, module), target=target, task=task)
    return apply.run("predict", APPLY, module, path, settings=settings, precision=precision, device=device,
                     options=ApplyOptions(min_hours)).value


def embed(path, model, *, min_hours: int = 24, precision: str = "auto", device: str = "cpu"):
    """(the weeks' frame, embeddings ``(W, num_features)``)."""
    out = apply.run("embed", APPLY, model, path, precision=precision, device=device,
                    options=ApplyOptions(min_hours)).value
    return _frame(out["week_start"], out["hours_observed"]), out["X"]
