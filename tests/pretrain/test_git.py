"""GIT pretraining: the loss against a hand computation, view corruption, a CLI run."""
from __future__ import annotations

import json
import math

import pytest
import torch

from domainfm.cli import main
from domainfm.data_loaders import graph as G
from domainfm.pretrain import git as P


def _softmax(v):
    m = max(v)
    e = [math.exp(a - m) for a in v]
    return [a / sum(e) for a in e]


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_pretraining_loss_equals_hand_computation():
    torch.manual_seed(0)
    r1, r2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    predictor = P.Predictor(4, dropout=0.5).double()
    with torch.no_grad():  # non-trivial BN running statistics
        predictor.norm.running_mean.uniform_(-0.5, 0.5)
        predictor.norm.running_var.uniform_(0.5, 2.0)
    predictor.eval()
    sem, align = P.git_pretrain_loss(r1, r2, predictor, align_lambda=10.0)

    def pred(v):
        h = torch.relu(predictor.lin1(v))
        h = (h - predictor.norm.running_mean) / torch.sqrt(predictor.norm.running_var + 1e-5) * predictor.norm.weight + predictor.norm.bias
        return predictor.lin2(h)

    h1, h2 = pred(r1).tolist(), pred(r2).tolist()
    a, b = r1.tolist(), r2.tolist()
    hand_sem = sum(((1 - _cos(a[i], h2[i])) + (1 - _cos(b[i], h1[i]))) / 2 for i in range(5)) / 5
    mean = [sum(row[d] for row in a) / 5 for d in range(4)]
    p = _softmax(mean)
    hand_kl = sum(sum(p[d] * (math.log(p[d]) - math.log(_softmax(row)[d])) for d in range(4)) for row in a) / 5
    assert sem.item() == pytest.approx(hand_sem, abs=1e-10)
    assert align.item() == pytest.approx(10.0 * hand_kl, abs=1e-10)
    # stop-gradient: the targets get no gradient through the cosine term, only the predictor path does
    r1g, r2g = r1.clone().requires_grad_(True), r2.clone().requires_grad_(True)
    sem_g, _ = P.git_pretrain_loss(r1g, r2g, predictor, align_lambda=0.0)
    sem_g.backward()
    h1g = pred(r1g)  # gradient of r1 must equal the gradient through P(r1) only
    r1h = r1.clone().requires_grad_(True)
    t2 = torch.nn.functional.normalize(r2, dim=-1)
    only_pred = ((1 - (t2 * torch.nn.functional.normalize(pred(r1h), dim=-1)).sum(-1)) / 2).mean()
    only_pred.backward()
    torch.testing.assert_close(r1g.grad, r1h.grad)
    del h1g


def test_corrupt_view_masks_columns_and_keeps_root_edges():
    x = torch.randn(40, 20).abs() + 0.1
    ei = torch.randint(0, 40, (2, 150))
    trees = G.build_task_trees(x, ei, "edge", ei[:, :16], [10, 10], shared=True)
    torch.manual_seed(0)
    xv, ev = P.corrupt_view(trees, feat_p=0.5, edge_p=0.5)
    real = trees.node_id >= 0
    zero_cols = (xv[real] == 0).all(0)
    assert 0 < zero_cols.sum() < 20
    assert torch.equal((xv[real] == 0).any(0), zero_cols)  # masked columns are whole columns (inputs are > 0)
    torch.testing.assert_close(xv[real][:, ~zero_cols], trees.x[real][:, ~zero_cols])
    root_edges = trees.depth[trees.edge_index[1]] == 0
    kept_root = (trees.depth[ev[1]] == 0).sum()
    assert kept_root == root_edges.sum()  # every virtual-root edge survives
    other = (~root_edges).sum()
    assert 0.3 * other < (ev.shape[1] - kept_root) < 0.7 * other


def test_pretrain_cli_runs_and_writes_encoder(tmp_path):
    from domainfm import create_model

    rc = main(["pretrain", "git", "model.name=git-test", "model.kwargs={hidden_channels: 16}",
               "data.datasets=[karate, nations]", "train.max_steps=3", "train.batch_size=64", "train.lr=1e-2",
               "--runs-dir", str(tmp_path), "--name", "pt"])
    assert rc == 0
    run = tmp_path / "git" / "pt"
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 3 and report["init"] == "random" and report["tasks"] == 34 + 156 + 14 + 182
    assert report["task_mix"] == {"karate/node": 34, "karate/edge": 156, "nations/node": 14, "nations/edge": 182}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # paired: the objective fell below its value at the first step (2.10 -> 1.46 on this CPU in bf16)
    assert report["final_loss"] == pytest.approx(train[-1]["loss"]) and train[-1]["loss"] < 0.9 * train[0]["loss"]
    assert report["final_align_reg"] == pytest.approx(train[-1]["align_reg"]) and report["final_align_reg"] >= 0
    encoder = create_model(report["encoder_dir"])
    assert encoder.in_channels == 384 and encoder.hidden_channels == 16
    fresh = create_model("git-test", in_channels=384, n_outputs=0)
    assert not torch.equal(encoder.pooling_lin.weight, fresh.pooling_lin.weight)


def test_module_loss_on_a_fixed_tree_batch_matches_its_parts():
    """Without corruption both views are one computation: the module's loss must equal
    mean(1 - cos(r, P(r))) + 10 * KL(softmax(mean r) || softmax(r_i)) on the batch's root embeddings."""
    from domainfm.models.git import GIT

    torch.manual_seed(0)
    x = torch.randn(30, 8, dtype=torch.float64)
    ei = torch.randint(0, 30, (2, 90))
    trees = G.build_task_trees(x, ei, "edge", ei[:, :10], [10, 10], shared=True, generator=torch.Generator().manual_seed(0))
    enc = GIT(8, 8, 2, dropout=0.0).double()
    module = P.GITPretrainer(enc, P.ObjectiveSection(feat_p=0.0, edge_p=0.0, predictor_dropout=0.0, trim=False)).double()
    loss, logs = module(trees)
    r = enc.virtual_root_embedding(enc.forward_features(trees.x, trees.edge_index), trees.edge_index, trees.roots)
    h = module.predictor(r)
    cos = torch.nn.functional.cosine_similarity(r, h, dim=-1)
    p = r.mean(0).softmax(-1)
    kl = (p * (p.log() - r.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(loss, (1 - cos).mean() + 10 * kl)
    torch.testing.assert_close(logs["align_reg"], 10 * kl)
    # trimming changes nothing at the roots in eval mode
    module.eval()
    module.objective.trim = True
    trimmed, _ = module(trees)
    module.objective.trim = False
    full, _ = module(trees)
    torch.testing.assert_close(trimmed, full)


def test_same_config_same_pretraining_run(tmp_path):
    reports = []
    for name in ("a", "b"):
        assert main(["pretrain", "git", "model.name=git-test", "data.datasets=[karate]", "train.max_steps=2",
                     "train.batch_size=64", "--runs-dir", str(tmp_path), "--name", name]) == 0
        reports.append(json.loads((tmp_path / "git" / name / "report.json").read_text()))
    assert reports[0]["final_loss"] == reports[1]["final_loss"]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "git" / "a" / "encoder" / "model.safetensors"))
    b = load_file(str(tmp_path / "git" / "b" / "encoder" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
