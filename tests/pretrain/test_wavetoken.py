"""The WaveToken pretraining entry point (the KernelSynth/TSMixup series are tested in
tests/data_loaders/test_synthetic_series.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from domainfm import cli, config as cfgmod, create_model
from domainfm.pretrain import wavetoken as P


def test_pretrain_cli_runs_and_writes_a_loadable_model(tmp_path):
    code = cli.main(["pretrain", "wavetoken", "train.max_steps=6", "train.batch_size=8", "train.progress=false",
                     "train.log_every_steps=2", "data.kernel_synth_series=8", "data.kernel_synth_length=128",
                     "data.windows_per_epoch=48", "data.val_windows=16", "--runs-dir", str(tmp_path), "--name", "p"])
    assert code == 0
    run = tmp_path / "wavetoken" / "p"
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 6 and report["init"] == "random" and report["params_total"] == report["params_trainable"] > 0
    assert 0 < report["val_loss"] < 1.2 * report["uniform_loss"]
    summary = json.loads((run / "pretrain_summary.json").read_text())
    assert summary["steps"] == 6 and all(report[k] == v for k, v in summary.items())
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


def test_pretraining_mixes_the_bundled_real_series_in_the_asked_share(tmp_path):
    code = cli.main(["pretrain", "wavetoken", "train.max_steps=2", "train.batch_size=4", "train.progress=false",
                     "data.kernel_synth_series=8", "data.kernel_synth_length=128", "data.windows_per_epoch=8",
                     "data.val_windows=0", "data.bundled=[m1_yearly]", "data.tsmixup_real_share=0.5",
                     "data.tsmixup_prob=0.9", "--runs-dir", str(tmp_path), "--name", "mix"])
    assert code == 0
    report = json.loads((tmp_path / "wavetoken" / "mix" / "report.json").read_text())
    assert report["extra_series"] == 181  # the M1 yearly series, 15 to 58 values: all shorter than a window
    comp = report["tsmixup_composition"]
    assert comp["draws"] == 8  # one epoch of 8 windows
    share = P.SeededWindows(P.generate_kernel_synth(8, length=128), [np.arange(20.0)] * 5, context_length=64,
                            prediction_length=16, num_windows=4000, seed=0, min_past=30, tsmixup_prob=0.9,
                            tsmixup={"real_share": 0.5}).composition(4000)
    assert abs(share["tsmixup_share"] - 0.9) < 4 * (0.9 * 0.1 / 4000) ** 0.5
    assert abs(share["real_component_share"] - 0.5) < 0.03


def test_context_crop_gives_histories_of_every_length():
    series = [np.arange(400.0, dtype=np.float32)]
    ds = P.SeededWindows(series, [], context_length=128, prediction_length=16, num_windows=400, seed=0, min_past=30,
                         tsmixup_prob=0.0, missing_prob=0.0, context_crop_prob=1.0)
    lengths = [int((~torch.isnan(ds[i][0])).sum()) for i in range(400)]
    assert min(lengths) == 30 and max(lengths) == 128
    assert 40 < np.median(lengths) < 110  # uniform between min_past and the context length
    plain = P.SeededWindows(series, [], context_length=128, prediction_length=16, num_windows=400, seed=0, min_past=30,
                            tsmixup_prob=0.0, missing_prob=0.0)
    for i in range(400):  # the same cut (the crop draws after it): the cropped history is its last values
        (crop_c, crop_f), (plain_c, plain_f) = ds[i], plain[i]
        assert torch.equal(crop_f, plain_f)
        kept = ~torch.isnan(crop_c)
        assert torch.equal(crop_c[kept], plain_c[-int(kept.sum()):])
