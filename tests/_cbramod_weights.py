"""A random CBraMod in the official layout for the fidelity tests (shared by tests/models)."""
from __future__ import annotations

import torch

from domainfm.models.cbramod.reference import RefCBraMod


def random_official_cbramod(n_layers: int = 12, ffn: int = 800, seed: int = 0) -> RefCBraMod:
    """The official restatement with random weights: norms and biases perturbed too (not their
    1/0 inits), and a non-zero mask encoding, so that no parameter's effect can hide."""
    torch.manual_seed(seed)
    ref = RefCBraMod(n_layers, ffn)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
        ref.patch_embedding.mask_encoding.copy_(torch.randn(200) * 0.5)
    return ref
