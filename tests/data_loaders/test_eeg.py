"""EEG loading: EDF round trips through MNE's exporter, windows, labels, units, errors."""
from __future__ import annotations

import importlib.resources

import mne
import numpy as np
import pytest

from domainfm.data_loaders import eeg
from domainfm.data_loaders.eeg import EEGError, EEGSettings

NO_FILTER = dict(l_freq=None, h_freq=None, notch=[])


def _signal(n_ch=3, sfreq=200.0, seconds=12.0, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sfreq)) / sfreq
    # µV: a slow sine per channel + noise, well inside +-100 µV
    data = np.stack([30 * np.sin(2 * np.pi * (3 + i) * t) + 5 * rng.standard_normal(len(t)) for i in range(n_ch)])
    return data


def _write_edf(path, data_uv, sfreq=200.0, names=("EEG FP1-REF", "EEG T3-REF", "EEG C3-REF"), annotations=None):
    info = mne.create_info(list(names), sfreq, ch_types="eeg")
    raw = mne.io.RawArray(data_uv * 1e-6, info, verbose="error")
    if annotations:
        onsets, durations, descriptions = zip(*annotations)
        raw.set_annotations(mne.Annotations(onsets, durations, descriptions))
    mne.export.export_raw(str(path), raw, fmt="edf", overwrite=True, verbose="error")
    return path


def test_edf_round_trip_windows_labels_and_units(tmp_path):
    data = _signal()
    path = _write_edf(tmp_path / "rec.edf", data,
                      annotations=[(1.0, 2.0, "left"), (5.0, 2.0, "right"), (9.0, 2.0, "rest"), (11.0, 1.0, "left")])
    settings = EEGSettings(channels=["t7", "Fp1"], events={"left": 0, "right": 1}, window_s=2.0, **NO_FILTER)
    x, y = eeg.load_windows(path, settings)
    # the 'left' at 11 s does not fit a 2 s window in a 12 s recording and is dropped; 'rest' is not mapped
    assert y.tolist() == [0, 1]
    assert x.shape == (2, 2, 400) and x.dtype == np.float32
    # channels ordered as requested (T7 is the alias of the file's T3), values in units of 100 µV
    want = np.stack([data[[1, 0], 200:600], data[[1, 0], 1000:1400]]) / 100.0
    np.testing.assert_allclose(x, want, atol=2e-4)  # EDF's 16-bit quantisation


def test_fixed_windows_trim_and_amplitude_rejection(tmp_path):
    data = _signal(seconds=10.0)
    data[2, 5 * 200 + 17] = 250.0  # a 250 µV artefact in the third 2-s window after trimming 1 s
    path = _write_edf(tmp_path / "rec.edf", data)
    base = dict(channels=["FP1", "T3", "C3"], window_s=2.0, trim_s=1.0, **NO_FILTER)
    x, y = eeg.load_windows(path, EEGSettings(**base))
    assert y is None and x.shape == (4, 3, 400)  # 1 s..9 s -> 4 windows of 2 s
    np.testing.assert_allclose(x[0], data[:, 200:600] / 100, atol=2e-4)
    x, _ = eeg.load_windows(path, EEGSettings(**base, reject_uv=100.0))
    assert x.shape[0] == 3
    np.testing.assert_allclose(x[2], data[:, 1400:1800] / 100, atol=2e-4)  # the window after the artefact
    labelled, y = eeg.load_windows(path, EEGSettings(**base, file_labels={"*/rec.edf": 1, "*/other*": 0}))
    assert y.tolist() == [1, 1, 1, 1]


def test_bipolar_montage_from_pairs(tmp_path):
    data = _signal()
    path = _write_edf(tmp_path / "rec.edf", data)
    x, _ = eeg.load_windows(path, EEGSettings(bipolar=[["FP1", "T7"], ["C3", "FP1"]], window_s=4.0, **NO_FILTER))
    assert x.shape == (3, 2, 800)
    np.testing.assert_allclose(x[1, 0], (data[0] - data[1])[800:1600] / 100, atol=4e-4)
    np.testing.assert_allclose(x[1, 1], (data[2] - data[0])[800:1600] / 100, atol=4e-4)
    raw = eeg.bipolar_montage(eeg.read_raw(path), [("FP1", "T3")])
    assert raw.ch_names == ["FP1-T3"]
    assert len(eeg.TCP_BIPOLAR_16) == 16


def test_resampling_filtering_and_notch(tmp_path):
    sf = 250.0
    t = np.arange(int(20 * sf)) / sf
    data = np.stack([20 * np.sin(2 * np.pi * 10 * t) + 20 * np.sin(2 * np.pi * 60 * t)] * 3)
    path = _write_edf(tmp_path / "rec.edf", data, sfreq=sf)
    raw = eeg.preprocess(eeg.read_raw(path), sfreq=200.0, l_freq=0.3, h_freq=75.0, notch=[60.0])
    assert raw.info["sfreq"] == 200.0 and raw.n_times == 4000
    spectrum = np.abs(np.fft.rfft(raw.get_data(units="uV")[0, 1000:3000]))  # 10 s, 0.1 Hz bins
    assert spectrum[600] < 0.05 * spectrum[100]  # 60 Hz removed, 10 Hz kept


def test_bad_inputs_raise_clear_errors(tmp_path):
    data = _signal()
    path = _write_edf(tmp_path / "rec.edf", data, annotations=[(1.0, 1.0, "left")])
    with pytest.raises(EEGError, match=r"channel\(s\) \['O2'\] not found.*EEG FP1-REF"):
        eeg.load_windows(path, EEGSettings(channels=["FP1", "O2"], window_s=2.0, **NO_FILTER))
    with pytest.raises(EEGError, match="recording too short: 12.0 s, data.min_duration_s is 300"):
        eeg.load_windows(path, EEGSettings(window_s=2.0, min_duration_s=300, **NO_FILTER))
    with pytest.raises(EEGError, match="recording too short: 12.00 s available.*needs 30 s"):
        eeg.load_windows(path, EEGSettings(window_s=30.0, **NO_FILTER))
    slow = _write_edf(tmp_path / "slow.edf", _signal(sfreq=100.0), sfreq=100.0)
    with pytest.raises(EEGError, match=r"slow.edf: sampling rate 100 Hz is below the target 200 Hz"):
        eeg.load_windows(slow, EEGSettings(window_s=2.0))
    x, _ = eeg.load_windows(slow, EEGSettings(window_s=2.0, allow_upsample=True, **NO_FILTER))
    assert x.shape == (6, 3, 400)  # 12 s at 200 Hz after the explicit opt-in
    nan_data = data * 1e-6
    nan_data[1, 50] = np.nan
    nan_raw = mne.io.RawArray(nan_data, mne.create_info(["FP1", "T3", "C3"], 200.0, "eeg"), verbose="error")
    with pytest.raises(EEGError, match=r"channel\(s\) \['T3'\] contain NaN"):
        eeg.preprocess(nan_raw)
    with pytest.raises(EEGError, match="none of the annotations \\['T1'\\] occur.*\\['left'\\]"):
        eeg.load_windows(path, EEGSettings(events={"T1": 0}, window_s=1.0, **NO_FILTER))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(EEGError, match="unsupported EEG format '.txt'"):
        eeg.read_raw(tmp_path / "notes.txt")
    with pytest.raises(EEGError, match="EEG file not found"):
        eeg.read_raw(tmp_path / "missing.edf")
    (tmp_path / "broken.edf").write_bytes(b"0" * 300)
    with pytest.raises(EEGError, match="broken.edf: could not be read as .edf"):
        eeg.read_raw(tmp_path / "broken.edf")
    with pytest.raises(EEGError, match="not both"):
        EEGSettings(channels=["FP1"], bipolar="tcp16")
    with pytest.raises(EEGError, match="windows contain NaN"):
        eeg.WindowDataset(np.full((2, 3, 400), np.nan))


def test_channel_name_normalisation():
    assert eeg.normalize_channel_name("EEG FP1-REF") == "FP1"
    assert eeg.normalize_channel_name("Fc5.") == "FC5"
    assert eeg.normalize_channel_name("EEG T3-LE") == "T3"
    assert eeg.normalize_channel_name("cz") == "CZ"


def test_shipped_sample_recording_reads():
    path = importlib.resources.files("domainfm.data_loaders") / "samples" / "eeg" / "S001R02.edf"
    raw = eeg.read_raw(str(path))
    assert raw.info["sfreq"] == 160.0 and len(raw.ch_names) == 64 and raw.n_times == 9760
    assert set(raw.annotations.description) == {"T0"}
    picked = eeg.pick_channels(raw, ["Fp1", "T7", "Oz"])
    assert picked.ch_names == ["Fp1", "T7", "Oz"]


def test_recording_windows_for_inference(tmp_path):
    data = _signal(n_ch=3, seconds=9.0)
    path = _write_edf(tmp_path / "rec.edf", data)
    settings = EEGSettings(channels=["C3", "Fp1"], window_s=2.0, reference="average", **NO_FILTER)
    x, starts = eeg.recording_windows(path, settings)
    # every window from the first sample (no trim, no rejection), picked channels referenced
    assert x.shape == (4, 2, 400) and np.allclose(starts, [0, 2, 4, 6])
    picked = data[[2, 0]] - data[[2, 0]].mean(axis=0)
    np.testing.assert_allclose(x[1], picked[:, 400:800] / 100, atol=1e-4)
    # the same as load_windows' fixed windows for an unlabelled file
    np.testing.assert_allclose(x, eeg.load_windows(path, settings)[0])
    # reference_all: the average over every EEG channel of the file, then the pick
    x_all, _ = eeg.recording_windows(path, settings, stride_s=1.0, reference_all=True)
    every = data - data.mean(axis=0)
    assert x_all.shape == (8, 2, 400)
    np.testing.assert_allclose(x_all[1], every[[2, 0], 200:600] / 100, atol=1e-4)
    # an MNE Raw in, errors named after `source`
    raw = eeg.read_raw(path)
    with pytest.raises(EEGError, match=r"^my-recording: channel\(s\) \['O1'\] not found"):
        eeg.recording_windows(raw, EEGSettings(channels=["O1"], **NO_FILTER), source="my-recording")
    with pytest.raises(EEGError, match=r"rec\.edf: channel\(s\) \['O1'\] not found"):
        eeg.recording_windows(path, EEGSettings(channels=["O1"], **NO_FILTER), reference_all=True)
    with pytest.raises(EEGError, match="recording too short: 9.00 s available"):
        eeg.recording_windows(path, EEGSettings(window_s=10.0, **NO_FILTER))
    with pytest.raises(EEGError, match="below the target 400 Hz"):
        eeg.recording_windows(path, EEGSettings(sfreq=400.0, window_s=2.0, **NO_FILTER))


def _write_fif_with_bad(path, data_uv, names, bads, sfreq=200.0):
    raw = mne.io.RawArray(data_uv * 1e-6, mne.create_info(list(names), sfreq, ch_types="eeg"), verbose="error")
    raw.info["bads"] = list(bads)
    raw.save(str(path), overwrite=True, verbose="error")
    return path


def test_channels_marked_bad_in_a_fif_are_dropped_with_a_notice(tmp_path):
    names = ["FP1", "F7", "T3", "C3", "T5", "O1"]
    data = _signal(n_ch=len(names), seconds=8.0)
    data[2] += 400.0  # the bad channel: a 400 µV offset no good channel comes near
    path = _write_fif_with_bad(tmp_path / "rec_raw.fif", data, names, ["T3"])
    settings = EEGSettings(window_s=2.0, **NO_FILTER)
    with pytest.warns(UserWarning, match=r"rec_raw\.fif: channel\(s\) \['T3'\] marked bad .* dropped"):
        x, _ = eeg.load_windows(path, settings)
    good = [0, 1, 3, 4, 5]
    assert x.shape == (4, 5, 400)
    np.testing.assert_allclose(x[1], data[good, 400:800] / 100, atol=1e-4)
    assert np.abs(x).max() < 1.0  # no sample of the +400 µV channel (4.0 in model units)
    with pytest.warns(UserWarning, match=r"rec_raw\.fif: channel\(s\) \['T3'\] marked bad"):
        x_inf, starts = eeg.recording_windows(path, settings)
    np.testing.assert_allclose(x_inf, x, atol=1e-6)
    # a bad channel the model needs by name is rebuilt from its neighbours (spherical splines), never read
    fixed = EEGSettings(channels=["C3", "T7"], window_s=2.0, **NO_FILTER)
    with pytest.warns(UserWarning, match=r"rec_raw\.fif: channel\(s\) \['T3'\] marked bad .* interpolated"):
        x_fixed, _ = eeg.load_windows(path, fixed)
    assert x_fixed.shape == (4, 2, 400)
    np.testing.assert_allclose(x_fixed[:, 0], x[:, 2], atol=1e-6)  # C3 untouched
    assert np.abs(x_fixed[:, 1]).max() < 1.0 and np.abs(x_fixed[:, 1]).std() > 0.01  # T7 = T3: interpolated


def _truncate_edf(src, dst, keep_fraction):
    raw_bytes = src.read_bytes()
    header = int(raw_bytes[184:192])
    dst.write_bytes(raw_bytes[: header + int((len(raw_bytes) - header) * keep_fraction)])
    return dst


def test_truncated_edf_is_read_with_a_warning_naming_the_file_and_durations(tmp_path):
    data = _signal(seconds=20.0)
    full = _write_edf(tmp_path / "full.edf", data)
    cut = _truncate_edf(full, tmp_path / "cut.edf", 0.3)
    settings = EEGSettings(channels=["FP1", "T3", "C3"], window_s=2.0, **NO_FILTER)
    with pytest.warns(UserWarning, match=r"cut\.edf: .*truncated.* 6(\.0)? s .* 20(\.0)? s"):
        x, _ = eeg.load_windows(cut, settings)
    assert x.shape == (3, 3, 400)  # what the file holds, not the 10 windows the header declares
    np.testing.assert_allclose(x[2], data[:, 800:1200] / 100, atol=2e-4)
    with pytest.warns(UserWarning, match=r"cut\.edf: .*truncated"):
        eeg.recording_windows(cut, settings)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the intact file reads without a notice
        assert eeg.load_windows(full, settings)[0].shape == (10, 3, 400)
