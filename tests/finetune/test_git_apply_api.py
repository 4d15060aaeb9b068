"""``domainfm.predict`` / ``domainfm.embed`` on GIT: the same figures as the family's own functions,
the CLI and the model applied by hand (full-graph message passing), on the shipped graphs (Karate
nodes, MUTAG graphs); embeddings as a table; and ``--help`` lists the family's options."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm import cli, create_model, save_pretrained
from domainfm.data_loaders import graph as G
from domainfm.finetune import git as FG
from domainfm.models.git.tasks import embed_tasks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GIT with a 2-class head, saved as a model folder (no run: default settings)."""
    folder = tmp_path_factory.mktemp("git") / "model"
    torch.manual_seed(0)
    save_pretrained(create_model("git-test", in_channels=384, n_outputs=2), folder)  # MiniLM width
    return folder


def test_predict_equals_the_family_function_the_cli_and_the_model_by_hand(model_dir, tmp_path):
    # family= : apply.family_of_model does not yet read a model folder's config.json key "model_name"
    frame = domainfm.predict(str(model_dir), "karate", family="git", precision="32-true")
    assert list(frame.columns) == ["node", "class", "class_name", "p_0", "p_1"]
    karate = G.load_karate()
    with torch.no_grad():  # every neighbour = full-graph message passing at the roots
        p = create_model(model_dir).eval()(karate.x, karate.edge_index, task="node").softmax(-1).numpy()
    np.testing.assert_allclose(frame[["p_0", "p_1"]].to_numpy(), p, atol=2e-6)
    assert frame["class"].tolist() == p.argmax(1).tolist()
    assert frame["class_name"].tolist() == [karate.class_texts[c] for c in p.argmax(1)]  # the input's own classes
    pd.testing.assert_frame_equal(FG.predict("karate", create_model(model_dir), precision="32-true"), frame)
    out = tmp_path / "nodes.csv"
    assert cli.main(["predict", "git", "--model", str(model_dir), "--input", "karate", "--output", str(out),
                     "--precision", "32-true"]) == 0
    written = pd.read_csv(out)
    assert written["node"].tolist() == list(range(34))
    assert written["class_name"].tolist() == frame["class_name"].tolist()
    np.testing.assert_allclose(written[["p_0", "p_1"]].to_numpy(), p, atol=2e-6)
    # the family's options: a split of the input, and the task
    test = domainfm.predict(create_model(model_dir), "karate", precision="32-true", split="test")
    assert test["node"].tolist() == karate.splits["test"].tolist()
    np.testing.assert_allclose(test[["p_0", "p_1"]].to_numpy(), p[karate.splits["test"]], atol=2e-6)
    edges = domainfm.predict(str(model_dir), "karate", family="git", precision="32-true", task="edge")
    assert list(edges.columns[:2]) == ["source", "target"] and len(edges) == 78  # every friendship once
    with pytest.raises(TypeError, match="unknown option"):
        domainfm.predict(str(model_dir), "karate", family="git", stride=2)


def test_embed_equals_the_family_function_the_cli_and_the_model_by_hand(model_dir, tmp_path):
    mutag = G.load_mutag()
    net = create_model(model_dir).eval()
    ref = embed_tasks(net, mutag, torch.arange(188)).numpy()  # pooling_lin of each graph's mean node state
    arrays = domainfm.embed(net, "mutag", precision="32-true")
    assert arrays["task"] == "graph" and arrays["index"].tolist() == list(range(188))
    np.testing.assert_allclose(arrays["embeddings"], ref, atol=2e-6)
    np.testing.assert_array_equal(FG.embed("mutag", net, precision="32-true")["embeddings"], arrays["embeddings"])
    out = tmp_path / "graphs.npz"
    assert cli.main(["embed", "git", "--model", str(model_dir), "--input", "mutag", "--output", str(out),
                     "--precision", "32-true"]) == 0
    with np.load(out) as saved:  # plain arrays: loads without pickle
        assert sorted(saved) == ["embeddings", "index", "model", "precision", "task"]
        np.testing.assert_allclose(saved["embeddings"], ref, atol=2e-6)
        assert str(saved["task"]) == "graph" and str(saved["model"]) == str(model_dir)
        assert str(saved["precision"]) == "32-true"
    table = tmp_path / "graphs.csv"  # the same embeddings as a table: id column, emb_<k>
    assert cli.main(["embed", "git", "--model", str(model_dir), "--input", "mutag", "--output", str(table),
                     "--precision", "32-true"]) == 0
    written = pd.read_csv(table)
    assert list(written.columns) == ["graph"] + [f"emb_{k}" for k in range(net.num_features)]
    np.testing.assert_allclose(written.drop(columns="graph").to_numpy(), ref, atol=1e-6)


def test_a_missing_input_that_is_no_shipped_graph_is_named(model_dir, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "never.csv"
    assert cli.main(["predict", "git", "--model", str(model_dir), "--input", "karat", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "karat: no such file" in err and "karate" in err and not out.exists()


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_help_lists_the_family_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "git", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    for flag in ("--task", "--index", "--split", "--seed", "--batch-size", "--model", "--input"):
        assert flag in text, flag
    assert "--task {node,edge,graph}" in text and "a shipped graph's name (karate, nations, mutag)" in text
