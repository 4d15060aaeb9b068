"""FIM imputation (Seifner et al., ICLR 2025): zero-shot imputation of ODE-governed series.

Variants: ``fim-imputation-base`` (the official local model, ``FIMImpPointBase``, 20.2 M
parameters; FIM-ℓ through ``impute(..., windows=K)``), ``fim-imputation-temporal`` (the
official temporal model, ``FIMImpTempBase``), ``fim-imputation-small`` (domainfm's own checkpoint)
and ``fim-imputation-test`` (tiny, for tests).

Weights: the official Hub repositories are registered as pretrained tags, loaded with
``create_model("<name>.<tag>", pretrained=True)`` (``domainfm list fim* --pretrained``):

* ``fim-imputation-base.fim4science``: ``hf://FIM4Science/fim-imp-pointwise-base``;
* ``fim-imputation-temporal.fim4science``: ``hf://FIM4Science/fim-imp-temporal-base``;
* ``fim-imputation-temporal.fim4science-windowed``: ``hf://FIM4Science/fim-imp-temporal``, the
  windowed release (``FIMImpTemp``, published as ``FIM4Science/fim-windowed-imputation``).

A bare name with ``pretrained=True`` loads the first tag. A downloaded folder loads with
``pretrained=DIR``. Neither sha256 nor revision is pinned (neither could be confirmed offline):
each file is verified against the sha256 the Hub publishes for it and the digest seen on first
download is recorded in the lock file and enforced after. See :mod:`.convert` for what each
repository holds and how its ``config.json`` is checked.
"""
from __future__ import annotations

import torch

from domainfm.zoo import WeightSource, register_model

from .convert import (config_from_official, convert_official_local, convert_official_temporal, official_model_kind,
                      rename_official_key, temporal_config_from_official)
from .fim import (FIMImputer, FIMInputError, balanced_windows, blend_windows, missing_from_observed,
                  observed_from_missing, overlapping_window_slices, simpson_path)
from .temporal import FIMTemporalImputer, scale_features

__all__ = [
    "FIMImputer", "FIMTemporalImputer", "FIMInputError", "balanced_windows", "overlapping_window_slices",
    "blend_windows", "simpson_path", "missing_from_observed", "observed_from_missing", "scale_features",
    "convert_official_local", "convert_official_temporal", "config_from_official", "temporal_config_from_official",
    "official_model_kind", "rename_official_key",
    "HUB_SOURCES", "SMALL_KWARGS", "TEST_KWARGS",
]

PAPER = "https://arxiv.org/abs/2402.07594"
#: the official Hub repositories (transformers layout: config.json + model.safetensors), under the names
#: OpenFIM gave them in commit 2805a1f ("Adapt Huggingface Model Renaming"); the old names in the notes
HUB_SOURCES = {
    "fim-imputation-base.fim4science": "hf://FIM4Science/fim-imp-pointwise-base",
    "fim-imputation-temporal.fim4science": "hf://FIM4Science/fim-imp-temporal-base",
    "fim-imputation-temporal.fim4science-windowed": "hf://FIM4Science/fim-imp-temporal",
}
_SPEC = {
    "n_chans": "any (each channel is imputed on its own)",
    "n_times": 128,
    "layout": "impute(times (B, T), values (B, T, D), observed (B, T, D) bool, eval_times (B, L)); "
              "NaN allowed where not observed",
    "pretraining": "ODE solutions on a 128-point grid, 8-64 points observed, additive noise",
    "values_std": "ours: sqrt(std(x0)^2 + (integral of the drift std)^2); not an official output",
}
_UNPINNED = ("revision main, unpinned: no commit of this repository could be confirmed offline; no sha256 pinned "
             "either: each file is verified against the sha256 the Hub publishes, then the lock file")
_WEIGHTS_LICENSE_NOTE = ("licence unknown: OpenFIM's code is MIT (LICENSE.md), but no licence for these weights "
                         "could be read offline")
#: what the official weights saw. The paper's own count of solutions could not be read offline; the
#: official training configs name their data sets (configs/train/imputation/*.yaml)
_LOCAL_PRIOR = ("the paper's synthetic prior only, no real series: 1-D ODE solutions (drifts drawn as Chebyshev "
                "series up to degree 100 or RBF Gaussian-process samples) on a 128-point grid, sparse noisy "
                "observations; the official config's data set is named torch_2M_ode_chebyshev_max_deg_100_rbf_gp_"
                "2_5_and_2_10_length_128_avg_min_8 (2M solutions; the paper's count could not be read offline)")
_TEMPORAL_PRIOR = (_LOCAL_PRIOR + "; then the temporal model on synthetic ODE solutions of 256 points cut into 5 "
                   "windows, one missing (the official config's data set: torch_500K_ode_length_256_..., 500K "
                   "series)")


def _official_source(url: str, tag: str, description: str, note: str, pretraining_data: str) -> WeightSource:
    return WeightSource(url, converter="official", tag=tag, license="unknown", description=description,
                        note=f"{_UNPINNED}; {_WEIGHTS_LICENSE_NOTE}; {note}", pretraining_data=pretraining_data,
                        overlaps=())


_POINTWISE_SOURCE = _official_source(
    HUB_SOURCES["fim-imputation-base.fim4science"], "fim4science",
    "official FIMImpPointBase weights (FIM4Science), trained by the authors on the paper's synthetic ODE prior",
    "published as FIM4Science/fim-imputation-base; its config.json names architectures ['FIMODE'], "
    "model_type 'fimode' and is checked against the model", _LOCAL_PRIOR)
_TEMPORAL_SOURCE = _official_source(
    HUB_SOURCES["fim-imputation-temporal.fim4science"], "fim4science",
    "official FIMImpTempBase weights (FIM4Science): the local model (keys fim_base.*), window transformer "
    "(psi_2.*) and scale-feature map",
    "published as FIM4Science/fim-imputation; its config.json describes psi_2 and is checked; its fim_base field "
    "only names the local model's source, whose architecture the weights' shapes give", _TEMPORAL_PRIOR)
# The windowed release is FIMImpTemp: FIMImpTempBase under `fim_imputation.` plus a denoiser that its
# config.json leaves null, so it is the temporal variant's architecture, tensor for tensor: a second
# tag of fim-imputation-temporal, not a variant of its own.
_WINDOWED_SOURCE = _official_source(
    HUB_SOURCES["fim-imputation-temporal.fim4science-windowed"], "fim4science-windowed",
    "official FIMImpTemp weights (FIM4Science), the windowed temporal release the OpenFIM tutorial loads: "
    "FIMImpTempBase under fim_imputation.*, no denoiser; built from FIM4Science/fim-imputation by OpenFIM's "
    "conversion script, so likely the same tensors as the fim4science tag (not confirmed)",
    "published as FIM4Science/fim-windowed-imputation; its config.json holds no architecture (architectures "
    "['FIMImputationWindowed'], fim_imputation 'FIM4Science/fim-imputation', denoising_model null): the head "
    "counts, which no tensor shape shows, are the variant's (8, as in the official configs)", _TEMPORAL_PRIOR)

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
                "FIM-l via impute(windows=K). Official weights: tag fim4science (hf://FIM4Science/"
                "fim-imp-pointwise-base)",
    input_spec=_SPEC, defaults={}, converters={"official": convert_official_local}, head="head",
    weights=[_POINTWISE_SOURCE],
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
        sha256="e5acce2c0d6251040e069857d3402083ebf0bafc9d4e76c2593e319866c92a90", tag="synthetic-prior",
        license="MIT", card="package://domainfm.models.fim/weights/fim-imputation-small.synthetic-prior.md",
        description="trained by domainfm, not the published weights: the official objective on domainfm's "
                    "synthetic ODE prior in three stages (configs/fim/pretrain_synthetic_prior.yaml, "
                    "pretrain_synthetic_prior_continued.yaml, then pretrain_synthetic_prior_paper_pattern*.yaml: "
                    "regular-stride and random observations, noise up to 35%, loss in normalised units); "
                    "pinned readout; see the card",
        pretraining_data="domainfm's synthetic ODE prior only (domainfm.pretrain.fim): three draws of 256,000 1-D ODE "
                         "solutions (seeds 0, 1 and 3) with Chebyshev-series or RBF-GP drifts on a 128-point grid; no "
                         "real series",
        overlaps=(),
        # pinned: better than the official readout in all 12 held-out prior cells (noise <= 10%) and on the ODE
        # trajectories; with noise up to 35% of the std the official readout is better (the card gives both)
        model_kwargs={"readout": "pinned"})],
)
def fim_imputation_small(**kwargs) -> FIMImputer:
    """FIMImputer at width 128 (time encoding and latent), 4 blocks x 4 heads, MLP width 256."""
    return FIMImputer(**kwargs)


@register_model(
    "fim-imputation-temporal", family="fim", paper=PAPER, license="MIT",
    description="FIM temporal imputation model (FIMImpTempBase): window embeddings + scale features through a "
                "window transformer, gap integrated from both sides. Official weights: tags fim4science "
                "(hf://FIM4Science/fim-imp-temporal-base) and fim4science-windowed (hf://FIM4Science/"
                "fim-imp-temporal, FIMImpTemp)",
    input_spec={**_SPEC, "layout": "impute_gap(times (B, W, K), values (B, W, K, D), observed, gap_times (B, L), "
                                   "gap_index)"},
    defaults={}, converters={"official": convert_official_temporal}, head="head",
    weights=[_TEMPORAL_SOURCE, _WINDOWED_SOURCE],
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
