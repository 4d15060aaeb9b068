"""Tests for domainfm.lora: LoRA / DoRA / RepLoRA wrappers, merge, save/load, presets."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from domainfm import lora

KINDS = ("linear", "conv1d", "conv2d", "qkv")


class Toy(nn.Module):
    """A small model whose layer ``layer`` is the adaptation target, plus a norm and a token."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        if kind == "linear":
            self.layer = nn.Linear(12, 20)
            self.post = nn.Linear(20, 5)
        elif kind == "conv1d":
            self.layer = nn.Conv1d(4, 6, kernel_size=3, stride=2, padding=1)
            self.post = nn.Conv1d(6, 5, kernel_size=1)
        elif kind == "conv2d":
            self.layer = nn.Conv2d(3, 6, kernel_size=3, padding=2, dilation=2, padding_mode="reflect")
            self.post = nn.Conv2d(6, 5, kernel_size=1)
        elif kind == "qkv":
            self.layer = nn.Linear(12, 36)  # fused q, k, v of width 12
            self.post = nn.Linear(36, 5)
        self.norm = nn.GroupNorm(1, 5) if kind.startswith("conv") else nn.LayerNorm(5)
        self.cls_token = nn.Parameter(torch.randn(5))

    def forward(self, x):
        y = self.norm(self.post(torch.relu(self.layer(x))))
        return y + (self.cls_token.view(-1, 1, 1) if self.kind == "conv2d" else
                    self.cls_token.view(-1, 1) if self.kind == "conv1d" else self.cls_token)

    def example(self, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        shape = {"linear": (3, 7, 12), "conv1d": (2, 4, 17), "conv2d": (2, 3, 9, 9), "qkv": (3, 7, 12)}[self.kind]
        return torch.randn(shape, generator=g)


def _target(kind: str) -> str:
    return "layer@q,v" if kind == "qkv" else "layer"


def _perturb(model: nn.Module, seed: int = 0, scale: float = 0.1) -> None:
    """Give every adapter tensor (B included) non-zero, reproducible values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g) * scale
            if name.endswith("lora_magnitude_vector"):
                p.mul_(1 + noise)
            else:
                p.add_(noise)


def _wrapper(model) -> lora.LoraLayer:
    assert isinstance(model.layer, lora.LoraLayer)
    return model.layer


# --- no-op, merge, unmerge ------------------------------------------------------------------------


@pytest.mark.parametrize("variant", lora.VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_fresh_adapter_is_noop(kind, variant):
    model = Toy(kind).eval()
    x = model.example()
    before = model(x)
    lora.apply(model, [_target(kind)], rank=4, alpha=8, variant=variant)
    after = model(x)
    if variant == "dora":  # m / ||W|| == 1 exactly, but the bias is added separately
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    else:
        assert torch.equal(after, before)


@pytest.mark.parametrize("variant", lora.VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_merge_matches_unmerged_and_unmerge_is_exact(kind, variant):
    model = Toy(kind).eval()
    x = model.example()
    lora.apply(model, [_target(kind)], rank=4, alpha=8, variant=variant)
    _perturb(model)
    wrapper = _wrapper(model)
    base_weight = wrapper.base_layer.weight.detach().clone()
    base_bias = wrapper.base_layer.bias.detach().clone()
    unmerged = model(x)
    assert not torch.allclose(unmerged, Toy(kind).eval()(x), atol=1e-3)  # the adapter does something

    lora.merge(model)
    assert wrapper.merged
    assert not torch.equal(wrapper.base_layer.weight, base_weight)
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-5)
    # merged wrappers compute the base layer only: the adapter tensors are no longer read
    with torch.no_grad():
        for _, p in wrapper.adapter_named_parameters():
            p.fill_(float("nan"))
    assert torch.isfinite(model(x)).all()
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-5)

    lora.unmerge(model)
    assert not wrapper.merged
    assert torch.equal(wrapper.base_layer.weight, base_weight)
    assert torch.equal(wrapper.base_layer.bias, base_bias)


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_slice_merge_leaves_k_rows_bit_identical(variant):
    model = Toy("qkv").eval()
    lora.apply(model, ["layer@q,v"], rank=4, variant=variant)
    _perturb(model)
    base = _wrapper(model).base_layer.weight.detach().clone()
    lora.merge(model)
    merged = _wrapper(model).base_layer.weight
    assert torch.equal(merged[12:24], base[12:24])  # k
    assert not torch.equal(merged[:12], base[:12])  # q
    assert not torch.equal(merged[24:], base[24:])  # v


def test_slice_forward_changes_only_selected_rows():
    model = Toy("qkv").eval()
    layer = model.layer
    x = model.example()
    reference = layer(x)
    lora.apply(model, ["layer@q,v"], rank=4)
    _perturb(model)
    out = model.layer(x)
    assert torch.equal(out[..., 12:24], reference[..., 12:24])
    assert not torch.allclose(out[..., :12], reference[..., :12])
    assert not torch.allclose(out[..., 24:], reference[..., 24:])


def test_merge_is_independent_of_train_eval_mode():
    def merged_weight(mode):
        model = Toy("linear")
        lora.apply(model, ["layer"], rank=4, dropout=0.3)
        _perturb(model)
        model.train(mode == "train")
        weight = model.layer.base_layer.weight.detach().clone()
        model.eval()
        model.train()  # switching modes never merges (ExPLoRA's EMA-teacher pitfall)
        assert torch.equal(model.layer.base_layer.weight, weight) and not model.layer.merged
        model.train(mode == "train")
        lora.merge(model)
        return model.layer.base_layer.weight.detach().clone()

    assert torch.equal(merged_weight("train"), merged_weight("eval"))


def test_merge_twice_and_unmerge_unmerged_raise():
    model = Toy("linear")
    lora.apply(model, ["layer"])
    with pytest.raises(RuntimeError, match="no adapter is merged"):
        lora.unmerge(model)
    lora.merge(model)
    with pytest.raises(RuntimeError, match="already merged"):
        lora.merge(model)


def test_merge_refuses_nan_and_leaves_weights_untouched():
    model = Toy("linear")
    model.layer2 = nn.Linear(20, 20)
    lora.apply(model, ["layer", "layer2"])
    _perturb(model)
    w1 = model.layer.base_layer.weight.detach().clone()
    w2 = model.layer2.base_layer.weight.detach().clone()
    with torch.no_grad():
        model.layer2.lora_B.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="layer2"):
        lora.merge(model)
    assert not model.layer.merged and not model.layer2.merged
    assert torch.equal(model.layer.base_layer.weight, w1)
    assert torch.equal(model.layer2.base_layer.weight, w2)


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_merge_unload_restores_plain_layers(variant):
    model = Toy("conv2d").eval()
    x = model.example()
    lora.apply(model, ["layer"], rank=2, variant=variant)
    _perturb(model)
    expected = model(x)
    lora.merge(model, unload=True)
    assert type(model.layer) is nn.Conv2d
    assert not any(isinstance(m, lora.LoraLayer) for m in model.modules())
    assert sorted(model.state_dict()) == sorted(Toy("conv2d").state_dict())
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_dropout_only_on_adapter_branch():
    model = Toy("linear")
    x = model.example()
    reference = model.eval()(x)
    lora.apply(model, ["layer"], rank=4, dropout=0.9)
    model.train()
    # B == 0, so a dropped-out base input would show; the adapter branch contributes nothing
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
    _perturb(model)
    torch.manual_seed(0)
    first = model(x)
    torch.manual_seed(1)
    assert not torch.equal(first, model(x))  # dropout is active on the branch in train mode
    model.eval()
    assert torch.equal(model(x), model(x))


# --- trainable parameters, gradients ------------------------------------------------------------


def _lora_count(kind: str, rank: int) -> int:
    if kind == "linear":
        return rank * (12 + 20)
    if kind == "conv1d":
        return rank * (4 * 3 + 6)
    if kind == "conv2d":
        return rank * (3 * 3 * 3 + 6)
    return 2 * rank * (12 + 12)  # q and v chunks of width 12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_only_adapter_and_unfreeze_params_train(kind, variant):
    rank, hidden = 3, 5
    model = Toy(kind)
    lora.apply(model, [_target(kind)], rank=rank, variant=variant, unfreeze=["*norm*", "cls_token"],
               replora_hidden=hidden)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    unfrozen = {"norm.weight", "norm.bias", "cls_token"}
    assert unfrozen <= trainable
    adapters = trainable - unfrozen
    assert adapters and all(n.startswith("layer.") and ".base_layer." not in n for n in adapters)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith(("post.", "layer.base_layer.")))

    w = model.layer.base_layer.weight
    out_chunk = 12 if kind == "qkv" else w.shape[0]
    n_chunks = 2 if kind == "qkv" else 1
    fan_in = w[0].numel()
    if variant == "lora":
        expected = _lora_count(kind, rank)
    elif variant == "dora":
        expected = _lora_count(kind, rank) + n_chunks * out_chunk
    else:  # shared A0, B0 + per chunk two MLPs (d -> h -> d, with biases)
        mlp = lambda d: 2 * d * hidden + hidden + d  # noqa: E731
        expected = rank * fan_in + out_chunk * rank + n_chunks * (mlp(fan_in) + mlp(out_chunk))
    assert sum(model.get_parameter(n).numel() for n in adapters) == expected
    assert lora.count_trainable(model) == expected + 5 + 5 + 5


def test_slice_trainable_count_formula():
    model = nn.Sequential(nn.Linear(40, 3 * 24))
    lora.apply(model, ["0@q,v"], rank=8)
    assert lora.count_trainable(model) == 2 * 8 * (40 + 24)
    lora2 = nn.Sequential(nn.Linear(40, 3 * 24))
    lora.apply(lora2, ["0@k"], rank=8)
    assert lora.count_trainable(lora2) == 8 * (40 + 24)


@pytest.mark.parametrize("variant", lora.VARIANTS)
@pytest.mark.parametrize("kind", ("qkv", "conv2d"))
def test_gradients_reach_adapters_not_base(kind, variant):
    model = Toy(kind)
    x = model.example()
    lora.apply(model, [_target(kind)], rank=4, variant=variant, unfreeze=["cls_token"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):  # step 1 moves the zero-initialised B (or g_B's output layer) off zero
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if variant == "replora":
        assert any("replora_mlp_A.fc1" in n for n in names) and any("replora_mlp_B.fc1" in n for n in names)


def test_rslora_scaling():
    plain = lora.apply(Toy("linear"), ["layer"], rank=16, alpha=8)
    rs = lora.apply(Toy("linear"), ["layer"], rank=16, alpha=8, use_rslora=True)
    assert plain.layer.scaling == pytest.approx(8 / 16)
    assert rs.layer.scaling == pytest.approx(8 / math.sqrt(16)) and rs.layer.scaling == pytest.approx(2.0)
    _perturb(rs)
    a, b = rs.layer.lora_A.weight, rs.layer.lora_B.weight
    torch.testing.assert_close(rs.layer.delta_weight(), 2.0 * (b @ a).detach())


def test_trainable_summary():
    model = Toy("linear")
    total = sum(p.numel() for p in model.parameters())
    lora.apply(model, ["layer"], rank=2, unfreeze=["cls_token"])
    summary = lora.trainable_summary(model)
    assert summary["trainable"] == 2 * (12 + 20) + 5
    assert summary["total"] == total + 2 * (12 + 20)
    assert summary["percent"] == pytest.approx(100 * summary["trainable"] / summary["total"])
    assert "trainable params: 69" in str(summary)


# --- save / load --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", lora.VARIANTS)
def test_save_load_round_trip(tmp_path, variant):
    model = Toy("qkv").eval()
    lora.apply(model, ["layer@q,v"], rank=4, alpha=4, variant=variant, unfreeze=["*norm*", "cls_token"],
               base_model_name="toy-qkv")
    _perturb(model)
    x = model.example()
    expected = model(x)
    lora.save_adapter(model, tmp_path)

    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 4.0
    assert cfg["target_modules"] == ["layer@q,v"] and cfg["variant"] == variant
    assert cfg["use_dora"] is (variant == "dora") and cfg["use_rslora"] is False
    assert cfg["modules_to_save"] == cfg["unfreeze"] == ["*norm*", "cls_token"]
    assert cfg["base_model_name_or_path"] == "toy-qkv"
    assert cfg["base_model_sha256"] == lora.base_model_sha256(Toy("qkv"), ["*norm*", "cls_token"])
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    unfrozen = {"base_model.model.norm.weight", "base_model.model.norm.bias", "base_model.model.cls_token"}
    prefix = "base_model.model.layer."
    if variant == "lora":
        adapter = {f"{prefix}{c}.lora_{f}.weight" for c in "qv" for f in "AB"}
    elif variant == "dora":
        adapter = {f"{prefix}{c}.lora_{f}.weight" for c in "qv" for f in "AB"}
        adapter |= {f"{prefix}{c}.lora_magnitude_vector" for c in "qv"}
    else:
        adapter = {f"{prefix}replora_A.weight", f"{prefix}replora_B.weight"}
        adapter |= {f"{prefix}{c}.replora_mlp_{f}.fc{i}.{t}" for c in "qv" for f in "AB" for i in (1, 2)
                    for t in ("weight", "bias")}
    assert keys == adapter | unfrozen
    assert keys == set(lora.adapter_state_dict(model))

    fresh = Toy("qkv").eval()
    assert not torch.allclose(fresh(x), expected)
    lora.load_adapter(fresh, tmp_path)
    assert isinstance(fresh.layer, lora.LoraLayer) and fresh.layer.variant == variant
    assert torch.equal(fresh(x), expected)
    assert lora.count_trainable(fresh) == lora.count_trainable(model)


def test_save_overwrites_atomically_and_merged_model_saves_adapters(tmp_path):
    model = Toy("linear").eval()
    lora.apply(model, ["layer"], rank=2)
    lora.save_adapter(model, tmp_path)
    _perturb(model)
    x = model.example()
    expected = model(x)
    lora.merge(model)
    lora.save_adapter(model, tmp_path)  # merged: same adapter tensors and the same base hash
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    fresh = lora.load_adapter(Toy("linear").eval(), tmp_path)
    torch.testing.assert_close(fresh(x), expected, rtol=0, atol=0)


def test_wrong_base_hash_raises_or_warns(tmp_path):
    model = Toy("linear")
    lora.apply(model, ["layer"], rank=2)
    lora.save_adapter(model, tmp_path)
    recorded = json.loads((tmp_path / "adapter_config.json").read_text())["base_model_sha256"]
    other = Toy("linear", seed=123)
    other_hash = lora.base_model_sha256(other, [])
    with pytest.raises(ValueError) as err:
        lora.load_adapter(other, tmp_path)
    assert recorded in str(err.value) and other_hash in str(err.value)
    assert not isinstance(other.layer, lora.LoraLayer)  # nothing applied on failure
    with pytest.warns(UserWarning, match=other_hash):
        lora.load_adapter(other, tmp_path, strict_base=False)
    assert isinstance(other.layer, lora.LoraLayer)


def test_base_hash_ignores_adapter_training_and_merge():
    fresh_hash = lora.base_model_sha256(Toy("qkv"), ["cls_token"])
    model = lora.apply(Toy("qkv"), ["layer@q,v"], variant="dora", unfreeze=["cls_token"])
    _perturb(model)
    assert lora.base_model_sha256(model) == fresh_hash
    lora.merge(model)
    assert lora.base_model_sha256(model) == fresh_hash
    with torch.no_grad():
        model.post.weight[0, 0] += 1.0  # a frozen base parameter changes the hash
    assert lora.base_model_sha256(model) != fresh_hash


def test_load_reports_missing_and_unexpected_keys(tmp_path):
    model = Toy("linear")
    lora.apply(model, ["layer"], rank=2)
    lora.save_adapter(model, tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    del tensors["base_model.model.layer.lora_B.weight"]
    tensors["base_model.model.layer.lora_C.weight"] = torch.zeros(1)
    save_file(tensors, path)
    with pytest.raises(ValueError) as err:
        lora.load_adapter(Toy("linear"), tmp_path)
    assert "base_model.model.layer.lora_B.weight" in str(err.value)
    assert "base_model.model.layer.lora_C.weight" in str(err.value)


def test_load_into_model_with_other_settings_raises(tmp_path):
    lora.save_adapter(lora.apply(Toy("linear"), ["layer"], rank=2), tmp_path)
    with pytest.raises(ValueError, match="rank"):
        lora.load_adapter(lora.apply(Toy("linear"), ["layer"], rank=4), tmp_path)


# --- bad inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"targets": ["nope.*"]}, "'nope.\\*'"),
        ({"targets": ["norm"]}, "'norm'.*LayerNorm"),
        ({"targets": ["layer"], "rank": 0}, "rank"),
        ({"targets": ["layer"], "rank": 2.5}, "rank"),
        ({"targets": ["layer"], "variant": "vera"}, "'vera'"),
        ({"targets": ["layer"], "dropout": 1.0}, "dropout"),
        ({"targets": ["layer"], "alpha": float("nan")}, "alpha"),
        ({"targets": ["layer"], "preset": "nope"}, "'nope'"),
        ({"targets": ["layer@q,x"]}, "'layer@q,x'"),
        ({"targets": ["post@q,v"]}, "'post@q,v'.*'post'.*5 output rows"),
        ({"targets": ["layer"], "unfreeze": ["blocks.99.*"]}, "'blocks.99.\\*'"),
        ({"targets": []}, "targets"),
    ],
)
def test_bad_inputs_raise_value_error_naming_them(kwargs, match):
    kwargs = dict(kwargs)
    model = Toy("linear")
    targets = kwargs.pop("targets")
    with pytest.raises(ValueError, match=match):
        lora.apply(model, targets, **kwargs)
    assert not any(isinstance(m, lora.LoraLayer) for m in model.modules())


def test_unsupported_layers_raise():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match="'0'.*groups=2"):
        lora.apply(model, ["0"])
    with pytest.raises(ValueError, match="'1.out_proj'.*MultiheadAttention"):
        lora.apply(model, ["1.out_proj"])
    with pytest.raises(ValueError, match="'1'.*MultiheadAttention"):
        lora.apply(model, ["1"])


def test_applying_twice_raises():
    model = lora.apply(Toy("linear"), ["layer"])
    with pytest.raises(ValueError, match="already has adapters"):
        lora.apply(model, ["post"])
    with pytest.raises(ValueError, match="already has adapters"):
        lora.apply(model.layer, ["base_layer"])  # a submodule holding a wrapper


# --- presets, timm ------------------------------------------------------------------------------


def test_preset_callable_and_override():
    def preset(model):
        return {"targets": ["layer"], "rank": 2, "alpha": 2.0, "unfreeze": ["cls_token"]}

    model = lora.apply(Toy("linear"), preset=preset, rank=3)  # caller's rank wins
    assert model.layer.rank == 3 and model.layer.scaling == pytest.approx(2 / 3)
    assert lora.count_trainable(model) == 3 * (12 + 20) + 5



def test_family_preset_resolves_without_importing_the_family_first():
    # the core holds no family preset: "explora" lives in domainfm.models.explora and is found
    # by the registry importing the families on a miss (a fresh interpreter proves the order)
    code = (
        "import sys\n"
        "from domainfm import lora\n"
        "assert 'domainfm.models.explora' not in sys.modules\n"
        "assert 'explora' in lora.PRESETS\n"
        "from domainfm.models.explora.preset import explora_preset\n"
        "assert lora.PRESETS['explora'] is explora_preset\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_register_preset_refuses_a_taken_name():
    assert "explora" in lora.PRESETS
    with pytest.raises(ValueError, match="'explora' is already registered by domainfm.models.explora"):
        lora.register_preset("explora", lambda model: {"targets": ["layer"]})
    lora.register_preset("explora", lora.PRESETS["explora"])  # re-registering the same function is fine
    name = "test-only-preset"
    lora.register_preset(name, {"targets": ["layer"], "rank": 2})
    try:
        model = lora.apply(Toy("linear"), preset=name)
        assert model.layer.rank == 2 and lora.count_trainable(model) == 2 * (12 + 20)
    finally:
        del lora.PRESETS[name]
    assert name not in lora.PRESETS

def _tiny_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=24, depth=3, num_heads=2, num_classes=0,
                             reg_tokens=2, no_embed_class=True)


def test_explora_on_tiny_timm_vit_merge_and_round_trip(tmp_path):
    model = _tiny_vit().eval()
    x = torch.randn(2, 3, 16, 16)
    lora.apply(model, preset="explora", rank=4)
    assert isinstance(model.blocks[0].attn.qkv, lora.LoraLayer) and model.blocks[0].attn.qkv.chunks == ("q", "v")
    assert isinstance(model.blocks[1].attn.qkv, lora.LoraLayer)
    assert isinstance(model.blocks[2].attn.qkv, nn.Linear)  # the last block is unfrozen instead
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"cls_token", "reg_token", "norm.weight", "blocks.0.norm1.weight", "blocks.2.mlp.fc1.weight"} <= trainable
    assert not trainable & {"pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight"}
    _perturb(model, scale=0.05)
    expected = model(x)
    lora.save_adapter(model, tmp_path)
    fresh = lora.load_adapter(_tiny_vit().eval(), tmp_path)
    assert torch.equal(fresh(x), expected)
    lora.merge(fresh)
    torch.testing.assert_close(fresh(x), expected, rtol=1e-5, atol=1e-5)


def test_explora_preset_counts_vit_base_dinov2():
    import timm
    model = timm.create_model("vit_base_patch14_dinov2", pretrained=False, img_size=224, num_classes=0)
    lora.apply(model, preset="explora")
    assert lora.count_trainable(model) == 9_288_192
    assert model.blocks[10].attn.qkv.rank == 64 and model.blocks[10].attn.qkv.scaling == pytest.approx(1 / 64)
    assert all(p.requires_grad for p in model.blocks[11].parameters())
    assert not model.pos_embed.requires_grad and not model.patch_embed.proj.weight.requires_grad


def test_explora_preset_counts_vit_large_dinov2():
    import timm
    # the count depends on shapes only; the meta device skips 300M random inits (~20 s on 2 cores)
    with torch.device("meta"):
        model = timm.create_model("vit_large_patch14_dinov2", pretrained=False, img_size=224, num_classes=0)
    lora.apply(model, preset="explora")
    assert lora.count_trainable(model) == 18_724_864


# --- details: init, DoRA gradient convention, PEFT shapes, half precision ------------------------


def test_init_kaiming_uniform_a_and_zero_b():
    model = lora.apply(nn.Sequential(nn.Linear(400, 30)), ["0"], rank=64)
    a, b = model[0].lora_A.weight, model[0].lora_B.weight
    bound = 1 / math.sqrt(400)  # kaiming_uniform(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert a.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert torch.equal(b, torch.zeros(30, 64))


def test_dora_norm_is_a_constant_for_autograd():
    model = lora.apply(nn.Sequential(nn.Linear(6, 5)), ["0"], rank=2, alpha=2, variant="dora")
    _perturb(model, scale=0.3)
    layer = model[0]
    x = torch.randn(4, 6)
    layer(x).pow(2).sum().backward()

    w, bias = layer.base_layer.weight.detach(), layer.base_layer.bias.detach()
    a = layer.lora_A.weight.detach().clone().requires_grad_()
    b = layer.lora_B.weight.detach().clone().requires_grad_()
    m = layer.lora_magnitude_vector.detach().clone().requires_grad_()
    adapted = w + layer.scaling * b @ a
    norm = adapted.norm(dim=1).detach()  # DoRA Sec. 4.3, PEFT: no gradient through the norm
    ((m / norm) * (x @ adapted.T) + bias).pow(2).sum().backward()
    torch.testing.assert_close(layer.lora_A.weight.grad, a.grad)
    torch.testing.assert_close(layer.lora_B.weight.grad, b.grad)
    torch.testing.assert_close(layer.lora_magnitude_vector.grad, m.grad)


def test_peft_shapes_for_conv_dora():
    model = lora.apply(Toy("conv2d"), ["layer"], rank=3, variant="dora")
    state = lora.adapter_state_dict(model)
    assert state["base_model.model.layer.lora_A.weight"].shape == (3, 3, 3, 3)
    assert state["base_model.model.layer.lora_B.weight"].shape == (6, 3, 1, 1)
    magnitude = state["base_model.model.layer.lora_magnitude_vector"]
    assert magnitude.shape == (1, 6, 1, 1)
    torch.testing.assert_close(magnitude.flatten(), model.layer.base_layer.weight.flatten(1).norm(dim=1))


def test_half_precision_base_gets_fp32_adapters_and_exact_unmerge():
    model = nn.Sequential(nn.Linear(8, 12)).to(torch.bfloat16)
    lora.apply(model, ["0@q,v"], rank=2)
    assert model[0].q.lora_A.weight.dtype == torch.float32
    _perturb(model)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    base = model[0].base_layer.weight.detach().clone()
    expected = model(x)
    assert expected.dtype == torch.bfloat16
    lora.merge(model)
    torch.testing.assert_close(model(x), expected, rtol=0.02, atol=0.02)  # bf16 weight rounding
    assert torch.equal(model[0].base_layer.weight[4:8], base[4:8])
    lora.unmerge(model)
    assert torch.equal(model[0].base_layer.weight, base)


def test_a_config_naming_a_preset_gets_the_preset_settings_and_can_set_every_apply_option():
    # adapt.lora.preset=explora used to become rank 8 / alpha 16 and lose the preset's unfreeze list:
    # the config section passed its own defaults explicitly, and explicit values win in apply()
    import domainfm
    from domainfm import config as cfgmod
    from domainfm.experiment.supervised import prepare_mode
    from domainfm.lora.inject import wrappers
    from domainfm.lora.settings import LoraSettings

    model = domainfm.create_model("explora-test", n_outputs=3)
    n_blocks = len(model.blocks)
    settings = cfgmod.from_dict(LoraSettings, {"preset": "explora"})
    prepare_mode(model, "lora", head="head", lora=settings)
    wrapped = wrappers(model)
    assert wrapped and {w.rank for w in wrapped.values()} == {64}
    assert [w.scaling for w in wrapped.values()] == [pytest.approx(1.0 / 64)] * len(wrapped)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith(f"blocks.{n_blocks - 1}.") for n in trainable)  # the preset's last block
    assert "cls_token" in trainable and any(n.startswith("head.") for n in trainable)
    # an explicit value still wins, and every apply option is settable from a config
    model = domainfm.create_model("explora-test", n_outputs=3)
    settings = cfgmod.from_dict(LoraSettings, {"preset": "explora", "rank": 4, "variant": "replora",
                                               "replora_hidden": 12, "unfreeze": ["pos_embed"]})
    prepare_mode(model, "lora", head="head", lora=settings)
    wrapped = wrappers(model)
    assert {w.rank for w in wrapped.values()} == {4}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "pos_embed" in trainable and "cls_token" in trainable  # the config's unfreeze adds to the preset's
    assert {w.variant for w in wrapped.values()} == {"replora"}
    hidden = {p.shape for w in wrapped.values() for n, p in w.named_parameters() if n.endswith("fc1.weight")}
    assert hidden and all(shape[0] == 12 for shape in hidden)


@pytest.mark.parametrize("merged", [False, True])
def test_readme_lora_example_saves_a_folder_that_loads_and_predicts_the_same(tmp_path, merged):
    # README's Python API: lora.apply -> (train) -> save_adapter + save_pretrained; the folder used
    # to hold base_layer/lora_A keys that create_model refused ("missing keys")
    import domainfm

    torch.manual_seed(0)
    model = domainfm.create_model("cbramod-test", n_outputs=4, n_chans=4)
    lora.apply(model, ["*self_attn_*proj", "*linear1", "*linear2"], rank=8, alpha=16)  # as README
    with torch.no_grad():  # stands for training: non-zero adapters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.eval()
    x = torch.randn(2, 4, model.n_times)
    expected = model(x)
    lora.save_adapter(model, tmp_path / "adapter")
    if merged:
        lora.merge(model)
    domainfm.save_pretrained(model, tmp_path / "my-model")
    loaded = domainfm.create_model(tmp_path / "my-model").eval()
    torch.testing.assert_close(loaded(x), expected, rtol=1e-4, atol=1e-5)
    assert not any("lora_" in k or "base_layer" in k for k in loaded.state_dict())
    torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)  # the live model keeps its adapters
    assert lora.inject.wrappers(model)
