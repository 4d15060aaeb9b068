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
