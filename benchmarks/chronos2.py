"""Chronos-2 forecast speed: domainfm's Chronos2 vs chronos-forecasting's Chronos2Pipeline.
Not run in CI.

    python benchmarks/chronos2.py [--threads 1] [--batch 32] [--context 2048] [--horizon 64] [--repeats 3]

Both hold the same stand-in weights (a randomly initialised upstream ``Chronos2Model`` at the sizes
of ``amazon/chronos-2``: d_model 768, 12 layers, 12 heads, d_ff 3072, 21 quantiles, patches of 16;
speed only, the numbers are not forecasts). Each forecasts ``batch`` univariate series of
``context`` values ``horizon`` steps ahead through its ``predict``. Calls are interleaved (ours,
theirs, ours, ...) so that load on a shared machine hits both alike; the median of each is printed
as forecasts (series) per second, with the ratio ours / pipeline (> 1: ours faster; also of the
process CPU time, which another process on the machine disturbs less), in fp32 and,
where the CPU multiplies bf16 natively (``domainfm.precision.bf16_native``), in bf16 (the pipeline
with bf16 weights, as its users load it; ours under ``domainfm.precision.autocast("bf16-mixed")``,
the house rule: fp32 weights, bf16 compute).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch

import domainfm
from domainfm.models.wavetoken.chronos2 import CHRONOS2_CONFIG
from domainfm.models.wavetoken.chronos2_convert import convert_chronos2
from domainfm.precision import autocast, bf16_native


def cpu_description() -> str:
    name, flags = platform.processor() or "unknown CPU", []
    try:
        text = open("/proc/cpuinfo").read()
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        present = set(next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")))
        flags = sorted(f for f in present if f.startswith(("avx", "amx", "fma")))
    except (OSError, StopIteration):
        pass
    return f"{name}; flags: {' '.join(flags) or 'unknown'}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def upstream_model():
    """A randomly initialised upstream Chronos2Model at amazon/chronos-2's sizes."""
    from chronos.chronos2 import Chronos2CoreConfig, Chronos2Model

    c = CHRONOS2_CONFIG
    config = Chronos2CoreConfig(
        d_model=c["d_model"], d_kv=c["d_kv"], d_ff=c["d_ff"], num_layers=c["num_layers"], num_heads=c["num_heads"],
        dropout_rate=c["dropout"], rope_theta=c["rope_theta"],
        chronos_config={k: c[k] for k in ("context_length", "input_patch_size", "input_patch_stride",
                                          "output_patch_size", "max_output_patches", "quantiles", "use_reg_token",
                                          "use_arcsinh", "time_encoding_scale")})
    config.architectures = ["Chronos2Model"]
    torch.manual_seed(0)
    return Chronos2Model(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    # one thread by default: on the 2 shared cores these figures come from, another process holds one
    # core, and two threads then wait on each other at every operation (both sides 2-3x slower)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--horizon", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from chronos.chronos2 import Chronos2Pipeline

    print(f"CPU: {cpu_description()}")
    print(f"chronos-2 sizes (stand-in weights): batch {args.batch} x context {args.context}, horizon {args.horizon}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    inputs = torch.cumsum(torch.randn(args.batch, 1, args.context, generator=g), dim=-1) + 10
    upstream = upstream_model()
    ours = domainfm.create_model("chronos-2").eval()
    ours.load_state_dict(convert_chronos2(upstream.state_dict(), ours))
    precisions = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if bf16_native("cpu") else [])
    if len(precisions) == 1:
        print("bf16: skipped (this CPU has no native bf16 matrix multiply)")
    for label, dtype in precisions:
        pipeline = Chronos2Pipeline(upstream.to(dtype))
        precision = "32-true" if dtype == torch.float32 else "bf16-mixed"

        def run_ours():
            with autocast(precision, "cpu"):
                return ours.predict(inputs, args.horizon)

        def run_theirs():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return pipeline.predict(inputs, prediction_length=args.horizon)

        mine, theirs = run_ours(), run_theirs()  # warm-up, and the two agree
        gap = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
        size = max(float(b.abs().max()) for b in theirs)
        times = {"ours": [], "pipeline": []}
        cpu = {"ours": [], "pipeline": []}
        for _ in range(args.repeats):
            for key, fn in (("ours", run_ours), ("pipeline", run_theirs)):
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                times[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
        ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["pipeline"])
        ours_cpu, theirs_cpu = statistics.median(cpu["ours"]), statistics.median(cpu["pipeline"])
        print(f"{label}: ours {args.batch / ours_s:6.2f} forecasts/s ({ours_s:6.2f} s)   pipeline "
              f"{args.batch / theirs_s:6.2f} forecasts/s ({theirs_s:6.2f} s)   ours/pipeline {theirs_s / ours_s:4.2f}x "
              f"(CPU time {theirs_cpu / ours_cpu:4.2f}x)   max |ours - pipeline| {gap:.1e} (forecasts up to {size:.0f})")
        print(f"      wall s per call: ours {['%.2f' % t for t in times['ours']]}, "
              f"pipeline {['%.2f' % t for t in times['pipeline']]}")


if __name__ == "__main__":
    main()
