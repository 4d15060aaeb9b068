"""A finished experiment keeps each arm's selected model, not its training checkpoints."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from domainfm import cli, create_model

FAST = ["model.name=git-test", "model.pretrained=null", "data.dataset=karate", "train.monitor=val/accuracy",
        "arms=[random]", "adapt.seeds=[0, 1]", "train.max_epochs=2", "train.batch_size=16",
        "protocols.in_context=false", "retained.n_episodes=2"]


def _run(tmp_path, name, *extra):
    assert cli.main(["finetune", "git", *FAST, *extra, "--runs-dir", str(tmp_path), "--name", name]) == 0
    return tmp_path / "git" / name


def test_finished_run_keeps_the_selected_model_and_drops_checkpoints(tmp_path, capsys):
    kept = _run(tmp_path, "kept", "keep_checkpoints=true")
    pruned = _run(tmp_path, "pruned")
    assert "removed" in capsys.readouterr().err
    # with keep_checkpoints both seeds' checkpoints are there; the best one is the saved model
    for seed in ("seed0", "seed1"):
        assert {p.name for p in (kept / "random" / seed / "checkpoints").iterdir()} == {"last.ckpt", "best.safetensors"}
    best = load_file(str(kept / "random" / "seed0" / "checkpoints" / "best.safetensors"))
    model = load_file(str(kept / "random" / "model" / "model.safetensors"))
    assert all(torch.equal(best[k], model[k]) for k in model)
    # pruned: no checkpoints anywhere below the arms, the model folder intact and loadable
    assert not list(pruned.rglob("checkpoints")) and not list(pruned.rglob("*.ckpt"))
    again = load_file(str(pruned / "random" / "model" / "model.safetensors"))
    assert again.keys() == model.keys() and all(torch.equal(again[k], model[k]) for k in model)
    create_model(pruned / "random" / "model")
    report = json.loads((pruned / "report.json").read_text())
    assert report["arms"]["random"]["model_dir"] == str(pruned / "random" / "model")
