"""CPU batch inference sharded across threads: one single-threaded stream per core.

On a few CPU cores, a transformer forward over a small batch is a long chain of short ops (layer
norms, head splits, softmaxes over 19-30 scores, GEMMs of a few MB). Run with ``n`` intra-op
threads, every one of them ends in an OpenMP barrier and most scale far below ``n``x. Splitting
the batch into ``n`` shards and running each shard's whole forward in its own thread with *one*
intra-op thread keeps every core busy without a barrier per op; on 2 cores it made CBraMod's
forward 12% (fp32) to 18% (bf16) faster at batch 8 (``benchmarks/cbramod.py``). A batch smaller
than ``n`` gets one shard per sample, each with its share of the ``n`` threads.

The result is that of the unsharded call: the models this is used for treat every sample
independently in inference (no batch statistics), so a shard's output is exactly the model's
output on that part of the batch. Only a GEMM whose blocking depends on the batch size (a
classifier head whose rows are the samples) may sum in a different order, a rounding-level
difference (2e-6 relative in fp32 in the tests). What is thread-local in torch (grad mode,
inference mode, autocast) is carried into the workers.

Sharding applies only when it can be the same computation and is worth it
(:func:`should_shard`): CPU tensors, no gradient, batch >= 2, >= 2 intra-op threads, not inside
a worker already, not under a ``TorchDispatchMode`` (e.g. ``FlopCounterMode``, which is
thread-local and would not see the workers' ops), not while compiling, and not switched off
with :func:`set_enabled` or ``DOMAINFM_SHARD_THREADS=0``; and for a model
(:func:`module_can_shard`) only in eval mode and with no forward hooks registered, so that no
observer sees the split.

While the workers run, the process-wide intra-op thread count is a shard's share (1 when the
batch covers the threads; torch's ``set_num_threads`` is global); it is restored to the caller's
count when the shards are done. Other threads that run torch ops concurrently with a sharded call
see that count meanwhile.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch

from domainfm.precision import active_autocast_dtype

__all__ = ["should_shard", "module_can_shard", "sharded", "set_enabled", "is_enabled"]

_local = threading.local()
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0  # a forked child inherits the pool object but not its threads: it builds its own
_enabled = os.environ.get("DOMAINFM_SHARD_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")


def set_enabled(enabled: bool) -> bool:
    """Switch sharded inference on or off for the process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def is_enabled() -> bool:
    return _enabled


def _in_worker() -> bool:
    return getattr(_local, "worker", False)


def should_shard(x: torch.Tensor) -> bool:
    """Whether :func:`sharded` would split a call on batch ``x`` (first dimension) here."""
    if not _enabled or _in_worker() or x.device.type != "cpu" or x.dim() == 0 or x.shape[0] < 2:
        return False
    if torch.is_grad_enabled() or torch.get_num_threads() < 2:
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return False
    return True


def module_can_shard(module: torch.nn.Module) -> bool:
    """Whether calls into ``module`` may be split across worker threads without anyone seeing it:
    in eval mode (a train-mode forward draws dropout masks from the shared generator, whose order
    across threads would not be reproducible), and with no forward (pre-)hooks on it, on any
    submodule or globally (a hook would fire once per shard, on part of the batch, in a worker)."""
    if module.training:
        return False
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size, _pool_pid
    with _lock:
        if _pool is None or _pool_size != size or _pool_pid != os.getpid():
            if _pool is not None and _pool_pid == os.getpid():
                _pool.shutdown(wait=True)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="domainfm-shard")
            _pool_size, _pool_pid = size, os.getpid()
        return _pool


def sharded(fn: Callable[..., torch.Tensor], *batched: torch.Tensor, **kwargs) -> torch.Tensor:
    """``fn(*batched, **kwargs)`` with the batch split into one shard per intra-op thread (or one
    per sample when the batch is smaller, each with its share of the threads).

    Every tensor in ``batched`` is split along its first dimension the same way (they must all
    have the caller's batch size); ``kwargs`` go unchanged to every shard. The shards' outputs
    (one tensor each) are concatenated along the first dimension. Call it only when
    :func:`should_shard` is true for the first tensor.
    """
    n = batched[0].shape[0]
    if any(t.shape[0] != n for t in batched):
        raise ValueError(f"sharded: every batched input needs the batch size {n}, got {[t.shape[0] for t in batched]}")
    threads = torch.get_num_threads()
    shards = min(threads, n)
    # each shard's share of the threads (one each when the batch covers them; with more threads
    # than samples, e.g. batch 2 on 16 threads, every shard keeps several instead of idling cores)
    per_shard = [threads // shards + (i < threads % shards) for i in range(shards)]
    pieces = [t.tensor_split(shards) for t in batched]
    autocast_dtype = active_autocast_dtype("cpu")
    inference_mode = torch.is_inference_mode_enabled()

    def run(i: int) -> torch.Tensor:
        _local.worker = True
        torch.set_num_threads(per_shard[i])
        try:
            with torch.inference_mode(inference_mode), torch.no_grad(), \
                    torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                return fn(*(p[i] for p in pieces), **kwargs)
        finally:
            _local.worker = False

    pool = _get_pool(shards)
    futures = [pool.submit(run, i) for i in range(shards)]
    try:
        wait(futures)  # all of them, so that none still runs with its share after the restore
    finally:
        torch.set_num_threads(threads)
    return torch.cat([f.result() for f in futures])
