"""Wearable behavioural data in, hourly tables and participant-weeks out.

Every reader returns the same table: a :class:`pandas.DataFrame` indexed by **tz-naive local
wall-clock hours** (each record placed by its own UTC offset, so nights stay nights across travel
and daylight-saving changes), one float column per variable, and **NaN where an hour has no record
of a variable** (never 0).

* :func:`read_healthkit` — Apple Health's ``export.zip`` as the Health app shares it (its
  ``export.xml`` streamed from the archive, never unpacked to disk), the ``export.xml`` itself or the
  unzipped ``apple_health_export/`` folder (streamed in bounded memory; a regex fast path over byte
  chunks, expat for the prolog and as the reference engine).
* :func:`read_fitbit` — Fitbit's account export (JSON files per measure, ``steps-2020-01-01.json``).
* :func:`read_long` — a long CSV/Parquet file or DataFrame ``timestamp, variable, value``.
* :func:`aggregate_minutes` / :func:`read_actigraphy` — minute-level actigraphy to hours.
* :func:`to_weeks` — ``(values (W, 168, V), observed, week_starts)`` z-scored per variable, with
  the statistics in ``.stats`` (store them in the model with ``model.set_zscore``).
* :func:`cohort_weeks` — many participants' tables -> their weeks, stacked and unscaled;
  :func:`split_participants` — train/val/test weeks, every participant's weeks in one split.
* :func:`handmade_features` — per-week means, SDs and 24-hour cosinor amplitudes (a probe baseline).
* :func:`participant_weeks` — any of the sources above (found by its kind) -> one participant's
  weeks in the variables' units, for a model that z-scores its own inputs (predict/embed).
* :func:`read_weeks_npz` / :func:`read_labels` — weeks already cut elsewhere (``.npz``) and their
  participant-level and weekly labels (CSV).
* :func:`openmhc_table` — our hourly table -> OpenMHC's 19 hourly channels in OpenMHC's units (the
  input of the ``wbm-openmhc`` weights); :func:`read_participant` applies it when a model asks
  for those channels.

Apple Health rules (all tested in ``tests/data_loaders/test_wearables.py``):

* *Cumulative* quantities (``steps, distance_km, flights, active_kcal, basal_kcal, exercise_min,
  stand_min``): an interval record is split across the hours it overlaps in proportion to the
  overlap (a record from 23:50 to 00:10 puts half its value in each day). When several sources
  (iPhone and Watch) record the same quantity in an hour, the hour counts **one** source, the one
  with the largest hourly total, never their sum (both devices count the same steps).
* *Samples* (``heart_rate, resting_hr, walking_hr, hrv_sdnn, respiratory_rate, spo2, wrist_temp,
  vo2max, walking_speed, step_length, walking_asymmetry, double_support, body_mass``): the mean of
  the samples that start in the hour, over all sources.
* *Sleep* (``HKCategoryTypeIdentifierSleepAnalysis``): ``sleep_min`` = minutes of the hour covered by
  asleep values (Core, Deep, REM, Unspecified, and the legacy Asleep), ``in_bed_min`` = minutes
  covered by InBed; overlapping records (two devices) are counted once (their union); Awake counts
  as neither.
* Units are converted to the column's unit (mi -> km, kJ -> kcal, degF -> degC, lb -> kg, ...);
  HealthKit's ``%`` holds fractions (0.97), converted to percent (97). An unknown unit is an error.
* A record's wall-clock start is its written local time; its duration is taken in absolute time
  (end minus start, both with their offsets), so a record spanning a DST change keeps its length.
  An offset beyond 14 hours from UTC or with minutes >= 60 (``+9999``) is an error, not a shift.

Security: the export carries an internal DTD; entity declarations of any kind (external entities
that would read files, or nested internal ones that expand exponentially) are refused with an
error, and external DTDs and parameter entities are never loaded. The same holds for the
``export.xml`` inside ``export.zip``: it is decompressed as it is read (memory bounded, nothing
written to disk, so a zip bomb costs time, never disk), and its CRC is checked at its end.
"""
from __future__ import annotations

import gc
import json
import os
import re
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from xml.parsers import expat

import numpy as np
import pandas as pd

__all__ = [
    "HealthDataError",
    "VARIABLES",
    "CUMULATIVE",
    "SAMPLES",
    "SLEEP",
    "HEALTHKIT_TYPES",
    "read_healthkit",
    "healthkit_export_file",
    "read_fitbit",
    "read_long",
    "aggregate_minutes",
    "read_actigraphy",
    "hourly_table",
    "ZScoreStats",
    "Weeks",
    "to_weeks",
    "cohort_weeks",
    "split_participants",
    "handmade_features",
    "read_participant",
    "participant_weeks",
    "read_weeks_npz",
    "read_labels",
    "OPENMHC_CHANNELS",
    "OPENMHC_SOURCES",
    "openmhc_table",
]


class HealthDataError(ValueError):
    """A wearable file that cannot be read: names the file, the field and what was expected."""


#: (scale, offset): value_in_column_unit = value * scale + offset
_COUNT = {"count": (1.0, 0.0)}
_KCAL = {"kcal": (1.0, 0.0), "Cal": (1.0, 0.0), "kJ": (1 / 4.184, 0.0), "cal": (1e-3, 0.0), "J": (1 / 4184.0, 0.0)}
_MINUTES = {"min": (1.0, 0.0), "s": (1 / 60, 0.0), "hr": (60.0, 0.0)}
_BPM = {"count/min": (1.0, 0.0), "count/s": (60.0, 0.0)}
_PERCENT = {"%": (100.0, 0.0)}  # HealthKit's percent unit stores fractions: 0.97 is 97 %

#: HealthKit quantity type -> (column, kind, accepted units)
HEALTHKIT_TYPES: dict[str, tuple[str, str, dict[str, tuple[float, float]]]] = {
    "HKQuantityTypeIdentifierStepCount": ("steps", "cumulative", _COUNT),
    "HKQuantityTypeIdentifierDistanceWalkingRunning": (
        "distance_km", "cumulative",
        {"km": (1.0, 0.0), "mi": (1.609344, 0.0), "m": (1e-3, 0.0), "ft": (3.048e-4, 0.0), "yd": (9.144e-4, 0.0)}),
    "HKQuantityTypeIdentifierFlightsClimbed": ("flights", "cumulative", _COUNT),
    "HKQuantityTypeIdentifierActiveEnergyBurned": ("active_kcal", "cumulative", _KCAL),
    "HKQuantityTypeIdentifierBasalEnergyBurned": ("basal_kcal", "cumulative", _KCAL),
    "HKQuantityTypeIdentifierAppleExerciseTime": ("exercise_min", "cumulative", _MINUTES),
    "HKQuantityTypeIdentifierAppleStandTime": ("stand_min", "cumulative", _MINUTES),
    "HKQuantityTypeIdentifierHeartRate": ("heart_rate", "sample", _BPM),
    "HKQuantityTypeIdentifierRestingHeartRate": ("resting_hr", "sample", _BPM),
    "HKQuantityTypeIdentifierWalkingHeartRateAverage": ("walking_hr", "sample", _BPM),
    "HKQuantityTypeIdentifierHeartRateVariabilitySDNN": ("hrv_sdnn", "sample", {"ms": (1.0, 0.0), "s": (1e3, 0.0)}),
    "HKQuantityTypeIdentifierRespiratoryRate": ("respiratory_rate", "sample", _BPM),
    "HKQuantityTypeIdentifierOxygenSaturation": ("spo2", "sample", _PERCENT),
    "HKQuantityTypeIdentifierAppleSleepingWristTemperature": (
        "wrist_temp", "sample", {"degC": (1.0, 0.0), "degF": (5 / 9, -32 * 5 / 9)}),
    "HKQuantityTypeIdentifierVO2Max": ("vo2max", "sample", {"mL/min·kg": (1.0, 0.0), "mL/(kg·min)": (1.0, 0.0),
                                                            "ml/(kg*min)": (1.0, 0.0)}),
    "HKQuantityTypeIdentifierWalkingSpeed": (
        "walking_speed", "sample", {"km/hr": (1.0, 0.0), "mi/hr": (1.609344, 0.0), "m/s": (3.6, 0.0)}),
    "HKQuantityTypeIdentifierWalkingStepLength": (
        "step_length", "sample", {"cm": (1.0, 0.0), "m": (100.0, 0.0), "in": (2.54, 0.0), "ft": (30.48, 0.0)}),
    "HKQuantityTypeIdentifierWalkingAsymmetryPercentage": ("walking_asymmetry", "sample", _PERCENT),
    "HKQuantityTypeIdentifierWalkingDoubleSupportPercentage": ("double_support", "sample", _PERCENT),
    "HKQuantityTypeIdentifierBodyMass": (
        "body_mass", "sample", {"kg": (1.0, 0.0), "lb": (0.45359237, 0.0), "g": (1e-3, 0.0), "st": (6.35029318, 0.0)}),
}
SLEEP_TYPE = "HKCategoryTypeIdentifierSleepAnalysis"
_ASLEEP = {"HKCategoryValueSleepAnalysisAsleep", "HKCategoryValueSleepAnalysisAsleepUnspecified",
           "HKCategoryValueSleepAnalysisAsleepCore", "HKCategoryValueSleepAnalysisAsleepDeep",
           "HKCategoryValueSleepAnalysisAsleepREM"}
_IN_BED = {"HKCategoryValueSleepAnalysisInBed"}
_AWAKE = {"HKCategoryValueSleepAnalysisAwake"}

CUMULATIVE = tuple(v for v, k, _ in HEALTHKIT_TYPES.values() if k == "cumulative")
SAMPLES = tuple(v for v, k, _ in HEALTHKIT_TYPES.values() if k == "sample")
SLEEP = ("sleep_min", "in_bed_min")
#: every column :func:`read_healthkit` can produce, in this order (the models' default input)
VARIABLES = CUMULATIVE + SAMPLES + SLEEP
#: how each known variable aggregates to an hour in the other readers (sum or mean)
_KINDS = {**{v: "cumulative" for v in CUMULATIVE + SLEEP + ("total_kcal", "activity_counts")},
          **{v: "sample" for v in SAMPLES}}

_HOUR = 3600


def _check_variables(variables: Iterable[str] | None, known: Sequence[str], where: str) -> list[str]:
    if variables is None:
        return list(known)
    variables = [variables] if isinstance(variables, str) else list(variables)
    unknown = [v for v in variables if v not in known]
    if unknown:
        raise ValueError(f"{where}: unknown variable(s) {unknown}; known: {list(known)}")
    return variables


# --------------------------------------------------------------------------- Apple Health dates


_DAYS_BEFORE_MONTH = np.array([0, 0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334], dtype=np.int64)


def _days_from_civil(y, m, d):
    """Days since 1970-01-01 of proleptic Gregorian dates (vectorised)."""
    leap_before = (y - 1) // 4 - (y - 1) // 100 + (y - 1) // 400 - (1969 // 4 - 1969 // 100 + 1969 // 400)
    is_leap = ((y % 4 == 0) & (y % 100 != 0)) | (y % 400 == 0)
    return (y - 1970) * 365 + leap_before + _DAYS_BEFORE_MONTH[m] + (is_leap & (m > 2)) + d - 1


def _text(raw) -> str:
    """An attribute read by the fast path (UTF-8 bytes) or by expat (str) as str, for messages and names."""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


_MAX_OFFSET_MIN = 14 * 60
_DIGIT_POS = [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 21, 22, 23, 24]


def _parse_hk_dates(strings: Sequence, path, field: str) -> tuple[np.ndarray, np.ndarray]:
    """``"2023-03-26 01:30:00 +0100"`` -> (local wall-clock seconds since 1970, UTC offset seconds).

    Vectorised over a batch: ``strings`` are ``str`` (expat) or ASCII ``bytes`` (the fast path),
    read as a fixed-width character array whose code points are checked and combined as digits."""
    n = len(strings)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    arr = np.array(strings)
    if arr.dtype.kind not in "SU":
        raise HealthDataError(f"{path}: Record {field}: expected text")
    width = arr.dtype.itemsize // (1 if arr.dtype.kind == "S" else 4)
    codes = arr.view(np.uint8 if arr.dtype.kind == "S" else np.uint32).reshape(n, width)
    if width < 25:
        codes = np.pad(codes, ((0, 0), (0, 25 - width)))
    ok = (codes[:, 25:] == 0).all(1) if width > 25 else np.ones(n, dtype=bool)  # exactly 25 characters
    c = codes[:, :25].astype(np.int32)  # a string shorter than 25 ends in zeros, which fail the checks below
    ok &= ((c[:, _DIGIT_POS] >= 48) & (c[:, _DIGIT_POS] <= 57)).all(1)
    ok &= (c[:, 4] == 45) & (c[:, 7] == 45) & (c[:, 10] == 32) & (c[:, 13] == 58)
    ok &= (c[:, 16] == 58) & (c[:, 19] == 32) & ((c[:, 20] == 43) | (c[:, 20] == 45))
    if not ok.all():
        bad = _text(strings[int(np.flatnonzero(~ok)[0])])
        raise HealthDataError(f"{path}: Record {field}={bad!r}: expected 'YYYY-MM-DD hh:mm:ss +hhmm' "
                              "(Apple Health's date format)")

    def num(a, b):
        out = c[:, a] - 48
        for i in range(a + 1, b):
            out = out * 10 + (c[:, i] - 48)
        return out.astype(np.int64)

    y, mo, d = num(0, 4), num(5, 7), num(8, 10)
    hh, mm, ss = num(11, 13), num(14, 16), num(17, 19)
    wrong = (mo < 1) | (mo > 12) | (d < 1) | (d > 31) | (hh > 23) | (mm > 59) | (ss > 60)
    if wrong.any():
        bad = _text(strings[int(np.flatnonzero(wrong)[0])])
        raise HealthDataError(f"{path}: Record {field}={bad!r}: month, day or time out of range")
    # real UTC offsets lie within -12:00 .. +14:00 (Kiribati's Line Islands); ISO 8601 minutes are
    # < 60. Anything else (+9999) is damage, and would shift the record by days without a word.
    off_h, off_m = num(21, 23), num(23, 25)
    wrong = (off_m > 59) | (off_h * 60 + off_m > _MAX_OFFSET_MIN)
    if wrong.any():
        bad = _text(strings[int(np.flatnonzero(wrong)[0])])
        raise HealthDataError(f"{path}: Record {field}={bad!r}: UTC offset {bad[20:]!r} out of range (expected "
                              "+hhmm or -hhmm with minutes < 60, at most 14 hours from UTC)")
    sign = np.where(c[:, 20] == 45, -1, 1)
    offset = sign * (off_h * 3600 + off_m * 60)
    local = _days_from_civil(y, mo, d) * 86400 + hh * 3600 + mm * 60 + ss
    return local, offset


# --------------------------------------------------------------------------- hourly accumulators


class _Accumulator:
    """Hourly sums keyed by integers, compressed by group-by whenever the buffer grows (bounded
    memory: the size is the number of distinct keys, not of records)."""

    def __init__(self, columns: Sequence[str], limit: int = 2_000_000):
        self.columns, self.limit = list(columns), limit
        self.parts: list[pd.DataFrame] = []
        self.rows = 0

    def add(self, frame: pd.DataFrame) -> None:
        if len(frame):
            self.parts.append(frame)
            self.rows += len(frame)
            if self.rows > self.limit:
                self.parts = [self.result()]
                self.rows = len(self.parts[0])

    def result(self) -> pd.DataFrame:
        if not self.parts:
            return pd.DataFrame(columns=self.columns + ["sum", "count"])
        frame = pd.concat(self.parts, ignore_index=True)
        return frame.groupby(self.columns, as_index=False, sort=False)[["sum", "count"]].sum()


def _merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals ``[start, end)`` as sorted disjoint intervals."""
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    running_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > running_end[:-1]
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _split_hours(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of intervals ``[start, end)`` (seconds) per hour: (record index, hour, overlap seconds).
    A zero-length interval gives one piece of overlap 0 in its hour."""
    h0 = np.floor_divide(start, _HOUR)
    h1 = np.where(end > start, np.floor_divide(end - 1, _HOUR), h0)
    counts = (h1 - h0 + 1).astype(np.int64)
    idx = np.repeat(np.arange(len(start)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    hour = h0[idx] + (np.arange(len(idx)) - first)
    overlap = np.minimum(end[idx], (hour + 1) * _HOUR) - np.maximum(start[idx], hour * _HOUR)
    return idx, hour, overlap


class _HourlyBuilder:
    """Collects cumulative records (per source), samples and sleep intervals; emits the hourly table."""

    def __init__(self, variables: Sequence[str], start=None, end=None):
        self.variables = list(variables)
        self.var_id = {v: i for i, v in enumerate(self.variables)}
        self.sources: dict[str, int] = {}
        self.cumulative = _Accumulator(["var", "source", "hour"])
        self.samples = _Accumulator(["var", "hour"])
        self.sleep: dict[str, tuple[np.ndarray, np.ndarray]] = {
            v: (np.zeros(0, np.int64), np.zeros(0, np.int64)) for v in SLEEP}
        self.lo = None if start is None else int(pd.Timestamp(start).value // 10**9)
        self.hi = None if end is None else int(pd.Timestamp(end).value // 10**9)

    def _window(self, start: np.ndarray, end: np.ndarray | None) -> np.ndarray:
        """Records that reach into ``[start, end)`` of the read (samples by their start)."""
        keep = np.ones(len(start), dtype=bool)
        if self.lo is not None:
            keep &= (start >= self.lo) if end is None else ((end > self.lo) | (start >= self.lo))
        if self.hi is not None:
            keep &= start < self.hi
        return keep

    def source_ids_of(self, codes: np.ndarray, names: Sequence[str]) -> np.ndarray:
        """Stable integer ids of sources across batches, from a batch's factorised names."""
        table = np.array([self.sources.setdefault(u, len(self.sources)) for u in names], dtype=np.int64)
        return table[codes]

    def add_cumulative(self, var: np.ndarray, source: np.ndarray, start: np.ndarray, end: np.ndarray,
                       value: np.ndarray) -> None:
        keep = self._window(start, end)
        var, source, start, end, value = var[keep], source[keep], start[keep], end[keep], value[keep]
        idx, hour, overlap = _split_hours(start, end)
        duration = (end - start)[idx]
        share = np.where(duration > 0, overlap / np.maximum(duration, 1), 1.0)
        self.cumulative.add(pd.DataFrame({"var": var[idx], "source": source[idx], "hour": hour,
                                          "sum": value[idx] * share, "count": np.ones(len(idx), np.int64)}))

    def add_samples(self, var: np.ndarray, start: np.ndarray, value: np.ndarray) -> None:
        keep = self._window(start, None)
        self.samples.add(pd.DataFrame({"var": var[keep], "hour": np.floor_divide(start[keep], _HOUR),
                                       "sum": value[keep], "count": np.ones(int(keep.sum()), np.int64)}))

    def add_sleep(self, column: str, start: np.ndarray, end: np.ndarray) -> None:
        keep = self._window(start, end)
        s0, e0 = self.sleep[column]
        self.sleep[column] = _merge_intervals(np.concatenate([s0, start[keep]]), np.concatenate([e0, end[keep]]))

    def table(self) -> pd.DataFrame:
        pieces: dict[str, pd.Series] = {}
        cum = self.cumulative.result()
        if len(cum):
            # one source per (variable, hour): the one with the largest hourly total
            best = cum.loc[cum.groupby(["var", "hour"], sort=False)["sum"].idxmax()]
            for var_id, group in best.groupby("var"):
                pieces[self.variables[int(var_id)]] = pd.Series(group["sum"].to_numpy(float),
                                                                index=group["hour"].to_numpy(np.int64))
        smp = self.samples.result()
        if len(smp):
            for var_id, group in smp.groupby("var"):
                pieces[self.variables[int(var_id)]] = pd.Series((group["sum"] / group["count"]).to_numpy(float),
                                                                index=group["hour"].to_numpy(np.int64))
        for column, (s, e) in self.sleep.items():
            if column in self.var_id and len(s):
                _, hour, overlap = _split_hours(s, e)
                minutes = pd.Series(overlap / 60.0).groupby(hour).sum()
                pieces[column] = minutes[minutes > 0]
        return _assemble(pieces, self.variables, self.lo, self.hi)


def _assemble(pieces: Mapping[str, pd.Series], variables: Sequence[str], lo=None, hi=None) -> pd.DataFrame:
    """Hour-integer series -> a table on the full hourly range (NaN where a variable has no record)."""
    hours = [s.index.to_numpy(np.int64) for s in pieces.values() if len(s)]
    if not hours:
        index = pd.DatetimeIndex([], name="time")
        return pd.DataFrame({v: pd.Series(dtype=float) for v in variables}, index=index)
    first = min(int(h.min()) for h in hours)
    last = max(int(h.max()) for h in hours)
    if lo is not None:
        first = max(first, lo // _HOUR)
    if hi is not None:
        last = min(last, (hi - 1) // _HOUR)
    grid = np.arange(first, last + 1, dtype=np.int64)
    data = {}
    for v in variables:
        s = pieces.get(v)
        data[v] = np.full(len(grid), np.nan) if s is None else s.reindex(grid).to_numpy(float)
    index = pd.DatetimeIndex(pd.to_datetime(grid * _HOUR, unit="s"), name="time")
    return pd.DataFrame(data, index=index)


# --------------------------------------------------------------------------- read_healthkit


_CHUNK = 1 << 23  # bytes read at a time by the fast path (8 MiB; memory does not grow with the file)
_MAX_GAP = 1 << 24  # bytes without a '<' the fast path carries over before it hands the file to expat

#: a Record start tag in the attribute order the Health app writes (type, sourceName,
#: sourceVersion, device, unit, creationDate, startDate, endDate, value); groups: type, sourceName,
#: unit, startDate, endDate, value, "/" of an empty-element tag. A chunk in which some Record tag
#: does not match it (another order, quoting or spacing) is read with the general pattern instead.
_RECORD_FAST = re.compile(
    rb'<Record type="([^"]*)" sourceName="([^"]*)"(?: sourceVersion="[^"]*")?(?: device="[^"]*")?'
    rb'(?: unit="([^"]*)")?(?: creationDate="[^"]*")? startDate="([^"]*)" endDate="([^"]*)" '
    rb'value="([^"]*)"(?: device="[^"]*")?\s*(/?)>')
_RECORD_OPEN = re.compile(rb"<Record[\s/>]")
_RECORD_TAG = re.compile(rb"<Record(?=[\s/>])((?:\s+[^\s=<>/\"']+\s*=\s*(?:\"[^\"<]*\"|'[^'<]*'))*)\s*(/?)>")
_ATTRIBUTE = re.compile(rb"([^\s=<>/\"']+)\s*=\s*(?:\"([^\"<]*)\"|'([^'<]*)')")
#: an ampersand that does not start one of the five predefined entities or a character reference
_BAD_REFERENCE = re.compile(rb"&(?!(?:amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);)")
_REFERENCE = re.compile(rb"&(amp|lt|gt|quot|apos|#[0-9]+|#x[0-9a-fA-F]+);|[\t\n]")
_PREDEFINED = {b"amp": b"&", b"lt": b"<", b"gt": b">", b"quot": b'"', b"apos": b"'"}
_ENTITY_DECL = re.compile(rb"<!ENTITY\s+(?:%\s+)?([^\s>]*)")
_ROOT_CLOSE = re.compile(rb"</HealthData\s*>\s*\Z")
_NOT_WANTED = -2  # variable id of a Record type that is not read (sleep is -1)


class _UseExpat(Exception):
    """Something the fast path does not read exactly (a comment, an attribute default in the DTD,
    a tag it cannot take apart) or an XML error: the file is read again by expat, which then gives
    the result or the exact error with its line and column."""


def _entity_refused(path, line, name) -> HealthDataError:
    return HealthDataError(
        f"{path}: line {line}: the XML declares entity {name!r}; entity declarations are refused (an Apple Health "
        "export has none, and external or nested entities are an attack vector)")


def _unescape(raw: bytes, path) -> bytes:
    """An attribute value as XML gives it: line ends normalised, a literal tab or newline becomes a
    space, the five predefined entities and character references decoded."""
    raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def sub(match):
        name = match.group(1)
        if name is None:
            return b" "
        if name[:1] != b"#":
            return _PREDEFINED[name]
        code = int(name[2:], 16) if name[1:2] == b"x" else int(name[1:])
        if not (code in (9, 10, 13) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or 0x10000 <= code <= 0x10FFFF):
            raise HealthDataError(f"{path}: malformed XML: character reference &{name.decode()}; is not an XML "
                                  "character")
        return chr(code).encode("utf-8")

    return _REFERENCE.sub(sub, raw)


def _unescape_column(column: Sequence[bytes], path) -> Sequence[bytes]:
    joined = b"\x00".join(column)
    if b"<" in joined:  # not allowed in an attribute value (expat reports where)
        raise _UseExpat("'<' in an attribute value")
    if b"&" not in joined and b"\n" not in joined and b"\t" not in joined and b"\r" not in joined:
        return column
    return [_unescape(x, path) if (b"&" in x or b"\n" in x or b"\t" in x or b"\r" in x) else x for x in column]


def _check_prolog(f, path) -> dict:
    """Expat reads the file up to the root's start tag (the XML declaration and the DOCTYPE with its
    internal DTD): entity declarations are refused, external entities never read, the root must be
    <HealthData>. Returns the root tag's byte offset and line, and whether the fast path reads this
    file exactly (UTF-8, no attribute defaults declared for Record)."""
    info = {"offset": None, "line": 1, "exact": True}
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)

    class Root(Exception):
        pass

    def refuse_entity(name, *args):
        raise _entity_refused(path, parser.CurrentLineNumber, name)

    def refuse_external(context, base, system_id, public_id):
        raise HealthDataError(f"{path}: line {parser.CurrentLineNumber}: reference to external entity "
                              f"{system_id!r} refused (external entities are never read)")

    def declaration(version, encoding, standalone):
        if encoding and encoding.lower() not in ("utf-8", "utf8", "us-ascii", "ascii"):
            info["exact"] = False

    def attlist(element, attribute, kind, default, required):
        if element == "Record" and default is not None:  # expat would add the default to every Record
            info["exact"] = False

    def start(name, attrs):
        if name != "HealthData":
            raise HealthDataError(f"{path}: root element is <{name}>, expected <HealthData>: not an Apple Health "
                                  "export.xml")
        info["offset"], info["line"] = parser.CurrentByteIndex, parser.CurrentLineNumber
        raise Root

    parser.EntityDeclHandler = refuse_entity
    parser.UnparsedEntityDeclHandler = refuse_entity
    parser.ExternalEntityRefHandler = refuse_external
    parser.XmlDeclHandler = declaration
    parser.AttlistDeclHandler = attlist
    parser.StartElementHandler = start
    first = True
    while True:
        data = f.read(1 << 16)
        if first and data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16: expat reads it, the fast path does not
            info["exact"] = False
        first = False
        try:
            parser.Parse(data, not data)
        except Root:
            return info
        except expat.ExpatError as exc:
            raise _xml_error(path, exc) from None
        if not data:
            raise HealthDataError(f"{path}: no XML element found: not an Apple Health export.xml")


def _xml_error(path, exc: expat.ExpatError) -> HealthDataError:
    what = "truncated" if "no element found" in str(exc) or "unclosed token" in str(exc) else "malformed"
    return HealthDataError(f"{path}: {what} XML at line {exc.lineno}, column {exc.offset}: "
                           f"{expat.ErrorString(exc.code)}")


def healthkit_export_file(folder: str | os.PathLike) -> Path | None:
    """The ``export.xml`` of an unzipped Apple Health export: ``folder/export.xml`` (``folder`` is
    the ``apple_health_export`` folder) or ``folder/apple_health_export/export.xml`` (the folder
    ``export.zip`` was unpacked into); None when neither exists."""
    folder = Path(folder)
    for candidate in (folder / "export.xml", folder / "apple_health_export" / "export.xml"):
        if candidate.is_file():
            return candidate
    return None


_ZIP_MEMBER = "apple_health_export/export.xml"  # where the Health app puts it in export.zip


def _zip_member(archive: zipfile.ZipFile, path: Path) -> zipfile.ZipInfo:
    """The ``export.xml`` of Apple Health's ``export.zip``: ``apple_health_export/export.xml``, else
    the one ``export.xml`` at any depth (a re-zipped export; macOS's ``__MACOSX/`` copies ignored)."""
    files = [i for i in archive.infolist() if not i.is_dir()]
    names = [i.filename.replace("\\", "/") for i in files]
    found = [i for i, n in zip(files, names) if (n == "export.xml" or n.endswith("/export.xml"))
             and not n.startswith("__MACOSX/")]
    chosen = [i for i in found if i.filename == _ZIP_MEMBER] or found
    if not chosen:
        held = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise HealthDataError(f"{path}: no export.xml in this zip (expected {_ZIP_MEMBER}, as the Health app writes "
                              f"export.zip); it holds {held or 'nothing'}")
    if len(chosen) > 1:
        listed = ", ".join(i.filename for i in chosen)
        raise HealthDataError(f"{path}: {len(chosen)} export.xml files in this zip ({listed}); expected one (Apple "
                              "Health's export.zip); unzip it and pass the one to read")
    return chosen[0]


@contextmanager
def _export_stream(path: Path):
    """``(binary file, name for messages, size in bytes)`` of an ``export.xml``, or of the one inside
    an ``export.zip`` (named ``export.zip/apple_health_export/export.xml``, as :class:`zipfile.Path`
    does), decompressed as it is read: never extracted to disk."""
    if path.suffix.lower() != ".zip":
        with open(path, "rb") as f:
            yield f, path, path.stat().st_size
        return
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise HealthDataError(f"{path}: not a readable zip archive ({exc}); expected Apple Health's export.zip") \
            from None
    with archive:
        info = _zip_member(archive, path)
        where = f"{path}/{info.filename}"
        if info.flag_bits & 0x1:
            raise HealthDataError(f"{where}: the member is encrypted; expected Apple Health's export.zip (not "
                                  "encrypted): unzip it and pass the folder")
        try:
            f = archive.open(info)
        except NotImplementedError as exc:  # e.g. Deflate64, which some zip tools use for large files
            raise HealthDataError(f"{where}: {exc} (compression method {info.compress_type}); unzip it and pass "
                                  "the folder") from None
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise HealthDataError(f"{where}: damaged zip archive ({exc})") from None
        with f:
            try:
                yield f, where, info.file_size
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # bad CRC, corrupt or truncated data
                raise HealthDataError(f"{where}: damaged zip archive ({exc})") from None


def read_healthkit(path: str | os.PathLike, *, variables: Iterable[str] | None = None, start=None, end=None,
                   batch_size: int = 200_000, return_stats: bool = False, engine: str = "fast"):
    """Read an Apple Health ``export.xml`` into an hourly table (rules in the module docstring).

    The file is streamed in bounded memory, from ``export.zip`` too (no tree is built): records of
    interest are buffered ``batch_size`` at a time and folded, vectorised, into per-hour
    accumulators, so memory depends on the number of hours and sources, not on the file.

    Two engines read the records. ``"fast"`` (default, ~10x expat): expat checks the prolog (XML
    declaration, DOCTYPE and its internal DTD, the <HealthData> root); the body is read in 8 MiB
    chunks, and one compiled regular expression takes the attributes of every ``<Record`` start tag
    of a chunk at once (a tag cut by the chunk's end waits for the next). The body is checked
    cheaply for what would change its meaning or reveal damage: an entity declaration anywhere is
    refused; an entity reference other than the five predefined ones and character references,
    unbalanced Record elements, a tag that cannot be taken apart, or a document that does not end
    with ``</HealthData>`` (truncation) send the file to expat, which gives the exact error (or the
    table, for the few valid files the fast path does not read: comments, CDATA or processing
    instructions in the body, attribute defaults declared for Record, a non-UTF-8 encoding).
    Other damage outside Record start tags (a broken ``<Workout>`` tag) is not detected by the fast
    path; ``engine="expat"`` checks the whole file's well-formedness (expat with a Python callback
    per element; the reference the fast path is tested against).

    Args:
        path: ``export.zip`` as the Health app shares it (its ``apple_health_export/export.xml``
            is streamed from the archive; errors name it ``export.zip/apple_health_export/export.xml``),
            the ``export.xml`` file (the ``apple_health_export`` folder's main file), or a folder
            holding it (see :func:`healthkit_export_file`).
        variables: columns to produce (default :data:`VARIABLES`); records of other types are skipped.
        start, end: keep hours in ``[start, end)`` (local wall-clock, anything ``pandas.Timestamp`` reads).
        batch_size: records buffered before they are folded into the accumulators.
        return_stats: also return ``{"records", "used", "bytes", "engine"}`` (for benchmarks).
        engine: ``"fast"`` or ``"expat"``.

    Returns:
        a DataFrame indexed by tz-naive local hours (``time``), one float column per variable.

    Raises:
        HealthDataError: not an Apple Health export, malformed or truncated XML, an entity
        declaration, a missing attribute, a bad date, value or unit; a zip that is damaged or
        holds no ``export.xml``. The message names the file (and the zip's member) and, where it
        has one, the line.
    """
    path = Path(path)
    if path.is_dir():
        found = healthkit_export_file(path)
        if found is None:
            raise HealthDataError(f"{path}: no export.xml in this folder or in its apple_health_export/ folder "
                                  "(expected Apple Health's export.xml, or the folder its export.zip unpacks to)")
        path = found
    variables = _check_variables(variables, VARIABLES, "read_healthkit")
    if engine not in ("fast", "expat"):
        raise ValueError(f"read_healthkit: engine={engine!r}: expected 'fast' or 'expat'")
    if batch_size < 1:
        raise ValueError(f"read_healthkit: batch_size={batch_size}: expected a positive integer")
    if not path.is_file():
        raise HealthDataError(f"{path}: no such file (expected Apple Health's export.zip or export.xml)")
    var_id = {v: i for i, v in enumerate(variables)}
    wanted: dict[str, int] = {t: var_id[c] for t, (c, _, _) in HEALTHKIT_TYPES.items() if c in var_id}
    if any(v in var_id for v in SLEEP):
        wanted[SLEEP_TYPE] = -1
    with _export_stream(path) as (f, where, size):
        prolog = _check_prolog(f, where)
        table = state = None
        if engine == "fast" and prolog["exact"]:
            builder = _HourlyBuilder(variables, start, end)
            state = {"records": 0, "used": 0, "engine": "fast"}
            collecting = gc.isenabled()
            gc.disable()  # millions of short-lived tuples make the cyclic collector run often for nothing
            try:
                _read_fast(f, where, prolog, builder, wanted, batch_size, state)
                table = builder.table()
            except _UseExpat:
                table = None
            finally:
                if collecting:
                    gc.enable()
        if table is None:
            f.seek(0)
            builder = _HourlyBuilder(variables, start, end)
            state = {"records": 0, "used": 0, "engine": "expat"}
            _read_expat(f, where, builder, wanted, batch_size, state)
            table = builder.table()
    if return_stats:
        return table, {**state, "bytes": size}
    return table


def _read_fast(f, path, prolog: dict, builder: "_HourlyBuilder", wanted: dict[str, int], batch_size: int,
               state: dict) -> None:
    """The fast path of :func:`read_healthkit` (see there); raises :class:`_UseExpat` to hand over."""
    wanted_b = {t.encode(): v for t, v in wanted.items()}
    position = prolog["offset"]  # file offset of the next part (lines are counted only for an error)
    f.seek(position)
    carry = b""
    open_records = 0
    pending: list[tuple] = []  # (var, source, unit, start, end, value) column pieces not yet folded
    n_pending = 0

    def line_at(offset: int) -> int:
        here = f.tell()
        f.seek(0)
        lines, done = 1, 0
        while done < offset:
            block = f.read(min(_CHUNK, offset - done))
            lines += block.count(b"\n")
            done += len(block)
        f.seek(here)
        return lines

    while True:
        data = f.read(_CHUNK)
        if not data:  # the rest must close the root element, with every Record closed
            if open_records or not _ROOT_CLOSE.match(carry):
                raise _UseExpat("not closed: truncated or malformed")
            break
        buf = carry + data if carry else data
        del data
        cut = buf.rfind(b"<")  # a tag never contains '<': everything before the last one is whole tags
        if cut <= 0:
            if len(buf) > _MAX_GAP:  # a zip bomb's filler: expat streams it in bounded memory
                raise _UseExpat("no tag in 16 MiB")
            carry = buf
            continue
        part, carry = buf[:cut], buf[cut:]
        del buf
        if b"<!" in part or b"<?" in part:
            declared = _ENTITY_DECL.search(part)
            if declared:
                raise _entity_refused(path, line_at(position + declared.start()),
                                      declared.group(1).decode("utf-8", "replace"))
            raise _UseExpat("comment, CDATA, processing instruction or declaration in the body")
        if b"</HealthData" in part or _BAD_REFERENCE.search(part):
            raise _UseExpat("content after the root element, or an undefined entity")
        rows = _RECORD_FAST.findall(part)
        if len(rows) != part.count(b"<Record"):  # a tag in another form (or one pattern match spanning two)
            rows = _general_records(part, path, lambda at: line_at(position + at), wanted_b)
        open_records -= part.count(b"</Record")
        position += len(part)
        del part
        if rows:
            types, sources, units, starts, ends, values, empty = ([r[k] for r in rows] for k in range(7))
            del rows
            open_records += len(types) - empty.count(b"/")
            state["records"] += len(types)
            codes, uniques = pd.factorize(np.asarray(types, dtype=object))
            lookup = np.array([wanted_b.get(_unescape(u, path), _NOT_WANTED) for u in uniques], dtype=np.int64)
            var = lookup[codes]
            keep = var != _NOT_WANTED
            if keep.all():
                columns = (sources, units, starts, ends, values)
            elif keep.any():
                mask = keep.tolist()
                columns = tuple(list(compress(column, mask)) for column in (sources, units, starts, ends, values))
                var = var[keep]
            else:
                columns = None
            if columns is not None:
                pending.append((var, *(_unescape_column(column, path) for column in columns)))
                n_pending += len(var)
        if open_records not in (0, 1):  # Records do not nest: at most one open between tags
            raise _UseExpat("unbalanced Record elements")
        if n_pending >= batch_size:
            n_pending = _fold_pending(pending, batch_size, builder, path, state)
    while pending:
        _fold_pending(pending, batch_size, builder, path, state, final=True)


def _fold_pending(pending: list[tuple], batch_size: int, builder, path, state: dict, final: bool = False) -> int:
    """Fold the pending column pieces in batches of ``batch_size`` records (all of them when
    ``final``); leaves the remainder in ``pending`` and returns its size."""
    var = np.concatenate([p[0] for p in pending])
    columns = [var] + [[x for p in pending for x in p[k]] if len(pending) > 1 else list(pending[0][k])
                       for k in range(1, 6)]
    pending.clear()
    n = len(var)
    stop = n if final else n - n % batch_size
    for lo in range(0, stop, batch_size):
        _fold([c[lo:lo + batch_size] for c in columns], builder, path)
        state["used"] += min(batch_size, stop - lo)
    if stop < n:
        pending.append(tuple(c[stop:] for c in columns))
    return n - stop


def _general_records(part: bytes, path, line_at, wanted_b: dict[bytes, int]) -> list[tuple]:
    """Record start tags in any attribute order, quoting or spacing -> the fast pattern's tuples."""
    tags = list(_RECORD_TAG.finditer(part))
    if [m.start() for m in tags] != [m.start() for m in _RECORD_OPEN.finditer(part)]:
        raise _UseExpat("a Record tag the general pattern cannot take apart")
    rows = []
    for m in tags:
        attrs: dict[bytes, bytes] = {}
        for a in _ATTRIBUTE.finditer(m.group(1)):
            if a.group(1) in attrs:
                raise _UseExpat("duplicate attribute")
            attrs[a.group(1)] = a.group(2) if a.group(2) is not None else a.group(3)
        kind = attrs.get(b"type", b"")
        if _unescape(kind, path) in wanted_b:
            for key in (b"startDate", b"endDate", b"value"):
                if key not in attrs:
                    raise HealthDataError(f"{path}: line {line_at(m.start())}: Record of type "
                                          f"{_text(_unescape(kind, path))!r} has no {key.decode()!r} attribute")
        rows.append((kind, attrs.get(b"sourceName", b""), attrs.get(b"unit", b""), attrs.get(b"startDate", b""),
                     attrs.get(b"endDate", b""), attrs.get(b"value", b""), m.group(2)))
    return rows


def _read_expat(f, path, builder: "_HourlyBuilder", wanted: dict[str, int], batch_size: int, state: dict) -> None:
    """The reference engine: expat with a callback per element (full well-formedness check)."""
    buffer: list[list] = [[] for _ in range(6)]
    parser = expat.ParserCreate()

    def refuse_entity(name, *args):
        raise _entity_refused(path, parser.CurrentLineNumber, name)

    def refuse_external(context, base, system_id, public_id):
        raise HealthDataError(f"{path}: line {parser.CurrentLineNumber}: reference to external entity "
                              f"{system_id!r} refused (external entities are never read)")

    root = []

    def start_element(name, attrs):
        if not root:
            root.append(name)
            if name != "HealthData":
                raise HealthDataError(f"{path}: root element is <{name}>, expected <HealthData>: not an Apple Health "
                                      "export.xml")
        if name != "Record":
            return
        state["records"] += 1
        var = wanted.get(attrs.get("type"))
        if var is None:
            return
        try:
            row = (var, attrs.get("sourceName", ""), attrs.get("unit", ""), attrs["startDate"], attrs["endDate"],
                   attrs["value"])
        except KeyError as exc:
            raise HealthDataError(f"{path}: line {parser.CurrentLineNumber}: Record of type {attrs.get('type')!r} "
                                  f"has no {exc.args[0]!r} attribute") from None
        for column, x in zip(buffer, row):
            column.append(x)
        if len(buffer[0]) >= batch_size:
            _fold(buffer, builder, path)
            state["used"] += len(buffer[0])
            for column in buffer:
                column.clear()

    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.EntityDeclHandler = refuse_entity
    parser.UnparsedEntityDeclHandler = refuse_entity
    parser.ExternalEntityRefHandler = refuse_external
    parser.StartElementHandler = start_element
    try:
        parser.ParseFile(f)
    except expat.ExpatError as exc:
        raise _xml_error(path, exc) from None
    if not root:
        raise HealthDataError(f"{path}: no XML element found: not an Apple Health export.xml")
    if buffer[0]:
        _fold(buffer, builder, path)
        state["used"] += len(buffer[0])


def _decode(uniques, path, field: str) -> list[str]:
    out = []
    for u in uniques:
        try:
            out.append(u.decode("utf-8") if isinstance(u, bytes) else str(u))
        except UnicodeDecodeError:
            raise HealthDataError(f"{path}: Record {field}={u!r}: not UTF-8 text") from None
    return out


def _fold(columns: Sequence[Sequence], builder: "_HourlyBuilder", path) -> None:
    """Vectorised: dates, units, values and hour splitting of one batch of records (columns var,
    sourceName, unit, startDate, endDate, value; text as ``str`` from expat or ``bytes``)."""
    var_col, source_col, unit_col, start_col, end_col, value_col = columns
    var = np.asarray(var_col, dtype=np.int64)
    local_start, off_start = _parse_hk_dates(start_col, path, "startDate")
    local_end, off_end = _parse_hk_dates(end_col, path, "endDate")
    duration = (local_end - off_end) - (local_start - off_start)
    if (duration < 0).any():
        i = int(np.flatnonzero(duration < 0)[0])
        raise HealthDataError(f"{path}: Record with startDate={_text(start_col[i])!r} ends before it starts "
                              f"(endDate={_text(end_col[i])!r})")
    start = local_start
    end = local_start + duration  # wall-clock of the start, true duration (DST-safe)

    sleep = var == -1
    if sleep.any():
        codes, uniques = pd.factorize(np.asarray(value_col, dtype=object)[sleep])
        names = _decode(uniques, path, "value")
        known = _ASLEEP | _IN_BED | _AWAKE
        bad = [v for v in names if v not in known]
        if bad:
            raise HealthDataError(f"{path}: {SLEEP_TYPE} value {bad[0]!r} is not a known sleep category; expected "
                                  f"one of {sorted(known)}")
        for column, accepted in (("sleep_min", _ASLEEP), ("in_bed_min", _IN_BED)):
            if column in builder.var_id:
                pick = np.isin(codes, [k for k, v in enumerate(names) if v in accepted])
                builder.add_sleep(column, start[sleep][pick], end[sleep][pick])
    if sleep.all():
        return
    qi = np.flatnonzero(~sleep)
    every = len(qi) == len(var)
    values = value_col if every else [value_col[i] for i in qi]
    try:
        value = np.fromiter(map(float, values), dtype=np.float64, count=len(values))
    except ValueError:
        for x in values:
            try:
                float(x)
            except ValueError:
                raise HealthDataError(f"{path}: Record value={_text(x)!r} is not a number") from None
        raise
    qvar = var[qi]
    units = unit_col if every else [unit_col[i] for i in qi]
    unit_codes, unit_uniques = pd.factorize(np.asarray(units, dtype=object))
    unit_names = _decode(unit_uniques, path, "unit")
    combo = qvar * len(unit_names) + unit_codes
    pairs, inverse = np.unique(combo, return_inverse=True)
    scale_of, offset_of = np.empty(len(pairs)), np.empty(len(pairs))
    for k, pair in enumerate(pairs.tolist()):
        column = builder.variables[pair // len(unit_names)]
        unit = unit_names[pair % len(unit_names)]
        hk_type = next(t for t, (c, _, _) in HEALTHKIT_TYPES.items() if c == column)
        accepted = HEALTHKIT_TYPES[hk_type][2]
        if unit not in accepted:
            raise HealthDataError(f"{path}: {hk_type} record with unit={unit!r}: expected one of {sorted(accepted)}")
        scale_of[k], offset_of[k] = accepted[unit]
    value = value * scale_of[inverse] + offset_of[inverse]
    sources = source_col if every else [source_col[i] for i in qi]
    source_codes, source_uniques = pd.factorize(np.asarray(sources, dtype=object))
    source_ids = builder.source_ids_of(source_codes, _decode(source_uniques, path, "sourceName"))
    is_cum = np.isin(qvar, [builder.var_id[c] for c in CUMULATIVE if c in builder.var_id])
    qstart, qend = start[qi], end[qi]
    if is_cum.any():
        builder.add_cumulative(qvar[is_cum], source_ids[is_cum], qstart[is_cum], qend[is_cum], value[is_cum])
    if (~is_cum).any():
        builder.add_samples(qvar[~is_cum], qstart[~is_cum], value[~is_cum])


# --------------------------------------------------------------------------- other formats


_OFFSET_RE = re.compile(r"(?:[+-]\d{2}:?\d{2}|Z)$")


def _wall_clock(values, where: str) -> pd.DatetimeIndex:
    """Timestamps as written (a trailing UTC offset is dropped: the wall-clock time is kept)."""
    series = pd.Series(values)
    if pd.api.types.is_datetime64_any_dtype(series):
        out = series.dt.tz_localize(None) if series.dt.tz is not None else series
        return pd.DatetimeIndex(out)
    text = series.astype(str).str.strip().str.replace(_OFFSET_RE, "", regex=True)
    try:
        return pd.DatetimeIndex(pd.to_datetime(text, format="ISO8601"))
    except (ValueError, TypeError) as exc:
        raise HealthDataError(f"{where}: timestamp column: expected ISO 8601 date-times ({exc})") from None


def hourly_table(timestamps, variables, values, *, kinds: Mapping[str, str] | None = None,
                 where: str = "hourly_table") -> pd.DataFrame:
    """Point records (wall-clock time, variable, value) -> the hourly table: cumulative variables
    summed per hour, samples averaged; hours without a record are NaN."""
    kinds = {**_KINDS, **dict(kinds or {})}
    frame = pd.DataFrame({"hour": np.asarray(pd.DatetimeIndex(timestamps).floor("h").asi8 // 10**9 // _HOUR),
                          "variable": np.asarray(variables, dtype=object), "value": np.asarray(values, dtype=float)})
    frame = frame[np.isfinite(frame["value"])]
    unknown = sorted(set(frame["variable"]) - set(kinds))
    if unknown:
        raise HealthDataError(f"{where}: variable(s) {unknown} have no known aggregation; pass "
                              "kinds={name: 'cumulative' | 'sample'}")
    pieces = {}
    for name, group in frame.groupby("variable", sort=False):
        agg = group.groupby("hour")["value"]
        pieces[name] = agg.sum() if kinds[name] == "cumulative" else agg.mean()
    order = [v for v in VARIABLES if v in pieces] + sorted(v for v in pieces if v not in VARIABLES)
    return _assemble(pieces, order)


def read_long(source, *, variables: Iterable[str] | None = None, kinds: Mapping[str, str] | None = None,
              columns: tuple[str, str, str] = ("timestamp", "variable", "value")) -> pd.DataFrame:
    """A long table ``timestamp, variable, value`` (CSV, Parquet or a DataFrame) -> the hourly table.

    Timestamps are local wall-clock times (a written UTC offset is dropped, keeping the local
    time). Variables aggregate by kind: cumulative ones (the HealthKit cumulative names, sleep
    minutes, ``total_kcal``, ``activity_counts``) are summed per hour, samples averaged; other
    names need ``kinds``.
    """
    where = str(source) if not isinstance(source, pd.DataFrame) else "DataFrame"
    if isinstance(source, pd.DataFrame):
        frame = source
    else:
        path = Path(source)
        if not path.is_file():
            raise HealthDataError(f"{path}: no such file (expected a CSV or Parquet table)")
        frame = pd.read_parquet(path) if path.suffix.lower() in {".parquet", ".pq"} else pd.read_csv(path)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise HealthDataError(f"{where}: missing column(s) {missing}; expected columns {list(columns)}")
    ts, var, val = columns
    frame = frame[[ts, var, val]]
    if variables is not None:
        variables = [variables] if isinstance(variables, str) else list(variables)
        frame = frame[frame[var].isin(variables)]
    try:
        values = pd.to_numeric(frame[val])
    except (ValueError, TypeError):
        raise HealthDataError(f"{where}: column {val!r} must hold numbers") from None
    table = hourly_table(_wall_clock(frame[ts], where), frame[var].astype(str), values, kinds=kinds, where=where)
    if variables is not None:
        table = table.reindex(columns=variables)
    return table


def aggregate_minutes(frame: pd.DataFrame, *, timestamp: str = "timestamp", cumulative: Sequence[str] = (),
                      samples: Sequence[str] = (), sleep: str | None = None, min_minutes: int = 30,
                      where: str = "actigraphy") -> pd.DataFrame:
    """Minute-level actigraphy -> hours.

    ``cumulative`` columns (activity counts, steps, kcal) are summed, ``samples`` (heart rate)
    averaged, and ``sleep`` (a 0/1 asleep flag per minute) becomes ``sleep_min``. An hour with
    fewer than ``min_minutes`` recorded minutes of a column is missing (NaN): a device worn for
    five minutes does not give a five-minute hourly total.
    """
    needed = [timestamp, *cumulative, *samples] + ([sleep] if sleep else [])
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise HealthDataError(f"{where}: missing column(s) {missing}; columns are {list(frame.columns)}")
    if not 1 <= min_minutes <= 60:
        raise ValueError(f"aggregate_minutes: min_minutes={min_minutes}: expected 1..60")
    index = _wall_clock(frame[timestamp], where)
    data = frame.drop(columns=[timestamp]).set_index(index.floor("min"))
    data = data[~data.index.duplicated(keep="first")]
    hours = data.index.floor("h")
    pieces = {}
    for column, how in [(c, "sum") for c in cumulative] + [(c, "mean") for c in samples] + \
            ([(sleep, "sleep")] if sleep else []):
        try:
            series = pd.to_numeric(data[column])
        except (ValueError, TypeError):
            raise HealthDataError(f"{where}: column {column!r} must hold numbers") from None
        grouped = series.groupby(hours)
        counts = grouped.count()
        agg = grouped.mean() if how == "mean" else grouped.sum()
        agg = agg.where(counts >= min_minutes)
        name = "sleep_min" if how == "sleep" else column
        pieces[name] = pd.Series(agg.to_numpy(float), index=agg.index.asi8 // 10**9 // _HOUR)
    order = [v for v in VARIABLES if v in pieces] + [v for v in pieces if v not in VARIABLES]
    return _assemble(pieces, order)


def read_actigraphy(path: str | os.PathLike, *, timestamp: str = "timestamp", cumulative: Sequence[str] = ("activity",),
                    samples: Sequence[str] = (), sleep: str | None = None, min_minutes: int = 30) -> pd.DataFrame:
    """A minute-level actigraphy CSV/Parquet file -> hours (see :func:`aggregate_minutes`)."""
    path = Path(path)
    if not path.is_file():
        raise HealthDataError(f"{path}: no such file (expected a minute-level CSV or Parquet file)")
    frame = pd.read_parquet(path) if path.suffix.lower() in {".parquet", ".pq"} else pd.read_csv(path)
    return aggregate_minutes(frame, timestamp=timestamp, cumulative=cumulative, samples=samples, sleep=sleep,
                             min_minutes=min_minutes, where=str(path))


#: Fitbit export measure -> (column, kind, scale to the column's unit)
FITBIT_MEASURES = {
    "steps": ("steps", "cumulative", 1.0),
    "distance": ("distance_km", "cumulative", 1e-5),  # Fitbit's export writes centimetres
    "calories": ("total_kcal", "cumulative", 1.0),  # total (not active) energy per minute
    "heart_rate": ("heart_rate", "sample", 1.0),
    "sleep": (None, "sleep", 1.0),
}
_FITBIT_FILE = re.compile(r"^(?P<measure>[a-z_]+)-\d{4}-\d{2}-\d{2}\.json$")
_FITBIT_ASLEEP = {"asleep", "light", "deep", "rem", "restless"}


def _fitbit_time(text: str, path: Path) -> pd.Timestamp:
    try:
        if "/" in text:  # "01/31/20 23:59:00"
            return pd.Timestamp(pd.to_datetime(text, format="%m/%d/%y %H:%M:%S"))
        return pd.Timestamp(text[:19])  # "2020-01-31T23:59:00.000"
    except (ValueError, TypeError):
        raise HealthDataError(f"{path}: dateTime={text!r}: expected 'MM/DD/YY hh:mm:ss' or ISO 8601") from None


def read_fitbit(folder: str | os.PathLike, *, variables: Iterable[str] | None = None, tz: str | None = None) -> pd.DataFrame:
    """Fitbit's account export: ``<measure>-YYYY-MM-DD.json`` files (steps, distance, calories,
    heart_rate, sleep) under ``folder`` -> the hourly table.

    Minute values are summed (steps, distance in cm -> km, calories -> ``total_kcal``) or averaged
    (heart rate ``value.bpm``) per hour; sleep logs' ``levels.data`` stages (asleep, light, deep,
    rem, restless) give ``sleep_min`` and the whole log span ``in_bed_min``. Times are taken as
    written (local wall-clock); with ``tz`` they are read as UTC and converted to that zone's
    wall-clock time.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HealthDataError(f"{folder}: not a folder (expected Fitbit's export with <measure>-YYYY-MM-DD.json)")
    files = sorted(p for p in folder.rglob("*.json") if _FITBIT_FILE.match(p.name)
                   and _FITBIT_FILE.match(p.name)["measure"] in FITBIT_MEASURES)
    if not files:
        healthkit = healthkit_export_file(folder)
        if healthkit is not None:
            raise HealthDataError(f"{folder}: no Fitbit measure files; this is an Apple Health export ({healthkit}): "
                                  "read it with read_healthkit")
        raise HealthDataError(f"{folder}: no Fitbit measure files (<measure>-YYYY-MM-DD.json for "
                              f"{sorted(FITBIT_MEASURES)})")
    times, names, values = [], [], []
    sleep: dict[str, list[tuple[pd.Timestamp, pd.Timestamp]]] = {"sleep_min": [], "in_bed_min": []}
    for path in files:
        measure = _FITBIT_FILE.match(path.name)["measure"]
        column, kind, scale = FITBIT_MEASURES[measure]
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise HealthDataError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(entries, list):
            raise HealthDataError(f"{path}: expected a JSON list of entries, got {type(entries).__name__}")
        for entry in entries:
            if kind == "sleep":
                try:
                    begin, finish = _fitbit_time(entry["startTime"], path), _fitbit_time(entry["endTime"], path)
                    levels = entry.get("levels", {}).get("data", [])
                except (KeyError, TypeError, AttributeError):
                    raise HealthDataError(f"{path}: sleep log without startTime/endTime") from None
                sleep["in_bed_min"].append((begin, finish))
                for stage in levels:
                    if stage.get("level") in _FITBIT_ASLEEP:
                        s = _fitbit_time(stage["dateTime"], path)
                        sleep["sleep_min"].append((s, s + pd.Timedelta(seconds=float(stage["seconds"]))))
                continue
            try:
                raw = entry["value"]
                raw = raw["bpm"] if isinstance(raw, dict) else raw
                times.append(_fitbit_time(entry["dateTime"], path))
                values.append(float(raw) * scale)
                names.append(column)
            except (KeyError, TypeError, ValueError):
                raise HealthDataError(f"{path}: entry {entry!r}: expected dateTime and a numeric value "
                                      "(or value.bpm)") from None
    stamps = pd.DatetimeIndex(times)

    def local(index: pd.DatetimeIndex) -> pd.DatetimeIndex:
        return index.tz_localize("UTC").tz_convert(tz).tz_localize(None) if tz else index

    table = hourly_table(local(stamps), names, values, where=str(folder)) if times else _assemble({}, [])
    for column, spans in sleep.items():
        if not spans:
            continue
        s = local(pd.DatetimeIndex([a for a, _ in spans])).asi8 // 10**9
        e = local(pd.DatetimeIndex([b for _, b in spans])).asi8 // 10**9
        s, e = _merge_intervals(s.astype(np.int64), e.astype(np.int64))
        _, hour, overlap = _split_hours(s, e)
        minutes = pd.Series(overlap / 60.0).groupby(hour).sum()
        extra = _assemble({column: minutes[minutes > 0]}, [column])
        table = table.join(extra, how="outer") if len(table.columns) else extra
    table = table.asfreq("h") if len(table) else table
    if variables is not None:
        table = table.reindex(columns=_check_variables(variables, list(table.columns) + list(VARIABLES) +
                                                       ["total_kcal"], "read_fitbit"))
    return table


# --------------------------------------------------------------------------- weeks


@dataclass(frozen=True)
class ZScoreStats:
    """Per-variable mean and SD used to z-score; store them in the model (``model.set_zscore``)."""

    variables: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, table: pd.DataFrame, variables: Sequence[str] | None = None) -> "ZScoreStats":
        variables = list(variables or table.columns)
        data = table.reindex(columns=variables).to_numpy(float)
        with np.errstate(all="ignore"), pd.option_context("mode.chained_assignment", None):
            mean = np.nanmean(np.where(np.isfinite(data), data, np.nan), axis=0) if len(data) else np.zeros(len(variables))
            std = np.nanstd(data, axis=0) if len(data) else np.ones(len(variables))
        mean = np.where(np.isfinite(mean), mean, 0.0)
        std = np.where(np.isfinite(std) & (std > 1e-8), std, 1.0)  # constant or empty: leave unscaled
        return cls(tuple(variables), mean, std)

    @classmethod
    def fit_weeks(cls, values: np.ndarray, observed: np.ndarray, variables: Sequence[str]) -> "ZScoreStats":
        """Fitted on the observed hours of weeks ``(N, 168, V)`` (a variable never observed: left
        unscaled)."""
        flat, seen = values.reshape(-1, len(variables)), observed.reshape(-1, len(variables))
        mean = np.array([flat[seen[:, k], k].mean() if seen[:, k].any() else 0.0 for k in range(len(variables))])
        std = np.array([flat[seen[:, k], k].std() if seen[:, k].any() else 1.0 for k in range(len(variables))])
        return cls(tuple(variables), mean, np.where(std > 1e-8, std, 1.0))

    @classmethod
    def identity(cls, variables: Sequence[str]) -> "ZScoreStats":
        """No scaling: weeks in the variables' units (a model z-scores them with its own statistics)."""
        return cls(tuple(variables), np.zeros(len(variables)), np.ones(len(variables)))

    @classmethod
    def from_model(cls, model) -> "ZScoreStats":
        info = model.zscore()
        variables = info["variables"] or [f"var{i}" for i in range(len(info["mean"]))]
        return cls(tuple(variables), np.asarray(info["mean"]), np.asarray(info["std"]))

    def to_dict(self) -> dict[str, Any]:
        return {"variables": list(self.variables), "mean": self.mean.tolist(), "std": self.std.tolist()}


class Weeks:
    """What :func:`to_weeks` returns; unpacks as ``values, observed, week_starts`` and carries ``stats``.

    ``values``: float32 ``(W, 168, V)`` z-scores, 0 where not observed; ``observed``: bool
    ``(W, 168, V)``; ``week_starts``: the local Monday 00:00 of each week; ``stats``: the
    :class:`ZScoreStats` applied.
    """

    def __init__(self, values, observed, week_starts, stats):
        self.values, self.observed, self.week_starts, self.stats = values, observed, week_starts, stats

    def __iter__(self):
        return iter((self.values, self.observed, self.week_starts))

    def __len__(self):
        return len(self.values)


def to_weeks(table: pd.DataFrame, *, variables: Sequence[str] | None = None, stats: ZScoreStats | None = None,
             min_hours: int = 1, week_start: int = 0) -> Weeks:
    """Cut an hourly table into participant-weeks (168 hours, starting on ``week_start``: 0 = Monday 00:00).

    Args:
        table: an hourly table from one of the readers (one participant).
        variables: columns, in model input order (default: the table's; a missing column is all NaN).
        stats: z-score statistics to apply (e.g. ``ZScoreStats.from_model(model)``); default:
            fitted on ``table``.
        min_hours: drop weeks with fewer hours than this that have any observed variable.

    Returns:
        :class:`Weeks` (``values, observed, week_starts = to_weeks(table)``; ``.stats``).
    """
    if not isinstance(table.index, pd.DatetimeIndex):
        raise HealthDataError(f"to_weeks: the table's index must be a DatetimeIndex of hours, got "
                              f"{type(table.index).__name__}")
    if table.index.tz is not None:
        raise HealthDataError("to_weeks: the table's index must be tz-naive local wall-clock hours")
    variables = list(variables or (stats.variables if stats is not None else table.columns))
    if stats is None:
        stats = ZScoreStats.fit(table, variables)
    elif list(stats.variables) != variables:
        raise ValueError(f"to_weeks: stats are for variables {list(stats.variables)}, not {variables}")
    data = table.reindex(columns=variables)
    if not len(data):
        n = len(variables)
        return Weeks(np.zeros((0, 168, n), np.float32), np.zeros((0, 168, n), bool), pd.DatetimeIndex([]), stats)
    hours = data.index.floor("h")
    data = data.groupby(hours).mean()
    first = data.index.min().normalize()
    first -= pd.Timedelta(days=(first.weekday() - week_start) % 7)
    last = data.index.max()
    n_weeks = int((last - first) // pd.Timedelta(days=7)) + 1
    grid = pd.date_range(first, periods=n_weeks * 168, freq="h")
    raw = data.reindex(grid).to_numpy(float).reshape(n_weeks, 168, len(variables))
    observed = np.isfinite(raw)
    values = np.where(observed, (raw - stats.mean) / stats.std, 0.0).astype(np.float32)
    keep = observed.any(-1).sum(1) >= max(min_hours, 1)
    starts = pd.DatetimeIndex(grid[::168])[keep]
    return Weeks(values[keep], observed[keep], starts, stats)


def handmade_features(values: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Per week and variable: mean and SD over observed hours, and the 24-hour cosinor amplitude
    (least-squares fit of ``m + a cos(2 pi h / 24) + b sin(2 pi h / 24)`` to the observed hours;
    amplitude ``sqrt(a^2 + b^2)``; NaN below 24 observed hours). Statistics of a variable never
    observed are NaN (the probe fills them with the training mean).

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


def split_participants(participant: np.ndarray, *, val_fraction: float, test_fraction: float,
                       seed: int) -> dict[str, np.ndarray]:
    """Week indices of ``train``, ``val`` and ``test`` participants (every week of a participant in
    one split), the participants shuffled by ``seed``; at least one participant each in val and test."""
    people = np.random.default_rng(seed).permutation(np.unique(participant))
    n_val = max(1, int(round(len(people) * val_fraction)))
    n_test = max(1, int(round(len(people) * test_fraction)))
    if n_val + n_test >= len(people):
        raise ValueError(f"{len(people)} participants are too few for validation and test splits")
    groups = {"test": people[:n_test], "val": people[n_test:n_test + n_val], "train": people[n_test + n_val:]}
    return {k: np.flatnonzero(np.isin(participant, v)) for k, v in groups.items()}


def cohort_weeks(tables: Sequence[pd.DataFrame], variables: Sequence[str], *, min_hours: int = 24):
    """Many participants' hourly tables -> their weeks stacked, unscaled: ``(values (N, 168, V),
    observed, participant (N,) (the table's index), week_start (N,))``."""
    cut = [to_weeks(t, variables=list(variables), stats=ZScoreStats.identity(variables), min_hours=min_hours)
           for t in tables]
    return (np.concatenate([w.values for w in cut]), np.concatenate([w.observed for w in cut]),
            np.concatenate([np.full(len(w), i) for i, w in enumerate(cut)]),
            pd.DatetimeIndex([s for w in cut for s in w.week_starts]))


_SOURCES = ("an Apple Health export.zip, its export.xml or its apple_health_export folder, a long CSV/Parquet "
            "(timestamp, variable, value) or a Fitbit folder")


def read_participant(source, variables: Sequence[str], *, tz: str | None = None) -> pd.DataFrame:
    """One participant's hourly table, the reader chosen by the source: an Apple Health
    ``export.zip``, its ``export.xml`` or the folder holding it (:func:`read_healthkit`), a Fitbit export folder
    (:func:`read_fitbit`; ``tz`` its zone), a long CSV/Parquet file or DataFrame ``timestamp,
    variable, value`` (:func:`read_long`), or an hourly table (a DataFrame indexed by hours).
    ``variables``: the columns wanted; the source must hold at least one of them. When they are
    OpenMHC's channels (:data:`OPENMHC_CHANNELS`) and the source holds none of them, they are
    derived from our variables by :func:`openmhc_table`."""
    openmhc = bool(variables) and all(v in OPENMHC_CHANNELS for v in variables)
    known = [v for v in (OPENMHC_SOURCES if openmhc else variables) if v in VARIABLES]
    where = "DataFrame" if isinstance(source, pd.DataFrame) else str(Path(source))
    path = None if isinstance(source, pd.DataFrame) else Path(source)
    if path is None:
        table = source if isinstance(source.index, pd.DatetimeIndex) else read_long(source)
    elif path.is_dir() and healthkit_export_file(path) is not None:
        table = read_healthkit(healthkit_export_file(path), variables=known)
    elif path.is_dir():
        table = read_fitbit(path, variables=known or None, tz=tz)
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected {_SOURCES})")
    elif path.suffix.lower() in (".xml", ".zip"):
        table = read_healthkit(path, variables=known)
    elif path.suffix.lower() in (".csv", ".parquet"):
        table = read_long(path)
    else:
        raise HealthDataError(f"{path}: expected {_SOURCES}, got {path.suffix or 'no suffix'!r}")
    if openmhc and not any(v in table.columns for v in OPENMHC_CHANNELS):
        table = openmhc_table(table)
    if not any(v in table.columns and table[v].notna().any() for v in variables):
        raise HealthDataError(f"{where}: none of the model's variables {list(variables)} is in the file (it has "
                              f"{list(table.columns)})")
    return table


#: OpenMHC's 19 hourly channels in the order of its tensors (``openmhc._constants.SENSOR_CHANNELS``
#: in github.com/AshleyLab/myheartcounts-dataset): iPhone (0-2), Apple Watch (3-6), sleep (7-8)
#: and ten workout types (9-18), the last twelve binary.
OPENMHC_CHANNELS = (
    "iphone_steps", "iphone_distance", "iphone_flights", "watch_steps", "watch_distance", "watch_hr",
    "watch_energy", "sleep_asleep", "sleep_inbed", "workout_walking", "workout_cycling", "workout_running",
    "workout_other", "workout_mixed_cardio", "workout_strength", "workout_elliptical", "workout_hiit",
    "workout_functional", "workout_yoga",
)
#: our variables :func:`openmhc_table` derives them from
OPENMHC_SOURCES = ("steps", "distance_km", "flights", "heart_rate", "active_kcal", "sleep_min", "in_bed_min")


def openmhc_table(table: pd.DataFrame) -> pd.DataFrame:
    """Our hourly table (any reader's) -> OpenMHC's 19 hourly channels (:data:`OPENMHC_CHANNELS`,
    in order) in OpenMHC's hourly units, NaN where missing.

    OpenMHC aggregates its minute data to hours by summing cumulative channels, averaging heart
    rate and taking the maximum of the binary channels (so an hour is "asleep" if any minute is),
    its minute units being steps, metres, flights, beats per *second* and energy per minute. From
    our variables:

    * ``iphone_steps``, ``iphone_flights`` = ``steps``, ``flights``; ``iphone_distance`` =
      ``distance_km`` x 1000 (metres). Our readers keep one source per hour (the larger total), so
      the iPhone channels get that source's count.
    * ``watch_steps``, ``watch_distance``: the same counts, in the hours with a heart-rate sample
      (a worn Watch), missing in the others; ``watch_hr`` = ``heart_rate`` / 60 (beats per
      second); ``watch_energy`` = ``active_kcal``.
    * ``sleep_asleep`` / ``sleep_inbed``: 1 in an hour with any minute asleep / in bed, 0 in the
      other hours of a calendar day with such a record (OpenMHC: 0 awake, 1 asleep, NaN on a
      day without sleep tracking), missing on days without one.
    * the ten workout channels: missing (our readers do not read workouts; OpenMHC leaves a
      non-tracker's workout channels NaN).

    Not confirmed (OpenMHC's preprocessing code is not public): whether its ``watch_energy``
    "cal/min" is kilocalories (taken here) or calories, and its heart-rate unit (its schema says
    bpm, its feature code and thresholds treat the stored values as beats per second, taken here).
    """
    if not isinstance(table.index, pd.DatetimeIndex):
        raise HealthDataError(f"openmhc_table: the table's index must be a DatetimeIndex of hours, got "
                              f"{type(table.index).__name__}")
    if not len(table):
        return pd.DataFrame({c: pd.Series(dtype=float) for c in OPENMHC_CHANNELS}, index=table.index)
    first, last = table.index.min().normalize(), table.index.max().normalize() + pd.Timedelta(hours=23)
    hours = pd.date_range(first, last, freq="h", name=table.index.name)  # whole days: sleep fills them
    src = table.reindex(columns=list(OPENMHC_SOURCES)).groupby(table.index.floor("h")).mean().reindex(hours)
    out = pd.DataFrame(np.nan, index=hours, columns=list(OPENMHC_CHANNELS))
    distance_m = src["distance_km"] * 1000.0
    worn = src["heart_rate"].notna()
    out["iphone_steps"], out["iphone_distance"], out["iphone_flights"] = src["steps"], distance_m, src["flights"]
    out["watch_steps"], out["watch_distance"] = src["steps"].where(worn), distance_m.where(worn)
    out["watch_hr"] = src["heart_rate"] / 60.0
    out["watch_energy"] = src["active_kcal"]
    days = hours.normalize()
    for channel, minutes in (("sleep_asleep", src["sleep_min"]), ("sleep_inbed", src["in_bed_min"])):
        tracked = minutes.notna().groupby(days).transform("any").to_numpy()
        out[channel] = np.where(tracked, (minutes.fillna(0.0) > 0).astype(float), np.nan)
    return out


def participant_weeks(source, variables: Sequence[str], *, min_hours: int = 24, tz: str | None = None) -> Weeks:
    """One participant's weeks from any source of :func:`read_participant`, ``variables`` in
    order, in their units (unscaled: a model z-scores its inputs with its own statistics); weeks
    with fewer than ``min_hours`` observed hours are dropped, and none left is an error."""
    table = read_participant(source, variables, tz=tz)
    weeks = to_weeks(table, variables=list(variables), stats=ZScoreStats.identity(variables), min_hours=min_hours)
    if not len(weeks):
        where = "DataFrame" if isinstance(source, pd.DataFrame) else str(Path(source))
        raise HealthDataError(f"{where}: no week with at least {min_hours} observed hours")
    return weeks


def read_weeks_npz(path: str | os.PathLike, variables: Sequence[str] | None = None):
    """Weeks cut elsewhere: an ``.npz`` with ``values`` ``(N, 168, V)`` in the variables' units
    (NaN: unobserved), ``participant`` ``(N,)`` and optionally ``variables`` ``(V,)`` (else
    ``variables``, else ``var0, var1, ...``) -> ``(values (0 where unobserved), observed,
    participant, variables)``."""
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("values", "participant") if k not in z]
        if missing:
            raise HealthDataError(f"{path}: missing array(s) {missing}; expected values (N, 168, V) and "
                                  "participant (N,)")
        raw, participant = z["values"].astype(np.float32), z["participant"]
        names = [str(v) for v in z["variables"]] if "variables" in z else list(
            variables or [f"var{i}" for i in range(raw.shape[-1])])
    if raw.ndim != 3 or raw.shape[1] != 168 or len(participant) != len(raw):
        raise HealthDataError(f"{path}: values {raw.shape}, participant {participant.shape}: expected "
                              "(N, 168, V) and (N,)")
    observed = np.isfinite(raw)
    return np.where(observed, raw, np.float32(0.0)), observed, participant, names


def read_labels(path: str | os.PathLike, participant: np.ndarray,
                weekly: str | os.PathLike | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The labels of the weeks of :func:`read_weeks_npz`: ``path``, a CSV with a ``participant``
    column and one column per participant-level task (-> indexed by participant), and ``weekly``,
    a CSV ``participant, week, tasks...`` matched by the week's index within its participant (->
    one row per week of ``participant``; no columns without ``weekly``)."""
    labels = pd.read_csv(path)
    if "participant" not in labels.columns:
        raise HealthDataError(f"{path}: no 'participant' column (columns: {list(labels.columns)})")
    week_labels = pd.DataFrame(index=range(len(participant)))
    if weekly:
        table = pd.read_csv(weekly)
        if not {"participant", "week"} <= set(table.columns):
            raise HealthDataError(f"{weekly}: expected columns participant, week and weekly tasks")
        week_idx = pd.Series(participant).groupby(participant).cumcount().to_numpy()
        keys = pd.MultiIndex.from_arrays([participant, week_idx])
        week_labels = table.set_index(["participant", "week"]).reindex(keys).reset_index(drop=True)
    return labels.set_index("participant"), week_labels
