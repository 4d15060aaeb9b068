"""CBraMod: official-checkpoint fidelity, the criss-cross split, the positional conv, the surface."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import domainfm
from domainfm.models.cbramod import CBraMod, convert_official_state_dict, to_official_state_dict
from domainfm.models.cbramod.cbramod import CrissCrossLayer

sys.path.insert(0, str(Path(__file__).parents[1]))
from _cbramod_weights import random_official_cbramod  # noqa: E402

# ----------------------------------------------------------------------------------------------
# The reference: domainfm.models.cbramod.reference, a plain restatement of the official forward
# (nn.MultiheadAttention path, official key layout) that shares no code with the model.
# ----------------------------------------------------------------------------------------------


def _official_state_dict(n_layers=12, ffn=800, seed=0):
    """A random official-format state_dict (norms and biases perturbed too, mask encoding non-zero)."""
    ref = random_official_cbramod(n_layers, ffn, seed)
    return ref, {k: v.clone() for k, v in ref.state_dict().items()}


EXPECTED_OFFICIAL_KEYS = {
    "patch_embedding.mask_encoding",
    "patch_embedding.positional_encoding.0.weight", "patch_embedding.positional_encoding.0.bias",
    *(f"patch_embedding.proj_in.{i}.{w}" for i in (0, 1, 3, 4, 6, 7) for w in ("weight", "bias")),
    "patch_embedding.spectral_proj.0.weight", "patch_embedding.spectral_proj.0.bias",
    "proj_out.0.weight", "proj_out.0.bias",
}


@pytest.fixture(scope="module")
def official():
    ref, sd = _official_state_dict()
    return ref.eval(), sd


def test_reference_has_the_official_key_layout(official):
    _, sd = official
    layer_keys = {k for k in sd if k.startswith("encoder.")}
    assert set(sd) - layer_keys == EXPECTED_OFFICIAL_KEYS
    for i in range(12):
        for branch in ("s", "t"):
            assert sd[f"encoder.layers.{i}.self_attn_{branch}.in_proj_weight"].shape == (300, 100)
            assert sd[f"encoder.layers.{i}.self_attn_{branch}.in_proj_bias"].shape == (300,)
            assert sd[f"encoder.layers.{i}.self_attn_{branch}.out_proj.weight"].shape == (100, 100)
        assert sd[f"encoder.layers.{i}.linear1.weight"].shape == (800, 200)
    assert len(layer_keys) == 12 * (2 * 4 + 4 + 4)
    # 4,924,000 parameters, the official count (its mask encoding is a frozen parameter, ours a buffer)
    assert sum(v.numel() for v in sd.values()) == 4_924_000
    ours = CBraMod()
    assert sum(p.numel() for p in ours.parameters()) + ours.patch_embedding.mask_encoding.numel() == 4_924_000


def test_official_checkpoint_loads_with_no_missing_or_unexpected_keys(official, tmp_path):
    _, sd = official
    path = tmp_path / "pretrained_weights.pth"
    torch.save(sd, path)
    model = domainfm.create_model("cbramod-base", pretrained=str(path), converter="official")
    report = model.domainfm_load_report
    assert report.missing == [] and report.unexpected == [] and report.dropped_head == []
    converted = convert_official_state_dict(sd, model)
    assert set(converted) == set(model.state_dict())
    # and the inverse rename gives back the official file exactly
    back = to_official_state_dict(model)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_official_file_loads_through_create_model_without_converter_argument(official, tmp_path):
    """As a user calls it: no converter=; the upstream file is converted because it is upstream."""
    ref, sd = official
    path = tmp_path / "pretrained_weights.pth"
    torch.save(sd, path)
    model = domainfm.create_model("cbramod-base", pretrained=str(path)).eval()
    report = model.domainfm_load_report
    assert report.kind == "upstream" and report.converter == "official"
    assert report.missing == [] and report.unexpected == []
    explicit = domainfm.create_model("cbramod-base")
    explicit.load_state_dict(convert_official_state_dict(torch.load(path, weights_only=True), explicit), strict=True)
    explicit.eval()
    for key, value in explicit.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    x = torch.randn(2, 19, 600, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.forward_features(x)
        assert torch.equal(got, explicit.forward_features(x))
        torch.testing.assert_close(got, ref.features(x.view(2, 19, 3, 200)), rtol=0, atol=1e-5)


def test_converter_is_idempotent(official):
    _, sd = official
    for model in (CBraMod(), CBraMod(n_chans=4, n_times=400, n_outputs=3, n_layers=12, reconstruction_head=False)):
        own = model.state_dict()
        again = convert_official_state_dict(dict(own), model)  # our own keys: unchanged
        assert list(again) == list(own) and all(again[k] is own[k] for k in own)
        once = convert_official_state_dict(sd, model)
        twice = convert_official_state_dict(once, model)
        assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)


@pytest.mark.parametrize("shape", [(2, 19, 10), (3, 5, 3), (1, 22, 1)])
def test_matches_official_forward_to_1e5(official, shape):
    ref, sd = official
    model = CBraMod()
    model.load_state_dict(convert_official_state_dict(sd, model))
    model.eval()
    b, c, n = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(b, c, n * 200, generator=g)
    mask = torch.rand(b, c, n, generator=g) < 0.5
    with torch.no_grad():
        want_feat = ref.features(x.view(b, c, n, 200))
        want_rec = ref(x.view(b, c, n, 200), mask.long())
        got_feat = model.forward_features(x)
        got_rec = model.forward_reconstruction(x, mask)
    assert got_feat.shape == (b, c, n, 200) and got_rec.shape == (b, c, n, 200)
    torch.testing.assert_close(got_feat, want_feat, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_rec, want_rec, rtol=0, atol=1e-5)
    # the mask really is used: masked patches differ from the unmasked reconstruction
    with torch.no_grad():
        unmasked = model.forward_reconstruction(x, torch.zeros_like(mask))
    assert (unmasked - got_rec).abs().max() > 1e-2


@pytest.mark.parametrize("short", [False, True], ids=["sdpa", "short-attention"])
def test_train_mode_gradients_match_reference_without_dropout(monkeypatch, short):
    # with dropout off, train-mode gradients agree with the reference's too (fp64 for exactness),
    # through SDPA and through the short-sequence attention (otherwise chosen for bf16 on CPU only)
    from domainfm.models.cbramod import _fast

    monkeypatch.setattr(_fast, "use_short_attention", lambda *a: short)
    ref, sd = _official_state_dict(n_layers=2, ffn=64, seed=3)
    model = CBraMod(n_layers=2, dim_feedforward=64, dropout=0.0)
    model.load_state_dict(convert_official_state_dict(sd, model))
    ref, model = ref.double(), model.double()
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    x = torch.randn(2, 3, 4, 200, dtype=torch.float64)
    mask = torch.rand(2, 3, 4) < 0.5
    ref(x, mask.long()).square().mean().backward()
    model.forward_reconstruction(x, mask).square().mean().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        key = name.replace(".in_proj.weight", ".in_proj_weight").replace(".in_proj.bias", ".in_proj_bias")
        torch.testing.assert_close(p.grad, ref_grads[key].grad, rtol=1e-9, atol=1e-10, msg=name)


# ----------------------------------------------------------------------------------------------
# what each part attends to
# ----------------------------------------------------------------------------------------------


def _changed(a, b, tol=1e-7):
    return (a - b).abs().amax(dim=-1) > tol


def test_criss_cross_split_spatial_sees_channels_temporal_sees_patches():
    torch.manual_seed(0)
    layer = CrissCrossLayer(dropout=0.0).eval()
    c, n, h = 6, 5, 100
    x = torch.randn(1, c, n, 200)
    c0, n0 = 2, 3
    y = x.clone()
    y[0, c0, n0] += torch.randn(200)
    with torch.no_grad():
        a, b = layer._criss_cross(x)[0], layer._criss_cross(y)[0]
    spatial, temporal = _changed(a[..., :h], b[..., :h]), _changed(a[..., h:], b[..., h:])
    want_spatial = torch.zeros(c, n, dtype=torch.bool)
    want_spatial[:, n0] = True  # every channel at patch n0 (spatial attention across channels)
    want_temporal = torch.zeros(c, n, dtype=torch.bool)
    want_temporal[c0, :] = True  # every patch of channel c0 (temporal attention across patches)
    assert torch.equal(spatial, want_spatial)
    assert torch.equal(temporal, want_temporal)

    # changing only the temporal half of the input leaves every spatial output alone, and vice versa
    z = x.clone()
    z[0, c0, :, h:] += torch.randn(n, h)  # one channel's other patches, temporal dims
    with torch.no_grad():
        out = layer._criss_cross(z)[0]
    assert not _changed(a[..., :h], out[..., :h]).any()
    changed_t = _changed(a[..., h:], out[..., h:])
    assert changed_t[c0].all() and not changed_t[torch.arange(c) != c0].any()
    s = x.clone()
    s[0, :, n0, :h] += torch.randn(c, h)
    with torch.no_grad():
        out = layer._criss_cross(s)[0]
    assert not _changed(a[..., h:], out[..., h:]).any()
    changed_s = _changed(a[..., :h], out[..., :h])
    assert changed_s[:, n0].all() and not changed_s[:, torch.arange(n) != n0].any()


def test_asymmetric_positional_conv_reach_is_19_channels_by_7_patches():
    torch.manual_seed(0)
    model = CBraMod(n_layers=1).eval()
    pos = model.patch_embedding.positional_encoding
    c, n = 25, 11
    emb = torch.randn(1, 200, c, n)
    bumped = emb.clone()
    bumped[0, :, 12, 5] += 1.0
    with torch.no_grad():
        changed = _changed(pos(emb)[0].permute(1, 2, 0), pos(bumped)[0].permute(1, 2, 0))
    want = torch.zeros(c, n, dtype=torch.bool)
    want[12 - 9 : 12 + 10, 5 - 3 : 5 + 4] = True  # +-9 channels, +-3 patches
    assert torch.equal(changed, want)
    # padding keeps the grid for any size, one channel or one patch included
    for size in [(1, 1), (1, 30), (64, 4)]:
        assert model.patch_embedding(torch.randn(2, *size, 200)).shape == (2, *size, 200)


def test_patch_cnn_groupnorm_couples_the_patches_of_one_example_only():
    # The convolutions act within a patch, but GroupNorm(5, 25) takes its statistics over the
    # whole (C*N)-patch image of an example, as in the official model: changing one patch moves
    # every patch's embedding of that example, and nothing of another example.
    torch.manual_seed(0)
    pe = CBraMod(n_layers=1).patch_embedding.eval()
    x = torch.randn(2, 3, 4, 200)
    y = x.clone()
    y[0, 1, 2] = torch.randn(200) * 3
    with torch.no_grad():
        a, b = pe.proj_in(x.reshape(2, 1, 12, 200)), pe.proj_in(y.reshape(2, 1, 12, 200))
    assert (a[0] - b[0]).abs().amax(dim=(0, 2)).gt(1e-6).all()
    assert torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------------------------
# surface, heads, errors
# ----------------------------------------------------------------------------------------------


def test_surface_heads_and_reset_classifier():
    torch.manual_seed(0)
    model = domainfm.create_model("cbramod-test", n_chans=5, n_times=600, n_outputs=4).eval()
    x = torch.randn(3, 5, 600)
    feats = model.forward_features(x)
    assert feats.shape == (3, 5, 3, 200) and model.num_features == 200
    assert torch.equal(model.forward_features(x.view(3, 5, 3, 200)), feats)  # patched input too
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (3, 200)
    torch.testing.assert_close(model.head.fc(pre), model(x))
    assert model(x).shape == (3, 4)
    model.reset_classifier(2, head_type="avgpooling_patch_reps")
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.mean(dim=(1, 2)))
    assert model(x).shape == (3, 2)
    # the avg-pooling head accepts any C and N; all_patch_reps refuses another size clearly
    assert model(torch.randn(1, 7, 1000)).shape == (1, 2)
    other = domainfm.create_model("cbramod-test", n_chans=5, n_times=600)
    with pytest.raises(ValueError, match="built for 5 channels x 3 patches"):
        other(torch.randn(1, 4, 600))


def test_input_errors_are_clear():
    model = CBraMod(n_layers=1)
    with pytest.raises(ValueError, match="not a multiple of the 200-sample patch"):
        model.forward_features(torch.randn(1, 3, 250))
    with pytest.raises(ValueError, match=r"\(batch, n_chans, n_times\)"):
        model.forward_features(torch.randn(3, 400))
    with pytest.raises(ValueError, match="sfreq=256"):
        CBraMod(sfreq=256)
    with pytest.raises(ValueError, match="n_times=300"):
        CBraMod(n_times=300)
    with pytest.raises(ValueError, match="needs n_chans and n_times"):
        CBraMod(n_outputs=2)
    with pytest.raises(ValueError, match="mask shape"):
        model.forward_reconstruction(torch.randn(1, 3, 400), torch.zeros(1, 3, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="no classifier head"):
        model(torch.randn(1, 3, 400))
    with pytest.raises(RuntimeError, match="reconstruction_head=False"):
        CBraMod(n_layers=1, reconstruction_head=False).forward_reconstruction(
            torch.randn(1, 3, 400), torch.zeros(1, 3, 2, dtype=torch.bool))


def test_finetuned_official_checkpoint_maps_backbone_and_classifier():
    _, sd = _official_state_dict(n_layers=2, ffn=64, seed=1)
    torch.manual_seed(1)
    classifier = nn.Sequential(nn.Identity(), nn.Linear(4 * 2 * 200, 2 * 200), nn.ELU(), nn.Dropout(),
                               nn.Linear(400, 200), nn.ELU(), nn.Dropout(), nn.Linear(200, 3))
    finetuned = {f"backbone.{k}": v for k, v in sd.items() if not k.startswith("proj_out")}
    finetuned.update({f"classifier.{k}": v for k, v in classifier.state_dict().items()})
    model = CBraMod(n_chans=4, n_times=400, n_outputs=3, n_layers=2, dim_feedforward=64, reconstruction_head=False)
    converted = convert_official_state_dict(finetuned, model)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted)
    assert torch.equal(model.head.fc.weight, classifier[7].weight)
    assert torch.equal(model.head.pre_logits[1].weight, classifier[1].weight)
    # the reconstruction head of a pretrained file is dropped for a model built without it
    assert not any(k.startswith("proj_out") for k in convert_official_state_dict(sd, model))


def test_pretrained_true_offline_names_the_file(monkeypatch):
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    with pytest.raises(domainfm.hub.HubError, match="pretrained_weights.pth"):
        domainfm.create_model("cbramod-base", pretrained=True)
