"""GIT graph foundation model (task-trees): architecture, official-checkpoint converter, variants."""
from __future__ import annotations

import torch

from domainfm.zoo import WeightSource, register_model

from .convert import convert_official_state_dict
from .git import GIT, SAGELayer

__all__ = ["GIT", "SAGELayer", "convert_official_state_dict"]

PAPER = "https://arxiv.org/abs/2412.16441"
# The official repository (github.com/Zehong-Wang/GIT) carries no licence for released weights and
# releases none: load such a checkpoint by path with pretrained=PATH. The one registered weight
# source is domainfm's own git-small checkpoint, shipped in the package (see its card).
_COMMON = dict(family="git", paper=PAPER, license="Apache-2.0", head="head",
               converters={"official": convert_official_state_dict})


def _example_input(in_channels: int):
    def make():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(12, in_channels, generator=g)
        src = torch.arange(12)
        edge_index = torch.cat([torch.stack([src, (src + 1) % 12]), torch.stack([(src + 1) % 12, src])], dim=1)
        return x, edge_index

    return make


@register_model(
    "git-base",
    **_COMMON,
    input_spec={"in_channels": 768, "features": "768-d text embeddings of node texts (OFA-style)"},
    defaults={"in_channels": 768, "hidden_channels": 768, "num_layers": 2, "backbone": "sage", "norm": "batch",
              "dropout": 0.15, "n_outputs": 0},
    example_input=_example_input(768),
)
def git_base(**kwargs):
    """GIT encoder as in the paper: SAGE, 768 -> 768, 2 layers, BatchNorm, dropout 0.15."""
    return GIT(**kwargs)


@register_model(
    "git-small",
    **_COMMON,
    input_spec={"in_channels": 384, "features": "384-d all-MiniLM-L6-v2 text embeddings"},
    defaults={"in_channels": 384, "hidden_channels": 384, "num_layers": 2, "backbone": "sage", "norm": "batch",
              "dropout": 0.15, "n_outputs": 0},
    example_input=_example_input(384),
    weights=[WeightSource(
        "package://domainfm.models.git/weights/git-small.graph-mixture.safetensors",
        sha256="8b138e4157a4b4fa2dedbc8956196044f0abb7961e3138e9e22567e71f8dad0a", tag="graph-mixture",
        license="Apache-2.0", card="package://domainfm.models.git/weights/git-small.graph-mixture.md",
        description="trained by domainfm, not the published weights (none are published): GIT's task-tree "
                    "pretraining on the shipped graphs (configs/git/pretrain_graph_mixture.yaml); see the card",
        pretraining_data="the package's shipped graphs, labels unused: Zachary's karate club, the Nations and "
                         "Kinships knowledge graphs, Cuneiform, and 4,556 NCI open-database compounds (RDKit's "
                         "first_5K.smi); node, edge and graph task-trees. Not MUTAG or Solubility, and no NCI "
                         "compound isomorphic to one of their graphs",
        overlaps=())],
)
def git_small(**kwargs):
    """Small GIT for 384-d MiniLM features (the embedded default): SAGE, 384 -> 384, 2 layers."""
    return GIT(**kwargs)


@register_model(
    "git-test",
    **_COMMON,
    input_spec={"in_channels": 16},
    defaults={"in_channels": 16, "hidden_channels": 16, "num_layers": 2, "backbone": "sage", "norm": "batch",
              "dropout": 0.0, "n_outputs": 3},
    tags=("test",),
    example_input=_example_input(16),
)
def git_test(**kwargs):
    """Test-sized GIT (16 -> 16, 2 layers, 3 outputs)."""
    return GIT(**kwargs)
