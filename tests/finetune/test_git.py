"""GIT adaptation: prototype logits, in-context episodes, zero-shot, CLI fine-tune runs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from domainfm.cli import main
from domainfm.data_loaders import graph as G
from domainfm.models.git import in_context as FT
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


STAGE = "stages=[{family: git, config: pretrain, overrides: [model.name=git-test, train.max_steps=2, " \
        "train.batch_size=64, 'data.datasets=[karate, nations]']}]"


def _cli(tmp_path, *overrides, name="ft"):
    # model.pretrained=null: the pretrained arm starts from the stage's output (the default config names
    # the shipped checkpoint instead)
    rc = main(["finetune", "git", "model.name=git-test", "model.pretrained=null", STAGE, "train.max_epochs=2", "train.batch_size=8",
               "adapt.seeds=[0]", *overrides, "--runs-dir", str(tmp_path), "--name", name])
    assert rc == 0
    run = tmp_path / "git" / name
    return run, json.loads((run / "report.json").read_text())


def _evaluation(run):
    assert main(["evaluate", str(run)]) == 0
    return json.loads((run / "evaluation.json").read_text())


def test_finetune_cli_node_task_with_random_arm_and_evaluate(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=karate", "data.few_shot_k=3", "protocols.n_episodes=4",
                       "protocols.k_shot=2", "protocols.n_query=2", "train.monitor=val/accuracy")
    pre, rnd = report["arms"]["pretrained"], report["arms"]["random"]
    assert pre["init"].startswith(f"pretrained {run / 'stages' / '0-git' / 'encoder'}") and "stage" in pre["init"]
    assert rnd["init"].startswith("random")
    assert report["data"]["graph_task"] == "node" and report["data"]["metric"] == "accuracy"
    assert report["data"]["train_tasks"] == 3 * 2  # few-shot: 3 training tasks per class
    assert pre["params"]["trainable"] == pre["params"]["total"] == sum(
        p.numel() for p in GIT(384, 16, 2, n_outputs=2).parameters())
    assert (run / "stages" / "0-git" / "metrics.jsonl").is_file()
    val = [json.loads(l) for l in (run / "pretrained" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("split") == "val" for r in val) == 2 and all("accuracy" in r for r in val if r.get("split") == "val")
    assert pre["in_context"]["n_way"] == rnd["in_context"]["n_way"] == 2
    evaluation = _evaluation(run)
    assert evaluation["max_abs_diff_val"] <= 1e-6
    for arm in ("pretrained", "random"):
        assert evaluation["arms"][arm]["test"] == pytest.approx(report["arms"][arm]["test"], abs=1e-6)


def test_train_monitor_in_config_is_honoured(tmp_path):
    # train.monitor chooses the selection metric (it used to be overwritten by the task's rule)
    run, report = _cli(tmp_path, "data.dataset=karate", "protocols.in_context=false", "arms=[random]",
                       "train.monitor=val/loss", "train.monitor_mode=min", "train.max_epochs=3", name="mon")
    assert report["monitor"] == "val/loss"
    vals = [json.loads(l) for l in (run / "random" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if r.get("split") == "val"]
    best = min(vals, key=lambda r: r["loss"])
    assert report["arms"]["random"]["best_step"] == best["step"]


def test_finetune_cli_edge_task_lora_sft_zero_shot(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=nations", "data.min_relation_count=60",
                       "model.kwargs={hidden_channels: 384}", "protocols.in_context=false", "protocols.sft=true",
                       "adapt.mode=lora", "protocols.sft_steps=2", "arms=[pretrained]", "train.monitor=val/accuracy",
                       "train.max_epochs=1", "train.batch_size=64", "data.train_fanout=3",
                       STAGE.replace("train.max_steps=2", "train.max_steps=2, 'model.kwargs={hidden_channels: 384}'"),
                       name="edge")
    arm = report["arms"]["pretrained"]
    assert report["data"]["graph_task"] == "edge" and list(report["arms"]) == ["pretrained"]
    assert set(arm["zero_shot_sft"]) >= {"accuracy"} and arm["mode"] == "lora"
    assert arm["params"]["trainable"] < arm["params"]["total"] / 4  # LoRA adapters + head only
    assert (run / "pretrained" / "sft" / "metrics.jsonl").is_file()
    assert (run / "pretrained" / "adapter" / "adapter_model.safetensors").is_file()
    evaluation = _evaluation(run)  # RUN/pretrained/model holds the merged LoRA weights
    assert evaluation["max_abs_diff_val"] <= 1e-6


def test_missing_pretrained_weights_is_an_error_even_with_random_fallback(tmp_path, capsys):
    from domainfm.experiment import WeightsUnavailable

    missing = tmp_path / "nowhere" / "encoder"
    base = ["finetune", "git", "model.name=git-test", "data.dataset=karate", "adapt.mode=none", "stages=[]",
            "--runs-dir", str(tmp_path)]
    # a file the user named never falls back to random init: one line naming it, exit 2
    assert main([*base, f"model.pretrained={missing}", "model.fallback=random", "--name", "a"]) == 2
    assert str(missing) in capsys.readouterr().err
    # the card's own weights (git-test registers none) fall back only when asked to
    with pytest.raises(WeightsUnavailable, match="model.fallback=random"):
        main(["--debug", *base, "model.pretrained=true", "--name", "b"])
    _, report = _cli(tmp_path, "model.pretrained=true", "model.fallback=random", "data.dataset=karate",
                     "adapt.mode=none", "stages=[]", "protocols.n_episodes=2", "protocols.k_shot=2",
                     "protocols.n_query=2", name="c")
    assert report["arms"]["pretrained"]["init"].startswith("random (fallback: git-test has no registered weight source")
    assert "in_context" in report["arms"]["pretrained"] and "best_step" not in report["arms"]["pretrained"]


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


@pytest.mark.slow
def test_finetune_cli_link_prediction_over_seeds(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=karate", "data.task=link", "arms=[pretrained]",
                       "protocols.n_episodes=3", "train.max_epochs=2", "train.batch_size=32", "adapt.seeds=[0, 5]",
                       name="link")
    arm = report["arms"]["pretrained"]
    assert report["data"]["dataset"] == "karate-link" and report["data"]["metric"] == "roc_auc"
    runs = [r["test"]["roc_auc"] for r in arm["seeds"]]
    assert len(runs) == 2 and arm["test"]["roc_auc"] == pytest.approx(sum(runs) / 2)
    assert arm["test_std"]["roc_auc"] == pytest.approx(float(torch.tensor(runs, dtype=torch.float64).std()))
    assert (run / "pretrained" / "seed5" / "metrics.jsonl").is_file() and arm["seeds"][0]["seed"] == 0
    # no head: link scores are dot products of pooled endpoints
    assert arm["params"]["total"] == sum(p.numel() for p in GIT(384, 16, 2).parameters())
    evaluation = _evaluation(run)  # RUN/pretrained/model is the first repeat
    assert evaluation["arms"]["pretrained"]["test"]["roc_auc"] == pytest.approx(runs[0], abs=1e-6)


@pytest.mark.slow
def test_resuming_a_finished_experiment_reuses_its_stage(tmp_path):
    run, report = _cli(tmp_path, "data.dataset=karate", "train.monitor=val/accuracy", "protocols.in_context=false", "arms=[pretrained]",
                       "train.max_epochs=1", name="res")
    stage_log = (run / "stages" / "0-git" / "metrics.jsonl").read_bytes()
    # without resume the used name is refused; with it, the finished stage is reused, not trained again
    assert main(["finetune", "git", "model.name=git-test", "model.pretrained=null", STAGE, "train.max_epochs=1", "train.batch_size=8",
                 "adapt.seeds=[0]", "data.dataset=karate", "train.monitor=val/accuracy", "protocols.in_context=false", "arms=[pretrained]",
                 "--runs-dir", str(tmp_path), "--name", "res"]) == 2
    _, again = _cli(tmp_path, "data.dataset=karate", "train.monitor=val/accuracy", "protocols.in_context=false", "arms=[pretrained]",
                    "train.max_epochs=1", "train.resume=true", name="res")
    assert (run / "stages" / "0-git" / "metrics.jsonl").read_bytes() == stage_log
    assert again["arms"]["pretrained"]["test"] == pytest.approx(report["arms"]["pretrained"]["test"], abs=1e-6)


def _protocol(ds, model, seed, **protocols):
    from types import SimpleNamespace

    from domainfm.experiment import TaskData
    from domainfm.finetune import git as FG

    cfg = FG.Config(protocols=FG.ProtocolSection(n_way=3, k_shot=2, n_query=3, n_episodes=10, **protocols))
    task = TaskData(None, None, extras={"dataset": ds})
    return FG.in_context_protocol(SimpleNamespace(cfg=cfg, seed=seed, model=model, task=task))["in_context"]


def test_in_context_episodes_follow_each_repeats_seed_unless_fixed():
    ds = _toy_node_dataset(n_per_class=20)
    ds.x = torch.rand(ds.x.shape, generator=torch.Generator().manual_seed(3))
    model = _identity_git(6)  # features without class signal: accuracy depends on which episodes are drawn
    episodes = dict(n_way=3, k_shot=2, n_query=3, n_episodes=10)
    per_seed = [_protocol(ds, model, seed)["accuracy"] for seed in (0, 1, 2)]
    assert per_seed == [FT.in_context(model, ds, seed=s, **episodes)["accuracy"] for s in (0, 1, 2)]
    assert len(set(per_seed)) > 1  # the repeats drew different episodes
    fixed = [_protocol(ds, model, seed, episode_seed=7)["accuracy"] for seed in (0, 1, 2)]
    assert fixed == [FT.in_context(model, ds, seed=7, **episodes)["accuracy"]] * 3


def test_finetune_report_gives_the_in_context_spread_over_episode_seeds(tmp_path, capsys):
    _, report = _cli(tmp_path, "data.dataset=karate", "arms=[pretrained]", "adapt.mode=none", "adapt.seeds=[0, 1, 2]",
                     "protocols.n_episodes=6", "protocols.k_shot=2", "protocols.n_query=2", "retained.datasets=[]",
                     name="spread")
    arm = report["arms"]["pretrained"]
    runs = [r["in_context"]["accuracy"] for r in arm["seeds"]]
    assert [r["seed"] for r in arm["seeds"]] == [0, 1, 2] and len(set(runs)) > 1  # one encoder, three episode draws
    assert arm["in_context"]["accuracy"] == pytest.approx(float(np.mean(runs)))
    assert arm["in_context_std"]["accuracy"] == pytest.approx(float(np.std(runs, ddof=1)))
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("in_context.accuracy "))
    assert row.split()[-3:] == [f"{np.mean(runs):.4f}", "±", f"{np.std(runs, ddof=1):.4f}"]
