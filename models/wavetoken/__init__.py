"""WaveToken (wavelet-tokenized forecasting) and Chronos on one T5 encoder-decoder.

Variants: ``wavetoken-{test,tiny,mini,small,base}`` (wavelet tokenizer, 1024 tokens) and
``chronos-t5-{test,tiny,mini,small,base,large}`` (Chronos's mean-scale tokenizer, 4096 tokens),
with Chronos's T5 sizes. ``create_model("chronos-t5-tiny", pretrained=True)`` fetches and verifies
``hf://amazon/chronos-t5-tiny`` (config.json + model.safetensors); a local copy of such a
repository loads with ``pretrained=DIR`` or :func:`load_chronos`.
"""
from __future__ import annotations

import torch

from domainfm.zoo import WeightSource, register_model

from .convert import CHRONOS_SHA256, apply_chronos_config, convert_hf_t5, load_chronos
from .forecast import DEFAULT_QUANTILES, TokenForecaster, filter_logits
from .t5 import T5EncoderDecoder, relative_position_bucket
from .tokenizer import MeanScaleUniformBins, WaveletTokenizer, WaveletTransform

__all__ = [
    "TokenForecaster",
    "T5EncoderDecoder",
    "WaveletTokenizer",
    "MeanScaleUniformBins",
    "WaveletTransform",
    "convert_hf_t5",
    "apply_chronos_config",
    "load_chronos",
    "relative_position_bucket",
    "filter_logits",
    "DEFAULT_QUANTILES",
    "CHRONOS_SHA256",
    "CHRONOS_REAL_DATA",
    "CHRONOS_PRETRAINING_DATA",
    "CHRONOS_OVERLAPS",
    "T5_SIZES",
]

WAVETOKEN_PAPER = "https://arxiv.org/abs/2412.05244"
CHRONOS_PAPER = "https://arxiv.org/abs/2403.07815"

# Chronos's T5 sizes (chronos-forecasting training configs / the published config.json files)
T5_SIZES = {
    "tiny": dict(d_model=256, num_layers=4, num_heads=4, d_ff=1024),
    "mini": dict(d_model=384, num_layers=4, num_heads=8, d_ff=1536),
    "small": dict(d_model=512, num_layers=6, num_heads=8, d_ff=2048),
    "base": dict(d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "large": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
}
_COMMON = dict(d_kv=64, relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout=0.1,
               initializer_factor=0.05, context_length=512, prediction_length=64, num_samples=20, temperature=1.0,
               top_k=50, top_p=1.0)
# WaveToken defaults (the paper's choices as far as we could confirm them; see the family README in
# finetune/wavetoken.py): Biorthogonal-2.2, one level, periodization, z-score scaling, no thresholding.
WAVELET_TOKENIZER = dict(wavelet="bior2.2", wavelet_level=1, wavelet_mode="periodization", scaling="standard",
                         threshold="none", low_limit=-10.0, high_limit=10.0)


def _build(**kwargs) -> TokenForecaster:
    return TokenForecaster(**kwargs)


def _example(context_length: int, vocab: int, with_eos: bool = True):
    def make():
        g = torch.Generator().manual_seed(0)
        length = context_length + int(with_eos)
        ids = torch.randint(2, vocab, (2, length), generator=g)
        mask = torch.ones(2, length, dtype=torch.bool)
        ids[1, :5] = 0
        mask[1, :5] = False
        return ids, mask, torch.randint(2, vocab, (2, 6), generator=g)

    return make


def _register_wavetoken(size: str, t5: dict, *, context_length=512, prediction_length=64, tags=(), extra=None,
                        weights=()):
    defaults = {**_COMMON, **t5, "tokenizer": "wavelet", "vocab_size": 1024, "context_length": context_length,
                "prediction_length": prediction_length, "tokenizer_kwargs": dict(WAVELET_TOKENIZER), **(extra or {})}
    register_model(
        f"wavetoken-{size}", family="wavetoken", paper=WAVETOKEN_PAPER, license="Apache-2.0",
        description=f"WaveToken-{size}: T5 encoder-decoder over wavelet-coefficient tokens (1024-token vocabulary)",
        input_spec={"n_chans": 1, "n_times": context_length, "prediction_length": prediction_length,
                    "tokenizer": "wavelet", "vocab_size": 1024},
        defaults=defaults, converters={"hf_t5": convert_hf_t5}, head="lm_head", tags=tags, weights=list(weights),
        example_input=_example(context_length, 1024),
    )(_build)


#: What the published Chronos checkpoints saw (Chronos paper, sec. 5 and Table 3; the released corpus is
#: autogluon/chronos_datasets; the 0.9/0.1 mixture is the training configs' and 1M KernelSynth series is
#: the KernelSynth script's paper default)
CHRONOS_REAL_DATA = (
    "the Chronos paper's real training datasets (its Table 3): those marked pretraining-only and the training "
    "portions of the 15 Benchmark I (in-domain) datasets (each series' last prediction window held out)")
CHRONOS_PRETRAINING_DATA = (CHRONOS_REAL_DATA + ", sampled 90% as TSMixup mixtures of those series and 10% as "
                            "KernelSynth synthetic series (1M)")
#: Benchmark I, the in-domain datasets (chronos-forecasting scripts/evaluation/configs/in-domain.yaml: "the
#: training portion of these datasets was part of the training corpus"), then GIFT-Eval, whose rule counts
#: any of its test datasets in the training data (M4, electricity, KDD Cup 2018 and solar are in both)
CHRONOS_OVERLAPS = (
    "Electricity (15 Min.)", "Electricity (Hourly)", "Electricity (Weekly)", "KDD Cup 2018", "London Smart Meters",
    "M4 (Daily)", "M4 (Hourly)", "M4 (Monthly)", "M4 (Weekly)", "Pedestrian Counts", "Rideshare", "Taxi (30 Min.)",
    "Temperature-Rain", "Uber TLC (Daily)", "Uber TLC (Hourly)", "GIFT-Eval")
CHRONOS_OVERLAP_NOTE = (
    "the Benchmark II (zero-shot) datasets were not trained on; the GIFT-Eval overlap is reported by third "
    "parties (SalesforceAIResearch/gift-eval#29, #62), not confirmed by Amazon")


def _chronos_weights(size: str) -> list:
    """The published Chronos-T5 repository (config.json + model.safetensors), Apache-2.0.

    No full sha256 and no commit could be confirmed offline for these files (see CHRONOS_SHA256):
    each file is verified against the sha256 the Hub publishes for it, and the digest seen on
    first download is recorded in ``$DOMAINFM_HOME/weights.lock.json`` and enforced after."""
    repo = f"amazon/chronos-t5-{size}"
    digests = CHRONOS_SHA256.get(repo, {})
    return [WeightSource(
        f"hf://{repo}", sha256=digests.get("model.safetensors"), converter="hf_t5", license="Apache-2.0",
        description=f"Chronos-T5 ({size}) pretrained by Amazon on public + synthetic (KernelSynth/TSMix) series",
        note="no pinned sha256/revision confirmed offline: the Hub's published digest + the lock file; "
             + CHRONOS_OVERLAP_NOTE,
        pretraining_data=CHRONOS_PRETRAINING_DATA, overlaps=CHRONOS_OVERLAPS)]


def _register_chronos(size: str, t5: dict, *, n_tokens=4096, context_length=512, prediction_length=64, tags=(), extra=None,
                      weights=()):
    defaults = {**_COMMON, **t5, "tokenizer": "chronos", "vocab_size": n_tokens, "context_length": context_length,
                "prediction_length": prediction_length,
                "tokenizer_kwargs": {"low_limit": -15.0, "high_limit": 15.0}, **(extra or {})}
    register_model(
        f"chronos-t5-{size}", family="wavetoken", paper=CHRONOS_PAPER, license="Apache-2.0",
        description=f"Chronos-T5 ({size}) on the WaveToken engine: mean scaling + uniform bins, {n_tokens} tokens. "
                    + (f"Weights: hf://amazon/chronos-t5-{size} (pretrained=True)" if weights else ""),
        input_spec={"n_chans": 1, "n_times": context_length, "prediction_length": prediction_length,
                    "tokenizer": "chronos", "vocab_size": n_tokens},
        weights=list(weights), defaults=defaults, converters={"hf_t5": convert_hf_t5}, head="lm_head", tags=tags,
        example_input=_example(context_length, n_tokens),
    )(_build)


_TEST_T5 = dict(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=64, relative_attention_num_buckets=8,
                relative_attention_max_distance=32, dropout=0.0, initializer_factor=1.0)

_register_wavetoken("test", _TEST_T5, context_length=64, prediction_length=16, tags=("test",))
#: WaveToken-micro: domainfm's own size (1.05M parameters, context 256), the architecture of the
#: checkpoint domainfm trains on a CPU (configs/wavetoken/pretrain_micro_kernelsynth.yaml); not a paper size
MICRO_T5 = dict(d_model=128, num_layers=2, num_heads=4, d_kv=32, d_ff=512)
#: the tokenizer settings the real-mix checkpoint was trained and measured with (scaling over the last 64 values)
REAL_MIX_TOKENIZER = {"wavelet": "bior2.2", "wavelet_level": 1, "wavelet_mode": "periodization", "scaling": "standard",
                      "threshold": "none", "low_limit": -10.0, "high_limit": 10.0, "scaling_window": 64}
_register_wavetoken("micro", MICRO_T5, context_length=256, prediction_length=64, weights=[WeightSource(
    "package://domainfm.models.wavetoken/weights/wavetoken-micro.real-mix.safetensors",
    sha256="0c3d4893101fc023cc056a61d826a02f17f9d75db5ebe11f2aad92ad07955caf", tag="real-mix",
    license="Apache-2.0", card="package://domainfm.models.wavetoken/weights/wavetoken-micro.real-mix.md",
    description="trained by domainfm, not the published weights: kernelsynth-tsmixup continued 3,000 steps with real "
                "series in TSMixup and the tokenizer scaling over the last 64 values "
                "(configs/wavetoken/pretrain_micro_real_mix.yaml); see the card",
    pretraining_data="8,000 KernelSynth synthetic series (Chronos Alg. 2) and TSMixup (Chronos Alg. 1) with half of its "
                     "components drawn from 459 real series: statsmodels' fertility (World Bank), danish_data, "
                     "interest_inflation; M1 yearly (Monash archive), Daphnet gait accelerometry (UCI), EEGMMIDB "
                     "S001R02 EEG (PhysioNet), shipped in data_loaders/samples; none of the 14 held-out series of the "
                     "package's statsmodels_series.csv",
    overlaps=("M1",), model_kwargs={"tokenizer_kwargs": REAL_MIX_TOKENIZER}), WeightSource(
    "package://domainfm.models.wavetoken/weights/wavetoken-micro.kernelsynth-tsmixup.safetensors",
    sha256="923725ede9c7711266c386baf12c8b18465d0b8400a7eed0a8ec45d1fac59fdd", tag="kernelsynth-tsmixup",
    license="Apache-2.0", card="package://domainfm.models.wavetoken/weights/wavetoken-micro.kernelsynth-tsmixup.md",
    description="trained by domainfm, not the published weights: KernelSynth + TSMixup over statsmodels-bundled "
                "series (configs/wavetoken/pretrain_micro_kernelsynth.yaml); see the card",
    pretraining_data="8,000 KernelSynth synthetic series (Chronos Alg. 2) and TSMixup (Chronos Alg. 1) over 205 "
                     "statsmodels-bundled series: fertility (World Bank), danish_data, interest_inflation; none of "
                     "the 14 held-out series of the package's statsmodels_series.csv",
    overlaps=())])
for _size in ("tiny", "mini", "small", "base"):
    _register_wavetoken(_size, T5_SIZES[_size])

_register_chronos("test", _TEST_T5, n_tokens=512, context_length=64, prediction_length=16, tags=("test",))
for _size in ("tiny", "mini", "small", "base", "large"):
    _register_chronos(_size, T5_SIZES[_size], weights=_chronos_weights(_size))
from . import chronos_bolt  # noqa: E402,F401  (registers chronos-bolt-*; see chronos_bolt.py)
from . import chronos2  # noqa: E402,F401  (registers chronos-2*; see chronos2.py)
