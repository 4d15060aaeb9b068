"""Time series in, forecasting windows out.

Series are GluonTS-style dicts: ``{"item_id": str, "start": pandas.Timestamp, "freq": str,
"target": float64 array (NaN = missing)}`` (plus ``"dataset"`` when the source names one). Readers
put every series on a regular grid of its frequency, so a missing timestamp becomes a NaN.

* :func:`read_long` — long-format CSV / Parquet files or pandas DataFrames
  (``item_id, timestamp, target``), with frequency inference per series.
* :func:`iter_long` / :func:`iter_series` — the same one series at a time (a CSV in chunks of
  rows), for forecasting and embedding inputs of any size.
* :func:`from_gluonts` — a list of GluonTS-style dicts (``start`` + ``target``).
* :func:`split_by_time` — hold out the last ``prediction_length`` steps (x ``n_windows``).
* :class:`ForecastWindows` — random (context, future) windows for training, with missing-value
  injection as in Chronos's training (each observation dropped with probability U(0, p)).
* :class:`HeldOutWindows` — fixed validation / test windows; :func:`kernel_synth_windows` —
  held-out KernelSynth windows (a retained-capability probe of the pretraining distribution).
* :func:`load_sample` — the public-domain series shipped in ``samples/timeseries``.
"""
from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

__all__ = [
    "infer_freq",
    "read_long",
    "iter_long",
    "iter_series",
    "from_dataframe",
    "from_gluonts",
    "split_by_time",
    "future_index",
    "ForecastWindows",
    "HeldOutWindows",
    "kernel_synth_windows",
    "load_sample",
    "statsmodels_corpus",
    "STATSMODELS_CORPUS",
    "BUNDLED_CORPUS",
    "bundled_corpus",
    "left_pad",
    "left_pad_batch",
    "SAMPLES",
    "TimeSeriesError",
]

SAMPLES = ("statsmodels_series",)


class TimeSeriesError(ValueError):
    """Bad time-series input; the message names the file (or DataFrame), item and column."""

# coarsest first: the first alias whose grid holds every timestamp is the series' frequency
_CANDIDATES = ("YS", "YE", "QS", "QE", "MS", "ME", "W", "D", "B", "h", "min", "s")


def infer_freq(timestamps: Sequence | pd.DatetimeIndex, *, name: str = "timestamps") -> str:
    """The pandas frequency alias of sorted, unique ``timestamps``, tolerating gaps.

    ``pandas.infer_freq`` first (needs no gaps); otherwise the coarsest common alias (years,
    quarters, months, weeks anchored on the first day, days, business days, hours, minutes,
    seconds) whose regular grid from the first to the last timestamp contains them all.
    """
    index = pd.DatetimeIndex(timestamps)
    if len(index) < 2:
        raise TimeSeriesError(f"{name}: cannot infer a frequency from {len(index)} timestamp(s); pass freq=")
    if len(index) >= 3:
        freq = pd.infer_freq(index)
        if freq is not None:
            return freq
    for alias in _CANDIDATES:
        if alias == "W":
            alias = "W-" + index[0].day_name()[:3].upper()
        try:
            grid = pd.date_range(index[0], index[-1], freq=alias)
        except ValueError:
            continue
        if len(grid) <= 100 * len(index) and index.isin(grid).all():
            return alias
    raise TimeSeriesError(f"{name}: timestamps follow no regular frequency (first {list(index[:3])}); pass freq=")


def _regularise(item: str, times: pd.DatetimeIndex, values: np.ndarray, freq: str | None, where: str) -> dict[str, Any]:
    if times.has_duplicates:
        dup = times[times.duplicated()][0]
        raise TimeSeriesError(f"{where}: item {item!r} has more than one row at timestamp {dup}")
    order = np.argsort(times.values, kind="stable")
    times, values = times[order], values[order]
    if freq is None:
        freq = infer_freq(times, name=f"{where}: item {item!r}") if len(times) > 1 else None
        if freq is None:
            raise TimeSeriesError(f"{where}: item {item!r} has a single timestamp; pass freq= to place it")
    grid = pd.date_range(times[0], times[-1], freq=freq)
    if not times.isin(grid).all():
        off = times[~times.isin(grid)][0]
        raise TimeSeriesError(f"{where}: item {item!r}: timestamp {off} is not on the {freq!r} grid starting {times[0]}")
    target = pd.Series(values, index=times).reindex(grid).to_numpy(dtype=np.float64)
    return {"item_id": str(item), "start": grid[0], "freq": freq, "target": target}


def from_dataframe(df: pd.DataFrame, *, item_id: str | None = "item_id", timestamp: str = "timestamp",
                   target: str = "target", freq: str | None = None, dataset: str | None = "dataset",
                   where: str = "DataFrame") -> list[dict[str, Any]]:
    """Series from a long-format DataFrame (one row per item and timestamp).

    ``item_id=None`` (or a missing item column) reads one series. A ``dataset`` column, when
    present, is carried into each series (used to aggregate metrics per dataset).
    """
    missing = [c for c in (timestamp, target) if c not in df.columns]
    if missing:
        raise TimeSeriesError(f"{where}: missing column(s) {missing}; columns are {list(df.columns)} "
                         "(set item_id=/timestamp=/target= to the names used)")
    if item_id is not None and item_id not in df.columns:
        raise TimeSeriesError(f"{where}: no item column {item_id!r} (columns {list(df.columns)}); pass item_id=None for one series")
    try:
        times = pd.to_datetime(df[timestamp])
    except (ValueError, TypeError) as exc:
        raise TimeSeriesError(f"{where}: column {timestamp!r} is not parseable as timestamps ({exc})") from None
    values = pd.to_numeric(df[target], errors="coerce")
    bad = values.isna() & df[target].notna()
    if bad.any():
        raise TimeSeriesError(f"{where}: column {target!r} has non-numeric value {df[target][bad].iloc[0]!r} "
                         f"(row {int(np.flatnonzero(bad.to_numpy())[0])}); use an empty cell for a missing value")
    if np.isinf(values.to_numpy(dtype=np.float64)).any():
        raise TimeSeriesError(f"{where}: column {target!r} contains infinite values")
    frame = pd.DataFrame({"t": times, "y": values.astype(np.float64)})
    frame["item"] = df[item_id].astype(str).to_numpy() if item_id is not None else "series"
    has_dataset = dataset is not None and dataset in df.columns
    if has_dataset:
        frame["dataset"] = df[dataset].astype(str).to_numpy()
    series = []
    for item, group in frame.groupby("item", sort=False):
        s = _regularise(item, pd.DatetimeIndex(group["t"]), group["y"].to_numpy(), freq, where)
        if has_dataset:
            names = group["dataset"].unique()
            if len(names) > 1:
                raise TimeSeriesError(f"{where}: item {item!r} appears in several datasets {list(names)}")
            s["dataset"] = names[0]
        series.append(s)
    if not series:
        raise TimeSeriesError(f"{where}: no rows")
    return series


def read_long(source: str | os.PathLike | pd.DataFrame, **kwargs) -> list[dict[str, Any]]:
    """Series from a long-format ``.csv`` / ``.parquet`` file or a DataFrame (see :func:`from_dataframe`)."""
    if isinstance(source, pd.DataFrame):
        return from_dataframe(source, **kwargs)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"time series file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".txt", ".gz"):
        try:
            df = pd.read_csv(path)
        except pd.errors.EmptyDataError:
            raise TimeSeriesError(f"{path}: the file is empty (expected a header with item_id, timestamp, "
                                  "target columns and one row per item and timestamp)") from None
        except (pd.errors.ParserError, UnicodeDecodeError) as exc:
            raise TimeSeriesError(f"{path}: not a readable CSV file ({exc})") from None
    elif suffix in (".parquet", ".pq"):
        try:
            df = pd.read_parquet(path)
        except ImportError as exc:
            raise ImportError(f"{path}: reading Parquet needs pyarrow or fastparquet (pip install pyarrow)") from exc
    else:
        raise TimeSeriesError(f"{path}: unsupported file type {suffix!r}; expected .csv or .parquet in long format")
    return from_dataframe(df, where=str(path), **kwargs)


def iter_long(path: str | os.PathLike, *, item_id: str = "item_id", timestamp: str = "timestamp",
              target: str = "target", freq: str | None = None, chunk_rows: int = 200_000) -> Iterator[dict[str, Any]]:
    """The series of a long-format file, one at a time. A CSV whose items each occupy contiguous
    rows (the usual layout) is read ``chunk_rows`` rows at a time, so memory does not grow with
    the number of series; any other file (Parquet, interleaved items) is read whole."""
    path = Path(path)
    if chunk_rows < 1:
        raise TimeSeriesError(f"chunk_rows={chunk_rows}: must be >= 1")
    columns = {"item_id": item_id, "timestamp": timestamp, "target": target, "freq": freq, "dataset": None}
    chunked = path.suffix.lower() in (".csv", ".txt") and path.is_file()
    if not chunked or not _items_contiguous(path, item_id, chunk_rows):
        yield from read_long(path, **columns)
        return
    carry, first_row = None, 0
    for chunk in pd.read_csv(path, chunksize=chunk_rows, dtype={item_id: str}):
        frame = chunk if carry is None else pd.concat([carry, chunk], ignore_index=True)
        items = frame[item_id].astype(str).to_numpy()
        done = items != items[-1]  # every item but the last is complete (its rows are contiguous)
        if done.any():
            yield from from_dataframe(frame[done].reset_index(drop=True), where=f"{path} (rows from {first_row})",
                                      **columns)
            first_row += int(done.sum())
        carry = frame[~done].reset_index(drop=True)
    if carry is not None and len(carry):
        yield from from_dataframe(carry, where=f"{path} (rows from {first_row})", **columns)


def _items_contiguous(path: Path, item_id: str, chunk_rows: int) -> bool:
    """Whether every item of the CSV occupies one run of rows (a pass over the item column only)."""
    seen, current = set(), None
    try:
        for chunk in pd.read_csv(path, usecols=[item_id], chunksize=chunk_rows, dtype={item_id: str}):
            items = chunk[item_id].astype(str).to_numpy()
            if not len(items):
                continue
            heads = items[np.r_[True, items[1:] != items[:-1]]]
            for head in heads:
                if head == current:
                    continue
                if head in seen:
                    return False
                seen.add(head)
                current = head
    except (ValueError, pd.errors.EmptyDataError):  # no such column, empty file: the whole-file reader says so
        return False
    return current is not None


def iter_series(source: Any, *, item_id: str = "item_id", timestamp: str = "timestamp", target: str = "target",
                freq: str | None = None, chunk_rows: int = 200_000) -> Iterator[dict[str, Any]]:
    """Every series of ``source``, one at a time: a long-format CSV/Parquet path (:func:`iter_long`),
    a long-format DataFrame, a list of series dicts (e.g. from :func:`read_long`) or a (B, T)
    array or tensor (NaN = missing; ids ``"0" .. "B-1"``, no timestamps). An item with no observed
    value, or no item at all, is an error naming the file (``series`` for a Python object)."""
    where = str(source) if isinstance(source, (str, os.PathLike)) else "series"
    columns = {"item_id": item_id, "timestamp": timestamp, "target": target, "freq": freq}
    if isinstance(source, (str, os.PathLike)):
        items: Iterable[Mapping[str, Any]] = iter_long(source, chunk_rows=chunk_rows, **columns)
    elif isinstance(source, pd.DataFrame):
        items = read_long(source, dataset=None, **columns)
    elif isinstance(source, (np.ndarray, torch.Tensor)):
        values = torch.as_tensor(source, dtype=torch.float32)
        rows = values.reshape(-1, values.shape[-1])
        items = ({"item_id": str(i), "target": row.numpy()} for i, row in enumerate(rows))
    else:
        items = list(source)
        if not all(isinstance(s, Mapping) and "target" in s for s in items):
            raise TimeSeriesError("series: expected a file path, a long-format DataFrame, a (B, T) array or a list of "
                                  "series dicts (item_id, start, freq, target), e.g. from read_long")
    n = 0
    for n, s in enumerate(items, 1):
        if not np.isfinite(np.asarray(s["target"], dtype=np.float64)).any():
            raise TimeSeriesError(f"{where}: item {s['item_id']!r} has no observed value (every {target!r} value is "
                                  "empty or NaN); drop the item or give it at least one value")
        yield dict(s)
    if n == 0:
        raise TimeSeriesError(f"{where}: no rows")


def from_gluonts(entries: Iterable[Mapping[str, Any]], *, freq: str | None = None) -> list[dict[str, Any]]:
    """Series from GluonTS-style dicts with ``start`` (timestamp or period) and ``target``
    (1-D); ``freq`` comes from the argument, the entry, or a pandas Period ``start``."""
    series = []
    for i, entry in enumerate(entries):
        if "target" not in entry or "start" not in entry:
            raise TimeSeriesError(f"entry {i}: needs 'start' and 'target' keys, has {sorted(entry)}")
        target = np.asarray(entry["target"], dtype=np.float64)
        if target.ndim != 1:
            raise TimeSeriesError(f"entry {i}: target must be 1-D (univariate), got shape {target.shape}")
        if np.isinf(target).any():
            raise TimeSeriesError(f"entry {i}: target contains infinite values")
        start = entry["start"]
        f = freq or entry.get("freq") or (start.freqstr if isinstance(start, pd.Period) else None)
        if f is None:
            raise TimeSeriesError(f"entry {i}: no frequency (pass freq=, a 'freq' key, or a pandas Period start)")
        start = start.to_timestamp() if isinstance(start, pd.Period) else pd.Timestamp(start)
        s = {"item_id": str(entry.get("item_id", i)), "start": start, "freq": f, "target": target}
        if "dataset" in entry:
            s["dataset"] = str(entry["dataset"])
        series.append(s)
    return series


def split_by_time(series: Sequence[Mapping[str, Any]], prediction_length: int, *, n_windows: int = 1,
                  min_context: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hold out the end of every series.

    Returns ``(train, test)``: ``train`` holds each series without its last
    ``n_windows * prediction_length`` steps; ``test`` holds one entry per series and window with
    ``context`` (everything before the window) and ``future`` (the window's values).
    """
    if prediction_length < 1 or n_windows < 1:
        raise TimeSeriesError(f"prediction_length={prediction_length} and n_windows={n_windows} must be >= 1")
    train, test = [], []
    for s in series:
        target = np.asarray(s["target"], dtype=np.float64)
        cut = len(target) - n_windows * prediction_length
        if cut < min_context:
            raise TimeSeriesError(f"series {s.get('item_id')!r}: length {len(target)} leaves fewer than {min_context} context "
                             f"value(s) before {n_windows} window(s) of {prediction_length}")
        train.append({**s, "target": target[:cut]})
        for w in range(n_windows):
            end = cut + (w + 1) * prediction_length
            test.append({**s, "context": target[: end - prediction_length], "future": target[end - prediction_length : end],
                         "window": w})
    return train, test


def future_index(series: Mapping[str, Any], horizon: int) -> pd.DatetimeIndex:
    """Timestamps of the ``horizon`` steps after the end of ``series``."""
    last = pd.date_range(series["start"], periods=len(series["target"]), freq=series["freq"])[-1]
    return pd.date_range(last, periods=horizon + 1, freq=series["freq"])[1:]


def left_pad(values: np.ndarray, length: int) -> np.ndarray:
    """The last ``length`` values, left-padded with NaN."""
    values = np.asarray(values, dtype=np.float32)[-length:]
    out = np.full(length, np.nan, dtype=np.float32)
    if len(values):
        out[length - len(values) :] = values
    return out


def left_pad_batch(series: Iterable[np.ndarray], length: int) -> torch.Tensor:
    """(B, length) float32: the last ``length`` values of each series, left-padded with NaN."""
    return torch.from_numpy(np.stack([left_pad(values, length) for values in series]))


class ForecastWindows(Dataset):
    """Random ``(context, future)`` windows drawn from a list of series, for training.

    Each item picks a series (uniformly, or weighted by ``weights``), an end point with at least
    ``min_past`` observed steps before the future window, and returns the context (the last
    ``context_length`` steps, left-padded with NaN) and the future (``prediction_length`` steps).
    With ``missing_prob > 0`` each context value is dropped to NaN with probability
    ``U(0, missing_prob)`` (Chronos's ``drop_prob``). Draws use numpy's global generator, which the
    engine seeds and restores on resume; with ``seed`` set, window ``i`` is instead a fixed draw
    of its own generator (``numpy.random.default_rng([seed, i])``): the same window every time it
    is read, as per-sample weights computed once over the dataset (FLOW) need.

    Args:
        series: dicts with a ``"target"`` array (or plain 1-D arrays).
        context_length, prediction_length: window sizes.
        num_windows: the dataset's length (windows per epoch).
        min_past: minimum context steps (default ``prediction_length``).
        seed: None (a fresh random window at each read) or an int (fixed windows, see above).

    Shapes:
        item: ``(context (context_length,), future (prediction_length,))`` float32 tensors.
    """

    def __init__(self, series: Sequence, context_length: int, prediction_length: int, *, num_windows: int = 1000,
                 min_past: int | None = None, missing_prob: float = 0.0, weights: Sequence[float] | None = None,
                 seed: int | None = None):
        self.targets = [np.asarray(s["target"] if isinstance(s, Mapping) else s, dtype=np.float32) for s in series]
        self.context_length, self.prediction_length = int(context_length), int(prediction_length)
        self.min_past = self.prediction_length if min_past is None else int(min_past)
        if not 0 <= missing_prob < 1:
            raise TimeSeriesError(f"missing_prob={missing_prob}: expected a probability in [0, 1)")
        self.missing_prob = missing_prob
        need = self.min_past + self.prediction_length
        keep = [i for i, t in enumerate(self.targets) if len(t) >= need]
        if not keep:
            raise TimeSeriesError(f"no series is long enough for min_past={self.min_past} + prediction_length={self.prediction_length}")
        self.usable = keep
        w = np.ones(len(keep)) if weights is None else np.asarray(weights, dtype=np.float64)[keep]
        if (w < 0).any() or w.sum() <= 0:
            raise TimeSeriesError("weights must be non-negative with a positive sum")
        self.p = w / w.sum()
        self.num_windows = int(num_windows)
        self.seed = None if seed is None else int(seed)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int):
        if self.seed is None:
            pick, randint, rand, uniform = np.random.choice, np.random.randint, np.random.rand, np.random.uniform
        else:
            if not 0 <= index < self.num_windows:
                raise IndexError(f"window {index} of {self.num_windows}")
            rng = np.random.default_rng([self.seed, int(index)])
            pick, randint, uniform = rng.choice, rng.integers, rng.uniform
            rand = rng.random
        target = self.targets[self.usable[pick(len(self.usable), p=self.p)]]
        end = int(randint(self.min_past + self.prediction_length, len(target) + 1))
        future = target[end - self.prediction_length : end]
        context = left_pad(target[: end - self.prediction_length], self.context_length)
        if self.missing_prob > 0:
            drop = rand(self.context_length) < uniform(0, self.missing_prob)
            context = np.where(drop, np.float32(np.nan), context)
        return torch.from_numpy(context.copy()), torch.from_numpy(future.copy())


class HeldOutWindows(Dataset):
    """Validation / test windows: ``(context, future, index)``, the context left-padded with NaN to
    the longest one (a recipe cuts it to its model's context length), ``index`` = ``offset + i``
    so that windows of several sets sharing one recipe stay distinct.

    Args:
        windows: dicts with ``context`` and ``future`` arrays (e.g. :func:`split_by_time`'s test).
        offset: added to each window's index.
    """

    def __init__(self, windows: Sequence[Mapping[str, Any]], offset: int = 0):
        self.windows, self.offset = list(windows), int(offset)
        contexts = [w["context"] for w in self.windows]
        self.context = left_pad_batch(contexts, max(len(c) for c in contexts))
        self.future = torch.from_numpy(np.stack([np.asarray(w["future"], dtype=np.float32) for w in self.windows]))

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        return self.context[i], self.future[i], torch.tensor(self.offset + i)


@functools.lru_cache(maxsize=8)
def kernel_synth_windows(n: int, length: int, seed: int, horizon: int) -> tuple[dict[str, Any], ...]:
    """``n`` KernelSynth series of ``length`` steps drawn with ``seed``, each split into a context
    and its last ``horizon`` steps (``future``); daily from 2000-01-01, dataset ``kernel_synth``."""
    from domainfm.data_loaders.synthetic_series import generate_kernel_synth

    start = pd.Timestamp("2000-01-01")
    windows = []
    for i, y in enumerate(generate_kernel_synth(n, length=length, seed=seed)):
        y = np.asarray(y, dtype=np.float64)
        # shifted to positive values: WQL divides by sum |y|, and a GP draw crosses zero
        y = y - y.min() + 1.0 + np.abs(y).mean()
        windows.append({"dataset": "kernel_synth", "item_id": f"ks{i}", "freq": "D", "start": start,
                        "context": y[:-horizon], "future": y[-horizon:]})
    return tuple(windows)


def load_sample(name: str = "statsmodels_series") -> list[dict[str, Any]]:
    """Series shipped with domainfm (see ``samples/timeseries/README.md``)."""
    if name not in SAMPLES:
        raise TimeSeriesError(f"unknown sample {name!r}; shipped: {list(SAMPLES)}")
    path = importlib.resources.files("domainfm.data_loaders") / "samples" / "timeseries" / f"{name}.csv"
    with importlib.resources.as_file(path) as p:
        return read_long(p)


#: statsmodels-bundled series that are *not* in the shipped evaluation sample (statsmodels_series.csv):
#: the real part of domainfm's WaveToken pretraining corpus. name -> (licence, description)
STATSMODELS_CORPUS = {
    "fertility": ("CC-BY-4.0 (World Bank open data)",
                  "World Bank fertility rate, 1960-2013, one yearly series per country (219, NaN gaps trimmed)"),
    "danish_data": ("public domain", "Danish money demand, 1974Q1-1987Q3, 5 quarterly series"),
    "interest_inflation": ("public domain", "German interest rate and inflation, 1972Q2-1998Q4, 2 quarterly series"),
}


#: Real series shipped in ``data_loaders/samples`` for pretraining (never the held-out
#: ``statsmodels_series.csv``): name -> (licence, what). See ``samples/timeseries/README.md``.
BUNDLED_CORPUS = {
    "m1_yearly": ("CC-BY-4.0 (Monash Time Series Forecasting Archive)",
                  "the 181 yearly series of the M1 competition (Makridakis et al. 1982), 15 to 58 values"),
    "daphnet_gait": ("CC-BY-4.0 (UCI Daphnet Freezing of Gait)",
                     "9 accelerometer channels (ankle, thigh, trunk; 3 axes each) of recording S06R02, 64 Hz, "
                     "7,040 samples each"),
    "eeg_motor_imagery": ("ODC-By-1.0 (PhysioNet EEGMMIDB)",
                          "the 64 EEG channels of S001R02 (eyes-closed rest), 160 Hz, 9,760 samples each"),
}


def _read_tsf(path: Path) -> list[dict[str, Any]]:
    """Series of a Monash ``.tsf`` file (``name:start:v1,v2,...`` lines after ``@data``; ``?`` is
    missing), as ``{"item_id", "target"}``."""
    out, in_data = [], False
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                in_data = line.lower() == "@data"
                continue
            fields = line.split(":")  # name, then the attributes (start timestamp), then the values
            name, values = fields[0], fields[-1]
            try:
                target = np.array([np.nan if v == "?" else float(v) for v in values.split(",")], dtype=np.float32)
            except ValueError as err:
                raise TimeSeriesError(f"{path}: line {number}: expected comma-separated numbers after the last ':' "
                                      f"({err})") from None
            out.append({"item_id": name, "target": target})
    return out


def bundled_corpus(names: Sequence[str]) -> list[dict[str, Any]]:
    """Real pretraining series shipped with the package (:data:`BUNDLED_CORPUS`), as
    ``{"item_id", "target"}`` dicts with float32 targets (item ids prefixed by the corpus name)."""
    samples = Path(__file__).resolve().parent / "samples"
    out: list[dict[str, Any]] = []
    for name in names:
        if name not in BUNDLED_CORPUS:
            raise TimeSeriesError(f"bundled corpus {name!r}: expected one of {sorted(BUNDLED_CORPUS)}")
        if name == "m1_yearly":
            series = _read_tsf(samples / "timeseries" / "m1_yearly.tsf")
        elif name == "daphnet_gait":
            frame = pd.read_csv(samples / "timeseries" / "daphnet_S06R02E0.csv")
            series = [{"item_id": c, "target": frame[c].to_numpy(dtype=np.float32)}
                      for c in frame.columns if c not in ("timestamp", "is_anomaly")]
        else:
            import mne

            raw = mne.io.read_raw_edf(samples / "eeg" / "S001R02.edf", preload=True, verbose="error")
            data = raw.get_data(units="uV").astype(np.float32)
            series = [{"item_id": ch.strip("."), "target": row} for ch, row in zip(raw.ch_names, data)]
        out.extend({"item_id": f"{name}/{s['item_id']}", "target": s["target"]} for s in series)
    return out


def statsmodels_corpus(names: Sequence[str], *, min_length: int = 16) -> list[dict[str, Any]]:
    """Series from statsmodels' bundled datasets (see :data:`STATSMODELS_CORPUS`), as
    ``{"item_id", "target"}`` dicts with float32 targets; the longest NaN-free stretch of each
    column (fertility: of each country's row) is kept when it has at least ``min_length`` values."""
    import statsmodels.api as sm

    out: list[dict[str, Any]] = []
    for name in names:
        if name not in STATSMODELS_CORPUS:
            raise TimeSeriesError(f"statsmodels corpus {name!r}: expected one of {sorted(STATSMODELS_CORPUS)}")
        frame = getattr(sm.datasets, name).load_pandas().data
        if name == "fertility":
            years = [c for c in frame.columns if str(c).isdigit()]
            columns = {f"{name}/{code}": row[years].to_numpy(dtype=np.float64)
                       for code, (_, row) in zip(frame["Country Code"], frame.iterrows())}
        else:
            numeric = frame.drop(columns=[c for c in ("year", "quarter") if c in frame.columns])
            columns = {f"{name}/{c}": numeric[c].to_numpy(dtype=np.float64) for c in numeric.columns}
        for item, values in columns.items():
            finite = np.isfinite(values)
            # the longest run of finite values
            best, start = (0, 0), None
            for i, ok in enumerate(np.append(finite, False)):
                if ok and start is None:
                    start = i
                elif not ok and start is not None:
                    best = max(best, (i - start, start))
                    start = None
            length, first = best
            if length >= min_length:
                out.append({"item_id": item, "target": values[first : first + length].astype(np.float32)})
    return out
