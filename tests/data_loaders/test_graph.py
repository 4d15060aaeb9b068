"""Graph data: CSR sampling, task-trees (roots, depths, fan-outs), validation, text features, shipped graphs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from domainfm.data_loaders import graph as G
from domainfm.data_loaders.graph.datasets import atom_text


def _star_and_path():
    """Node 0 has in-neighbours 1..20 (a star), a path 20 -> 21 -> 22, and isolated node 23."""
    src = list(range(1, 21)) + [20, 21]
    dst = [0] * 20 + [21, 22]
    # reverse edges too, so every edge is undirected
    ei = torch.tensor([src + dst, dst + src])
    x = torch.arange(24, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    return x, ei


def _in_neighbors(edge_index, v):
    return set(edge_index[0, edge_index[1] == v].tolist())


@pytest.mark.parametrize("fanout", [1, 3, 5, 19, 20, 25, -1])
def test_sampler_respects_fanout_distinct_and_real_neighbours(fanout):
    x, ei = _star_and_path()
    csr = G.build_csr(ei, 24)
    nodes = torch.tensor([0, 21, 23, 0, 5])
    nb, parent, eid = G.sample_neighbors(csr, nodes, fanout, torch.Generator().manual_seed(0))
    assert torch.all(parent[1:] >= parent[:-1])  # grouped by parent in input order
    deg = {0: 20, 21: 2, 23: 0, 5: 1}
    for pos, v in enumerate(nodes.tolist()):
        mine = nb[parent == pos].tolist()
        expected = deg[v] if fanout < 0 else min(deg[v], fanout)
        assert len(mine) == expected and len(set(mine)) == expected
        assert set(mine) <= _in_neighbors(ei, v)
    # the edge ids point at edges that really connect neighbour -> parent
    torch.testing.assert_close(ei[0, eid], nb)
    torch.testing.assert_close(ei[1, eid], nodes[parent])


def test_sampler_large_degree_path_and_reproducibility():
    # a hub with 1000 in-neighbours exercises Floyd's comparison path (degree beyond a 63-bit mask)
    n = 1001
    ei = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])
    csr = G.build_csr(ei, n)
    nodes = torch.zeros(50, dtype=torch.long)
    a = G.sample_neighbors(csr, nodes, 10, torch.Generator().manual_seed(7))
    b = G.sample_neighbors(csr, nodes, 10, torch.Generator().manual_seed(7))
    c = G.sample_neighbors(csr, nodes, 10, torch.Generator().manual_seed(8))
    for t1, t2 in zip(a, b):
        assert torch.equal(t1, t2)
    assert not torch.equal(a[0], c[0])
    per_row = a[0].reshape(50, 10)
    assert all(len(set(r.tolist())) == 10 for r in per_row)
    # uniform: over 50 x 10 draws every neighbour is equally likely (mean id ~ 500)
    assert 400 < per_row.float().mean() < 600


def _subset_counts(csr, node, fanout, draws, seed):
    nb, parent, _ = G.sample_neighbors(csr, torch.full((draws,), node), fanout, torch.Generator().manual_seed(seed))
    rows = nb.reshape(draws, fanout).sort(dim=1).values
    _, counts = torch.unique(rows, dim=0, return_counts=True)
    return counts


@pytest.mark.parametrize("degree,fanout", [(5, 3), (12, 10), (70, 2)])
def test_sampler_draws_every_subset_uniformly(degree, fanout):
    """Without replacement, every fanout-subset of the in-edges is equally likely: a chi-square test
    over all C(degree, fanout) subsets (bit-mask path for small degrees, comparisons for 70)."""
    from math import comb

    from scipy.stats import chisquare

    ei = torch.stack([torch.arange(1, degree + 1), torch.zeros(degree, dtype=torch.long)])
    csr = G.build_csr(ei, degree + 1)
    n_subsets = comb(degree, fanout)
    draws = 60 * n_subsets
    counts = _subset_counts(csr, 0, fanout, draws, seed=3)
    assert counts.numel() == n_subsets  # every subset occurs
    assert chisquare(counts.numpy()).pvalue > 1e-3
    if n_subsets == 10:  # the test has power: moving 2/3 of one subset's draws to another fails it
        biased = counts.clone()
        biased[0] += 40
        biased[1] -= 40
        assert chisquare(biased.numpy()).pvalue < 1e-3


def test_sampler_fanout_above_floyd_limit_uses_ranked_keys():
    n = 201
    ei = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])
    csr = G.build_csr(ei, n)
    nb, parent, _ = G.sample_neighbors(csr, torch.zeros(400, dtype=torch.long), 100, torch.Generator().manual_seed(1))
    rows = nb.reshape(400, 100)
    assert all(len(set(r.tolist())) == 100 for r in rows)
    # each neighbour is in a sample with probability 100/200
    freq = torch.bincount(nb, minlength=n)[1:].float() / 400
    assert abs(freq.mean() - 0.5) < 1e-6 and freq.min() > 0.38 and freq.max() < 0.62


def _tree_cases():
    torch.manual_seed(0)
    n = 300
    ei = torch.randint(0, n, (2, 4000))
    hub = torch.stack([torch.arange(1, 100), torch.zeros(99, dtype=torch.long)])  # a degree-99 node
    ei = torch.cat([ei, hub], 1)
    x, ea = torch.randn(n, 5), torch.randn(ei.shape[1], 3)
    ptr = torch.tensor([0, 100, 200, 300])
    tasks = [("node", torch.randint(0, n, (50,))), ("edge", ei[:, :40]), ("graph", torch.tensor([0, 2, 1, 2]))]
    for task, index in tasks:
        for virtual_root in (True, False):
            if task == "graph" and not virtual_root:
                continue
            for shared in (True, False):
                for fanouts in ([10, 10], [3, -1], [2, 70], [-1, 5, 3], [1, 4]):
                    yield x, ei, ea, ptr, task, index, virtual_root, shared, fanouts



def test_numba_backend_loads_the_git_kernels(monkeypatch):
    # the equality test below would pass trivially if the kernels failed to import (silent torch fallback)
    from domainfm.models.git import _task_tree_numba, task_trees

    monkeypatch.setenv("DOMAINFM_GRAPH_BACKEND", "numba")
    assert task_trees._numba_kernels() is _task_tree_numba
    monkeypatch.setenv("DOMAINFM_GRAPH_BACKEND", "torch")
    assert task_trees._numba_kernels() is None
    assert G.build_task_trees is task_trees.build_task_trees  # re-exported for existing callers

def test_numba_and_torch_paths_build_identical_trees(monkeypatch):
    checked = 0
    for x, ei, ea, ptr, task, index, virtual_root, shared, fanouts in _tree_cases():
        built = {}
        for backend in ("torch", "numba"):
            monkeypatch.setenv("DOMAINFM_GRAPH_BACKEND", backend)
            built[backend] = G.build_task_trees(x, ei, task, index, fanouts, ptr=ptr, virtual_root=virtual_root,
                                                shared=shared, edge_attr=ea, generator=torch.Generator().manual_seed(5))
        for field, value in built["torch"].__dict__.items():
            other = built["numba"].__dict__[field]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (task, virtual_root, shared, fanouts, field)
            else:
                assert value == other
        checked += 1
    assert checked == 50


def test_trees_need_cpu_tensors():
    x, ei = _star_and_path()
    with pytest.raises(G.GraphError, match="x on meta.*built on CPU tensors"):
        G.build_task_trees(x.to("meta"), ei, "node", torch.tensor([0]), [10, 10], shared=True)
    with pytest.raises(G.GraphError, match="index on another device"):
        G.build_task_trees(x, ei, "node", torch.tensor([0], device="meta"), [10, 10])


def test_unknown_graph_backend_is_named(monkeypatch):
    x, ei = _star_and_path()
    monkeypatch.setenv("DOMAINFM_GRAPH_BACKEND", "pyg-lib")
    with pytest.raises(G.GraphError, match="DOMAINFM_GRAPH_BACKEND='pyg-lib'"):
        G.build_task_trees(x, ei, "node", torch.tensor([0]), [10, 10], shared=True)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_trees_built_in_threads_equal_sequential_builds(backend, monkeypatch):
    """The shared form's id maps are per thread: concurrent builds do not see each other's nodes."""
    import threading

    if backend == "numba":
        monkeypatch.setenv("DOMAINFM_GRAPH_BACKEND", backend)
    torch.manual_seed(2)
    n = 500
    ei = torch.randint(0, n, (2, 5000))
    x = torch.randn(n, 4)
    csr = G.build_csr(ei, n)
    jobs = [ei[:, 100 * i:100 * i + 300] for i in range(6)]

    def build(i):
        return G.build_task_trees(x, None, "edge", jobs[i], [10, 10], csr=csr, shared=True,
                                  generator=torch.Generator().manual_seed(i))

    expected = [build(i) for i in range(len(jobs))]
    got = [None] * len(jobs)

    def worker(i):
        for _ in range(5):
            got[i] = build(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(expected, got):
        assert torch.equal(a.node_id, b.node_id) and torch.equal(a.edge_index, b.edge_index)


def test_node_task_trees_virtual_root_form():
    x, ei = _star_and_path()
    trees = G.build_task_trees(x, ei, "node", torch.tensor([0, 22, 23]), [10, 10],
                               generator=torch.Generator().manual_seed(0))
    assert torch.equal(trees.roots, torch.tensor([0, 1, 2]))
    assert torch.equal(trees.node_id[:3], torch.tensor([-1, -1, -1]))
    assert torch.all(trees.x[:3] == 0)  # virtual roots carry all-zero features
    assert trees.depth.max() == 2  # the virtual node spends one hop
    # depth 1 = the task nodes, one per tree
    d1 = trees.depth == 1
    assert torch.equal(trees.node_id[d1], torch.tensor([0, 22, 23]))
    assert torch.equal(trees.tree[d1], torch.tensor([0, 1, 2]))
    # depth 2: 10 of node 0's 20 neighbours, node 22's single neighbour 21, nothing for isolated 23
    d2 = trees.depth == 2
    assert (trees.tree[d2] == 0).sum() == 10 and (trees.tree[d2] == 1).sum() == 1 and (trees.tree[d2] == 2).sum() == 0
    assert set(trees.node_id[d2 & (trees.tree == 0)].tolist()) <= set(range(1, 21))
    # every tree edge goes child -> parent, one level up, inside one tree
    c, p = trees.edge_index
    assert torch.all(trees.depth[c] == trees.depth[p] + 1) and torch.equal(trees.tree[c], trees.tree[p])
    assert torch.equal(torch.bincount(c, minlength=len(trees.node_id))[3:], torch.ones(len(trees.node_id) - 3, dtype=torch.long))
    torch.testing.assert_close(trees.x[3:], x[trees.node_id[3:]])


def test_edge_and_graph_task_trees():
    x, ei = _star_and_path()
    pairs = torch.tensor([[0, 20], [1, 21]])  # (0, 1) and (20, 21)
    t = G.build_task_trees(x, ei, "edge", pairs, [5, 3], generator=torch.Generator().manual_seed(1))
    d1 = t.depth == 1
    assert t.node_id[d1].tolist() == [0, 1, 20, 21] and t.tree[d1].tolist() == [0, 0, 1, 1]
    d2 = t.depth == 2
    children = torch.bincount(t.edge_index[1][d2[t.edge_index[0]]], minlength=len(t.node_id))
    assert children[d1].tolist() == [3, 1, 2, 2]  # min(degree, 3) for nodes 0, 1, 20, 21
    # fine-tuning form: no virtual node, the endpoints are the roots (2, B)
    f = G.build_task_trees(x, ei, "edge", pairs, [-1], virtual_root=False)
    assert f.roots.shape == (2, 2) and f.node_id[f.roots[0]].tolist() == [0, 20] and f.node_id[f.roots[1]].tolist() == [1, 21]
    assert f.depth.max() == 1 and (f.depth == 1).sum() == 20 + 1 + 2 + 2
    # graph tasks: graphs as a batch with ptr; fan-out 2 of the graph's nodes under the root
    ptr = torch.tensor([0, 5, 8, 24])
    g = G.build_task_trees(x, ei, "graph", torch.tensor([1, 0]), [2, 1], ptr=ptr, generator=torch.Generator().manual_seed(0))
    d1 = g.depth == 1
    ids, tree = g.node_id[d1], g.tree[d1]
    assert tree.tolist() == [0, 0, 1, 1]
    assert set(ids[:2].tolist()) <= {5, 6, 7} and set(ids[2:].tolist()) <= set(range(5))
    with pytest.raises(G.GraphError, match="virtual root"):
        G.build_task_trees(x, ei, "graph", torch.tensor([0]), [2], ptr=ptr, virtual_root=False)


def test_task_trees_reproducible_with_seed_and_edge_attr_follow_edges():
    x, ei = _star_and_path()
    attr = torch.arange(ei.shape[1], dtype=torch.float32).unsqueeze(1)
    make = lambda s: G.build_task_trees(x, ei, "node", torch.tensor([0, 0, 21]), [3, 4], edge_attr=attr,
                                        generator=torch.Generator().manual_seed(s))
    a, b, c = make(3), make(3), make(4)
    assert torch.equal(a.node_id, b.node_id) and torch.equal(a.edge_index, b.edge_index)
    assert not torch.equal(a.node_id, c.node_id)
    # edge_attr of each tree edge below depth 1 is the attr of the graph edge child -> parent
    child, parent = a.edge_index
    real = a.depth[parent] >= 1
    eids = a.edge_attr[real, 0].long()
    assert torch.equal(ei[0, eids], a.node_id[child[real]]) and torch.equal(ei[1, eids], a.node_id[parent[real]])
    assert torch.all(a.edge_attr[~real] == 0)


def test_tree_gnn_with_all_neighbours_equals_full_graph():
    from domainfm.models.git import GIT

    torch.manual_seed(0)
    x = torch.randn(30, 8)
    ei = torch.randint(0, 30, (2, 90))
    model = GIT(8, 8, 2, dropout=0.0).eval()
    full = model.task_embedding(model.forward_features(x, ei), "node", torch.tensor([3, 7, 11]))
    t = G.build_task_trees(x, ei, "node", torch.tensor([3, 7, 11]), [-1, -1], virtual_root=False)
    tree = model.task_embedding(model.forward_features(t.x, t.edge_index), "node", t.roots)
    torch.testing.assert_close(tree, full, rtol=1e-5, atol=1e-5)


def test_bad_graphs_give_clear_errors():
    x = torch.randn(4, 3)
    with pytest.raises(G.GraphError, match="node id 9, outside \\[0, 4\\)"):
        G.check_graph(x, torch.tensor([[0, 9], [1, 2]]), name="g1")
    with pytest.raises(G.GraphError, match="node id -1"):
        G.check_graph(x, torch.tensor([[0, -1], [1, 2]]))
    with pytest.raises(G.GraphError, match="empty"):
        G.check_graph(torch.zeros(0, 3), torch.zeros(2, 0, dtype=torch.long), name="g2")
    with pytest.raises(G.GraphError, match="3 columns but .* expect 5"):
        G.check_graph(x, torch.tensor([[0], [1]]), feature_dim=5)
    with pytest.raises(G.GraphError, match="shape \\(2, num_edges\\)"):
        G.check_graph(x, torch.tensor([0, 1, 2]))
    with pytest.raises(G.GraphError, match="NaN"):
        G.check_graph(torch.tensor([[float("nan")]]), torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(G.GraphError, match="fan-out"):
        G.build_task_trees(x, torch.tensor([[0], [1]]), "node", torch.tensor([0]), [0])
    with pytest.raises(G.GraphError, match="outside"):
        G.build_task_trees(x, torch.tensor([[0], [1]]), "node", torch.tensor([7]), [2])
    with pytest.raises(G.GraphError, match="graph 1 has no nodes"):
        G.build_task_trees(x, torch.tensor([[0], [1]]), "graph", torch.tensor([1]), [2], ptr=torch.tensor([0, 4, 4]))
    # isolated nodes are allowed: a tree with no children
    t = G.build_task_trees(x, torch.tensor([[0], [1]]), "node", torch.tensor([3]), [2, 2])
    assert t.node_id.tolist() == [-1, 3] and t.edge_index.tolist() == [[1], [0]]


def test_hashing_encoder_and_cache(tmp_path):
    enc = G.HashingTextEncoder(64)
    a = enc.encode(["a carbon atom", "a carbon atom", "an oxygen atom"])
    assert a.shape == (3, 64) and torch.equal(a[0], a[1])
    torch.testing.assert_close(a.norm(dim=1), torch.ones(3))
    assert (a[0] @ a[2]) < 0.99
    calls = []

    class Counting:
        name, dim = "counting", 2

        def encode(self, texts):
            calls.append(list(texts))
            return torch.tensor([[len(t), 1.0] for t in texts])

    cached = G.CachedTextEncoder(Counting(), tmp_path)
    out = cached.encode(["ab", "abc", "ab"])
    assert out.tolist() == [[2, 1], [3, 1], [2, 1]]
    assert G.CachedTextEncoder(Counting(), tmp_path).encode(["abc"]).tolist() == [[3, 1]]
    assert [sorted(c) for c in calls] == [["ab", "abc"]]  # the second encoder read the cache file


def test_shipped_graphs_load_with_shipped_embeddings_only(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # prove the core path does not need it
    enc = G.text_encoder("minilm")
    karate = G.load_karate(enc)
    assert karate.x.shape == (34, 384) and karate.edge_index.shape == (2, 156)
    assert karate.y.bincount().tolist() == [17, 17] and karate.num_classes == 2
    assert sum(v.numel() for v in karate.splits.values()) == 34
    nations = G.load_nations(enc)
    assert nations.task_index.shape == (2, 1992) and nations.num_classes == 55 and nations.splits["test"].numel() == 201
    mutag = G.load_mutag(enc)
    assert mutag.ptr.numel() == 189 and mutag.x.shape == (3371, 384) and mutag.y.bincount().tolist() == [63, 125]
    assert mutag.edge_attr.shape == (7442, 384)
    x, ei, batch, _ = mutag.graphs(torch.tensor([2, 0]))
    n2, n0 = int(mutag.ptr[3] - mutag.ptr[2]), int(mutag.ptr[1] - mutag.ptr[0])
    assert batch.bincount().tolist() == [n2, n0] and x.shape[0] == n2 + n0
    G.check_graph(x, ei)
    kinships = G.load_kinships(enc)
    # every one of the 10,686 triples is a task; message passing runs over the training pairs only
    assert kinships.task_index.shape == (2, 10686) and kinships.num_classes == 25 and kinships.x.shape == (104, 384)
    assert [kinships.splits[k].numel() for k in ("train", "val", "test")] == [8544, 1068, 1074]
    assert torch.equal(kinships.x[0], kinships.x[-1])  # anonymous persons: one text, one feature row
    cuneiform = G.load_cuneiform(enc)
    assert cuneiform.ptr.numel() == 268 and cuneiform.x.shape == (5680, 384) and cuneiform.num_classes == 30
    assert cuneiform.edge_index.shape == (2, 23922) and len(set(map(tuple, cuneiform.x.tolist()))) == 12
    solubility = G.load_solubility(enc)
    # 1,282 molecules less the three isomorphic to a MUTAG graph; low/medium/high as in the SDF files
    assert solubility.ptr.numel() == 1280 and solubility.x.shape == (16634, 384)
    assert solubility.y.bincount().tolist() == [518, 515, 246] and solubility.edge_attr.shape == (34230, 384)
    # one atom text space with MUTAG: a carbon atom has the same features in both datasets
    # (counts from the SDF files: 12,501 carbons, 24 of them in the three molecules dropped)
    carbon = enc.encode([atom_text("carbon", "C")])[0]
    assert torch.equal(mutag.x[0], carbon) and int((solubility.x == carbon).all(1).sum()) == 12477
    nci = G.load_nci(enc)
    # 4,999 lines: 8 unparsable, 204 with other elements, 231 isomorphic to a MUTAG or Solubility graph
    assert nci.ptr.numel() == 4557 and nci.num_classes == 1 and nci.edge_index.shape == (2, 152368)
    # MiniLM embeddings: the mutagenic class text is closer to "mutagenic" wording than the karate text
    with pytest.raises(ImportError, match="domainfm\\[text\\]"):
        enc.encode(["a text that was never shipped"])


def test_graph_dir_npz_roundtrip_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "toy.npz", x=rng.normal(size=(6, 4)).astype(np.float32),
             edge_index=np.array([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]), task=np.array("node"),
             y=np.array([0, 1, 0, 1, 0, 1]), task_index=np.arange(6), class_emb=np.eye(2, 4, dtype=np.float32))
    (ds,) = G.load_graph_dir(tmp_path)
    assert ds.name == "toy" and ds.task == "node" and ds.num_classes == 2 and ds.csr.num_nodes == 6
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 4), np.float32), edge_index=np.array([[0], [5]]),
             task=np.array("node"), y=np.zeros(3, int), task_index=np.arange(3), class_emb=np.eye(2, 4))
    with pytest.raises(G.GraphError, match="bad: edge_index contains node id 5"):
        G.load_graph_dir(tmp_path / "bad.npz")
    np.savez(tmp_path / "missing.npz", x=np.zeros((3, 4), np.float32))
    with pytest.raises(G.GraphError, match="missing key"):
        G.load_graph_dir(tmp_path / "missing.npz")


@pytest.mark.parametrize("shared", [False, True])
def test_all_neighbour_trees_equal_full_graph_in_both_forms(shared):
    from domainfm.models.git import GIT

    torch.manual_seed(1)
    x = torch.randn(25, 8)
    ei = torch.randint(0, 25, (2, 70))
    model = GIT(8, 8, 2, dropout=0.0).eval()
    z = model.forward_features(x, ei)
    pairs = torch.tensor([[3, 3, 9], [4, 9, 9]])
    t = G.build_task_trees(x, ei, "edge", pairs, [-1, -1], virtual_root=False, shared=shared)
    zt = model.forward_features(t.x, t.edge_index)
    torch.testing.assert_close(model.task_embedding(zt, "edge", t.roots), model.task_embedding(z, "edge", pairs),
                               rtol=1e-5, atol=1e-5)
    # virtual-root form with all neighbours: the root is the mean over the task's nodes
    v = G.build_task_trees(x, ei, "edge", pairs, [-1, -1, -1], virtual_root=True, shared=shared)
    zv = model.forward_features(v.x, v.edge_index)
    expected = model.pooling_lin((z[pairs[0]] + z[pairs[1]]) / 2)
    torch.testing.assert_close(model.virtual_root_embedding(zv, v.edge_index, v.roots), expected, rtol=1e-5, atol=1e-5)


def test_shared_trees_hold_each_node_once_and_respect_fanout():
    torch.manual_seed(0)
    n = 200
    ei = torch.randint(0, n, (2, 2000))
    x = torch.randn(n, 4)
    t = G.build_task_trees(x, ei, "node", torch.randint(0, n, (64,)), [10, 5], shared=True,
                           generator=torch.Generator().manual_seed(0))
    real = t.node_id >= 0
    assert t.node_id[real].unique().numel() == real.sum()  # every graph node at most once
    assert (t.node_id == -1).sum() == 64 and t.depth.max() <= 2
    child, parent = t.edge_index
    fan_in = torch.bincount(parent, minlength=t.node_id.numel())
    assert torch.all(fan_in[t.roots] == 1)  # a node task's root has its node as only child
    assert fan_in[t.depth == 1].max() == 5  # fanouts[1] neighbours below each task node (degree ~10)
    assert torch.all(fan_in[t.depth == 2] == 0)
    assert torch.all(t.depth[child] <= t.depth[parent] + 1)
    unrolled = G.build_task_trees(x, ei, "node", torch.randint(0, n, (64,)), [10, 5], shared=False)
    assert t.node_id.numel() < unrolled.node_id.numel()


def test_merged_task_trees_stay_level_ordered_and_consistent():
    x, ei = _star_and_path()
    a = G.build_task_trees(x, ei, "node", torch.tensor([0, 21]), [10, 3], shared=True)
    b = G.build_task_trees(x, ei, "edge", torch.tensor([[20], [21]]), [10, 3], shared=True)
    m = G.merge_task_trees([a, b])
    assert torch.all(m.depth[1:] >= m.depth[:-1])
    assert m.num_trees == 3 and torch.all(m.node_id[m.roots] == -1) and torch.all(m.depth[m.roots] == 0)
    # every edge still connects the same graph nodes as before the merge
    before = sorted(zip(torch.cat([a.node_id[a.edge_index[0]], b.node_id[b.edge_index[0]]]).tolist(),
                        torch.cat([a.node_id[a.edge_index[1]], b.node_id[b.edge_index[1]]]).tolist()))
    after = sorted(zip(m.node_id[m.edge_index[0]].tolist(), m.node_id[m.edge_index[1]].tolist()))
    assert before == after
    children_of_last_root = m.node_id[m.edge_index[0][m.edge_index[1] == m.roots[2]]]
    assert sorted(children_of_last_root.tolist()) == [20, 21]


def test_pretraining_mixture_rejects_mismatched_feature_widths_and_empty_graphs():
    a = G.load_karate(G.HashingTextEncoder(32))
    b = G.load_nations(G.HashingTextEncoder(48))
    with pytest.raises(G.GraphError, match="different feature widths \\(karate: 32, nations: 48\\)"):
        G.PretrainTaskTable([a, b])
    with pytest.raises(G.GraphError, match="task type 'subgraph'"):
        G.PretrainTaskTable([a], ["subgraph"])
    with pytest.raises(G.GraphError, match="graph 1 is empty"):
        G.GraphDataset(name="mols", task="graph", x=torch.randn(3, 4), edge_index=torch.tensor([[0], [1]]),
                       ptr=torch.tensor([0, 3, 3]), task_index=torch.arange(2), y=torch.tensor([0, 1]), splits={},
                       class_texts=["a", "b"], class_emb=torch.zeros(2, 4), labels="", encoder="")
    table = G.PretrainTaskTable([a, G.load_karate(G.HashingTextEncoder(32))], ["own", "graph"])
    assert table.counts() == {"karate/node": 68}  # a single graph has no graph-level task
    assert len(table) == 68
    batch = table.collate(list(range(0, 68, 3)))
    assert batch.num_trees == 23 and torch.all(batch.depth[batch.roots] == 0)


def test_from_pyg_node_data_and_graph_list():
    from torch_geometric.data import Data

    x = torch.randn(6, 8)
    ei = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    mask = lambda idx: torch.zeros(6, dtype=torch.bool).index_fill_(0, torch.tensor(idx), True)
    data = Data(x=x, edge_index=ei, y=torch.tensor([0, 1, 0, 1, 0, 1]), train_mask=mask([0, 1]),
                val_mask=mask([2, 3]), test_mask=mask([4, 5]))
    ds = G.from_pyg(data, name="toy", class_texts=["even", "odd"], encoder=G.HashingTextEncoder(8))
    assert ds.task == "node" and ds.splits["test"].tolist() == [4, 5] and ds.class_emb.shape == (2, 8)
    graphs = [Data(x=torch.randn(n, 8), edge_index=torch.tensor([[0], [1]]), y=torch.tensor([n % 2])) for n in (3, 4, 5, 2, 3, 4)]
    gds = G.from_pyg(graphs, name="mols")
    assert gds.task == "graph" and gds.ptr.tolist() == [0, 3, 7, 12, 14, 17, 21] and gds.y.tolist() == [1, 0, 1, 0, 1, 0]
    with pytest.raises(G.GraphError, match="empty"):
        G.from_pyg([Data(x=torch.zeros(0, 8), edge_index=torch.zeros(2, 0, dtype=torch.long), y=torch.tensor([0]))])
    with pytest.raises(G.GraphError, match="node id 9"):
        G.from_pyg(Data(x=x, edge_index=torch.tensor([[0], [9]]), y=torch.zeros(6, dtype=torch.long)))


def test_no_shipped_pretraining_molecule_is_a_held_out_graph():
    """MUTAG and Solubility are GIT's held-out evaluation sets: no NCI (pretraining) molecule may
    have the same labelled graph (atoms by element, bonds by kind) as one of theirs, and no
    Solubility molecule that of a MUTAG compound."""
    import networkx as nx

    enc = G.text_encoder("minilm")
    sets = {name: G.load_dataset(name, enc) for name in ("mutag", "solubility", "nci")}
    # label ids shared across the datasets: one id per distinct atom / bond text embedding
    _, atom_ids = torch.unique(torch.cat([d.x for d in sets.values()]), dim=0, return_inverse=True)
    _, bond_ids = torch.unique(torch.cat([d.edge_attr for d in sets.values()]), dim=0, return_inverse=True)

    def graphs(ds, atoms, bonds):
        owner = torch.repeat_interleave(torch.arange(len(ds.ptr) - 1), ds.ptr.diff()).tolist()
        out = [nx.Graph() for _ in range(len(ds.ptr) - 1)]
        for n, g in enumerate(owner):
            out[g].add_node(n, a=atoms[n])
        for (u, v), b in zip(ds.edge_index.t().tolist(), bonds):
            out[owner[u]].add_edge(u, v, b=b)
        return out

    found, a0, b0 = {}, 0, 0
    for name, ds in sets.items():
        n, e = ds.x.shape[0], ds.edge_index.shape[1]
        found[name] = graphs(ds, atom_ids[a0:a0 + n].tolist(), bond_ids[b0:b0 + e].tolist())
        a0, b0 = a0 + n, b0 + e

    def key(g):  # a cheap invariant; equal keys are then checked for isomorphism
        return (g.number_of_edges(), tuple(sorted(d["a"] for _, d in g.nodes(data=True))))

    def clashes(candidates, held_out=("mutag",)):
        index = {}
        for g in (g for name in held_out for g in found[name]):
            index.setdefault(key(g), []).append(g)
        return sum(any(nx.is_isomorphic(g, m, node_match=lambda p, q: p["a"] == q["a"],
                                        edge_match=lambda p, q: p["b"] == q["b"]) for m in index.get(key(g), []))
                   for g in candidates)

    assert clashes(found["solubility"]) == 0 and clashes(found["nci"], ("mutag", "solubility")) == 0
    # the check can fail: MUTAG's own first graphs, relabelled, are found
    relabelled = [nx.relabel_nodes(g, {n: -n - 1 for n in g}) for g in found["mutag"][:5]]
    assert clashes(relabelled) == 5
