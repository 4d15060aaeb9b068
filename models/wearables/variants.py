"""Registered WBM variants: ``wbm-base`` (paper-like Mamba-2), ``wbm-transformer-base`` (the
Transformer+RoPE comparison), ``wbm-openmhc`` (the layout of OpenMHC's released weights, loadable
on the CPU), and the tiny ``wbm-test`` / ``wbm-transformer-test`` for tests."""
from __future__ import annotations

import torch

from domainfm.models.wearables import openmhc
from domainfm.models.wearables.wbm import WBM
from domainfm.zoo import WeightSource, register_model

__all__ = ["PAPER", "DEFAULT_VARIABLES", "OPENMHC_SOURCE", "wbm_base", "wbm_transformer_base", "wbm_openmhc",
           "wbm_test", "wbm_transformer_test"]

PAPER = "https://arxiv.org/abs/2507.00191"

#: The hourly variables :func:`domainfm.data_loaders.wearables.read_healthkit` produces, in order:
#: cumulative quantities (hourly totals), samples (hourly means), sleep (minutes of the hour).
#: The paper uses 27 behavioural variables and OpenMHC 19 channels; neither list is published in
#: full, so this is our choice of what an Apple Health export carries.
DEFAULT_VARIABLES = (
    "steps", "distance_km", "flights", "active_kcal", "basal_kcal", "exercise_min", "stand_min",
    "heart_rate", "resting_hr", "walking_hr", "hrv_sdnn", "respiratory_rate", "spo2", "wrist_temp", "vo2max",
    "walking_speed", "step_length", "walking_asymmetry", "double_support", "body_mass",
    "sleep_min", "in_bed_min",
)

_SPEC = {
    "sfreq": 1 / 3600,
    "units": "per-variable z-scores (statistics in the model's zscore_mean / zscore_std buffers)",
    "layout": "values and observed mask, each (batch, n_times hours, n_chans variables); NaN = missing",
    "tokenisation": "TST: one token per hour",
}

# Paper-like sizes. OpenMHC: 168 h x 19 channels, 4 Mamba-2 layers, embedding 256, projection
# 128. Inferred (not stated by paper or OpenMHC as far as we know): d_state 64, headdim 64,
# expand 2, d_conv 4 (mamba_ssm's Mamba2 defaults), chunk 64 (a week is 3 chunks).
_BASE = dict(d_model=256, n_layers=4, proj_dim=128, d_state=64, headdim=64, expand=2, d_conv=4, chunk_size=64)
_TEST = dict(d_model=32, n_layers=2, proj_dim=16, d_state=8, headdim=16, expand=2, d_conv=4, chunk_size=16,
             n_heads=4)


def _example_input(n_chans: int, n_times: int):
    def make():
        g = torch.Generator().manual_seed(0)
        values = torch.randn(2, n_times, n_chans, generator=g)
        observed = torch.rand(2, n_times, n_chans, generator=g) > 0.3
        observed[1, :10] = False  # a device-wear gap
        return values, observed

    return make


def _register(name: str, *, backbone: str, sizes: dict, n_chans: int, n_times: int, n_outputs, tags=(), desc=""):
    defaults = {"n_chans": n_chans, "n_times": n_times, "sfreq": 1 / 3600, "n_outputs": n_outputs,
                "backbone": backbone, **sizes}
    if n_chans == len(DEFAULT_VARIABLES):
        defaults["variables"] = list(DEFAULT_VARIABLES)
    return register_model(
        name, family="wearables", paper=PAPER, license="Apache-2.0", description=desc,
        input_spec={**_SPEC, "n_chans": n_chans, "n_times": n_times,
                    "variables": list(DEFAULT_VARIABLES) if n_chans == len(DEFAULT_VARIABLES) else None},
        defaults=defaults, head="head", tags=tags,
        example_input=_example_input(n_chans, n_times) if "test" in tags else None,
    )


@_register("wbm-base", backbone="mamba2", sizes=_BASE, n_chans=len(DEFAULT_VARIABLES), n_times=168, n_outputs=None,
           desc="WBM base: TST tokens, 4 Mamba-2 layers, d 256, projection 128 (no public weights)")
def wbm_base(**kwargs) -> WBM:
    """WBM base: TST tokens + 4 Mamba-2 layers, d 256, projection 128."""
    return WBM(**kwargs)


OPENMHC_SOURCE = WeightSource(
    f"hf://{openmhc.RELEASE_REPO}/model.ckpt", revision=openmhc.RELEASE_REVISION, converter="openmhc",
    license="CC-BY-4.0", tag="openmhc-v1",  # tags may not hold a "." (model.tag)
    description="OpenMHC's WBM re-implementation (bidirectional Mamba-2 contrastive SSL encoder; its W&B artifact "
                "WBM_Final_HPO_best:v1), the encoder of the OpenMHC benchmark's reported WBM model",
    pretraining_data="OpenMHC / MyHeartCounts: the MHC training split (the release's provenance; presumably "
                     "the benchmark's user-level split sharable_users_seed42_2026), weekly windows of 168 hourly "
                     "steps x 19 iPhone/Apple Watch channels from daily_hourly_hf, contrastive self-supervised "
                     "pretraining (no labels)",
    overlaps=("OpenMHC",),
    note="sha256 not confirmed offline (verified against the Hub's digest at tag v1.0, then the lock file); tag "
         "v1.0 is the model card's; the Hub card says CC-BY-4.0, OpenMHC's README 'Models OpenRAIL'; which "
         "projection head it holds is not documented (projector='linear' if the converter says so); the "
         "z-score constants are in normalization_stats.json beside model.ckpt: load_openmhc() reads both. "
         "OpenMHC's own benchmark: its training participants were seen, its test participants (same cohort) "
         "were held out per the release's provenance")


@register_model(
    "wbm-openmhc", family="wearables", paper=PAPER, license="Apache-2.0",
    description="WBM as OpenMHC re-implemented and released it: MLP hour tokens, 4 bidirectional post-norm Mamba-2 "
                "blocks (d 256, d_state 128), mean over the week, 3-layer projection 128; 19 iPhone/Watch channels",
    input_spec={**_SPEC, "n_chans": len(openmhc.CHANNELS), "n_times": openmhc.N_TIMES,
                "variables": list(openmhc.CHANNELS),
                "units": "OpenMHC's hourly units (steps, metres, flights, beats per second, energy, 0/1 sleep and "
                         "workout flags; data_loaders.wearables.openmhc_table), z-scored by the model with its "
                         "zscore_mean / zscore_std buffers (the release's normalization_stats.json: channels 0-6)",
                "layout": "values and observed mask, each (batch, 168 hours, 19 channels); the model feeds "
                          "[z-scores (0 where missing) || missing flags (1 = missing)] as OpenMHC does"},
    defaults={"n_chans": len(openmhc.CHANNELS), "n_times": openmhc.N_TIMES, "sfreq": 1 / 3600, "n_outputs": None,
              "variables": list(openmhc.CHANNELS), **openmhc.ARCH_DEFAULTS},
    weights=[OPENMHC_SOURCE],
    converters={"openmhc": openmhc.convert_openmhc_state_dict},
    head="head",
)
def wbm_openmhc(**kwargs) -> WBM:
    """OpenMHC's WBM layout: MLP tokens, 4 BiMamba-2 post-norm blocks, d 256, mean pooling (6.93 M parameters)."""
    return WBM(**kwargs)


_TRANSFORMER_BASE = dict(d_model=256, n_layers=4, proj_dim=128, n_heads=8, mlp_ratio=4.0)


@_register("wbm-transformer-base", backbone="transformer", sizes=_TRANSFORMER_BASE, n_chans=len(DEFAULT_VARIABLES),
           n_times=168, n_outputs=None,
           desc="WBM Transformer+RoPE comparison: TST tokens, 4 layers, d 256, 8 heads, projection 128")
def wbm_transformer_base(**kwargs) -> WBM:
    """WBM with a Transformer+RoPE backbone of the same width and depth (the paper's comparison)."""
    return WBM(**kwargs)


@_register("wbm-test", backbone="mamba2", sizes=_TEST, n_chans=8, n_times=48, n_outputs=2, tags=("test",),
           desc="tiny WBM (Mamba-2) for tests")
def wbm_test(**kwargs) -> WBM:
    """Tiny WBM for tests: 2 Mamba-2 layers, d 32."""
    return WBM(**kwargs)


@_register("wbm-transformer-test", backbone="transformer", sizes=_TEST, n_chans=8, n_times=48, n_outputs=2,
           tags=("test",), desc="tiny WBM (Transformer+RoPE) for tests")
def wbm_transformer_test(**kwargs) -> WBM:
    """Tiny WBM with the Transformer+RoPE backbone for tests."""
    return WBM(**kwargs)
