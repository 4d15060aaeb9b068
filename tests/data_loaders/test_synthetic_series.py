"""KernelSynth and TSMixup series (Chronos) and the synthetic training windows built on them."""
from __future__ import annotations

import numpy as np
import torch

from domainfm.data_loaders import synthetic_series as S


def test_kernel_bank_matches_chronos():
    assert len(S.KERNEL_BANK) == 33
    periods = sorted(round(p["periodicity"] * S.KERNEL_LENGTH) for k, p in S.KERNEL_BANK if k == "exp_sine_squared")
    assert periods == sorted([24, 48, 96, 168, 336, 672, 7, 14, 30, 60, 365, 730, 4, 26, 52, 4, 6, 12, 4, 40, 10])
    kinds = [k for k, _ in S.KERNEL_BANK]
    assert kinds.count("dot_product") == 3 and kinds.count("rbf") == 3 and kinds.count("rational_quadratic") == 3
    assert kinds.count("white") == 2 and kinds.count("constant") == 1


def test_kernel_matrices_match_sklearn_definitions():
    import sklearn.gaussian_process.kernels as sk
    x = np.linspace(0, 1, 50)
    pairs = [
        (("exp_sine_squared", {"periodicity": 24 / 1024, "length_scale": 1.0}), sk.ExpSineSquared(periodicity=24 / 1024)),
        (("dot_product", {"sigma_0": 10.0}), sk.DotProduct(sigma_0=10.0)),
        (("rbf", {"length_scale": 0.1}), sk.RBF(length_scale=0.1)),
        (("rational_quadratic", {"alpha": 0.1, "length_scale": 1.0}), sk.RationalQuadratic(alpha=0.1)),
        (("white", {"noise_level": 0.1}), sk.WhiteKernel(noise_level=0.1)),
        (("constant", {"constant_value": 1.0}), sk.ConstantKernel()),
    ]
    for spec, kernel in pairs:
        np.testing.assert_allclose(S.kernel_matrix(spec, x), kernel(x[:, None]), atol=1e-12)


def test_kernel_synth_is_reproducible_and_finite():
    a = S.generate_kernel_synth(6, length=128, seed=3)
    b = S.generate_kernel_synth(6, length=128, seed=3)
    assert a.shape == (6, 128) and np.isfinite(a).all() and np.array_equal(a, b)
    assert not np.array_equal(a, S.generate_kernel_synth(6, length=128, seed=4))
    assert a.std(axis=1).min() > 0


def test_ts_mixup_is_a_convex_mix_of_mean_scaled_windows():
    rng = np.random.default_rng(0)
    pool = [np.full(300, 5.0), np.full(300, -2.0)]  # mean-|x| scaling turns them into +1 and -1
    for _ in range(20):
        mixed = S.ts_mixup(pool, rng, max_series=3, min_length=50, max_length=200)
        assert 50 <= len(mixed) <= 200
        assert np.allclose(mixed, mixed[0]) and -1 - 1e-6 <= mixed[0] <= 1 + 1e-6  # a convex combination of +-1
    single = S.ts_mixup([np.arange(1.0, 401.0)], np.random.default_rng(1), max_series=1, min_length=100, max_length=100)
    assert len(single) == 100 and np.isclose(np.abs(single).mean(), 1.0, atol=1e-5)


def test_synthetic_windows_split_pad_and_drop_only_context_values():
    # a KernelSynth "pool" of one ramp, no TSMixup: each window is a contiguous slice of the ramp
    ramp = np.arange(1.0, 201.0, dtype=np.float32)
    ds = S.SyntheticWindows(ramp[None], [], context_length=64, prediction_length=8, num_windows=5,
                            tsmixup_prob=0.0, missing_prob=0.0, min_past=20)
    np.random.seed(0)
    for i in range(len(ds)):
        context, future = ds[i]
        assert context.shape == (64,) and future.shape == (8,) and context.dtype == torch.float32
        # the future continues the context by one step; left padding (short history) is NaN
        observed = context[~torch.isnan(context)]
        assert len(observed) >= 20 and torch.equal(observed, torch.arange(float(observed[0]), float(observed[-1]) + 1))
        assert torch.equal(future, torch.arange(float(observed[-1]) + 1, float(observed[-1]) + 9))
    # missing values: only in the context, never in the future
    dropping = S.SyntheticWindows(ramp[None], [], context_length=64, prediction_length=8, num_windows=50,
                                  tsmixup_prob=0.0, missing_prob=0.9, min_past=64)
    np.random.seed(1)
    items = [dropping[i] for i in range(50)]
    assert sum(int(torch.isnan(c).sum()) for c, _ in items) > 0
    assert not any(torch.isnan(f).any() for _, f in items)


def test_fixed_windows_are_reproducible_and_leave_the_global_generator_alone():
    pool = S.generate_kernel_synth(4, length=128, seed=0)
    ds = S.SyntheticWindows(pool, [], context_length=32, prediction_length=8, num_windows=6)
    np.random.seed(123)
    expected_next = np.random.rand()
    np.random.seed(123)
    a = S.fixed_windows(ds, 6, seed=7)
    assert np.random.rand() == expected_next  # global state restored
    b = S.fixed_windows(ds, 6, seed=7)
    assert a.tensors[0].shape == (6, 32) and a.tensors[1].shape == (6, 8)
    for x, y in zip(a.tensors, b.tensors):  # NaN (missing) at the same places, equal values elsewhere
        assert torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))
    c = S.fixed_windows(ds, 6, seed=8)
    assert not torch.equal(torch.nan_to_num(a.tensors[1]), torch.nan_to_num(c.tensors[1]))


def test_pretraining_module_re_exports_the_same_objects():
    from domainfm.pretrain import wavetoken as P

    for name in S.__all__:
        assert getattr(P, name) is getattr(S, name)


def _signed_pools():
    # mean-|x| scaling maps the KernelSynth stand-ins (constant +5, 512 long) to +1 and the real
    # ones (constant -3, 12 to 107 long: yearly and quarterly series) to -1, so a window holds a
    # real series exactly when its values fall below +1
    synth = [np.full(512, 5.0, dtype=np.float32) for _ in range(400)]
    real = [np.full(n, -3.0, dtype=np.float32) for n in range(12, 108, 5)]
    return synth, real


def _real_draw_share(ds, n):
    np.random.seed(0)
    hits = 0
    for i in range(n):
        context, future = ds[i]
        values = torch.cat([context, future])
        hits += bool((values[~torch.isnan(values)] < 1 - 1e-5).any())
    return hits / n


def test_tsmixup_draws_hold_real_series_in_the_asked_share_whatever_their_length():
    synth, real = _signed_pools()
    common = dict(context_length=128, prediction_length=64, num_windows=3000, tsmixup_prob=1.0, missing_prob=0.0,
                  min_past=60)
    n = 3000
    # Chronos mixes real series only: every mix holds one
    only_real = S.SyntheticWindows(synth, real, **common)
    assert _real_draw_share(only_real, n) == 1.0
    # half the components real: P(at least one of k ~ U{1,2,3}) = 1 - (1/2 + 1/4 + 1/8) / 3
    half = S.SyntheticWindows(synth, real, tsmixup={"real_share": 0.5}, **common)
    expected = 1 - (0.5 + 0.25 + 0.125) / 3
    assert abs(_real_draw_share(half, n) - expected) < 4 * (expected * (1 - expected) / n) ** 0.5
    none = S.SyntheticWindows(synth, real, tsmixup={"real_share": 0.0}, **common)
    assert _real_draw_share(none, 500) == 0.0


def test_short_real_series_give_windows_with_context_and_a_masked_future_tail():
    ramp = np.arange(1.0, 31.0, dtype=np.float32)  # 30 values, shorter than min_past + horizon
    past, future = S.cut_window(ramp, lambda low, high: high, min_past=60, prediction_length=64)
    assert len(past) == 29 and future.shape == (64,)
    assert future[0] == 30 and np.isnan(future[1:]).all()
    past, future = S.cut_window(ramp, lambda low, high: low, min_past=60, prediction_length=64)
    np.testing.assert_array_equal(past, ramp[:15])  # at least half of the series is context
    np.testing.assert_array_equal(future[:15], ramp[15:])
    assert np.isnan(future[15:]).all()
    long = np.arange(200.0, dtype=np.float32)
    past, future = S.cut_window(long, lambda low, high: low, min_past=60, prediction_length=64)
    np.testing.assert_array_equal(past, long[:60])
    np.testing.assert_array_equal(future, long[60:124])
