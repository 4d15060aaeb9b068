"""EEG in, model-ready windows out: MNE readers, channel picking, montages, filtering, windowing,
amplitude rejection and unit scaling.

The steps follow braindecode's shape (named steps on MNE objects, then windowing):

>>> raw = read_raw("S001R02.edf")                                  # doctest: +SKIP
>>> raw = pick_channels(raw, ["FP1", "FP2", "T3"])                # aliases: T3 == T7, case, 'EEG x-REF'
>>> raw = preprocess(raw, sfreq=200, l_freq=0.3, h_freq=75, notch=[60])
>>> x, y = windows_from_annotations(raw, {"T1": 0, "T2": 1}, window_s=4)   # x in µV
>>> x = to_model_units(x)                                          # CBraMod's units: 100 µV

Channels are matched by name (:func:`match_channels`): case, an ``EEG `` prefix, reference affixes
(``-REF``, ``-LE``, ``-AVG``, ``-A1`` ...), trailing dots and the old/new 10-20 names (T3/T7, T4/T8,
T5/P7, T6/P8) do not matter (``'EEG FP1-REF'``, ``'Fp1.'`` and ``'fp1'`` are one channel). A
channel the model needs and the file lacks is an error; :func:`recording_windows` feeds it as
zeros only when asked (``fill_missing="zeros"``) and says so; the file's other channels are
dropped with a notice naming them.

Errors name the file, the field and what was expected: a missing channel (with the channels the
file has), a recording shorter than needed, a sampling rate below the target (upsampling would
invent content), NaNs, an unreadable format. Warnings name the file too: channels marked bad in
it (``info["bads"]``, e.g. a FIF) are dropped, or interpolated where the model needs them by name
(:func:`drop_bad_channels`); an EDF/BDF shorter than its header declares is read as far as it
goes, with the seconds read and declared.

Large corpora (TUEG) are converted once with these readers into a streamed corpus by
``domainfm prepare cbramod`` (:data:`domainfm.pretrain.cbramod.PREPARE`, on :mod:`domainfm.streaming`).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.resources
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
    "ChannelMatch",
    "match_channels",
    "scalp_channels",
    "name_channels",
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

# reference affixes of a channel label: TUH's '-REF' / '-LE' (linked ears), average ('-AVG', '-AR',
# '-CAR'), ear and mastoid references ('-A1', '-A2', '-A1A2', '-M1', '-M2', '-M1M2')
_REFERENCE_SUFFIX = re.compile(r"\s*[-_ ]\s*(REF|LE|AVG|AR|CAR|A1A2|A1|A2|M1M2|M1|M2)$")

# 10-05 names that are reference sites (ear lobes, mastoids), not scalp electrodes
_REFERENCE_SITES = frozenset({"A1", "A2", "M1", "M2"})

#: file suffix -> MNE reader name
READERS = {".edf": "read_raw_edf", ".bdf": "read_raw_bdf", ".fif": "read_raw_fif", ".fif.gz": "read_raw_fif",
           ".vhdr": "read_raw_brainvision", ".set": "read_raw_eeglab"}


# ----------------------------------------------------------------------------- reading


def normalize_channel_name(name: str) -> str:
    """Canonical form for matching: upper case, without an ``EEG`` prefix, a reference suffix
    (``-REF``, ``-LE``, ``-AVG``/``-AR``/``-CAR``, ``-A1``/``-A2``/``-A1A2``, ``-M1``/``-M2``) and
    EEGMMIDB's trailing dots (``'EEG FP1-REF'``, ``'EEG FP1-LE'``, ``'Fp1.'``, ``'fp1'`` -> ``'FP1'``).
    The old/new 10-20 aliases (T3/T7 ...) are not merged here but in :func:`match_channels`."""
    text = name.strip().upper()
    text = re.sub(r"^EEG(?:[\s_:]+|(?=[A-Z]))", "", text).rstrip(".").strip()
    text = _REFERENCE_SUFFIX.sub("", text).rstrip(".").strip()
    return text or name.strip().upper()  # a label that is all prefix/suffix ('EEG', 'REF') stays itself


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


@dataclass
class ChannelMatch:
    """Where each channel a model takes was found in a recording (:func:`match_channels`).

    ``channels``: the names asked for, in order; ``file_channels``: the file's channel for each
    (None: the file has none of that name); ``available``: every channel of the file, in file
    order; ``where``: the file, for messages; ``filled``: the missing channels were fed as zeros.
    ``str()`` is the one-line account a ``predict``/``embed`` summary prints."""

    channels: list[str]
    file_channels: list[str | None]
    available: list[str]
    where: str = "<recording>"
    filled: bool = False

    @property
    def missing(self) -> list[str]:
        """The names asked for that the file lacks."""
        return [name for name, ch in zip(self.channels, self.file_channels) if ch is None]

    @property
    def present(self) -> list[str]:
        """The names asked for that the file has, in the order asked."""
        return [name for name, ch in zip(self.channels, self.file_channels) if ch is not None]

    @property
    def extra(self) -> list[str]:
        """The file's channels not asked for, in file order."""
        used = set(self.file_channels)
        return [ch for ch in self.available if ch not in used]

    def __str__(self) -> str:
        renamed = [f"{name}={ch}" for name, ch in zip(self.channels, self.file_channels) if ch not in (None, name)]
        parts = [f"{len(self.present)} of the model's {len(self.channels)} channels found by name"
                 + (f" ({', '.join(renamed)})" if renamed else "")]
        if self.missing:
            parts.append(f"missing {self.missing}" + (" filled with zeros (fill_missing='zeros')" if self.filled else ""))
        if self.extra:
            parts.append(f"{len(self.extra)} other channel(s) of the file dropped")
        return "; ".join(parts)

    def missing_error(self, hint: str = "") -> EEGError:
        """The error naming the missing channels and the file's (``hint`` appended)."""
        return EEGError(
            f"{self.where}: channel(s) {self.missing} not found (matched case-insensitively, ignoring an 'EEG' prefix, "
            f"reference suffixes such as '-REF'/'-LE'/'-A1' and trailing dots, with aliases T3/T7, T4/T8, T5/P7, "
            f"T6/P8); the file has {self.available}{hint}")


def match_channels(raw, names: Sequence[str]) -> ChannelMatch:
    """Find each of ``names`` among ``raw.ch_names``: a file channel spelled exactly so, else the
    one whose :func:`normalize_channel_name` is the same, else its old/new 10-20 alias (T3/T7,
    T4/T8, T5/P7, T6/P8). Two file channels that normalise alike (``'EEG FP1-REF'`` and
    ``'EEG FP1-LE'``) are an error when asked for, since either could be meant; a missing channel
    is not (see :attr:`ChannelMatch.missing`, :meth:`ChannelMatch.missing_error`)."""
    by_key: dict[str, list[str]] = {}
    for ch in raw.ch_names:
        by_key.setdefault(normalize_channel_name(ch), []).append(ch)
    found: list[str | None] = []
    for name in names:
        if name in raw.ch_names:
            found.append(name)
            continue
        key = normalize_channel_name(name)
        hits = by_key.get(key) or by_key.get(_ALIASES.get(key, ""), [])
        if len(hits) > 1:
            raise EEGError(f"{_where(raw)}: channel {name!r} matches several of the file's channels {hits}; name the "
                           "one to use exactly as the file spells it")
        found.append(hits[0] if hits else None)
    return ChannelMatch(list(names), found, list(raw.ch_names), _where(raw))


def _resolve(raw, names: Sequence[str]) -> list[str]:
    match = match_channels(raw, names)
    if match.missing:
        raise match.missing_error()
    return list(match.file_channels)


@functools.lru_cache(maxsize=1)
def _electrode_names() -> frozenset[str]:
    """The 10-05 system's electrode names (MNE's montage, named ``colin27_1005`` from MNE 1.13),
    normalised, without the reference sites A1/A2/M1/M2."""
    import mne

    name = "colin27_1005" if "colin27_1005" in mne.channels.get_builtin_montages() else "standard_1005"
    names = mne.channels.make_standard_montage(name).ch_names
    return frozenset(normalize_channel_name(n) for n in names) - _REFERENCE_SITES


def scalp_channels(raw) -> list[str]:
    """The file's scalp EEG channels, in file order: those of EEG type whose name (in any spelling
    :func:`normalize_channel_name` accepts) is a 10-05 electrode, the ear/mastoid reference sites
    A1/A2/M1/M2 excepted. EDF readers type every signal as EEG, so TUH's ``'EEG EKG1-REF'``, an
    EOG, photic or numbered channel would otherwise enter an average reference. A file none of
    whose EEG channels has a 10-05 name (numbered nets: E1..E128) keeps every EEG channel."""
    import mne

    eeg_names = [raw.ch_names[i] for i in mne.pick_types(raw.info, eeg=True, exclude=[])]
    scalp = [ch for ch in eeg_names if normalize_channel_name(ch) in _electrode_names()]
    return scalp or eeg_names


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
    """Keep ``channels`` in this order, found by name (:func:`match_channels`) and renamed to the
    requested names; a missing channel is an error naming it and the file's channels."""
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


def name_channels(settings: EEGSettings, files: Iterable[str | os.PathLike]) -> EEGSettings:
    """``settings`` with its channels named. Unchanged where ``settings`` names channels or bipolar
    pairs; otherwise (every EEG channel) ``channels`` becomes the EEG channels of the first of
    ``files``, in its order and without those marked bad in it. Every file is then read by name in
    that one order (a file whose channels come in another order is reordered, one that lacks a
    channel is an error, where reading in file order would mix channels silently), and a run can
    record the channels its model takes."""
    if settings.channels is not None or settings.bipolar is not None:
        return settings
    first = next(iter(files), None)
    if first is None:
        return settings
    import mne

    raw = read_raw(first, preload=False)
    names = [raw.ch_names[i] for i in mne.pick_types(raw.info, eeg=True, exclude="bads")]
    return dataclasses.replace(settings, channels=names)


def recording_windows(recording, settings: EEGSettings, *, stride_s: float | None = None,
                      reference_all: bool = False, source: str | None = None, fill_missing: str | None = None,
                      return_match: bool = False, notify: bool = True):
    """Every fixed window of one recording, for inference (``predict`` / ``embed``): the channel
    selection and preprocessing of ``settings`` (as :func:`load_windows`), then consecutive
    ``settings.window_s`` windows every ``stride_s`` (default: the window, no overlap) from the
    first sample to the end. No labels, no trimming, no amplitude rejection: every window gets
    an output row.

    ``settings.channels`` are found by name (:func:`match_channels`: any case, ``EEG`` prefix,
    reference suffix, trailing dots, T3/T7-style aliases) and fed in that order; the file's other
    channels are dropped, with a one-line warning naming them.

    Args:
        recording: a file path (any format of :data:`READERS`) or an MNE ``Raw``.
        reference_all: average-reference over *every* scalp channel of the file
            (:func:`scalp_channels`: EEG channels with 10-05 names, so an ECG/EOG channel stays
            out) before picking ``settings.channels`` (CBraMod's embedded demo task does this;
            :func:`load_windows` references the picked channels).
        source: the name used in errors when ``recording`` is a ``Raw``.
        fill_missing: None (default): a channel of ``settings.channels`` that the file lacks is
            an error naming it and the file's channels. ``"zeros"``: it is fed to the model as
            zeros (after preprocessing, so it enters no reference), with a warning naming it.
        return_match: also return the :class:`ChannelMatch` (None without named channels).
        notify: warn about dropped and zero-filled channels (off for internal reads, e.g. CBraMod's
            retained-capability windows, which pick a few channels on purpose).

    Returns ``(x, start_s)`` (``(x, start_s, match)`` with ``return_match``): windows ``(n, C, T)``
    float32 in model units and their start times in seconds from the first sample. Errors
    (:class:`EEGError`) name the file: a missing channel (listing the file's), a rate below
    ``settings.sfreq`` without ``allow_upsample``, a recording shorter than one window. Channels
    marked bad in the recording are handled (and announced) as by :func:`drop_bad_channels`.
    """
    if fill_missing not in (None, "zeros"):
        raise EEGError(f"fill_missing={fill_missing!r}: expected None (a missing channel is an error) or 'zeros'")
    if isinstance(recording, (str, os.PathLike)):
        raw = read_raw(recording)
    else:
        raw = recording.copy()
        if source is not None or not getattr(raw, "filenames_for_errors", None):
            raw.filenames_for_errors = source or _where(raw)
    where = _where(raw)
    needed = _needed_channels(settings)
    match = None
    if settings.pairs() is None and settings.channels is not None:
        match = match_channels(raw, settings.channels)
        if match.missing and (fill_missing is None or not match.present):
            raise match.missing_error(
                "; fill_missing='zeros' (--fill-missing zeros) feeds missing channels as zeros" if fill_missing is None
                else "; none of the model's channels is in the file, so there is nothing to fill around")
        needed = match.present
    elif fill_missing is not None and settings.pairs() is not None:
        raise EEGError(f"{where}: fill_missing={fill_missing!r} needs named channels; the model reads bipolar pairs")
    raw = drop_bad_channels(raw, needed, notify_dropped=needed is None or (reference_all and settings.pairs() is None))
    pre = dict(sfreq=settings.sfreq, l_freq=settings.l_freq, h_freq=settings.h_freq, notch=settings.notch,
               allow_upsample=settings.allow_upsample)
    if settings.pairs() is not None:
        raw = preprocess(bipolar_montage(raw, settings.pairs()), reference=settings.reference, **pre)
    elif reference_all:
        import mne

        scalp = scalp_channels(raw)
        average = settings.reference == "average"
        raw = preprocess(raw.copy().pick(mne.pick_types(raw.info, eeg=True, exclude=[])),
                         reference=None if average else settings.reference, **pre)
        if average:  # over the scalp channels only: an ECG or EOG channel is no part of the average
            raw.set_eeg_reference(scalp, verbose="error")
        raw.filenames_for_errors = where
        if needed is not None:
            raw = pick_channels(raw, needed)
    else:
        raw = pick_channels(raw, needed) if needed is not None else raw.copy().pick("eeg")
        raw = preprocess(raw, reference=settings.reference, **pre)
    x, starts = fixed_windows(raw, window_s=settings.window_s, stride_s=stride_s)
    x = to_model_units(x, uv_per_unit=settings.uv_per_unit)
    if match is not None:
        notes = []
        if match.missing:
            full = np.zeros((len(x), len(match.channels), x.shape[-1]), dtype=x.dtype)
            full[:, [i for i, ch in enumerate(match.file_channels) if ch is not None]] = x
            x, match.filled = full, True
            notes.append(f"channel(s) {match.missing} are not in the file: fed to the model as zeros "
                         "(fill_missing='zeros')")
        if match.extra:
            used = " (scalp channels among them still enter the average reference)" if reference_all else ""
            notes.append(f"channel(s) {match.extra} are not among the model's channels: dropped{used}")
        if notes and notify:
            warnings.warn(f"{where}: " + "; ".join(notes), UserWarning, stacklevel=2)
    return (x, starts, match) if return_match else (x, starts)


class WindowDataset(Dataset):
    """In-memory ``(x, y)`` windows; ``x`` float32 ``(n, C, T)``, ``y`` long (classes) or float;
    ``channels``: the names of the ``C`` channels, where known."""

    def __init__(self, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor | None = None, *, regression: bool = False,
                 channels: Sequence[str] | None = None):
        self.x = torch.as_tensor(np.asarray(x, dtype=np.float32))
        self.channels = None if channels is None else list(channels)
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
        if self.channels is not None and len(self.channels) != self.x.shape[1]:
            raise EEGError(f"{self.x.shape[1]} channels in the windows but {len(self.channels)} channel names")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] if self.y is None else (self.x[i], self.y[i])


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
