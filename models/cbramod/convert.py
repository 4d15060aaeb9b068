"""Official CBraMod checkpoints -> this implementation's keys.

The official model (github.com/wjq-learning/CBraMod, ``models/cbramod.py``) and ours share every
key but the attention input projection, which ``nn.MultiheadAttention`` stores as a bare
parameter and we keep as an ``nn.Linear`` (so that LoRA can wrap it):

=====================================================  =================================================
official                                               ours
=====================================================  =================================================
``encoder.layers.{i}.self_attn_{s,t}.in_proj_weight``  ``encoder.layers.{i}.self_attn_{s,t}.in_proj.weight``
``encoder.layers.{i}.self_attn_{s,t}.in_proj_bias``    ``encoder.layers.{i}.self_attn_{s,t}.in_proj.bias``
everything else (``patch_embedding.*``, ``out_proj``,  unchanged
``linear1/2``, ``norm1/2``, ``proj_out.0.*``)
=====================================================  =================================================

Fine-tuned official models (``model_for_*.py``) wrap the backbone as ``backbone.*`` beside a
``classifier`` Sequential; their linear layers map onto our ``head`` (``all_patch_reps``:
``classifier.{1,4,7}`` -> ``head.pre_logits.{1,4}``, ``head.fc``; ``avgpooling_patch_reps``:
``classifier.3`` -> ``head.fc``). A ``module.`` prefix (DataParallel) is stripped.

The converter is idempotent (our own keys pass through unchanged), so the hub may apply it to
any upstream file, whatever share of its keys already matches.
"""
from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["convert_official_state_dict", "to_official_state_dict"]

_IN_PROJ = re.compile(r"^(encoder\.layers\.\d+\.self_attn_[st])\.in_proj_(weight|bias)$")
_HEAD_MAPS = {
    "all_patch_reps": {"1": "head.pre_logits.1", "4": "head.pre_logits.4", "7": "head.fc"},
    "avgpooling_patch_reps": {"3": "head.fc"},
}


def convert_official_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename an official (pretrained or fine-tuned) CBraMod state_dict to ``model``'s keys.

    ``proj_out.*`` (the reconstruction head) is dropped when ``model`` was built without it
    (``reconstruction_head=False``, as for fine-tuning); official classifier weights are kept
    only when ``model`` has a head of the same type. Unknown keys are passed through so that the
    loader names them as unexpected.
    """
    own = model.state_dict()
    head_type = getattr(model, "head_type", None)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("module."):
            key = key[len("module."):]
        if key.startswith("backbone."):
            key = key[len("backbone."):]
        elif key.startswith("classifier."):
            index, _, leaf = key[len("classifier."):].partition(".")
            target = _HEAD_MAPS.get(head_type, {}).get(index)
            if target is not None and f"{target}.{leaf}" in own:
                out[f"{target}.{leaf}"] = value
            continue
        match = _IN_PROJ.match(key)
        if match:
            key = f"{match.group(1)}.in_proj.{match.group(2)}"
        if key.startswith("proj_out.") and getattr(model, "proj_out", None) is None:
            continue
        out[key] = value
    return out


def to_official_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our backbone's weights under the official keys (the inverse rename; head excluded)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("head."):
            continue
        key = re.sub(r"\.in_proj\.(weight|bias)$", r".in_proj_\1", key)
        out[key] = value
    return out
