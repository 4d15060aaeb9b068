"""Official GIT checkpoints -> our keys.

The official encoder (``model/encoder.py`` of Zehong-Wang/GIT) saves
``layers.{i}.lin_l.{weight,bias}``, ``layers.{i}.lin_r.weight``, ``norms.{i}.*`` for
``i < num_layers`` plus one extra ``norms.{num_layers}.*`` (created for ``pooling`` but never
used: its call is commented out), and ``pooling_lin.{weight,bias}``. A fine-tuned ``TaskModel``
nests these under ``encoder.`` and adds the classifier ``decoder.{weight,bias}``. GAT layers from
PyG < 2.5 store ``lin_src``/``lin_dst`` (one shared matrix), newer PyG ``lin``.

The converter is idempotent (our own keys pass through unchanged), so the hub may apply it to
any upstream file, whatever share of its keys already matches.
"""
from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["convert_official_state_dict"]


def convert_official_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Map an official GIT encoder / TaskModel state_dict onto :class:`~domainfm.models.git.GIT`."""
    num_layers = getattr(model, "num_layers", None)
    uses_norm = getattr(model, "norm", "batch") == "batch"
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "encoder."):
            if key.startswith(prefix):
                key = key[len(prefix):]
        if key.startswith("decoder."):
            key = "head." + key[len("decoder."):]
        if key.startswith(("sem_encoder.", "sem_decoder.", "feat_decoder.", "topo_decoder.")):
            continue  # pretraining-only modules of PretrainModel
        match = re.match(r"norms\.(\d+)\.", key)
        if match and (not uses_norm or (num_layers is not None and int(match.group(1)) >= num_layers)):
            continue  # the unused pooling norm, or norms of a checkpoint run with normalize='none'
        key = key.replace(".lin_src.", ".lin.")
        if ".lin_dst." in key:
            continue  # the same matrix as lin_src for a GATConv on one node type
        out[key] = value
    return out
