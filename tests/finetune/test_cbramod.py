"""CBraMod fine-tuning through the CLI: LoRA on the tiny variant, adapter round trip, pretrained
weights from a file, the offline message and fallback, and the embedded-default data."""
from __future__ import annotations

import json

import mne
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from domainfm import cli, create_model, lora
from domainfm.finetune import cbramod as ft


def _write_labelled(path, seconds=60, sfreq=200.0, seed=0):
    """Events 'A' (10 Hz burst on channel 0) and 'B' (10 Hz burst on channel 3) every 3 s."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sfreq)
    data = 5 * rng.standard_normal((4, n))
    onsets, labels = [], []
    for k, onset in enumerate(np.arange(1.0, seconds - 3, 3.0)):
        label = "A" if (k + seed) % 2 == 0 else "B"
        s = int(onset * sfreq)
        t = np.arange(int(2 * sfreq)) / sfreq
        data[0 if label == "A" else 3, s : s + len(t)] += 40 * np.sin(2 * np.pi * 10 * t)
        onsets.append(onset)
        labels.append(label)
    raw = mne.io.RawArray(data * 1e-6, mne.create_info(["Fp1", "Fp2", "O1", "O2"], sfreq, "eeg"), verbose="error")
    raw.set_annotations(mne.Annotations(onsets, [2.0] * len(onsets), labels))
    mne.export.export_raw(str(path), raw, fmt="edf", overwrite=True, verbose="error")


def _common(tmp_path):
    root = tmp_path / "data"
    root.mkdir(exist_ok=True)
    _write_labelled(root / "train.edf", seed=0)
    _write_labelled(root / "val.edf", seconds=30, seed=1)
    return ["model.name=cbramod-test", "model.pretrained=null", "model.kwargs={}", "stages=[]", "data.kind=files", f"data.root={root}",
            "data.train=[train.edf]", "data.val=[val.edf]", "data.eeg.channels=[Fp1, Fp2, O1, O2]",
            "data.eeg.events={A: 0, B: 1}", "data.eeg.window_s=2.0", "n_outputs=2",
            "train.batch_size=4", "train.progress=false", "train.log_every_steps=1"]


def _official_file(tmp_path, seed=5):
    """A "pretrained" cbramod-test checkpoint in the official format (our weights, official keys)."""
    from domainfm.models.cbramod import to_official_state_dict

    torch.manual_seed(seed)
    source = create_model("cbramod-test", n_outputs=None)
    path = tmp_path / "pretrained_weights.pth"
    torch.save(to_official_state_dict(source), path)
    return source, path


LORA_TARGETS = ["encoder.layers.*.self_attn_*.in_proj", "encoder.layers.*.self_attn_*.out_proj",
                "encoder.layers.*.linear1", "encoder.layers.*.linear2"]


def _report(run):
    return json.loads((run / "report.json").read_text())


def test_lora_finetune_through_cli_and_adapter_reload(tmp_path):
    source, weights = _official_file(tmp_path)
    args = ["finetune", "cbramod", *_common(tmp_path), f"model.pretrained={weights}", "adapt.mode=lora",
            "adapt.lora.rank=2", "arms=[pretrained]", "model.kwargs={head_type: avgpooling_patch_reps}",
            "train.max_steps=4", "train.lr=1e-3", "keep_checkpoints=true", "--runs-dir", str(tmp_path / "runs"),
            "--name", "lora"]
    assert cli.main(args) == 0
    run = tmp_path / "runs" / "cbramod" / "lora"
    report = _report(run)
    arm = report["arms"]["pretrained"]
    assert arm["init"].startswith(f"pretrained {weights}") and arm["mode"] == "lora" and arm["steps"] == 4
    assert report["adapt"]["mode"] == "lora" and report["labels"] == "recorded"
    assert arm["params"]["trainable"] / arm["params"]["total"] < 0.05
    assert report["data"]["train_examples"] == 19 and report["data"]["val_examples"] == 9
    assert report["monitor"] == "val/cohen_kappa"
    assert {"balanced_accuracy", "cohen_kappa", "f1_weighted"} <= set(arm["val"])
    best = load_file(str(run / "pretrained" / "checkpoints" / "best.safetensors"))
    assert any(".base_layer." in k for k in best)

    # the saved adapter on a freshly loaded base gives the predictions of the merged saved model
    kwargs = dict(n_chans=4, n_times=400, n_outputs=2, head_type="avgpooling_patch_reps", reconstruction_head=False)
    saved = create_model(run / "pretrained" / "model").eval()
    base = create_model("cbramod-test", pretrained=str(weights), **kwargs)
    untouched = create_model("cbramod-test", pretrained=str(weights), **kwargs).eval()
    assert torch.equal(base.encoder.layers[1].linear1.weight, source.encoder.layers[1].linear1.weight)
    reloaded = lora.load_adapter(base, run / "pretrained" / "adapter").eval()
    x = torch.randn(3, 4, 400)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), saved(x), atol=1e-5, rtol=1e-5)
        # and the adapter changed the backbone: same head, LoRA deltas removed -> other features
        untouched.head.load_state_dict(reloaded.head.state_dict())
        assert (untouched.forward_features(x) - reloaded.forward_features(x)).abs().max() > 1e-6
    # `domainfm evaluate` scores RUN/pretrained/model (LoRA merged) exactly as the run did
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["max_abs_diff_val"] <= 1e-6
    assert evaluation["arms"]["pretrained"]["val"]["cohen_kappa"] == pytest.approx(arm["val"]["cohen_kappa"], abs=1e-6)


def test_full_finetune_learns_the_synthetic_events_in_both_arms(tmp_path):
    _, weights = _official_file(tmp_path)
    args = ["finetune", "cbramod", *_common(tmp_path), f"model.pretrained={weights}", "train.max_epochs=15",
            "train.lr=5e-4", "train.head_lr=1e-3",
            # fp32 everywhere: auto is bf16 only where the CPU multiplies bf16 natively, and the
            # threshold below must hold on every CPU
            "train.precision=32-true", "--runs-dir", str(tmp_path / "runs"), "--name", "full"]
    assert cli.main(args) == 0
    report = _report(tmp_path / "runs" / "cbramod" / "full")
    assert list(report["arms"]) == ["pretrained", "random"]
    for arm in report["arms"].values():
        assert arm["params"]["trainable"] == arm["params"]["total"]
        assert arm["val"]["balanced_accuracy"] >= 0.75  # channel-0 vs channel-3 10 Hz bursts
    assert report["arms"]["random"]["init"] == "random (no pretrained weights requested)"
    # the selected step is the best validation kappa of the arm's own log
    log = [json.loads(l) for l in (tmp_path / "runs" / "cbramod" / "full" / "random" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in log if r.get("split") == "val"]
    assert max(r["cohen_kappa"] for r in vals) == pytest.approx(
        next(r for r in vals if r["step"] == report["arms"]["random"]["best_step"])["cohen_kappa"])


def test_card_weights_offline_stop_or_fall_back_as_configured(tmp_path, monkeypatch, capsys):
    from domainfm.experiment import ModelSpec, WeightsUnavailable, resolve

    monkeypatch.setenv("DOMAINFM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    kwargs = dict(n_chans=4, n_times=400, n_outputs=2, reconstruction_head=False)
    with pytest.raises(WeightsUnavailable, match="model.fallback=random"):
        resolve(ModelSpec("cbramod-base", True, "error", kwargs, "official"))
    model, init = resolve(ModelSpec("cbramod-base", True, "random", kwargs, "official"))
    assert init.kind == "random" and str(init).startswith("random (fallback: OfflineError")
    assert "RANDOM initialisation" in capsys.readouterr().err
    # a file the user named is never replaced by random init
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as info:
        resolve(ModelSpec("cbramod-test", str(bad), "random", kwargs))
    assert not isinstance(info.value, WeightsUnavailable) and str(bad) in str(info.value)


def test_embedded_default_task_is_built_from_the_shipped_recording():
    train, val = ft.build_demo_task()
    assert train.x.shape == (19 * 12, 4, 800) and val.x.shape == (9 * 12, 4, 800)
    assert torch.bincount(train.y).tolist() == [76, 76, 76]
    assert torch.isfinite(train.x).all() and 0.05 < float(train.x.std()) < 2.0  # 100 µV units
    # the embedded default's config parses, asks for the official weights (random fallback, said in the
    # report) for the 12-layer model with no stage, and labels the task as constructed
    from domainfm import config as cfgmod

    cfg = cfgmod.from_dict(ft.Config, cfgmod.load_yaml(cfgmod.config_path("cbramod", "finetune")))
    assert cfg.arms == ["pretrained", "random"] and cfg.stages == []
    assert cfg.model.pretrained is True and cfg.model.fallback == "random" and "n_layers" not in cfg.model.kwargs
    task = ft.build_task(cfg)
    assert task.labels.startswith("constructed:") and task.n_outputs == 3 and task.info["n_chans"] == 4
