"""Shared helpers for the benchmarks: this machine's matmul peak and a workload's share of it.

A ratio against the official code says who is faster; the share of the matmul peak says how much
is left on the table. Both use the same rule everywhere:

* ``matmul_peak(dtype, device, threads)`` times square ``torch.mm`` at a size where the BLAS
  (oneDNN/MKL on CPU, cuBLAS on GPU) is at its best, and returns the best GFLOP/s seen.
  On CPUs with AMX or AVX-512-BF16, bf16 is measured as it runs under autocast (bf16 inputs).
* ``count_flops(fn)`` counts the FLOPs of one call with ``torch.utils.flop_counter.FlopCounterMode``
  (matmuls, convolutions and SDPA; elementwise work is not counted, so the share is a lower bound
  on how busy the machine is, and an honest upper bound on how much matmul work there was).
* ``share_of_peak(flops, seconds, peak_gflops)`` = achieved GFLOP/s / peak.

    from _peak import matmul_peak, count_flops, share_of_peak   # benchmarks/ is on sys.path
"""
from __future__ import annotations

import functools
import time

import torch
from torch.utils.flop_counter import FlopCounterMode


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=None)
def matmul_peak(dtype: torch.dtype = torch.float32, device: str = "cpu", threads: int | None = None,
                size: int | None = None, seconds: float = 3.0) -> float:
    """Best GFLOP/s of ``size x size`` matmuls in ``dtype`` on ``device`` (cached per process)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        n = size or (8192 if str(device).startswith("cuda") else 2048)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        for _ in range(2):  # warm up the BLAS (packing buffers, JIT kernels)
            torch.mm(a, b, out=out)
        _sync(device)
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            _sync(device)
            dt = time.perf_counter() - t0
            best = max(best, 2.0 * n ** 3 / dt / 1e9)
        return best
    finally:
        torch.set_num_threads(old)


def count_flops(fn, *args, **kwargs) -> int:
    """FLOPs of one call ``fn(*args, **kwargs)`` (forward and, if ``fn`` runs it, backward)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def share_of_peak(flops: float, seconds: float, peak_gflops: float) -> float:
    """Achieved GFLOP/s (``flops / seconds``) as a fraction of ``peak_gflops``."""
    if seconds <= 0 or peak_gflops <= 0:
        return float("nan")
    return flops / seconds / 1e9 / peak_gflops


def peak_line(threads: int | None = None, device: str = "cpu") -> str:
    """One printable line with this machine's fp32 and bf16 matmul peaks."""
    f32 = matmul_peak(torch.float32, device, threads)
    b16 = matmul_peak(torch.bfloat16, device, threads)
    return (f"matmul peak on {device} ({threads or torch.get_num_threads()} threads): "
            f"fp32 {f32:.0f} GFLOP/s, bf16 {b16:.0f} GFLOP/s ({b16 / f32:.1f}x)")


def steady_allocator() -> str:
    """Fix glibc malloc's thresholds for the rest of the process, so that freed buffers are reused
    instead of being handed back to the kernel and page-faulted in again on the next step.

    By default glibc serves large buffers with mmap and moves the mmap/trim thresholds as the
    process frees memory, so how many pages a forward pass faults in (and 10-27% of a CBraMod
    step measured here) depends on what the process allocated before: one 16 MB matrix freed
    earlier changes both sides' times. Fixed thresholds (mmap above 1 GiB, never trim) take that
    out of a side-by-side comparison; both implementations run under the same allocator. The same
    effect for any process: ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647``.
    Returns a line saying what was done (nothing off glibc).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "allocator: unchanged (no glibc mallopt)"
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = mallopt(m_mmap_threshold, 1 << 30) == 1 and mallopt(m_trim_threshold, 2 ** 31 - 1) == 1
    return ("allocator: glibc malloc with fixed thresholds (mmap above 1 GiB, no trim), the same for both sides"
            if ok else "allocator: mallopt refused; glibc defaults")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    print(peak_line(a.threads, a.device))
