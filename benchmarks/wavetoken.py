"""WaveToken / Chronos speed figures (issue 4). Not run in CI.

    python benchmarks/wavetoken.py [--threads 1] [--quick]

Prints: tokenizer encode+decode series/s at context 512, batch 256 (WaveToken batched torch vs a
PyWavelets loop vs the Chronos tokenizer); forecast latency and series/s with and without the KV
cache for a 64-step horizon (wavetoken-tiny, random weights: speed only); KernelSynth series/s.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pywt
import torch

import domainfm
from domainfm.models.wavetoken import MeanScaleUniformBins, WaveletTokenizer
from domainfm.pretrain.wavetoken import generate_kernel_synth


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def pywt_loop(context: np.ndarray, tok: WaveletTokenizer) -> np.ndarray:
    """A straightforward per-series PyWavelets tokenizer: z-score, wavedec, digitize, and back."""
    boundaries = tok.boundaries.numpy()
    centers = tok.centers.numpy()
    out = np.empty_like(context)
    for i, x in enumerate(context):
        loc, scale = np.nanmean(x), np.nanstd(x) or 1.0
        coeffs = pywt.wavedec((x - loc) / scale, tok.transform.wavelet, mode="periodization", level=tok.transform.level)
        flat = np.concatenate(coeffs)
        ids = np.digitize(flat, boundaries)
        values = centers[ids]
        parts = np.split(values, np.cumsum([len(c) for c in coeffs])[:-1])
        out[i] = pywt.waverec(parts, tok.transform.wavelet, mode="periodization") * scale + loc
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and samples")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 10
    batch, length = 256, 512
    rng = np.random.default_rng(0)
    context = (np.cumsum(rng.normal(size=(batch, length)), axis=1) + 10).astype(np.float32)
    ctx = torch.from_numpy(context)
    print(f"torch threads: {torch.get_num_threads()}")

    wav = WaveletTokenizer(vocab_size=1024, context_length=length, use_eos_token=False)
    chron = MeanScaleUniformBins(n_tokens=4096, context_length=length, use_eos_token=False)

    def wav_round_trip():
        ids, _, state = wav.encode_context(ctx)
        wav.decode(ids.unsqueeze(1), state, length)

    def chron_round_trip():
        ids, _, state = chron.encode_context(ctx)
        chron.decode(ids.unsqueeze(1), state, length)

    t_wav = best_of(wav_round_trip, repeats)
    t_chron = best_of(chron_round_trip, repeats)
    t_loop = best_of(lambda: pywt_loop(context, wav), max(1, repeats // 3))
    print(f"tokenizer encode+decode, context {length}, batch {batch}:")
    print(f"  WaveToken (batched torch DWT)   {batch / t_wav:>10.0f} series/s")
    print(f"  WaveToken (PyWavelets loop)     {batch / t_loop:>10.0f} series/s")
    print(f"  Chronos MeanScaleUniformBins    {batch / t_chron:>10.0f} series/s")

    model = domainfm.create_model("wavetoken-tiny").eval()
    n_series, samples, horizon = (4, 5, 64) if args.quick else (16, 20, 64)
    series = torch.from_numpy(context[:n_series])
    for cache in (True, False):
        seconds = best_of(lambda: model.predict(series, horizon, num_samples=samples, seed=0, use_cache=cache),
                          1 if args.quick else 2)
        print(f"forecast wavetoken-tiny, {n_series} series x {samples} samples, horizon {horizon}, "
              f"{'KV cache' if cache else 'no cache'}: {seconds:.2f} s ({n_series / seconds:.2f} series/s)")
        if cache:
            cached = seconds
    print(f"  KV-cache speed-up: {seconds / cached:.1f}x")

    n = 20 if args.quick else 100
    start = time.perf_counter()
    generate_kernel_synth(n, length=1024, seed=0)
    print(f"KernelSynth (length 1024): {n / (time.perf_counter() - start):.1f} series/s")


if __name__ == "__main__":
    main()
