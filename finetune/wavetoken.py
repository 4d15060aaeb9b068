"""Fine-tune and evaluate WaveToken / Chronos forecasters on the experiment layer; predict and embed.

The embedded default (``configs/wavetoken/finetune.yaml``, offline, a few minutes on a CPU): an
in-process KernelSynth/TSMixup pretraining stage of the test-sized model, then two arms
(``pretrained``: the stage's model; ``random``) fine-tuned on the public-domain statsmodels
series shipped with domainfm. Validation: each series' window before the test window (selects the
best step on ``wql_rel`` unless ``train.monitor`` is set); test: each series' last
``prediction_length`` steps. Scores: MASE and WQL per dataset next to seasonal naive and their
geometric mean relative to it (the GluonTS / Chronos protocol), beside statsforecast's AutoETS and
AutoTheta (``eval.baselines``; AutoARIMA opt-in) fitted on each window's context as the model sees
it: extra columns of the report's table. ``adapt.mode``: full, lora
(attention q/v, merged before saving) or none. Each arm reports its ``zero_shot`` test scores
before adaptation and writes ``RUN/<arm>/model`` and ``RUN/<arm>/forecasts.csv``.
``model.pretrained: hf://org/repo`` loads a whole Chronos repository. Tokenizer defaults (issue
4): the paper's maximally decimated DWT, FDRC thresholding (its Algorithm 1), 1024 tokens and
coarse-to-fine order; Biorthogonal-2.2, one level, periodization, z-score scaling and no
thresholding are our reading, each a setting in ``model.kwargs.tokenizer_kwargs``.

**Two kinds of forecaster, one path.** Token models (WaveToken, Chronos-T5) sample paths and are
fine-tuned on the cross-entropy of the horizon's tokens; quantile forecasters (Chronos-Bolt,
:func:`is_quantile_forecaster`) output quantiles and are fine-tuned on the quantile loss; recipes,
scores, protocols and predict/embed dispatch on the kind. Both recipes' ``per_sample_loss(model,
batch) -> (B,)`` has the step's loss as its mean. **Retained capability** (forgetting,
:class:`RetainedSection`): zero-shot ``wql_rel`` on series the fine-tuning task never sees.

**predict / embed**: :data:`APPLY` on the shared apply layer (``domainfm predict|embed wavetoken``;
Python :func:`predict`, :func:`embed`, ``domainfm.predict|embed``); the input is read one series
at a time (a CSV in chunks of rows), the output written when every series is done.

**Precision** (``--precision auto``: bf16 autocast where the device multiplies bf16 natively, else
fp32). Only the network runs in bf16: the tokenizer stays fp32 (:func:`fp32_tokenizer`). A
sampling model may then pick a neighbouring token at a few steps, so some sample paths move while
the scores barely do; :data:`BF16_TOLERANCE` is the bound the tests enforce; the measured figures
are in ``benchmarks/README.md`` ("WaveToken / Chronos: bf16 vs fp32"); ``32-true`` gives fp32.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from domainfm import zoo
from domainfm.atomic import atomic_write_text
from domainfm.data_loaders import timeseries as T
from domainfm.data_loaders.timeseries import HeldOutWindows
from domainfm.engine import Recipe, Trainer
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment import apply
from domainfm.experiment.forecast_baselines import DEFAULT_BASELINES, baseline_columns, check_baselines, describe_baselines
from domainfm.experiment.forecast_metrics import forecast_scores, sample_quantiles
from domainfm.experiment.inference import quantile_levels
from domainfm.experiment.pictures import fan_chart, fan_figure
from domainfm.lora.settings import LoraSettings
from domainfm.pretrain.wavetoken import ForecastRecipe

__all__ = ["Config", "DataSection", "EvalSection", "RetainedSection", "FAMILY", "ForecastEvalRecipe",
           "QuantileForecastRecipe", "HeldOutWindows", "build_task", "build_recipe", "is_quantile_forecaster",
           "model_forecast", "retained_windows", "fan_figure", "fan_chart", "run", "evaluate", "predict", "embed",
           "pooled_embedding", "ApplyOptions", "ForecastSettings", "APPLY", "BF16_TOLERANCE", "relative_scores",
           "report_baselines"]


@dataclass
class DataSection:
    """Series in long format (``path``: CSV/Parquet; null: the shipped statsmodels sample)."""

    path: str | None = None
    item_id: str = "item_id"
    timestamp: str = "timestamp"
    target: str = "target"
    dataset_column: str = "dataset"
    freq: str | None = None
    prediction_length: int = 12
    windows_per_epoch: int = 2048
    missing_prob: float = 0.1
    min_past: int = 16
    #: fixed training windows (window i is the same draw at every read, seeded by train.seed)
    #: instead of fresh random windows; always on with ``adapt.sample_weighting: flow``, whose
    #: per-window weights are computed once over the dataset
    fixed_windows: bool = False


@dataclass
class EvalSection:
    num_samples: int = 20
    quantile_levels: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    #: statistical baselines scored beside the model on the same contexts (forecast_baselines.BASELINES:
    #: auto_ets, auto_theta, auto_arima; AutoARIMA is slow on long seasons); seasonal naive is always scored
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))


@dataclass
class RetainedSection:
    """The retained capability's data: zero-shot forecasts of series outside the fine-tuning task.

    ``path: null`` draws ``series`` KernelSynth series of ``length`` steps with ``seed`` (their own
    generator: disjoint from the pretraining draws, which use seeds 0 and 10000 and up), scored
    as daily data (season 1: the baseline is the last value); a ``path`` (long-format CSV/Parquet)
    scores its series instead. ``prediction_length`` defaults to ``data.prediction_length``."""

    enabled: bool = True
    series: int = 24
    length: int = 192
    seed: int = 7_770_001
    path: str | None = None
    prediction_length: int | None = None


@dataclass
class Config(ExperimentConfig):
    model: ModelSection = field(default_factory=lambda: ModelSection(name="wavetoken-test"))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(lora=LoraSettings(targets=["*attn.q", "*attn.v"])))
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    retained: RetainedSection = field(default_factory=RetainedSection)


#: bf16 autocast vs fp32 on the shipped series, the bounds the tests enforce: the relative difference
#: of the scores (|wql_rel_bf16 / wql_rel_fp32 - 1|, the same for mase_rel; measured up to 1.3%) and the
#: largest difference of the deterministic outputs (token logits, Bolt's quantiles) relative to their
#: largest magnitude (measured up to 0.9%; benchmarks/README.md).
BF16_TOLERANCE = {"score_rel": 0.05, "logits_rel": 0.03}


# --------------------------------------------------------------------------- forecasting, both kinds


def is_quantile_forecaster(model) -> bool:
    """Whether ``model`` outputs quantiles directly (Chronos-Bolt) rather than sample paths."""
    return bool(getattr(getattr(model, "module", model), "is_quantile_forecaster", False))


_TOKENIZER_METHODS = ("prepare_context", "encode_context", "encode_labels", "decode")


def _fp32(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def fp32_tokenizer(model):
    """Run a token model's tokenizer (scaling, the wavelet transform, binning, decoding) in fp32
    under any autocast: only the network runs in bf16. Under bf16 autocast the wavelet transform
    (a conv1d) would run in bf16 and move about 70% of the shipped series' context tokens to a
    neighbouring bin (measured), and decoding would round the forecasts to bf16. A workaround in
    this module until ``TokenForecaster`` does it itself; a no-op for models without a tokenizer."""
    tokenizer = getattr(getattr(model, "module", model), "tokenizer", None)
    if tokenizer is None or getattr(tokenizer, "_domainfm_fp32", False):
        yield model
        return
    patched = [name for name in _TOKENIZER_METHODS if hasattr(tokenizer, name)]
    for name in patched:
        object.__setattr__(tokenizer, name, _fp32(getattr(tokenizer, name)))
    object.__setattr__(tokenizer, "_domainfm_fp32", True)
    try:
        yield model
    finally:
        for name in [*patched, "_domainfm_fp32"]:
            tokenizer.__dict__.pop(name, None)


def _with_median(levels) -> list[float]:
    """``levels`` plus 0.5 (MASE scores the median) when it is missing, sorted."""
    levels = [float(q) for q in levels]
    return sorted(set(levels) | {0.5}) if not any(abs(q - 0.5) < 1e-9 for q in levels) else levels


def _batches(items, size: int):
    """``items`` (any iterable, read lazily) in lists of ``size``."""
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


@torch.no_grad()
def model_forecast(model, context: torch.Tensor, prediction_length: int, eval_cfg: EvalSection,
                   quantile_levels=None) -> dict[str, np.ndarray]:
    """One batch of forecasts: ``{"samples": (B, S, H)}`` from a sampling model (``eval_cfg``'s
    sampling settings), or ``{"quantiles": (B, H, Q) at quantile_levels, "mean": (B, H)}`` from a
    quantile forecaster. ``context`` is (B, T), NaN-padded on the left."""
    if is_quantile_forecaster(model):
        levels = list(quantile_levels if quantile_levels is not None else eval_cfg.quantile_levels)
        quantiles, mean = model.predict_quantiles(context, prediction_length, quantile_levels=levels)
        return {"quantiles": quantiles.float().cpu().numpy(), "mean": mean.float().cpu().numpy()}
    c = eval_cfg
    with fp32_tokenizer(model):
        samples = model.predict(context, prediction_length, num_samples=c.num_samples, seed=c.seed,
                                temperature=c.temperature, top_k=c.top_k, top_p=c.top_p)
    return {"samples": samples.float().cpu().numpy()}


def _quantiles_of(forecast: dict[str, np.ndarray], levels) -> tuple[np.ndarray, np.ndarray]:
    """(B, H, Q) quantiles at ``levels`` (of samples: GluonTS's rule) and (B, H) mean of a model_forecast result."""
    if "samples" in forecast:
        return sample_quantiles(forecast["samples"], levels), forecast["samples"].mean(1)
    return forecast["quantiles"], forecast["mean"]


def _scores(windows, forecast: dict[str, np.ndarray], levels, baselines=(), context_length=None) -> dict[str, float]:
    """:func:`forecast_scores` of a model_forecast result, with ``baselines`` fitted on the last
    ``context_length`` values of each context (what the model sees)."""
    extra = {"baselines": baselines, "context_length": context_length}
    if "samples" in forecast:
        return forecast_scores(windows, forecast["samples"], levels, **extra)
    return forecast_scores(windows, None, _with_median(levels), quantiles=forecast["quantiles"], **extra)


def relative_scores(scores: dict[str, float]) -> dict[str, float]:
    """The geometric means relative to seasonal naive of ``scores``: the model's ``mase_rel`` and
    ``wql_rel``, each baseline's ``<b>_mase_rel`` / ``<b>_wql_rel`` and its ``<b>_fallback_windows``."""
    return {k: v for k, v in scores.items()
            if k in ("mase_rel", "wql_rel") or "." not in k and k.endswith(("_mase_rel", "_wql_rel", "_fallback_windows"))}


def report_baselines(cfg, task=None) -> dict[str, Any]:
    """``report["baselines"]`` of a forecasting family: the table's baseline columns and how they were fitted."""
    names = check_baselines(cfg.eval.baselines, "eval.baselines")
    return {"columns": baseline_columns(names), "description": describe_baselines(names)}


# --------------------------------------------------------------------------- data + recipes


def build_task(cfg: Config) -> TaskData:
    """Train: random windows of each series before its validation window (``ForecastWindows``);
    val: the window before the test window; test: each series' last ``prediction_length`` steps."""
    d = cfg.data
    if d.path is None:
        series, source = T.load_sample(), "shipped statsmodels sample (public domain)"
    else:
        series, source = T.read_long(d.path, item_id=d.item_id, timestamp=d.timestamp, target=d.target, freq=d.freq,
                                     dataset=d.dataset_column), d.path
    train_series, test = T.split_by_time(series, d.prediction_length, min_context=2)
    fit_series, val = T.split_by_time(train_series, d.prediction_length, min_context=2)
    # the recipe sets the model's own context length (an hf:// Chronos config may change it)
    context_length = cfg.model.kwargs.get("context_length", zoo.get_card(cfg.model.name).defaults["context_length"])
    fixed = d.fixed_windows or getattr(cfg.adapt, "sample_weighting", "none") == "flow"
    train = T.ForecastWindows(fit_series, context_length, d.prediction_length, num_windows=d.windows_per_epoch,
                              min_past=d.min_past, missing_prob=d.missing_prob, seed=cfg.train.seed if fixed else None)
    val_ds, test_ds = HeldOutWindows(val), HeldOutWindows(test, offset=len(val))
    return TaskData(train, val_ds, test_ds, task="forecast", n_outputs=None,
                    labels="recorded: forecast targets are each series' own held-out values",
                    info={"source": source, "n_series": len(series), "prediction_length": d.prediction_length},
                    extras={"windows": val + test})


def _fit_context(context: torch.Tensor, length: int) -> torch.Tensor:
    if context.shape[-1] >= length:
        return context[..., -length:]
    return torch.nn.functional.pad(context, (length - context.shape[-1], 0), value=float("nan"))


class _EvalMixin:
    """Evaluation shared by both recipes: forecasts of held-out windows scored with
    :func:`forecast_scores`; ``forecasts`` keeps the latest forecast of every window scored
    (``{index: {"quantiles": (H, Q) at eval.quantile_levels, "mean": (H,)}}``) for
    ``forecasts.csv`` and the fan chart."""

    def _init_eval(self, windows, eval_cfg: EvalSection):
        self.windows, self.eval_cfg, self.forecasts = windows, eval_cfg, {}

    def eval_step(self, model, batch):
        context, future, index = batch
        context = _fit_context(context, self.model.context_length)
        loss = self.per_sample_loss(model, (context, future)).detach().float()
        levels = _with_median(self.eval_cfg.quantile_levels)
        out = model_forecast(self.model, context, future.shape[-1], self.eval_cfg, levels)
        return {**{k: torch.from_numpy(v) for k, v in out.items()}, "index": index, "loss": loss}

    def metrics(self, outputs):
        order = outputs["index"].long().argsort()
        index = outputs["index"][order].tolist()
        forecast = {k: outputs[k][order].numpy() for k in ("samples", "quantiles", "mean") if k in outputs}
        levels = self.eval_cfg.quantile_levels
        if "samples" in forecast:
            quantiles, mean = _quantiles_of(forecast, levels)
        else:
            have = _with_median(levels)
            quantiles = forecast["quantiles"][..., [have.index(float(q)) for q in levels]]
            mean = forecast["mean"]
        self.forecasts.update({i: {"quantiles": q, "mean": m} for i, q, m in zip(index, quantiles, mean)})
        scores = _scores([self.windows[i] for i in index], forecast, levels, self.eval_cfg.baselines,
                         self.model.context_length)
        scores["loss"] = float(outputs["loss"].mean())
        return scores


class ForecastEvalRecipe(_EvalMixin, ForecastRecipe):
    """Token models (WaveToken, Chronos-T5). Training: the cross-entropy of the future's tokens
    under teacher forcing, each series' mean over its labelled tokens, averaged over the batch
    (:meth:`per_sample_loss`); evaluation samples forecasts of held-out windows and scores them
    (plus that loss)."""

    def __init__(self, model, train_dataset, val_dataset, *, windows, eval_cfg: EvalSection):
        super().__init__(model, train_dataset, val_dataset)
        self._init_eval(windows, eval_cfg)

    def _per_sample(self, model, batch):
        context, future = batch[0], batch[1]
        with fp32_tokenizer(self.model):  # tokens as in fp32 whatever the training precision
            ids, mask, labels = self.model.training_tokens(context, future)
        logits = model(ids, mask, self.model.shift_right(labels))
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")
        valid = labels != -100
        per_sample = ce.sum(1) / valid.sum(1).clamp(min=1)
        correct = ((logits.argmax(-1) == labels) & valid).sum()
        return per_sample, correct, valid.sum()

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """(B,) each series' mean token cross-entropy; ``step``'s loss is their mean."""
        return self._per_sample(model, batch)[0]

    def step(self, model, batch):
        per_sample, correct, total = self._per_sample(model, batch)
        loss = per_sample.mean()
        return loss, {"loss": loss.detach(), "token_accuracy": (correct / total.clamp(min=1)).detach()}


class QuantileForecastRecipe(_EvalMixin, Recipe):
    """Quantile forecasters (Chronos-Bolt). Training: the model's quantile loss of the future
    given the context (missing future values masked out), one value per series
    (``model.per_sample_loss``), averaged over the batch; evaluation scores the model's quantiles
    directly (no sampling)."""

    def __init__(self, model, train_dataset, val_dataset, *, windows, eval_cfg: EvalSection):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self._init_eval(windows, eval_cfg)

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        """(B,) the quantile loss of each series; ``step``'s loss is their mean."""
        context, future = batch[0], batch[1]
        context = _fit_context(context.float(), self.model.context_length)
        mask = torch.isfinite(future)
        return model.per_sample_loss(context, torch.nan_to_num(future.float()), mask)

    def step(self, model, batch):
        loss = self.per_sample_loss(model, batch).mean()
        return loss, {"loss": loss.detach()}


def build_recipe(cfg: Config, model, task: TaskData):
    train = copy.copy(task.train)
    if train is not None:
        train.context_length = model.context_length
    kind = QuantileForecastRecipe if is_quantile_forecaster(model) else ForecastEvalRecipe
    return kind(model, train, task.val, windows=task.extras["windows"], eval_cfg=cfg.eval)


# --------------------------------------------------------------------------- protocols


def zero_shot_protocol(recipe_for):
    """The protocol that scores the arm's model on the test windows before adaptation, through
    ``recipe_for(cfg, model, task)`` (a forecasting family's recipe builder)."""

    def zero_shot(ctx: ArmContext) -> dict[str, Any]:
        """Test scores of the arm's model before adaptation (with ``adapt.mode: none`` they are the
        arm's test scores already)."""
        if ctx.mode == "none" or ctx.task.test is None:
            return {}
        trainer = Trainer(dataclasses.replace(ctx.cfg.train, progress=False), run_dir=None)
        scores = trainer.evaluate(recipe_for(ctx.cfg, ctx.model, ctx.task), ctx.task.test, model=ctx.model)
        return {"zero_shot": {"test": relative_scores(scores)}}

    return zero_shot


zero_shot = zero_shot_protocol(build_recipe)


def _window_record(w: dict[str, Any], quantiles: np.ndarray, mean: np.ndarray, levels) -> dict[str, Any]:
    history = np.asarray(w["context"] if "context" in w else w["target"], dtype=np.float64)
    h = quantiles.shape[0]
    base = {"start": w["start"], "freq": w["freq"], "target": history}
    return {"item_id": str(w["item_id"]), "history": history,
            "history_index": pd.date_range(w["start"], periods=len(history), freq=w["freq"]),
            "future_index": T.future_index(base, h), "quantiles": np.asarray(quantiles), "mean": np.asarray(mean),
            "levels": [float(q) for q in levels], "target": np.asarray(w["future"]) if "future" in w else None}


def write_forecasts(ctx: ArmContext) -> dict[str, Any]:
    """``<arm>/forecasts.csv``: the scored test forecasts' mean and quantiles next to the targets;
    ``<arm>/forecast_fan.png``: their fan chart (first six series), listed in the report's pictures."""
    test = ctx.task.test
    if test is None:
        return {}
    levels = ctx.cfg.eval.quantile_levels
    frames, records = [], []
    for i, w in enumerate(test.windows):
        f = ctx.recipe.forecasts[test.offset + i]
        record = _window_record(w, f["quantiles"], f["mean"], levels)
        row = {"dataset": w.get("dataset", ""), "item_id": w["item_id"], "timestamp": record["future_index"],
               "target": w["future"], "mean": f["mean"]}
        row.update({str(q): f["quantiles"][:, j] for j, q in enumerate(levels)})
        frames.append(pd.DataFrame(row))
        records.append(record)
    path = ctx.run_dir / "forecasts.csv"
    atomic_write_text(path, pd.concat(frames).to_csv(index=False))
    picture = fan_chart(ctx.run_dir / "forecast_fan.png", records,
                        title=f"{ctx.arm}: test forecasts ({getattr(ctx.model, 'domainfm_name', ctx.cfg.model.name)})")
    return {"forecasts": str(path), "pictures": {"forecast_fan": str(picture.relative_to(ctx.run_root))}}


# --------------------------------------------------------------------------- retained capability


def retained_windows(cfg: Config) -> list[dict[str, Any]]:
    """The held-out windows of the retained capability (see :class:`RetainedSection`)."""
    r = cfg.retained
    horizon = int(r.prediction_length or cfg.data.prediction_length)
    if r.path is None:
        return list(T.kernel_synth_windows(int(r.series), int(r.length), int(r.seed), horizon))
    series = T.read_long(r.path, item_id=cfg.data.item_id, timestamp=cfg.data.timestamp, target=cfg.data.target,
                         freq=cfg.data.freq, dataset=cfg.data.dataset_column)
    return T.split_by_time(series, horizon, min_context=2)[1]


def retained_forecasting(ctx: ArmContext) -> dict[str, Any]:
    """Zero-shot scores of ``ctx.model`` on series outside the fine-tuning task."""
    from domainfm.precision import autocast

    cfg, model = ctx.cfg, ctx.model
    if not cfg.retained.enabled:
        return {"wql_rel": float("nan"), "mase_rel": float("nan")}
    windows = retained_windows(cfg)
    horizon, levels = len(windows[0]["future"]), _with_median(cfg.eval.quantile_levels)
    pieces = []
    with autocast(cfg.train.precision, next(model.parameters()).device):
        for batch in _batches(windows, 64):
            context = T.left_pad_batch([w["context"] for w in batch], model.context_length)
            pieces.append(model_forecast(model, context, horizon, cfg.eval, levels))
    scores = _scores(windows, {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}, levels,
                     cfg.eval.baselines, model.context_length)
    return {**relative_scores(scores), "n_series": len(windows)}


FAMILY = Family(
    name="wavetoken",
    config=Config,
    data=build_task,
    recipe=build_recipe,
    protocols_before=[zero_shot],
    protocols=[write_forecasts],
    head=(),  # token models: the output layer is tied to the embeddings: LoRA trains only adapters (+ lora.unfreeze)
    selection=lambda cfg, task: ("wql_rel", "min"),
    retained=Retained(retained_forecasting, metric="wql_rel", direction="min",
                      description="zero-shot WQL (and MASE) relative to seasonal naive on series outside the "
                                  "fine-tuning task (retained.path, or held-out KernelSynth series: the pretraining "
                                  "distribution)"),
    baselines=report_baselines,
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# --------------------------------------------------------------------------- fan chart


# --------------------------------------------------------------------------- predict / embed


DEFAULT_MODEL = "wavetoken-test"
PLOT_SERIES = 6
PREDICT_ONLY = ("predict",)


@dataclass
class ApplyOptions:
    """The options of ``domainfm predict|embed wavetoken`` (sampling and horizon: predict only)."""

    item_id: str = apply.option("item_id", "the column naming each series")
    timestamp: str = apply.option("timestamp", "the timestamp column")
    target: str = apply.option("target", "the value column (empty or NaN: missing)")
    freq: str | None = apply.option(None, "the pandas frequency of every series (default: inferred per series)")
    chunk_rows: int = apply.option(200_000, "rows read at a time from a CSV whose items are in contiguous rows")
    prediction_length: int | None = apply.option(None, "horizon (default: the run's, else the model's)",
                                                 commands=PREDICT_ONLY)
    num_samples: int | None = apply.option(None, "sample paths (default: the run's, else 20)", commands=PREDICT_ONLY)
    quantiles: list[float] | None = apply.option(None, "comma-separated levels in (0, 1) (default 0.1,...,0.9)",
                                                 type=quantile_levels, commands=PREDICT_ONLY)
    seed: int | None = apply.option(None, "sampling seed (default: the run's, else 0)", type=int, commands=PREDICT_ONLY)
    plot: str | None = apply.option(None, "fan chart PNG of the first six series (default: <output stem>.png)",
                                    output=(".png",), default_from=".png", commands=PREDICT_ONLY)
    no_plot: bool = apply.option(False, "do not draw the fan chart", commands=PREDICT_ONLY)
    future_covariates: str | None = apply.option(None, "Chronos-2: CSV/Parquet of the known-future covariates "
                                                 "(item, timestamp, covariates) over the horizon", commands=PREDICT_ONLY)


@dataclass
class ForecastSettings:
    """How predict forecasts: a run's sampling settings and horizon (None: the model's own)."""

    eval: EvalSection = field(default_factory=EvalSection)
    prediction_length: int | None = None


def _chronos2(model=None):
    """finetune/chronos2.py when ``model`` is Chronos-2 (targets + covariates: it reads, forecasts and plots)."""
    from domainfm.models.wavetoken.chronos2 import Chronos2

    return importlib.import_module("domainfm.finetune.chronos2") if isinstance(model, Chronos2) else None


def _settings(ref: apply.ModelRef, model) -> ForecastSettings:
    if _chronos2(model):
        return _chronos2(model).predict_settings(ref, model)
    cfg = ref.run_config(Config)  # a run folder (or a model inside one): its own horizon, levels and sampling
    return ForecastSettings() if cfg is None else ForecastSettings(cfg.eval, cfg.data.prediction_length)


def _read(source, settings, options: ApplyOptions | None):
    """(a name for titles, the series one at a time: read lazily, in chunks, as they are forecast)."""
    o = options or ApplyOptions()
    chronos2 = importlib.import_module("domainfm.finetune.chronos2")
    if isinstance(settings, chronos2.PredictSettings):  # a Chronos-2 model (see _settings)
        return chronos2.read_for_predict(source, settings, o)
    name = Path(source).name if isinstance(source, (str, Path)) else "series"
    return name, T.iter_series(source, item_id=o.item_id, timestamp=o.timestamp, target=o.target, freq=o.freq,
                               chunk_rows=o.chunk_rows)


def _predict(data, model, settings: ForecastSettings, options: ApplyOptions | None, run: apply.Runtime) -> apply.Output:
    o = options or ApplyOptions()
    if _chronos2(model):
        return _chronos2(model).predict_output(data, model, settings, o, run)
    name, items = data
    ev = dataclasses.replace(settings.eval, quantile_levels=o.quantiles or list(settings.eval.quantile_levels),
                             num_samples=o.num_samples or settings.eval.num_samples,
                             seed=settings.eval.seed if o.seed is None else o.seed)
    levels = [float(q) for q in ev.quantile_levels]
    horizon = int(o.prediction_length or settings.prediction_length or model.prediction_length)

    def forecast(context):  # Bolt's quantiles, or those of a token model's paths (seeded per series, not per batch)
        return tuple(map(torch.from_numpy, _quantiles_of(model_forecast(model, context, horizon, ev, levels), levels)))

    frames, records = [], []
    for batch in _batches(items, run.batch_size):
        if any("start" not in s for s in batch):
            raise T.TimeSeriesError("series: predict needs timestamps (a long-format file or DataFrame, or series "
                                    "dicts with start and freq)")
        quantiles, mean = run.batched(forecast, T.left_pad_batch([s["target"] for s in batch], model.context_length))
        for s, q, mu in zip(batch, quantiles.numpy(), mean.numpy()):
            row = {"item_id": s["item_id"], "timestamp": T.future_index(s, horizon), "mean": mu}
            frames.append(pd.DataFrame({**row, **{str(level): q[:, j] for j, level in enumerate(levels)}}))
            if len(records) < PLOT_SERIES:
                records.append(_window_record({**s, "context": s["target"]}, q, mu, levels))
    frame = pd.concat(frames, ignore_index=True)
    extras = {}
    if run.output is not None and not o.no_plot:  # the command line draws it; Python returns the table alone
        title = f"{getattr(model, 'domainfm_name', type(model).__name__)}: forecasts of {name}"
        extras["plot"] = fan_figure(records, title=title)
    return apply.Output(frame, extras, f"{len(frame)} rows for {len(frames)} series")


@torch.no_grad()
def pooled_embedding(model, context) -> torch.Tensor:
    """(B, d_model) float32: the encoder states of each series mean-pooled over its observed
    positions (the encoder's attention mask: context tokens, or Bolt's patches, that hold an
    observed value, and the final EOS / [REG] state)."""
    if is_quantile_forecaster(model):  # Chronos-Bolt: patches (observed or not) + [REG]
        states, mask, _ = model.encode(model.prepare_context(context))
    else:  # token models: context tokens + EOS
        with fp32_tokenizer(model):
            ids, mask, _ = model.tokenize(context)
        states = model.encode(ids, mask)
    m = mask.to(states.device).float().unsqueeze(-1)
    return (states.float() * m).sum(1) / m.sum(1).clamp(min=1.0)


def _embed(data, model, settings, options, run: apply.Runtime) -> apply.Output:
    ids, parts = [], []
    for batch in _batches(data[1], run.batch_size):
        parts.append(run.batched(functools.partial(pooled_embedding, model),
                                 T.left_pad_batch([s["target"] for s in batch], model.context_length)))
        ids.extend(str(s["item_id"]) for s in batch)
    emb = torch.cat(parts).numpy().astype(np.float32)
    summary = f"{emb.shape[0]} embeddings of width {emb.shape[1]}"
    if run.output is not None and run.output.suffix.lower() != ".npz":  # a table: item_id, e0 .. e{d-1}
        frame = pd.DataFrame(emb, columns=[f"e{j}" for j in range(emb.shape[1])])
        frame.insert(0, "item_id", ids)
        return apply.Output(frame, summary=summary)
    return apply.Output({"item_id": np.asarray(ids, dtype=str), "embedding": emb}, summary=summary)


APPLY = apply.Applier(
    family="wavetoken",
    input="series in long format (CSV/Parquet: item_id, timestamp, target)",
    description="The series are read one at a time (a CSV whose items are in contiguous rows: --chunk-rows rows at a "
                "time) and computed in batches.",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=64,
    predict=apply.Command(_predict, apply.TABLE, default_model=DEFAULT_MODEL,
                          what="Probabilistic forecasts of every series (item_id, timestamp, mean, <levels>) and a fan "
                               "chart of the first six; a run folder (or a model in one) forecasts with the run's "
                               "horizon, quantile levels and sampling settings unless the options say otherwise."),
    embed=apply.Command(_embed, (".npz", ".csv", ".parquet"), default_model=DEFAULT_MODEL,
                        what="Per-series encoder embeddings, mean-pooled over observed positions: .npz (item_id, "
                             "embedding) or .csv/.parquet (item_id, e0..e{d-1})."),
)


def predict(series, model: str | Path | torch.nn.Module | None = None, *, prediction_length: int | None = None,
            quantile_levels=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), num_samples: int = 20, seed: int = 0,
            arm: str | None = None, pretrained: str | None = None, precision: str = "auto", device: str = "cpu",
            batch_size: int = 64, **columns) -> Any:
    """Probabilistic forecasts of every series: a DataFrame with ``item_id, timestamp, mean`` and
    one column per quantile level (named like ``"0.1"``), ``prediction_length`` rows per series
    (default: the model's horizon). ``series``: a long-format CSV/Parquet path or DataFrame
    (``columns``: ``item_id=``, ``timestamp=``, ``target=``, ``freq=``), or a list of series dicts.
    ``model``: a registered name (default ``wavetoken-test``), a ``save_pretrained`` folder, a run
    folder (``arm``) or a module. Sampling models draw ``num_samples`` paths with ``seed`` (the same
    forecast for a series whatever its batch); quantile forecasters ignore both. Unlike
    ``domainfm.predict``, a run's own eval settings are not read: the arguments are the settings."""
    options = ApplyOptions(**columns, prediction_length=prediction_length, num_samples=num_samples,
                           quantiles=[float(q) for q in quantile_levels], seed=seed)
    return apply.run("predict", APPLY, model, series, settings=ForecastSettings(), arm=arm, pretrained=pretrained,
                     precision=precision, device=device, batch_size=batch_size, options=options).value


def embed(series, model: str | Path | torch.nn.Module | None = None, *, arm: str | None = None,
          pretrained: str | None = None, precision: str = "auto", device: str = "cpu", batch_size: int = 64,
          **columns) -> tuple[list[str], np.ndarray]:
    """Per-series embeddings: ``(item_ids, (N, d_model) float32)``, the encoder states mean-pooled
    over each series' observed positions (:func:`pooled_embedding`). ``series`` and ``model`` as
    in :func:`predict`; a (B, T) array or tensor (NaN = missing) gives ids ``"0" .. "B-1"``."""
    out = apply.run("embed", APPLY, model, series, arm=arm, pretrained=pretrained, precision=precision, device=device,
                    batch_size=batch_size, options=ApplyOptions(**columns)).value
    return out["item_id"].tolist(), out["embedding"]
