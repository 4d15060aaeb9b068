"""domainfm.threads: CPU batch inference sharded across single-threaded workers.

The sharded call must be the same computation as the plain one (values bit for bit, dtypes, the
caller's autocast), must run each shard with one intra-op thread, must give the caller its thread
count back (also when a shard fails), and must stay out of the way whenever sharding could change
what is computed or observed (gradients, dispatch modes such as FlopCounterMode, batch 1, one
thread, switched off).
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from domainfm import threads
from domainfm.models.cbramod import CBraMod


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _calls(fn):
    """fn, recording (thread, intra-op threads, autocast on, batch) of every call."""
    seen = []

    def wrapped(x, *rest):
        seen.append((threading.get_ident(), torch.get_num_threads(), torch.is_autocast_enabled("cpu"), x.shape[0]))
        return fn(x, *rest)

    return wrapped, seen


def test_sharded_runs_one_single_threaded_shard_per_thread_and_restores_the_count(two_threads):
    fn, seen = _calls(lambda x: x * 2)
    x = torch.arange(10.0).view(5, 2)
    with torch.no_grad():
        assert threads.should_shard(x)
        out = threads.sharded(fn, x)
    assert torch.equal(out, x * 2)
    assert sorted(b for *_, b in seen) == [2, 3]  # 5 samples over 2 threads
    assert all(n == 1 for _, n, _, _ in seen)  # one intra-op thread per worker
    assert threading.get_ident() not in {t for t, *_ in seen}
    assert torch.get_num_threads() == 2


def test_sharded_carries_autocast_and_propagates_errors_with_the_count_restored(two_threads):
    fn, seen = _calls(lambda x: torch.nn.functional.linear(x, torch.ones(3, 4)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = threads.sharded(fn, torch.randn(4, 4))
    assert out.dtype == torch.bfloat16 and all(on for _, _, on, _ in seen)

    def fails(x):
        if x[0, 0] > 100:
            raise ValueError("bad shard")
        return x

    x = torch.zeros(4, 2)
    x[2:, 0] = 1000.0
    with torch.no_grad(), pytest.raises(ValueError, match="bad shard"):
        threads.sharded(fails, x)
    assert torch.get_num_threads() == 2
    with torch.no_grad(), pytest.raises(ValueError, match="batch size 4"):
        threads.sharded(lambda a, b: a, torch.zeros(4, 1), torch.zeros(3, 1))


def test_should_shard_only_when_it_is_the_same_computation(two_threads):
    x = torch.zeros(4, 3)
    assert not threads.should_shard(x)  # gradients enabled: autograd stays on the caller's thread
    with torch.no_grad():
        assert threads.should_shard(x)
        assert not threads.should_shard(torch.zeros(1, 3))  # batch of one
        with FlopCounterMode(display=False):  # thread-local mode: workers would escape it
            assert not threads.should_shard(x)
        previous = threads.set_enabled(False)
        try:
            assert not threads.should_shard(x)
        finally:
            threads.set_enabled(previous)
        torch.set_num_threads(1)
        assert not threads.should_shard(x)
        torch.set_num_threads(2)
        # inside a worker: no nested sharding
        inner = threads.sharded(lambda t: torch.full((t.shape[0],), float(threads.should_shard(t))), x)
        assert torch.equal(inner, torch.zeros(4))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cbramod_sharded_inference_equals_the_single_stream(two_threads, precision):
    torch.manual_seed(0)
    model = CBraMod(n_chans=4, n_times=600, n_outputs=3, n_layers=2, dim_feedforward=64).eval()
    x = torch.randn(5, 4, 600, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(5, 4, 3, generator=torch.Generator().manual_seed(2)) < 0.5
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.no_grad(), ctx:
        got = (model.forward_features(x), model(x), model.forward_reconstruction(x, mask))
        previous = threads.set_enabled(False)
        try:
            want = (model.forward_features(x), model(x), model.forward_reconstruction(x, mask))
        finally:
            threads.set_enabled(previous)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        # the same arithmetic per sample; only GEMMs whose blocking depends on the batch size
        # (the classifier head's, M = 2-3 instead of 5) may sum in another order
        if precision == "fp32":
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    assert torch.get_num_threads() == 2


def test_models_shard_only_in_eval_mode_and_without_hooks(two_threads):
    model = CBraMod(n_chans=4, n_times=400, n_layers=1, dim_feedforward=32).eval()
    x = torch.randn(4, 4, 400)
    assert threads.module_can_shard(model)
    calls = []
    handle = model.encoder.layers[0].register_forward_hook(lambda m, a, out: calls.append(out.shape[0]))
    try:
        assert not threads.module_can_shard(model)
        with torch.no_grad():
            model.forward_features(x)
        assert calls == [4]  # the hook saw the whole batch once, on the caller's thread
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        assert not threads.module_can_shard(model)
    finally:
        handle.remove()
    assert threads.module_can_shard(model) and not threads.module_can_shard(model.train())


def test_a_forked_child_shards_with_its_own_workers(two_threads):
    # the parent's pool exists first; a child made by fork inherits the pool object without its
    # threads, so reusing it would wait forever
    import multiprocessing as mp

    with torch.no_grad():
        threads.sharded(lambda t: t + 1, torch.zeros(4, 2))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_shards, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "sharded call in a forked child hung"
    assert queue.get(timeout=5) == [2.0] * 8


def _child_shards(queue):
    torch.set_num_threads(2)
    with torch.no_grad():
        queue.put(threads.sharded(lambda t: t + 2, torch.zeros(8)).tolist())


def test_small_batches_keep_every_thread_busy():
    old = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        fn, seen = _calls(lambda x: x + 1)
        with torch.no_grad():
            threads.sharded(fn, torch.zeros(2, 3))
        assert sorted(n for _, n, _, _ in seen) == [2, 3]  # 5 threads over 2 shards, none idle
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(old)
