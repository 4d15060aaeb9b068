"""ExPLoRA fine-tuning on the experiment layer: the embedded default's stage + arms (each arm
starts from the weights it says), `domainfm evaluate` reproducing the report, learning above
the majority baseline, linear probing, weights through `resolve`, top-1/top-5."""
import json

import pytest
import torch
from rasterio.transform import from_origin
from safetensors.torch import load_file

from domainfm.cli import main
from domainfm.data_loaders import satellite as S
from domainfm.experiment import ModelSpec, WeightsUnavailable, resolve
from domainfm.finetune import explora as F

STAGE = ("stages=[{family: explora, config: pretrain, overrides: [export_init=true, train.max_steps=2, "
         "train.batch_size=4, data.stride=40, dino.n_prototypes=64, dino.hidden_dim=32, dino.bottleneck_dim=16, "
         "dino.n_local=1]}]")
FAST = ["train.max_epochs=1", "train.batch_size=64", "train.max_steps=3", "train.log_every_steps=1", STAGE]


def test_embedded_default_arms_start_from_the_stage_output_and_its_init(tmp_path):
    assert main(["finetune", "--runs-dir", str(tmp_path), "--name", "f", "explora", *FAST]) == 0
    run = tmp_path / "explora" / "f"
    report = json.loads((run / "report.json").read_text())
    stage = json.loads((run / "stages" / "0-explora" / "report.json").read_text())
    assert list(report["arms"]) == ["pretrained", "stage_init"] and stage["steps"] == 2 and stage["init"] == "random"
    assert report["labels"].startswith("constructed:") and "spectral indices" in report["labels"]
    # the data.retained_offset blocks neither train nor validate: the retained capability's tiles
    n_held = report["retained_before"]["n_tiles"]
    assert report["data"]["n_train"] + report["data"]["n_val"] + n_held == 26 * 26 and len(report["data"]["classes"]) == 4
    assert n_held == report["data"]["n_retained"] > 100
    for arm in ("pretrained", "stage_init"):
        assert 1 / 3 < report["arms"][arm]["retained"]["knn_accuracy"] <= 1
        assert report["arms"][arm]["pictures"]["class_map"] == f"{arm}/class_map.png"
        assert (run / arm / "class_map.png").is_file()
    pre, base = report["arms"]["pretrained"], report["arms"]["stage_init"]
    assert pre["init"].startswith(f"pretrained {stage['saved_model']}") and stage["saved_model"].endswith("backbone")
    assert base["init"].startswith(f"pretrained {stage['saved_init']}") and stage["saved_init"].endswith("init_backbone")
    # LoRA r8 on q,v of all 3 blocks + fc_norm + head: 3 * 2 * 8 * (48 + 48) + 2 * 48 + (48 * 4 + 4)
    assert report["params"]["trainable"] == 3 * 2 * 8 * 96 + 96 + 196
    # Each arm's model holds its starting weights where LoRA fine-tuning does not reach: the last
    # block's MLP (trained by the extended pretraining, frozen here) is the stage's output in one
    # arm and the stage's starting point in the other.
    key = "blocks.2.mlp.fc1.weight"
    exported = load_file(f"{stage['saved_model']}/model.safetensors")[key]
    start = load_file(f"{stage['saved_init']}/model.safetensors")[key]
    assert not torch.equal(exported, start)
    assert torch.equal(load_file(str(run / "pretrained" / "model" / "model.safetensors"))[key], exported)
    assert torch.equal(load_file(str(run / "stage_init" / "model" / "model.safetensors"))[key], start)
    # the reported validation figures are those of the selected step
    for arm in ("pretrained", "stage_init"):
        records = [json.loads(line) for line in (run / arm / "metrics.jsonl").read_text().splitlines()]
        at_best = [r for r in records if r.get("split") == "val" and r.get("step") == report["arms"][arm]["best_step"]]
        assert at_best and at_best[-1]["top1"] == report["arms"][arm]["val"]["top1"]
    # `domainfm evaluate` scores RUN/<arm>/model again and reproduces every validation metric
    assert main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["max_abs_diff_val"] <= 1e-6
    for arm in report["arms"]:
        assert evaluation["arms"][arm]["val"] == pytest.approx(report["arms"][arm]["val"], abs=1e-6)


def _image_folder(root, n_per_class=12):
    rng = torch.Generator().manual_seed(0)
    for c, cls in enumerate(("forest", "water")):
        for i in range(n_per_class):
            img = (torch.rand(3, 12, 12, generator=rng) * 1000 + 3000 * c).numpy().astype("uint16")
            S.write_geotiff(root / cls / f"{i}.tif", img, transform=from_origin(0, 0, 10, 10), crs="EPSG:32618")
    return ["stages=[]", "data.source=folder", f"data.path={root}", "data.n_bands=3", "data.mean=[2000,2000,2000]",
            "data.std=[1500,1500,1500]", "data.val_fraction=0.25", "train.batch_size=4"]


def test_full_finetuning_learns_an_easy_task_beyond_the_majority_baseline(tmp_path):
    args = _image_folder(tmp_path / "imgs")
    assert main(["finetune", "--runs-dir", str(tmp_path), "--name", "full", "explora", *args, "arms=[random]",
                 "adapt.mode=full", "train.max_epochs=4", "train.warmup_ratio=0.0"]) == 0
    report = json.loads((tmp_path / "explora" / "full" / "report.json").read_text())
    majority = report["data"]["majority_class_top1"]
    # 6 validation images; the class most frequent in training is right on at most 4 of them
    assert report["data"]["n_val"] == 6 and majority < 1.0
    assert report["labels"] == "recorded" and report["arms"]["random"]["init"].startswith("random")
    assert report["arms"]["random"]["val"]["top1"] == 1.0 > majority


def test_linear_probe_trains_only_the_head_and_evaluates_identically(tmp_path):
    args = _image_folder(tmp_path / "imgs", n_per_class=4)
    lp = ["finetune", "--runs-dir", str(tmp_path), "--name", "lp", "explora", *args, "arms=[random]",
          "adapt.mode=linear_probe", "train.max_epochs=2", "model.kwargs.global_pool=token"]
    assert main(lp) == 0
    run = tmp_path / "explora" / "lp"
    report = json.loads((run / "report.json").read_text())
    assert report["params"]["trainable"] == 48 * 2 + 2 and report["arms"]["random"]["mode"] == "linear_probe"
    assert main(["evaluate", str(run)]) == 0
    assert json.loads((run / "evaluation.json").read_text())["max_abs_diff_val"] <= 1e-6
    with pytest.raises(ValueError, match="has 3 bands, expected 4"):
        main(["--debug", *lp[:4], "lp2", *lp[5:], "data.n_bands=4"])


def test_weights_resolve_a_pretrain_backbone_with_norm_moved_to_fc_norm(tmp_path):
    from domainfm import create_model, save_pretrained

    torch.manual_seed(0)
    src = create_model("explora-test", n_outputs=0)
    torch.nn.init.normal_(src.norm.weight)  # not the LayerNorm default, so that the move is visible
    save_pretrained(src, tmp_path / "backbone")
    model_section = F.Config().model
    model, init = resolve(model_section.spec(str(tmp_path / "backbone"), n_outputs=4))
    assert str(init).startswith(f"pretrained {tmp_path / 'backbone'}")
    assert torch.equal(model.fc_norm.weight, src.norm.weight)
    assert torch.equal(model.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert model.head.out_features == 4
    with pytest.raises(Exception, match="missing.pth"):  # a named file never falls back to random
        resolve(model_section.spec(str(tmp_path / "missing.pth")))
    with pytest.raises(WeightsUnavailable, match="fallback=random"):  # no weight source registered
        resolve(ModelSpec("explora-test", True))
    model, init = resolve(ModelSpec("explora-test", True, fallback="random"))
    assert init.kind == "random" and "fallback" in str(init)


def test_classification_metrics_report_top5_only_beyond_five_classes():
    recipe = F.ClassificationRecipe(torch.nn.Linear(2, 2), [], None)
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])
    out = recipe.metrics({"scores": scores, "target": torch.tensor([0, 0]), "loss": torch.zeros(2)})
    assert out["top1"] == 0.5 and out["top5"] == 0.5
    out4 = recipe.metrics({"scores": scores[:, :4], "target": torch.tensor([3, 0]), "loss": torch.zeros(2)})
    assert out4["top1"] == 1.0 and "top5" not in out4


def test_per_sample_loss_is_the_unreduced_training_loss():
    """FLOW weights ClassificationRecipe.per_sample_loss: its mean is the step's loss (with label
    smoothing), and each entry is that sample's own smoothed cross-entropy."""
    from domainfm import create_model

    torch.manual_seed(0)
    model = create_model("explora-test", n_outputs=4, global_pool="avg").eval()  # eval: no drop path
    recipe = F.ClassificationRecipe(model, [], None, task="multiclass", label_smoothing=0.1)
    x, y = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 3, 1, 0])
    with torch.no_grad():
        per_sample = recipe.per_sample_loss(model, (x, y))
        loss, _ = recipe.step(model, (x, y))
        logp = model(x).log_softmax(-1)
    assert per_sample.shape == (6,)
    torch.testing.assert_close(per_sample.mean(), loss, rtol=0, atol=1e-6)
    manual = -(0.9 * logp[torch.arange(6), y] + 0.1 * logp.mean(-1))
    torch.testing.assert_close(per_sample, manual, rtol=0, atol=1e-5)
