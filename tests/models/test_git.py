"""GIT model: reference SAGE computation, official converter, task embeddings, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import domainfm
from domainfm.hub import load_pretrained
from domainfm.models.git import GIT, convert_official_state_dict


def _graph(n=9, f=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g, dtype=torch.float64)
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 1, 2, 0, 7], [1, 2, 3, 4, 5, 6, 0, 0, 0, 3, 3]])
    return x, edge_index  # node 8 is isolated


def _reference_encoder(sd, x, edge_index, num_layers, edge_attr=None, eps=1e-5):
    """Plain dense computation of the official encoder in eval mode: for each layer,
    h_i = W_l mean_{j->i} m_j + b_l + W_r h_i (m_j = h_j, or relu(h_j + e_ji)), then ReLU, then BN."""
    h = x
    n = x.shape[0]
    for i in range(num_layers):
        agg = torch.zeros(n, h.shape[1], dtype=h.dtype)
        count = torch.zeros(n, dtype=h.dtype)
        for e in range(edge_index.shape[1]):
            src, dst = int(edge_index[0, e]), int(edge_index[1, e])
            msg = h[src] if edge_attr is None else torch.relu(h[src] + edge_attr[e])
            agg[dst] += msg
            count[dst] += 1
        agg = agg / count.clamp(min=1).unsqueeze(1)
        out = agg @ sd[f"layers.{i}.lin_l.weight"].T + sd[f"layers.{i}.lin_l.bias"] + h @ sd[f"layers.{i}.lin_r.weight"].T
        out = torch.relu(out)
        mean, var = sd[f"norms.{i}.running_mean"], sd[f"norms.{i}.running_var"]
        out = (out - mean) / torch.sqrt(var + eps) * sd[f"norms.{i}.weight"] + sd[f"norms.{i}.bias"]
        h = out
    return h


def _official_state_dict(f=16, hidden=16, num_layers=2, seed=1, wrap=False):
    """A state_dict in the official key layout (incl. the unused extra norm), random values."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    dims = [f] + [hidden] * num_layers
    for i in range(num_layers):
        sd[f"layers.{i}.lin_l.weight"] = torch.randn(dims[i + 1], dims[i], generator=g) * 0.3
        sd[f"layers.{i}.lin_l.bias"] = torch.randn(dims[i + 1], generator=g)
        sd[f"layers.{i}.lin_r.weight"] = torch.randn(dims[i + 1], dims[i], generator=g) * 0.3
    for i in range(num_layers + 1):
        sd[f"norms.{i}.weight"] = torch.rand(hidden, generator=g) + 0.5
        sd[f"norms.{i}.bias"] = torch.randn(hidden, generator=g)
        sd[f"norms.{i}.running_mean"] = torch.randn(hidden, generator=g)
        sd[f"norms.{i}.running_var"] = torch.rand(hidden, generator=g) + 0.5
        sd[f"norms.{i}.num_batches_tracked"] = torch.tensor(7)
    sd["pooling_lin.weight"] = torch.randn(hidden, hidden, generator=g) * 0.3
    sd["pooling_lin.bias"] = torch.randn(hidden, generator=g)
    if wrap:  # a fine-tuned TaskModel: encoder.* + decoder.*
        sd = {f"encoder.{k}": v for k, v in sd.items()}
        sd["decoder.weight"] = torch.randn(3, hidden, generator=g)
        sd["decoder.bias"] = torch.randn(3, generator=g)
    return sd


def test_official_checkpoint_loads_and_matches_reference_sage(tmp_path):
    sd = _official_state_dict()
    path = tmp_path / "encoder_10.pt"
    torch.save(sd, path)
    model = domainfm.create_model("git-test", n_outputs=0)
    report = load_pretrained(model, str(path), converter="official")
    assert report.missing == [] and report.unexpected == []
    model = model.double().eval()
    x, edge_index = _graph()
    z = model.forward_features(x, edge_index)
    ref = _reference_encoder({k: v.double() for k, v in sd.items()}, x, edge_index, 2)
    torch.testing.assert_close(z, ref, rtol=0, atol=1e-5)
    # node 8 is isolated (the reference gives it a zero aggregate), so this also covers isolated nodes;
    # edge-task root embeddings go through pooling_lin
    emb = model.task_embedding(z, "edge", torch.tensor([[0, 2], [1, 3]]))
    expected = ((ref[[0, 2]] + ref[[1, 3]]) / 2) @ sd["pooling_lin.weight"].double().T + sd["pooling_lin.bias"].double()
    torch.testing.assert_close(emb, expected, rtol=0, atol=1e-5)


def test_official_git_base_file_loads_through_create_model_without_converter_argument(tmp_path):
    """The official encoder file of git-base carries the unused norms.{num_layers} BatchNorm; as a
    user calls it (no converter=) the file is converted because it is upstream, and it equals the
    converter called by hand."""
    sd = _official_state_dict(f=768, hidden=768, num_layers=2, seed=4)
    assert "norms.2.weight" in sd and "norms.2.running_var" in sd
    path = tmp_path / "encoder_10.pt"
    torch.save(sd, path)
    model = domainfm.create_model("git-base", pretrained=str(path)).eval()
    report = model.domainfm_load_report
    assert report.kind == "upstream" and report.converter == "official"
    assert report.missing == [] and report.unexpected == []
    explicit = domainfm.create_model("git-base")
    explicit.load_state_dict(convert_official_state_dict(torch.load(path, weights_only=True), explicit), strict=True)
    explicit.eval()
    x, edge_index = _graph(f=768, seed=2)
    x = x.float()
    with torch.no_grad():
        got = model(x, edge_index, task="edge", index=torch.tensor([[0, 2], [1, 8]]))
        assert torch.equal(got, explicit(x, edge_index, task="edge", index=torch.tensor([[0, 2], [1, 8]])))
        z = model.double().forward_features(x.double(), edge_index)
    torch.testing.assert_close(z, _reference_encoder({k: v.double() for k, v in sd.items()}, x.double(), edge_index, 2))


@pytest.mark.parametrize("kwargs", [{}, {"n_outputs": 3}, {"backbone": "gat", "norm": "none"}])
def test_converter_is_idempotent(kwargs):
    model = GIT(16, 16, 2, dropout=0.0, **kwargs)
    own = model.state_dict()
    again = convert_official_state_dict(dict(own), model)  # our own keys: unchanged
    assert list(again) == list(own) and all(again[k] is own[k] for k in own)
    official = _official_state_dict(wrap=True)
    if kwargs.get("backbone") == "gat":
        official = {f"encoder.{k.replace('.lin.', '.lin_src.')}": v for k, v in own.items()}
        official.update({f"encoder.norms.{i}.weight": torch.ones(16) for i in range(3)})
    once = convert_official_state_dict(official, model)
    assert set(once) <= set(own) | {"head.weight", "head.bias"}
    twice = convert_official_state_dict(once, model)
    assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)


def test_reference_with_edge_features_and_taskmodel_checkpoint():
    sd = _official_state_dict(wrap=True)
    model = GIT(16, 16, 2, n_outputs=3, dropout=0.0)
    converted = convert_official_state_dict(sd, model)
    assert "norms.2.weight" not in converted and "head.weight" in converted
    model.load_state_dict(converted, strict=True)
    model = model.double().eval()
    x, edge_index = _graph(seed=3)
    edge_attr = torch.randn(edge_index.shape[1], 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    z = model.forward_features(x, edge_index, edge_attr)
    plain = {k[len("encoder."):]: v.double() for k, v in sd.items() if k.startswith("encoder.")}
    torch.testing.assert_close(z, _reference_encoder(plain, x, edge_index, 2, edge_attr), rtol=0, atol=1e-5)
    logits = model(x, edge_index, edge_attr, task="node", index=torch.tensor([4]))
    pooled = z[4] @ plain["pooling_lin.weight"].T + plain["pooling_lin.bias"]
    torch.testing.assert_close(logits[0], pooled @ sd["decoder.weight"].double().T + sd["decoder.bias"].double())


def test_task_embeddings_node_edge_graph_and_virtual_root():
    torch.manual_seed(0)
    model = GIT(8, 8, 1, dropout=0.0, norm="none").eval()
    z = torch.randn(6, 8)
    lin = model.pooling_lin
    torch.testing.assert_close(model.task_embedding(z, "node", torch.tensor([2, 5])), lin(z[[2, 5]]))
    batch = torch.tensor([0, 0, 1, 1, 1, 2])
    expected = lin(torch.stack([z[:2].mean(0), z[2:5].mean(0), z[5]]))
    torch.testing.assert_close(model.task_embedding(z, "graph", batch), expected)
    # roots 0 and 3; children of 0 are 1, 2; of 3 is 4; 5 -> 1 is not into a root
    edge_index = torch.tensor([[1, 2, 4, 5], [0, 0, 3, 1]])
    out = model.virtual_root_embedding(z, edge_index, torch.tensor([0, 3]))
    torch.testing.assert_close(out, lin(torch.stack([(z[1] + z[2]) / 2, z[4]])))


def test_gat_backbone_and_bad_inputs():
    model = GIT(16, 16, 2, backbone="gat", n_outputs=2)
    x, edge_index = _graph()
    out = model(x.float(), edge_index)
    assert out.shape == (9, 2)
    out.sum().backward()
    assert model.layers[0].lin.weight.grad is not None
    with pytest.raises(ValueError, match="divisible"):
        GIT(16, 10, backbone="gat")
    with pytest.raises(ValueError, match="backbone"):
        GIT(16, 16, backbone="gcn")
    sage = GIT(16, 16)
    with pytest.raises(ValueError, match=r"\(N, 16\)"):
        sage.forward_features(torch.randn(5, 12), edge_index)
    with pytest.raises(ValueError, match="outside"):
        sage.forward_features(torch.randn(5, 16), torch.tensor([[0, 7], [1, 2]]))
    with pytest.raises(ValueError, match="edge_attr has 4 features"):
        sage.forward_features(torch.randn(5, 16), torch.tensor([[0], [1]]), torch.randn(1, 4))
    with pytest.raises(ValueError, match="task="):
        sage.task_embedding(torch.randn(3, 16), "subgraph", None)


def test_registered_variants_and_head_reset():
    assert {"git-base", "git-small", "git-test"} <= set(domainfm.list_models("git-*"))
    info = domainfm.model_info("git-base")
    # 2 x (768*768*2 + 768) + BN 2 x 2*768 + pooling_lin 768*768 + 768
    assert info["num_params"] == 2 * (2 * 768 * 768 + 768) + 2 * 2 * 768 + 768 * 768 + 768
    model = domainfm.create_model("git-test")
    x, edge_index = domainfm.zoo.get_card("git-test").example_input()
    assert model(x, edge_index).shape == (12, 3)
    model.reset_classifier(0)
    assert model(x, edge_index).shape == (12, 16)


@pytest.mark.parametrize("backbone", ["sage", "gat"])
def test_trimmed_layers_equal_full_computation_at_kept_depths(backbone):
    from domainfm.data_loaders import graph as G

    torch.manual_seed(0)
    x = torch.randn(60, 16)
    ei = torch.randint(0, 60, (2, 240))
    model = GIT(16, 16, 2, backbone=backbone, dropout=0.0).eval()
    with torch.no_grad():
        for norm in model.norms:
            norm.running_mean.uniform_(-0.3, 0.3)
    trees = G.build_task_trees(x, ei, "edge", ei[:, :12], [10, 10], shared=True,
                               generator=torch.Generator().manual_seed(0))
    full = model.forward_features(trees.x, trees.edge_index)
    trimmed = model.forward_features(trees.x, trees.edge_index, depth=trees.depth, keep_depth=1)
    keep = trees.depth <= 1
    torch.testing.assert_close(trimmed[keep], full[keep], rtol=1e-5, atol=1e-5)
    assert torch.all(trimmed[~keep] == 0)
    torch.testing.assert_close(model.virtual_root_embedding(trimmed, trees.edge_index, trees.roots),
                               model.virtual_root_embedding(full, trees.edge_index, trees.roots), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="non-decreasing"):
        model.forward_features(trees.x, trees.edge_index, depth=trees.depth.flip(0))


def test_converter_maps_old_pyg_gat_keys_and_drops_pretraining_modules():
    model = GIT(16, 16, 2, backbone="gat", norm="none")
    own = {k: v.clone() for k, v in model.state_dict().items()}
    old = {}
    for key, value in own.items():
        old[key.replace(".lin.", ".lin_src.")] = value.clone() + 1
        if ".lin." in key:
            old[key.replace(".lin.", ".lin_dst.")] = value.clone() + 1  # PyG < 2.5 stores the shared matrix twice
    old.update({f"norms.{i}.weight": torch.ones(16) for i in range(3)})  # normalize='none' checkpoints still carry norms
    old["sem_decoder.lins.0.weight"] = torch.zeros(16, 16)  # a PretrainModel's predictor is not part of the encoder
    converted = convert_official_state_dict({f"encoder.{k}": v for k, v in old.items()}, model)
    assert set(converted) == set(own)
    model.load_state_dict(converted, strict=True)
    torch.testing.assert_close(model.layers[0].lin.weight, own["layers.0.lin.weight"] + 1)


@pytest.mark.parametrize("task", ["node", "edge", "virtual"])
def test_task_embedding_gradients_repeat_bit_for_bit_with_threads(task):
    """Root gathers repeat indices (edge endpoints, shared nodes); on CPU the backward of ``z[index]``
    adds their gradients in a thread-dependent order, which made runs drift apart. The model uses
    index_select, whose backward is deterministic: four backward passes give identical gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = GIT(32, 64, 2, dropout=0.0)
        z = torch.randn(6000, 64, requires_grad=True)
        pairs = torch.randint(0, 6000, (2, 40000))
        grads = []
        for _ in range(4):
            z.grad = None
            if task == "node":
                out = model.task_embedding(z, "node", pairs[0])
            elif task == "edge":
                out = model.task_embedding(z, "edge", pairs)
            else:
                roots = torch.arange(500)
                out = model.virtual_root_embedding(z, torch.stack([pairs[0], pairs[1] % 500]), roots)
            (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            grads.append(z.grad.clone())
        assert all(torch.equal(grads[0], g) for g in grads[1:])
    finally:
        torch.set_num_threads(threads)
