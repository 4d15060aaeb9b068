"""GIT: a graph foundation model over task-trees.

Wang et al., "Towards Graph Foundation Models: Learning Generalities Across Graphs via
Task-Trees", ICML 2025 (https://arxiv.org/abs/2412.16441; official code
https://github.com/Zehong-Wang/GIT).

The encoder is a stack of GraphSAGE-style layers (or GAT with 4 heads), each followed by ReLU,
BatchNorm and dropout. A task is embedded at the root of its task-tree and mapped by
``pooling_lin``::

    node  v      : pooling_lin(z[v])
    edge  (u, v) : pooling_lin((z[u] + z[v]) / 2)
    graph g      : pooling_lin(mean_{v in g} z[v])
    virtual root : pooling_lin(mean over the root's children)      (pretraining form)

Parameter names follow the official checkpoints (``layers.{i}.lin_l``, ``layers.{i}.lin_r``,
``norms.{i}``, ``pooling_lin``), so :func:`~domainfm.models.git.convert.convert_official_state_dict`
only strips wrappers and drops the unused extra norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv, MessagePassing
from torch_geometric.utils import scatter

__all__ = ["SAGELayer", "GIT", "TASKS"]

TASKS = ("node", "edge", "graph")


class SAGELayer(MessagePassing):
    r"""GraphSAGE layer with mean aggregation, as in GIT's encoder.

    .. math::
        \mathbf{x}'_i = W_l \cdot \operatorname{mean}_{j \in \mathcal{N}(i)} m_{j \to i} + b_l + W_r \mathbf{x}_i,
        \qquad m_{j \to i} = \mathbf{x}_j \text{ or } \operatorname{ReLU}(\mathbf{x}_j + \mathbf{e}_{ji})

    (the second form when edge features are given). A node without in-neighbours aggregates 0.

    Args:
        in_channels: width of the input node features (and of edge features, when used).
        out_channels: width of the output.

    Shapes:
        ``x``: (N, in_channels); ``edge_index``: (2, E) source -> target; ``edge_attr``:
        (E, in_channels) or ``None``; output: (N, out_channels).
    """

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(aggr="mean")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.lin_l = nn.Linear(in_channels, out_channels, bias=True)
        self.lin_r = nn.Linear(in_channels, out_channels, bias=False)

    def forward(self, x: Tensor | tuple[Tensor, Tensor], edge_index: Tensor, edge_attr: Tensor | None = None) -> Tensor:
        """``x`` may be a pair ``(x_source, x_target)`` (bipartite: targets are the first rows)."""
        x_src, x_dst = x if isinstance(x, tuple) else (x, x)
        if edge_attr is not None and edge_attr.shape[-1] != x_src.shape[-1]:
            raise ValueError(f"SAGELayer: edge_attr has {edge_attr.shape[-1]} features but node inputs have "
                             f"{x_src.shape[-1]}; GIT adds edge features to neighbour features, so the widths must match")
        out = self.propagate(edge_index, x=(x_src, x_dst), edge_attr=edge_attr, size=(x_src.shape[0], x_dst.shape[0]))
        return self.lin_l(out) + self.lin_r(x_dst)

    def message(self, x_j: Tensor, edge_attr: Tensor | None = None) -> Tensor:
        return x_j if edge_attr is None else F.relu(x_j + edge_attr)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr=mean"


class GIT(nn.Module):
    """GIT encoder, task pooling and an optional classifier head.

    Args:
        in_channels: node feature width (text-embedding width; 768 in the paper).
        hidden_channels: width of every layer and of ``pooling_lin`` (768 in the paper).
        num_layers: message-passing layers (2).
        backbone: ``"sage"`` (default) or ``"gat"`` (PyG ``GATConv``, 4 heads of width
            ``hidden_channels // 4``, concatenated).
        norm: ``"batch"`` (BatchNorm after each layer's ReLU) or ``"none"``.
        dropout: after each layer (0.15).
        n_outputs: classes of the ``head`` (a Linear on the task embedding); 0 makes the head an
            identity, so :meth:`forward` returns task embeddings.
        heads: attention heads of the GAT backbone.

    Shapes:
        ``forward_features(x, edge_index, edge_attr)``: x (N, in_channels) -> (N, hidden_channels).
        ``task_embedding(z, task, index)``: index (B,) node ids, (2, B) pairs or (N,) graph
        assignment -> (B, hidden_channels). ``forward(...)``: -> (B, n_outputs).
    """

    def __init__(self, in_channels: int = 768, hidden_channels: int = 768, num_layers: int = 2, *,
                 backbone: str = "sage", norm: str = "batch", dropout: float = 0.15, n_outputs: int = 0,
                 heads: int = 4):
        super().__init__()
        if backbone not in ("sage", "gat"):
            raise ValueError(f"backbone={backbone!r}: expected 'sage' or 'gat'")
        if norm not in ("batch", "none"):
            raise ValueError(f"norm={norm!r}: expected 'batch' or 'none'")
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: need at least one layer")
        if backbone == "gat" and hidden_channels % heads:
            raise ValueError(f"backbone='gat': hidden_channels={hidden_channels} must be divisible by heads={heads}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout}: expected a value in [0, 1)")
        self.in_channels, self.hidden_channels, self.num_layers = in_channels, hidden_channels, num_layers
        self.backbone, self.norm, self.n_outputs = backbone, norm, n_outputs
        dims = [in_channels] + [hidden_channels] * num_layers
        self.layers = nn.ModuleList(
            SAGELayer(a, b) if backbone == "sage" else GATConv(a, b // heads, heads=heads)
            for a, b in zip(dims[:-1], dims[1:])
        )
        self.norms = nn.ModuleList(nn.BatchNorm1d(hidden_channels) if norm == "batch" else nn.Identity()
                                   for _ in range(num_layers))
        self.dropout = nn.Dropout(dropout)
        self.pooling_lin = nn.Linear(hidden_channels, hidden_channels)
        self.num_features = hidden_channels
        self.head: nn.Module = nn.Identity()
        self.reset_classifier(n_outputs)

    # -- surface --------------------------------------------------------------

    def reset_classifier(self, n_outputs: int) -> None:
        self.n_outputs = n_outputs
        self.head = nn.Linear(self.hidden_channels, n_outputs) if n_outputs > 0 else nn.Identity()
        if isinstance(getattr(self, "domainfm_kwargs", None), dict):
            # keep the record used by save_pretrained in step with the new head
            self.domainfm_kwargs = {**self.domainfm_kwargs, "n_outputs": n_outputs}

    def forward_features(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor | None = None, *,
                         depth: Tensor | None = None, keep_depth: int = 0) -> Tensor:
        """Node embeddings (N, hidden_channels) after the message-passing layers.

        With ``depth`` (non-decreasing (N,) node depths of a task-tree batch) only the nodes whose
        output can still reach depth ``keep_depth`` are computed: layer ``l`` of ``L`` runs on the
        nodes of depth ``<= keep_depth + L - l`` (PyG's "trim to layer"). The rows returned are
        then exact for depth ``<= keep_depth`` (the task roots' inputs) and zero below; in eval
        mode those rows equal the untrimmed computation, in training mode BatchNorm statistics
        are taken over the computed nodes only.
        """
        if x.ndim != 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"GIT expects node features (N, {self.in_channels}), got {tuple(x.shape)}")
        if edge_index.ndim != 2 or edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= x.shape[0]):
            raise ValueError(f"edge_index holds node ids outside [0, {x.shape[0]})")
        if edge_attr is not None and self.backbone == "gat":
            raise ValueError("backbone='gat' does not use edge features (as the official GIT); pass edge_attr=None")
        if depth is not None:
            return self._trimmed(x, edge_index, edge_attr, depth, keep_depth)
        z = x
        for layer, norm in zip(self.layers, self.norms):
            z = layer(z, edge_index, edge_attr) if edge_attr is not None else layer(z, edge_index)
            z = norm(F.relu(z))
            z = self.dropout(z)
        return z

    def _trimmed(self, x, edge_index, edge_attr, depth, keep_depth):
        if depth.numel() > 1 and bool((depth[1:] < depth[:-1]).any()):
            raise ValueError("depth must be non-decreasing (nodes ordered level by level, as build_task_trees makes them)")
        z = x
        L = len(self.layers)
        for i, (layer, norm) in enumerate(zip(self.layers, self.norms)):
            n_out = int(torch.searchsorted(depth, torch.tensor(keep_depth + L - i - 1, device=depth.device), right=True))
            mask = edge_index[1] < n_out
            e = edge_index[:, mask]
            a = edge_attr[mask] if edge_attr is not None else None
            pair = (z, z[:n_out])
            if isinstance(layer, SAGELayer):
                z = layer(pair, e, a)
            else:
                z = layer(pair, e, size=(z.shape[0], n_out))
            z = self.dropout(norm(F.relu(z)))
        if z.shape[0] < x.shape[0]:
            z = torch.cat([z, z.new_zeros(x.shape[0] - z.shape[0], z.shape[1])])
        return z

    def task_embedding(self, z: Tensor, task: str, index: Tensor | None = None) -> Tensor:
        """Root embeddings after ``pooling_lin`` for ``task`` = ``"node"`` (index: (B,) node ids;
        ``None``: every node), ``"edge"`` ((2, B) node pairs) or ``"graph"`` ((N,) graph id of
        every node, mean-pooled; ``None``: one graph)."""
        # gathers use index_select, not z[index]: on CPU the backward of advanced indexing adds
        # the gradients of repeated indices in a thread-dependent order, so runs would drift apart
        if task == "node":
            h = z if index is None else z.index_select(0, index)
        elif task == "edge":
            if index is None or index.ndim != 2 or index.shape[0] != 2:
                raise ValueError("task='edge' needs index of shape (2, B): the node pairs")
            h = (z.index_select(0, index[0]) + z.index_select(0, index[1])) / 2
        elif task == "graph":
            if index is None:
                h = z.mean(0, keepdim=True)
            else:
                if index.shape[0] != z.shape[0]:
                    raise ValueError(f"task='graph': index must give the graph of each of the {z.shape[0]} nodes")
                h = scatter(z, index, dim=0, reduce="mean")
        else:
            raise ValueError(f"task={task!r}: expected one of {TASKS}")
        return self.pooling_lin(h)

    def virtual_root_embedding(self, z: Tensor, edge_index: Tensor, roots: Tensor) -> Tensor:
        """Pretraining form: ``pooling_lin`` of the mean of each root's in-neighbours (children).
        A root without children gets ``pooling_lin(0)``."""
        is_root = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)
        is_root[roots] = True
        slot = torch.full((z.shape[0],), -1, dtype=torch.long, device=z.device)
        slot[roots] = torch.arange(roots.numel(), device=z.device)
        into_root = is_root[edge_index[1]]
        h = scatter(z.index_select(0, edge_index[0, into_root]), slot[edge_index[1, into_root]], dim=0,
                    dim_size=roots.numel(), reduce="mean")
        return self.pooling_lin(h)

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        return features if pre_logits else self.head(features)

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor | None = None, task: str = "node",
                index: Tensor | None = None) -> Tensor:
        """Logits (or task embeddings when ``n_outputs=0``) of the tasks ``index``."""
        z = self.forward_features(x, edge_index, edge_attr)
        return self.forward_head(self.task_embedding(z, task, index))
