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
    return ["model.name=cbramod-test", "model.pretrained=false", "data.kind=files", f"data.root={root}",
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


def test_lora_finetune_through_cli_and_adapter_reload(tmp_path):
    _, weights = _official_file(tmp_path)
    args = ["finetune", "cbramod", *_common(tmp_path), f"model.pretrained={weights}", "mode=lora", "lora.rank=2",
            f"lora.targets={LORA_TARGETS}", "model.head_type=avgpooling_patch_reps", "train.max_steps=4",
            "train.lr=1e-3", "--runs-dir", str(tmp_path / "runs"), "--name", "lora"]
    assert cli.main(args) == 0
    run = tmp_path / "runs" / "cbramod" / "lora"
    report = json.loads((run / "report.json").read_text())
    assert report["init"].startswith(f"pretrained: {weights}")
    assert report["mode"] == "lora" and report["steps"] == 4
    assert report["params_trainable"] / report["params_total"] < 0.05
    assert report["train_examples"] == 19 and report["val_examples"] == 9
    assert report["selected_by"] == "val cohen_kappa"
    assert {"val_balanced_accuracy", "val_cohen_kappa", "val_f1_weighted"} <= set(report)
    best = load_file(str(run / "checkpoints" / "best.safetensors"))
    assert any(".base_layer." in k for k in best)

    # the saved adapter on a freshly loaded base gives the predictions of the trained model
    from domainfm.finetune.supervised import LoraSettings, prepare_mode

    cfg = ft.Config(n_outputs=2, model=ft.ModelSection(name="cbramod-test", head_type="avgpooling_patch_reps"))
    trained, _ = ft.build_model(cfg, 4, 400, pretrained=str(weights))
    prepare_mode(trained, "lora", head="head", lora=LoraSettings(targets=LORA_TARGETS, rank=2, alpha=16.0))
    trained.load_state_dict(best)
    base, _ = ft.build_model(cfg, 4, 400, pretrained=str(weights))
    untouched = ft.build_model(cfg, 4, 400, pretrained=str(weights))[0].eval()
    reloaded = lora.load_adapter(base, run / "adapter")
    x = torch.randn(3, 4, 400)
    trained.eval(), reloaded.eval()
    with torch.no_grad():
        want, got = trained(x), reloaded(x)
        assert torch.equal(got, want)
        # and the adapter changed the backbone: same head, LoRA deltas removed -> other features
        untouched.head.load_state_dict(reloaded.head.state_dict())
        assert (untouched.forward_features(x) - reloaded.forward_features(x)).abs().max() > 1e-6
    # `domainfm evaluate` rebuilds the LoRA model from the run folder
    assert cli.main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["val_cohen_kappa"] == pytest.approx(report["val_cohen_kappa"], abs=1e-6)


def test_full_finetune_learns_the_synthetic_events(tmp_path):
    args = ["finetune", "cbramod", *_common(tmp_path), "train.max_epochs=6", "train.lr=5e-4",
            "train.head_lr=1e-3", "--runs-dir", str(tmp_path / "runs"), "--name", "full"]
    assert cli.main(args) == 0
    report = json.loads((tmp_path / "runs" / "cbramod" / "full" / "report.json").read_text())
    assert report["params_trainable"] == report["params_total"]
    assert report["val_balanced_accuracy"] >= 0.75  # channel-0 vs channel-3 10 Hz bursts


def test_pretrained_file_is_loaded_and_offline_default_says_so(tmp_path, monkeypatch, capsys):
    source, path = _official_file(tmp_path)
    cfg = ft.Config(n_outputs=2, model=ft.ModelSection(name="cbramod-test", pretrained=str(path)))
    model, init = ft.build_model(cfg, 4, 400, pretrained=str(path))
    assert init.startswith(f"pretrained: {path}")
    assert torch.equal(model.encoder.layers[1].linear1.weight, source.encoder.layers[1].linear1.weight)
    assert model.proj_out is None  # the reconstruction head is dropped for fine-tuning

    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    strict = ft.Config(n_outputs=2, model=ft.ModelSection(name="cbramod-base", pretrained=True))
    with pytest.raises(SystemExit, match="pretrained_fallback=error"):
        ft.build_model(strict, 4, 400, pretrained=True)
    fallback = ft.Config(n_outputs=2, model=ft.ModelSection(name="cbramod-test", pretrained=True,
                                                            pretrained_fallback="random"))
    model, init = ft.build_model(fallback, 4, 400, pretrained=True)
    assert init == "random"
    err = capsys.readouterr().err
    assert "cbramod-test has no pretrained weights" in err and "RANDOM initialisation" in err


def test_embedded_default_task_is_built_from_the_shipped_recording():
    train, val = ft.build_demo_task()
    assert train.x.shape == (19 * 12, 4, 800) and val.x.shape == (9 * 12, 4, 800)
    assert torch.bincount(train.y).tolist() == [76, 76, 76]
    assert torch.isfinite(train.x).all() and 0.05 < float(train.x.std()) < 2.0  # 100 µV units
    cfg_path = __import__("domainfm.config", fromlist=["config_path"]).config_path("cbramod", "finetune")
    text = cfg_path.read_text()
    assert "pretrained_fallback: random" in text and "CONSTRUCTED" in text
