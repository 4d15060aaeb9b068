"""The EEG channel contract: names matched across conventions (TUH's ``EEG FP1-REF``, EEGMMIDB's
``Fp1.``, case, reference suffixes, T3/T7 aliases), a missing channel is an error unless zero
filling is asked for, other channels are dropped with a notice, and an average reference is taken
over the scalp channels only (an ECG or EOG channel in the file changes nothing)."""
from __future__ import annotations

import warnings

import mne
import numpy as np
import pytest

from domainfm.data_loaders import eeg
from domainfm.data_loaders.eeg import EEGError, EEGSettings

NO_FILTER = dict(l_freq=None, h_freq=None, notch=[])
CLEAN = ["Fp1", "Fp2", "T7", "C3", "Cz", "C4", "T8", "P7", "O1", "O2"]
# the same electrodes as TUH spells them (old 10-20 names for T7/T8/P7, mixed reference suffixes)
TUH = {"Fp1": "EEG FP1-REF", "Fp2": "EEG FP2-REF", "T7": "EEG T3-REF", "C3": "EEG C3-LE", "Cz": "EEG CZ-REF",
       "C4": "EEG C4-AVG", "T8": "EEG T4-REF", "P7": "EEG T5-A1", "O1": "EEG O1-REF", "O2": "o2."}
# non-scalp signals an EDF types as EEG: they must enter neither the model nor an average reference
EXTRAS = ["EEG EKG1-REF", "EOG LOC", "EEG A1-REF", "EEG 26-REF", "PHOTIC"]


def _data(n_ch, seconds=6.0, sfreq=200.0, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sfreq)) / sfreq
    return np.stack([(20 + 3 * i) * np.sin(2 * np.pi * (2 + i) * t) + 4 * rng.standard_normal(len(t))
                     for i in range(n_ch)])


def _edf(path, data_uv, names, sfreq=200.0):
    raw = mne.io.RawArray(data_uv * 1e-6, mne.create_info(list(names), sfreq, "eeg"), verbose="error")
    # each channel quantised on its own range: a channel's samples do not depend on its neighbours
    mne.export.export_raw(str(path), raw, fmt="edf", physical_range="channelwise", overwrite=True, verbose="error")
    return path


@pytest.fixture()
def pair(tmp_path):
    """(clean file, TUH-style file, clean data in µV): the TUH file holds the same signals under
    TUH names, in reversed order, with five extra channels of large amplitude in between."""
    data = _data(len(CLEAN))
    clean = _edf(tmp_path / "clean.edf", data, CLEAN)
    extras = 900.0 * np.sign(_data(len(EXTRAS), seed=1))  # ±900 µV: visible in any average they entered
    order = list(range(len(CLEAN)))[::-1]
    rows = [data[i] for i in order[:5]] + list(extras) + [data[i] for i in order[5:]]
    names = [TUH[CLEAN[i]] for i in order[:5]] + EXTRAS + [TUH[CLEAN[i]] for i in order[5:]]
    tuh = _edf(tmp_path / "tuh.edf", np.stack(rows), names)
    return clean, tuh, eeg.read_raw(clean).get_data(units="uV")


@pytest.mark.parametrize("label, canonical", [
    ("EEG FP1-REF", "FP1"), ("EEG FP1-LE", "FP1"), ("Fp1.", "FP1"), ("fp1", "FP1"), ("FP1-AVG", "FP1"),
    ("EEG Fp1-A1", "FP1"), ("Fp1-A1A2", "FP1"), ("FP1-M2", "FP1"), ("Cz-CAR", "CZ"), ("EEG:Fp1", "FP1"),
    ("EEG FP1 - REF", "FP1"), ("C3..", "C3"), ("T10.", "T10"), ("EEG T3-LE", "T3"), ("EEG EKG1-REF", "EKG1"),
    ("EEG 26-REF", "26"), ("EEG A1-REF", "A1"), ("EOG LOC", "EOG LOC"), ("REF", "REF"), ("EEG", "EEG"),
])
def test_channel_labels_normalise_across_conventions(label, canonical):
    assert eeg.normalize_channel_name(label) == canonical


def test_match_by_name_with_aliases_both_ways_exact_spelling_first_and_ambiguity_refused():
    names = ["EEG FP1-REF", "EEG T3-REF", "EEG T6-LE", "P7..", "EEG EKG1-REF", "Cz"]
    raw = mne.io.RawArray(np.zeros((len(names), 10)), mne.create_info(names, 200.0, "eeg"), verbose="error")
    match = eeg.match_channels(raw, ["fp1", "T7", "P8", "T5", "CZ", "O1"])
    # T7 <- the file's T3, P8 <- T6 (old names in the file), T5 <- P7 (new name in the file)
    assert match.file_channels == ["EEG FP1-REF", "EEG T3-REF", "EEG T6-LE", "P7..", "Cz", None]
    assert match.missing == ["O1"] and match.present == ["fp1", "T7", "P8", "T5", "CZ"]
    assert match.extra == ["EEG EKG1-REF"] and match.available == names
    assert str(match) == ("5 of the model's 6 channels found by name (fp1=EEG FP1-REF, T7=EEG T3-REF, P8=EEG T6-LE, "
                          "T5=P7.., CZ=Cz); missing ['O1']; 1 other channel(s) of the file dropped")
    # two spellings of one electrode: asking for it by a third spelling is ambiguous, by one of them is not
    twice = ["EEG FP1-REF", "EEG FP1-LE", "Fp2"]
    raw = mne.io.RawArray(np.zeros((3, 10)), mne.create_info(twice, 200.0, "eeg"), verbose="error")
    with pytest.raises(EEGError, match=r"channel 'Fp1' matches several of the file's channels "
                                       r"\['EEG FP1-REF', 'EEG FP1-LE'\]"):
        eeg.match_channels(raw, ["Fp1"])
    assert eeg.match_channels(raw, ["EEG FP1-LE", "FP2"]).file_channels == ["EEG FP1-LE", "Fp2"]


def test_tuh_style_file_gives_the_clean_files_windows_and_names_the_dropped_channels(pair):
    clean, tuh, data = pair
    model_channels = ["Fp1", "T7", "P7", "O2", "Cz"]
    rows = [CLEAN.index(c) for c in model_channels]
    settings = EEGSettings(channels=model_channels, window_s=2.0, reference="average", **NO_FILTER)
    x_clean, starts = eeg.recording_windows(clean, settings)
    with pytest.warns(UserWarning) as record:
        x_tuh, starts_tuh, match = eeg.recording_windows(tuh, settings, return_match=True)
    notices = [str(w.message) for w in record if "not among the model's channels" in str(w.message)]
    assert len(notices) == 1 and "\n" not in notices[0] and notices[0].startswith(f"{tuh}: ")
    for name in EXTRAS + ["EEG FP2-REF", "EEG C3-LE", "EEG C4-AVG", "EEG T4-REF", "EEG O1-REF"]:
        assert repr(name) in notices[0]
    assert match.file_channels == ["EEG FP1-REF", "EEG T3-REF", "EEG T5-A1", "o2.", "EEG CZ-REF"]
    np.testing.assert_allclose(starts_tuh, starts)
    np.testing.assert_allclose(x_tuh, x_clean, atol=1e-6)
    # independent: the picked channels minus their mean, in units of 100 µV, cut every 2 s
    picked = data[rows] - data[rows].mean(axis=0)
    np.testing.assert_allclose(x_clean, np.stack([picked[:, s:s + 400] for s in range(0, 1200, 400)]) / 100,
                               atol=1e-5)

    # average over every scalp channel of the file (the demo's reference): the five extra channels
    # (ECG, EOG, the A1 ear reference, a numbered and a photic channel) stay out of it
    with pytest.warns(UserWarning, match="scalp channels among them still enter the average reference"):
        x_all = eeg.recording_windows(tuh, settings, reference_all=True)[0]
    np.testing.assert_allclose(x_all, eeg.recording_windows(clean, settings, reference_all=True)[0], atol=1e-6)
    every = data - data.mean(axis=0)
    np.testing.assert_allclose(x_all[1], every[rows, 400:800] / 100, atol=1e-5)


def test_scalp_channels_keep_10_05_electrodes_and_fall_back_for_numbered_nets():
    names = ["EEG FP1-REF", "EEG EKG1-REF", "Fcz.", "EEG A1-REF", "M2", "EEG 26-REF", "EOG LOC", "T9..", "EEG T3-LE"]
    raw = mne.io.RawArray(np.zeros((len(names), 10)), mne.create_info(names, 200.0, "eeg"), verbose="error")
    assert eeg.scalp_channels(raw) == ["EEG FP1-REF", "Fcz.", "T9..", "EEG T3-LE"]
    info = mne.create_info(["Fp1", "Fp2", "HEOG", "STI"], 200.0, ["eeg", "eeg", "eog", "stim"])
    assert eeg.scalp_channels(mne.io.RawArray(np.zeros((4, 10)), info, verbose="error")) == ["Fp1", "Fp2"]
    net = [f"E{i}" for i in range(1, 9)]  # no 10-05 name at all: every EEG channel is a scalp channel
    assert eeg.scalp_channels(mne.io.RawArray(np.zeros((8, 10)), mne.create_info(net, 200.0, "eeg"),
                                              verbose="error")) == net


def test_a_missing_channel_is_an_error_listing_both_sides_unless_zeros_are_asked_for(pair):
    _, tuh, data = pair
    settings = EEGSettings(channels=["Fp1", "Pz", "C4", "Oz"], window_s=2.0, reference="average", **NO_FILTER)
    with pytest.raises(EEGError) as err:
        eeg.recording_windows(tuh, settings)
    text = str(err.value)
    assert text.startswith(f"{tuh}: channel(s) ['Pz', 'Oz'] not found") and "fill_missing='zeros'" in text
    assert f"the file has {mne.io.read_raw_edf(tuh, verbose='error').ch_names}" in text

    with pytest.warns(UserWarning, match=r"channel\(s\) \['Pz', 'Oz'\] are not in the file: fed to the model as "
                                         r"zeros \(fill_missing='zeros'\)"):
        x, _, match = eeg.recording_windows(tuh, settings, fill_missing="zeros", return_match=True)
    assert x.shape == (3, 4, 400) and match.filled and "missing ['Pz', 'Oz'] filled with zeros" in str(match)
    assert not x[:, [1, 3]].any()  # exactly zero, where the model expects Pz and Oz
    # the present channels as if only they had been asked for: the zeros enter no average reference
    present = EEGSettings(channels=["Fp1", "C4"], window_s=2.0, reference="average", **NO_FILTER)
    np.testing.assert_allclose(x[:, [0, 2]], eeg.recording_windows(tuh, present)[0], atol=1e-6)
    rows = [CLEAN.index("Fp1"), CLEAN.index("C4")]
    picked = data[rows] - data[rows].mean(axis=0)
    np.testing.assert_allclose(x[2, [0, 2]], picked[:, 800:1200] / 100, atol=1e-5)

    with pytest.raises(EEGError, match=r"fill_missing='mean': expected None .* or 'zeros'"):
        eeg.recording_windows(tuh, settings, fill_missing="mean")
    with pytest.raises(EEGError, match=r"channel\(s\) \['Pz', 'Oz'\] not found.*none of the model's channels is "
                                       "in the file"):
        eeg.recording_windows(tuh, EEGSettings(channels=["Pz", "Oz"], window_s=2.0, **NO_FILTER), fill_missing="zeros")
    with pytest.raises(EEGError, match="fill_missing='zeros' needs named channels"):
        eeg.recording_windows(tuh, EEGSettings(bipolar=[["Fp1", "T7"]], window_s=2.0, **NO_FILTER),
                              fill_missing="zeros")


def test_a_complete_match_reads_without_a_notice(pair):
    clean, _, _ = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = eeg.recording_windows(clean, EEGSettings(channels=list(CLEAN), window_s=2.0, **NO_FILTER))[0]
    assert x.shape == (3, len(CLEAN), 400)


def test_name_channels_reads_every_training_file_in_the_first_files_order(tmp_path, pair):
    clean, tuh, data = pair
    settings = EEGSettings(window_s=2.0, **NO_FILTER)  # channels: null, every EEG channel
    named = eeg.name_channels(settings, [clean, tuh])
    assert named.channels == CLEAN and settings.channels is None
    # the TUH file, reversed and with extras, is read in the clean file's order: the same windows
    np.testing.assert_allclose(eeg.load_windows(tuh, named)[0], eeg.load_windows(clean, named)[0], atol=1e-6)
    # without naming, file order: the rows would not line up (the silent mix this prevents)
    assert eeg.load_windows(tuh, settings)[0].shape[1] == len(CLEAN) + len(EXTRAS)
    short = _edf(tmp_path / "short.edf", data[:-1], CLEAN[:-1])
    with pytest.raises(EEGError, match=r"short\.edf: channel\(s\) \['O2'\] not found"):
        eeg.load_windows(short, named)
    # a channel marked bad in the first file is not one of the run's channels
    raw = mne.io.RawArray(data * 1e-6, mne.create_info(CLEAN, 200.0, "eeg"), verbose="error")
    raw.info["bads"] = ["Cz"]
    raw.save(str(tmp_path / "bad_raw.fif"), verbose="error")
    assert eeg.name_channels(settings, [tmp_path / "bad_raw.fif"]).channels == [c for c in CLEAN if c != "Cz"]
    fixed = EEGSettings(channels=["Fp1"], window_s=2.0)
    assert eeg.name_channels(fixed, [clean]) is fixed and eeg.name_channels(settings, []) is settings


def test_window_dataset_carries_its_channel_names():
    ds = eeg.WindowDataset(np.zeros((2, 3, 400)), np.zeros(2), channels=("Fp1", "Fp2", "Cz"))
    assert ds.channels == ["Fp1", "Fp2", "Cz"] and eeg.WindowDataset(np.zeros((2, 3, 400))).channels is None
    with pytest.raises(EEGError, match="3 channels in the windows but 2 channel names"):
        eeg.WindowDataset(np.zeros((2, 3, 400)), channels=["Fp1", "Fp2"])
