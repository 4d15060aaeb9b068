"""CBraMod pretraining: the masking rule, the masked-only loss, and one run through the CLI."""
from __future__ import annotations

import json

import mne
import numpy as np
import torch
from safetensors.torch import load_file

from domainfm import cli, create_model
from domainfm.data_loaders import eeg
from domainfm.pretrain.cbramod import MaskedReconstructionRecipe, random_patch_mask


def test_mask_ratio_and_at_least_one_masked_patch():
    g = torch.Generator().manual_seed(0)
    mask = random_patch_mask(64, 19, 30, 0.5, generator=g)
    assert mask.dtype == torch.bool and mask.shape == (64, 19, 30)
    assert abs(mask.float().mean().item() - 0.5) < 0.01
    sparse = random_patch_mask(200, 1, 1, 0.01, generator=g)
    assert sparse.flatten(1).any(dim=1).all()  # every example has a masked patch


def test_loss_counts_only_masked_patches():
    torch.manual_seed(0)
    model = create_model("cbramod-test", n_outputs=None).eval()
    recipe = MaskedReconstructionRecipe(model, None, mask_ratio=0.5)
    x = torch.randn(2, 4, 400)
    torch.manual_seed(1)
    loss = recipe._loss(model, x)
    torch.manual_seed(1)
    mask = random_patch_mask(2, 4, 2, 0.5)
    with torch.no_grad():
        rec = model.forward_reconstruction(x, mask)
    patches = x.view(2, 4, 2, 200)
    want = ((rec - patches) ** 2)[mask].mean()
    torch.testing.assert_close(loss.detach(), want)


def _write_recording(path, seconds=40, sfreq=200.0):
    rng = np.random.default_rng(0)
    names = ["Fp1", "Fp2", "C3", "C4"]
    t = np.arange(int(seconds * sfreq)) / sfreq
    data = np.stack([20 * np.sin(2 * np.pi * (8 + i) * t) + 5 * rng.standard_normal(len(t)) for i in range(4)]) * 1e-6
    raw = mne.io.RawArray(data, mne.create_info(names, sfreq, "eeg"), verbose="error")
    mne.export.export_raw(str(path), raw, fmt="edf", overwrite=True, verbose="error")


def test_pretraining_run_through_cli_with_shards(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    _write_recording(root / "a.edf")
    _write_recording(root / "b.edf", seconds=3)  # too short for one 4 s window: skipped and counted
    args = ["pretrain", "cbramod", "model.name=cbramod-test", f"data.root={root}", "data.files=['*.edf']",
            "data.eeg.channels=[Fp1, Fp2, C3, C4]", "data.eeg.window_s=4.0", "data.eeg.min_duration_s=null",
            "data.eeg.trim_s=2.0", "data.eeg.reject_uv=null", f"data.preprocess_to={tmp_path / 'shards'}",
            "data.val_fraction=0.25", "train.max_steps=24", "train.batch_size=2", "train.lr=3e-3", "train.progress=false",
            "train.log_every_steps=1", "--runs-dir", str(tmp_path / "runs"), "--name", "p"]
    assert cli.main(args) == 0
    run = tmp_path / "runs" / "cbramod" / "p"
    report = json.loads((run / "report.json").read_text())
    assert report["init"] == "random" and report["steps"] == 24
    assert report["windows"] == 9 and report["files_skipped"] == 1  # (40 - 2*2) s / 4 s
    assert report["val_windows"] == 2 and report["input"] == "4 ch x 4 patches"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r.get("split") == "train"]
    val_losses = [r["loss"] for r in records if r.get("split") == "val"]
    # the masked-reconstruction objective is learnt: from a random init's error (~10) it falls by
    # an order of magnitude on training and held-out windows alike
    assert len(train_losses) == 24 and np.mean(train_losses[-4:]) < 0.2 * train_losses[0]
    assert len(val_losses) >= 2 and val_losses[-1] < 0.5 * val_losses[0]
    # shards were written and read back; the best checkpoint holds the reconstruction head
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert index["total"] == 9 and len(index["meta"]["skipped"]) == 1
    best = load_file(str(run / "checkpoints" / "best.safetensors"))
    assert "proj_out.0.weight" in best and "encoder.layers.1.self_attn_t.in_proj.weight" in best
    # and `domainfm evaluate` re-computes the masked loss of that checkpoint
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    # the selected model's error, measured again with fresh masks: the trained one's, not the init's
    assert evaluation["loss"] < 0.5 * val_losses[0]
    ds = eeg.ShardDataset(tmp_path / "shards")
    assert ds[0].shape == (4, 800)
