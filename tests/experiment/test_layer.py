"""The experiment layer's pieces: weights resolution and its fallback rule, config validation,
seed aggregation and the per-arm table, the run folder, and Trainer.fit returning the best model."""
from __future__ import annotations

import json
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from domainfm import config as cfgmod
from domainfm.engine import Recipe, TrainConfig, Trainer
from domainfm.experiment import (AdaptSection, ExperimentConfig, ModelSection, ModelSpec, StageSection, RunFolder, RunFolderError,
                                 WeightsUnavailable, aggregate_seeds, format_table, resolve, to_markdown)

KW = dict(n_chans=2, n_times=400, n_outputs=2, reconstruction_head=False)


def test_resolve_random_and_card_fallback_rules(tmp_path, capsys):
    model, init = resolve(ModelSpec("cbramod-test", None, "error", KW))
    assert init.kind == "random" and str(init) == "random (no pretrained weights requested)"
    assert model.n_outputs == 2
    # cbramod-test registers no weight source: an error unless the random fallback is asked for
    with pytest.raises(WeightsUnavailable, match="cbramod-test has no registered weight source"):
        resolve(ModelSpec("cbramod-test", True, "error", KW))
    _, init = resolve(ModelSpec("cbramod-test", True, "random", KW))
    assert init.kind == "random" and "fallback" in init.reason
    assert "RANDOM initialisation" in capsys.readouterr().err
    # a path the user named that does not exist is never replaced by random init
    with pytest.raises(FileNotFoundError):
        resolve(ModelSpec("cbramod-test", str(tmp_path / "missing.pth"), "random", KW))


def test_resolve_loads_a_saved_folder_and_says_so(tmp_path):
    from domainfm import create_model, save_pretrained

    torch.manual_seed(3)
    source = create_model("cbramod-test", **KW)
    save_pretrained(source, tmp_path / "m")
    model, init = resolve(ModelSpec("cbramod-test", str(tmp_path / "m"), "error", {**KW, "n_outputs": 3}))
    assert init.kind == "pretrained" and str(tmp_path / "m") in str(init)
    # backbone weights equal, the resized head re-initialised
    torch.testing.assert_close(model.encoder.layers[0].linear1.weight, source.encoder.layers[0].linear1.weight)
    assert model.n_outputs == 3


def test_string_booleans_and_bad_arms_are_config_errors():
    with pytest.raises(ValueError, match="without quotes"):
        ModelSpec("cbramod-test", "true")
    with pytest.raises(ValueError, match="expected one of"):
        ExperimentConfig(arms=["pretrained", "scratch"])
    with pytest.raises(ValueError, match="needs a stage"):
        ExperimentConfig(arms=["stage_init"])
    with pytest.raises(ValueError, match=r"stages=\[\]"):
        ExperimentConfig(model=ModelSection(name="x", pretrained=True), stages=[StageSection("cbramod")])
    with pytest.raises(ValueError, match="twice"):
        ExperimentConfig(arms=["random", "random"])
    with pytest.raises(ValueError, match="adapt.mode"):
        AdaptSection(mode="frozen")
    assert ExperimentConfig(arms=["pretrained:linear_probe", "random"]).arms[0] == "pretrained:linear_probe"


def test_config_sections_are_strict():
    with pytest.raises(cfgmod.ConfigError, match="adapt.lora.rnak"):
        cfgmod.from_dict(ExperimentConfig, {"adapt": {"lora": {"rnak": 2}}})
    with pytest.raises(cfgmod.ConfigError, match="model.fallback"):
        cfgmod.from_dict(ExperimentConfig, {"model": {"name": "x", "fallback": "maybe"}})


def test_aggregate_seeds_mean_std_and_table():
    runs = [{"init": "random", "seed": s, "best_step": 3, "val": {"acc": a}, "test": {"acc": t}}
            for s, a, t in ((0, 0.5, 0.4), (1, 0.7, 0.6), (2, 0.9, 0.5))]
    arm = aggregate_seeds(runs)
    assert arm["val"]["acc"] == pytest.approx(0.7) and arm["val_std"]["acc"] == pytest.approx(np.std([0.5, 0.7, 0.9], ddof=1))
    assert arm["test"]["acc"] == pytest.approx(0.5) and arm["seeds"] == runs and arm["best_step"] == 3
    assert aggregate_seeds(runs[:1]) == runs[0]
    report = {"family": "toy", "arms": {"pretrained": arm, "random": runs[0]}}
    table = format_table(report)
    header, _, *rows = table.splitlines()
    assert header.split() == ["metric", "pretrained", "random"]
    val = next(r for r in rows if r.startswith("val.acc"))
    assert "0.7000 ± 0.2000" in val and val.rstrip().endswith("0.5000")
    assert "| metric | pretrained | random |" in to_markdown(report)


def test_run_folder_refuses_a_used_name_and_clears_dead_temps(tmp_path):
    folder = RunFolder.create(tmp_path / "run")
    folder.write_report({"family": "toy", "arms": {}})
    with pytest.raises(RunFolderError, match="already holds a run.*train.resume=true"):
        RunFolder.create(tmp_path / "run")
    stale = tmp_path / "run" / "checkpoints" / ".last.ckpt.tmp-999999999-0"
    stale.parent.mkdir()
    stale.write_bytes(b"half")
    RunFolder.create(tmp_path / "run", resume=True)
    assert not stale.exists() and json.loads(folder.report_file.read_text())["family"] == "toy"
    assert folder.arm_dir("pretrained:lora", 3) == tmp_path / "run" / "pretrained-lora" / "seed3"


class _Toy(Recipe):
    def __init__(self, model, data, val):
        self.model, self.train_dataset, self.val_dataset = model, data, val

    def step(self, model, batch):
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        x, y = batch
        return {"correct": (model(x).argmax(-1) == y).float()}

    def metrics(self, outputs):
        # a metric that is best early: the selected step must not be the last one
        return {"score": float(outputs["correct"].mean())}


def test_fit_returns_the_model_at_its_best_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()
    val_x = torch.randn(32, 4, generator=g)
    # inverted validation labels: the score falls as the model learns, so the best step is an early one
    val = torch.utils.data.TensorDataset(val_x, (val_x[:, 0] <= 0).long())
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    cfg = TrainConfig(max_epochs=6, batch_size=16, lr=0.05, progress=False, monitor="val/score", monitor_mode="max",
                      weight_decay=0.0)
    result = Trainer(cfg, run_dir=tmp_path).fit(_Toy(model, torch.utils.data.TensorDataset(x, y), val))
    vals = [r for r in result.history if r.get("split") == "val"]
    best = max(vals, key=lambda r: r["score"])
    assert result.best_step == best["step"] and result.best_val["score"] == best["score"]
    assert result.best_step < vals[-1]["step"] and best["score"] > vals[-1]["score"]
    saved = load_file(str(tmp_path / "checkpoints" / "best.safetensors"))
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    assert result.model is model and torch.equal(model.weight, saved["weight"])
    assert not torch.equal(model.weight, last["weight"])  # the last epoch's weights were not returned


def test_a_failed_write_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    from domainfm.atomic import atomic_torch_save

    def refuse(obj, f, *a, **k):  # what torch reports for a read-only or full checkpoints/ folder
        raise RuntimeError("[enforce fail at inline_container.cc:747] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", refuse)
    target = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(OSError, match=f"cannot write {target}"):
        atomic_torch_save({"a": 1}, target)
    assert list(target.parent.iterdir()) == []
