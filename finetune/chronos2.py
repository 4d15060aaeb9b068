"""Fine-tune and evaluate Chronos-2 with covariates on the experiment layer; predict through ``wavetoken``.

``domainfm finetune chronos2`` (``configs/chronos2/finetune.yaml``, offline, a few minutes on a
CPU): two arms (``pretrained``: ``model.pretrained: true`` with ``model.fallback: random``, so
``chronos-2-test``, whose card lists no weights, starts from a seeded random init and the report's
``init`` says so; ``random``) fine-tuned with LoRA on five US macro series of statsmodels'
public-domain ``macrodata`` (``data_loaders/samples/timeseries/statsmodels_macro_covariates.md``):
target ``target``, past-only covariates ``unemp`` and ``tbilrate`` (observed, unknown in the
future), known-future covariate ``quarter`` (a calendar feature *derived* from the timestamp, not
observed: it is known ahead by construction).

**Data** (:class:`DataSection`): a long-format CSV/Parquet, one row per item and time step:
``id_column``, ``timestamp_column``, ``target`` (one column or several: several targets of an item
are forecast jointly), ``past_covariates`` and ``future_covariates`` (columns whose values over
the forecast window are given to the model). Each item is one Chronos-2 *task*, its rows the
targets, then the past-only covariates, then the known-future ones (the order of
``predict_df``'s tasks), forecast as one group. Test: each item's last ``prediction_length``
steps; validation: the window before it; training: every window (``window_stride``) that ends
before the validation window, with at least ``min_past`` context steps: a fixed set, so that
FLOW's per-window weights are computed once over it.

**Recipe** (:class:`Chronos2Recipe`): Chronos-2's own quantile loss (``forward(...,
future_target=...)``: the pinball loss at the model's levels in normalised units, summed over
levels, averaged over the forecast steps and the task's rows; known-future and unobserved steps
count 0). :meth:`Chronos2Recipe.per_sample_loss` gives it per task (B,); ``step``'s loss is its
mean and equals the model's forward loss of the batch. ``adapt.mode``: full, lora (adapters on
both attentions' ``q, k, v, o`` and the feed-forward's ``wi, wo``; the ``quantile_head`` stays
trainable), linear_probe (the quantile head) or none. Scores: MASE and WQL per dataset (a dataset
per target column) next to seasonal naive and their geometric mean relative to it, GluonTS
conventions (:func:`~domainfm.experiment.forecast_metrics.forecast_scores`), beside statsforecast's
AutoETS and AutoTheta (``eval.baselines``) fitted on each target's context window as the model sees
it (targets only: the baselines use no covariates); checkpoints selected
on validation ``wql_rel``. **Retained capability**: zero-shot ``wql_rel`` on items outside the
task (:class:`RetainedSection`). FLOW / WiSE-FT come from the shared machinery.

**Predict**: ``domainfm predict wavetoken --model chronos-2-test|RUN|MODEL_DIR --input long.csv
[--future-covariates future.csv] --output out.csv [--plot fan.png]`` reaches :func:`predict_output`
(``finetune/wavetoken.py`` dispatches a Chronos-2 model here): the table is the model's
``predict_df`` (``item_id, timestamp, target_name, predictions, <levels>``), every column of the
input other than the id, timestamp and targets a covariate (known-future when the future file has
it); a run folder forecasts with its horizon and quantile levels.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from domainfm.atomic import atomic_write_text
from domainfm.data_loaders.timeseries import TimeSeriesError, infer_freq
from domainfm.engine import Recipe, Trainer
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment import apply
from domainfm.experiment.forecast_metrics import forecast_scores
from domainfm.experiment.pictures import fan_chart, fan_figure
from domainfm.experiment.forecast_baselines import DEFAULT_BASELINES
from domainfm.finetune.wavetoken import _with_median, relative_scores, report_baselines, zero_shot_protocol
from domainfm.lora.settings import LoraSettings

__all__ = ["Config", "DataSection", "EvalSection", "RetainedSection", "FAMILY", "Chronos2Recipe", "SeriesTable",
           "TaskWindows", "read_table", "build_task", "build_recipe", "row_losses", "run", "evaluate",
           "PredictSettings", "predict_settings", "read_for_predict", "predict_output", "APPLY", "LORA_TARGETS",
           "SHIPPED"]

SHIPPED = Path(__file__).resolve().parents[1] / "data_loaders" / "samples" / "timeseries" / \
    "statsmodels_macro_covariates.csv"
#: Chronos-2's projections (models/wavetoken/chronos2.py): time and group attention q/k/v/o, feed-forward wi/wo
LORA_TARGETS = ["*_attn.q", "*_attn.k", "*_attn.v", "*_attn.o", "*ffn.wi", "*ffn.wo"]


@dataclass
class DataSection:
    """A long-format CSV/Parquet (``path``; null: the shipped macrodata sample) and its columns."""

    path: str | None = None
    id_column: str = "item_id"
    timestamp_column: str = "timestamp"
    target: str | list[str] = "target"
    past_covariates: list[str] = field(default_factory=list)
    future_covariates: list[str] = field(default_factory=list)
    #: the items of the task (null: every item of the file)
    items: list[str] | None = None
    prediction_length: int = 8
    #: context steps read per window (null: the model's context length, at most the longest series)
    context_length: int | None = None
    min_past: int = 16
    window_stride: int = 1
    freq: str | None = None


@dataclass
class EvalSection:
    quantile_levels: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    #: statistical baselines scored beside the model on each target's context (forecast_baselines.BASELINES)
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))


@dataclass
class RetainedSection:
    """Zero-shot forecasts of items outside the task: ``items`` of ``path`` (null: ``data.path``;
    with both null, the file's items that ``data.items`` leaves out), same columns and horizon."""

    enabled: bool = True
    path: str | None = None
    items: list[str] | None = None


@dataclass
class Config(ExperimentConfig):
    model: ModelSection = field(default_factory=lambda: ModelSection(name="chronos-2-test", pretrained=True,
                                                                     fallback="random"))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(mode="lora", lora=LoraSettings(targets=list(LORA_TARGETS))))
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    retained: RetainedSection = field(default_factory=RetainedSection)


# --------------------------------------------------------------------------- data


@dataclass
class SeriesTable:
    """Items of a long-format file as row blocks: ``rows[i]`` (R, T_i) float32 = targets, past-only
    covariates, known-future covariates; ``starts[i]`` the first timestamp; one ``freq``."""

    source: str
    items: list[str]
    starts: list[pd.Timestamp]
    rows: list[np.ndarray]
    freq: str
    targets: list[str]
    past: list[str]
    known: list[str]

    @property
    def n_targets(self) -> int:
        return len(self.targets)


def _targets(d: DataSection) -> list[str]:
    return [d.target] if isinstance(d.target, str) else list(d.target)


def read_table(path: str | Path | None, d: DataSection, items: list[str] | None = None) -> SeriesTable:
    """Read ``path`` (null: the shipped sample) into a :class:`SeriesTable`; a missing column, a
    non-numeric value or an irregular series is a :class:`TimeSeriesError` naming file and column."""
    source = Path(path) if path is not None else SHIPPED
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such file (data.path: a long-format CSV/Parquet)")
    frame = pd.read_parquet(source) if source.suffix.lower() == ".parquet" else pd.read_csv(source)
    targets = _targets(d)
    roles = [("id_column", [d.id_column]), ("timestamp_column", [d.timestamp_column]), ("target", targets),
             ("past_covariates", list(d.past_covariates)), ("future_covariates", list(d.future_covariates))]
    for role, columns in roles:
        for column in columns:
            if column not in frame.columns:
                raise TimeSeriesError(f"{source}: no column {column!r} (data.{role}); its columns: {list(frame.columns)}")
    both = sorted(set(d.past_covariates) & set(d.future_covariates) | set(targets) & set(d.past_covariates + d.future_covariates))
    if both:
        raise TimeSeriesError(f"{source}: column(s) {both} named in two of data.target / past_covariates / "
                              "future_covariates; each column has one role")
    values = targets + list(d.past_covariates) + list(d.future_covariates)
    for column in values:
        if not pd.api.types.is_numeric_dtype(frame[column]) or pd.api.types.is_bool_dtype(frame[column]):
            raise TimeSeriesError(f"{source}: column {column!r} must be numeric (got dtype {frame[column].dtype}); "
                                  "encode categories as numbers")
    frame = frame.assign(**{d.timestamp_column: pd.to_datetime(frame[d.timestamp_column])})
    frame[d.id_column] = frame[d.id_column].astype(str)
    wanted = items if items is not None else list(pd.unique(frame[d.id_column]))
    absent = sorted(set(wanted) - set(frame[d.id_column]))
    if absent:
        raise TimeSeriesError(f"{source}: item(s) {absent[:5]} not in column {d.id_column!r}")
    groups = dict(tuple(frame.groupby(d.id_column, sort=False)))
    starts, rows, freqs = [], [], set()
    for item in wanted:
        g = groups[item].sort_values(d.timestamp_column)
        stamps = pd.DatetimeIndex(g[d.timestamp_column])
        freq = d.freq or infer_freq(stamps, name=f"{source}: item {item!r}")
        if len(pd.date_range(stamps[0], stamps[-1], freq=freq)) != len(stamps):
            raise TimeSeriesError(f"{source}: item {item!r}: timestamps are not a regular {freq} grid (gaps or "
                                  "duplicates); write missing steps as rows with empty values")
        freqs.add(freq)
        starts.append(stamps[0])
        rows.append(g[values].to_numpy(np.float32, na_value=np.nan).T.copy())
    if len(freqs) > 1:
        raise TimeSeriesError(f"{source}: the items' frequencies disagree ({sorted(freqs)}); pass data.freq")
    return SeriesTable(str(source), list(wanted), starts, rows, freqs.pop(), targets, list(d.past_covariates),
                       list(d.future_covariates))


class TaskWindows(Dataset):
    """Forecast windows of a :class:`SeriesTable`: ``(context (R, C), future (R, H), target
    (n_targets, H), index)``. ``context``: the rows' values before the window (last ``C``, NaN on
    the left); ``future``: the known-future covariates' values over the window, NaN on the other
    rows; ``target``: the targets' values over the window. ``ends``: (item, end step) pairs."""

    def __init__(self, table: SeriesTable, ends: list[tuple[int, int]], horizon: int, context_length: int,
                 offset: int = 0, with_index: bool = True):
        self.table, self.ends, self.horizon, self.context_length = table, list(ends), int(horizon), int(context_length)
        self.offset, self.with_index = int(offset), with_index

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int):
        t, h, c = self.table, self.horizon, self.context_length
        item, end = self.ends[i]
        rows = t.rows[item]
        past = rows[:, max(0, end - h - c):end - h]
        context = np.full((rows.shape[0], c), np.nan, np.float32)
        context[:, c - past.shape[1]:] = past
        future = np.full((rows.shape[0], h), np.nan, np.float32)
        known = slice(rows.shape[0] - len(t.known), rows.shape[0])
        future[known] = rows[known, end - h:end]
        out = (torch.from_numpy(context), torch.from_numpy(future), torch.from_numpy(rows[:t.n_targets, end - h:end].copy()))
        return (*out, torch.tensor(self.offset + i)) if self.with_index else out

    def windows(self) -> list[dict[str, Any]]:
        """One scoring window per (window, target): ``forecast_scores``' dicts, in dataset order."""
        t, out = self.table, []
        for item, end in self.ends:
            for j, name in enumerate(t.targets):
                series = t.rows[item][j]
                out.append({"dataset": name, "item_id": t.items[item], "target_name": name, "freq": t.freq,
                            "start": t.starts[item], "context": series[:end - self.horizon].astype(np.float64),
                            "future": series[end - self.horizon:end].astype(np.float64)})
        return out


def _context_length(cfg: Config, table: SeriesTable) -> int:
    from domainfm import zoo

    model = cfg.model.kwargs.get("context_length", zoo.get_card(cfg.model.name).defaults["context_length"])
    longest = max(r.shape[1] for r in table.rows)
    return int(min(model, cfg.data.context_length or longest, longest))


def _check_horizon(cfg: Config) -> None:
    from domainfm import zoo

    defaults = {**zoo.get_card(cfg.model.name).defaults, **cfg.model.kwargs}
    one_pass = defaults["max_output_patches"] * defaults["output_patch_size"]
    if not 1 <= cfg.data.prediction_length <= one_pass:
        raise TimeSeriesError(f"data.prediction_length={cfg.data.prediction_length}: expected 1 to {one_pass} (the steps "
                              f"{cfg.model.name} forecasts in one pass, which its quantile loss scores)")


def build_task(cfg: Config) -> TaskData:
    """Train: windows ending before each item's validation window; val: the window before the
    test window; test: each item's last ``prediction_length`` steps."""
    d = cfg.data
    _check_horizon(cfg)
    table = read_table(d.path, d, d.items)
    h = d.prediction_length
    for item, rows in zip(table.items, table.rows):
        if rows.shape[1] < 2 * h + d.min_past:
            raise TimeSeriesError(f"{table.source}: item {item!r} has {rows.shape[1]} steps; data.prediction_length={h} "
                                  f"needs at least 2 * {h} + data.min_past={d.min_past}")
    c = _context_length(cfg, table)
    n = [rows.shape[1] for rows in table.rows]
    fit = [(i, e) for i, length in enumerate(n) for e in range(length - 2 * h, d.min_past + h - 1, -d.window_stride)]
    train = TaskWindows(table, sorted(fit), h, c, with_index=False)
    val = TaskWindows(table, [(i, length - h) for i, length in enumerate(n)], h, c)
    test = TaskWindows(table, [(i, length) for i, length in enumerate(n)], h, c, offset=len(val))
    return TaskData(train, val, test, task="forecast", n_outputs=None,
                    labels="recorded: forecast targets are each item's own held-out values",
                    info={"source": table.source, "n_items": len(table.items), "prediction_length": h,
                          "freq": table.freq, "targets": table.targets, "past_covariates": table.past,
                          "future_covariates": table.known, "train_windows": len(train), "context_length": c},
                    extras={"windows": val.windows() + test.windows(), "n_targets": table.n_targets})


# --------------------------------------------------------------------------- recipe


def _grouped(batch, n_targets: int):
    """(B, R, C) windows -> Chronos-2's rows: context (B*R, C), group ids (B,) per row, future
    covariates (B*R, H) and future targets (B*R, H) (NaN on covariate rows: not scored)."""
    context, future, target = batch[0], batch[1], batch[2]
    b, r, _ = context.shape
    scored = torch.full_like(future, float("nan"))
    scored[:, :n_targets] = target
    group_ids = torch.arange(b, device=context.device).repeat_interleave(r)
    return context.reshape(b * r, -1).float(), group_ids, future.reshape(b * r, -1).float(), scored.reshape(b * r, -1).float()


def row_losses(model, context, group_ids, future_covariates, future_target) -> torch.Tensor:
    """(rows,) Chronos-2's quantile loss per row, as its ``forward(..., future_target=...)``
    computes it before the mean over rows: the pinball loss ``2 |(y - q)(1[y <= q] - level)|`` in
    normalised units, summed over the model's levels and averaged over the ``n * P`` forecast
    steps, unobserved and known-future steps counting 0."""
    p = model.output_patch_size
    n = math.ceil(future_target.shape[1] / p)
    embeds, observed, (loc, scale), known = model.tokens(context, future_covariates=future_covariates,
                                                         num_output_patches=n)
    states = model.encode(embeds, observed, group_ids, keep=n)
    normalised = model.forward_head(states).transpose(1, 2).to(torch.float32)  # (rows, Q, n * P)
    z = model._normalise(future_target.to(normalised.device), loc, scale)
    valid = ~torch.isnan(z)
    pad = normalised.shape[-1] - z.shape[1]
    z = torch.nn.functional.pad(torch.where(valid, z, torch.zeros_like(z)), (0, pad))
    weight = torch.nn.functional.pad(valid.float(), (0, pad)) * (1 - known)
    levels = torch.tensor(model.quantiles, device=z.device).view(1, -1, 1)
    y = z.unsqueeze(1)
    pinball = 2 * torch.abs((y - normalised) * ((y <= normalised).float() - levels))
    return (pinball * weight.unsqueeze(1)).mean(-1).sum(-1)


class Chronos2Recipe(Recipe):
    """Training: Chronos-2's quantile loss with covariates; evaluation: the model's quantile
    forecasts of held-out windows (with their known-future covariates) scored by
    :func:`forecast_scores`; ``forecasts`` keeps the latest of every scored window
    (``{window index: {"quantiles": (H, Q) at eval.quantile_levels, "mean": (H,)}}``)."""

    def __init__(self, model, train_dataset, val_dataset, *, windows, n_targets: int, eval_cfg: EvalSection,
                 context_length: int | None = None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.windows, self.n_targets, self.eval_cfg, self.forecasts = windows, n_targets, eval_cfg, {}
        #: the context steps the model is given (TaskWindows.context_length): the baselines are fitted on as many
        self.context_length = context_length

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """(B,) each window's (task's) loss: its rows' mean; ``step``'s loss is their mean."""
        context, group_ids, future, scored = _grouped(batch, self.n_targets)
        rows = row_losses(model, context, group_ids, future, scored)
        return rows.view(batch[0].shape[0], -1).mean(1)

    def step(self, model, batch):
        loss = self.per_sample_loss(model, batch).mean()
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        from domainfm.models.wavetoken.chronos2_convert import Task

        context, future, target, index = batch
        loss = self.per_sample_loss(model, (context, future, target)).detach().float()
        levels = _with_median(self.eval_cfg.quantile_levels)
        tasks = [Task(c.float().cpu(), f.float().cpu(), self.n_targets) for c, f in zip(context, future)]
        quantiles, means = self.model.predict_quantiles(tasks, future.shape[-1], levels, batch_size=max(1, len(tasks) * context.shape[1]),
                                                        context_length=context.shape[-1])
        return {"quantiles": torch.stack(quantiles), "mean": torch.stack(means), "index": index.cpu(), "loss": loss.cpu()}

    def metrics(self, outputs):
        order = outputs["index"].long().argsort()
        index = outputs["index"][order].tolist()
        quantiles, mean = outputs["quantiles"][order].numpy(), outputs["mean"][order].numpy()  # (N, n_t, H, Q)
        levels, have = self.eval_cfg.quantile_levels, _with_median(self.eval_cfg.quantile_levels)
        nt = self.n_targets
        keys = [i * nt + j for i in index for j in range(nt)]
        flat_q, flat_m = quantiles.reshape(len(keys), *quantiles.shape[2:]), mean.reshape(len(keys), -1)
        chosen = flat_q[..., [have.index(float(q)) for q in levels]]
        self.forecasts.update({k: {"quantiles": q, "mean": m} for k, q, m in zip(keys, chosen, flat_m)})
        scores = forecast_scores([self.windows[k] for k in keys], None, have, quantiles=flat_q,
                                 baselines=self.eval_cfg.baselines, context_length=self.context_length)
        scores["loss"] = float(outputs["loss"].mean())
        return scores


def build_recipe(cfg: Config, model, task: TaskData) -> Chronos2Recipe:
    return Chronos2Recipe(model, task.train, task.val, windows=task.extras["windows"],
                          n_targets=task.extras["n_targets"], eval_cfg=cfg.eval,
                          context_length=task.info.get("context_length"))


# --------------------------------------------------------------------------- protocols


zero_shot = zero_shot_protocol(build_recipe)  # the wavetoken family's protocol, on this family's recipe


def _record(item_id, start, freq, history, quantiles, mean, levels, target=None) -> dict[str, Any]:
    """A fan-chart record (:func:`~domainfm.experiment.pictures.fan_figure`) of one forecast."""
    history = np.asarray(history, dtype=np.float64)
    index = pd.date_range(start, periods=len(history) + len(mean), freq=freq)
    return {"item_id": str(item_id), "history": history, "history_index": index[:len(history)],
            "future_index": index[len(history):], "quantiles": np.asarray(quantiles), "mean": np.asarray(mean),
            "levels": [float(q) for q in levels], "target": None if target is None else np.asarray(target)}


def write_forecasts(ctx: ArmContext) -> dict[str, Any]:
    """``<arm>/forecasts.csv``: the scored test forecasts (mean = median, quantiles) next to the
    targets; ``<arm>/forecast_fan.png``: their fan chart (first six), listed in the report's pictures."""
    test = ctx.task.test
    if test is None:
        return {}
    levels, nt = ctx.cfg.eval.quantile_levels, test.table.n_targets
    frames, records = [], []
    for k, w in enumerate(test.windows()):
        f = ctx.recipe.forecasts[test.offset * nt + k]
        record = _record(w["item_id"], w["start"], w["freq"], w["context"], f["quantiles"], f["mean"], levels, w["future"])
        row = {"item_id": w["item_id"], "target_name": w["target_name"], "timestamp": record["future_index"],
               "target": w["future"], "mean": f["mean"]}
        row.update({str(q): f["quantiles"][:, j] for j, q in enumerate(levels)})
        frames.append(pd.DataFrame(row))
        records.append({**record, "item_id": f"{w['item_id']}" + (f" / {w['target_name']}" if nt > 1 else "")})
    path = ctx.run_dir / "forecasts.csv"
    atomic_write_text(path, pd.concat(frames).to_csv(index=False))
    picture = fan_chart(ctx.run_dir / "forecast_fan.png", records,
                        title=f"{ctx.arm}: test forecasts with covariates ({ctx.cfg.model.name})")
    return {"forecasts": str(path), "pictures": {"forecast_fan": str(picture.relative_to(ctx.run_root))}}


# --------------------------------------------------------------------------- retained capability


def retained_items(cfg: Config) -> tuple[str | None, list[str]]:
    """``(path, items)`` of the retained capability (see :class:`RetainedSection`)."""
    r, d = cfg.retained, cfg.data
    path = r.path if r.path is not None else d.path
    if r.items is not None:
        return path, list(r.items)
    if r.path is not None:
        return path, list(read_table(path, d).items)
    every = read_table(path, d).items
    left = [i for i in every if d.items is not None and i not in d.items]
    if not left:
        raise TimeSeriesError(f"retained: every item of {path or SHIPPED} is in the task (data.items); give "
                              "retained.path / retained.items, or retained.enabled=false")
    return path, left


def retained_forecasting(ctx: ArmContext) -> dict[str, Any]:
    """Zero-shot scores of ``ctx.model`` on the last ``data.prediction_length`` steps of items
    outside the task, with the same covariates."""
    cfg = ctx.cfg
    if not cfg.retained.enabled:
        return {"wql_rel": float("nan"), "mase_rel": float("nan")}
    path, items = retained_items(cfg)
    table = read_table(path, cfg.data, items)
    h = cfg.data.prediction_length
    windows = TaskWindows(table, [(i, r.shape[1]) for i, r in enumerate(table.rows)], h, _context_length(cfg, table))
    recipe = Chronos2Recipe(ctx.model, None, None, windows=windows.windows(), n_targets=table.n_targets,
                            eval_cfg=cfg.eval, context_length=windows.context_length)
    trainer = Trainer(dataclasses.replace(cfg.train, progress=False), run_dir=None)
    scores = trainer.evaluate(recipe, windows, model=ctx.model)
    return {**relative_scores(scores), "n_series": len(table.items) * table.n_targets}


FAMILY = Family(
    name="chronos2",
    config=Config,
    data=build_task,
    recipe=build_recipe,
    protocols_before=[zero_shot],
    protocols=[write_forecasts],
    head="quantile_head",
    selection=lambda cfg, task: ("wql_rel", "min"),
    retained=Retained(retained_forecasting, metric="wql_rel", direction="min",
                      description="zero-shot WQL (and MASE) relative to seasonal naive, with the same covariates, on "
                                  "items outside the fine-tuning task (retained.items / retained.path)"),
    baselines=report_baselines,
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# --------------------------------------------------------------------------- predict (reached through wavetoken)


@dataclass
class PredictSettings:
    """How a Chronos-2 model forecasts in ``domainfm predict wavetoken``: a run's quantile levels,
    horizon and columns (None: the options' or the model's own)."""

    quantile_levels: list[float] | None = None
    prediction_length: int | None = None
    data: DataSection | None = None


def predict_settings(ref: apply.ModelRef, model) -> PredictSettings:
    cfg = ref.run_config(Config) if ref.run is not None or ref.model_dir is not None else None
    if cfg is None:
        return PredictSettings()
    return PredictSettings(list(cfg.eval.quantile_levels), cfg.data.prediction_length, cfg.data)


def _frame(path: Path, label: str):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({label})")
    return pd.read_parquet(path) if path.suffix.lower() == ".parquet" else pd.read_csv(path)


def read_for_predict(source, settings: PredictSettings, options) -> dict[str, Any]:
    """The input table and the known-future covariates' table (``--future-covariates``) as
    DataFrames, checked for the columns they must have (one-line errors naming file and column)."""
    o = options
    d = settings.data
    item_id = d.id_column if d is not None and o.item_id == "item_id" else o.item_id
    timestamp = d.timestamp_column if d is not None and o.timestamp == "timestamp" else o.timestamp
    targets = _targets(d) if d is not None and o.target == "target" else [t.strip() for t in o.target.split(",") if t.strip()]
    if isinstance(source, pd.DataFrame):
        name, df = "series", source
    else:
        name, df = Path(source).name, _frame(Path(source), "--input")
    future = None
    if getattr(o, "future_covariates", None):
        future = _frame(Path(o.future_covariates), "--future-covariates")
    for label, frame, where in (("--input", df, source), ("--future-covariates", future, getattr(o, "future_covariates", None))):
        if frame is None:
            continue
        needed = [item_id, timestamp] + (targets if label == "--input" else [])
        for column in needed:
            if column not in frame.columns:
                raise TimeSeriesError(f"{where if isinstance(where, (str, Path)) else label}: no column {column!r} "
                                      f"({label}); its columns: {list(frame.columns)}")
    if future is not None:
        unknown = [c for c in future.columns if c not in (item_id, timestamp) and c not in df.columns]
        if unknown:
            raise TimeSeriesError(f"{o.future_covariates}: column(s) {unknown} are not in {name}: a known-future "
                                  "covariate needs its past values in --input as well")
    return {"name": name, "df": df, "future_df": future, "id_column": item_id, "timestamp_column": timestamp,
            "target": targets}


def predict_output(data: dict[str, Any], model, settings: PredictSettings, options, run: apply.Runtime) -> apply.Output:
    """``model.predict_df`` of the input (covariates: every other column; known-future: those of
    ``--future-covariates``) and a fan chart of the first six (item, target) forecasts."""
    from domainfm.precision import autocast

    o = options
    levels = [float(q) for q in (o.quantiles or settings.quantile_levels or EvalSection().quantile_levels)]
    horizon = int(o.prediction_length or settings.prediction_length or model.prediction_length)
    target = data["target"][0] if len(data["target"]) == 1 else data["target"]
    with torch.no_grad(), autocast(run.precision, run.device):
        frame = model.predict_df(data["df"], data["future_df"], id_column=data["id_column"],
                                 timestamp_column=data["timestamp_column"], target=target, prediction_length=horizon,
                                 quantile_levels=levels, freq=o.freq, batch_size=run.batch_size)
    extras = {}
    if run.output is not None and not o.no_plot:
        extras["plot"] = fan_figure(_predict_records(data, frame, levels, horizon),
                                    title=f"{getattr(model, 'domainfm_name', type(model).__name__)}: forecasts of {data['name']}")
    n = frame[[data["id_column"], "target_name"]].drop_duplicates().shape[0]
    return apply.Output(frame, extras, f"{len(frame)} rows for {n} series")


def _predict_records(data, frame: pd.DataFrame, levels, horizon: int, limit: int = 6) -> list[dict[str, Any]]:
    idc, tsc = data["id_column"], data["timestamp_column"]
    df = data["df"].assign(**{tsc: pd.to_datetime(data["df"][tsc])})
    records = []
    for start in range(0, len(frame), horizon):
        block = frame.iloc[start:start + horizon]
        item, name = block[idc].iloc[0], block["target_name"].iloc[0]
        history = df[df[idc] == item].sort_values(tsc)
        stamps = pd.DatetimeIndex(block[tsc])
        records.append({"item_id": f"{item} / {name}" if len(data["target"]) > 1 else str(item),
                        "history": history[name].to_numpy(np.float64), "history_index": pd.DatetimeIndex(history[tsc]),
                        "future_index": stamps, "quantiles": block[[str(q) for q in levels]].to_numpy(np.float64),
                        "mean": block["predictions"].to_numpy(np.float64), "levels": levels, "target": None})
        if len(records) == limit:
            break
    return records


def _applier() -> apply.Applier:
    from domainfm.finetune import wavetoken

    # wavetoken's declaration (its predict dispatches a Chronos-2 model to predict_output above), so
    # that `domainfm predict chronos2 --model RUN` and `domainfm.predict(RUN, ...)` on a chronos2 run
    # folder work too; Chronos-2 has no embed command here
    return dataclasses.replace(
        wavetoken.APPLY, family="chronos2", embed=None,
        input="series in long format (CSV/Parquet: item_id, timestamp, target(s), covariates)",
        predict=dataclasses.replace(wavetoken.APPLY.predict, default_model="chronos-2-test"))


APPLY = _applier()
