"""Adapters saved by domainfm read by PEFT (``PeftModel.from_pretrained``) with the same outputs,
adapters PEFT has no layer for refused by PEFT with the reason, and our own loader reading our new
files, files from before ``domainfm_target_patterns``, and files written by PEFT."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from domainfm import lora

import peft  # noqa: E402  (in the test extra)
import timm  # noqa: E402


def _vit():
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, num_classes=3).eval()


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return model.eval()


class _Nested(nn.Module):
    """``fc`` at the top and ``inner.fc``: the name ``fc`` alone would also suffix-match ``inner.fc`` in PEFT."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 6)
        self.inner = nn.Sequential()
        self.inner.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.inner.fc(torch.tanh(self.fc(x)))


def _perturb(model, seed=1):
    """Random non-zero B (a fresh adapter is a no-op) and changed unfrozen parameters / BN stats."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for module in model.modules():  # statistics of an unfrozen BatchNorm (trained with it)
            if isinstance(module, nn.BatchNorm1d) and module.weight.requires_grad:
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=g))


CASES = {
    "vit-lora": (_vit, dict(targets=["blocks.*.attn.qkv", "blocks.*.attn.proj", "blocks.*.mlp.fc2", "patch_embed.proj"],
                            unfreeze=["head.*", "blocks.1.norm2.*"]), lambda: torch.randn(2, 3, 32, 32)),
    "vit-dora-rslora": (_vit, dict(targets=["blocks.*.mlp.fc*"], variant="dora", use_rslora=True, unfreeze=["head.*"]),
                        lambda: torch.randn(2, 3, 32, 32)),
    "sequential": (_mlp, dict(targets=["0", "3"], unfreeze=["1.*", "5.*"]), lambda: torch.randn(5, 8)),
    "suffix-clash": (_Nested, dict(targets=["fc"]), lambda: torch.randn(4, 6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_our_adapter_with_equal_outputs(tmp_path, case):
    make, kwargs, example = CASES[case]
    kwargs = dict(kwargs)
    base = make()
    model = copy.deepcopy(base)
    targets = kwargs.pop("targets")
    lora.apply(model, targets, rank=4, alpha=8, base_model_name="toy", **kwargs)
    _perturb(model)
    model.eval()
    torch.manual_seed(5)
    x = example()
    with torch.no_grad():
        ours = model(x)
        assert not torch.allclose(ours, base(x), atol=1e-3)  # the adapter does something
    lora.save_adapter(model, tmp_path)

    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    wrapped = sorted(lora._wrappers(model))
    assert cfg["domainfm_target_patterns"] == targets and cfg["domainfm_peft_compatible"] is True
    assert cfg["domainfm_peft_incompatible"] is None
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] is None and cfg["bias"] == "none"
    assert cfg["fan_in_fan_out"] is False and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["use_dora"] is (kwargs.get("variant") == "dora") and cfg["use_rslora"] is kwargs.get("use_rslora", False)
    if case == "suffix-clash":  # a list entry "fc" would also adapt inner.fc in PEFT: an exact regex instead
        assert cfg["target_modules"] == "(?:fc)"
    else:
        assert cfg["target_modules"] == wrapped
    expected_mts = {"vit-lora": ["blocks.1.norm2", "head"], "vit-dora-rslora": ["head"], "sequential": ["1", "5"],
                    "suffix-clash": None}[case]
    assert cfg["modules_to_save"] == expected_mts
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert {f"base_model.model.{w}.lora_{f}.weight" for w in wrapped for f in "AB"} <= keys
    if case == "sequential":  # BatchNorm in modules_to_save: its running statistics travel too (PEFT wants them)
        assert {"base_model.model.1.running_mean", "base_model.model.1.running_var",
                "base_model.model.1.num_batches_tracked"} <= keys

    fresh = copy.deepcopy(base)
    with pytest.warns(UserWarning, match="Unexpected keyword arguments"):  # our own keys, ignored by PEFT
        peft_model = peft.PeftModel.from_pretrained(fresh, str(tmp_path)).eval()
    peft_layers = [n for n, m in peft_model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert sorted(n.removeprefix("base_model.model.") for n in peft_layers) == wrapped
    with torch.no_grad():
        theirs = peft_model(x)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)

    # our own loader still round-trips the new file
    again = lora.load_adapter(copy.deepcopy(base), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours, rtol=0, atol=0)


def test_sliced_adapter_is_marked_and_refused_by_peft(tmp_path):
    base = _vit()
    model = lora.apply(copy.deepcopy(base), ["blocks.*.attn.qkv@q,v"], rank=4, alpha=8, unfreeze=["head.*"])
    _perturb(model)
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = model(x)
    lora.save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["domainfm_peft_compatible"] is False
    assert "fused-projection slices" in cfg["domainfm_peft_incompatible"] and "blocks.0.attn.qkv" in cfg["domainfm_peft_incompatible"]
    assert cfg["domainfm_target_patterns"] == ["blocks.*.attn.qkv@q,v"]
    # PEFT refuses instead of loading an adapter that would do nothing (modules_to_save keeps our
    # unfreeze globs in such a file, so PEFT's message is its "no modules were targeted" one)
    with pytest.warns(UserWarning), pytest.raises(peft.tuners.tuners_utils.NoMatchingPeftModuleError):
        peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    loaded = lora.load_adapter(copy.deepcopy(base), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), ours, rtol=0, atol=0)


def test_replora_on_plain_names_is_refused_by_peft_with_the_reason(tmp_path):
    base = _mlp()
    model = lora.apply(copy.deepcopy(base), ["0", "3"], rank=2, variant="replora", replora_hidden=4)
    _perturb(model)
    lora.save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["domainfm_peft_compatible"] is False and "RepLoRA" in cfg["domainfm_peft_incompatible"]
    # "0" and "3" would match in PEFT: they are replaced by an entry that matches nothing and says why
    assert len(cfg["target_modules"]) == 1 and cfg["target_modules"][0].startswith("domainfm-only-adapter:RepLoRA")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="domainfm-only-adapter:RepLoRA"):
        peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    x = torch.randn(5, 8)
    model.eval()
    loaded = lora.load_adapter(copy.deepcopy(base), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("unfreeze, reason", [
    (["cls_token"], "'cls_token', a parameter of the root module"),
    # PEFT wraps every module whose name ends with the entry: "norm" would also take q_norm, norm1, ...
    (["norm.*"], "modules_to_save entry 'norm' would also match"),
    (["head.bias"], "not every parameter"),
])
def test_unfreeze_peft_cannot_express_is_marked(tmp_path, unfreeze, reason):
    model = lora.apply(_vit(), ["blocks.0.attn.proj"], rank=2, unfreeze=unfreeze)
    lora.save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["domainfm_peft_compatible"] is False and reason in cfg["domainfm_peft_incompatible"]
    # the plain name would match in PEFT, which would then train other modules than ours: refused
    assert cfg["target_modules"] == [cfg["target_modules"][0]] and cfg["target_modules"][0].startswith("domainfm-only-adapter:")
    with pytest.warns(UserWarning), pytest.raises(peft.tuners.tuners_utils.NoMatchingPeftModuleError):
        peft.PeftModel.from_pretrained(_vit(), str(tmp_path))


def test_files_from_before_the_peft_layout_still_load(tmp_path):
    """Earlier files held our globs in target_modules and unfreeze globs in modules_to_save."""
    base = _vit()
    model = lora.apply(copy.deepcopy(base), ["blocks.*.attn.qkv"], rank=4, alpha=8, unfreeze=["head.*"])
    _perturb(model)
    model.eval()
    lora.save_adapter(model, tmp_path)
    path = tmp_path / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for key in ("domainfm_target_patterns", "domainfm_peft_compatible", "domainfm_peft_incompatible"):
        del cfg[key]
    cfg["target_modules"], cfg["modules_to_save"] = ["blocks.*.attn.qkv"], ["head.*"]
    path.write_text(json.dumps(cfg))
    x = torch.randn(2, 3, 32, 32)
    loaded = lora.load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert sorted(lora._wrappers(loaded)) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_we_read_an_adapter_written_by_peft(tmp_path):
    base = _vit()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "fc2"], modules_to_save=["head"])
    peft_model = peft.get_peft_model(copy.deepcopy(base), config)
    _perturb(peft_model)
    peft_model.eval()
    peft_model.save_pretrained(str(tmp_path))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs = peft_model(x)
    with pytest.warns(UserWarning, match="no base_model_sha256"):
        ours = lora.load_adapter(copy.deepcopy(base), tmp_path).eval()
    assert sorted(lora._wrappers(ours)) == [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "mlp.fc2")]
    assert {n for n, p in ours.named_parameters() if p.requires_grad and "lora" not in n} == {"head.weight", "head.bias"}
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs, rtol=0, atol=1e-6)
