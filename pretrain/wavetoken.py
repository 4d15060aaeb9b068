"""Pretraining WaveToken / Chronos models on synthetic series: KernelSynth and TSMixup.

* The series come from :mod:`domainfm.data_loaders.synthetic_series` (KernelSynth, Chronos
  Alg. 2; TSMixup, Chronos Alg. 1; random training windows with missing values).
* The objective is the cross-entropy of the horizon's tokens under teacher forcing (labels of
  missing values ignored), on random (context, future) windows with missing-value injection.

Chronos's recipe (reproduced by ``configs/wavetoken/pretrain*.yaml`` for each size): context 512,
horizon 64, TSMixup 0.9 + KernelSynth 0.1, 200k steps, batch 32, AdamW, lr 1e-3 with linear decay,
no weight decay, drop probability 0.2, min_past 60. Chronos's TSMixup mixes its real training
corpus; in memory (``data.kind: memory``) it mixes the KernelSynth pool plus any series you list
in ``data.extra_series`` (long-format CSV/Parquet) or ``data.statsmodels``, since no corpus can
be downloaded at run time; a corpus of your own is streamed (below).

``domainfm pretrain wavetoken`` runs ``configs/wavetoken/pretrain.yaml`` (a short run of the
test-sized model); the trained model is written to ``RUN/model`` (``create_model(RUN/model)``).

**A real corpus at scale** (``data.kind: streaming``): ``domainfm prepare wavetoken --input FILES
--output DIR prediction_length=64 min_past=60`` converts series files (long-format CSV/Parquet as
:func:`domainfm.data_loaders.timeseries.read_long` reads them, or GluonTS/Hugging Face-style
``.arrow``/Parquet with one series per row) once into LitData shards of raw float32 series, one
series per sample (:data:`PREPARE`); ``domainfm pretrain wavetoken data.kind=streaming
data.path=DIR`` (or ``s3://...``) then streams them (:class:`CorpusWindows`). The shards hold the
raw values, not tokens: the tokenizer (wavelet, scaling, vocabulary) belongs to the model config
and a corpus serves every model size and tokenizer; TSMixup mixes raw series and the random
(context, future) windows are cut afresh each epoch, as in Chronos.

**Randomness** (window cropping, TSMixup draws, KernelSynth picks, missing values) is drawn in the
datasets' ``__getitem__`` from :class:`~domainfm.engine.SampleSeeds` keyed by (``train.seed``,
epoch, sample index), never from the process RNG, and the loss is the global batch's token mean:
a run on 2 ranks with batch B per rank equals one process with batch 2B (up to float rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from domainfm import streaming
from domainfm.distributed import global_batch_mean
from domainfm.data_loaders.synthetic_series import (
    KERNEL_BANK,
    KERNEL_LENGTH,
    SyntheticWindows,
    cut_window,
    fixed_windows,
    generate_kernel_synth,
    kernel_matrix,
    mix_series,
    sample_kernel_synth,
    ts_mixup,
)
from domainfm.data_loaders.timeseries import left_pad
from domainfm.engine import Recipe, SampleSeeds, TrainConfig, Trainer
from domainfm.errors import InputError
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
    "mix_series",
    "cut_window",
    "SyntheticWindows",
    "fixed_windows",
    "SeededWindows",
    "CorpusWindows",
    "PrepareSettings",
    "convert_series",
    "PREPARE",
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

    The training loss is the mean over the *global* batch's labelled tokens (Chronos's token
    mean): on ``W`` ranks each rank's token sum is divided by the token count summed over the
    ranks and multiplied by ``W`` (data parallel averages the ranks' gradients). A per-rank mean
    would weight a token by its rank's count of missing future values, so 2 ranks would not equal
    one process with their batches together.
    """

    def __init__(self, model, train_dataset, val_dataset=None):
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset

    def _token_losses(self, model, batch):
        """Summed cross-entropy of the labelled tokens, correct predictions, labelled tokens."""
        context, future = batch[0], batch[1]
        ids, mask, labels = self.model.training_tokens(context, future)
        logits = model(ids, mask, self.model.shift_right(labels))
        summed = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                 reduction="sum")
        valid = labels != -100
        correct = ((logits.argmax(-1) == labels) & valid).sum()
        return summed, correct, valid.sum()

    def _loss(self, model, batch):
        summed, correct, total = self._token_losses(model, batch)
        return summed / total.clamp(min=1), correct, total

    def step(self, model, batch):
        summed, correct, total = self._token_losses(model, batch)
        # the mean over the global batch's tokens (every rank calls step once per micro-batch, so
        # the collective inside is matched)
        loss = global_batch_mean(summed, total)
        return loss, {"loss": loss.detach(), "token_accuracy": (correct / total.clamp(min=1)).detach()}

    def eval_step(self, model, batch):
        loss, correct, total = self._loss(model, batch)
        n = batch[0].shape[0]
        return {"loss": loss.detach().float().reshape(1).expand(n), "correct": correct.reshape(1).expand(n) / n,
                "total": total.reshape(1).expand(n).float() / n}

    def metrics(self, outputs):
        return {"loss": float(outputs["loss"].mean()),
                "token_accuracy": float(outputs["correct"].sum() / outputs["total"].sum().clamp(min=1))}


# --------------------------------------------------------------------------- training windows


class SeededWindows(SyntheticWindows):
    """:class:`~domainfm.data_loaders.synthetic_series.SyntheticWindows` with every draw taken from
    ``SampleSeeds(seed)`` keyed by (epoch, index) in ``__getitem__``: the same recipe (TSMixup with
    probability ``tsmixup_prob``, else a KernelSynth series of the pool; a random end point with
    at least ``min_past`` values before the future; each context value dropped with probability
    ``U(0, missing_prob)``), but sample ``i`` of epoch ``e`` is the same window on any rank, in any
    batch and after a resume. ``set_epoch`` is called by the engine at each epoch start."""

    def __init__(self, kernel_synth, extra, *, seed: int = 0, context_crop_prob: float = 0.0, **kwargs):
        super().__init__(kernel_synth, extra, **kwargs)
        self.seeds = SampleSeeds(seed)
        self.context_crop_prob = context_crop_prob

    def set_epoch(self, epoch: int) -> None:
        self.seeds.set_epoch(epoch)

    def _kernel_synth(self, rng: np.random.Generator) -> np.ndarray:
        if not self.kernel_synth:
            raise InputError("data.kernel_synth_series=0 leaves no KernelSynth series for the windows that are not "
                             "TSMixup (data.tsmixup_prob < 1); generate some or set data.tsmixup_prob=1")
        return self.kernel_synth[int(rng.integers(len(self.kernel_synth)))]

    def _series(self, index: int, rng: np.random.Generator, sources: list[str] | None = None) -> np.ndarray:
        """Series ``index``'s draw; ``sources`` (when given) receives one ``"real"``/``"synthetic"``
        per TSMixup component, or ``"kernel_synth"`` for a plain KernelSynth series."""
        if rng.random() < self.tsmixup_prob:
            return ts_mixup(self.kernel_synth, rng, real=self.real, sources=sources, **self.tsmixup)
        if sources is not None:
            sources.append("kernel_synth")
        return self._kernel_synth(rng)

    def composition(self, n: int = 2000, epoch: int = 0) -> dict[str, float]:
        """What ``n`` draws of this sampler hold (replayed from its own seeds for samples
        ``0..n-1`` of ``epoch``, without touching the epoch it is at): the share of TSMixup windows,
        the share of windows holding at least one real series, and the share of real components
        among the TSMixup components."""
        seeds = SampleSeeds(self.seeds.seed)
        seeds.set_epoch(epoch)
        n = min(n, len(self))
        mixes = with_real = components = real = 0
        for i in range(n):
            sources: list[str] = []
            self._series(i, seeds.numpy(i), sources)
            if sources != ["kernel_synth"]:
                mixes += 1
                components += len(sources)
                real += sources.count("real")
                with_real += "real" in sources
        return {"draws": float(n), "tsmixup_share": mixes / max(n, 1), "real_draw_share": with_real / max(n, 1),
                "real_component_share": real / max(components, 1)}

    def _window(self, series: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A (context, future) window of ``series`` ending at a random point (SyntheticWindows's cut)."""
        past, future = cut_window(series, lambda low, high: rng.integers(low, high + 1), min_past=self.min_past,
                                  prediction_length=self.prediction_length)
        longest = min(len(past), self.context_length)
        if self.context_crop_prob > 0 and rng.random() < self.context_crop_prob and longest > self.min_past:
            # a history of random length (min_past to the whole context): the forecast must not
            # depend on how much history the window happened to have (issue: longer contexts
            # pulled forecasts towards the context mean)
            past = past[-int(rng.integers(self.min_past, longest + 1)):]
        context = left_pad(past, self.context_length)
        if self.missing_prob > 0:
            rate = rng.uniform(0, self.missing_prob)
            context = np.where(rng.random(self.context_length) < rate, np.float32(np.nan), context)
        return torch.from_numpy(np.ascontiguousarray(context, dtype=np.float32)), torch.from_numpy(
            np.ascontiguousarray(future, dtype=np.float32))

    def __getitem__(self, index: int):
        rng = self.seeds.numpy(index)
        return self._window(self._series(int(index), rng), rng)


class CorpusWindows(SeededWindows):
    """One training window per series of a prepared corpus per epoch (``len`` = the corpus's
    series; :attr:`blocks` its LitData chunks, so the engine's sampler reads chunk by chunk).

    Sample ``i``: with probability ``tsmixup_prob`` a TSMixup of corpus series ``i`` with 0 to
    ``max_series - 1`` partners drawn uniformly from the real series (the corpus and the
    in-memory ``extra`` series); otherwise a KernelSynth series of the in-memory pool. That is
    Chronos's mixture (TSMixup over the real corpus, KernelSynth beside it). The mix's length is
    drawn between ``min_length`` and ``min(max_length, shortest component)``: a corpus read lazily
    cannot be filtered by length beforehand, as :func:`ts_mixup` filters its in-memory pool.

    Partners are read by index anywhere in the corpus (Chronos mixes across datasets): cheap on
    local disk; from object storage a partner outside LitData's chunk cache costs a chunk download.
    """

    def __init__(self, corpus, kernel_synth, extra, *, seed: int = 0, **kwargs):
        kwargs["num_windows"] = len(corpus)
        super().__init__(kernel_synth, extra, seed=seed, **kwargs)
        self.corpus = corpus
        self.extra = [np.asarray(s, dtype=np.float32) for s in extra]

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return self.corpus.blocks

    def _corpus_series(self, index: int) -> np.ndarray:
        return np.asarray(self.corpus[index]["target"], dtype=np.float32)

    def _partner(self, rng: np.random.Generator) -> np.ndarray:
        j = int(rng.integers(len(self.corpus) + len(self.extra)))
        return self._corpus_series(j) if j < len(self.corpus) else self.extra[j - len(self.corpus)]

    def _series(self, index: int, rng: np.random.Generator, sources: list[str] | None = None) -> np.ndarray:
        if rng.random() >= self.tsmixup_prob:
            if sources is not None:
                sources.append("kernel_synth")
            return self._kernel_synth(rng)
        mix = self.tsmixup
        k = int(rng.integers(1, mix.get("max_series", 3) + 1))
        parts = [self._corpus_series(index)] + [self._partner(rng) for _ in range(k - 1)]
        if sources is not None:
            sources.extend(["real"] * k)
        return mix_series(parts, rng, alpha=mix.get("alpha", 1.5), min_length=mix["min_length"],
                          max_length=mix.get("max_length", 2048))


# --------------------------------------------------------------------------- corpus preparation


@dataclass
class PrepareSettings:
    """What ``domainfm prepare wavetoken`` keeps: each series whole, as raw float32 values (NaN =
    missing) with its item id, if it has at least ``min_past + prediction_length`` values and at
    most ``max_missing_prop`` of them missing (Chronos's training filter). ``prediction_length``
    and ``min_past`` must then equal the model's horizon and ``data.min_past`` of the pretraining.
    ``item_id``/``timestamp``/``target``/``freq``: the columns of a long-format file (``item_id``
    null: one series per file); ``target`` (and ``item_id`` when present) also names the columns of
    a file with one series per row. No context length: windows are cut at training time, so one
    corpus serves any context length."""

    prediction_length: int = 64
    min_past: int = 60
    max_missing_prop: float = 0.9
    item_id: str | None = "item_id"
    timestamp: str = "timestamp"
    target: str = "target"
    freq: str | None = None

    def __post_init__(self):
        if self.prediction_length < 1 or self.min_past < 1:
            raise InputError(f"prediction_length={self.prediction_length}, min_past={self.min_past}: must be >= 1")
        if not 0 <= self.max_missing_prop <= 1:
            raise InputError(f"max_missing_prop={self.max_missing_prop}: expected a fraction in [0, 1]")


_ARROW = (".arrow", ".feather", ".ipc")
_PARQUET = (".parquet", ".pq")


def _rows_table(path: Path, target: str):
    """The file as a pyarrow table when it holds one series per row (an Arrow IPC file as GluonTS
    and Hugging Face datasets write them, or a Parquet file whose ``target`` column is a list);
    None for a long-format file."""
    import pyarrow as pa

    suffix = path.suffix.lower()
    if suffix in _ARROW:
        try:
            return pa.ipc.open_file(path).read_all()
        except pa.ArrowInvalid:  # the streaming format (Hugging Face datasets' cache files)
            with pa.OSFile(str(path), "rb") as fh:
                return pa.ipc.open_stream(fh).read_all()
    if suffix in _PARQUET:
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        if target in schema.names and _is_list(schema.field(target).type):
            return pq.read_table(path)
    return None


def _is_list(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _series_of(settings: PrepareSettings, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    from domainfm.data_loaders.timeseries import TimeSeriesError, iter_long

    table = _rows_table(path, settings.target)
    if table is None:
        for s in iter_long(path, item_id=settings.item_id, timestamp=settings.timestamp, target=settings.target,
                           freq=settings.freq):
            yield s["item_id"], np.asarray(s["target"], dtype=np.float64)
        return
    if settings.target not in table.column_names:
        raise TimeSeriesError(f"{path}: no column {settings.target!r} (columns {table.column_names}); set target=")
    ids = table.column(settings.item_id).to_pylist() if settings.item_id in table.column_names else None
    for row, values in enumerate(table.column(settings.target).to_pylist()):
        item = str(ids[row]) if ids is not None else f"{path.stem}/{row}"
        target = np.asarray([np.nan if v is None else v for v in (values or [])], dtype=np.float64)
        if target.ndim != 1:
            raise TimeSeriesError(f"{path}: item {item!r}: column {settings.target!r} holds shape {target.shape}; "
                                  "expected one univariate series per row")
        if np.isinf(target).any():
            raise TimeSeriesError(f"{path}: item {item!r}: column {settings.target!r} contains infinite values")
        yield item, target


def convert_series(settings: PrepareSettings, path: str) -> Iterator[dict[str, Any]]:
    """The samples of one series file: ``{"item_id": str, "target": float32 (T,)}`` per series
    kept by ``settings`` (see :class:`PrepareSettings`)."""
    need = settings.min_past + settings.prediction_length
    for item, target in _series_of(settings, Path(path)):
        if len(target) < need or (np.isnan(target).mean() if len(target) else 1.0) > settings.max_missing_prop:
            continue
        yield {"item_id": item, "target": target.astype(np.float32)}


#: ``domainfm prepare wavetoken``: series files into a corpus of raw series (see PrepareSettings)
PREPARE = streaming.Preparation(
    convert=convert_series, settings=PrepareSettings, suffixes=(".csv", ".parquet", ".pq", ".arrow"),
    what="series files (long-format CSV/Parquet, or one series per row in .arrow/Parquet) as raw float32 "
         "series, one per sample")


# --------------------------------------------------------------------------- config + entry


#: where the real series come from: ``memory`` (data.extra_series / data.statsmodels, read whole)
#: or ``streaming`` (a corpus written by ``domainfm prepare wavetoken``, at data.path)
DATA_KINDS = ("memory", "streaming")


@dataclass
class DataSection:
    """The pretraining series. ``kind: memory``: ``windows_per_epoch`` windows per epoch from the
    KernelSynth pool and TSMixup over it plus ``extra_series``/``statsmodels``. ``kind:
    streaming``: one window per series of the prepared corpus at ``path`` (a folder or
    ``s3://...``) per epoch, TSMixup over its real series (:class:`CorpusWindows`);
    ``windows_per_epoch`` is not used."""

    kind: str = "memory"
    path: str | None = None
    kernel_synth_series: int = 1000
    kernel_synth_length: int = 1024
    max_kernels: int = 5
    tsmixup_prob: float = 0.9
    tsmixup_max_series: int = 3
    tsmixup_alpha: float = 1.5
    tsmixup_min_length: int = 128
    tsmixup_max_length: int = 2048
    #: the probability that a TSMixup component is a real series (extra_series, statsmodels, the
    #: corpus) rather than a KernelSynth one; Chronos mixes real series only (1.0)
    tsmixup_real_share: float = 1.0
    extra_series: list[str] = field(default_factory=list)
    #: statsmodels-bundled datasets added to the TSMixup pool (data_loaders.timeseries.STATSMODELS_CORPUS)
    statsmodels: list[str] = field(default_factory=list)
    #: real series shipped in the package added to the TSMixup pool (data_loaders.timeseries.BUNDLED_CORPUS)
    bundled: list[str] = field(default_factory=list)
    #: probability that a training window's history is cut to a random length (min_past to the
    #: context length); 0 is Chronos's recipe
    context_crop_prob: float = 0.0
    windows_per_epoch: int = 10000
    val_windows: int = 256
    missing_prob: float = 0.2
    min_past: int = 60
    seed: int = 0

    def __post_init__(self):
        if self.kind not in DATA_KINDS:
            raise InputError(f"data.kind={self.kind!r}: expected one of {list(DATA_KINDS)}")
        if self.kind == "streaming" and not self.path:
            raise InputError("data.kind=streaming needs data.path: a folder written by `domainfm prepare wavetoken "
                             "--input FILES --output DIR` (or its copy at s3://...)")
        if self.kind == "memory" and self.path:
            raise InputError(f"data.path={self.path} is read with data.kind=streaming only; set data.kind=streaming "
                             "(or drop data.path)")


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


def open_corpus(path: str, *, prediction_length: int, min_past: int) -> streaming.PreparedCorpus:
    """The prepared corpus at ``path``, refused (naming ``data.path`` and the field) when it was
    prepared for another horizon or ``min_past`` than this pretraining uses."""
    corpus = streaming.PreparedCorpus(path, family="wavetoken")
    settings = corpus.settings
    wanted = {"prediction_length": (prediction_length, "the model's prediction_length"),
              "min_past": (min_past, "data.min_past")}
    for name, (value, what) in wanted.items():
        if settings.get(name) != value:
            raise streaming.PrepareError(
                f"data.path {corpus.path}: the corpus was prepared with {name}={settings.get(name)}, but this "
                f"pretraining uses {name}={value} ({what}); prepare it again with `domainfm prepare wavetoken ... "
                f"{name}={value}`")
    return corpus


def parameter_counts(model) -> dict[str, int]:
    return {"params_total": sum(p.numel() for p in model.parameters()),
            "params_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    import time

    from domainfm import save_pretrained
    from domainfm.atomic import atomic_write_json

    run_dir = Path(run_dir)
    d = cfg.data
    for key in ("tsmixup_prob", "tsmixup_real_share", "context_crop_prob"):
        if not 0 <= getattr(d, key) <= 1:
            raise ValueError(f"data.{key}={getattr(d, key)}: expected a probability")
    torch.manual_seed(cfg.train.seed)
    model, init_info = build_model(cfg.model)
    corpus = None
    if d.kind == "streaming":  # refused before anything is generated when it does not fit this model
        corpus = open_corpus(d.path, prediction_length=model.prediction_length, min_past=d.min_past)
    start = time.perf_counter()
    kernel_synth = generate_kernel_synth(d.kernel_synth_series, length=d.kernel_synth_length, max_kernels=d.max_kernels,
                                         seed=d.seed) if d.kernel_synth_series > 0 else []
    synth_seconds = time.perf_counter() - start
    extra = _load_extra(d.extra_series)
    if d.statsmodels:
        from domainfm.data_loaders.timeseries import statsmodels_corpus

        extra += [s["target"] for s in statsmodels_corpus(d.statsmodels)]
    if d.bundled:
        from domainfm.data_loaders.timeseries import bundled_corpus

        extra += [s["target"] for s in bundled_corpus(d.bundled)]
    tsmixup = dict(max_series=d.tsmixup_max_series, alpha=d.tsmixup_alpha, min_length=d.tsmixup_min_length,
                   max_length=d.tsmixup_max_length, real_share=d.tsmixup_real_share)
    common = dict(context_length=model.context_length, prediction_length=model.prediction_length,
                  tsmixup_prob=d.tsmixup_prob, missing_prob=d.missing_prob, min_past=d.min_past, tsmixup=tsmixup)
    if corpus is not None:
        train = CorpusWindows(corpus, kernel_synth, extra, seed=cfg.train.seed, context_crop_prob=d.context_crop_prob,
                              **common)
    else:
        train = SeededWindows(kernel_synth, extra, num_windows=d.windows_per_epoch, seed=cfg.train.seed,
                              context_crop_prob=d.context_crop_prob, **common)
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
        # measured from this run's own sampler (samples 0..1999 of epoch 0)
        "tsmixup_composition": train.composition(2000),
        "data_kind": d.kind,
        "model_dir": saved,
        "saved_model": saved,  # what the experiment layer takes from a stage
    }
    if corpus is not None:
        report.update(corpus=corpus.describe(), corpus_path=corpus.path, corpus_series=len(corpus),
                      corpus_settings=corpus.settings)
    train_losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    if train_losses:
        report["train_loss_first"], report["train_loss_last"] = train_losses[0], train_losses[-1]
    for key, value in result.last_val.items():
        report[f"val_{key}"] = value
    report["uniform_loss"] = math.log(model.vocab_size)  # cross-entropy of a model that knows nothing
    atomic_write_json(run_dir / "pretrain_summary.json", report)
    return report
