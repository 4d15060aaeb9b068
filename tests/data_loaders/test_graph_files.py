"""read_graph / read_ids: the graph files predict and embed accept."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from domainfm.data_loaders import graph as G


def _data(n=6, f=4, y=True):
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(0)
    ei = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    return Data(x=torch.randn(n, f, generator=g), edge_index=ei, **({"y": torch.arange(n) % 2} if y else {}),
                train_mask=torch.arange(n) < 3)


def test_a_saved_data_is_read_weights_only_as_a_node_graph(tmp_path):
    d = _data()
    path = tmp_path / "g.pt"
    torch.save(d, path)
    ds = G.read_graph(path)
    assert ds.task == "node" and ds.name == str(path)
    torch.testing.assert_close(ds.x, d.x)
    assert ds.edge_index.tolist() == d.edge_index.tolist() and ds.y.tolist() == d.y.tolist()
    assert ds.splits["train"].tolist() == [0, 1, 2] and ds.num_classes == 2
    unlabelled = tmp_path / "u.pt"
    torch.save(_data(y=False), unlabelled)
    u = G.read_graph(unlabelled)
    assert u.num_classes == 0 and (u.y == -1).all() and u.labels == "none"


def test_a_saved_list_of_data_is_a_graph_set(tmp_path):
    graphs = [_data(n=3), _data(n=6)]
    graphs[0].edge_index = torch.tensor([[0, 1], [1, 2]])
    graphs[0].y, graphs[1].y = torch.tensor([1]), torch.tensor([0])
    path = tmp_path / "set.pt"
    torch.save(graphs, path)
    ds = G.read_graph(path)
    assert ds.task == "graph" and ds.ptr.tolist() == [0, 3, 9] and ds.y.tolist() == [1, 0]
    # the second graph's edges are shifted by the first graph's 3 nodes
    assert ds.edge_index[:, 2:].tolist() == (graphs[1].edge_index + 3).tolist()


def test_refusals_name_the_file(tmp_path):
    not_torch = tmp_path / "notes.pt"
    not_torch.write_text("hello")
    with pytest.raises(G.GraphError, match="notes.pt: not a graph saved with torch.save"):
        G.read_graph(not_torch)
    tensor_only = tmp_path / "t.pt"
    torch.save(torch.zeros(3), tensor_only)
    with pytest.raises(G.GraphError, match="t.pt: holds a Tensor"):
        G.read_graph(tensor_only)
    with pytest.raises(FileNotFoundError, match="not one of the shipped graphs"):
        G.read_graph(tmp_path / "missing.pt")
    wide = tmp_path / "wide.pt"
    torch.save(_data(f=5), wide)
    with pytest.raises(G.GraphError, match=r"wide.pt: node features have 5 columns but the model/other graphs expect 7"):
        G.read_graph(wide, feature_dim=7)


def test_a_saved_batch_is_refused_with_to_data_list_as_the_fix(tmp_path):
    from torch_geometric.data import Batch

    graphs = [_data(n=6), _data(n=7)]
    path = tmp_path / "batch.pt"
    torch.save(Batch.from_data_list(graphs), path)
    with pytest.raises(G.GraphError) as info:
        G.read_graph(path)
    message = str(info.value)
    assert "batch.pt" in message and "Batch" in message and "to_data_list()" in message, message
    # torch's own advice would have the user allow-list classes this reader never unpickles
    assert "add_safe_globals" not in message and "safe_globals" not in message, message
    # the suggested fix reads back as the graph set
    torch.save(Batch.from_data_list(graphs).to_data_list(), path)
    ds = G.read_graph(path)
    assert ds.task == "graph" and ds.ptr.tolist() == [0, 6, 13]


def test_a_refused_class_is_named_without_torchs_allow_list_advice(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"x": torch.zeros(2), "when": __import__("datetime").date(2024, 1, 1)}, path)
    with pytest.raises(G.GraphError, match="other.pt: refused") as info:
        G.read_graph(path)
    assert "datetime" in str(info.value) and "safe_globals" not in str(info.value), str(info.value)


def test_npz_and_shipped_names():
    ds = G.read_graph("karate", encoder=G.HashingTextEncoder(32), feature_dim=32)
    assert ds.name == "karate" and ds.x.shape == (34, 32)
    with pytest.raises(G.GraphError, match="karate: node features have 32 columns but the model/other graphs expect 8"):
        G.read_graph("karate", encoder=G.HashingTextEncoder(32), feature_dim=8)


def test_read_ids(tmp_path):
    (tmp_path / "n.txt").write_text("id\n4\n2\n\n7\n")
    assert G.read_ids(tmp_path / "n.txt", columns=1).tolist() == [4, 2, 7]
    (tmp_path / "e.csv").write_text("u,v\n0,1\n2,3\n")
    assert G.read_ids(tmp_path / "e.csv", columns=2).tolist() == [[0, 2], [1, 3]]
    assert G.read_ids(tmp_path / "e.csv").tolist() == [[0, 2], [1, 3]]  # two per line: pairs
    assert G.read_ids(tmp_path / "n.txt").tolist() == [4, 2, 7]
    np.save(tmp_path / "p.npy", np.array([[0, 1], [2, 3]]))
    assert G.read_ids(tmp_path / "p.npy").tolist() == [[0, 2], [1, 3]]
    np.save(tmp_path / "m.npy", np.array([False, True, True]))
    assert G.read_ids(tmp_path / "m.npy", columns=1).tolist() == [1, 2]
    (tmp_path / "bad.txt").write_text("1\nx\n")
    with pytest.raises(G.GraphError, match="bad.txt: line 2"):
        G.read_ids(tmp_path / "bad.txt", columns=1)
    np.save(tmp_path / "f.npy", np.array([0.5, 1.0]))
    with pytest.raises(G.GraphError, match="f.npy: ids must be integers"):
        G.read_ids(tmp_path / "f.npy", columns=1)
