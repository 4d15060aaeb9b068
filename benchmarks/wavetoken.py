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
under ``domainfm.precision.autocast("bf16-mixed")``), and each side's share of the measured matmul peak
(``benchmarks/_peak.py``: FLOPs of one predict call of each side from ``torch.utils.flop_counter``,
counted during the warm-up call).

On a machine other processes share, more OpenMP threads than idle cores is pathological (a thread
preempted mid-matmul stalls the others at every barrier: a 40 x 256 matmul measured 40x slower with
2 threads than with 1 at a load average of 10 on 2 cores); use ``--threads 1`` there and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np
import torch

import domainfm
from domainfm.models.wavetoken import MeanScaleUniformBins
from domainfm.precision import autocast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peak import count_flops, matmul_peak, peak_line, share_of_peak  # noqa: E402  (shared helpers)

TINY = dict(d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=4,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, vocab_size=4096)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device: str, warmup: dict | None = None) -> dict[str, float]:
    """Median seconds per callable, calls alternating and their order flipping every round.
    ``warmup``: per name, a callable run once instead of the plain warm-up call (e.g. counting FLOPs)."""
    names = list(fns)
    times = {n: [] for n in names}
    for name in names:  # warm-up
        (warmup or {}).get(name, fns[name])()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


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
    parser.add_argument("--batch", type=int, default=None, help="series per predict call (default 32; 8 with --quick)")
    parser.add_argument("--rows", default="fp32,bf16", help="predict rows to run: fp32, bf16 or both (comma-separated)")
    parser.add_argument("--skip-tokenizer", action="store_true", help="only the predict rows")
    args = parser.parse_args()
    device = args.device
    print(f"torch {torch.__version__}, device {device}, load average {os.getloadavg()}")
    rng = np.random.default_rng(0)

    # -- tokenizer: 256 x 512, 1 thread -------------------------------------------------
    torch.set_num_threads(1)
    if not args.skip_tokenizer:
        tokenizer_row(args, rng)
    else:
        rng.normal(size=(256, 512))  # the same predict series either way
    predict_rows(args, rng)


def tokenizer_row(args, rng) -> None:
    from chronos import ChronosConfig
    from chronos import MeanScaleUniformBins as OfficialBins

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



def predict_rows(args, rng) -> None:
    device = args.device
    torch.set_num_threads(args.threads)
    batch, horizon, samples = (args.batch or (8 if args.quick else 32)), 64, 20
    series = torch.from_numpy((np.cumsum(rng.normal(size=(batch, 512)), axis=1) + 10).astype(np.float32))
    reps = args.repeats or (3 if args.quick else 7)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    print(peak_line(args.threads, device))
    with tempfile.TemporaryDirectory() as directory:
        official, ours = build_models(directory, device)
        print(f"predict chronos-t5-tiny (random weights), batch {batch}, context 512, horizon {horizon}, "
              f"{samples} samples, top_k 50, top_p 1, temperature 1, {torch.get_num_threads()} threads, {reps} repeats:")
        for name, dtype, precision in (("fp32", torch.float32, "32-true"), ("bf16", torch.bfloat16, "bf16-mixed")):
            if name not in rows:
                continue
            pipe = official[dtype]

            def run_official():
                with torch.no_grad():
                    pipe.predict(series, prediction_length=horizon, num_samples=samples, limit_prediction_length=False)

            def run_ours():
                with autocast(precision, device):
                    ours.predict(series, horizon, num_samples=samples, seed=0)

            flops = {}

            def counted(label, fn):
                def run():
                    start = time.perf_counter()
                    flops[label] = count_flops(fn)
                    print(f"    ({name} {label}: warm-up with FLOP counting {time.perf_counter() - start:.1f} s)", flush=True)
                return run

            try:
                t = interleaved({"ours": run_ours, "official": run_official}, reps, device,
                                warmup={"ours": counted("ours", run_ours), "official": counted("official", run_official)})
            except Exception as exc:  # report the official (or our) failure instead of dying on it
                print(f"  {name}: FAILED ({type(exc).__name__}: {exc})")
                traceback.print_exc()
                continue
            peak = matmul_peak(dtype, device, args.threads)
            line = [f"  {name}: ours {t['ours']:.3f} s, official {t['official']:.3f} s, ratio official/ours "
                    f"{t['official'] / t['ours']:.2f}x"]
            for side in ("ours", "official"):
                share = share_of_peak(flops[side], t[side], peak)
                line.append(f"{side} {flops[side] / 1e9:.1f} GFLOP -> {flops[side] / t[side] / 1e9:.1f} GFLOP/s "
                            f"= {100 * share:.1f}% of the {name} matmul peak ({peak:.0f} GFLOP/s)")
            print(";\n    ".join(line), flush=True)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
