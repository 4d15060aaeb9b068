"""User graph files (.npz): ids and labels are checked before any cast, and a file that is not a
plain-array .npz is named in the error."""
from __future__ import annotations

import numpy as np
import pytest

from domainfm.data_loaders import graph as G


def _write(path, **override):
    arrays = dict(x=np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32),
                  edge_index=np.array([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]), task=np.array("node"),
                  y=np.array([0, 1, 0, 1, 0, 1]), task_index=np.arange(6), class_emb=np.eye(2, 4, dtype=np.float32))
    arrays.update(override)
    np.savez(path, **arrays)
    return path


def test_a_valid_file_loads(tmp_path):
    ds = G.load_graph_dir(_write(tmp_path / "ok.npz"))[0]
    assert ds.num_classes == 2 and ds.edge_index.dtype.is_floating_point is False


def test_float_edge_ids_are_refused_not_truncated(tmp_path):
    path = _write(tmp_path / "f.npz", edge_index=np.array([[0.0, 1.7], [1.0, 2.2]]))
    with pytest.raises(G.GraphError, match=r"f.npz: 'edge_index' must hold integers, got float64"):
        G.load_graph_dir(path)


def test_labels_outside_the_classes_are_refused(tmp_path):
    path = _write(tmp_path / "y.npz", y=np.array([0, 1, 0, 2, 0, 1]))
    with pytest.raises(G.GraphError, match=r"y.npz: label 2 in 'y' is outside the 2 classes"):
        G.load_graph_dir(path)


def test_a_file_that_is_not_a_plain_npz_is_named(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not an archive")
    with pytest.raises(G.GraphError, match=r"bad.npz: not a readable .npz"):
        G.load_graph_dir(bad)
    pickled = tmp_path / "obj.npz"
    _write(pickled, y=np.array([{"a": 1}] * 6, dtype=object))  # an object array needs pickle to read
    with pytest.raises(G.GraphError, match=r"obj.npz: not a readable .npz"):
        G.load_graph_dir(pickled)
