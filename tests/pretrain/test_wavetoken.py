"""KernelSynth, TSMixup and the pretraining entry point."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from domainfm import cli, config as cfgmod, create_model
from domainfm.pretrain import wavetoken as P


def test_kernel_bank_matches_chronos():
    assert len(P.KERNEL_BANK) == 33
    periods = sorted(round(p["periodicity"] * P.KERNEL_LENGTH) for k, p in P.KERNEL_BANK if k == "exp_sine_squared")
    assert periods == sorted([24, 48, 96, 168, 336, 672, 7, 14, 30, 60, 365, 730, 4, 26, 52, 4, 6, 12, 4, 40, 10])
    kinds = [k for k, _ in P.KERNEL_BANK]
    assert kinds.count("dot_product") == 3 and kinds.count("rbf") == 3 and kinds.count("rational_quadratic") == 3
    assert kinds.count("white") == 2 and kinds.count("constant") == 1


def test_kernel_matrices_match_sklearn_definitions():
    sk = pytest.importorskip("sklearn.gaussian_process.kernels")
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
        np.testing.assert_allclose(P.kernel_matrix(spec, x), kernel(x[:, None]), atol=1e-12)


def test_kernel_synth_is_reproducible_and_finite():
    a = P.generate_kernel_synth(6, length=128, seed=3)
    b = P.generate_kernel_synth(6, length=128, seed=3)
    assert a.shape == (6, 128) and np.isfinite(a).all() and np.array_equal(a, b)
    assert not np.array_equal(a, P.generate_kernel_synth(6, length=128, seed=4))
    assert a.std(axis=1).min() > 0


def test_ts_mixup_is_a_convex_mix_of_mean_scaled_windows():
    rng = np.random.default_rng(0)
    pool = [np.full(300, 5.0), np.full(300, -2.0)]  # mean-|x| scaling turns them into +1 and -1
    for _ in range(20):
        mixed = P.ts_mixup(pool, rng, max_series=3, min_length=50, max_length=200)
        assert 50 <= len(mixed) <= 200
        assert np.allclose(mixed, mixed[0]) and -1 - 1e-6 <= mixed[0] <= 1 + 1e-6  # a convex combination of +-1
    single = P.ts_mixup([np.arange(1.0, 401.0)], np.random.default_rng(1), max_series=1, min_length=100, max_length=100)
    assert len(single) == 100 and np.isclose(np.abs(single).mean(), 1.0, atol=1e-5)


def test_pretrain_cli_runs_and_writes_a_loadable_model(tmp_path):
    code = cli.main(["pretrain", "wavetoken", "train.max_steps=6", "train.batch_size=8", "train.progress=false",
                     "train.log_every_steps=2", "data.kernel_synth_series=8", "data.kernel_synth_length=128",
                     "data.windows_per_epoch=48", "data.val_windows=16", "--runs-dir", str(tmp_path), "--name", "p"])
    assert code == 0
    run = tmp_path / "wavetoken" / "p"
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 6 and report["init"] == "random" and report["params_total"] == report["params_trainable"] > 0
    assert 0 < report["val_loss"] < 1.2 * report["uniform_loss"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)
    model = create_model(run / "model")
    assert model.domainfm_name == "wavetoken-test"
    assert torch.isfinite(model.predict(torch.randn(40), 8, num_samples=2, seed=0)).all()


def test_every_shipped_config_parses():
    from domainfm.finetune import wavetoken as F

    names = cfgmod.list_configs("wavetoken")
    assert "wavetoken/pretrain" in names and "wavetoken/finetune" in names
    for name in names:
        raw = cfgmod.load_yaml(cfgmod.config_path("wavetoken", name.split("/")[1]))
        schema = P.Config if name.split("/")[1].startswith("pretrain") else F.Config
        cfgmod.from_dict(schema, raw)
