"""The CBraMod embedded default task, built from the shipped recording (PhysioNet EEGMMIDB
S001R02, ODC-By; ``samples/eeg/README.md``). The recording has no task events, so the labels are
constructed (:data:`DEMO_LABELS_NOTE` says how, and every report prints it)."""
from __future__ import annotations

import numpy as np

from domainfm.data_loaders import eeg

__all__ = ["DEMO_REGIONS", "DEMO_LABELS_NOTE", "build_demo_task"]


#: scalp regions of the demo task (EEGMMIDB 10-10 names), 16 channels each, in groups of 4 neighbours
DEMO_REGIONS = {
    "frontal": ["Fp1", "Fpz", "Fp2", "Af7", "Af3", "Afz", "Af4", "Af8", "F7", "F5", "F3", "F1", "Fz", "F2", "F4", "F6"],
    "central": ["C5", "C3", "C1", "Cz", "C2", "C4", "C6", "T7", "Cp5", "Cp3", "Cp1", "Cpz", "Cp2", "Cp4", "Cp6", "T8"],
    "posterior": ["P7", "P5", "P3", "P1", "Pz", "P2", "P4", "P6", "P8", "Po7", "Po3", "Poz", "Po4", "Po8", "O1", "O2"],
}
DEMO_LABELS_NOTE = (
    "constructed: the shipped recording (PhysioNet EEGMMIDB S001R02, eyes-closed resting baseline, "
    "whose only annotation is one T0 = rest) has no task events, so each example is 4 neighbouring "
    "channels x 4 s and its label is the scalp region those channels lie over (0 frontal: Fp/Af/F rows; "
    "1 central: C/Cp rows + T7/T8; 2 posterior: P/Po/O rows), read from the channel names. "
    "Train: windows within 0-40 s; val: windows within 41-61 s (no overlap in time)."
)


def build_demo_task(settings: eeg.EEGSettings | None = None, *, window_s: float = 4.0, stride_s: float = 2.0,
                    split_s: float = 40.0, gap_s: float = 1.0):
    """The embedded default task from the shipped ``S001R02.edf`` (see :data:`DEMO_LABELS_NOTE`).

    Returns ``(train, val)`` :class:`~domainfm.data_loaders.eeg.WindowDataset`\\ s of ``(4, 800)``
    windows (4 channels x 4 one-second patches at 200 Hz, units of 100 µV) with region labels.
    """
    settings = settings or eeg.EEGSettings(reference="average", allow_upsample=True)
    path = eeg.samples_dir() / "S001R02.edf"
    channels = [ch for region in DEMO_REGIONS.values() for ch in region]
    raw = eeg.read_raw(path)
    raw = eeg.preprocess(raw.copy().pick("eeg"), sfreq=settings.sfreq, l_freq=settings.l_freq,
                         h_freq=settings.h_freq, notch=settings.notch, reference=settings.reference,
                         allow_upsample=settings.allow_upsample)  # average reference over all 64 channels
    raw = eeg.pick_channels(raw, channels)
    splits = []
    for start, stop in ((0.0, split_s), (split_s + gap_s, None)):
        x, _ = eeg.fixed_windows(raw, window_s=window_s, stride_s=stride_s, start_s=start, stop_s=stop)
        x = eeg.to_model_units(x, uv_per_unit=settings.uv_per_unit)
        xs, ys = [], []
        for label, region in enumerate(DEMO_REGIONS):
            first = channels.index(DEMO_REGIONS[region][0])
            for g in range(0, len(DEMO_REGIONS[region]), 4):
                xs.append(x[:, first + g : first + g + 4])
                ys.append(np.full(len(x), label))
        splits.append(eeg.WindowDataset(np.concatenate(xs), np.concatenate(ys)))
    return splits[0], splits[1]
