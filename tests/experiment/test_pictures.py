"""Pictures of a run: a toy family (tiny MLP, synthetic data) through ``Family.run`` and
``RunFolder.write_report``; every picture the report lists is a valid, non-blank PNG in the run
folder and ``report.md`` embeds it; runs without a test set or without training still succeed."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ExperimentConfig, Family, ModelSection, RunFolder, TaskData
from domainfm.experiment import pictures

import matplotlib.image as mpimg  # noqa: E402


def _data(task: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(99))
    if task == "binary":
        return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).float())
    return TensorDataset(x, (x @ w).argmax(-1))


def _family(task: str, *, test: bool = True, info=None) -> Family:
    k = 1 if task == "binary" else 3

    def build(cfg):
        return TaskData(_data(task, 96, 0), _data(task, 48, 1), _data(task, 40, 2) if test else None, task=task,
                        n_outputs=k, labels="synthetic: a linear rule of Gaussian inputs", info=dict(info or {}))

    return Family("picturestoy", ExperimentConfig, data=build,
                  model_kwargs=lambda cfg, t: {"n_chans": 4, "n_outputs": t.n_outputs, "hidden": 8})


def _cfg(arms, *, seeds=(0,), mode="full"):
    return ExperimentConfig(model=ModelSection(name="dfmtest-tiny"), adapt=AdaptSection(mode=mode, seeds=list(seeds)),
                            arms=list(arms), train=TrainConfig(max_epochs=3, batch_size=16, lr=3e-2, progress=False,
                                                               log_every_steps=2, precision="32-true"))


def _run(family, cfg, path):
    folder = RunFolder.create(path)
    report = family.run(cfg, folder.path)
    folder.write_report(report)
    try:
        return report, json.loads(folder.report_file.read_text()), (folder.path / "report.md").read_text()
    finally:
        folder.release()


def _check_png(path):
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = mpimg.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    rgb = image[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.01 and len(np.unique(rgb, axis=0)) > 10, f"{path} is blank"


def _all_pictures(report):
    out = dict(report.get("pictures", {}))
    for arm, result in report["arms"].items():
        out.update({f"{arm}/{k}": v for k, v in result.get("pictures", {}).items()})
    return out


def _spy(monkeypatch, name):
    """Record the arguments of pictures.<name> (then draw as usual)."""
    calls, real = [], getattr(pictures, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pictures, name, wrapper)
    return calls


def test_multiclass_run_draws_curves_and_confusion_matrices(tmp_path, tiny_zoo, monkeypatch):
    drawn = _spy(monkeypatch, "confusion_matrix_picture")
    family = _family("multiclass", info={"classes": ["alpha", "beta", "gamma"]})
    report, saved, markdown = _run(family, _cfg(["pretrained", "random:linear_probe"]), tmp_path / "run")
    # each matrix is of the arm's selected model on the test set: its accuracy is the report's
    assert len(drawn) == 2
    for (y_true, y_pred, names, _), arm in zip(drawn, ("pretrained", "random:linear_probe")):
        assert names == ["alpha", "beta", "gamma"] and len(y_true) == 40
        assert np.mean(y_true == y_pred) == pytest.approx(saved["arms"][arm]["test"]["accuracy"], abs=1e-6)
    assert saved["pictures"] == {"learning_curves": "learning_curves.png"}
    assert saved["arms"]["pretrained"]["pictures"] == {"learning_curve": "pretrained/learning_curve.png",
                                                       "confusion_matrix": "pretrained/confusion_matrix.png"}
    assert saved["arms"]["random:linear_probe"]["pictures"] == {
        "learning_curve": "random-linear_probe/learning_curve.png",
        "confusion_matrix": "random-linear_probe/confusion_matrix.png"}
    for name, rel in _all_pictures(saved).items():
        _check_png(tmp_path / "run" / rel)
        assert f"]({rel})" in markdown, name
    # report.md: the comparison table (one column per arm), then the pictures
    assert "| metric | pretrained | random:linear_probe |" in markdown
    assert markdown.index("| metric |") < markdown.index("## Pictures")
    assert "![learning_curves](learning_curves.png)" in markdown
    assert "### arm random:linear_probe" in markdown


def test_binary_run_over_two_seeds_adds_roc_curves(tmp_path, tiny_zoo, monkeypatch):
    from sklearn.metrics import roc_auc_score

    drawn = _spy(monkeypatch, "roc_picture")
    report, saved, markdown = _run(_family("binary"), _cfg(["pretrained", "random"], seeds=(0, 1)), tmp_path / "run")
    # one ROC per arm and seed, on the test set, with the AUROC the report has for that seed
    assert len(drawn) == 4
    per_seed = [saved["arms"][arm]["seeds"][k]["test"]["roc_auc"] for arm in ("pretrained", "random") for k in (0, 1)]
    for (y_true, prob, _), expected in zip(drawn, per_seed):
        assert len(y_true) == 40 and roc_auc_score(y_true, prob) == pytest.approx(expected, abs=1e-6)
    for arm in ("pretrained", "random"):
        pics = saved["arms"][arm]["pictures"]  # the first seed's, in its own folder
        assert pics == {"learning_curve": f"{arm}/seed0/learning_curve.png",
                        "confusion_matrix": f"{arm}/seed0/confusion_matrix.png", "roc_curve": f"{arm}/seed0/roc_curve.png"}
        assert saved["arms"][arm]["seeds"][1]["pictures"]["roc_curve"] == f"{arm}/seed1/roc_curve.png"
    assert set(saved["pictures"]) == {"learning_curves"}
    for rel in _all_pictures(saved).values():
        _check_png(tmp_path / "run" / rel)
        assert f"]({rel})" in markdown


def test_without_test_set_or_training_the_run_still_succeeds(tmp_path, tiny_zoo):
    # no training (adapt.mode none): no learning curve; no test set: the matrix is drawn on validation
    report, saved, markdown = _run(_family("multiclass", test=False), _cfg(["pretrained"], mode="none"),
                                   tmp_path / "run")
    assert saved["arms"]["pretrained"]["pictures"] == {"confusion_matrix": "pretrained/confusion_matrix.png"}
    assert "pictures" not in saved  # one arm, nothing trained: no overlay
    _check_png(tmp_path / "run" / "pretrained" / "confusion_matrix.png")
    assert "![confusion_matrix](pretrained/confusion_matrix.png)" in markdown
    assert not (tmp_path / "run" / "pretrained" / "learning_curve.png").exists()


def test_scores_come_from_the_recipe_and_the_matrix_from_them(tmp_path, tiny_zoo):
    """predict_scores is the recipe's eval_step over the dataset: equal to the model's own
    softmax-free logits, in dataset order."""
    from domainfm import create_model
    from domainfm.experiment.family import ArmContext
    from domainfm.experiment.supervised import SupervisedRecipe

    torch.manual_seed(0)
    model = create_model("dfmtest-tiny", n_chans=4, n_outputs=3).eval()
    test = _data("multiclass", 37, 5)
    task = TaskData(None, None, test, task="multiclass", n_outputs=3)
    recipe = SupervisedRecipe(model, None, None, task="multiclass")
    cfg = _cfg(["pretrained"])
    ctx = ArmContext(cfg, "pretrained", 0, model, task, tmp_path / "pretrained", None, "none", recipe=recipe)
    scores, target = pictures.predict_scores(ctx, test)
    with torch.no_grad():
        expected = model(test.tensors[0]).numpy()
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-6)
    assert np.array_equal(target, test.tensors[1].numpy())
    out = pictures.arm_pictures(ctx)
    assert out == {"pictures": {"confusion_matrix": "pretrained/confusion_matrix.png"}}
    _check_png(tmp_path / "pretrained" / "confusion_matrix.png")

    # a picture whose drawing fails is left out with a warning naming it; the run goes on
    def broken(model, batch):
        raise RuntimeError("no forward today")

    recipe.eval_step = broken
    with pytest.warns(RuntimeWarning, match="confusion_matrix.*no forward today"):
        assert pictures.arm_pictures(ctx) == {}


def test_run_pictures_keeps_pictures_from_others_and_skips_what_it_cannot_draw(tmp_path):
    report = {"family": "x", "monitor": "val/accuracy", "pictures": {"tradeoff": "tradeoff.png"},
              "arms": {"a": {"best_step": 2}, "b": {}}, "adapt": {"seeds": [0]}}
    assert pictures.run_pictures(report, tmp_path) == {"pictures": {"tradeoff": "tradeoff.png"}}  # no metrics.jsonl
    for arm, shift in (("a", 0.0), ("b", 0.2)):
        (tmp_path / arm).mkdir()
        lines = [{"split": "train", "step": s, "epoch": 0, "loss": 1.0 / s + shift} for s in (1, 2, 3)]
        lines += [{"split": "val", "step": s, "epoch": s, "accuracy": 0.5 + 0.1 * s - shift} for s in (1, 2, 3)]
        text = "\n".join(json.dumps(r) for r in lines) + "\n{\"split\": \"train\", \"st"  # a cut last line
        (tmp_path / arm / "metrics.jsonl").write_text(text)
    out = pictures.run_pictures(report, tmp_path)
    assert out == {"pictures": {"tradeoff": "tradeoff.png", "learning_curves": "learning_curves.png"}}
    _check_png(tmp_path / "learning_curves.png")
    train, val = pictures.read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3] and [r["accuracy"] for r in val] == pytest.approx([0.6, 0.7, 0.8])
