"""FLOW, WiSE-FT and DaWin through Family.run on a toy family: a tiny MLP pretrained on task A,
fine-tuned on task B, whose retained capability is task-A accuracy through the pretext head kept
from pretraining. Checks the derived arms, the WiSE curve, per-arm retained values, the picture,
Family.evaluate on derived arms, and the configuration errors."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from domainfm import config as cfgmod
from domainfm import zoo
from domainfm.engine import Recipe, TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.lora.settings import LoraSettings

NAME = "robusttest-mlp"
D = 6


class ToyNet(nn.Module):
    def __init__(self, n_outputs: int = 3, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, n_outputs)
        self.n_outputs = n_outputs

    def forward_features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def _rule(seed: int, k: int) -> torch.Tensor:
    return torch.randn(D, k, generator=torch.Generator().manual_seed(seed))


def _data(n: int, seed: int, rule: torch.Tensor) -> TensorDataset:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ rule).argmax(-1))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The toy 'foundation model': pretrained on task A (3 classes); its pretext head is kept."""
    from domainfm import create_model, save_pretrained

    zoo.register_model(NAME, family="robusttest", overwrite=True, head="head", defaults={"n_outputs": 3},
                       paper="https://example.org/toy", license="MIT", input_spec={"features": D})(ToyNet)
    torch.manual_seed(0)
    model = create_model(NAME, n_outputs=3)
    data = _data(512, 1, _rule(11, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        F.cross_entropy(model(data.tensors[0]), data.tensors[1]).backward()
        opt.step()
    folder = save_pretrained(model, tmp_path_factory.mktemp("pre") / "model")
    yield str(folder), {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    zoo.unregister_model(NAME)


def _retained_fn(ctx):
    """Task-A accuracy of the arm's backbone through the pretext head from pretraining."""
    head = nn.Linear(16, 3)
    head.load_state_dict(ctx.task.extras["pretext_head"])
    x, y = ctx.task.extras["retained_data"].tensors
    model = ctx.model
    device = next(model.parameters()).device
    logits = head.to(device)(model.forward_features(x.to(device)))
    return {"acc_a": float((logits.argmax(-1).cpu() == y).float().mean())}


@dataclass
class ToyConfig(ExperimentConfig):
    task: str = "multiclass"
    model: ModelSection = field(default_factory=lambda: ModelSection(name=NAME))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        max_epochs=6, batch_size=32, lr=3e-2, weight_decay=0.0, progress=False, accelerator="cpu",
        precision="32-true"))


def _family(head_state, recipe=None) -> Family:
    def build_task(cfg):
        rule = _rule(22, 2)
        train, val, test = _data(192, 2, rule), _data(96, 3, rule), _data(96, 4, rule)
        extras = {"pretext_head": head_state, "retained_data": _data(128, 5, _rule(11, 3))}
        if cfg.task == "regression":
            train, val, test = [TensorDataset(d.tensors[0], (d.tensors[0] @ rule[:, 0]).float()) for d in (train, val, test)]
            return TaskData(train, val, test, task="regression", n_outputs=1, labels="synthetic: linear rule",
                            extras=extras)
        return TaskData(train, val, test, task="multiclass", n_outputs=2, labels="synthetic: argmax of a linear rule",
                        extras=extras)

    return Family("robusttoy", ToyConfig, data=build_task, model_kwargs=lambda cfg, task: {"n_outputs": task.n_outputs},
                  recipe=recipe, head="head", retained=Retained(_retained_fn, metric="acc_a", direction="max",
                                                                 description="task-A accuracy through the pretext head"))


def _cfg(folder, **adapt):
    return ToyConfig(model=ModelSection(name=NAME, pretrained=folder), adapt=AdaptSection(**adapt),
                     arms=adapt.pop("arms", None) or ["pretrained", "random"])


def test_flow_and_wise_arms_side_by_side(pretrained, tmp_path):
    folder, head = pretrained
    family = _family(head)
    cfg = ToyConfig(model=ModelSection(name=NAME, pretrained=folder),
                    adapt=AdaptSection(sample_weighting="flow", interpolation="wise", probe_epochs=3),
                    arms=["pretrained", "random"])
    report = family.run(cfg, tmp_path / "run")
    arms = report["arms"]
    alphas = ["0", "0.25", "0.5", "0.75", "1"]
    assert list(arms) == (["pretrained"] + [f"pretrained+wise@{a}" for a in alphas] + ["pretrained+flow"]
                          + [f"pretrained+flow+wise@{a}" for a in alphas] + ["random"])
    assert "random" in report["robust"]["skipped_arms"]["random"]
    # every arm, derived or not, carries target metrics and the retained capability
    recomputed = False
    for name, arm in arms.items():
        assert set(arm["val"]) >= {"cohen_kappa", "balanced_accuracy"} and "cohen_kappa" in arm["test"], name
        # recomputed independently from the arm's saved model where it saved one
        model_dir = tmp_path / "run" / name / "model"
        if model_dir.is_dir():
            from domainfm import create_model

            saved = create_model(model_dir).eval()
            x, y = _data(128, 5, _rule(11, 3)).tensors
            pretext = nn.Linear(16, 3)
            pretext.load_state_dict(head)
            with torch.no_grad():
                expected = float((pretext(saved.forward_features(x)).argmax(-1) == y).float().mean())
            assert arm["retained"]["acc_a"] == pytest.approx(expected, abs=1e-6), name
            recomputed = True
        assert round(arm["retained"]["acc_a"] * 128) == pytest.approx(arm["retained"]["acc_a"] * 128, abs=1e-6), name
    assert recomputed  # at least the fine-tuned arm saved its model
    # the endpoints: alpha 1 is the fine-tuned arm itself, alpha 0 the pretrained backbone
    for base in ("pretrained", "pretrained+flow"):
        assert arms[f"{base}+wise@1"]["val"] == arms[base]["val"]
        assert arms[f"{base}+wise@1"]["retained"] == arms[base]["retained"]
        assert arms[f"{base}+wise@0"]["retained"] == arms["pretrained"]["retained_before"]
        assert arms[f"{base}+wise@0.5"]["derived_from"] == base and arms[f"{base}+wise@0.5"]["alpha"] == 0.5
    # both fine-tuned arms start from the same probe: their alpha-0 models are the same
    assert arms["pretrained+wise@0"]["test"] == arms["pretrained+flow+wise@0"]["test"]
    # the WiSE curve: one entry per alpha with target metrics and retained capability
    curve = report["wise_curve"]["pretrained"]
    assert [p["alpha"] for p in curve] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all({"val", "test", "retained"} <= set(p) for p in curve)
    assert curve[2]["test"] == arms["pretrained+wise@0.5"]["test"]
    # FLOW: the weights are exp(-l/tau) with tau the median pretrained (probe) loss
    flow = arms["pretrained+flow"]["flow"]
    assert flow["temperature_rule"] == "median" and flow["temperature"] > 0
    assert flow["pretrained_loss"].startswith("linear probe")
    assert 0 < flow["weight_min"] < flow["weight_mean"] < flow["weight_max"] <= 1.0  # losses >= 0: w in (0, 1]
    assert arms["pretrained+flow"]["test"] != arms["pretrained"]["test"]  # a different training loss
    assert (tmp_path / "run" / "pretrained+flow" / "model").is_dir()
    assert (tmp_path / "run" / "pretrained" / "probe" / "metrics.jsonl").is_file()
    assert report["adapt"]["sample_weighting"] == "flow" and report["adapt"]["wise_alpha"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # the picture
    assert report["pictures"]["tradeoff"] == "tradeoff.png"
    png = (tmp_path / "run" / "tradeoff.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # evaluate: saved arms re-scored (the +flow arm too); interpolated arms named and skipped
    from domainfm.experiment import RunFolder

    RunFolder(tmp_path / "run").write_report(report)
    again = family.evaluate(cfg, tmp_path / "run")
    assert again["max_abs_diff_val"] < 1e-6
    assert set(again["arms"]["pretrained+flow"]) == {"val", "test"}
    assert "derived from 'pretrained' by wise" in again["arms"]["pretrained+wise@0.5"]["skipped"]


def test_dawin_and_wise_with_lora(pretrained, tmp_path):
    folder, head = pretrained
    family = _family(head)
    cfg = ToyConfig(model=ModelSection(name=NAME, pretrained=folder),
                    adapt=AdaptSection(mode="lora", lora=LoraSettings(targets=["body.0", "body.2"], rank=2, alpha=4.0),
                                       interpolation="wise+dawin", wise_alpha=[0.0, 0.5, 1.0], dawin_components=2,
                                       probe_epochs=2),
                    arms=["pretrained"])
    report = family.run(cfg, tmp_path / "run")
    arms = report["arms"]
    assert list(arms) == ["pretrained", "pretrained+wise@0", "pretrained+wise@0.5", "pretrained+wise@1",
                          "pretrained+dawin"]
    dawin = arms["pretrained+dawin"]
    assert {"cohen_kappa", "accuracy"} <= set(dawin["val"]) and "cohen_kappa" in dawin["test"]
    mixture = dawin["dawin"]["test"]
    assert sum(c["n"] for c in mixture["components"]) == 96
    assert all(0 < c["mean"] < 1 for c in mixture["components"])
    assert 0 < dawin["dawin"]["test"]["lambda_mean"] < 1
    assert dawin["retained_alpha"] == dawin["dawin"]["test"]["lambda_mean"] and "acc_a" in dawin["retained"]
    # scaling the adapters at alpha 1 = the merged, saved model (to float rounding)
    for key, value in arms["pretrained"]["val"].items():
        assert arms["pretrained+wise@1"]["val"][key] == pytest.approx(value, abs=1e-5)
    # alpha 0 = the pretrained backbone (no adapter contribution): what it retained before
    assert arms["pretrained+wise@0"]["retained"] == arms["pretrained"]["retained_before"]
    assert (tmp_path / "run" / "tradeoff.png").is_file()


def test_regression_flow_with_head_round_and_dawin_not_applicable(pretrained, tmp_path):
    folder, head = pretrained
    cfg = ToyConfig(task="regression", model=ModelSection(name=NAME, pretrained=folder),
                    adapt=AdaptSection(sample_weighting="flow", flow_head_epochs=1, interpolation="dawin",
                                       probe_epochs=1), arms=["pretrained"])
    cfg.train.max_epochs = 1
    report = _family(head).run(cfg, tmp_path / "run")
    arms = report["arms"]
    assert list(arms) == ["pretrained", "pretrained+dawin", "pretrained+flow", "pretrained+flow+dawin"]
    assert arms["pretrained+dawin"]["skipped"].startswith("not applicable: task 'regression'")
    assert "r2" in arms["pretrained+flow"]["test"]
    # the official second round: the head alone, plain loss, in its own folder
    assert arms["pretrained+flow"]["flow"]["head_epochs"] == 1
    assert (tmp_path / "run" / "pretrained+flow" / "flow_head" / "metrics.jsonl").is_file()
    assert "flow_head_epochs" in report["adapt"]


def test_flow_needs_per_sample_loss(pretrained, tmp_path):
    folder, head = pretrained

    class PlainRecipe(Recipe):
        def __init__(self, model, train, val):
            self.model, self.train_dataset, self.val_dataset = model, train, val

        def step(self, model, batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            return loss, {"loss": loss.detach()}

    family = _family(head, recipe=lambda cfg, model, task: PlainRecipe(model, task.train, task.val))
    cfg = ToyConfig(model=ModelSection(name=NAME, pretrained=folder), adapt=AdaptSection(sample_weighting="flow",
                                                                                          probe_epochs=1),
                    arms=["pretrained"], train=TrainConfig(max_epochs=1, batch_size=64, progress=False,
                                                           accelerator="cpu", precision="32-true",
                                                           monitor="val/loss", monitor_mode="min"))
    with pytest.raises(TypeError, match="family 'robusttoy'.*PlainRecipe.*per_sample_loss"):
        family.run(cfg, tmp_path / "run")


def test_unknown_methods_are_config_errors():
    with pytest.raises(ValueError, match="adapt.interpolation='soup'"):
        AdaptSection(interpolation="soup")
    with pytest.raises(cfgmod.ConfigError, match="adapt.*sample_weighting='focal'"):
        cfgmod.from_dict(ExperimentConfig, {"adapt": {"sample_weighting": "focal"}})
    with pytest.raises(ValueError, match="wise_alpha"):
        AdaptSection(interpolation="wise", wise_alpha=[0.5, 1.5])
    with pytest.raises(ValueError, match="flow_temperature"):
        AdaptSection(sample_weighting="flow", flow_temperature=0.0)
    # a single alpha from the command line is a one-point sweep
    cfg = cfgmod.from_dict(ExperimentConfig, cfgmod.apply_overrides({}, ["adapt.interpolation=wise", "adapt.wise_alpha=0.5"]))
    assert cfg.adapt.wise_alpha == [0.5] and cfg.adapt.interpolations == ["wise"]
    assert AdaptSection(interpolation="wise+dawin").interpolations == ["wise", "dawin"]


def test_fine_tuning_starts_from_the_probe_head(pretrained, tmp_path):
    """With a probe as the pretrained side, the fine-tuned arms start from it (LP-FT, as FLOW's
    official vision code loads the linear-probe checkpoint before fine-tuning and WiSE-FT starts
    from the zero-shot head), so the WiSE path connects two points of one fine-tuning run: the
    head the fine-tuning starts from is the trained probe (not the seed's random head), and it is
    exactly the alpha-0 model."""
    from sklearn.metrics import balanced_accuracy_score

    from domainfm import create_model

    folder, head = pretrained
    starts = {}

    def record(cfg, model, mode):
        starts.setdefault(mode, {k: v.detach().clone() for k, v in model.head.state_dict().items()})

    family = _family(head)
    family.prepare = record
    cfg = ToyConfig(model=ModelSection(name=NAME, pretrained=folder), arms=["pretrained"],
                    adapt=AdaptSection(interpolation="wise", wise_alpha=[0.0, 1.0], probe_epochs=3))
    arms = family.run(cfg, tmp_path / "run")["arms"]
    assert set(starts) == {"linear_probe", "full"}
    assert not torch.equal(starts["full"]["weight"], starts["linear_probe"]["weight"])
    model = create_model(folder, n_outputs=2).eval()
    model.head.load_state_dict(starts["full"])
    x, y = _data(96, 4, _rule(22, 2)).tensors
    with torch.no_grad():
        pred = model(x).argmax(-1)
    expected = balanced_accuracy_score(y.numpy(), pred.numpy())
    assert arms["pretrained+wise@0"]["test"]["balanced_accuracy"] == pytest.approx(expected, abs=1e-9)
    assert expected > 0.7  # the probe learned the task
