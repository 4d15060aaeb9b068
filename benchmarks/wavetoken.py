"""Chronos speed against the official chronos-forecasting package, interleaved in one process.

    python benchmarks/wavetoken.py [--threads 2] [--device cpu|cuda] [--quick]

The official code is the installed ``chronos-forecasting`` (``ChronosPipeline``,
``MeanScaleUniformBins``); it is not a dependency of domainfm and only this script imports it.
Both sides get the same random chronos-t5-tiny weights (a Hugging Face T5 built from the
chronos-t5-tiny config, saved, then loaded by ``ChronosPipeline.from_pretrained`` and by
``domainfm.create_model("chronos-t5-tiny", pretrained=DIR)``): speed only.

Every comparison alternates ours / official (order alternating) and reports medians and the ratio
official / ours (> 1: ours faster), so that a loaded machine slows both alike. Rows:
tokenizer (256 series x 512, encode, 1 thread), predict (batch 32, context 512, horizon 64,
20 samples) in fp32 and in bf16 (official: ``torch_dtype=bfloat16`` weights; ours: fp32 weights
under ``domainfm.precision.autocast("bf16-mixed")``), and ours' share of the measured matmul peak
(FLOPs of one predict from ``torch.utils.flop_counter.FlopCounterMode``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch

import domainfm
from domainfm.models.wavetoken import MeanScaleUniformBins
from domainfm.precision import autocast

TINY = dict(d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, vocab_size=4096)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device: str) -> dict[str, float]:
    """Median seconds per callable, calls alternating and their order flipping every round."""
    names = list(fns)
    times = {n: [] for n in names}
    for name in names:  # warm-up
        fns[name]()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def matmul_peak(dtype: torch.dtype, device: str, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of a square matmul (median of ``repeats``), the ceiling the shares refer to."""
    try:
        from benchmarks._peak import matmul_peak as shared_peak  # another engineer's helper, if present
        return shared_peak(dtype=dtype, device=device)
    except Exception:
        pass
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def build_models(directory: str, device: str):
    from transformers import T5Config, T5ForConditionalGeneration
    from chronos import ChronosPipeline

    torch.manual_seed(0)
    config = T5Config(**TINY, feed_forward_proj="relu", dropout_rate=0.1, layer_norm_epsilon=1e-6,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, is_encoder_decoder=True,
                      initializer_factor=0.05)
    T5ForConditionalGeneration(config).save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chronos_config"] = {
        "tokenizer_class": "MeanScaleUniformBins", "tokenizer_kwargs": {"low_limit": -15.0, "high_limit": 15.0},
        "n_tokens": 4096, "n_special_tokens": 2, "pad_token_id": 0, "eos_token_id": 1, "use_eos_token": True,
        "model_type": "seq2seq", "context_length": 512, "prediction_length": 64, "num_samples": 20,
        "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    }
    with open(path, "w") as f:  # a scratch directory of this run, deleted at exit
        json.dump(cfg, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        official = {dt: ChronosPipeline.from_pretrained(directory, device_map=device, torch_dtype=dt)
                    for dt in (torch.float32, torch.bfloat16)}
        ours = domainfm.create_model("chronos-t5-tiny", pretrained=directory).to(device).eval()
    return official, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer repeats (development)")
    parser.add_argument("--repeats", type=int, default=None, help="predict repeats per side (default 7; 3 with --quick)")
    args = parser.parse_args()
    device = args.device
    from chronos import ChronosConfig
    from chronos import MeanScaleUniformBins as OfficialBins

    print(f"torch {torch.__version__}, device {device}, load average {os.getloadavg()}")
    rng = np.random.default_rng(0)

    # -- tokenizer: 256 x 512, 1 thread -------------------------------------------------
    torch.set_num_threads(1)
    context = torch.from_numpy((np.cumsum(rng.normal(size=(256, 512)), axis=1) + 10).astype(np.float32))
    context[3, :40] = float("nan")
    cfg = ChronosConfig(tokenizer_class="MeanScaleUniformBins", tokenizer_kwargs={}, context_length=512,
                        prediction_length=64, n_tokens=4096, n_special_tokens=2, pad_token_id=0, eos_token_id=1,
                        use_eos_token=True, model_type="seq2seq", num_samples=20, temperature=1.0, top_k=50,
                        top_p=1.0)
    off_tok = OfficialBins(-15.0, 15.0, cfg)
    our_tok = MeanScaleUniformBins(-15.0, 15.0, n_tokens=4096, context_length=512)
    ref_ids, _, ref_scale = off_tok.context_input_transform(context)
    ids, _, state = our_tok.encode_context(context)
    assert torch.equal(ids, ref_ids) and torch.equal(state.scale, ref_scale), "tokenizers disagree"
    reps = 21 if args.quick else 201
    t = interleaved({"ours": lambda: our_tok.encode_context(context),
                     "official": lambda: off_tok.context_input_transform(context)}, reps, "cpu")
    print(f"tokenizer encode 256 x 512, 1 thread: ours {t['ours'] * 1e3:.3f} ms, official {t['official'] * 1e3:.3f} ms, "
          f"ratio official/ours {t['official'] / t['ours']:.2f}x")

    # -- predict ---------------------------------------------------------------------
    torch.set_num_threads(args.threads)
    batch, horizon, samples = (8, 64, 20) if args.quick else (32, 64, 20)
    series = torch.from_numpy((np.cumsum(rng.normal(size=(batch, 512)), axis=1) + 10).astype(np.float32))
    reps = args.repeats or (3 if args.quick else 7)
    with tempfile.TemporaryDirectory() as directory:
        official, ours = build_models(directory, device)
        print(f"predict chronos-t5-tiny (random weights), batch {batch}, context 512, horizon {horizon}, "
              f"{samples} samples, {torch.get_num_threads()} threads:")
        for name, dtype, precision in (("fp32", torch.float32, "32-true"), ("bf16", torch.bfloat16, "bf16-mixed")):
            pipe = official[dtype]

            def run_official():
                with torch.no_grad():
                    pipe.predict(series, prediction_length=horizon, num_samples=samples, limit_prediction_length=False)

            def run_ours():
                with autocast(precision, device):
                    ours.predict(series, horizon, num_samples=samples, seed=0)

            t = interleaved({"ours": run_ours, "official": run_official}, reps, device)
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                run_ours()
            flops = counter.get_total_flops()
            peak = matmul_peak(dtype, device)
            print(f"  {name}: ours {t['ours']:.3f} s, official {t['official']:.3f} s, ratio official/ours "
                  f"{t['official'] / t['ours']:.2f}x; ours {flops / 1e9:.1f} GFLOP -> {flops / t['ours'] / 1e9:.0f} GFLOP/s "
                  f"= {100 * flops / t['ours'] / peak:.1f}% of the {name} matmul peak ({peak / 1e9:.0f} GFLOP/s)")
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
