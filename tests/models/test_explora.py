"""ExPLoRA models: preset parameter counts on real sizes (meta device), q/v-slice LoRA merge,
teacher isolation, official checkpoint conversion (both file kinds), group-channel ViT."""
import copy

import pytest
import torch
from torch import nn

from domainfm import create_model, lora, zoo
from domainfm.hub import HubError
from domainfm.models.explora import GroupChannelViT, convert_official, load_official
from domainfm.models.explora.satmae import sincos_1d, sincos_2d


def _meta(name, **kw):
    with torch.device("meta"):
        return zoo.build_model(name, **kw)


@pytest.mark.parametrize("name, expected", [
    ("explora-vit-large-dinov2-fmow-rgb", 18_724_864),
    ("explora-vit-base-dinov2-fmow-rgb", 9_288_192),
])
def test_explora_preset_trainable_counts_exact(name, expected):
    model = _meta(name)
    lora.apply(model, preset="explora")
    assert lora.count_trainable(model) == expected
    depth = len(model.blocks)
    # the last block is unfrozen instead of adapted; k rows of qkv are never adapted
    assert isinstance(model.blocks[depth - 1].attn.qkv, nn.Linear)
    assert model.blocks[0].attn.qkv.chunks == ("q", "v")
    assert not model.pos_embed.requires_grad and not model.patch_embed.proj.weight.requires_grad


def test_classification_head_counted_separately():
    model = _meta("explora-vit-large-dinov2-fmow-rgb", n_outputs=62)
    presets = lora.PRESETS["explora"](model)
    lora.apply(model, preset="explora", unfreeze=presets["unfreeze"] + ["head.*"])
    assert lora.count_trainable(model) == 18_724_864 + 1024 * 62 + 62


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return create_model("explora-test", **kw).eval()


def _perturb_adapters(model, scale=0.1):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)


def test_qv_slice_lora_merge_equals_unmerged_and_leaves_k_untouched():
    model = _tiny()
    x = torch.randn(3, 3, 32, 32)
    lora.apply(model, preset="explora", rank=4, alpha=4.0)
    _perturb_adapters(model)
    qkv = model.blocks[0].attn.qkv
    dim = qkv.base_layer.out_features // 3
    before = qkv.base_layer.weight.detach().clone()
    unmerged = model(x)
    lora.merge(model)
    after = qkv.base_layer.weight.detach()
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-5)
    assert torch.equal(after[dim:2 * dim], before[dim:2 * dim])  # k rows bit-identical
    assert not torch.allclose(after[:dim], before[:dim]) and not torch.allclose(after[2 * dim:], before[2 * dim:])
    # the q delta is exactly s * B_q A_q
    a, b = qkv.q.lora_A.weight, qkv.q.lora_B.weight
    torch.testing.assert_close(after[:dim] - before[:dim], qkv.scaling * b @ a, rtol=1e-5, atol=1e-6)
    lora.unmerge(model)
    assert torch.equal(qkv.base_layer.weight, before)


def test_teacher_never_changes_when_student_is_merged_or_switched_to_eval():
    student = _tiny()
    lora.apply(student, preset="explora", rank=4)
    _perturb_adapters(student)
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    snapshot = {k: v.clone() for k, v in teacher.state_dict().items()}
    student.eval(), teacher.eval(), teacher.train(), teacher.eval()  # eval() never merges
    assert not any(w.merged for w in lora._wrappers(teacher).values())
    lora.merge(student)
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    # and they still share no storage
    s_ptrs = {p.data_ptr() for p in student.parameters()}
    assert not s_ptrs & {p.data_ptr() for p in teacher.parameters()}


def _official_layout(model: nn.Module) -> dict[str, torch.Tensor]:
    """An encoder state_dict in DINOv2's official key names, built from ``model``'s shapes."""
    g = torch.Generator().manual_seed(7)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("head."):
            continue
        sd[k] = torch.randn(v.shape, generator=g) * 0.02
    sd["mask_token"] = torch.zeros(1, model.embed_dim)
    return sd


def test_encoder_only_official_file_loads_with_only_mask_token_dropped(tmp_path):
    model = create_model("explora-test", n_outputs=0)
    sd = _official_layout(model)
    expected_keys = {"cls_token", "pos_embed", "mask_token", "patch_embed.proj.weight", "blocks.0.norm1.weight",
                     "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.ls1.gamma",
                     "blocks.0.norm2.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight",
                     "blocks.0.ls2.gamma", "norm.weight", "norm.bias"}
    assert expected_keys <= set(sd)
    torch.save({"model": sd, "epoch": 199}, tmp_path / "explora_encoder_only.pth")
    path = str(tmp_path / "explora_encoder_only.pth")
    # as a user calls it: no converter= (every key but mask_token matches the model, yet the file is
    # upstream, so the converter applies), and the same as naming the converter
    for kwargs in ({}, {"converter": "official"}):
        fresh = create_model("explora-test", n_outputs=0, pretrained=path, **kwargs).eval()
        report = fresh.domainfm_load_report
        assert report.kind == "upstream" and report.converter == "official"
        assert report.missing == [] and report.unexpected == []
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, sd[k]), k
    # the converter is what drops mask_token: loaded with an identity converter it is the one stray key
    with pytest.raises(HubError, match="unexpected keys: mask_token$"):
        create_model("explora-test", n_outputs=0, pretrained=path, converter=lambda state, model: state)


@pytest.mark.parametrize("name, kwargs", [
    ("explora-test", {}), ("explora-test", {"global_pool": "avg", "n_outputs": 3}), ("explora-multispectral-test", {}),
])
def test_converter_is_idempotent(name, kwargs):
    model = create_model(name, **kwargs)
    own = model.state_dict()
    again = convert_official(dict(own), model)  # our own keys: unchanged
    assert list(again) == list(own) and all(again[k] is own[k] for k in own)
    official = _official_layout(create_model(name, n_outputs=0))
    once = convert_official({"model": official}, model)
    assert "mask_token" not in once
    twice = convert_official(once, model)
    assert list(twice) == list(once) and all(torch.equal(twice[k], once[k]) for k in once)


@pytest.mark.slow
def test_official_vit_large_encoder_only_file_loads_through_create_model_without_converter_argument(tmp_path):
    """The Must-show on the real variant: an official encoder-only ``{"model": ...}`` file of
    ExPLoRA ViT-L/14 (DINOv2 key names, with ``mask_token``), loaded exactly as a user calls it.

    The file is built from the model's own keys (which are DINOv2's names) plus ``mask_token``,
    with shapes read on the meta device, to keep this one ViT-L test cheap (~300M parameters)."""
    name = "explora-vit-large-dinov2-fmow-rgb"
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in zoo.build_model(name).state_dict().items()}
    assert len([k for k in shapes if k.endswith(".attn.qkv.weight")]) == 24 and shapes["pos_embed"] == (1, 257, 1024)
    g = torch.Generator().manual_seed(0)
    official = {k: torch.empty(shape).normal_(0, 0.02, generator=g) for k, shape in shapes.items()}
    official["mask_token"] = torch.zeros(1, 1024)
    path = tmp_path / "explora_dinov2_vit_large_fmow_rgb_encoder_only.pth"
    torch.save({"model": official, "epoch": 199}, path)

    model = create_model(name, pretrained=str(path)).eval()
    report = model.domainfm_load_report
    assert report.kind == "upstream" and report.converter == "official"
    assert report.missing == [] and report.unexpected == []
    # the converter called by hand, into a model that gets its tensors straight from the converter
    with torch.device("meta"):
        explicit = zoo.build_model(name)
    raw = torch.load(path, weights_only=True)
    explicit.load_state_dict(convert_official(raw, explicit), strict=True, assign=True)
    explicit.eval()
    got = model.state_dict()
    for key, value in explicit.state_dict().items():
        assert torch.equal(got[key], value), key
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), explicit(x))


def test_teacher_format_full_file_converts_to_the_same_weights(tmp_path):
    model = create_model("explora-test", n_outputs=0)
    sd = _official_layout(model)
    full = {f"backbone.{k}": v for k, v in sd.items()}
    d = model.embed_dim
    for i in range(len(model.blocks)):  # merged copies beside the fused qkv
        for j, part in enumerate("qkv"):
            for kind in ("weight", "bias"):
                full[f"backbone.blocks.{i}.attn.{part}_proj.{kind}"] = sd[f"blocks.{i}.attn.qkv.{kind}"][j * d:(j + 1) * d]
    full["dino_head.mlp.0.weight"] = torch.randn(8, d)
    full["ibot_head.last_layer.weight_g"] = torch.ones(16, 1)
    torch.save({"teacher": full, "model": {"backbone.cls_token": torch.zeros(1, 1, d)}, "iteration": 3},
               tmp_path / "full.pth")
    encoder_only = convert_official(sd, model)
    teacher = create_model("explora-test", n_outputs=0)
    report = load_official(teacher, tmp_path / "full.pth")
    assert report.missing == [] and report.unexpected == []
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, encoder_only[k]), k
    # only the separate projections (no fused qkv): fused by the converter to the same tensor
    only_proj = {k: v for k, v in full.items() if ".attn.qkv." not in k}
    converted = convert_official({"teacher": only_proj}, model)
    assert torch.equal(converted["blocks.1.attn.qkv.weight"], sd["blocks.1.attn.qkv.weight"])
    # disagreeing copies are an error, not a silent pick
    bad = dict(full)
    bad["backbone.blocks.0.attn.k_proj.weight"] = bad["backbone.blocks.0.attn.k_proj.weight"] + 1
    with pytest.raises(ValueError, match="disagrees"):
        convert_official({"teacher": bad}, model)


def test_converter_resamples_position_table_and_moves_norm_to_fc_norm():
    src = create_model("explora-test", n_outputs=0, img_size=48)  # 12x12 grid
    dst = create_model("explora-test", n_outputs=3, img_size=32, global_pool="avg")  # 8x8, fc_norm
    out = convert_official(_official_layout(src), dst)
    assert out["pos_embed"].shape == dst.pos_embed.shape
    assert "fc_norm.weight" in out and "norm.weight" not in out
    missing, unexpected = dst.load_state_dict(out, strict=False)
    assert set(missing) == {"head.weight", "head.bias"} and unexpected == []


def test_missing_official_file_and_unregistered_weights_are_clear_errors(tmp_path):
    from domainfm.hub import load_pretrained

    with pytest.raises(HubError, match="no pretrained weights registered"):
        load_pretrained(create_model("explora-test"), True, card="explora-test")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_official(create_model("explora-test"), tmp_path / "nope.pth")


def test_sincos_tables_match_closed_form():
    t = sincos_1d(4, torch.arange(3).numpy())
    omega = [1.0, 1.0 / 100.0]
    for p in range(3):
        assert t[p].tolist() == pytest.approx([torch.sin(torch.tensor(p * w)).item() for w in omega]
                                              + [torch.cos(torch.tensor(p * w)).item() for w in omega], abs=1e-6)
    table = sincos_2d(8, 2)
    assert table.shape == (5, 8) and (table[0] == 0).all()


def test_group_channel_vit_tokens_groups_and_encodings():
    torch.manual_seed(0)
    model = create_model("explora-multispectral-test").eval()
    assert len(model.patch_embed) == 3 and model.patch_embed[2].proj.in_channels == 2
    x = torch.randn(2, 10, 16, 16)
    feats = model.forward_features(x)
    assert feats.shape == (2, 1 + 3 * 16, 48)
    enc = model.group_pos_embed()
    # last 16 dims: the same channel code on every patch of a group, different between groups
    assert torch.equal(enc[0, 1, 0, -16:], enc[0, 1, 5, -16:])
    assert not torch.equal(enc[0, 0, 0, -16:], enc[0, 1, 0, -16:])
    # first dims: the same position code in every group
    assert torch.equal(enc[0, 0, 3, :-16], enc[0, 2, 3, :-16])
    # a group only sees its own bands: changing band 8 (group 2) leaves group 0/1 tokens unchanged
    x2 = x.clone()
    x2[:, 8] += 1
    e1, e2 = model.embed_groups(x), model.embed_groups(x2)
    assert torch.equal(e1[:, :2], e2[:, :2]) and not torch.equal(e1[:, 2], e2[:, 2])
    # avg pooling over all G*L tokens through fc_norm
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), model.fc_norm(feats[:, 1:].mean(1)))
    with pytest.raises(ValueError, match="expects"):
        model(torch.randn(2, 4, 16, 16))
    with pytest.raises(ValueError, match="channel_groups"):
        GroupChannelViT(in_chans=4, channel_groups=[[0, 1], [1, 5]], embed_dim=48, depth=1, num_heads=3, channel_embed=16)


def test_explora_preset_on_group_channel_vit_with_trainable_patch_embeddings():
    model = create_model("explora-multispectral-test", n_outputs=0)
    values = lora.PRESETS["explora"](model)
    lora.apply(model, preset="explora", unfreeze=values["unfreeze"] + ["patch_embed.*"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "patch_embed.0.proj.weight" in trainable and "blocks.2.mlp.fc1.weight" in trainable
    assert "pos_embed" not in trainable and "channel_embed" not in trainable
    assert "blocks.0.attn.qkv.q.lora_A.weight" in trainable and "blocks.0.mlp.fc1.weight" not in trainable
