"""CBraMod speed and memory: this implementation vs an official-style one, on this machine.

Prints training-step and inference throughput (samples/s) and peak memory at the paper's
pretraining shape (19 channels x 30 one-second patches, batch 8), in fp32 and under bf16
autocast, for ``domainfm``'s CBraMod (SDPA on plain Linear projections) and for a faithful
re-statement of the official code's forward (``nn.MultiheadAttention`` per branch, the same
``.contiguous().view`` layout), with identical weights. Training step = forward of the
reconstruction objective on masked input + MSE on masked patches + backward + AdamW step.

    python benchmarks/cbramod.py                      # all cases
    python benchmarks/cbramod.py --reps 5 --threads 2 --precision fp32

Both implementations run interleaved, rep by rep, so that load from other processes hits both
alike; the median of the reps is reported. CPU peak memory is the peak RSS growth of a child
process per case over the built model and data (VmHWM after a reset), GPU peak is ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.nn.functional as F
from domainfm.models.cbramod.reference import RefCBraMod


# ----------------------------------------------------------------------------- official-style


class OfficialCBraMod(RefCBraMod):
    """The package's restatement of the official forward, on unpatched (B, C, T) input."""

    def forward_features(self, x):
        b, c, t = x.shape
        return self.features(x.view(b, c, t // 200, 200))

    def forward_reconstruction(self, x, mask):
        b, c, t = x.shape
        return self(x.view(b, c, t // 200, 200), mask)


# ----------------------------------------------------------------------------- timing


def _build(impl: str, device: str):
    torch.manual_seed(0)
    if impl == "official":
        return OfficialCBraMod().to(device)
    from domainfm.models.cbramod import CBraMod

    return CBraMod().to(device)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _runner(impl, mode, precision, batch, device):
    model = _build(impl, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, 19, 30 * 200, generator=g).to(device)
    mask = (torch.rand(batch, 19, 30, generator=g) < 0.5).to(device)
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if precision == "bf16" else (lambda: torch.autocast(device, enabled=False))
    if mode == "infer":
        model.eval()

        def step():
            with torch.no_grad(), ctx():
                model.forward_features(x)
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=5e-2)

        def step():
            with ctx():
                rec = model.forward_reconstruction(x, mask)
            loss = F.mse_loss(rec.float()[mask], x.view(batch, 19, 30, 200)[mask])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _timed(step, device, clock=time.perf_counter):
    _sync(device)
    t0 = clock()
    step()
    _sync(device)
    return clock() - t0


def _rss_kb(field_name: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _peak_child(impl, mode, precision, batch, device, threads, queue):
    torch.set_num_threads(threads)
    step = _runner(impl, mode, precision, batch, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        # ru_maxrss survives exec (it would report the parent's peak): reset the high-water mark
        # instead (Linux: writing 5 to clear_refs resets VmHWM) and measure growth over the model
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base = _rss_kb("VmRSS")
    for _ in range(2):
        step()
    if device == "cuda":
        queue.put((torch.cuda.max_memory_allocated() - base) / 2**20)
    else:
        queue.put((_rss_kb("VmHWM") - base) / 1024)


def peak_memory_mb(impl, mode, precision, batch, device, threads):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(impl, mode, precision, batch, device, threads, queue))
    proc.start()
    value = queue.get()
    proc.join()
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--precision", choices=["fp32", "bf16", "all"], default="all")
    parser.add_argument("--mode", choices=["train", "infer", "all"], default="all")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (for A/B comparisons with --threads 1 on a busy machine)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    precisions = ["fp32", "bf16"] if args.precision == "all" else [args.precision]
    modes = ["train", "infer"] if args.mode == "all" else [args.mode]
    print(f"device={args.device} threads={args.threads} torch={torch.__version__} batch={args.batch} "
          f"shape=19x30x200 reps={args.reps} (median)  loadavg={os.getloadavg()[0]:.2f}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = []
    for precision in precisions:
        for mode in modes:
            steps = {impl: _runner(impl, mode, precision, args.batch, args.device) for impl in ("domainfm", "official")}
            times = {impl: [] for impl in steps}
            for impl, step in steps.items():
                for _ in range(args.warmup):
                    step()
            for _ in range(args.reps):
                for impl, step in steps.items():
                    times[impl].append(_timed(step, args.device, clock))
            row = {"mode": mode, "precision": precision}
            for impl in steps:
                row[f"{impl}_samples_per_s"] = args.batch / statistics.median(times[impl])
                if not args.no_memory:
                    row[f"{impl}_peak_mb"] = peak_memory_mb(impl, mode, precision, args.batch, args.device, args.threads)
            row["speedup"] = row["domainfm_samples_per_s"] / row["official_samples_per_s"]
            results.append(row)
            mem = "" if args.no_memory else (f"  peak MB ours {row['domainfm_peak_mb']:7.0f}  "
                                            f"official {row['official_peak_mb']:7.0f}")
            print(f"{mode:5s} {precision:4s}  samples/s ours {row['domainfm_samples_per_s']:7.2f}  "
                  f"official {row['official_samples_per_s']:7.2f}  speedup {row['speedup']:.2f}x{mem}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
