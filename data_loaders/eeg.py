"""EEG in, model-ready windows out: MNE readers, channel picking, montages, filtering, windowing,
amplitude rejection, unit scaling, and memory-mapped shards for large corpora.

The steps follow braindecode's shape (named steps on MNE objects, then windowing):

>>> raw = read_raw("S001R02.edf")                                  # doctest: +SKIP
>>> raw = pick_channels(raw, ["FP1", "FP2", "T3"])                # aliases: T3 == T7, case, 'EEG x-REF'
>>> raw = preprocess(raw, sfreq=200, l_freq=0.3, h_freq=75, notch=[60])
>>> x, y = windows_from_annotations(raw, {"T1": 0, "T2": 1}, window_s=4)   # x in µV
>>> x = to_model_units(x)                                          # CBraMod's units: 100 µV

Errors name the file, the field and what was expected: a missing channel (with the channels the
file has), a recording shorter than needed, a sampling rate below the target (upsampling would
invent content), NaNs, an unreadable format. Warnings name the file too: channels marked bad in
it (``info["bads"]``, e.g. a FIF) are dropped, or interpolated where the model needs them by name
(:func:`drop_bad_channels`); an EDF/BDF shorter than its header declares is read as far as it
goes, with the seconds read and declared.

Large corpora (TUEG): :func:`write_shards` writes fixed-size ``.npy`` shards plus ``index.json``
once; :class:`ShardDataset` memory-maps them, so every process (rank, loader worker) reads only
the windows its sampler hands it.
"""
from __future__ import annotations

import fnmatch
import importlib.resources
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "EEGError",
    "TCP_BIPOLAR_16",
    "TUEG_19",
    "READERS",
    "EEGSettings",
    "normalize_channel_name",
    "read_raw",
    "drop_bad_channels",
    "pick_channels",
    "bipolar_montage",
    "preprocess",
    "to_model_units",
    "fixed_windows",
    "windows_from_annotations",
    "reject_by_amplitude",
    "load_windows",
    "recording_windows",
    "WindowDataset",
    "write_shards",
    "ShardDataset",
    "iter_files",
    "resolve_root",
    "samples_dir",
]


class EEGError(ValueError):
    """Bad EEG input: the message names the file, the field and what was expected."""


#: CBraMod's pretraining channels (TUEG, 10-20 names, in this order)
TUEG_19 = ["FP1", "FP2", "F3", "F4", "C3", "C4", "P3", "P4", "O1", "O2",
           "F7", "F8", "T3", "T4", "T5", "T6", "FZ", "CZ", "PZ"]

#: the 16-channel temporal central parasagittal (TCP) bipolar montage used for TUAB / TUEV
TCP_BIPOLAR_16 = [
    ("FP1", "F7"), ("F7", "T3"), ("T3", "T5"), ("T5", "O1"),
    ("FP2", "F8"), ("F8", "T4"), ("T4", "T6"), ("T6", "O2"),
    ("FP1", "F3"), ("F3", "C3"), ("C3", "P3"), ("P3", "O1"),
    ("FP2", "F4"), ("F4", "C4"), ("C4", "P4"), ("P4", "O2"),
]

# old 10-20 name -> 10-10 name (both directions are accepted)
_ALIASES = {"T3": "T7", "T4": "T8", "T5": "P7", "T6": "P8"}
_ALIASES.update({v: k for k, v in list(_ALIASES.items())})

#: file suffix -> MNE reader name
READERS = {".edf": "read_raw_edf", ".bdf": "read_raw_bdf", ".fif": "read_raw_fif", ".fif.gz": "read_raw_fif",
           ".vhdr": "read_raw_brainvision", ".set": "read_raw_eeglab"}


# ----------------------------------------------------------------------------- reading


def normalize_channel_name(name: str) -> str:
    """Canonical form for matching: upper case, without ``EEG `` prefix, ``-REF``/``-LE``/``-AVG``
    suffix and EEGMMIDB's trailing dots (``'EEG FP1-REF'``, ``'Fp1.'`` and ``'fp1'`` -> ``'FP1'``)."""
    text = name.strip().upper()
    text = re.sub(r"^EEG[\s_:]*", "", text)
    text = re.sub(r"[-_ ](REF|LE|AVG|AR|A1|A2|M1|M2)$", "", text)
    return text.rstrip(".").strip()


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return ".fif.gz" if name.endswith(".fif.gz") else path.suffix.lower()


def read_raw(path: str | os.PathLike, *, preload: bool = True):
    """Read EDF/BDF/FIF/BrainVision (.vhdr)/EEGLAB (.set) with MNE; only EEG-like channels kept."""
    import mne

    path = Path(path)
    if not path.is_file():
        raise EEGError(f"{path}: EEG file not found")
    suffix = _suffix(path)
    if suffix not in READERS:
        raise EEGError(f"{path}: unsupported EEG format {suffix!r}; expected one of {sorted(READERS)}")
    reader = getattr(mne.io, READERS[suffix])
    try:
        raw = reader(str(path), preload=preload, verbose="error")
    except Exception as exc:  # MNE raises many types for corrupt files
        raise EEGError(f"{path}: could not be read as {suffix} ({type(exc).__name__}: {exc})") from exc
    raw.filenames_for_errors = str(path)  # MNE objects accept new attributes; used in messages below
    if suffix in (".edf", ".bdf"):
        _warn_if_truncated(raw, path)
    return raw


def _edf_declared(path: Path) -> tuple[int, float] | None:
    """(number of data records, seconds per record) from an EDF/BDF header; None where the header
    leaves the count open (-1, a recording not closed) or cannot be read."""
    with open(path, "rb") as f:
        head = f.read(256)
    try:
        n_records, record_s = int(head[236:244].decode("ascii")), float(head[244:252].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    return (n_records, record_s) if n_records > 0 and record_s > 0 else None


def _warn_if_truncated(raw, path: Path) -> None:
    # MNE infers the record count from the file size when the two disagree (an interrupted copy or
    # download, a recorder that was not stopped) and says so only as a log message, which
    # verbose="error" silences: the missing minutes would vanish without a word
    declared = _edf_declared(path)
    if declared is None:
        return
    n_records, record_s = declared
    declared_s, read_s = n_records * record_s, raw.n_times / raw.info["sfreq"]
    if declared_s - read_s > 1.0 / raw.info["sfreq"]:
        kind = path.suffix[1:].upper()
        warnings.warn(f"{path}: truncated {kind} file: it holds {read_s:g} s of the {declared_s:g} s its header "
                      f"declares ({n_records} data records x {record_s:g} s); only the {read_s:g} s present are used",
                      UserWarning, stacklevel=3)


def _where(raw) -> str:
    return getattr(raw, "filenames_for_errors", None) or (str(raw.filenames[0]) if raw.filenames and raw.filenames[0] else "<raw>")


def _index_channels(raw) -> dict[str, str]:
    index: dict[str, str] = {}
    for ch in raw.ch_names:
        key = normalize_channel_name(ch)
        index.setdefault(key, ch)
    for key, ch in list(index.items()):
        alias = _ALIASES.get(key)
        if alias is not None:
            index.setdefault(alias, ch)
    return index


def _resolve(raw, names: Sequence[str]) -> list[str]:
    index = _index_channels(raw)
    missing = [n for n in names if normalize_channel_name(n) not in index]
    if missing:
        raise EEGError(
            f"{_where(raw)}: channel(s) {missing} not found (matched case-insensitively, ignoring 'EEG '/'-REF', "
            f"with aliases T3/T7, T4/T8, T5/P7, T6/P8); the file has {raw.ch_names}"
        )
    return [index[normalize_channel_name(n)] for n in names]


def _standard_positions() -> dict:
    """Channel positions of the standard 10-20 montage (MNE >= 1.13 names it ``colin27_1020``)."""
    import mne

    name = "colin27_1020" if "colin27_1020" in mne.channels.get_builtin_montages() else "standard_1020"
    return mne.channels.make_standard_montage(name).get_positions()


def _interpolate(raw, channels: Sequence[str], where: str):
    """``raw`` (a copy, loaded) with ``channels`` replaced by MNE's spherical-spline interpolation
    from the good EEG channels: the file's own positions when every EEG channel has one, else the
    standard 10-20 positions matched by name (with the T3/T7 aliases). Returns (raw, how)."""
    import mne

    eeg_names = [raw.ch_names[i] for i in mne.pick_types(raw.info, eeg=True, exclude=[])]
    not_eeg = [ch for ch in channels if ch not in eeg_names]
    if not_eeg:
        raise EEGError(f"{where}: channel(s) {not_eeg} are marked bad and needed, but are not EEG channels, so they "
                       "cannot be interpolated; choose other channels or unmark them (info['bads'])")
    own = {ch: raw.info["chs"][raw.ch_names.index(ch)]["loc"][:3] for ch in eeg_names}
    if all(np.isfinite(p).all() and np.abs(p).sum() > 0 for p in own.values()):
        sub, how = raw.copy().pick(eeg_names), "from the file's channel positions"
    else:
        standard = _standard_positions()
        by_name = {normalize_channel_name(k): v for k, v in standard["ch_pos"].items()}
        ch_pos = {}
        for ch in eeg_names:
            key = normalize_channel_name(ch)
            pos = by_name.get(key, by_name.get(_ALIASES.get(key, ""), None))
            if pos is not None:
                ch_pos[ch] = pos
        unplaced = [ch for ch in channels if ch not in ch_pos]
        if unplaced:
            raise EEGError(f"{where}: channel(s) {unplaced} are marked bad and needed, but have no position (the file "
                           "has none and the name is not a 10-20 name) to interpolate them from; set a montage, "
                           "choose other channels or unmark them (info['bads'])")
        sub = raw.copy().pick(list(ch_pos))
        sub.set_montage(mne.channels.make_dig_montage(
            ch_pos=ch_pos, nasion=standard["nasion"], lpa=standard["lpa"], rpa=standard["rpa"],
            coord_frame=standard["coord_frame"]), verbose="error")
        how = "from standard 10-20 positions (the file has none)"
    sub.info["bads"] = list(channels)
    try:
        sub.interpolate_bads(reset_bads=True, verbose="error")
    except Exception as exc:  # noqa: BLE001 - MNE raises several types (no digitization to fit a head sphere, ...)
        raise EEGError(f"{where}: channel(s) {list(channels)} are marked bad and needed, but could not be interpolated "
                       f"{how} ({type(exc).__name__}: {exc}); choose other channels or unmark them "
                       "(info['bads'])") from exc
    raw.load_data()
    for ch in channels:
        rebuilt = sub.get_data(picks=[ch])[0]
        raw.apply_function(lambda _, rebuilt=rebuilt: rebuilt, picks=[ch], verbose="error")
    raw.info["bads"] = [ch for ch in raw.info["bads"] if ch not in channels]
    return raw, how


def drop_bad_channels(raw, needed: Sequence[str] | None = None, *, notify_dropped: bool = True):
    """Honour the channels marked bad in the recording (``raw.info["bads"]``, e.g. by a FIF file):
    bad channels are dropped, as ``raw.pick(..., exclude="bads")``, except those in ``needed`` (the
    channel names a model takes, in any spelling :func:`pick_channels` accepts), which are
    rebuilt by spherical-spline interpolation from the good EEG channels (``raw.interpolate_bads``),
    since the model's channel set is fixed. A warning names the file and the channels; with
    ``notify_dropped=False`` only interpolations are announced (the dropped channels were not
    going to be used). Returns a new raw (``raw`` itself when nothing is marked bad)."""
    bads = [ch for ch in raw.info["bads"] if ch in raw.ch_names]
    if not bads:
        return raw
    where = _where(raw)
    wanted = set(_resolve(raw, needed)) if needed is not None else set()
    repair = [ch for ch in bads if ch in wanted]
    drop = [ch for ch in bads if ch not in wanted]
    raw = raw.copy()
    notes = []
    if drop:
        raw.drop_channels(drop)
        if notify_dropped:
            notes.append(f"channel(s) {drop} marked bad in the file (info['bads']) are dropped")
    if repair:
        raw, how = _interpolate(raw, repair, where)
        notes.append(f"channel(s) {repair} marked bad in the file (info['bads']) are needed and interpolated {how}")
    raw.filenames_for_errors = where
    if notes:
        warnings.warn(f"{where}: " + "; ".join(notes), UserWarning, stacklevel=3)
    return raw


def pick_channels(raw, channels: Sequence[str]):
    """Keep ``channels`` in this order (renamed to the requested names)."""
    actual = _resolve(raw, channels)
    if len(set(actual)) != len(actual):
        raise EEGError(f"{_where(raw)}: requested channels {list(channels)} map to repeated file channels {actual}")
    raw = raw.copy().pick(actual)
    raw.reorder_channels(actual)
    raw.rename_channels(dict(zip(actual, channels)))
    return raw


def bipolar_montage(raw, pairs: Sequence[Sequence[str]]):
    """A new raw whose channels are ``anode - cathode`` for each pair (e.g. :data:`TCP_BIPOLAR_16`),
    named ``"A-B"``."""
    import mne

    pairs = [tuple(p) for p in pairs]
    bad = [p for p in pairs if len(p) != 2]
    if bad:
        raise EEGError(f"bipolar pairs must be [anode, cathode]; got {bad}")
    names = sorted({n for p in pairs for n in p})
    lookup = dict(zip(names, _resolve(raw, names)))
    data = raw.get_data(picks=[lookup[n] for n in names])
    rows = {n: i for i, n in enumerate(names)}
    out = np.stack([data[rows[a]] - data[rows[b]] for a, b in pairs])
    info = mne.create_info([f"{a}-{b}" for a, b in pairs], raw.info["sfreq"], ch_types="eeg")
    bip = mne.io.RawArray(out, info, first_samp=raw.first_samp, verbose="error")
    bip.set_meas_date(raw.info["meas_date"])
    bip.set_annotations(raw.annotations)
    bip.filenames_for_errors = _where(raw)
    return bip


def preprocess(raw, *, sfreq: float | None = 200.0, l_freq: float | None = 0.3, h_freq: float | None = 75.0,
               notch: Sequence[float] = (60.0,), reference: str | None = None, allow_upsample: bool = False):
    """Resample, band-pass, notch and (average) reference, in CBraMod's order (official TUEG
    pipeline: resample, then filter, then notch). A recording sampled below ``sfreq`` is refused
    unless ``allow_upsample`` (the official PhysioNet-MI pipeline upsamples 160 -> 200 Hz)."""
    where = _where(raw)
    data = raw.get_data()
    if not np.isfinite(data).all():
        bad = [raw.ch_names[i] for i in np.flatnonzero(~np.isfinite(data).all(axis=1))]
        raise EEGError(f"{where}: channel(s) {bad} contain NaN or inf samples; interpolate or drop them first")
    raw = raw.copy()
    if sfreq is not None:
        if raw.info["sfreq"] + 1e-6 < sfreq and not allow_upsample:
            raise EEGError(
                f"{where}: sampling rate {raw.info['sfreq']:g} Hz is below the target {sfreq:g} Hz; upsampling adds "
                f"no content above {raw.info['sfreq'] / 2:g} Hz. Use a recording sampled at >= the target, or set "
                "data.eeg.allow_upsample=true if intended (the official PhysioNet-MI pipeline upsamples 160 -> 200 Hz)"
            )
        if abs(raw.info["sfreq"] - sfreq) > 1e-6:
            raw.resample(sfreq, verbose="error")
    nyquist = raw.info["sfreq"] / 2
    if h_freq is not None and h_freq >= nyquist:
        h_freq = None  # the anti-aliasing of resampling already limits the band
    if l_freq is not None or h_freq is not None:
        raw.filter(l_freq=l_freq, h_freq=h_freq, verbose="error")
    freqs = [f for f in (notch or ()) if f < nyquist]
    if freqs:
        raw.notch_filter(freqs, verbose="error")
    if reference == "average":
        raw.set_eeg_reference("average", verbose="error")
    elif reference is not None:
        raise EEGError(f"reference={reference!r}: expected 'average' or None")
    raw.filenames_for_errors = where
    return raw


def to_model_units(x_uv: np.ndarray, *, uv_per_unit: float = 100.0) -> np.ndarray:
    """µV -> the model's units (CBraMod: 100 µV, i.e. divide by 100, as the official loaders)."""
    return np.asarray(x_uv, dtype=np.float32) / np.float32(uv_per_unit)


# ----------------------------------------------------------------------------- windowing


def _samples(raw, seconds: float, what: str) -> int:
    n = int(round(seconds * raw.info["sfreq"]))
    if n <= 0:
        raise EEGError(f"{what}={seconds} s gives no samples at {raw.info['sfreq']:g} Hz")
    return n


def fixed_windows(raw, *, window_s: float, stride_s: float | None = None, start_s: float = 0.0,
                  stop_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive windows ``(n, C, window)`` in µV between ``start_s`` and ``stop_s`` (default:
    the end), and their start times in seconds."""
    sf = raw.info["sfreq"]
    size = _samples(raw, window_s, "window_s")
    step = _samples(raw, stride_s if stride_s is not None else window_s, "stride_s")
    first = int(round(start_s * sf))
    last = raw.n_times if stop_s is None else min(raw.n_times, int(round(stop_s * sf)))
    if last - first < size:
        raise EEGError(
            f"{_where(raw)}: recording too short: {(last - first) / sf:.2f} s available from {start_s:g} s, "
            f"a window needs {window_s:g} s"
        )
    starts = np.arange(first, last - size + 1, step)
    data = raw.get_data(units="uV")
    return np.stack([data[:, s : s + size] for s in starts]).astype(np.float32), starts / sf


def windows_from_annotations(raw, mapping: Mapping[str, int | float], *, window_s: float,
                             offset_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """One window per annotation whose description is in ``mapping`` (description -> label),
    starting ``offset_s`` after its onset; windows past the end of the recording are dropped.
    Returns ``(x (n, C, window) in µV, y (n,))``."""
    sf = raw.info["sfreq"]
    size = _samples(raw, window_s, "window_s")
    found = sorted(set(raw.annotations.description))
    unknown = [k for k in mapping if k not in found]
    if len(unknown) == len(mapping):
        raise EEGError(f"{_where(raw)}: none of the annotations {list(mapping)} occur; the file's annotations are {found}")
    data = raw.get_data(units="uV")
    first_time = raw.first_time
    xs, ys = [], []
    for ann in raw.annotations:
        if ann["description"] not in mapping:
            continue
        start = int(round((ann["onset"] - first_time + offset_s) * sf))
        if start < 0 or start + size > raw.n_times:
            continue
        xs.append(data[:, start : start + size])
        ys.append(mapping[ann["description"]])
    if not xs:
        raise EEGError(f"{_where(raw)}: no complete {window_s:g} s window fits after the annotations {list(mapping)}")
    return np.stack(xs).astype(np.float32), np.asarray(ys)


def reject_by_amplitude(x_uv: np.ndarray, max_abs_uv: float) -> np.ndarray:
    """Boolean keep-mask of windows whose peak |amplitude| is below ``max_abs_uv`` (official TUEG: 100 µV)."""
    return np.abs(x_uv).reshape(len(x_uv), -1).max(axis=1) < max_abs_uv


# ----------------------------------------------------------------------------- from files


@dataclass
class EEGSettings:
    """How recordings become model windows (the ``data`` section of CBraMod's configs).

    Channel selection: ``channels`` (names, in order) or ``bipolar`` (pairs, or ``"tcp16"``).
    Labels: ``events`` (annotation description -> label) or ``file_labels`` (glob on the file
    path -> label, e.g. TUAB's ``*/abnormal/*``); with neither, windows are unlabelled (pretraining).
    """

    channels: list[str] | None = None
    bipolar: str | list[list[str]] | None = None
    reference: str | None = None
    sfreq: float = 200.0
    l_freq: float | None = 0.3
    h_freq: float | None = 75.0
    notch: list[float] = field(default_factory=lambda: [60.0])
    uv_per_unit: float = 100.0
    window_s: float = 30.0
    stride_s: float | None = None
    events: dict[str, float] | None = None
    event_offset_s: float = 0.0
    file_labels: dict[str, float] | None = None
    min_duration_s: float | None = None
    trim_s: float = 0.0
    reject_uv: float | None = None
    allow_upsample: bool = False

    def __post_init__(self):
        if self.channels is not None and self.bipolar is not None:
            raise EEGError("data: set channels or bipolar, not both")
        if self.events is not None and self.file_labels is not None:
            raise EEGError("data: labels come from events or from file_labels, not both")
        if isinstance(self.bipolar, str) and self.bipolar != "tcp16":
            raise EEGError(f"data.bipolar={self.bipolar!r}: expected 'tcp16' or a list of [anode, cathode] pairs")

    def pairs(self) -> list[tuple[str, str]] | None:
        if self.bipolar is None:
            return None
        return list(TCP_BIPOLAR_16) if self.bipolar == "tcp16" else [tuple(p) for p in self.bipolar]


def _needed_channels(settings: EEGSettings) -> list[str] | None:
    """The channel names the settings' montage reads (None: every EEG channel of the file)."""
    pairs = settings.pairs()
    if pairs is not None:
        return list(dict.fromkeys(n for pair in pairs for n in pair))
    return None if settings.channels is None else list(settings.channels)


def _file_label(path: Path, patterns: Mapping[str, float]) -> float:
    hits = [label for pattern, label in patterns.items() if fnmatch.fnmatch(str(path), pattern)]
    if len(set(hits)) != 1:
        raise EEGError(f"{path}: data.file_labels patterns {list(patterns)} give {'no' if not hits else 'conflicting'} label(s)")
    return hits[0]


def load_windows(path: str | os.PathLike, settings: EEGSettings) -> tuple[np.ndarray, np.ndarray | None]:
    """Read one recording and return ``(x, y)``: windows in model units ``(n, C, T)`` (float32)
    and labels (``None`` for unlabelled windows), after every step of ``settings``. Channels marked
    bad in the file are dropped, or interpolated where ``settings`` names them
    (:func:`drop_bad_channels`)."""
    path = Path(path)
    raw = drop_bad_channels(read_raw(path), _needed_channels(settings), notify_dropped=settings.channels is None
                            and settings.pairs() is None)
    if settings.pairs() is not None:
        raw = bipolar_montage(raw, settings.pairs())
    elif settings.channels is not None:
        raw = pick_channels(raw, settings.channels)
    else:
        raw = raw.copy().pick("eeg")
    duration = raw.n_times / raw.info["sfreq"]
    if settings.min_duration_s is not None and duration < settings.min_duration_s:
        raise EEGError(f"{path}: recording too short: {duration:.1f} s, data.min_duration_s is {settings.min_duration_s:g} s")
    raw = preprocess(raw, sfreq=settings.sfreq, l_freq=settings.l_freq, h_freq=settings.h_freq,
                     notch=settings.notch, reference=settings.reference, allow_upsample=settings.allow_upsample)
    if settings.events is not None:
        x, y = windows_from_annotations(raw, settings.events, window_s=settings.window_s, offset_s=settings.event_offset_s)
    else:
        stop = raw.n_times / raw.info["sfreq"] - settings.trim_s
        x, _ = fixed_windows(raw, window_s=settings.window_s, stride_s=settings.stride_s, start_s=settings.trim_s, stop_s=stop)
        y = None if settings.file_labels is None else np.full(len(x), _file_label(path, settings.file_labels))
    if settings.reject_uv is not None:
        keep = reject_by_amplitude(x, settings.reject_uv)
        x = x[keep]
        y = None if y is None else y[keep]
    return to_model_units(x, uv_per_unit=settings.uv_per_unit), y


def recording_windows(recording, settings: EEGSettings, *, stride_s: float | None = None,
                      reference_all: bool = False, source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every fixed window of one recording, for inference (``predict`` / ``embed``): the channel
    selection and preprocessing of ``settings`` (as :func:`load_windows`), then consecutive
    ``settings.window_s`` windows every ``stride_s`` (default: the window, no overlap) from the
    first sample to the end. No labels, no trimming, no amplitude rejection: every window gets
    an output row.

    Args:
        recording: a file path (any format of :data:`READERS`) or an MNE ``Raw``.
        reference_all: average-reference over *every* EEG channel of the file before picking
            ``settings.channels`` (CBraMod's embedded demo task does this; :func:`load_windows`
            references the picked channels).
        source: the name used in errors when ``recording`` is a ``Raw``.

    Returns ``(x, start_s)``: windows ``(n, C, T)`` float32 in model units and their start times in
    seconds from the first sample. Errors (:class:`EEGError`) name the file: a missing channel
    (listing the file's), a rate below ``settings.sfreq`` without ``allow_upsample``, a
    recording shorter than one window. Channels marked bad in the recording are handled (and
    announced) as by :func:`drop_bad_channels`.
    """
    if isinstance(recording, (str, os.PathLike)):
        raw = read_raw(recording)
    else:
        raw = recording.copy()
        if source is not None or not getattr(raw, "filenames_for_errors", None):
            raw.filenames_for_errors = source or _where(raw)
    needed = _needed_channels(settings)
    raw = drop_bad_channels(raw, needed, notify_dropped=needed is None or (reference_all and settings.pairs() is None))
    pre = dict(sfreq=settings.sfreq, l_freq=settings.l_freq, h_freq=settings.h_freq, notch=settings.notch,
               allow_upsample=settings.allow_upsample)
    if settings.pairs() is not None:
        raw = preprocess(bipolar_montage(raw, settings.pairs()), reference=settings.reference, **pre)
    elif reference_all:
        where = _where(raw)
        if settings.channels is not None:
            _resolve(raw, settings.channels)  # a missing channel is named before any filtering
        raw = preprocess(raw.copy().pick("eeg"), reference=settings.reference, **pre)
        raw.filenames_for_errors = where
        if settings.channels is not None:
            raw = pick_channels(raw, settings.channels)
    else:
        raw = pick_channels(raw, settings.channels) if settings.channels is not None else raw.copy().pick("eeg")
        raw = preprocess(raw, reference=settings.reference, **pre)
    x, starts = fixed_windows(raw, window_s=settings.window_s, stride_s=stride_s)
    return to_model_units(x, uv_per_unit=settings.uv_per_unit), starts


class WindowDataset(Dataset):
    """In-memory ``(x, y)`` windows; ``x`` float32 ``(n, C, T)``, ``y`` long (classes) or float."""

    def __init__(self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor | None = None, *, regression: bool = False):
        self.x = torch.as_tensor(np.asarray(x, dtype=np.float32))
        if self.x.dim() != 3:
            raise EEGError(f"windows must have shape (n, n_chans, n_times), got {tuple(self.x.shape)}")
        if not torch.isfinite(self.x).all():
            raise EEGError("windows contain NaN or inf values")
        self.y = None
        if y is not None:
            y = torch.as_tensor(np.asarray(y))
            self.y = y.float() if regression else y.long()
            if len(self.y) != len(self.x):
                raise EEGError(f"{len(self.x)} windows but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] if self.y is None else (self.x[i], self.y[i])


# ----------------------------------------------------------------------------- shards


def write_shards(windows: Iterable[np.ndarray], out_dir: str | os.PathLike, *, shard_size: int = 4096,
                 dtype: str = "float16", meta: Mapping | None = None) -> Path:
    """Write batches of windows ``(n, C, T)`` (model units) into ``shard_XXXXX.npy`` files of
    ``shard_size`` windows each and an ``index.json`` (shapes, counts, dtype, ``meta``). Each
    file is written to a temporary name and renamed; the index is written last."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, buffer, shape = [], [], None

    def flush():
        block = np.concatenate(buffer).astype(dtype)
        name = f"shard_{len(shards):05d}.npy"
        tmp = out / f".{name}.tmp-{os.getpid()}.npy"
        np.save(tmp, block)
        os.replace(tmp, out / name)
        shards.append({"file": name, "count": int(len(block))})
        buffer.clear()

    held = 0
    for batch in windows:
        batch = np.asarray(batch)
        if batch.ndim != 3:
            raise EEGError(f"write_shards: expected windows (n, C, T), got {batch.shape}")
        if shape is None:
            shape = batch.shape[1:]
        elif batch.shape[1:] != shape:
            raise EEGError(f"write_shards: window shape {batch.shape[1:]} differs from the first {shape}")
        while len(batch):
            take = min(shard_size - held, len(batch))
            buffer.append(batch[:take])
            held += take
            batch = batch[take:]
            if held == shard_size:
                flush()
                held = 0
    if buffer:
        flush()
    if shape is None:
        raise EEGError("write_shards: no windows to write")
    index = {"format": "domainfm-eeg-shards-v1", "window_shape": list(shape), "dtype": dtype,
             "total": sum(s["count"] for s in shards), "shards": shards, "meta": dict(meta or {})}
    from domainfm.engine import atomic_write_text

    atomic_write_text(out / "index.json", json.dumps(index, indent=2) + "\n")
    return out


class ShardDataset(Dataset):
    """Windows from :func:`write_shards` output, memory-mapped lazily in each process (so a
    DataLoader worker or DDP rank touches only the pages of the windows it reads)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        index_file = self.root / "index.json"
        if not index_file.is_file():
            raise EEGError(f"{self.root}: no index.json; create shards with `domainfm.data_loaders.eeg.write_shards`")
        self.index = json.loads(index_file.read_text())
        if self.index.get("format") != "domainfm-eeg-shards-v1":
            raise EEGError(f"{index_file}: unknown format {self.index.get('format')!r}")
        counts = [s["count"] for s in self.index["shards"]]
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.window_shape = tuple(self.index["window_shape"])
        self._maps: dict[int, np.ndarray] = {}
        for s in self.index["shards"]:
            if not (self.root / s["file"]).is_file():
                raise EEGError(f"{self.root}: shard {s['file']} listed in index.json is missing")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        shard = int(np.searchsorted(self.offsets, i, side="right") - 1)
        if shard not in self._maps:
            self._maps[shard] = np.load(self.root / self.index["shards"][shard]["file"], mmap_mode="r")
        return torch.from_numpy(np.array(self._maps[shard][i - self.offsets[shard]], dtype=np.float32))

    def __getstate__(self):  # workers re-open their own maps
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state


SAMPLES_TOKEN = "@samples"


def samples_dir() -> Path:
    """The folder of the EEG recordings shipped with domainfm (see its README.md)."""
    return Path(str(importlib.resources.files("domainfm.data_loaders") / "samples" / "eeg"))


def resolve_root(root: str | os.PathLike | None) -> Path | None:
    """``"@samples"`` -> :func:`samples_dir`; anything else as a path (``~`` expanded)."""
    if root is None:
        return None
    return samples_dir() if str(root) == SAMPLES_TOKEN else Path(root).expanduser()


def iter_files(root: str | os.PathLike, patterns: Sequence[str]) -> Iterator[Path]:
    """Files under ``root`` matching any glob in ``patterns`` (sorted, each once)."""
    root = resolve_root(root)
    if not root.is_dir():
        raise EEGError(f"data.root={str(root)!r} is not a directory")
    seen = set()
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            if path.is_file() and path not in seen:
                seen.add(path)
                yield path
