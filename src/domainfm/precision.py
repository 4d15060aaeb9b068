"""One rule for numerical precision, shared by training (``train.precision: auto``) and every
inference entry point (``predict``, ``embed``, benchmarks).

``auto`` means bf16 autocast with fp32 master weights where the hardware multiplies bf16 natively
(CUDA devices with bf16 support; CPUs with AMX-BF16 or AVX512-BF16, where oneDNN's bf16 matmuls run
several times faster than fp32), and fp32 elsewhere. ``DOMAINFM_PRECISION`` overrides ``auto``
(e.g. ``DOMAINFM_PRECISION=32-true`` to reproduce fp32 figures).
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

__all__ = ["PRECISIONS", "PrecisionError", "bf16_native", "resolve_precision", "autocast", "autocast_dtype",
           "active_autocast_dtype"]

#: what ``precision`` may say (Lightning Fabric's names, plus ``auto``)
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "64-true")


class PrecisionError(ValueError):
    """A precision no entry point accepts (from a config, ``--precision`` or ``DOMAINFM_PRECISION``)."""


@functools.lru_cache(maxsize=None)
def _cpu_bf16_native() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:  # not Linux: ask oneDNN, which checks the ISA itself
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()) and (
            torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX"))
    return "amx_bf16" in flags or "avx512_bf16" in flags


def bf16_native(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` multiplies bf16 natively (so bf16 autocast pays off)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_bf16_native()
    return False


def resolve_precision(precision: str | None, device: str | torch.device = "cpu") -> str:
    """``auto`` (or None) -> ``bf16-mixed`` where :func:`bf16_native`, else ``32-true``; other
    values are returned as they are after a check."""
    if precision in (None, "auto"):
        precision = os.environ.get("DOMAINFM_PRECISION") or "auto"
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision={precision!r}: expected one of {PRECISIONS}")
    if precision == "auto":
        return "bf16-mixed" if bf16_native(device) else "32-true"
    return precision


def autocast_dtype(precision: str | None, device: str | torch.device = "cpu") -> torch.dtype | None:
    """The autocast dtype ``precision`` means on ``device`` (None: no autocast)."""
    resolved = resolve_precision(precision, device)
    if resolved.startswith("bf16"):
        return torch.bfloat16
    if resolved.startswith("16"):
        return torch.float16
    return None


def active_autocast_dtype(device_type: str = "cpu") -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` right now (None when autocast is off there)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


@contextlib.contextmanager
def autocast(precision: str | None = "auto", device: str | torch.device = "cpu") -> Iterator[str]:
    """Context for inference under ``precision`` (yields the resolved name)."""
    device = torch.device(device)
    dtype = autocast_dtype(precision, device)
    resolved = resolve_precision(precision, device)
    if dtype is None:
        yield resolved
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield resolved
