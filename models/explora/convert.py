"""Official ExPLoRA checkpoints -> our keys (timm's ViT / :class:`GroupChannelViT`).

Two file kinds are released (LoRA already merged into the weights):

* **encoder-only** (``*_encoder_only.pth``): ``{"model": state_dict}`` in DINOv2's key names
  (``cls_token``, ``pos_embed``, ``mask_token``, ``patch_embed.proj.*``,
  ``blocks.{i}.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}.*``,
  ``norm.*``). timm's DINOv2 ViT uses the same names; only ``mask_token`` has no place in it (it
  is used by iBOT masking during pretraining) and is dropped.
* **full** (``explora_dinov2_vit_*_fmow_rgb.pth``): the EMA teacher under ``teacher``, keys
  prefixed ``backbone.`` (plus ``dino_head.*`` / ``ibot_head.*``, dropped), with merged
  ``attn.q_proj / k_proj / v_proj`` copies beside the fused ``attn.qkv``. When both exist they
  must agree (checked); when only the separate projections exist they are fused.

Also handled: DINOv2's chunked block layout (``blocks.{chunk}.{i}.``), a position table of another
grid size (resampled with timm's bicubic interpolation, as timm does for DINOv2 weights), and,
for a model built with ``global_pool="avg"``, the final ``norm.*`` moved to ``fc_norm.*``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["convert_official", "load_official", "DROPPED_KEYS", "unwrap_official"]

#: keys of the official files with no counterpart in the encoder (documented, never silent)
DROPPED_KEYS = ("mask_token",)
_CHUNKED = re.compile(r"^blocks\.(\d+)\.(\d+)\.(.*)$")
_PROJ = re.compile(r"^(blocks\.\d+\.attn)\.([qkv])_proj\.(weight|bias)$")


def unwrap_official(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The encoder state_dict inside an official file: ``teacher`` (full files, preferred: it
    is the model DINOv2 evaluates), else ``model``, else the mapping itself if flat."""
    for key in ("teacher", "model", "state_dict"):
        if key in checkpoint and isinstance(checkpoint[key], Mapping):
            return dict(checkpoint[key])
    if all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return dict(checkpoint)
    raise ValueError(
        f"not an ExPLoRA checkpoint: no 'teacher' or 'model' state_dict among its keys {sorted(checkpoint)[:10]}"
    )


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in ("module.", "backbone."):
        if any(k.startswith(prefix) for k in sd):
            # full files: keep only the backbone (heads live under dino_head./ibot_head.)
            sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def _unchunk(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # DINOv2 with block_chunks>0 names block i "blocks.<chunk>.<i>." (i is global)
    if not any(_CHUNKED.match(k) for k in sd):
        return sd
    out = {}
    for k, v in sd.items():
        m = _CHUNKED.match(k)
        out[f"blocks.{m.group(2)}.{m.group(3)}" if m else k] = v
    return out


def _fuse_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    proj: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    out = {}
    for k, v in sd.items():
        m = _PROJ.match(k)
        if m:
            proj.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = v
        else:
            out[k] = v
    for (attn, kind), parts in proj.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"{attn}: found {sorted(parts)}_proj.{kind} but need q, k and v")
        fused = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
        key = f"{attn}.qkv.{kind}"
        if key in out:
            if out[key].shape != fused.shape or not torch.allclose(out[key].float(), fused.float(), atol=1e-5, rtol=1e-4):
                raise ValueError(f"{key} disagrees with the separate {attn}.q/k/v_proj.{kind} in the same file")
        else:
            out[key] = fused
    return out


def _resize_pos_embed(pos: torch.Tensor, model: nn.Module) -> torch.Tensor:
    own = model.state_dict().get("pos_embed")
    if own is None or own.shape == pos.shape:
        return pos
    from timm.layers import resample_abs_pos_embed

    n_prefix = 0 if getattr(model, "no_embed_class", False) else getattr(model, "num_prefix_tokens", 1)
    grid = model.patch_embed.grid_size
    return resample_abs_pos_embed(pos, new_size=list(grid), num_prefix_tokens=n_prefix)


def convert_official(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``fn(state_dict, model) -> state_dict`` for both official file kinds (see module doc).

    Idempotent: our own keys pass through unchanged (no prefix, chunk or q/k/v split to undo,
    ``norm`` already moved to ``fc_norm``, the position table already at the model's grid)."""
    sd = unwrap_official(state_dict) if not all(isinstance(v, torch.Tensor) for v in state_dict.values()) else dict(state_dict)
    sd = _unchunk(_fuse_qkv(_strip_prefix(sd)))
    own = set(model.state_dict())
    for key in DROPPED_KEYS:
        if key not in own:  # a model that has the key keeps it (idempotent on our own keys)
            sd.pop(key, None)
    if "pos_embed" in sd:
        sd["pos_embed"] = _resize_pos_embed(sd["pos_embed"], model)
    if "fc_norm.weight" in own and "norm.weight" not in own:
        for kind in ("weight", "bias"):
            if f"norm.{kind}" in sd:
                sd[f"fc_norm.{kind}"] = sd.pop(f"norm.{kind}")
    return sd


def load_official(model: nn.Module, path: str | Path, *, strict: bool = True):
    """Load an official ExPLoRA ``.pth`` (either kind) into ``model``; returns the hub's LoadReport.

    Read with ``torch.load(weights_only=True)``; ``argparse.Namespace`` (MAE-style training
    scripts store their ``args`` in the file) is the one extra class allowed, as plain data.
    """
    from domainfm import hub

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ExPLoRA checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        raw = hub.load_checkpoint(path)
    else:
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                raw = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - re-raised with the file named
                raise hub.UnsafeCheckpointError(f"{path}: cannot be read as plain tensors ({exc})") from exc
    sd = convert_official(unwrap_official(raw), model)
    return hub.load_state_dict_into(model, sd, heads=("head",), strict=strict, source=str(path))
