"""ExPLoRA pretraining: DINO / iBOT / KoLeo against hand computations, centring and schedules,
EMA teacher isolation, and CLI runs of both objectives on test-sized models."""
import copy
import json
import math

import pytest
import torch

from domainfm import create_model, lora
from domainfm.cli import main
from domainfm.engine import TrainConfig
from domainfm.pretrain import explora as E
from domainfm.pretrain.explora import dino as explora_dino
from domainfm.pretrain.explora import mae as explora_mae


def _ce(p, logits, temp):
    """-sum_k p_k log softmax(logits / temp)_k, by hand."""
    z = [v / temp for v in logits]
    m = max(z)
    log_norm = m + math.log(sum(math.exp(v - m) for v in z))
    return -sum(pk * (zk - log_norm) for pk, zk in zip(p, z))


def test_dino_loss_equals_hand_computation():
    g = torch.Generator().manual_seed(0)
    s = [torch.randn(2, 3, generator=g) for _ in range(3)]  # global A, global B, one local
    t = [torch.softmax(torch.randn(2, 3, generator=g), -1) for _ in range(2)]
    got = E.dino_loss(s, t, student_temp=0.1, n_global=2)
    pairs = [(0, 1), (1, 0), (2, 0), (2, 1)]  # a global crop never meets its own teacher view
    expected = sum(sum(_ce(t[j][b].tolist(), s[i][b].tolist(), 0.1) for b in range(2)) / 2 for i, j in pairs) / 4
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_ibot_loss_equals_hand_computation():
    g = torch.Generator().manual_seed(1)
    masks = torch.tensor([[True, False, True, True], [False, False, False, False], [False, True, False, False]])
    n = int(masks.sum())
    s = torch.randn(n, 5, generator=g)
    t = torch.softmax(torch.randn(n, 5, generator=g), -1)
    got = E.ibot_loss(s, t, masks, student_temp=0.1)
    # crop 0: mean of its 3 patches; crop 1: nothing; crop 2: its one patch; divided by all 3 crops
    ce = [_ce(t[i].tolist(), s[i].tolist(), 0.1) for i in range(n)]
    expected = (sum(ce[:3]) / 3 + ce[3]) / 3
    assert float(got) == pytest.approx(expected, rel=1e-5)
    empty = E.ibot_loss(torch.zeros(0, 5, requires_grad=True), torch.zeros(0, 5), torch.zeros(2, 4, dtype=torch.bool), 0.1)
    assert float(empty.detach()) == 0.0


def test_koleo_loss_equals_hand_computation():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])  # normalised: e1, e2, (1,1)/sqrt2
    d_12 = math.sqrt(2.0)
    d_13 = math.sqrt((1 - 2 ** -0.5) ** 2 + 0.5)  # e1 <-> diagonal
    expected = -(math.log(d_13) + math.log(d_13) + math.log(d_13)) / 3  # every point's nearest involves the diagonal
    assert d_13 < d_12
    assert float(E.koleo_loss(x)) == pytest.approx(expected, rel=1e-5)


def test_centring_and_teacher_softmax():
    center = torch.zeros(1, 3)
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    p = E.teacher_probs(logits, center, 0.5)
    torch.testing.assert_close(p, torch.softmax(logits / 0.5, -1))
    E.update_center(center, logits, momentum=0.9)
    torch.testing.assert_close(center, torch.full((1, 3), 0.1 * 2.0))
    E.update_center(center, torch.tensor([[4.0, 0.0, 0.0]]), momentum=0.9)
    torch.testing.assert_close(center, torch.tensor([[0.9 * 0.2 + 0.4, 0.18, 0.18]]))
    p2 = E.teacher_probs(logits, center, 0.04)
    torch.testing.assert_close(p2, torch.softmax((logits - center) / 0.04, -1))


def test_schedules_follow_the_config():
    # teacher temperature: 0.04 -> 0.07 linearly over 30 % of 100 steps, then flat
    tt = [E.teacher_temperature(s, 100, 0.04, 0.07, 0.3) for s in (0, 15, 29, 30, 99)]
    assert tt == pytest.approx([0.04, 0.055, 0.04 + 0.03 * 29 / 30, 0.07, 0.07])
    # momentum 0.992 -> 1 and weight decay 0.04 -> 0.4, cosine
    assert E.teacher_momentum(0, 100, 0.992, 1.0) == pytest.approx(0.992)
    assert E.teacher_momentum(50, 100, 0.992, 1.0) == pytest.approx(0.996)
    assert E.teacher_momentum(100, 100, 0.992, 1.0) == pytest.approx(1.0)
    assert E.cosine_schedule(0.04, 0.4, 25, 100) == pytest.approx(0.4 + (0.04 - 0.4) * 0.5 * (1 + math.cos(math.pi / 4)))


def test_random_patch_masks_follow_probability_and_ratio():
    g = torch.Generator().manual_seed(0)
    masks = E.random_patch_masks(10, 100, 0.5, (0.1, 0.5), g)
    counts = sorted(masks.sum(1).tolist())
    assert counts[:5] == [0] * 5  # int(10 * 0.5) crops masked, the others not
    assert all(10 <= c <= 50 for c in counts[5:])


def _dino_settings(**kw):
    base = dict(n_prototypes=32, hidden_dim=16, bottleneck_dim=8, global_size=16, local_size=8, n_local=1)
    base.update(kw)
    return E.DinoSection(**base)


def _pretrainer(**kw):
    torch.manual_seed(0)
    backbone = create_model("explora-test", n_outputs=0, img_size=16, dynamic_img_size=True, drop_path_rate=0.1)
    lora.apply(backbone, preset="explora", rank=4)
    return E.DinoPretrainer(backbone, _dino_settings(**kw))


def test_ema_teacher_update_isolation_and_last_layer_freeze():
    pt = _pretrainer(freeze_last_layer_steps=1)
    recipe = E.DinoRecipe(pt, train_dataset=[None], n_patches=16, base_weight_decay=0.04)
    groups = recipe.param_groups(pt, TrainConfig(weight_decay=0.123))
    names = {n for n, p in pt.named_parameters() if p.requires_grad}
    assert not any(n.startswith("teacher.") for n in names) and "mask_token" not in names
    assert pt.teacher.training is False and pt.train().teacher.training is False
    assert all(m.drop_prob == 0 for m in pt.teacher.modules() if hasattr(m, "drop_prob"))
    crops = [torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16), torch.randn(4, 3, 8, 8)]
    loss, logs = recipe.step(pt, crops)
    loss.backward()
    head = pt.student["head"]
    assert torch.count_nonzero(head.last_layer_v.grad) == 0  # frozen prototypes for step 0
    assert torch.count_nonzero(head.mlp[0].weight.grad) > 0
    with torch.no_grad():  # pretend an optimizer step moved the student
        for p in pt.student.parameters():
            if p.requires_grad:
                p.add_(0.5)
    before_t = {k: v.clone() for k, v in pt.teacher.state_dict().items()}
    student = dict(pt.student.named_parameters())
    recipe.on_train_step_end(pt, step=1, total_steps=10)
    m = E.teacher_momentum(0, 10, 0.992, 1.0)
    for name, p in pt.teacher.named_parameters():
        if student[name].requires_grad:
            torch.testing.assert_close(p, m * before_t[name] + (1 - m) * student[name].detach())
        else:  # frozen base weights: identical in both, untouched
            assert torch.equal(p, before_t[name]) and torch.equal(p, student[name])
    assert int(pt.step) == 1
    optimizer = torch.optim.AdamW(groups)
    recipe.before_optimizer_step(optimizer, step=1, total_steps=10)
    decayed = [g for g in optimizer.param_groups if g["weight_decay"] > 0]
    assert decayed and all(g["weight_decay"] == pytest.approx(E.cosine_schedule(0.04, 0.4, 1, 10)) for g in decayed)
    # the next step's gradient reaches the prototypes
    pt.zero_grad()
    loss, _ = recipe.step(pt, crops)
    loss.backward()
    assert torch.count_nonzero(head.last_layer_v.grad) > 0
    # merging the student (e.g. for export) never touches the teacher
    snapshot = {k: v.clone() for k, v in pt.teacher.state_dict().items()}
    lora.merge(pt.student["backbone"])
    assert all(torch.equal(v, snapshot[k]) for k, v in pt.teacher.state_dict().items())
    assert not any(w.merged for w in lora._wrappers(pt.teacher).values())


def test_mae_masks_three_quarters_and_patchify_layout():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    patches = explora_mae.patchify(x, 2)
    assert patches.shape == (2, 4, 12)
    assert torch.equal(patches[0, 1].reshape(2, 2, 3), x[0, :, 0:2, 2:4].permute(1, 2, 0))
    torch.manual_seed(0)
    enc = create_model("explora-multispectral-test", n_outputs=0)
    pt = E.MaePretrainer(enc, E.MaeSection(decoder_dim=16, decoder_depth=1, decoder_heads=2, decoder_channel_embed=4))
    loss, logs = pt(torch.randn(2, 10, 16, 16))
    assert logs["masked_fraction"] == pytest.approx(0.75) and torch.isfinite(loss)
    loss.backward()
    assert enc.patch_embed[0].proj.weight.grad is not None


def test_cli_dino_extended_pretraining_run(tmp_path):
    overrides = ["train.max_steps=3", "train.batch_size=4", "train.log_every_steps=1", "data.stride=24",
                 "dino.n_prototypes=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local=2",
                 "dino.freeze_last_layer_steps=1"]
    assert main(["pretrain", "--runs-dir", str(tmp_path), "--name", "p", "explora", *overrides]) == 0
    run = tmp_path / "explora" / "p"
    report = json.loads((run / "report.json").read_text())
    assert report["init"] == "random" and report["steps"] == 3 and report["objective"] == "dino"
    # explora preset on the 3-block test ViT (rank 16): q,v LoRA on blocks 0-1 + block 2 + norms + cls
    backbone = create_model("explora-test", n_outputs=0, img_size=32, dynamic_img_size=True)
    values = lora.PRESETS["explora"](backbone)
    lora.apply(backbone, preset="explora", rank=16)
    assert report["params_trainable_backbone"] == lora.count_trainable(backbone)
    assert values["targets"] == ["blocks.0.attn.qkv@q,v", "blocks.1.attn.qkv@q,v"]
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert len(train) == 3 and all({"dino", "ibot", "koleo", "teacher_temp"} <= set(r) for r in train)
    # the exported backbone is the merged teacher: same outputs as the teacher with adapters
    exported = create_model(str(run / "backbone")).eval()
    teacher = create_model("explora-test", n_outputs=0, img_size=32, dynamic_img_size=True).eval()
    lora.apply(teacher, preset="explora", rank=16)
    from safetensors.torch import load_file

    best = load_file(str(run / "checkpoints" / "best.safetensors"))
    teacher_sd = {k[len("teacher.backbone."):]: v for k, v in best.items() if k.startswith("teacher.backbone.")}
    teacher.load_state_dict(teacher_sd)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(exported(x), teacher(x), rtol=1e-5, atol=1e-5)


def test_cli_mae_multispectral_run_falls_below_the_trivial_baseline(tmp_path):
    overrides = ["train.max_steps=40", "train.batch_size=16", "train.lr=3e-3", "train.log_every_steps=1",
                 "data.stride=8", "mae.decoder_depth=1"]
    assert main(["pretrain", "--config", str(_config("pretrain_mae_multispectral")),
                 "--runs-dir", str(tmp_path), "--name", "m", "explora", *overrides]) == 0
    run = tmp_path / "explora" / "m"
    report = json.loads((run / "report.json").read_text())
    assert report["objective"] == "mae" and report["steps"] == 40
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    # Trivial baseline: norm_pix_loss scales each target patch to zero mean and unit (unbiased) variance over
    # its n = patch_size**2 * len(group) values, so predicting the patch's mean (0) scores (n - 1) / n on it; a
    # batch mixes the channel groups' masked patches, so no such prediction scores below the smallest group's.
    encoder = create_model("explora-multispectral-test", n_outputs=0, img_size=16, patch_size=4)
    sizes = [encoder.patch_size ** 2 * len(group) for group in encoder.channel_groups]
    baseline = min((n - 1) / n for n in sizes)
    late = sum(losses[-10:]) / 10
    assert late < baseline < losses[0], (losses[0], late, baseline)
    model = create_model("explora-multispectral-test", n_outputs=0)
    values = lora.PRESETS["explora"](model)
    lora.apply(model, preset="explora", rank=16, unfreeze=values["unfreeze"] + ["patch_embed.*"])
    assert report["params_trainable_backbone"] == lora.count_trainable(model)


def _config(name):
    from domainfm.config import config_path

    return config_path("explora", name)


def test_objectives_are_importable_from_the_entry_and_their_modules():
    for module in (explora_dino, explora_mae):
        for name in module.__all__:
            if name in E.__all__:
                assert getattr(E, name) is getattr(module, name)
    assert {"Config", "run", "DinoPretrainer", "MaePretrainer"} <= set(E.__all__)


def test_full_training_keeps_the_fixed_sincos_tables_frozen():
    model = create_model("explora-multispectral-test", n_outputs=0)
    E.apply_adapter(model, E.AdapterSection(enabled=False))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"pos_embed", "channel_embed"}


def test_scene_of_the_data_section_is_the_data_loader_scene():
    from domainfm.data_loaders import satellite as S

    got = E.load_scene(E.DataSection(source="sample", bands=["B08", "B04"]))
    ref = S.load_scene("sample", bands=["B08", "B04"])
    assert torch.equal(got.image, ref.image) and got.band_names == ["B08", "B04"] and got.stats == ref.stats
    with pytest.raises(ValueError, match="data.source=raster needs data.path or data.paths"):
        E.load_scene(E.DataSection(source="raster"))
    with pytest.raises(ValueError, match=r"data \(source='sample'.*mean/std have 1 values"):
        E.load_scene(E.DataSection(source="sample", mean=[0.0], std=[1.0]))

