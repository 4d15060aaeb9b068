"""GIT adaptation: prototype logits, in-context episodes, zero-shot, CLI fine-tune runs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from domainfm.cli import main
from domainfm.data_loaders import graph as G
from domainfm.finetune import git as FT
from domainfm.models.git import GIT


def test_prototype_logits_equal_hand_computation():
    support = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1])
    protos = FT.class_prototypes(support, labels, 2)
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(protos, torch.tensor([[(1 + r) / 2, r / 2], [0.0, 1.0]]))
    query = torch.tensor([[2.0, 2.0], [0.0, -1.0]])
    logits = FT.prototype_logits(query, protos)
    p0 = torch.tensor([(1 + r) / 2, r / 2])
    p0 = p0 / p0.norm()
    q0 = torch.tensor([r, r])
    expected = torch.tensor([[-(2 - 2 * float(q0 @ p0)), -(2 - 2 * r)],
                             [-(2 - 2 * float(torch.tensor([0.0, -1.0]) @ p0)), -(2 + 2 * 1.0)]])
    torch.testing.assert_close(logits, expected)


def _identity_git(dim: int) -> GIT:
    """One SAGE layer with lin_l = 0, lin_r = I, pooling_lin = I: task embedding = relu(x)."""
    model = GIT(dim, dim, 1, norm="none", dropout=0.0)
    with torch.no_grad():
        model.layers[0].lin_l.weight.zero_()
        model.layers[0].lin_l.bias.zero_()
        model.layers[0].lin_r.weight.copy_(torch.eye(dim))
        model.pooling_lin.weight.copy_(torch.eye(dim))
        model.pooling_lin.bias.zero_()
    return model.eval()


def _toy_node_dataset(n_per_class=10, n_classes=3, dim=6):
    y = torch.arange(n_classes).repeat_interleave(n_per_class)
    x = torch.rand(y.numel(), dim) * 0.1
    x[torch.arange(y.numel()), y] += 1.0  # class c lives near axis c
    ei = torch.randint(0, y.numel(), (2, 40), generator=torch.Generator().manual_seed(0))
    splits = G._stratified_split(y, (0.5, 0.2), 0)
    class_emb = torch.eye(n_classes, dim)
    return G.GraphDataset(name="toy", task="node", x=x, edge_index=ei, task_index=torch.arange(y.numel()), y=y,
                          splits=splits, class_texts=[f"c{i}" for i in range(n_classes)], class_emb=class_emb,
                          labels="constructed for the test", encoder="none")


def test_in_context_and_zero_shot_on_separable_embeddings():
    ds = _toy_node_dataset()
    model = _identity_git(6)
    ic = FT.in_context(model, ds, n_way=5, k_shot=2, n_query=2, n_episodes=5)
    assert ic["n_way"] == 3 and ic["accuracy"] == 1.0 and ic["accuracy_std"] == 0.0
    zs = FT.zero_shot(model, ds)
    assert zs["accuracy"] == 1.0
    # shuffled class texts: zero-shot must follow them (accuracy 0 when every prototype is wrong)
    ds.class_emb = ds.class_emb[[1, 2, 0]]
    assert FT.zero_shot(model, ds)["accuracy"] == 0.0
    with pytest.raises(G.GraphError, match="hidden_channels == in_channels"):
        FT.zero_shot(GIT(6, 4, 1), ds)


def _cli(tmp_path, *overrides, name="ft"):
    rc = main(["finetune", "git", "model.name=git-test", "pretrain.max_steps=2", "pretrain.batch_size=64",
               "pretrain.datasets=[karate, nations]", "train.max_epochs=2", "train.batch_size=8", "adapt.seeds=[0]", *overrides,
               "--runs-dir", str(tmp_path), "--name", name])
    assert rc == 0
    run = tmp_path / "git" / name
    return run, json.loads((run / "report.json").read_text())


def test_finetune_cli_node_task_with_baseline_and_evaluate(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=karate", "adapt.modes=[in_context, finetune, few_shot]",
                       "adapt.n_episodes=4", "adapt.k_shot=2", "adapt.n_query=2", "train.monitor=val/accuracy")
    assert report["init"].startswith("pretrained: in-process GIT pretraining on karate+nations (2 steps)")
    assert report["task"] == "node" and report["metric"] == "accuracy"
    for key in ("finetune_test_accuracy_pretrained", "finetune_test_accuracy_random", "few_shot_test_accuracy_pretrained",
                "in_context_accuracy_pretrained", "in_context_accuracy_random"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["params_trainable"] == report["params_total"] == sum(
        p.numel() for p in GIT(384, 16, 2, n_outputs=2).parameters())
    assert (run / "pretrain" / "metrics.jsonl").is_file()
    val = [json.loads(l) for l in (run / "finetune-pretrained" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("split") == "val" for r in val) == 2 and all("accuracy" in r for r in val if r.get("split") == "val")
    assert main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["test_accuracy"] == pytest.approx(report["finetune_test_accuracy_pretrained"])


def test_finetune_cli_edge_task_lora_sft_zero_shot(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=nations", "data.min_relation_count=60",
                       "model.overrides={hidden_channels: 384}", "adapt.modes=[sft, finetune]", "adapt.mode=lora",
                       "adapt.sft_steps=2", "adapt.baseline=false", "train.monitor=val/accuracy", "train.max_epochs=1",
                       "train.batch_size=64", "data.train_fanout=3", name="edge")
    assert report["task"] == "edge" and "finetune_test_accuracy_random" not in report
    assert 0 <= report["zero_shot_sft_accuracy_pretrained"] <= 1
    assert report["params_trainable"] < report["params_total"] / 4  # LoRA adapters + head only
    assert (run / "sft-pretrained" / "metrics.jsonl").is_file()
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert main(["evaluate", str(run)]) == 0  # RUN/model holds the merged LoRA weights
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["test_accuracy"] == pytest.approx(report["finetune_test_accuracy_pretrained"])


def test_missing_pretrained_weights_error_or_explicit_random_fallback(tmp_path):
    missing = tmp_path / "nowhere" / "encoder"
    with pytest.raises(SystemExit, match="pretrained_fallback=random"):
        _cli(tmp_path, f"model.pretrained={missing}", "data.dataset=karate", "adapt.modes=[in_context]", name="a")
    _, report = _cli(tmp_path, f"model.pretrained={missing}", "model.pretrained_fallback=random", "data.dataset=karate",
                     "adapt.modes=[in_context]", "adapt.n_episodes=2", "adapt.k_shot=2", "adapt.n_query=2", name="b")
    assert report["init"] == "random" and "in_context_accuracy_random" in report
    assert "in_context_accuracy_pretrained" not in report


def test_in_context_binary_auc_scores_the_real_positive_class():
    ds = _toy_node_dataset(n_per_class=12, n_classes=2)
    ds.name = "toy-link"  # binary link-style task: episodes report ROC-AUC
    ic = FT.in_context(_identity_git(6), ds, n_way=2, k_shot=2, n_query=3, n_episodes=8, seed=1)
    # episodes shuffle the class order; every one must still score class 1 as positive
    assert ic["roc_auc"] == 1.0 and ic["roc_auc_std"] == 0.0 and ic["accuracy"] == 1.0


def test_link_prediction_split_holds_out_edges():
    ds = G.load_karate(G.HashingTextEncoder(384))
    link = G.link_prediction_split(ds, seed=0)
    assert link.task == "edge" and link.labels.startswith("constructed")
    mp = set(map(tuple, link.edge_index.t().tolist()))
    full = set(map(tuple, ds.edge_index.t().tolist()))
    for split in ("train", "val", "test"):
        pos = link.splits[split]
        pairs, y = link.task_index[:, pos], link.y[pos]
        assert y.sum() * 2 == y.numel()  # balanced
        for (u, v), label in zip(pairs.t().tolist(), y.tolist()):
            assert ((u, v) in full) == bool(label)  # positives are edges, negatives are not
            if split != "train" and label:
                assert (u, v) not in mp and (v, u) not in mp  # held-out edges never pass messages
    assert link.splits["train"].numel() == 2 * int(0.85 * 78)
    with pytest.raises(G.GraphError, match="complete"):
        G.link_prediction_split(G.load_nations(G.HashingTextEncoder(384)))


def test_finetune_cli_link_prediction(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=karate", "data.task=link", "adapt.modes=[in_context, finetune]",
                       "adapt.baseline=false", "adapt.n_episodes=3", "train.max_epochs=2", "train.batch_size=32",
                       "adapt.seeds=[0, 5]", name="link")
    assert report["dataset"] == "karate-link" and report["metric"] == "roc_auc"
    assert 0 <= report["finetune_test_roc_auc_pretrained"] <= 1 and 0 <= report["in_context_roc_auc_pretrained"] <= 1
    runs = report["finetune_test_roc_auc_runs_pretrained"]
    assert len(runs) == 2 and report["finetune_test_roc_auc_pretrained"] == pytest.approx(sum(runs) / 2)
    assert (run / "finetune-pretrained-seed5" / "metrics.jsonl").is_file() and report["model_seed"] == 0
    # no head: link scores are dot products of pooled endpoints
    assert report["params_total"] == sum(p.numel() for p in GIT(384, 16, 2).parameters())
    assert main(["evaluate", str(run)]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["test_roc_auc"] == pytest.approx(runs[0])  # RUN/model is the first repeat
