"""CBraMod from braindecode's files: its state_dict layout and its Hub folders (issue #26).

The stand-in weights are written here in braindecode 1.8's layout, restated from its module tree
(``braindecode/models/cbramod.py``: ``patch_embedding``, ``encoder.layers.{i}`` with
``nn.MultiheadAttention`` per branch, ``proj_out = Sequential(Linear(d, emb_dim))``, and the task
head ``final_layer = Sequential(Flatten(), Linear(n_chans * n_patches * emb_dim, n_outputs))``
applied to ``proj_out``'s output), and saved as braindecode's ``push_to_hub`` writes a folder:
``config.json`` (``EEGModuleMixin``'s init keywords + ``braindecode_version``; ``chs_info`` locations
of a channel without a montage are NaN, which ``json.dump`` writes as ``NaN``), ``model.safetensors``
(no metadata), ``pytorch_model.bin`` and ``README.md``. The backbone reference is
:mod:`domainfm.models.cbramod.reference`, the official forward restated independently of our model.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from safetensors.torch import save_file

import domainfm
from domainfm.models.cbramod import convert_official_state_dict

sys.path.insert(0, str(Path(__file__).parents[1]))
from _cbramod_weights import random_official_cbramod  # noqa: E402
from test_hub_hf import fake_hub  # noqa: E402,F401  (the fixture: a local server answering like the Hub)

N_CHANS, N_TIMES, N_OUTPUTS, N_LAYERS, FFN = 4, 400, 3, 2, 64  # cbramod-test's sizes
N_PATCHES, EMB_DIM = N_TIMES // 200, 200


def braindecode_keys(n_layers: int, with_head: bool) -> set[str]:
    """braindecode CBraMod's state_dict keys, from its module tree (not from our model)."""
    keys = {"patch_embedding.mask_encoding",  # an nn.Parameter(requires_grad=False) there
            "patch_embedding.positional_encoding.0.weight", "patch_embedding.positional_encoding.0.bias",
            "patch_embedding.spectral_proj.0.weight", "patch_embedding.spectral_proj.0.bias",
            "proj_out.0.weight", "proj_out.0.bias"}
    # proj_in: (Conv2d, GroupNorm, GELU) x 3
    keys |= {f"patch_embedding.proj_in.{i}.{w}" for i in (0, 1, 3, 4, 6, 7) for w in ("weight", "bias")}
    for i in range(n_layers):
        for branch in ("s", "t"):
            attn = f"encoder.layers.{i}.self_attn_{branch}"
            keys |= {f"{attn}.in_proj_weight", f"{attn}.in_proj_bias",
                     f"{attn}.out_proj.weight", f"{attn}.out_proj.bias"}
        keys |= {f"encoder.layers.{i}.{m}.{w}"
                 for m in ("linear1", "linear2", "norm1", "norm2") for w in ("weight", "bias")}
    if with_head:
        keys |= {"final_layer.1.weight", "final_layer.1.bias"}  # final_layer.0 is the Flatten
    return keys


def braindecode_checkpoint(seed: int = 0, with_head: bool = True):
    """(reference backbone, braindecode-layout state_dict, final_layer's Linear or None)."""
    ref = random_official_cbramod(N_LAYERS, FFN, seed).eval()
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    linear = None
    if with_head:
        g = torch.Generator().manual_seed(seed + 100)
        linear = torch.nn.Linear(N_CHANS * N_PATCHES * EMB_DIM, N_OUTPUTS)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.01)
            linear.bias.copy_(torch.randn(N_OUTPUTS, generator=g))
        sd["final_layer.1.weight"] = linear.weight.detach().clone()
        sd["final_layer.1.bias"] = linear.bias.detach().clone()
    assert set(sd) == braindecode_keys(N_LAYERS, with_head)
    return ref, sd, linear


def braindecode_config(*, with_head: bool = True, **override) -> dict:
    """config.json as braindecode 1.8 writes it for ``CBraMod(n_chans=4, n_times=400, sfreq=200,
    n_outputs=3, n_layer=2, dim_feedforward=64, chs_info=...)``."""
    chs_info = [{"ch_name": name, "kind": 2, "coil_type": 1, "unit": 107, "cal": 1.0, "range": 1.0,
                 "loc": [float("nan")] * 12} for name in ("C3", "Cz", "C4", "Pz")]
    config = {
        "n_outputs": N_OUTPUTS if with_head else None, "n_chans": N_CHANS, "chs_info": chs_info,
        "n_times": N_TIMES, "input_window_seconds": None, "sfreq": 200, "patch_size": 200,
        "dim_feedforward": FFN, "n_layer": N_LAYERS, "nhead": 8, "activation": "torch.nn.modules.activation.GELU",
        "emb_dim": EMB_DIM,
        "channels_kernel_stride_padding_norm": [[25, 49, 25, 24, [5, 25]], [25, 3, 1, 1, [5, 25]],
                                                [25, 3, 1, 1, [5, 25]]],
        "drop_prob": 0.1, "return_encoder_output": not with_head, "braindecode_version": "1.8.1",
    }
    config.update(override)
    return config


def write_braindecode_folder(folder: Path, sd: dict, config: dict, *, safetensors: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(sd, folder / "pytorch_model.bin")
    if safetensors:
        save_file(sd, str(folder / "model.safetensors"))
    (folder / "README.md").write_text("---\nlibrary_name: braindecode\n---\n# CBraMod\n")
    return folder


def _x(seed=3):
    return torch.randn(2, N_CHANS, N_TIMES, generator=torch.Generator().manual_seed(seed))


def test_braindecode_classifier_folder_loads_strictly_and_reproduces_braindecode_logits(tmp_path):
    ref, sd, linear = braindecode_checkpoint()
    folder = write_braindecode_folder(tmp_path / "cbramod-bd", sd, braindecode_config())
    with pytest.warns(UserWarning, match=r"final_layer\.1\.weight.*fresh initialisation"):
        model = domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=N_OUTPUTS)
    model.eval()
    report = model.domainfm_load_report
    assert report.kind == "upstream" and report.converter == "official"
    assert report.unexpected == [] and report.dropped_head == []
    # only our head is missing: braindecode's classifier matches none of our head types
    assert report.missing and all(k.startswith("head.") for k in report.missing)
    assert set(report.missing) == {k for k in model.state_dict() if k.startswith("head.")}
    x = _x()
    with torch.no_grad():
        feats = model.forward_features(x)
        # braindecode's logits: final_layer(proj_out(encoder(patch_embedding(x)))), by hand on the
        # reference backbone, and on ours (its proj_out loaded from the same file)
        want = F.linear(ref(x.view(2, N_CHANS, N_PATCHES, 200)).flatten(1), linear.weight, linear.bias)
        got = F.linear(model.proj_out(feats).flatten(1), linear.weight, linear.bias)
        logits = model(x)
    torch.testing.assert_close(feats, ref.features(x.view(2, N_CHANS, N_PATCHES, 200)), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert want.abs().max() > 1.0  # the logits are not trivially small
    assert logits.shape == (2, N_OUTPUTS) and torch.isfinite(logits).all()


@pytest.mark.parametrize("safetensors", [True, False], ids=["model.safetensors", "pytorch_model.bin only"])
def test_braindecode_backbone_folder_loads_with_no_missing_or_unexpected_keys(tmp_path, safetensors):
    ref, sd, _ = braindecode_checkpoint(seed=1, with_head=False)
    folder = write_braindecode_folder(tmp_path / "bd", sd, braindecode_config(with_head=False), safetensors=safetensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no classifier in the file: nothing to warn about
        model = domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=None).eval()
        with_head = domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=5)
    report = model.domainfm_load_report
    assert report.missing == [] and report.unexpected == [] and report.kind == "upstream"
    assert all(k.startswith("head.") for k in with_head.domainfm_load_report.missing)
    x = _x(4)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref.features(x.view(2, N_CHANS, N_PATCHES, 200)),
                                   rtol=0, atol=1e-5)


def test_converter_takes_braindecode_keys_idempotently_and_keeps_the_official_behaviour():
    _, sd, _ = braindecode_checkpoint(seed=2)
    model = domainfm.create_model("cbramod-test", n_outputs=None)
    once = convert_official_state_dict(sd, model)
    assert set(once) == set(model.state_dict())  # final_layer gone, in_proj renamed, nothing else
    twice = convert_official_state_dict(once, model)
    assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)
    official = {k: v for k, v in sd.items() if not k.startswith("final_layer.")}
    assert set(convert_official_state_dict(official, model)) == set(once)


@pytest.mark.parametrize("field, value, message", [
    ("n_chans", 5, r"n_chans=5 but chs_info lists 4 channels"),
    ("n_times", 600,
     r"n_chans=4, n_times=600 give final_layer an input of .* = 2400, but final_layer\.1\.weight has 1600"),
    ("n_outputs", 2, r"n_outputs=2 but final_layer\.1\.weight has 3 outputs"),
    ("nhead", 4, r"nhead=4 but the model has n_heads=8"),
    ("n_layer", 3, r"n_layer=3 but the model has n_layers=2"),
    ("sfreq", 250, r"sfreq=250 but this CBraMod works on 200 Hz"),
    ("activation", "torch.nn.modules.activation.ELU", r"activation=.*ELU.* uses GELU"),
])
def test_a_braindecode_config_that_disagrees_is_a_clear_error(tmp_path, field, value, message):
    _, sd, _ = braindecode_checkpoint(seed=3)
    config = braindecode_config(**{field: value})
    if field == "n_chans":
        config_without_chs = braindecode_config(n_chans=value, chs_info=None)
        folder = write_braindecode_folder(tmp_path / "no-chs", sd, config_without_chs)
        with pytest.raises(ValueError, match=r"config\.json.*n_chans=5, n_times=400 give final_layer an input of "
                                             r"5 x 2 patches x 200 = 2000, but final_layer\.1\.weight has 1600"):
            domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=N_OUTPUTS)
    folder = write_braindecode_folder(tmp_path / "bd", sd, config)
    with pytest.raises(ValueError, match=r"config\.json \(braindecode CBraMod\).*" + message):
        domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=N_OUTPUTS)


def test_a_braindecode_repo_loads_through_hf_url(fake_hub, domainfm_home):  # noqa: F811
    ref, sd, _ = braindecode_checkpoint(seed=4)
    repo = "braindecode/cbramod-tiny"
    fake_hub.add(repo, "config.json", json.dumps(braindecode_config(), indent=2).encode(), lfs=False)
    fake_hub.add(repo, "model.safetensors", safetensors_bytes(sd))
    with pytest.warns(UserWarning, match="final_layer"):
        model = domainfm.create_model("cbramod-test", pretrained=f"hf://{repo}", n_outputs=N_OUTPUTS).eval()
    report = model.domainfm_load_report
    assert report.source == f"hf://{repo}" and report.unexpected == []
    assert all(k.startswith("head.") for k in report.missing)
    assert model.domainfm_upstream_config["braindecode_version"] == "1.8.1"
    x = _x(5)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref.features(x.view(2, N_CHANS, N_PATCHES, 200)),
                                   rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the flatten_emb head


def braindecode_logits(ref, sd: dict, x: torch.Tensor) -> torch.Tensor:
    """braindecode's forward, ``final_layer(proj_out(encoder(patch_embedding(x))))``, by hand from
    the weights dict on the reference backbone (not through our head)."""
    feats = ref.features(x.view(x.shape[0], x.shape[1], -1, 200))  # (B, C, N, d)
    emb = F.linear(feats, sd["proj_out.0.weight"], sd["proj_out.0.bias"])  # (B, C, N, emb_dim)
    return F.linear(emb.flatten(1), sd["final_layer.1.weight"], sd["final_layer.1.bias"])


def test_flatten_emb_head_loads_braindecode_classifier_strictly_and_gives_its_logits(tmp_path):
    ref, sd, _ = braindecode_checkpoint(seed=5)
    folder = write_braindecode_folder(tmp_path / "bd", sd, braindecode_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the classifier is kept: nothing to warn about
        model = domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb",
                                      n_outputs=N_OUTPUTS).eval()
    report = model.domainfm_load_report
    assert report.missing == [] and report.unexpected == [] and report.dropped_head == []
    x = _x(6)
    with torch.no_grad():
        want = braindecode_logits(ref, sd, x)
        logits = model(x)
        pre = model.forward_head(model.forward_features(x), pre_logits=True)
    assert want.abs().max() > 1.0  # the logits are not trivially small
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
    assert pre.shape == (2, N_CHANS * N_PATCHES * EMB_DIM) == (2, model.num_features)
    # the backbone's reconstruction proj_out and the head's projection are separate modules
    assert model.proj_out[0] is not model.head.pre_logits[0]


def test_flatten_emb_head_with_other_n_outputs_is_dropped_as_a_resized_classifier(tmp_path):
    _, sd, _ = braindecode_checkpoint(seed=6)
    folder = write_braindecode_folder(tmp_path / "bd", sd, braindecode_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb", n_outputs=5)
    report = model.domainfm_load_report
    assert sorted(report.dropped_head) == ["head.fc.bias", "head.fc.weight"]
    assert report.missing == [] and report.unexpected == []
    assert model.head.fc.weight.shape == (5, N_CHANS * N_PATCHES * EMB_DIM)
    # the projection is braindecode's proj_out, which still fits
    torch.testing.assert_close(model.head.pre_logits[0].weight, sd["proj_out.0.weight"], rtol=0, atol=0)


def test_flatten_emb_head_for_other_signal_sizes_loads_no_half_classifier(tmp_path):
    _, sd, _ = braindecode_checkpoint(seed=7)
    folder = write_braindecode_folder(tmp_path / "bd", sd, braindecode_config())
    with pytest.warns(UserWarning, match=r"takes 1600 inputs but .* takes 2400.* build the model with "
                                         r"head_type='flatten_emb', n_chans=4, n_times=400, n_outputs=3"):
        model = domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb",
                                      n_times=600, n_outputs=N_OUTPUTS)
    report = model.domainfm_load_report
    # the weight is dropped as a resized head; its bias (same shape) is withheld, not loaded alone
    assert report.dropped_head == ["head.fc.weight"] and report.missing == ["head.fc.bias"]
    assert not torch.equal(model.head.fc.bias, sd["final_layer.1.bias"])


def test_drop_warning_names_the_keywords_that_keep_braindecode_classifier(tmp_path):
    _, sd, _ = braindecode_checkpoint(seed=8)
    keywords = "head_type='flatten_emb', n_chans=4, n_times=400, n_outputs=3"
    # a Hub folder: n_chans from chs_info, n_times from input_window_seconds * sfreq
    config = braindecode_config(n_chans=None, n_times=None, input_window_seconds=2.0)
    folder = write_braindecode_folder(tmp_path / "bd", sd, config)
    with pytest.warns(UserWarning) as record:
        domainfm.create_model("cbramod-test", pretrained=str(folder), n_outputs=N_OUTPUTS)
    message = str(next(w.message for w in record if "final_layer" in str(w.message)))
    assert "head_type='all_patch_reps'" in message and "fresh initialisation" in message
    assert f"pass {keywords} (create_model('cbramod-test', pretrained=..., {keywords}))" in message
    # ... and taking the advice keeps it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb",
                                     n_chans=4, n_times=400, n_outputs=3)
    assert kept.domainfm_load_report.missing == [] and kept.domainfm_load_report.dropped_head == []
    # a bare state_dict (no config.json) into a model of other sizes: the product the file fixes
    torch.save(sd, tmp_path / "bare.pt")
    with pytest.warns(UserWarning, match=r"pass head_type='flatten_emb', n_chans=C, n_times=200\*N with "
                                         r"C\*N = 1600/200 = 8, n_outputs=3"):
        domainfm.create_model("cbramod-test", pretrained=str(tmp_path / "bare.pt"), n_times=600, n_outputs=2)


def test_flatten_emb_with_another_emb_dim(tmp_path):
    ref, sd, _ = braindecode_checkpoint(seed=9, with_head=False)
    g = torch.Generator().manual_seed(9)
    emb_dim = 40
    sd["proj_out.0.weight"] = torch.randn(emb_dim, 200, generator=g) * 0.1
    sd["proj_out.0.bias"] = torch.randn(emb_dim, generator=g)
    sd["final_layer.1.weight"] = torch.randn(N_OUTPUTS, N_CHANS * N_PATCHES * emb_dim, generator=g) * 0.05
    sd["final_layer.1.bias"] = torch.randn(N_OUTPUTS, generator=g)
    folder = write_braindecode_folder(tmp_path / "bd", sd, braindecode_config(emb_dim=emb_dim))
    with pytest.raises(ValueError, match=r"emb_dim=40: braindecode's proj_out .* pass reconstruction_head=False"):
        domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb", emb_dim=emb_dim)
    model = domainfm.create_model("cbramod-test", pretrained=str(folder), head_type="flatten_emb", emb_dim=emb_dim,
                                  reconstruction_head=False).eval()
    assert model.domainfm_load_report.missing == [] and model.domainfm_load_report.unexpected == []
    x = _x(7)
    with torch.no_grad():
        torch.testing.assert_close(model(x), braindecode_logits(ref, sd, x), rtol=0, atol=1e-5)
    assert model.num_features == N_CHANS * N_PATCHES * emb_dim


def test_converter_with_flatten_emb_is_idempotent_and_keeps_our_own_head_projection():
    _, sd, _ = braindecode_checkpoint(seed=10)
    model = domainfm.create_model("cbramod-test", head_type="flatten_emb", n_outputs=N_OUTPUTS)
    once = convert_official_state_dict(sd, model)
    assert set(once) == set(model.state_dict())
    assert once["head.fc.weight"] is sd["final_layer.1.weight"]
    assert once["head.pre_logits.0.weight"] is once["proj_out.0.weight"] is sd["proj_out.0.weight"]
    twice = convert_official_state_dict(once, model)
    assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)
    # our own file, fine-tuned: its head projection has left the reconstruction proj_out behind
    tuned = {**once, "head.pre_logits.0.weight": once["head.pre_logits.0.weight"] + 1.0}
    assert convert_official_state_dict(tuned, model)["head.pre_logits.0.weight"] is tuned["head.pre_logits.0.weight"]


def test_flatten_emb_model_surface():
    """What tests/test_all_models.py checks of the registered default head, for this head."""
    model = domainfm.create_model("cbramod-test", head_type="flatten_emb").eval()
    x = _x(8)
    with torch.no_grad():
        features = model.forward_features(x)
        pre = model.forward_head(features, pre_logits=True)
        logits = model.forward_head(features)
        # (forward runs per-thread shards of the batch: the same sums in another blocking)
        torch.testing.assert_close(model(x), logits, rtol=0, atol=1e-5)
        assert torch.equal(model.forward_head(features), logits)  # one process, one machine
    assert pre.shape == (2, model.num_features) and logits.shape == (2, N_OUTPUTS)
    body = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("head.")}
    model.reset_classifier(N_OUTPUTS + 3)
    assert model.head.head_type == "flatten_emb" and model.num_features == pre.shape[1]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in body.items())
    with torch.no_grad():
        assert model.forward_head(features).shape == (2, N_OUTPUTS + 3)
    # braindecode's final_layer keeps PyTorch's default init: fresh logits of the input's scale
    assert logits.abs().max() < 10 * features.abs().max()
    model.reset_classifier(2, head_type="avgpooling_patch_reps")
    assert model.num_features == 200


@pytest.mark.parametrize("kwargs, message", [
    ({"n_chans": None}, r"head_type='flatten_emb' .* needs n_chans and n_times \(got n_chans=None"),
    ({"n_times": None}, r"head_type='flatten_emb' .* needs n_chans and n_times"),
    ({"emb_dim": 40, "head_type": "all_patch_reps"}, r"emb_dim=40: .* only for head_type='flatten_emb'"),
])
def test_flatten_emb_rejects_what_it_cannot_build(kwargs, message):
    with pytest.raises(ValueError, match=message):
        domainfm.create_model("cbramod-test", **{"head_type": "flatten_emb", **kwargs})
