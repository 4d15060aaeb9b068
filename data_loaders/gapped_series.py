"""Series with gaps in, tensors for imputation out.

A *gapped series* is one set of (possibly irregular) time points shared by its channels, with
``NaN`` where a channel was not observed. Sources:

* **wide** tables: one time column (or the index) and one column per channel;
* **long** tables: ``(item_id,) time, channel, value`` rows, pivoted to wide per item;
* CSV or Parquet files, or pandas DataFrames.

Times may be numbers or timestamps (converted to days since the first time point, recorded in
``time_origin`` / ``time_unit``). Each row's time as the source wrote it is kept in
``time_labels`` and written back unchanged by :func:`to_dataframe`, so output rows carry the input's
stamps, UTC offset included. A column with several UTC offsets (a daylight-saving change) is put on
one clock (UTC) for the model; stamps with and without an offset in one column are refused (the
naive ones name no instant). Errors name the file, the column and the row: an empty file or one
without data rows, unsorted or duplicate times, non-finite times, a channel with fewer than two
observations, and (:func:`check_windows`) a FIM-ℓ window with fewer than two.

For scoring and fine-tuning an imputer: :func:`gap_mask` (artificial contiguous gaps),
:func:`interpolate_baseline` (linear, clamped-spline or GP gap filling, the baselines to beat),
:func:`masked_metrics` (MAE, RMSE, MRE on the hidden entries, R^2) and :class:`HoldoutWindows`
(windows of a series with random observed points hidden).

**Shapes:** :meth:`GappedSeries.tensors` -> ``times (T,)``, ``values (T, D)`` (NaN at gaps),
``observed (T, D)`` bool.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

__all__ = ["GappedSeries", "GappedSeriesError", "read_series", "from_dataframe", "fim_windows", "check_windows",
           "load_co2", "to_dataframe", "gap_mask", "interpolate_baseline", "masked_metrics",
           "HoldoutWindows"]


class GappedSeriesError(ValueError):
    """Bad input for a gapped series; the message names the source, the column and the row."""


@dataclass
class GappedSeries:
    """One series: ``times (T,)`` float64 (increasing), ``values (T, D)`` float64 with NaN at gaps."""

    times: np.ndarray
    values: np.ndarray
    channels: list[str]
    item_id: str = "series"
    source: str = "<dataframe>"
    time_column: str = "time"
    time_origin: pd.Timestamp | None = None
    time_unit: str = "day"
    #: each row's time as the source gave it (a CSV cell's text), written back by :func:`to_dataframe`
    time_labels: np.ndarray | None = None
    info: dict = field(default_factory=dict)

    @property
    def observed(self) -> np.ndarray:
        return np.isfinite(self.values)

    def tensors(self, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.as_tensor(self.times, dtype=dtype), torch.as_tensor(self.values, dtype=dtype),
                torch.as_tensor(self.observed))

    def timestamps(self, times: np.ndarray | None = None):
        """Times as the source gave them (timestamps when it had timestamps)."""
        times = self.times if times is None else np.asarray(times)
        if self.time_origin is None:
            return times
        return self.time_origin + pd.to_timedelta(times, unit="D")


def _where(source: str, column: str | None = None, row: int | None = None) -> str:
    parts = [source]
    if column is not None:
        parts.append(f"column {column!r}")
    if row is not None:
        parts.append(f"row {row}")
    return ", ".join(parts)


def _first_odd_stamp(raw: pd.Series) -> tuple[int, str | None]:
    """Position of the first cell that is not a timestamp (``"not a stamp"``), or whose UTC offset
    is present where the first stamp's is absent or the reverse (``"offset"``); ``(0, None)`` when
    none stands out. Cell by cell: only for error messages."""
    aware = None
    for i, cell in enumerate(raw):
        if pd.isna(cell):
            continue
        try:
            stamp = pd.Timestamp(cell)
        except (ValueError, TypeError):
            return i, "not a stamp"
        if aware is None:
            aware = stamp.tzinfo is not None
        elif (stamp.tzinfo is not None) != aware:
            return i, "offset"
    return 0, None


def _offset_error(raw: pd.Series, source: str, column: str, rows: np.ndarray, bad: int) -> GappedSeriesError:
    return GappedSeriesError(f"{_where(source, column, int(rows[bad]))}: {raw.iloc[bad]!r} and {raw.dropna().iloc[0]!r} "
                             "differ in having a UTC offset; give every stamp an offset, or none (a stamp without "
                             "one names no instant next to those with one)")


def _parse_stamps(raw: pd.Series, source: str, column: str, rows: np.ndarray) -> pd.Series:
    """Timestamps of a column: as they are without an offset or with one offset; on one clock (UTC)
    when the offsets differ between rows (pandas 2 gives objects, pandas 3 an error, unless asked
    for UTC). Raises ``ValueError``/``TypeError`` when the column is not timestamps, and
    :class:`GappedSeriesError` naming the row when offsets are present on some stamps only."""
    if pd.api.types.is_datetime64_any_dtype(raw):
        return raw
    mixed = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mixed time zones.*", category=FutureWarning)
        try:
            stamps = pd.to_datetime(raw, errors="raise")
            if stamps.dtype != object:
                return stamps
        except ValueError as exc:
            mixed = exc
    try:
        stamps = pd.to_datetime(raw, errors="raise", utc=True)
    except (ValueError, TypeError):
        bad, why = _first_odd_stamp(raw)
        if why == "offset":
            raise _offset_error(raw, source, column, rows, bad) from None
        if mixed is not None:
            raise mixed from None
        raise
    # utc=True reads a stamp without offset as UTC: refuse rather than guess its clock
    bad, why = _first_odd_stamp(raw)
    if why == "offset":
        raise _offset_error(raw, source, column, rows, bad)
    return stamps


def _times(raw: pd.Series, source: str, column: str, rows: np.ndarray) -> tuple[np.ndarray, pd.Timestamp | None]:
    origin = None
    if pd.api.types.is_datetime64_any_dtype(raw) or pd.api.types.is_string_dtype(raw.dtype):  # object, or pandas 3's str
        try:
            stamps = _parse_stamps(raw, source, column, rows)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GappedSeriesError):
                raise
            numeric = pd.to_numeric(raw, errors="coerce")
            if numeric.notna().any() and numeric.isna().any():  # numbers with a stray cell
                bad = int(np.flatnonzero(numeric.isna().to_numpy())[0])
            else:  # stamps with a stray cell
                bad = _first_odd_stamp(raw)[0]
            raise GappedSeriesError(f"{_where(source, column, int(rows[bad]))}: {raw.iloc[bad]!r} is neither a number "
                                    f"nor a timestamp ({exc})") from None
        if stamps.isna().any():
            bad = int(np.flatnonzero(stamps.isna().to_numpy())[0])
            raise GappedSeriesError(f"{_where(source, column, int(rows[bad]))}: missing timestamp")
        origin = stamps.iloc[0]  # keeps the column's offset (UTC when it had several), for plots and messages
        times = ((stamps - origin) / pd.Timedelta(days=1)).to_numpy(dtype=np.float64)
    else:
        times = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(times))
    if len(bad):
        raise GappedSeriesError(f"{_where(source, column, int(rows[bad[0]]))}: time {raw.iloc[bad[0]]} is not finite; "
                                "every row needs a finite time (use NaN in a value column for a gap)")
    step = np.diff(times)
    if (step == 0).any():
        i = int(np.flatnonzero(step == 0)[0])
        raise GappedSeriesError(f"{_where(source, column, int(rows[i + 1]))}: duplicate time {raw.iloc[i + 1]} "
                                f"(also at row {int(rows[i])})")
    if (step < 0).any():
        i = int(np.flatnonzero(step < 0)[0])
        raise GappedSeriesError(f"{_where(source, column, int(rows[i + 1]))}: times are not sorted ({raw.iloc[i + 1]} "
                                f"after {raw.iloc[i]}); sort the rows by time first")
    return times, origin


def _build(df: pd.DataFrame, *, source: str, time: str, channels: Sequence[str], item_id: str,
           rows: np.ndarray, labels: np.ndarray | None = None) -> GappedSeries:
    times, origin = _times(df[time], source, time, rows)
    labels = df[time].to_numpy() if labels is None else labels
    values = np.empty((len(df), len(channels)), dtype=np.float64)
    for j, name in enumerate(channels):
        col = pd.to_numeric(df[name], errors="coerce")
        text = df[name].notna() & col.isna()
        if text.any():
            i = int(np.flatnonzero(text.to_numpy())[0])
            raise GappedSeriesError(f"{_where(source, name, int(rows[i]))}: {df[name].iloc[i]!r} is not a number "
                                    "(leave the cell empty or NaN for a gap)")
        values[:, j] = col.to_numpy(dtype=np.float64)
        seen = np.flatnonzero(np.isfinite(values[:, j]))
        of_item = f" of item {item_id!r}" if item_id != "series" else ""
        if not len(seen):
            raise GappedSeriesError(f"{_where(source, name)}: no observed value in channel {name!r}{of_item}")
        if len(seen) == 1:
            # Refused rather than filled: FIM scales each channel by the range of its observed
            # times and values, which one point leaves at zero (the model's output turns to inf);
            # a constant fill would be a rule of ours passed off as FIM's path, with no std to
            # give it. Same stance as a channel with no observation.
            raise GappedSeriesError(f"{_where(source, name)}: only one observed value (row {int(rows[seen[0]])}) in "
                                    f"channel {name!r}{of_item}; imputation needs at least two observed points per "
                                    "channel (drop the column or add observations)")
    values[~np.isfinite(values)] = np.nan  # inf counts as missing, like NaN
    return GappedSeries(times=times, values=values, channels=list(channels), item_id=item_id, source=source,
                        time_column=time, time_origin=origin, time_labels=np.asarray(labels, dtype=object))


def from_dataframe(df: pd.DataFrame, *, time: str | None = None, channels: Sequence[str] | None = None,
                   layout: str = "auto", item_id: str = "item_id", channel: str = "channel", value: str = "value",
                   source: str = "<dataframe>") -> list[GappedSeries]:
    """Gapped series from a DataFrame.

    Args:
        time: the time column (default: ``time``, ``timestamp``, ``date`` or ``t`` if present,
            else the index).
        channels: value columns of a wide table (default: every other numeric-looking column).
        layout: ``wide``, ``long`` (``item_id?, time, channel, value`` rows) or ``auto`` (long
            when the ``channel`` and ``value`` columns exist).
    """
    if layout not in {"auto", "wide", "long"}:
        raise GappedSeriesError(f"layout={layout!r}: expected 'auto', 'wide' or 'long'")
    if len(df) == 0:
        raise GappedSeriesError(f"{source}: no data rows (columns: {list(df.columns)}); expected a time column, "
                                "one column per channel and at least two rows")
    df = df.copy()
    if time is None:
        time = next((c for c in ("time", "timestamp", "date", "t", "ds") if c in df.columns), None)
        if time is None:
            name = df.index.name or "index"
            df = df.reset_index().rename(columns={df.index.name or "index": name})
            time = name
    if time not in df.columns:
        raise GappedSeriesError(f"{source}: no time column {time!r} (columns: {list(df.columns)})")
    df["__row__"] = np.arange(len(df)) + (2 if source.endswith((".csv", ".CSV")) else 0)  # file line numbers
    if layout == "long" or (layout == "auto" and channel in df.columns and value in df.columns):
        for col in (channel, value):
            if col not in df.columns:
                raise GappedSeriesError(f"{source}: long layout needs a {col!r} column (columns: {list(df.columns)})")
        df["__time_text__"] = df[time]
        if pd.api.types.is_string_dtype(df[time].dtype):
            try:
                df[time] = _parse_stamps(df[time], source, time, df["__row__"].to_numpy())
            except GappedSeriesError:
                raise
            except (ValueError, TypeError):
                pass  # numbers as text: _times reports the bad cell
        groups = df.groupby(item_id, sort=False) if item_id in df.columns else [("series", df)]
        out = []
        for key, part in groups:
            dup = part.duplicated([time, channel], keep="first")
            if dup.any():
                i = int(np.flatnonzero(dup.to_numpy())[0])
                raise GappedSeriesError(f"{_where(source, time, int(part['__row__'].iloc[i]))}: duplicate time "
                                        f"{part[time].iloc[i]!r} for channel {part[channel].iloc[i]!r}")
            wide = part.pivot(index=time, columns=channel, values=value)  # sorted by time
            rows = part.groupby(time)["__row__"].min().reindex(wide.index).to_numpy()
            labels = part.groupby(time)["__time_text__"].first().reindex(wide.index).to_numpy()
            wide = wide.reset_index()
            out.append(_build(wide, source=source, time=time, channels=[str(c) for c in wide.columns[1:]],
                              item_id=str(key), rows=rows, labels=labels))
        return out
    if channels is None:
        channels = [c for c in df.columns if c not in (time, "__row__", item_id)]
    for name in channels:
        if name not in df.columns:
            raise GappedSeriesError(f"{source}: no column {name!r} (columns: {[c for c in df.columns if c != '__row__']})")
    if not channels:
        raise GappedSeriesError(f"{source}: no value column besides the time column {time!r}")
    if item_id in df.columns:
        return [_build(part, source=source, time=time, channels=channels, item_id=str(key),
                       rows=part["__row__"].to_numpy()) for key, part in df.groupby(item_id, sort=False)]
    return [_build(df, source=source, time=time, channels=channels, item_id="series", rows=df["__row__"].to_numpy())]


def read_series(path: str | os.PathLike | pd.DataFrame, **kwargs) -> list[GappedSeries]:
    """Gapped series from a CSV / Parquet file (or a DataFrame); see :func:`from_dataframe`."""
    if isinstance(path, pd.DataFrame):
        return from_dataframe(path, **kwargs)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"series file not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix in {".parquet", ".pq"}:
            df = pd.read_parquet(path)
        elif suffix in {".csv", ".txt"}:
            df = pd.read_csv(path)
        else:
            raise GappedSeriesError(f"{path}: unsupported file type {suffix!r}; expected .csv or .parquet")
    except pd.errors.EmptyDataError:
        raise GappedSeriesError(f"{path}: empty file; expected a header line (a time column and one column per "
                                "channel) and data rows") from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as exc:
        raise GappedSeriesError(f"{path}: could not be read as {suffix[1:]} ({exc})") from exc
    return from_dataframe(df, source=str(path), **kwargs)


def fim_windows(n: int, window_points: int, overlap: float = 0.25) -> int | None:
    """How many FIM-ℓ windows of about ``window_points`` points cover ``n`` points, sharing
    ``overlap`` of a window with the previous one (None: the series fits one window)."""
    if n <= window_points:
        return None
    return min(n, max(2, math.ceil((n / window_points - 1) / (1 - overlap) + 1)))


def check_windows(series: GappedSeries, windows: int, overlap: float = 0.25) -> None:
    """Raise if a FIM-ℓ window of ``series`` has fewer than two observed points in some channel
    (each window is scaled by the range of its observed times and values: one point leaves it zero)."""
    from domainfm.models.fim import balanced_windows, overlapping_window_slices

    size, stride = balanced_windows(len(series.times), windows, overlap)
    for w, (s, e) in enumerate(overlapping_window_slices(len(series.times), windows, size, stride).tolist()):
        for j, name in enumerate(series.channels):
            seen = int(np.isfinite(series.values[s:e, j]).sum())
            if seen < 2:
                t0, t1 = series.timestamps(series.times[[s, e - 1]])
                what = "no observed point" if not seen else "only one observed point (at least two needed)"
                raise GappedSeriesError(f"{series.source}, column {name!r}: window {w} of {windows} (rows {s}..{e - 1}, "
                                        f"times {t0}..{t1}) has {what}; use fewer windows")


def to_dataframe(series: GappedSeries, values: np.ndarray, std: np.ndarray) -> pd.DataFrame:
    """Imputed table: time (each row's as the source gave it), then per channel the value, its std
    and whether it was observed."""
    stamps = series.time_labels if series.time_labels is not None else series.timestamps()
    out = {series.time_column: stamps}
    for j, name in enumerate(series.channels):
        out[name] = values[:, j]
        out[f"{name}_std"] = std[:, j]
        out[f"{name}_observed"] = series.observed[:, j]
    return pd.DataFrame(out)


def load_co2() -> GappedSeries:
    """Weekly Mauna Loa CO2 1958-2001 (statsmodels' ``co2``; NOAA, public domain): 2284 weeks,
    59 missing. Shipped in ``samples/fim/co2_weekly.csv``."""
    path = Path(__file__).parent / "samples" / "fim" / "co2_weekly.csv"
    return read_series(path, time="date")[0]


def gap_mask(n: int, d: int, fraction: float, rng: np.random.Generator, n_gaps: int = 3) -> np.ndarray:
    """``(n, d)`` bool, True where hidden: ``n_gaps`` contiguous gaps per channel covering
    ``fraction`` of the grid, never the first or last point."""
    hidden = np.zeros((n, d), dtype=bool)
    length = max(1, int(round(fraction * n / n_gaps)))
    for j in range(d):
        slots = np.sort(rng.choice(np.arange(1, n_gaps * 2, 2), size=n_gaps, replace=False))
        for s in slots:
            start = int(s * n / (n_gaps * 2)) - length // 2
            hidden[max(1, start): min(n - 1, start + length), j] = True
    return hidden


#: the baselines :func:`interpolate_baseline` offers
BASELINES = ("linear", "spline", "gp")
#: the GP baseline fits its kernel on at most this many observations of a series (evenly spaced)
GP_FIT_POINTS = 400


def interpolate_baseline(times: np.ndarray, values: np.ndarray, observed: np.ndarray, kind: str) -> np.ndarray:
    """Per channel, fill the series from its observed points: the interpolations a practitioner tries first.

    * ``"linear"``: ``np.interp``; held constant beyond the first and last observation.
    * ``"spline"``: a natural cubic spline (scipy) between the first and last observation, **held constant**
      at the end observations' values beyond them (a cubic extrapolated past the data is off by orders of
      magnitude within a few gaps' length); linear with fewer than 4 observations.
    * ``"gp"``: a Gaussian process (scikit-learn ``GaussianProcessRegressor``, kernel RBF + WhiteKernel,
      ``normalize_y=True``), fitted per channel by maximum marginal likelihood on the observed points, times
      scaled to the observed span so the length-scale's start (0.1) and bounds mean the same for every series;
      its posterior mean. On more than ``GP_FIT_POINTS`` (400) observations the kernel is fitted on 400 evenly
      spaced ones, then the GP is conditioned on all of them. Linear with fewer than 3 observations.

    **Shapes:** ``times (T,)``, ``values, observed (T, D)`` -> ``(T, D)``.
    """
    if kind not in BASELINES:
        raise ValueError(f"interpolate_baseline: kind={kind!r}; expected one of {', '.join(BASELINES)}")
    from scipy.interpolate import CubicSpline

    out = np.empty(values.shape, dtype=np.float64)
    for j in range(values.shape[1]):
        t, v = times[observed[:, j]], values[observed[:, j], j]
        if kind == "linear" or len(t) < (3 if kind == "gp" else 4):
            out[:, j] = np.interp(times, t, v)
        elif kind == "spline":
            out[:, j] = CubicSpline(t, v, bc_type="natural")(np.clip(times, t[0], t[-1]))
        else:
            out[:, j] = _gp_fill(times, t, v)
    return out


def _gp_fill(times: np.ndarray, t: np.ndarray, v: np.ndarray) -> np.ndarray:
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, WhiteKernel

    t0, span = t[0], max(t[-1] - t[0], 1e-12)
    x = ((t - t0) / span)[:, None]
    kernel = RBF(length_scale=0.1, length_scale_bounds=(1e-3, 1e3)) + WhiteKernel(1e-2, (1e-8, 1e1))
    gp = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=0, random_state=0)
    with warnings.catch_warnings():  # a noise-free series drives the white noise to its bound: expected
        warnings.simplefilter("ignore", ConvergenceWarning)
        if len(t) > GP_FIT_POINTS:
            # a long series (CO2: 2,225 weeks, ~70 s per fit): the kernel is fitted on an even subsample,
            # then conditioned on every observation with that kernel fixed
            sub = np.unique(np.linspace(0, len(t) - 1, GP_FIT_POINTS).round().astype(int))
            gp.fit(x[sub], v[sub])
            gp = GaussianProcessRegressor(gp.kernel_, normalize_y=True, optimizer=None)
        gp.fit(x, v)
    return gp.predict(((times - t0) / span)[:, None])


def masked_metrics(pred: np.ndarray, target: np.ndarray, mask: np.ndarray,
                   known: np.ndarray | None = None) -> dict[str, float]:
    """MAE, RMSE, MRE (PyPOTS: ``sum|p-t|m / sum|t m|``) on masked entries; R^2 on the entries whose
    truth is ``known`` (default all; a real gap has none)."""
    m = mask.astype(bool)
    err = np.abs(pred - target)
    out = {"mae": float(err[m].mean()) if m.any() else math.nan,
           "rmse": float(np.sqrt((err[m] ** 2).mean())) if m.any() else math.nan,
           "mre": float(err[m].sum() / max(np.abs(target[m]).sum(), 1e-12)) if m.any() else math.nan}
    k = np.ones_like(m) if known is None else known.astype(bool)
    mean = np.array([target[k[:, j], j].mean() for j in range(target.shape[1])])
    ss_res = ((pred - target) ** 2)[k].sum()
    ss_tot = ((target - mean) ** 2)[k].sum()
    out["r2"] = float(1 - ss_res / ss_tot) if ss_tot > 0 else math.nan
    return out


class HoldoutWindows(Dataset):
    """``n`` random windows of ``window_points`` points of one series, each with ``fraction`` of
    its observed points hidden (never the first row; a channel whose observed points would all be
    hidden in a window keeps them all as input there).

    **Shapes:** items ``(times (L,), values (L, D) with 0 at gaps, observed_input (L, D) bool,
    hidden (L, D) bool)``, ``L = min(window_points, T)``."""

    def __init__(self, series: GappedSeries, n: int, fraction: float, seed: int, window_points: int):
        rng = np.random.default_rng(seed)
        obs = series.observed
        t_len = len(series.times)
        length = min(window_points, t_len)
        self.items = []
        for _ in range(n):
            start = int(rng.integers(0, t_len - length + 1))
            sl = slice(start, start + length)
            o = obs[sl].copy()
            hide = o & (rng.random(o.shape) < fraction)
            hide[0] = False
            inp = o & ~hide
            inp[:, ~inp.any(axis=0)] = o[:, ~inp.any(axis=0)]
            hide &= ~inp
            self.items.append(tuple(torch.as_tensor(x) for x in (
                series.times[sl], np.nan_to_num(series.values[sl]), inp, hide)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
