"""SToFM transformer: cells/s and peak memory of our forward vs the official formulation.

One sub-slice at the released shape (d=256, 12 layers, 32 heads, FFN 256, 128 kernels) with
``--tokens`` tokens (default 1,100: [CLS], the slice's hypernodes, the cells), made by
``data_loaders.spatial.build_subslices`` from a uniform random slice. The official side is
``domainfm.models.stofm.reference.RefSToFM``: the official forward restated op for op
(Gaussian basis on the full ``[B, N, N, 128]`` tensor, logits passed layer to layer), loaded with
the same weights. Timing: an eval forward (``torch.no_grad``), the two sides alternated in one
process, best of ``--repeats`` (the machine is shared: the minimum is the least disturbed run;
run with ``OMP_NUM_THREADS=1`` there, since under contention a parallel region waits for a
descheduled thread). Memory: each side in its own process, after a warm-up forward, the peak
resident memory above the pre-forward level (Linux: VmHWM reset through ``/proc/self/clear_refs``;
on CUDA: ``max_memory_allocated``).
The outputs of the two are compared (max abs difference on the real tokens).

    OMP_NUM_THREADS=1 python benchmarks/stofm.py [--tokens 1100] [--repeats 3] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _inputs(n_tokens: int, seed: int = 0):
    import numpy as np

    from domainfm.data_loaders import spatial

    rng = np.random.default_rng(seed)
    n_hyper = 30
    n_cells = n_tokens - 1 - n_hyper
    xy = rng.uniform(0, 1000, (n_cells, 2))
    emb = rng.normal(size=(n_cells, 256)).astype(np.float32)
    # hypernodes from a fixed 6 x 5 grid of clusters (Leiden needs igraph; the cost is the same)
    clusters = (np.minimum(xy[:, 0] // (1000 / 6), 5) * 5 + np.minimum(xy[:, 1] // 200, 4)).astype(int)
    (sub,) = spatial.build_subslices(xy, emb, cells_per_subslice=n_cells, clusters=clusters)
    batch = spatial.collate_subslices([sub])
    return batch["token_embeddings"], batch["distances"], batch["token_types"]


def _models(side_only: str | None = None):
    import torch

    import domainfm
    from domainfm.models.stofm.reference import RefSToFM

    torch.manual_seed(0)
    ours = domainfm.create_model("stofm-base").eval()
    official = None
    if side_only in (None, "official"):
        official = RefSToFM().eval()
        official.load_state_dict(ours.state_dict())
    return ours, official


def _forward(side, ours, official, emb, dist, types):
    return official(emb, dist, types)[0] if side == "official" else ours.forward_features(emb, dist, types)


def _child(side: str, n_tokens: int, device: str, out_path: str) -> None:
    """Peak memory of one forward above the pre-forward level (after one warm-up forward)."""
    import torch

    emb, dist, types = (t.to(device) for t in _inputs(n_tokens))
    ours, official = _models(side)
    ours.to(device)
    if official is not None:
        official.to(device)
    with torch.no_grad():
        out = _forward(side, ours, official, emb, dist, types)
        del out
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM (peak RSS) to the current RSS
            base = _status("VmRSS")
        out = _forward(side, ours, official, emb, dist, types)
        if device == "cuda":
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() if device == "cuda" else _status("VmHWM")) - base
    with open(out_path, "w") as fh:
        json.dump({"peak_bytes": peak}, fh)


def _timings(n_tokens: int, repeats: int, device: str):
    """Wall time of each side's forward, in alternation (best of ``repeats``), and both outputs."""
    import torch

    emb, dist, types = (t.to(device) for t in _inputs(n_tokens))
    ours, official = _models()
    ours.to(device)
    official.to(device)
    times = {"official": [], "ours": []}
    outputs = {}
    with torch.no_grad():
        for _ in range(repeats):
            for side in ("official", "ours"):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = _forward(side, ours, official, emb, dist, types)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[side].append(time.perf_counter() - start)
                outputs[side] = out.float().cpu()
                del out
    real = (types == 0).cpu()
    diff = float((outputs["official"][real] - outputs["ours"][real]).abs().max())
    return {k: min(v) for k, v in times.items()}, times, diff, int(real.sum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.tokens, args.device, args.out)
        return {}
    import tempfile

    import torch

    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("official", "ours"):
            out = os.path.join(tmp, side + ".json")
            subprocess.run([sys.executable, __file__, "--child", side, "--tokens", str(args.tokens),
                            "--device", args.device, "--out", out], check=True)
            with open(out) as fh:
                peaks[side] = json.load(fh)["peak_bytes"]
    best, times, diff, n_cells = _timings(args.tokens, args.repeats, args.device)
    summary = {
        "device": args.device, "tokens": args.tokens, "cells": n_cells, "threads": torch.get_num_threads(),
        "official_s": round(best["official"], 3), "ours_s": round(best["ours"], 3),
        "official_cells_per_s": round(n_cells / best["official"], 1), "ours_cells_per_s": round(n_cells / best["ours"], 1),
        "speedup": round(best["official"] / best["ours"], 2),
        "official_peak_mb": round(peaks["official"] / 2**20, 1), "ours_peak_mb": round(peaks["ours"] / 2**20, 1),
        "memory_ratio": round(peaks["ours"] / max(1, peaks["official"]), 3),
        "max_abs_diff": diff,
        "all_times_s": {k: [round(t, 2) for t in v] for k, v in times.items()},
    }
    for key, value in summary.items():
        print(f"{key:>22}  {value}")
    return summary


if __name__ == "__main__":
    main()
