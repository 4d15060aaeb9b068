"""ExPLoRA fine-tuning through the CLI: LoRA run on the test-sized variant (from an extended
pretraining run, beside the no-extended-pretraining baseline), linear probe, evaluate, errors."""
import json

import pytest
import torch
from rasterio.transform import from_origin

from domainfm import lora
from domainfm.cli import main
from domainfm.data_loaders import satellite as S
from domainfm.finetune import explora as F

FAST = ["train.max_epochs=1", "train.batch_size=64", "train.max_steps=2",
        "extended_pretraining.overrides=[train.max_steps=2,train.batch_size=4,data.stride=40,dino.n_prototypes=64,"
        "dino.hidden_dim=32,dino.bottleneck_dim=16,dino.n_local=1]"]


def test_cli_lora_finetune_after_extended_pretraining_with_baseline(tmp_path):
    assert main(["finetune", "--runs-dir", str(tmp_path), "--name", "f", "explora", *FAST]) == 0
    run = tmp_path / "explora" / "f"
    report = json.loads((run / "report.json").read_text())
    assert report["init"].startswith("random + ExPLoRA extended pretraining (2 steps)")
    assert report["pretrain_init"] == "random" and "spectral indices" in report["labels"]
    assert report["n_classes"] == 4 and report["n_train"] + report["n_val"] == 26 * 26
    for key in ("top1", "baseline_top1", "balanced_accuracy", "majority_class_top1"):
        assert 0.0 <= report[key] <= 1.0
    assert -1.0 <= report["cohen_kappa"] <= 1.0
    assert report["top1_gain_from_extended_pretraining"] == pytest.approx(report["top1"] - report["baseline_top1"])
    # LoRA r8 on q,v of all 3 blocks + fc_norm + head: 3 * 2 * 8 * (48 + 48) + 2 * 48 + (48 * 4 + 4)
    assert report["params_trainable"] == 3 * 2 * 8 * 96 + 96 + 196
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "val" and "top1" in r for r in records)
    assert (run / "without_extended_pretraining" / "metrics.jsonl").is_file()
    # the fine-tune arm started from the exported ExPLoRA backbone, the baseline from its init
    exported = (run / "extended_pretraining" / "backbone" / "model.safetensors").stat().st_size
    assert exported > 0 and (run / "extended_pretraining" / "init_backbone" / "model.safetensors").is_file()
    # `domainfm evaluate` reproduces the selected checkpoint's top-1
    assert main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["top1"] == pytest.approx(report["top1"], abs=1e-6)


def test_loading_a_pretrain_backbone_moves_norm_to_fc_norm(tmp_path):
    from domainfm import create_model, save_pretrained

    torch.manual_seed(0)
    src = create_model("explora-test", n_outputs=0)
    save_pretrained(src, tmp_path / "backbone")
    cfg = F.Config()
    model, init = F.build_model(cfg, 4, str(tmp_path / "backbone"))
    assert init == f"pretrained: {tmp_path / 'backbone'}"
    assert torch.equal(model.fc_norm.weight, src.norm.weight) and torch.equal(model.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    with pytest.raises(Exception, match="pretrained_fallback=random"):
        F.build_model(cfg, 4, str(tmp_path / "missing.pth"))
    cfg.model.pretrained_fallback = "random"
    _, init = F.build_model(cfg, 4, str(tmp_path / "missing.pth"))
    assert init == "random"


def test_linear_probe_on_image_folder_trains_only_the_head(tmp_path):
    rng = torch.Generator().manual_seed(0)
    for c, cls in enumerate(("forest", "water")):
        for i in range(6):
            img = (torch.rand(3, 12, 12, generator=rng) * 1000 + 3000 * c).numpy().astype("uint16")
            S.write_geotiff(tmp_path / "imgs" / cls / f"{i}.tif", img, transform=from_origin(0, 0, 10, 10), crs="EPSG:32618")
    args = ["finetune", "--runs-dir", str(tmp_path), "--name", "lp", "explora", "mode=linear_probe",
            "extended_pretraining.enabled=false", "data.source=folder", f"data.path={tmp_path / 'imgs'}",
            "data.n_bands=3", "data.mean=[2000,2000,2000]", "data.std=[1500,1500,1500]", "data.val_fraction=0.25",
            "train.max_epochs=3", "train.batch_size=4", "model.global_pool=token"]
    assert main(args) == 0
    report = json.loads((tmp_path / "explora" / "lp" / "report.json").read_text())
    assert report["init"] == "random" and report["n_classes"] == 2 and report["n_val"] == 3
    assert report["params_trainable"] == 48 * 2 + 2
    assert "labels" not in report
    with pytest.raises(ValueError, match="has 3 bands, expected 4"):
        main([*args[:4], "lp2", *args[5:], "data.n_bands=4"])


def test_classification_metrics_report_top5_only_beyond_five_classes():
    recipe = F.ClassificationRecipe(torch.nn.Linear(2, 2), [], None)
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], [0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])
    out = recipe.metrics({"scores": scores, "target": torch.tensor([0, 0]), "loss": torch.zeros(2)})
    assert out["top1"] == 0.5 and out["top5"] == 0.5
    out4 = recipe.metrics({"scores": scores[:, :4], "target": torch.tensor([3, 0]), "loss": torch.zeros(2)})
    assert out4["top1"] == 1.0 and "top5" not in out4
