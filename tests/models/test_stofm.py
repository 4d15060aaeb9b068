"""SToFM: official-checkpoint fidelity (transformer and cell encoder), the distance bias, the surface."""
from __future__ import annotations

import json

import pytest
import torch

import domainfm
from domainfm.models.stofm import (SToFM, convert_official_state_dict, load_official, load_official_cell_encoder,
                                   to_official_state_dict)
from domainfm.models.stofm.reference import RefSToFM
from domainfm.models.stofm.stofm import GaussianDistanceBias

TEST_SHAPE = dict(input_dim=256, dim=32, layers=2, heads=4, ffn=32, k=16)


def _official(seed=0, heads_for_pretraining=False, **shape):
    """A random official-layout model: every parameter perturbed (norms, biases, kernels)."""
    shape = {**TEST_SHAPE, **shape}
    torch.manual_seed(seed)
    ref = RefSToFM(**shape, heads_for_pretraining=heads_for_pretraining).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
        # an affine map into the kernels' range, so every kernel sees the distances
        ref.gaussian.linear.weight.fill_(0.07)
        ref.gaussian.linear.bias.fill_(0.1)
        ref.gaussian.means.weight.uniform_(0, 6)
        ref.gaussian.stds.weight.uniform_(0.3, 2)
    return ref


def _batch(lengths=(23, 15), n_hyper=3, input_dim=256, seed=1):
    """Padded sub-slices laid out as the data loader makes them: [CLS], hypernodes, cells; kNN
    distances (k=5) symmetrised, 100 for non-neighbours, full hypernode rows, 0 on CLS/diagonal/pad."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(lengths), max(lengths)
    emb = torch.zeros(b, n, input_dim)
    types = torch.full((b, n), 3, dtype=torch.long)
    dist = torch.zeros(b, n, n)
    for i, m in enumerate(lengths):
        xy = torch.rand(m, 2, generator=g) * 60 - 30
        full = torch.cdist(xy, xy)
        knn = full.topk(6, largest=False).indices
        adj = torch.zeros(m, m, dtype=torch.bool)
        adj.scatter_(1, knn, True)
        adj |= adj.t().clone()
        adj[1:1 + n_hyper, :] = True
        adj[:, 1:1 + n_hyper] = True
        d = torch.where(adj, full, torch.full_like(full, 100.0))
        d[0, :] = 0
        d[:, 0] = 0
        d.fill_diagonal_(0)
        dist[i, :m, :m] = d
        emb[i, 1:m] = torch.randn(m - 1, input_dim, generator=g)
        emb[i, 3] = -100.0  # a masked cell, as in pretraining
        types[i, :m] = 0
        types[i, 0] = 1
        types[i, 1:1 + n_hyper] = 2
    return emb, dist, types


OFFICIAL_LAYER_KEYS = {
    *(f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")),
    "self_attn.out_proj.weight", "self_attn.out_proj.bias",
    *(f"{m}.{w}" for m in ("self_attn_layer_norm", "fc1", "fc2", "final_layer_norm") for w in ("weight", "bias")),
}
OFFICIAL_TOP_KEYS = {
    "embedding_layer.weight", "embedding_layer.bias", "token_type_embeddings.weight",
    "gaussian.linear.weight", "gaussian.linear.bias", "gaussian.means.weight", "gaussian.stds.weight",
    "gaussian.proj.0.weight", "gaussian.proj.0.bias", "gaussian.proj.2.weight", "gaussian.proj.2.bias",
}


def test_reference_has_the_official_key_layout_and_released_size():
    sd = RefSToFM().state_dict()
    layer_keys = {k for k in sd if k.startswith("encoder.layers.")}
    assert set(sd) - layer_keys == OFFICIAL_TOP_KEYS
    assert layer_keys == {f"encoder.layers.{i}.{k}" for i in range(12) for k in OFFICIAL_LAYER_KEYS}
    assert sd["gaussian.means.weight"].shape == (1, 128) and sd["gaussian.proj.2.weight"].shape == (32, 128)
    ours = domainfm.create_model("stofm-base")
    assert set(to_official_state_dict(ours)) == set(sd)
    assert sum(p.numel() for p in ours.parameters()) == sum(v.numel() for v in sd.values())


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_official_checkpoint_loads_by_path_and_matches_the_reference(tmp_path, grad):
    ref = _official()
    path = tmp_path / "se2transformer.pth"
    torch.save(ref.state_dict(), path)
    model = domainfm.create_model("stofm-test", pretrained=str(path), n_outputs=None).eval()
    report = model.domainfm_load_report
    assert report.missing == [] and report.unexpected == [] and report.dropped_head == []
    emb, dist, types = _batch()
    with torch.no_grad():
        ref_h, ref_pair = ref(emb, dist, types)
    with torch.set_grad_enabled(grad):
        h, pair = model.forward_features(emb, dist, types, return_pair=True)
    assert h.shape == (2, 23, 32) and pair.shape == (2, 23, 23, 4)
    valid = types != 3
    assert ref_h.abs().max() > 0.5  # a non-trivial output
    torch.testing.assert_close(h[valid], ref_h[valid], atol=1e-5, rtol=1e-5)
    # the pair representation (last logits) on real rows, padding columns 0 in both
    torch.testing.assert_close(pair[valid], ref_pair[valid], atol=1e-5, rtol=1e-5)
    assert (pair[1, :, 15:] == 0).all()


def test_padding_does_not_change_a_sub_slice():
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    emb, dist, types = _batch(lengths=(15, 23))
    alone = tuple(t[:1, :15] if t.dim() == 2 else t[:1, :15, :15] if t.shape[-1] == t.shape[1] else t[:1, :15]
                  for t in (emb, dist, types))
    with torch.no_grad():
        padded = model.forward_features(emb, dist, types)[0, :15]
        single = model.forward_features(*alone)[0]
    torch.testing.assert_close(padded, single, atol=1e-5, rtol=1e-5)


def test_pretraining_checkpoint_with_heads_converts_automatically(tmp_path):
    ref = _official(heads_for_pretraining=True)
    wrapped = {("model." + k if not k.startswith(("lm_head", "pair_head")) else k): v for k, v in ref.state_dict().items()}
    path = tmp_path / "mlm.pth"
    torch.save(wrapped, path)
    model = domainfm.create_model("stofm-test", pretrained=str(path), n_outputs=None, pretrain_heads=True).eval()
    assert model.domainfm_load_report.converter == "official"
    emb, dist, types = _batch()
    with torch.no_grad():
        ref_h, ref_pair = ref(emb, dist, types)
        _, lm, pair_pred = model.forward_pretrain(emb, dist, types)
    valid = types != 3
    want_lm = torch.nn.functional.normalize(ref.lm_head(ref_h), dim=-1)
    torch.testing.assert_close(lm[valid], want_lm[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pair_pred[0], ref.pair_head(ref_pair).squeeze(-1)[0], atol=1e-5, rtol=1e-5)
    # a backbone-only model drops the heads of the same file
    plain = domainfm.create_model("stofm-test", pretrained=str(path), n_outputs=None)
    assert plain.domainfm_load_report.unexpected == []
    assert set(convert_official_state_dict(wrapped, plain)) == set(to_official_state_dict(plain))


def test_gaussian_bias_evaluates_only_distinct_distances_and_equals_the_dense_form(monkeypatch):
    ref = _official()
    ours = GaussianDistanceBias(4, 16)
    ours.load_state_dict({k[len("gaussian."):]: v for k, v in ref.state_dict().items() if k.startswith("gaussian.")})
    _, dist, _ = _batch()
    seen = []
    original = GaussianDistanceBias.basis
    monkeypatch.setattr(GaussianDistanceBias, "basis", lambda self, v: (seen.append(v.numel()), original(self, v))[1])
    with torch.no_grad():
        dense = ref.gaussian(dist)
        sparse = ours(dist)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=1e-6)
    assert (sparse[dist.unsqueeze(1).expand_as(sparse) == 0] == 0).all()
    # every kNN distance appears twice, all non-edges are 100 and all zeros 0: far fewer evaluations
    assert sum(seen) == torch.unique(dist).numel() < dist.numel() / 4
    # gradients through the gather equal the dense form's
    d = dist.clone()
    ours(d).square().sum().backward()
    ref.gaussian(d).square().sum().backward()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.gaussian.named_parameters())[name].grad, atol=1e-4, rtol=1e-4)


def test_surface_head_and_errors():
    model = domainfm.create_model("stofm-test", n_outputs=5)
    emb, dist, types = _batch()
    out = model(emb, dist, types)
    assert out.shape == (2, 23, 5)
    model.reset_classifier(2)
    assert model(emb, dist, types).shape == (2, 23, 2) and model.num_features == 32
    with pytest.raises(ValueError, match="distances must be"):
        model.forward_features(emb, dist[:, :5], types)
    with pytest.raises(ValueError, match="token_embeddings must be"):
        model.forward_features(emb[..., :10], dist, types)
    with pytest.raises(RuntimeError, match="pretrain_heads"):
        model.forward_pretrain(emb, dist, types)


# ------------------------------------------------------------------------------ cell encoder


def _official_cell_encoder_folder(root):
    import transformers
    config = transformers.BertConfig(vocab_size=25427, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=64, hidden_act="relu",
                                     hidden_dropout_prob=0.02, attention_probs_dropout_prob=0.02)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()
    with torch.no_grad():
        for name, p in bert.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    proj = torch.nn.Linear(32, 256)
    folder = root / "cell_encoder"
    bert.save_pretrained(folder / "cell_bert")
    torch.save(proj.state_dict(), folder / "cell_proj.bin")
    return folder, bert, proj


def test_official_cell_encoder_folder_matches_hf_bert(tmp_path):
    folder, bert, proj = _official_cell_encoder_folder(tmp_path)
    encoder = load_official_cell_encoder(folder).eval()
    assert encoder.domainfm_load_report.missing == [] and encoder.domainfm_load_report.unexpected == []
    assert encoder.config["hidden_size"] == 32 and encoder.config["num_hidden_layers"] == 2
    ids = torch.randint(2, 25426, (3, 20))
    ids[:, 0] = 25426
    mask = torch.ones_like(ids)
    ids[1, 12:], mask[1, 12:] = 0, 0
    with torch.no_grad():
        hf = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        want = torch.nn.functional.normalize(proj(hf[:, 0]), dim=-1)
        got = encoder(ids, mask)
        hidden = encoder.forward_features(ids, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[mask.bool()], hf[mask.bool()], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(3))


def test_load_official_folder_reads_config_transformer_and_cell_encoder(tmp_path):
    folder, _, _ = _official_cell_encoder_folder(tmp_path)
    ref = _official(layers=3, heads=8, k=16)
    torch.save(ref.state_dict(), tmp_path / "se2transformer.pth")
    (tmp_path / "config.json").write_text(json.dumps({
        "embedding_dim": 32, "num_hidden_layers": 3, "num_attention_heads": 8, "ffn_embedding_dim": 32,
        "gaussian_hidden_dim": 16, "input_dim": 256, "pre_layernorm": False, "activation_fn": "gelu"}))
    model, encoder = load_official(tmp_path, name="stofm-test", n_outputs=None)
    assert isinstance(model, SToFM) and len(model.encoder.layers) == 3 and model.n_heads == 8
    emb, dist, types = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval().forward_features(emb, dist, types)[types != 3],
                                   ref(emb, dist, types)[0][types != 3], atol=1e-5, rtol=1e-5)
    assert encoder.num_features == 256
    (tmp_path / "config.json").write_text(json.dumps({"pre_layernorm": True}))
    with pytest.raises(ValueError, match="pre_layernorm"):
        load_official(tmp_path, name="stofm-test", cell_encoder=False)
