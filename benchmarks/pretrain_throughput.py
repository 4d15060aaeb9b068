"""Pretraining throughput per family: training samples per second of each paper-size model at 1
process and at 2 processes (DDP over gloo on CPU; NCCL with ``--device cuda``), the share of the
matmul peak it reaches, and what one pass over each paper's pretraining corpus would cost.

    python benchmarks/pretrain_throughput.py                       # every family, CPU
    python benchmarks/pretrain_throughput.py --families cbramod wearables --steps 3
    python benchmarks/pretrain_throughput.py --device cuda         # where a GPU is present

One training sample is what the family's pretraining feeds the model per example (the model
card's example input, one row of it: a 30-s EEG window, a participant-week, a series window, ...).
A step is forward + backward through the whole model (``forward_features``; the objectives' own
heads are small beside the backbones) + an AdamW update, in fp32 and in bf16 autocast where the
CPU multiplies bf16 natively. FLOPs are counted with torch's FlopCounterMode (matmuls,
convolutions, attention; elementwise work is not counted), so the share of peak is a lower bound.

The projection divides the FLOPs of one pass over each corpus by an H100's dense bf16 peak
(989 TFLOP/s) times an assumed model-FLOPs utilisation of 40% (typical of well-tuned mid-size
training; small models reach less): planning figures, not measurements. Eight GPUs are counted
as eight times one (DDP scales near-linearly at these model sizes, but not exactly).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _peak import count_flops, matmul_peak, share_of_peak  # noqa: E402

#: family -> (paper-size model, per-rank batch for the measurement)
MODELS = {
    "cbramod": ("cbramod-base", 8),
    "stofm": ("stofm-base", 2),
    "wavetoken": ("wavetoken-small", 8),
    "wearables": ("wbm-base", 8),
    "fim": ("fim-imputation-base", 8),
    "git": ("git-base", 1),  # a sample: the card's example graph
    "explora": ("explora-dinov2-vit-large", 2),
}

#: each paper's pretraining corpus, in training samples as the model sees them, and the source.
#: ``None``: not stated in a form we could confirm (the table then shows the per-sample cost only).
CORPORA = {
    "cbramod": (1_109_545, "TUEG after cleaning: 1,109,545 30-s samples (~9,246 h), CBraMod paper; 40 epochs"),
    "stofm": (None, "SToCorpus-88M: ~88M cells in ~2,000 slices; sub-slices per slice not stated as a count"),
    "wavetoken": (51_200_000, "the Chronos recipe WaveToken follows: 200K steps x batch 256 windows"),
    "wearables": (14_880_000, "2.5B participant-hours / 168 = ~14.9M participant-weeks (WBM paper); epochs not "
                              "stated"),
    "fim": (2_000_000, "2M ODE solutions (the official training config's data set name)"),
    "git": (None, "task trees sampled from the pretraining graphs: no fixed sample count"),
    "explora": (None, "fMoW images x the paper's iterations: not confirmed here"),
}
H100_BF16_TFLOPS = 989.0
ASSUMED_MFU = 0.40


def cpu_line() -> str:
    name, flags = platform.processor() or "unknown CPU", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        have = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have)
    except (OSError, StopIteration):
        pass
    return f"{name} [{flags}], {os.cpu_count()} logical CPUs, torch {torch.__version__}"


def _batch(inputs: tuple, batch: int) -> tuple:
    """The card's example input tiled/cropped along dim 0 to ``batch`` rows (per-sample inputs)."""
    out = []
    for x in inputs:
        if torch.is_tensor(x) and x.ndim >= 1:
            reps = -(-batch // x.shape[0])
            x = x.repeat(reps, *([1] * (x.ndim - 1)))[:batch]
        out.append(x)
    return tuple(out)


def build(family: str, device: str):
    from domainfm import create_model
    from domainfm.export import example_inputs_for

    name, batch = MODELS[family]
    model = create_model(name).to(device).train()
    if family == "fim":
        # the pretraining sample: one 128-point series, 8-64 points observed, imputed on the whole grid (the
        # card's example is resized by tiling, which breaks the increasing times FIM checks)
        g = torch.Generator().manual_seed(0)
        times = torch.linspace(0, 1, 128).expand(batch, -1)
        observed = torch.rand(batch, 128, 1, generator=g) < 0.3
        values = torch.randn(batch, 128, 1, generator=g).masked_fill(~observed, float("nan"))
        inputs = (times, values, observed, times)
    elif family == "git":
        inputs, batch = example_inputs_for(model), 1  # one graph (nodes, edges): not tiled along the node axis
    else:
        inputs = _batch(example_inputs_for(model), batch)
    inputs = tuple(x.to(device) if torch.is_tensor(x) else x for x in inputs)
    return model, inputs, batch


def _uses_features(model, inputs) -> bool:
    """forward_features when it takes the example's inputs (FIM's also takes evaluation times: forward)."""
    import inspect

    if not hasattr(model, "forward_features"):
        return False
    try:
        inspect.signature(model.forward_features).bind(*inputs)
        return True
    except TypeError:
        return False


def _loss(model, inputs):
    out = model.forward_features(*inputs) if _uses_features(model, inputs) else model(*inputs)
    tensors = [out] if torch.is_tensor(out) else [v for v in (out.values() if isinstance(out, dict) else out)
                                                   if torch.is_tensor(v)]
    return sum(t.float().square().mean() for t in tensors if t.is_floating_point())


def _step_fn(model, inputs, bf16: bool, device: str):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                            enabled=bf16):
            loss = _loss(model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return step


def measure(family: str, device: str, bf16: bool, steps: int) -> dict:
    model, inputs, batch = build(family, device)
    step = _step_fn(model, inputs, bf16, device)
    step()  # warm-up (allocator, oneDNN kernels)
    flops = count_flops(lambda: _loss(model, inputs).backward())
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"samples_per_s": batch / best, "flops_per_sample": flops / batch, "seconds_per_step": best,
            "batch": batch, "params": sum(p.numel() for p in model.parameters())}


def _ddp_worker(rank: int, world: int, family: str, bf16: bool, steps: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, inputs, batch = build(family, "cpu")
        ddp = DistributedDataParallel(model, find_unused_parameters=True)  # the heads are not in forward_features
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                # forward_features through DDP's forward so that its gradient hooks run
                out = _through_ddp(ddp, inputs) if _uses_features(model, inputs) else ddp(*inputs)
                parts = [out] if torch.is_tensor(out) else list(out.values() if isinstance(out, dict) else out)
                loss = sum(t.float().square().mean() for t in parts if torch.is_tensor(t) and t.is_floating_point())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            queue.put(world * batch / min(times))
    finally:
        dist.destroy_process_group()


def _through_ddp(ddp, inputs):
    """DDP wraps ``forward``; run ``forward_features`` inside it by swapping forward for one call."""
    module = ddp.module
    original = module.forward
    module.forward = module.forward_features
    try:
        return ddp(*inputs)
    finally:
        module.forward = original


def measure_ddp(family: str, bf16: bool, steps: int, world: int = 2) -> float:
    import random

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = random.randint(20000, 40000)
    mp.start_processes(_ddp_worker, args=(world, family, bf16, steps, port, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-ddp", action="store_true", help="skip the 2-process measurement")
    args = p.parse_args()
    from domainfm.precision import bf16_native

    on_gpu = args.device.startswith("cuda")
    bf16_modes = [False] + ([True] if (on_gpu or bf16_native("cpu")) else [])
    print(cpu_line() if not on_gpu else f"{torch.cuda.get_device_name()} ({cpu_line()})")
    peaks = {bf16: matmul_peak(torch.bfloat16 if bf16 else torch.float32, args.device) for bf16 in bf16_modes}
    print("matmul peak: " + ", ".join(f"{'bf16' if k else 'fp32'} {v:.0f} GFLOP/s" for k, v in peaks.items()))
    rows = []
    for family in args.families:
        for bf16 in bf16_modes:
            r = measure(family, args.device, bf16, args.steps)
            two = None if (args.no_ddp or on_gpu) else measure_ddp(family, bf16, args.steps)
            share = share_of_peak(r["flops_per_sample"] * r["samples_per_s"], 1.0, peaks[bf16])
            rows.append((family, bf16, r, two, share))
            print(f"{family:<10} {MODELS[family][0]:<26} {'bf16' if bf16 else 'fp32'}  params {r['params'] / 1e6:7.1f}M  "
                  f"batch {r['batch']:>2}  {r['samples_per_s']:8.2f} samples/s (1 proc)"
                  + (f"  {two:8.2f} samples/s (2 procs, x{two / r['samples_per_s']:.2f})" if two else "")
                  + f"  {r['flops_per_sample'] / 1e9:9.2f} GFLOP/sample  {share:6.1%} of peak", flush=True)
    print("\nplanning (one pass over each paper's corpus; H100 bf16 at an assumed 40% MFU; from the FLOPs counted "
          "here, not from the CPU times):")
    print(f"{'family':<10} {'samples':>12} {'TFLOP/pass':>12} {'1x H100 h':>10} {'8x H100 h':>10} "
          f"{'this CPU, days':>15}  corpus")
    for family in args.families:
        flops = next(r["flops_per_sample"] for f, _, r, _, _ in rows if f == family)
        cpu_rate = max(r["samples_per_s"] for f, _, r, _, _ in rows if f == family)
        samples, source = CORPORA[family]
        if samples is None:
            print(f"{family:<10} {'-':>12} {'-':>12} {'-':>10} {'-':>10} {'-':>15}  {source}; "
                  f"{flops / 1e9:.2f} GFLOP per sample")
            continue
        total = flops * samples
        h100_hours = total / (H100_BF16_TFLOPS * 1e12 * ASSUMED_MFU) / 3600
        print(f"{family:<10} {samples:>12,} {total / 1e12:>12,.0f} {h100_hours:>10.2f} {h100_hours / 8:>10.2f} "
              f"{samples / cpu_rate / 86400:>15.1f}  {source}")


if __name__ == "__main__":
    main()
