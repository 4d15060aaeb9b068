"""GIT predict / embed through the CLI on the shipped graphs, checked against an independent
full-graph forward; the retained capability in a fine-tuning report; per-sample losses of GIT
batches (FLOW)."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import create_model, zoo
from domainfm.cli import main
from domainfm.data_loaders import graph as G
from domainfm.finetune import git as FG

FAST = ["model.name=git-test", "stages=[]", "arms=[random]", "adapt.seeds=[0]", "train.max_epochs=2",
        "train.batch_size=16", "protocols.in_context=false"]


def _finetune(root, name, *overrides):
    assert main(["finetune", "git", *FAST, *overrides, "--runs-dir", str(root), "--name", name]) == 0
    return root / "git" / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    # the karate run also compares a trained arm with an untrained one (retained capability)
    return {"karate": _finetune(root, "karate", "data.dataset=karate", "train.monitor=val/accuracy",
                                "arms=[random, random:none]", "retained.n_episodes=5"),
            "mutag": _finetune(root, "mutag", "data.dataset=mutag", "train.max_epochs=1"),
            "link": _finetune(root, "link", "data.dataset=karate", "data.task=link", "train.max_epochs=1")}


def _net(run):
    return create_model(run / "random" / "model").eval()


def _probs(frame):
    cols = [c for c in frame.columns if c.startswith("p_")]
    return frame[cols].to_numpy()


def _predict_cli(tmp_path, run, graph, *extra, name="out.csv"):
    out = tmp_path / name
    assert main(["predict", "git", "--model", str(run), "--input", str(graph), "--output", str(out),
                 "--precision", "32-true", *extra]) == 0
    return pd.read_csv(out)


def test_predict_node_every_node_equals_full_graph_forward(tmp_path, runs):
    frame = _predict_cli(tmp_path, runs["karate"], "karate")
    ds = G.load_karate()
    assert list(frame.columns) == ["node", "class", "class_name", "p_0", "p_1"]
    assert frame["node"].tolist() == list(range(34))
    p = _probs(frame)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-6)
    assert (frame["class"].to_numpy() == p.argmax(1)).all()
    assert frame["class_name"].tolist() == [ds.class_texts[c] for c in frame["class"]]
    # reference: the saved model on the whole graph (full message passing = task-trees with every neighbour)
    with torch.no_grad():
        ref = _net(runs["karate"])(ds.x, ds.edge_index, task="node").softmax(-1).numpy()
    np.testing.assert_allclose(p, ref, atol=2e-6)


def test_predict_edge_and_graph_variants(tmp_path, runs):
    ds = G.load_karate()
    edges = _predict_cli(tmp_path, runs["karate"], "karate", "--task", "edge", name="edges.csv")
    pairs = torch.unique(torch.sort(ds.edge_index, 0).values, dim=1)
    assert pairs.shape[1] == 78 and (pairs[0] < pairs[1]).all()  # every friendship once
    assert edges[["source", "target"]].to_numpy().tolist() == pairs.t().tolist()
    with torch.no_grad():
        ref = _net(runs["karate"])(ds.x, ds.edge_index, task="edge", index=pairs).softmax(-1).numpy()
    np.testing.assert_allclose(_probs(edges), ref, atol=2e-6)

    graphs = _predict_cli(tmp_path, runs["mutag"], "mutag", name="graphs.csv")  # the run's task: graphs
    mutag = G.load_mutag()
    assert graphs["graph"].tolist() == list(range(188)) and list(graphs.columns)[-2:] == ["p_0", "p_1"]
    with torch.no_grad():  # binary head: one logit, p_1 = sigmoid
        logit = _net(runs["mutag"])(mutag.x, mutag.edge_index, task="graph", index=mutag.batch).reshape(-1)
    np.testing.assert_allclose(graphs["p_1"], torch.sigmoid(logit).numpy(), atol=2e-6)
    np.testing.assert_allclose(_probs(graphs).sum(1), 1.0, atol=1e-6)
    assert graphs["class_name"][graphs["class"] == 1].eq(mutag.class_texts[1]).all()


def test_embed_has_the_cards_width_and_equals_embed_tasks(tmp_path, runs):
    from domainfm.models.git.tasks import embed_tasks

    out = tmp_path / "emb.npz"
    assert main(["embed", "git", "--model", str(runs["karate"]), "--input", "nations", "--output", str(out),
                 "--task", "edge", "--precision", "32-true"]) == 0
    with np.load(out, allow_pickle=False) as z:
        emb, index, task = z["embeddings"], z["index"], str(z["task"])
    nations = G.load_nations()
    width = zoo.get_card("git-test").defaults["hidden_channels"]
    assert task == "edge" and emb.shape == (1992, width) and emb.dtype == np.float32
    assert index.tolist() == nations.task_index.t().tolist()  # Nations' own edge tasks (its triples)
    ref = embed_tasks(_net(runs["karate"]), nations, torch.arange(1992))
    np.testing.assert_allclose(emb, ref.numpy(), atol=2e-6)


def _karate_files(tmp_path):
    from torch_geometric.data import Data

    ds = G.load_karate()
    pt = tmp_path / "karate.pt"
    torch.save(Data(x=ds.x, edge_index=ds.edge_index, y=ds.y), pt)
    npz = tmp_path / "karate.npz"
    np.savez(npz, x=ds.x.numpy(), edge_index=ds.edge_index.numpy(), task=np.array("node"), y=ds.y.numpy(),
             task_index=np.arange(34), class_emb=ds.class_emb.numpy())
    return pt, npz


def test_torch_save_and_npz_inputs_give_the_same_predictions(tmp_path, runs):
    pt, npz = _karate_files(tmp_path)
    a = _predict_cli(tmp_path, runs["karate"], pt, name="a.csv")
    b = _predict_cli(tmp_path, runs["karate"], npz, name="b.csv")
    c = _predict_cli(tmp_path, runs["karate"], "karate", name="c.csv")
    assert len(a) == 34
    pd.testing.assert_frame_equal(a, b)
    pd.testing.assert_frame_equal(a, c)


def test_index_file_mask_and_split_select_tasks(tmp_path, runs):
    full = _predict_cli(tmp_path, runs["karate"], "karate", name="full.csv")
    ids = tmp_path / "ids.txt"
    ids.write_text("node\n5\n3\n")
    sub = _predict_cli(tmp_path, runs["karate"], "karate", "--index", str(ids), name="sub.csv")
    assert sub["node"].tolist() == [5, 3]
    np.testing.assert_allclose(_probs(sub), _probs(full)[[5, 3]], atol=1e-6)
    mask = np.zeros(34, bool)
    mask[[0, 33]] = True
    np.save(tmp_path / "mask.npy", mask)
    masked = _predict_cli(tmp_path, runs["karate"], "karate", "--index", str(tmp_path / "mask.npy"), name="m.csv")
    assert masked["node"].tolist() == [0, 33]
    test = _predict_cli(tmp_path, runs["karate"], "karate", "--split", "test", name="t.csv")
    assert test["node"].tolist() == G.load_karate().splits["test"].tolist()


def test_width_mismatch_is_one_line_naming_the_file(tmp_path, runs, capsys):
    from torch_geometric.data import Data

    bad = tmp_path / "narrow.pt"
    torch.save(Data(x=torch.randn(5, 10), edge_index=torch.tensor([[0, 1], [1, 2]])), bad)
    out = tmp_path / "never.csv"
    capsys.readouterr()
    assert main(["predict", "git", "--model", str(runs["karate"]), "--input", str(bad), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].strip().startswith("(run again with --debug")
    assert str(bad) in err[0] and "10 columns" in err[0] and "expect 384" in err[0]
    assert not out.exists() and list(tmp_path.glob(".never.csv*")) == []
    with pytest.raises(G.GraphError, match="narrow.pt: node features have 10 columns"):
        main(["--debug", "embed", "git", "--model", str(runs["karate"]), "--input", str(bad), "--output", str(out)])


class _Payload:
    """Unpickling this would create a marker file: a weights-only load must refuse it first."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_needing_other_classes_is_refused_unopened(tmp_path, runs):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Payload(str(marker))}, evil)
    with pytest.raises(G.GraphError, match="evil.pt: refused"):
        FG.predict(evil, runs["karate"])
    assert not marker.exists()


def test_bf16_stays_within_the_documented_tolerance(runs):
    for run, graph in ((runs["karate"], "karate"), (runs["mutag"], "mutag")):
        p32 = _probs(FG.predict(graph, run, precision="32-true"))
        pbf = _probs(FG.predict(graph, run, precision="bf16-mixed"))
        assert 0 < np.abs(p32 - pbf).max() <= FG.BF16_PROBABILITY_TOLERANCE  # bf16 really ran, and stayed close
        e32 = FG.embed(graph, run, precision="32-true")["embeddings"]
        ebf = FG.embed(graph, run, precision="bf16-mixed")["embeddings"]
        assert 0 < np.abs(e32 - ebf).max() / np.abs(e32).max() <= FG.BF16_EMBEDDING_TOLERANCE


def test_settings_come_from_the_run_folder(runs):
    s = FG.model_settings(runs["mutag"])
    assert (s.task, s.fanout, s.use_edge_attr, s.link) == ("graph", -1, False, False)
    assert s.class_names == G.load_mutag().class_texts
    assert FG.model_settings(runs["mutag"] / "random" / "model").task == "graph"  # RUN/<arm>/model too
    assert FG.model_settings("git-test").source.startswith("defaults")


def test_link_prediction_model_scores_node_pairs(tmp_path, runs):
    frame = _predict_cli(tmp_path, runs["link"], "karate", name="links.csv")  # the run's task: edges
    ds = G.load_karate()
    pairs = torch.unique(torch.sort(ds.edge_index, 0).values, dim=1)
    assert frame[["source", "target"]].to_numpy().tolist() == pairs.t().tolist()
    assert frame["class_name"].isin(G.LINK_CLASS_TEXTS).all()
    net = _net(runs["link"])
    assert isinstance(net.head, torch.nn.Identity)  # no head: pooled endpoints' scaled dot product
    with torch.no_grad():
        p = net.pooling_lin(net.forward_features(ds.x, ds.edge_index))
        score = (p[pairs[0]] * p[pairs[1]]).sum(-1) / math.sqrt(p.shape[1])
    np.testing.assert_allclose(frame["p_1"], torch.sigmoid(score).numpy(), atol=2e-6)
    np.testing.assert_allclose(_probs(frame).sum(1), 1.0, atol=1e-6)
    with pytest.raises(G.GraphError, match="link-prediction model scores node pairs"):
        FG.predict("karate", runs["link"], task="node")


def test_report_carries_retained_before_and_per_arm_retained(runs):
    from domainfm.models.git.in_context import in_context

    report = json.loads((runs["karate"] / "report.json").read_text())
    assert report["retained_capability"]["metric"] == "accuracy"
    before = report["retained_before"]
    # Cuneiform cannot host 5-way 3-query episodes, NCI (unlabelled) none at all: skipped, by name
    graphs = {"nations", "mutag", "kinships", "solubility"}
    assert set(before) >= graphs | {"accuracy"} and "karate" not in before  # not the tuned graph
    for skipped in ("cuneiform", "nci"):
        assert skipped not in before and skipped in before["skipped"]
    assert before["accuracy"] == pytest.approx(sum(before[g]["accuracy"] for g in graphs) / len(graphs))
    trained, frozen = report["arms"]["random"], report["arms"]["random:none"]
    # recomputed apart from the run: the arm without adaptation saved its initial weights, which every arm
    # starts from (same seed); the same 5 episodes (retained.seed 0) on each graph
    init = create_model(frozen["model_dir"]).eval()
    for g in sorted(graphs):
        again = in_context(init, FG.load_task_dataset(FG.DataSection(dataset=g)), n_way=5, k_shot=3, n_query=3,
                           n_episodes=5, seed=0)
        assert before[g]["accuracy"] == pytest.approx(again["accuracy"], abs=1e-6), g
        assert before[g]["n_way"] == again["n_way"] == {"mutag": 2, "solubility": 3}.get(g, 5)
    assert frozen["retained_before"] == trained["retained_before"]  # each arm measured its own: same init
    assert frozen["retained"] == frozen["retained_before"]  # no adaptation, nothing forgotten
    assert math.isfinite(trained["retained"]["accuracy"]) and trained["retained"] != before


def test_per_sample_loss_of_git_batches_averages_to_the_step_loss():
    from domainfm.experiment.supervised import SupervisedRecipe
    from domainfm.models.git.tasks import TaskCollate, TaskItems, link_forward, task_forward

    enc = G.HashingTextEncoder(16)
    for ds, task, n_out in ((G.load_karate(enc), "multiclass", 2), (G.load_mutag(enc), "binary", 1),
                            (G.link_prediction_split(G.load_karate(enc)), "binary", 0)):
        model = create_model("git-test", pretrained=False, n_outputs=n_out)
        collate = TaskCollate(ds, 3, 2)
        fwd = link_forward if n_out == 0 else task_forward
        recipe = SupervisedRecipe(model, TaskItems(ds.splits["train"]), task=task, forward_fn=fwd, collate_fn=collate)
        torch.manual_seed(0)
        batch = collate(ds.splits["train"][:12].tolist())
        per = recipe.per_sample_loss(model, batch)
        loss, _ = recipe.step(model, batch)
        assert per.shape == (12,) and (per > 0).all()
        torch.testing.assert_close(per.mean(), loss)
