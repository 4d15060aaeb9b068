"""CBraMod pretraining: the masking rule, masks drawn per window from (seed, epoch, index), the
masked-only loss, and one run through the CLI (recordings in memory; the streamed corpus:
test_cbramod_streaming.py)."""
from __future__ import annotations

import json

import mne
import numpy as np
import torch
from safetensors.torch import load_file

from domainfm import cli, create_model
from domainfm.pretrain.cbramod import MaskedReconstructionRecipe, MaskedWindows, random_patch_mask


def test_mask_ratio_and_at_least_one_masked_patch():
    g = torch.Generator().manual_seed(0)
    mask = random_patch_mask(64, 19, 30, 0.5, generator=g)
    assert mask.dtype == torch.bool and mask.shape == (64, 19, 30)
    assert abs(mask.float().mean().item() - 0.5) < 0.01
    sparse = random_patch_mask(200, 1, 1, 0.01, generator=g)
    assert sparse.flatten(1).any(dim=1).all()  # every example has a masked patch


def test_masks_are_drawn_per_window_from_seed_epoch_and_index():
    # where the masks' random numbers come from: the window's index and the epoch, never the
    # process RNG or the batch it lands in (what lets 2 ranks equal one process)
    windows = torch.zeros(40, 19, 1000)
    ds = MaskedWindows(windows, mask_ratio=0.5, seed=7)
    first = [ds[i][1] for i in range(40)]
    torch.manual_seed(123)
    assert all(torch.equal(ds[i][1], first[i]) for i in reversed(range(40)))
    assert first[0].shape == (19, 5) and first[0].dtype == torch.bool
    assert not all(torch.equal(first[0], m) for m in first[1:])
    assert abs(torch.stack(first).float().mean().item() - 0.5) < 0.03
    ds.set_epoch(1)
    assert not torch.equal(ds[0][1], first[0])
    ds.set_epoch(0)
    assert torch.equal(ds[0][1], first[0])
    assert not torch.equal(MaskedWindows(windows, mask_ratio=0.5, seed=8)[0][1], first[0])
    sparse = MaskedWindows(torch.zeros(200, 1, 200), mask_ratio=0.01)
    assert all(sparse[i][1].any() for i in range(200))  # every window has a masked patch


def test_loss_counts_only_masked_patches():
    torch.manual_seed(0)
    model = create_model("cbramod-test", n_outputs=None).eval()
    recipe = MaskedReconstructionRecipe(model, None)
    x = torch.randn(2, 4, 400)
    mask = random_patch_mask(2, 4, 2, 0.5, generator=torch.Generator().manual_seed(1))
    loss = recipe._loss(model, x, mask)
    with torch.no_grad():
        rec = model.forward_reconstruction(x, mask)
    patches = x.view(2, 4, 2, 200)
    want = ((rec - patches) ** 2)[mask].mean()
    torch.testing.assert_close(loss.detach(), want)
    # evaluation: the same mean, over every masked value however the windows are batched
    out = [recipe.eval_step(model, (x[i:i + 1], mask[i:i + 1])) for i in range(2)]
    pooled = recipe.metrics({k: torch.cat([o[k] for o in out]) for k in out[0]})
    assert abs(pooled["loss"] - float(want)) < 1e-5 * float(want)


def _write_recording(path, seconds=40, sfreq=200.0):
    rng = np.random.default_rng(0)
    names = ["Fp1", "Fp2", "C3", "C4"]
    t = np.arange(int(seconds * sfreq)) / sfreq
    data = np.stack([20 * np.sin(2 * np.pi * (8 + i) * t) + 5 * rng.standard_normal(len(t)) for i in range(4)]) * 1e-6
    raw = mne.io.RawArray(data, mne.create_info(names, sfreq, "eeg"), verbose="error")
    mne.export.export_raw(str(path), raw, fmt="edf", overwrite=True, verbose="error")


def test_pretraining_run_through_cli(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    _write_recording(root / "a.edf")
    _write_recording(root / "b.edf", seconds=3)  # too short for one 4 s window: skipped and counted
    args = ["pretrain", "cbramod", "model.name=cbramod-test", f"data.root={root}", "data.files=['*.edf']",
            "data.eeg.channels=[Fp1, Fp2, C3, C4]", "data.eeg.window_s=4.0", "data.eeg.min_duration_s=null",
            "data.eeg.trim_s=2.0", "data.eeg.reject_uv=null",
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
    # the best checkpoint holds the reconstruction head
    best = load_file(str(run / "checkpoints" / "best.safetensors"))
    assert "proj_out.0.weight" in best and "encoder.layers.1.self_attn_t.in_proj.weight" in best
    # and `domainfm evaluate` re-computes the masked loss of that checkpoint
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    # the selected model's error on the validation windows and masks: the trained one's, not the init's
    assert evaluation["loss"] < 0.5 * val_losses[0]
    assert abs(evaluation["loss"] - report["best_val_loss"]) < 1e-5 * report["best_val_loss"]
    assert report["data_kind"] == "memory" and report["data_source"] == f"recordings: {root}"
