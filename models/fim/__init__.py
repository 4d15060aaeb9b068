"""FIM imputation (Seifner et al., ICLR 2025): zero-shot imputation of ODE-governed series.

Variants: ``fim-imputation-base`` (the official local model, ``FIMImpPointBase``, 20.2 M
parameters; FIM-ℓ through ``impute(..., windows=K)``), ``fim-imputation-temporal`` (the
official temporal model, ``FIMImpTempBase``) and ``fim-imputation-test`` (tiny, for tests).

Weights: the official Hub folders load with
``create_model("fim-imputation-base", pretrained="hf://FIM4Science/fim-imp-pointwise-base")`` and
``create_model("fim-imputation-temporal", pretrained="hf://FIM4Science/fim-imp-temporal")``, or
from a downloaded folder (``pretrained=DIR``). No weight source is pinned on the cards: the
published files' sha256 could not be confirmed offline, so, as for Chronos, the hub downloads
them with a warning that prints the digest they had (pin it with ``sha256=``).
"""
from __future__ import annotations

import torch

from domainfm.zoo import WeightSource, register_model

from .convert import config_from_official, convert_official_local, convert_official_temporal, rename_official_key
from .fim import (FIMImputer, FIMInputError, balanced_windows, blend_windows, missing_from_observed,
                  observed_from_missing, overlapping_window_slices, simpson_path)
from .temporal import FIMTemporalImputer, scale_features

__all__ = [
    "FIMImputer", "FIMTemporalImputer", "FIMInputError", "balanced_windows", "overlapping_window_slices",
    "blend_windows", "simpson_path", "missing_from_observed", "observed_from_missing", "scale_features",
    "convert_official_local", "convert_official_temporal", "config_from_official", "rename_official_key",
    "HUB_SOURCES", "SMALL_KWARGS", "TEST_KWARGS",
]

PAPER = "https://arxiv.org/abs/2410.07267"
#: the official Hub folders (transformers layout: config.json + model.safetensors); sha256 not pinned
HUB_SOURCES = {
    "fim-imputation-base": "hf://FIM4Science/fim-imp-pointwise-base",
    "fim-imputation-temporal": "hf://FIM4Science/fim-imp-temporal",
}
_SPEC = {
    "n_chans": "any (each channel is imputed on its own)",
    "n_times": 128,
    "layout": "impute(times (B, T), values (B, T, D), observed (B, T, D) bool, eval_times (B, L)); "
              "NaN allowed where not observed",
    "pretraining": "ODE solutions on a 128-point grid, 8-64 points observed, additive noise",
    "values_std": "ours: sqrt(std(x0)^2 + (integral of the drift std)^2); not an official output",
}
_NO_DIGEST = ("Weights: {src} (no sha256 pinned: could not be confirmed offline; the hub downloads it with a "
              "warning printing its digest; pass sha256= to pin)")

#: fim-imputation-small: the architecture of domainfm's own checkpoint (1.0M parameters), sized so that a
#: 2-core CPU can train it on the synthetic prior for hundreds of thousands of series in ~1.5 hours
SMALL_KWARGS = dict(dim_time=128, dim_latent=128, n_heads=4, n_blocks=4, mlp_hidden=256, trunk_layers=2,
                    combiner_layers=2, init_layers=2, dropout=0.0)
TEST_KWARGS = dict(dim_time=16, dim_latent=16, n_heads=2, n_blocks=2, mlp_hidden=32, trunk_layers=2,
                   combiner_layers=2, init_layers=2, dropout=0.0)


def _example_input():
    g = torch.Generator().manual_seed(0)
    times = torch.linspace(0, 1, 24).expand(2, -1)
    values = torch.sin(6 * times)[..., None].repeat(1, 1, 2) + 0.05 * torch.randn(2, 24, 2, generator=g)
    observed = torch.rand(2, 24, 2, generator=g) < 0.6
    observed[:, 0] = True
    values = values.masked_fill(~observed, float("nan"))
    return times, values, observed, torch.linspace(0, 1, 30).expand(2, -1)


@register_model(
    "fim-imputation-base", family="fim", paper=PAPER, license="MIT",
    description="FIM local imputation model (FIMImpPointBase, 20.2M params): zero-shot ODE imputation; "
                "FIM-l via impute(windows=K). " + _NO_DIGEST.format(src=HUB_SOURCES["fim-imputation-base"]),
    input_spec=_SPEC, defaults={}, converters={"official": convert_official_local}, head="head",
    tags=("hub:" + HUB_SOURCES["fim-imputation-base"],),
)
def fim_imputation_base(**kwargs) -> FIMImputer:
    """The paper's local model: sine time encoding 512, branch 3 blocks x 8 heads, MLPs [1024]x4."""
    return FIMImputer(**kwargs)


@register_model(
    "fim-imputation-small", family="fim", paper=PAPER, license="MIT",
    description="FIM local imputation model, small (1.0M params; the base model's structure at width 128, "
                "4 blocks, MLPs 256): the architecture of domainfm's own synthetic-prior checkpoint",
    input_spec=_SPEC, defaults=dict(SMALL_KWARGS), converters={"official": convert_official_local}, head="head",
    weights=[WeightSource(
        "package://domainfm.models.fim/weights/fim-imputation-small.synthetic-prior.safetensors",
        sha256="825aac9d623b9e3c027e7cd1bd594be003a56c44cdef80ac2ee7b42294217180", tag="synthetic-prior",
        license="MIT", card="package://domainfm.models.fim/weights/fim-imputation-small.synthetic-prior.md",
        description="trained by domainfm, not the published weights: the official objective on domainfm's "
                    "synthetic ODE prior (configs/fim/pretrain_synthetic_prior.yaml); see the card",
        pretraining_data="domainfm's synthetic ODE prior only (domainfm.pretrain.fim): 256,000 1-D ODE solutions "
                         "with Chebyshev-series or RBF-GP drifts on a 128-point grid; no real series",
        overlaps=())],
)
def fim_imputation_small(**kwargs) -> FIMImputer:
    """FIMImputer at width 128 (time encoding and latent), 4 blocks x 4 heads, MLP width 256."""
    return FIMImputer(**kwargs)


@register_model(
    "fim-imputation-temporal", family="fim", paper=PAPER, license="MIT",
    description="FIM temporal imputation model (FIMImpTempBase): window embeddings + scale features through a "
                "window transformer, gap integrated from both sides. "
                + _NO_DIGEST.format(src=HUB_SOURCES["fim-imputation-temporal"]),
    input_spec={**_SPEC, "layout": "impute_gap(times (B, W, K), values (B, W, K, D), observed, gap_times (B, L), "
                                   "gap_index)"},
    defaults={}, converters={"official": convert_official_temporal}, head="head",
    tags=("hub:" + HUB_SOURCES["fim-imputation-temporal"],),
)
def fim_imputation_temporal(**kwargs) -> FIMTemporalImputer:
    """The paper's temporal model on the base local model; window transformer 3 blocks, MLP 512."""
    return FIMTemporalImputer(**kwargs)


@register_model(
    "fim-imputation-test", family="fim", paper=PAPER, license="MIT",
    description="Tiny FIM local imputation model for tests (same structure, widths 16/32)",
    input_spec={**_SPEC, "n_times": 24}, defaults=dict(TEST_KWARGS),
    converters={"official": convert_official_local}, head="head", tags=("test",), example_input=_example_input,
)
def fim_imputation_test(**kwargs) -> FIMImputer:
    """Tiny FIMImputer (dim 16, 2 blocks, MLP width 32)."""
    return FIMImputer(**kwargs)
