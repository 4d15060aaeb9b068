"""GIT benchmark: task-tree construction speed and pretraining step throughput / peak memory.

    python benchmarks/git.py [--device cpu|cuda] [--nodes 10000] [--edges 50000] [--batch 4096]

Prints
1. task-trees built per second for node, edge and graph tasks on a random graph with ``--nodes``
   nodes and ``--edges`` undirected edges (graph tasks: the graph cut into 100 equal graphs), fan-out
   10, 2 levels, virtual roots, nodes shared within a batch (as PyG's NeighborLoader) or unrolled;
   on the default path (numba kernels when importable) and, for edges, on the vectorised torch path
   (``DOMAINFM_GRAPH_BACKEND=torch``), which builds the same trees;
2. next to it, the official code's per-edge Python loop that adds one virtual node per edge
   (``VirtualNodeAugmentor.add_virtual_nodes_edge_classification``, re-implemented here with the
   same loop body and ``to_undirected``) -- counted in edges per second, *without* the neighbour
   sampling that the official code still has to do afterwards, so the ratio is a lower bound;
3. pretraining throughput (roots/s) and peak memory at ``--batch`` roots, 128-d input, hidden 768,
   2 layers, fan-out 10: our step, and an "official-style" step emulated on the same sampled
   subgraph (the official model pools, predicts and regularises *every* node of the subgraph and
   keeps the virtual roots' edges in the corruption);
4. a FLOP-matched pretraining step: FLOPs per step counted with ``torch.utils.flop_counter``
   (``benchmarks/_peak.count_flops``) for ours at ``--batch`` roots and for the official side, whose
   batch is then scaled until its FLOPs per step equal ours (within 2%); per side FLOPs per root,
   ms per step, roots/s, GFLOP/s and share of the fp32 matmul peak, interleaved, wall clock. The
   official side is the official code with ``--official PATH`` (a checkout of
   github.com/Zehong-Wang/GIT, fetched for the measurement, never committed: its ``Encoder`` and
   ``PretrainModel`` and the loop body of ``pretrain.py`` on PyG's ``NeighborLoader``; where PyG's
   sampler backend (pyg-lib / torch-sparse) is missing, on our NeighborLoader-style subgraphs, which
   is the same model work), else the in-package official-style restatement of item 3.

    python benchmarks/git.py --official /tmp/GIT [--skip-trees]
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch


def _random_graph(n: int, e: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    from torch_geometric.utils import to_undirected

    edge_index = to_undirected(torch.stack([src, dst]), num_nodes=n)
    return torch.randn(n, dim, generator=g), edge_index


def _rate(fn, items: int, repeat: int = 7, inner: int = 10) -> float:
    """Items per second of the best of ``repeat`` runs of ``inner`` calls. On CPU the clock is the
    process CPU time (``--clock cpu``, default): on a shared machine wall time mostly measures the
    neighbours."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = CLOCK()
        for _ in range(inner):
            fn()
        best = min(best, (CLOCK() - start) / inner)
    return items / best


CLOCK = time.perf_counter


def official_edge_loop(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """The official per-edge loop (data/pretrain_data.py), kept as written there."""
    from torch_geometric.utils import to_undirected

    new_edge = []
    for i in range(edge_index.size(1)):
        src, dst = edge_index[:, i]
        new_edge.append([src, num_nodes + i])
        new_edge.append([num_nodes + i, dst])
    new_edge = torch.tensor(new_edge, dtype=torch.long).t()
    return to_undirected(new_edge)


def bench_trees(args) -> None:
    from domainfm.data_loaders import graph as G
    from domainfm.models.git import task_trees

    x, ei = _random_graph(args.nodes, args.edges, 16)
    csr = G.build_csr(ei, args.nodes)
    gen = torch.Generator().manual_seed(0)
    fan = [10, 10]
    B = args.batch
    node_idx = torch.randint(0, args.nodes, (B,), generator=gen)
    edge_idx = ei[:, torch.randint(0, ei.shape[1], (B,), generator=gen)]
    n_graphs = 100
    ptr = torch.linspace(0, args.nodes, n_graphs + 1).long()
    graph_idx = torch.randint(0, n_graphs, (B,), generator=gen)
    backend = "numba" if task_trees._numba_kernels() is not None else "torch"
    print(f"task-trees on a random graph: {args.nodes} nodes, {ei.shape[1]} directed edges; batch {B}, fan-out {fan}; "
          f"default path: {backend}")
    rates = {}
    for task, index in (("node", node_idx), ("edge", edge_idx), ("graph", graph_idx)):
        for shared in (True, False):
            rates[task, shared] = _rate(lambda: G.build_task_trees(x, None, task, index, fan, csr=csr, ptr=ptr,
                                                                   shared=shared, generator=gen), B)
            print(f"  {task:5s} trees/s ({'shared nodes' if shared else 'unrolled    '}): {rates[task, shared]:12,.0f}")
    previous = os.environ.get("DOMAINFM_GRAPH_BACKEND")
    os.environ["DOMAINFM_GRAPH_BACKEND"] = "torch"
    try:
        torch_rate = _rate(lambda: G.build_task_trees(x, None, "edge", edge_idx, fan, csr=csr, shared=True,
                                                      generator=gen), B)
    finally:
        if previous is None:
            del os.environ["DOMAINFM_GRAPH_BACKEND"]
        else:
            os.environ["DOMAINFM_GRAPH_BACKEND"] = previous
    print(f"  edge  trees/s (shared nodes, torch path): {torch_rate:12,.0f}")
    # the ratio: the official loop and our edge trees measured in alternation, best of each, so
    # that a change in machine speed during the run moves both
    sub = ei  # every directed edge, as the official augmentation does
    loop_rate, edge_rate = 0.0, rates["edge", True]
    for _ in range(5):
        loop_rate = max(loop_rate, _rate(lambda: official_edge_loop(sub, args.nodes), sub.shape[1], repeat=1, inner=1))
        edge_rate = max(edge_rate, _rate(lambda: G.build_task_trees(x, None, "edge", edge_idx, fan, csr=csr, shared=True,
                                                                    generator=gen), B))
    print(f"  official per-edge loop (virtual nodes only, no sampling): {loop_rate:12,.0f} edges/s")
    print(f"  edge task-trees (shared nodes, sampled): {edge_rate:12,.0f}/s = {edge_rate / loop_rate:.1f}x the official loop")


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_pretrain(args) -> None:
    device = torch.device(args.device)
    x, ei = _random_graph(args.nodes, args.edges, 128)
    steps = _pretrain_steps(args, device, x, ei, args.batch)
    ours, official_style, batch = steps["ours"], steps["official-style"], steps["batch"]
    sample = batch()
    print(f"pretraining: batch {args.batch} roots -> {sample.x.shape[0]} subgraph nodes, {sample.edge_index.shape[1]} "
          f"edges; 128-d input, hidden 768, 2 layers, fan-out 10, device {device}")
    for name, fn in (("ours", ours), ("official-style (emulated)", official_style)):
        _reset_peak(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fn()  # warm-up
        start = CLOCK()
        for _ in range(args.steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = CLOCK() - start
        print(f"  {name:26s}: {args.steps * args.batch / seconds:10,.0f} roots/s, peak memory {_peak_mb(device):,.0f} MiB"
              + (" (process peak RSS)" if device.type != "cuda" else ""))


def _pretrain_steps(args, device, x, ei, batch_size: int) -> dict:
    """Our pretraining step and the emulated official-style step at ``batch_size`` roots."""
    import torch.nn.functional as F

    from domainfm.data_loaders import graph as G
    from domainfm.models.git import GIT
    from domainfm.pretrain import git as P

    table = G.PretrainTaskTable([G.GraphDataset(
        name="random", task="node", x=x, edge_index=ei, task_index=torch.arange(args.nodes),
        y=torch.zeros(args.nodes, dtype=torch.long), splits={}, class_texts=["c"], class_emb=torch.zeros(1, 128),
        labels="none", encoder="random")], ["node", "edge"], [10, 10])
    encoder = GIT(128, 768, 2, dropout=0.15).to(device)
    module = P.GITPretrainer(encoder, P.ObjectiveSection()).to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=1e-8)
    gen = torch.Generator().manual_seed(0)

    def batch():
        return table.collate(torch.randint(0, len(table), (batch_size,), generator=gen).tolist()).to(device)

    def ours():
        trees = batch()
        loss, _ = module(trees)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()

    def official_style():
        # same subgraph, but pooling/predictor/KL over every node and corruption over every edge
        trees = batch()
        views = []
        for _ in range(2):
            keep_cols = (torch.rand(trees.x.shape[1], device=device) >= 0.2).to(trees.x.dtype)
            keep = torch.rand(trees.edge_index.shape[1], device=device) >= 0.2
            e = trees.edge_index[:, keep]
            z = encoder.forward_features(trees.x * keep_cols, e)
            from torch_geometric.utils import scatter

            pooled = encoder.pooling_lin(scatter(z[e[0]], e[1], dim=0, dim_size=z.shape[0], reduce="mean"))
            views.append(pooled)
        z1, z2 = views
        h1, h2 = module.predictor(z1), module.predictor(z2)
        n = trees.num_trees
        sem = ((1 - (F.normalize(z1[:n].detach(), dim=-1) * F.normalize(h2[:n], dim=-1)).sum(-1)) +
               (1 - (F.normalize(z2[:n].detach(), dim=-1) * F.normalize(h1[:n], dim=-1)).sum(-1))).mean() / 2
        align = F.kl_div(z1.log_softmax(-1), z1.mean(0).softmax(-1), reduction="batchmean") * 10
        loss = sem + align
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()

    return {"ours": ours, "official-style": official_style, "batch": batch}


def _official_step(path: str, x: torch.Tensor, ei: torch.Tensor, batch: int, device, gen, sampler):
    """One pretraining step of the official code at ``path`` (a checkout of Zehong-Wang/GIT, fetched
    for the measurement, never committed): PyG ``NeighborLoader`` (fan-out 10 x 2 layers, as
    ``utils/loader.py``), ``mask_feature`` / ``dropout_adj`` views (p 0.2, ``pretrain.py``) and the
    official ``Encoder`` / ``PretrainModel`` (SAGE, hidden 768, 2 layers, batch norm, dropout 0.15,
    align_reg_lambda 10, sem_lambda 1, no multitask; the defaults of ``utils/args.py`` and
    ``config/base.yaml``); the loop body of ``pretrain.pretrain`` without wandb. ``sampler()``: our
    NeighborLoader-style batch, used when PyG's sampler backend is missing."""
    import sys

    from torch import nn
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.utils import dropout_adj, mask_feature

    sys.path.insert(0, path)
    from model.encoder import Encoder, InnerProductDecoder  # the official modules
    from model.pretrain_model import PretrainModel

    encoder = Encoder(input_dim=x.shape[1], hidden_dim=768, activation=nn.ReLU, num_layers=2, backbone="sage",
                      normalize="batch", dropout=0.15)
    # the official convs declare "# propagate_type: (x: OptPairTensor)" yet pass edge_attr=None, which the
    # propagate PyG >= 2.5 generates from that comment rejects; the generic propagate takes it
    import types

    from torch_geometric.nn import MessagePassing

    for conv in [*encoder.layers, encoder.mean_aggr]:
        conv.propagate = types.MethodType(MessagePassing.propagate, conv)
    model = PretrainModel(encoder=encoder, feat_decoder=nn.Linear(768, x.shape[1]),
                          topo_decoder=InnerProductDecoder(hidden_dim=768, output_dim=768)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-8)
    params = dict(feat_p=0.2, edge_p=0.2, multitask=False, align_reg_lambda=10.0, sem_lambda=1.0)
    loader = NeighborLoader(Data(x=x, edge_index=ei), num_neighbors=[10, 10], batch_size=batch, shuffle=True,
                            generator=gen)
    state = {"it": iter(loader), "fallback": None}
    try:
        next(iter(loader))
    except ImportError as exc:  # PyG's sampler needs pyg-lib or torch-sparse (not on PyPI for this torch)
        if not _NOTED:
            _NOTED.append(True)
            print(f"    NeighborLoader unavailable ({exc}); the official model step runs on the subgraphs of our "
                  "NeighborLoader-style sampler (shared nodes, fan-out 10 x 2, roots first), i.e. the same model work")
        state["fallback"] = sampler

    def next_batch():
        if state["fallback"] is not None:
            trees = state["fallback"]()
            return trees.num_trees, trees.x, trees.edge_index
        try:
            data = next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            data = next(state["it"])
        return data.batch_size, data.x, data.edge_index

    def step():
        model.train()
        bs, xb, edge_index = next_batch()
        xb, edge_index = xb.to(device), edge_index.to(device)
        x1, _ = mask_feature(xb, p=params["feat_p"])
        e1, _ = dropout_adj(edge_index, p=params["edge_p"], force_undirected=True, num_nodes=xb.size(0))
        x2, _ = mask_feature(xb, p=params["feat_p"])
        e2, _ = dropout_adj(edge_index, p=params["edge_p"], force_undirected=True, num_nodes=xb.size(0))
        loss = model([xb, edge_index], [x1, e1], [x2, e2], bs=bs, params=params)["loss"]
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step.fallback = state["fallback"] is not None
    return step


_NOTED: list = []


def bench_flop_matched(args) -> None:
    """Pretraining steps with the same FLOPs per step on both sides: FLOPs per root counted with
    ``torch.utils.flop_counter`` (``benchmarks/_peak.count_flops``) at ``--batch`` roots, then the
    official side's batch scaled so that its FLOPs per step equal ours; times interleaved (median
    of wall-clock steps, the same clock for both), FLOPs per root, GFLOP/s and share of the matmul peak."""
    import statistics
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _peak import count_flops, matmul_peak, share_of_peak

    device = torch.device(args.device)
    x, ei = _random_graph(args.nodes, args.edges, 128)
    gen = torch.Generator().manual_seed(0)
    steps = _pretrain_steps(args, device, x, ei, args.batch)
    ours = steps["ours"]
    if args.official:
        official_name = "official code (PyG NeighborLoader)"
        make_official = lambda b: _official_step(args.official, x, ei, b, device, gen,  # noqa: E731
                                                 _pretrain_steps(args, device, x, ei, b)["batch"])
    else:
        official_name = "official-style (in-package restatement)"
        make_official = lambda b: _pretrain_steps(args, device, x, ei, b)["official-style"]  # noqa: E731
    official = make_official(args.batch)
    if getattr(official, "fallback", False):
        official_name = "official model code (our sampler)"
    ours()
    official()  # warm-up (first NeighborLoader batch, allocator)
    f_ours, f_off = count_flops(ours), count_flops(official)
    # FLOPs per root fall as the batch grows (roots share neighbours): a few proportional steps
    # towards the batch whose FLOPs per step equal ours, keeping the closest
    matched, best = args.batch, (abs(f_off - f_ours), args.batch, official, f_off)
    for _ in range(4):
        flops_now = best[3]
        matched = max(1, round(best[1] * f_ours / flops_now))
        if matched == best[1]:
            break
        candidate = make_official(matched)
        candidate()
        f_candidate = count_flops(candidate)
        if abs(f_candidate - f_ours) < best[0]:
            best = (abs(f_candidate - f_ours), matched, candidate, f_candidate)
        if best[0] < 0.02 * f_ours:
            break
    _, matched, official_matched, f_matched = best
    fns = {"ours": (ours, args.batch, f_ours), official_name: (official_matched, matched, f_matched)}
    times = {name: [] for name in fns}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for r in range(args.steps * 2 + 1):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            sync()
            start = time.perf_counter()
            fns[name][0]()
            sync()
            times[name].append(time.perf_counter() - start)
    peak = matmul_peak(torch.float32, str(device), torch.get_num_threads())
    print(f"FLOP-matched pretraining step (fp32, {torch.get_num_threads()} thread(s), wall clock, median of "
          f"{args.steps * 2 + 1}): at {args.batch} roots ours {f_ours / args.batch / 1e6:.2f} MFLOP/root, "
          f"{official_name} {f_off / args.batch / 1e6:.2f} MFLOP/root -> official batch {matched} for equal FLOPs/step")
    seconds = {name: statistics.median(t) for name, t in times.items()}
    for name, (_, b, flops) in fns.items():
        sec = seconds[name]
        print(f"  {name:44s}: {b:6d} roots, {flops / 1e9:8.2f} GFLOP/step ({flops / b / 1e6:.2f} MFLOP/root), "
              f"{sec * 1e3:9.1f} ms/step, {b / sec:10,.0f} roots/s, {flops / sec / 1e9:6.1f} GFLOP/s = "
              f"{100 * share_of_peak(flops, sec, peak):.1f}% of the fp32 matmul peak ({peak:.0f} GFLOP/s)")
    off = list(fns)[1]
    print(f"  at equal FLOPs per step: official time / ours {seconds[off] / seconds['ours']:.2f}x; "
          f"roots/s ours / official {(args.batch / seconds['ours']) / (matched / seconds[off]):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--edges", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-pretrain", action="store_true")
    parser.add_argument("--skip-trees", action="store_true")
    parser.add_argument("--official", default=None, metavar="PATH",
                        help="checkout of github.com/Zehong-Wang/GIT for the FLOP-matched step (else the in-package restatement)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None,
                        help="cpu: process CPU time (default on CPU, one thread); wall: elapsed time (default on GPU)")
    args = parser.parse_args()
    global CLOCK
    clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    if clock == "cpu":
        torch.set_num_threads(1)  # CPU time of one thread == the time it would take on a quiet core
        CLOCK = time.process_time
    print(f"clock: {clock} time" + (" (one thread)" if clock == "cpu" else ""))
    torch.manual_seed(0)
    if not args.skip_trees:
        bench_trees(args)
    if not args.skip_pretrain:
        bench_pretrain(args)
        bench_flop_matched(args)


if __name__ == "__main__":
    main()
