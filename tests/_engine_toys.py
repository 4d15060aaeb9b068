"""Tiny models, datasets and recipes shared by the engine tests and the torchrun script."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from domainfm.engine import Recipe


def make_dataset(n=256, d=8, k=3, seed=0, dtype=torch.float32):
    """A linearly separable k-class problem; ``seed`` draws the inputs, the labelling rule is fixed."""
    w = torch.randn(d, k, generator=torch.Generator().manual_seed(1234), dtype=dtype)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    y = (x @ w).argmax(-1)
    return TensorDataset(x, y)


class TinyNet(nn.Module):
    def __init__(self, d=8, hidden=32, k=3, dropout=0.1):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(dropout))])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, k)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ClassifyRecipe(Recipe):
    def __init__(self, model, train, val=None):
        self.model, self.train_dataset, self.val_dataset = model, train, val

    def step(self, model, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        x, y = batch
        return {"scores": model(x).float(), "target": y}

    def metrics(self, outputs):
        pred = outputs["scores"].argmax(-1)
        return {"accuracy": float((pred == outputs["target"]).float().mean()),
                "loss": float(F.cross_entropy(outputs["scores"], outputs["target"]))}
