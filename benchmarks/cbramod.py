"""CBraMod speed and memory: this implementation vs the official one, on this machine.

Prints training-step and inference throughput (samples/s), the ratio official time / ours, each
side's share of this machine's matmul peak, and peak memory at the paper's pretraining shape
(19 channels x 30 one-second patches, batch 8), in fp32 and under bf16 autocast, with identical
weights on both sides. The official side is the official code itself with ``--official PATH``
(a checkout of github.com/wjq-learning/CBraMod, fetched for the measurement and never committed;
its ``models.cbramod.CBraMod`` is imported from there), otherwise the package's restatement of
its forward (:mod:`domainfm.models.cbramod.reference`: ``nn.MultiheadAttention`` per branch,
the same ``.contiguous().view`` layout). Training step = forward of the reconstruction objective
on masked input + MSE on masked patches + backward + AdamW step.

    python benchmarks/cbramod.py                      # all cases, in-package restatement
    python benchmarks/cbramod.py --official /tmp/cbramod-official --threads 2 --no-memory
    python benchmarks/cbramod.py --reps 5 --threads 2 --precision fp32 --device cuda

Share of peak: FLOPs of one step counted with ``torch.utils.flop_counter`` (matmuls, convolutions,
attention; on our model with its oneDNN inference linears off, which the counter does not see;
the arithmetic is the same on both sides), divided by the median time and by
:func:`_peak.matmul_peak` in the run's dtype.

Both implementations run interleaved, rep by rep, so that load from other processes hits both
alike; the median of the reps is reported. CPU peak memory is the peak RSS growth of a child
process per case over the built model and data (VmHWM after a reset), GPU peak is ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from domainfm.models.cbramod.cbramod import PatchEmbedding
from domainfm.models.cbramod.convert import to_official_state_dict
from domainfm.models.cbramod.reference import RefCBraMod

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peak import count_flops, matmul_peak, share_of_peak, steady_allocator  # noqa: E402


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


class UpstreamCBraMod(nn.Module):
    """The official ``models.cbramod.CBraMod`` (imported from a checkout) behind the same calls."""

    def __init__(self, upstream_cls):
        super().__init__()
        self.model = upstream_cls(in_dim=200, out_dim=200, d_model=200, dim_feedforward=800, seq_len=30,
                                  n_layer=12, nhead=8)

    def forward_features(self, x):
        b, c, t = x.shape
        return self.model.encoder(self.model.patch_embedding(x.view(b, c, t // 200, 200)))

    def forward_reconstruction(self, x, mask):
        b, c, t = x.shape
        return self.model(x.view(b, c, t // 200, 200), mask)


def import_official(path) -> type:
    """``models.cbramod.CBraMod`` from a checkout of the official repository at ``path``.

    The checkout's top-level package is called ``models``; it is imported with its directory
    first on ``sys.path`` and then renamed in ``sys.modules`` so that it shadows nothing else.
    """
    root = Path(path).expanduser().resolve()
    if not (root / "models" / "cbramod.py").is_file() or not (root / "models" / "criss_cross_transformer.py").is_file():
        raise SystemExit(f"--official {path}: no models/cbramod.py and models/criss_cross_transformer.py there "
                         "(expected a checkout of github.com/wjq-learning/CBraMod)")
    clash = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "models" or k.startswith("models.")}
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("models.cbramod")
    finally:
        sys.path.remove(str(root))
        for key in [k for k in sys.modules if k == "models" or k.startswith("models.")]:
            sys.modules[f"_cbramod_official_{key}"] = sys.modules.pop(key)
        sys.modules.update(clash)
    return module.CBraMod


def _build(impl: str, device: str, official_path: str | None = None):
    from domainfm.models.cbramod import CBraMod

    torch.manual_seed(0)
    ours = CBraMod()
    if impl == "domainfm":
        return ours.to(device)
    model = UpstreamCBraMod(import_official(official_path)) if official_path else OfficialCBraMod()
    target = model.model if official_path else model
    # the same weights on both sides (the official key layout; its mask encoding is a parameter)
    target.load_state_dict(to_official_state_dict(ours), strict=True)
    return model.to(device)


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _runner(impl, mode, precision, batch, device, official_path=None):
    model = _build(impl, device, official_path)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, 19, 30 * 200, generator=g).to(device)
    mask = (torch.rand(batch, 19, 30, generator=g) < 0.5).to(device)
    dev = torch.device(device).type
    ctx = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if precision == "bf16" else (lambda: torch.autocast(dev, enabled=False))
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


def _peak_child(impl, mode, precision, batch, device, threads, official_path, queue):
    torch.set_num_threads(threads)
    step = _runner(impl, mode, precision, batch, device, official_path)
    if device.startswith("cuda"):
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
    if device.startswith("cuda"):
        queue.put((torch.cuda.max_memory_allocated() - base) / 2**20)
    else:
        queue.put((_rss_kb("VmHWM") - base) / 1024)


def peak_memory_mb(impl, mode, precision, batch, device, threads, official_path=None):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(impl, mode, precision, batch, device, threads, official_path, queue))
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
    parser.add_argument("--malloc", choices=["steady", "default"], default="steady",
                        help="steady (default): fixed glibc malloc thresholds for both sides (_peak.steady_allocator); "
                             "default: glibc's moving thresholds, under which page faults depend on the process's history")
    parser.add_argument("--floor", action="store_true",
                        help="also print the kernel floor of inference: the model's matmuls, GELU, softmax and layer "
                             "norms timed alone at their best, and the largest ratio any implementation of the same "
                             "arithmetic with these kernels could reach against the measured official time")
    parser.add_argument("--official", default=None, metavar="PATH",
                        help="a checkout of github.com/wjq-learning/CBraMod: measure against its own model code "
                             "(default: the package's restatement, domainfm.models.cbramod.reference)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = steady_allocator() if args.malloc == "steady" and args.device == "cpu" else "allocator: glibc defaults"
    precisions = ["fp32", "bf16"] if args.precision == "all" else [args.precision]
    modes = ["train", "infer"] if args.mode == "all" else [args.mode]
    official = f"official code at {args.official}" if args.official else "in-package restatement (reference.py)"
    print(f"device={args.device} threads={args.threads} torch={torch.__version__} batch={args.batch} "
          f"shape=19x30x200 reps={args.reps} (median, interleaved)  loadavg={os.getloadavg()[0]:.2f}")
    print(f"official side: {official}")
    print(allocator)
    print(f"same weights: max |features ours - official| in fp32 = {_agreement(args.device, args.official):.2e}")
    peaks = {p: matmul_peak(torch.float32 if p == "fp32" else torch.bfloat16, args.device, args.threads)
             for p in precisions}
    print("matmul peak: " + ", ".join(f"{p} {v:.0f} GFLOP/s" for p, v in peaks.items()), flush=True)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = []
    for precision in precisions:
        for mode in modes:
            steps = {impl: _runner(impl, mode, precision, args.batch, args.device, args.official)
                     for impl in ("domainfm", "official")}
            flops = _step_flops(mode, precision, args.batch, args.device)
            times = {impl: [] for impl in steps}
            for impl, step in steps.items():
                for _ in range(args.warmup):
                    step()
            for _ in range(args.reps):
                for impl, step in steps.items():
                    times[impl].append(_timed(step, args.device, clock))
            row = {"mode": mode, "precision": precision, "gflop_per_step": flops / 1e9,
                   "peak_gflops": peaks[precision], "official": official, "loadavg": os.getloadavg()[0]}
            for impl in steps:
                median = statistics.median(times[impl])
                row[f"{impl}_samples_per_s"] = args.batch / median
                row[f"{impl}_share_of_peak"] = share_of_peak(flops, median, peaks[precision])
                if not args.no_memory:
                    row[f"{impl}_peak_mb"] = peak_memory_mb(impl, mode, precision, args.batch, args.device, args.threads,
                                                            args.official)
            row["speedup"] = row["ratio"] = row["domainfm_samples_per_s"] / row["official_samples_per_s"]
            if args.floor and mode == "infer" and args.device == "cpu":
                floor_s = inference_floor(precision, args.batch, args.threads)
                official_s = args.batch / row["official_samples_per_s"]
                row["floor_ms"], row["max_ratio"] = floor_s * 1e3, official_s / floor_s
                print(f"      kernel floor of {precision} inference {floor_s * 1e3:.0f} ms per batch: no implementation of "
                      f"this arithmetic with these kernels beats {row['max_ratio']:.2f}x official", flush=True)
            results.append(row)
            mem = "" if args.no_memory else (f"  peak MB ours {row['domainfm_peak_mb']:7.0f}  "
                                            f"official {row['official_peak_mb']:7.0f}")
            print(f"{mode:5s} {precision:4s}  samples/s ours {row['domainfm_samples_per_s']:7.2f}  "
                  f"official {row['official_samples_per_s']:7.2f}  ratio {row['ratio']:.2f}x  "
                  f"share of peak ours {row['domainfm_share_of_peak']:6.1%} official {row['official_share_of_peak']:6.1%}"
                  f"{mem}", flush=True)
    if args.json:
        from domainfm.atomic import atomic_write_json

        atomic_write_json(args.json, results)
    return 0


def inference_floor(precision: str, batch: int, threads: int, reps: int = 15, verbose: bool = True) -> float:
    """Seconds below which no CPU implementation of CBraMod inference that runs the official
    arithmetic through torch's kernels can go, here, at ``batch`` samples on ``threads`` cores.

    Each kernel of the 12 criss-cross layers runs alone, on one core, at the shapes of one
    ``ceil(batch / threads)``-sample stream (the batch split over the cores, no synchronisation
    between them: the best case), in the run's precision, as its best of ``reps`` calls on warm
    caches and reused buffers: the six linear layers (oneDNN, bias fused), the exact-erf GELU,
    the four attention matmuls of each branch, the softmaxes (fp32) and the two layer norms, and
    the patch embedding (CNN, FFT, spectral projection, positional convolution) as one call.
    Their sum is a lower bound: head splits, residual adds, memory traffic between kernels and
    the cores' shared bandwidth are all left out.
    """
    lp = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b = -(-batch // threads)
        m = b * 19 * 30
        g = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        def linear(k, n):
            x, w, bias = rand(m, k), rand(n, k) * 0.05, rand(n)
            return (lambda: lp(x, w, bias, "none", [], "")) if lp is not None else (lambda: F.linear(x, w, bias))

        def attention(length):
            s = m // length * 4  # sequences x heads
            q, k, v = rand(s, length, 25), rand(s, length, 25), rand(s, length, 25)
            p = torch.softmax(rand(s, length, length).float(), -1).to(dtype)
            return (lambda: torch.bmm(q, k.transpose(1, 2)), lambda: torch.bmm(p, v),
                    lambda: torch.softmax(p, -1, dtype=torch.float32))

        hidden, tokens = rand(m, 800), rand(m, 200)
        embedding = PatchEmbedding(200).eval()
        eeg = torch.randn(b, 19, 30, 200, generator=g)

        def embed(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                return embedding(x)
        ln_w, ln_b = torch.ones(200), torch.zeros(200)
        s_scores, s_values, s_softmax = attention(19)
        t_scores, t_values, t_softmax = attention(30)
        kernels = [  # (what, calls per forward, fn)
            ("linear 200->800 (FFN in)", 12, linear(200, 800)),
            ("GELU (exact) on the FFN hidden", 12, lambda: F.gelu(hidden)),
            ("linear 800->200 (FFN out)", 12, linear(800, 200)),
            ("linear 100->300 (q, k, v of a branch)", 24, linear(100, 300)),
            ("linear 100->100 (out proj of a branch)", 24, linear(100, 100)),
            ("q k^T, spatial (L=19)", 12, s_scores), ("p v, spatial", 12, s_values), ("softmax, spatial", 12, s_softmax),
            ("q k^T, temporal (L=30)", 12, t_scores), ("p v, temporal", 12, t_values), ("softmax, temporal", 12, t_softmax),
            ("layer norm", 24, lambda: F.layer_norm(tokens, (200,), ln_w, ln_b)),
            ("patch embedding (whole)", 1, lambda: embed(eeg)),
        ]
        total = 0.0
        with torch.no_grad():
            for what, calls, fn in kernels:
                for _ in range(3):
                    fn()
                best = min(_timed(fn, "cpu") for _ in range(reps))
                total += calls * best
                if verbose:
                    print(f"      floor {precision} {what:40s} {calls:3d} x {best * 1e3:6.3f} ms = {calls * best * 1e3:6.1f} ms")
        return total
    finally:
        torch.set_num_threads(old)


def _step_flops(mode, precision, batch, device) -> int:
    """FLOPs of one step: counted on our model with the oneDNN inference linears switched off, as
    ``FlopCounterMode`` does not see them (nor the official fp32 inference's fused
    ``_native_multi_head_attention``); the arithmetic is the same on both sides."""
    from domainfm.models.cbramod import _fast

    saved = _fast._HAS_ONEDNN_LINEAR
    _fast._HAS_ONEDNN_LINEAR = False
    try:
        return count_flops(_runner("domainfm", mode, precision, batch, device))
    finally:
        _fast._HAS_ONEDNN_LINEAR = saved


def _agreement(device, official_path) -> float:
    """Max |difference| of the two sides' fp32 features on a small input (a wiring check)."""
    ours, official = (_build(impl, device, official_path).eval() for impl in ("domainfm", "official"))
    x = torch.randn(2, 19, 5 * 200, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
        return (ours.forward_features(x) - official.forward_features(x)).abs().max().item()


if __name__ == "__main__":
    raise SystemExit(main())
