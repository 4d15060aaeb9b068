"""FIM imputation speed: the local model's throughput, and FIM-ℓ against the official cost model.

1. ``fim-imputation-base`` (20.2 M parameters), ``impute`` at B=16 series, T=128 points
   (half observed), evaluated on the same 128 points: series per second.
2. FIM-ℓ at T=1024 with 8 windows (25% overlap): ours (each window on its own observations and
   evaluation points) vs the official cost model (every window padded to the full grid: 1024
   observations and 1024 evaluation points per window; ``windowed(..., pad_to_full_grid=True)``),
   outputs checked identical, ratio printed. Ratios are measured in alternation (median of runs).

Run: ``OMP_NUM_THREADS=2 python benchmarks/fim.py [--batch-l 2] [--repeats 3]``.

Measured (2 CPU cores shared with other jobs, torch 2.14, random weights, ``--batch-l 1``):
local model B=16, T=128: 11.3 s per batch (1.4 series/s; the machine was heavily loaded);
FIM-ℓ T=1024, 8 windows: ours 6.9 s vs the padded cost model 35.0 s -> 5.1x, max |difference|
2.4e-7 (float32).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import domainfm


def _series(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    times = torch.linspace(0, 10, t).expand(b, -1).contiguous()
    values = torch.sin(times)[..., None] + 0.05 * torch.randn(b, t, 1, generator=g)
    observed = torch.rand(b, t, 1, generator=g) < 0.5
    observed[:, ::16] = True
    return times, values.masked_fill(~observed, float("nan")), observed


def _time(fn, repeats):
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-l", type=int, default=2, help="series in the FIM-l comparison")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = domainfm.create_model("fim-imputation-base").eval()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters (random init)")

    times, values, observed = _series(16, 128)
    with torch.inference_mode():
        model.impute(times, values, observed, times)  # warm-up
        sec = _time(lambda: model.impute(times, values, observed, times), args.repeats)
    print(f"local model, B=16, T=128: {sec * 1e3:.0f} ms per batch, {16 / sec:.1f} series/s")

    b = args.batch_l
    times, values, observed = _series(b, 1024, seed=1)
    missing = ~observed[..., 0]
    with torch.inference_mode():
        ours = model.windowed(times, values[..., 0], missing, times, 8, 0.25)
        padded = model.windowed(times, values[..., 0], missing, times, 8, 0.25, pad_to_full_grid=True)
        diff = max(float((ours[k] - padded[k]).abs().max()) for k in ("values", "drift_mean", "values_std"))
        t_ours, t_pad = [], []
        for _ in range(args.repeats):  # alternate, so drifts in machine load hit both
            t_ours.append(_time(lambda: model.windowed(times, values[..., 0], missing, times, 8, 0.25), 1))
            t_pad.append(_time(lambda: model.windowed(times, values[..., 0], missing, times, 8, 0.25,
                                                      pad_to_full_grid=True), 1))
    a, p = statistics.median(t_ours), statistics.median(t_pad)
    print(f"FIM-l, B={b}, T=1024, 8 windows, 25% overlap: ours {a * 1e3:.0f} ms, official cost model (padded to the "
          f"full grid) {p * 1e3:.0f} ms -> {p / a:.1f}x faster; max |difference| {diff:.2e}")
    return {"local_series_per_s": 16 / sec, "fim_l_ms": a * 1e3, "padded_ms": p * 1e3, "ratio": p / a, "max_diff": diff}


if __name__ == "__main__":
    main()
