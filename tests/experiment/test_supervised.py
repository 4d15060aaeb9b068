import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from domainfm import lora
from domainfm.engine import TrainConfig, Trainer
from domainfm.experiment import metrics as M
from domainfm.experiment.supervised import LoraSettings, SupervisedRecipe, prepare_mode

sys.path.insert(0, str(Path(__file__).parents[1]))
from _engine_toys import TinyNet, make_dataset  # noqa: E402


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_modes_select_trainable_parameters():
    model = prepare_mode(TinyNet(), "linear_probe")
    assert _trainable(model) == {"head.weight", "head.bias"}
    model = prepare_mode(model, "full")
    assert _trainable(model) == {n for n, _ in model.named_parameters()}
    model = prepare_mode(TinyNet(), "lora", lora=LoraSettings(targets=["blocks.0.0"], rank=2))
    assert _trainable(model) == {"blocks.0.0.lora_A.weight", "blocks.0.0.lora_B.weight", "head.weight", "head.bias"}
    assert lora.count_trainable(model) == 2 * (8 + 32) + 32 * 3 + 3
    with pytest.raises(ValueError, match="lora.targets"):
        prepare_mode(TinyNet(), "lora", lora=LoraSettings())
    with pytest.raises(ValueError, match="mode="):
        prepare_mode(TinyNet(), "adapter")


def test_multiclass_recipe_metrics_match_direct_computation():
    torch.manual_seed(0)
    model = TinyNet()
    val = make_dataset(n=50, seed=3)
    recipe = SupervisedRecipe(model, make_dataset(), val, task="multiclass", label_smoothing=0.1)
    trainer = Trainer(TrainConfig(max_epochs=4, batch_size=16, lr=1e-2, progress=False, accelerator="cpu"))
    trainer.fit(recipe)
    result = trainer.evaluate(recipe)
    model.eval()
    with torch.no_grad():
        logits = model(val.tensors[0])
    expected = M.compute("multiclass", val.tensors[1], logits)
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-6)
    assert result["cohen_kappa"] > 0.7
    smoothed = torch.nn.functional.cross_entropy(logits, val.tensors[1], label_smoothing=0.1)
    assert result["loss"] == pytest.approx(float(smoothed), rel=0.05)  # per-batch mean of batch means


def test_binary_and_regression_recipes():
    torch.manual_seed(0)
    x = torch.randn(200, 8)
    w = torch.randn(8)
    for task, y in (("binary", (x @ w > 0).long()), ("regression", x @ w)):
        model = TinyNet(k=1, dropout=0.0)
        ds = TensorDataset(x, y)
        recipe = SupervisedRecipe(model, ds, ds, task=task)
        trainer = Trainer(TrainConfig(max_epochs=15, batch_size=20, lr=1e-2, progress=False, accelerator="cpu"))
        trainer.fit(recipe)
        out = trainer.evaluate(recipe)
        if task == "binary":
            assert set(out) == {"balanced_accuracy", "pr_auc", "roc_auc", "accuracy", "loss"}
            assert out["roc_auc"] > 0.95
        else:
            assert set(out) == {"pearson_r", "r2", "rmse", "mae", "loss"}
            assert out["r2"] > 0.8


class _NormNet(torch.nn.Module):
    """A backbone with BatchNorm and dropout, and a head with its own dropout."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(),
                                            torch.nn.Dropout(0.5))
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.head(self.backbone(x))


def test_linear_probe_keeps_the_frozen_backbone_in_eval_mode():
    """A linear probe's backbone is frozen *including* its statistics: training the head must not
    move BatchNorm's running mean/var, and backbone dropout is off (features as at inference);
    the head's own dropout still trains."""
    import copy

    torch.manual_seed(0)
    model = _NormNet()
    before = copy.deepcopy(model.state_dict())
    prepare_mode(model, "linear_probe")
    ds = make_dataset(n=96, seed=1)
    ds = TensorDataset(ds.tensors[0] * 3 + 1, ds.tensors[1])  # batch statistics far from the running ones
    trainer = Trainer(TrainConfig(max_epochs=2, batch_size=16, lr=1e-2, progress=False, accelerator="cpu"))
    trainer.fit(SupervisedRecipe(model, ds, None, task="multiclass"))
    after = model.state_dict()
    for key in before:
        if key.startswith("backbone."):
            assert torch.equal(before[key], after[key]), key
    assert not torch.equal(before["head.1.weight"], after["head.1.weight"])
    model.train()
    assert not model.backbone.training and not model.backbone[1].training and not model.backbone[3].training
    assert model.training and model.head.training and model.head[0].training
    # a deep copy (the experiment layer's probe is one) keeps the rule, bound to the copy
    clone = copy.deepcopy(model)
    clone.train()
    assert not clone.backbone[1].training and clone.head[0].training
    # full fine-tuning afterwards trains the statistics again
    prepare_mode(model, "full")
    model.train()
    assert model.backbone[1].training
