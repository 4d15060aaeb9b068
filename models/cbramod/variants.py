"""Registered CBraMod variants: ``cbramod-base`` (the paper's, with the official weights) and
``cbramod-test`` (tiny, for the test suite)."""
from __future__ import annotations

import torch

from domainfm.models.cbramod.cbramod import CBraMod
from domainfm.models.cbramod.convert import convert_official_state_dict
from domainfm.zoo import WeightSource, register_model

__all__ = ["OFFICIAL_URL", "OFFICIAL_SHA256", "PRETRAINING_DATA", "OVERLAPS", "cbramod_base", "cbramod_test"]

PAPER = "https://arxiv.org/abs/2412.07236"
OFFICIAL_URL = "hf://weighting666/CBraMod/pretrained_weights.pth"
# sha256 of pretrained_weights.pth as published by third parties; verified on every download.
OFFICIAL_SHA256 = "0792cb808c14e6b7a2bb2ce1dff379bc47bc54c49a779825bdfeb33bf8157178"

#: what the official weights saw: unlabelled TUEG, the Temple University Hospital EEG Corpus
PRETRAINING_DATA = ("TUEG (Temple University Hospital EEG Corpus), unlabelled: CBraMod's pretraining set cut "
                    "from it (19 channels, 30 s segments at 200 Hz), masked patch reconstruction")
#: TUH's own corpora cut from TUEG (each corpus's README: "a subset of the TUH EEG Corpus"), on which
#: CBraMod and its peers report results: their recordings were seen, without labels, in pretraining
OVERLAPS = ("TUAB", "TUEV", "TUSZ")
OVERLAP_NOTE = ("not confirmed: whether CBraMod removed any TUAB/TUEV/TUSZ recordings from its TUEG copy; "
                "TUH's other corpora (TUAR, TUEP, TUSL) are likely TUEG subsets too")

_INPUT_SPEC = {
    "sfreq": 200.0,
    "patch_size": 200,
    "units": "100 uV (EEG in microvolts divided by 100)",
    "layout": "(batch, n_chans, n_times), n_times a multiple of 200; any n_chans",
    "pretraining_channels": ["FP1", "FP2", "F3", "F4", "C3", "C4", "P3", "P4", "O1", "O2",
                             "F7", "F8", "T3", "T4", "T5", "T6", "FZ", "CZ", "PZ"],
}


@register_model(
    "cbramod-base",
    family="cbramod",
    paper=PAPER,
    license="MIT",
    input_spec={**_INPUT_SPEC, "n_chans": 19, "n_times": 6000},
    defaults={"n_chans": 19, "n_times": 6000, "sfreq": 200.0, "n_outputs": None},
    weights=[WeightSource(OFFICIAL_URL, sha256=OFFICIAL_SHA256, converter="official", license="MIT",
                          description="official CBraMod weights: masked patch reconstruction on TUEG "
                                      "(19 ch, 30 s segments, 200 Hz), 40 epochs",
                          pretraining_data=PRETRAINING_DATA, overlaps=OVERLAPS, note=OVERLAP_NOTE)],
    converters={"official": convert_official_state_dict},
    head="head",
)
def cbramod_base(**kwargs) -> CBraMod:
    """CBraMod base: 12 criss-cross layers, d=200, 8 heads, FFN 800 (4.92 M parameters)."""
    return CBraMod(**kwargs)


def _example_input():
    return (torch.randn(2, 4, 400, generator=torch.Generator().manual_seed(0)),)


@register_model(
    "cbramod-test",
    family="cbramod",
    paper=PAPER,
    license="MIT",
    input_spec={**_INPUT_SPEC, "n_chans": 4, "n_times": 400},
    defaults={"n_chans": 4, "n_times": 400, "sfreq": 200.0, "n_outputs": 3, "n_layers": 2, "dim_feedforward": 64},
    converters={"official": convert_official_state_dict},
    head="head",
    tags=("test",),
    example_input=_example_input,
)
def cbramod_test(**kwargs) -> CBraMod:
    """Tiny CBraMod for tests: 2 layers, FFN 64 (same patch embedding and attention widths)."""
    return CBraMod(**kwargs)
