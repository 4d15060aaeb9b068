"""Reading checkpoint files safely (safetensors, or torch files with weights_only=True) and unwrapping state_dicts."""
from __future__ import annotations

import argparse
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from domainfm.hub.base import HubError, UnsafeCheckpointError

# --------------------------------------------------------------------------- reading checkpoints


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint without executing code: safetensors, or ``torch.load(weights_only=True)``.

    A file that is none of safetensors, a torch zip archive or a pickle is reported as not a
    checkpoint; "would execute code" is said only where the unpickler met a code reference."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    kind = _file_kind(path)
    if kind is None:
        with open(path, "rb") as fh:
            head = fh.read(16)
        raise HubError(f"{path}: not a checkpoint: not a safetensors file, not a torch zip archive, not a pickle "
                       f"(it starts with {head!r})")
    if kind == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise HubError(f"{path}: not a readable safetensors file ({exc})") from exc
    try:
        # argparse.Namespace is the one extra class allowed, as plain data: MAE-style training
        # scripts (MAE, SatMAE, ExPLoRA) store their command-line ``args`` in the checkpoint
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        code = _code_reference(str(exc))
        if code is not None:
            raise UnsafeCheckpointError(
                f"{path}: refused to load. The file contains Python objects that are not plain tensors/containers "
                f"and loading it would execute code ({code}). Convert it to safetensors in a trusted environment."
            ) from exc
        raise HubError(f"{path}: corrupt {_KIND_NAMES[kind]} ({_last_line(exc)})") from exc
    except Exception as exc:  # noqa: BLE001 - the unpickler raises KeyError/IndexError/... on damaged data
        raise HubError(f"{path}: corrupt or truncated {_KIND_NAMES[kind]} ({type(exc).__name__}: {_last_line(exc)})") from exc


_KIND_NAMES = {"zip": "torch zip archive", "pickle": "pickle (legacy torch checkpoint)", "safetensors": "safetensors file"}


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("Check the documentation")]
    return lines[-1] if lines else type(exc).__name__


def _code_reference(message: str) -> str | None:
    """The global the weights-only unpickler refused (a class or function the file would call)."""
    import re

    match = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"[Uu]nsupported global:? ([\w.]+)", message)
    if match:
        return f"it references {match.group(1)}"
    match = re.search(r"(Trying to (?:call reduce|instantiate|set) [^\n]*)", message)
    return match.group(1) if match else None


def _file_kind(path: Path) -> str | None:
    """``"safetensors"``, ``"zip"`` (torch's format), ``"pickle"`` (legacy torch / plain pickle)
    or ``None`` (none of these), from the file's bytes, not its name."""
    import pickletools
    import struct

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(9)
        if len(head) == 9:
            (n,) = struct.unpack("<Q", head[:8])
            if 2 <= n <= size - 8 and head[8:9] == b"{":
                return "safetensors"
        if zipfile.is_zipfile(fh):
            return "zip"
        fh.seek(0)
        # a pickle: a stream of known opcodes ending in STOP (for a legacy torch file, the first of
        # its pickles: the magic number); text and random bytes fail within a few opcodes
        try:
            for opcode, _arg, _pos in pickletools.genops(fh):
                if opcode.name == "STOP":
                    return "pickle"
        except Exception:  # noqa: BLE001 - anything the opcode reader rejects is not a pickle
            return None
    return None


def _unwrap_state_dict(obj: Any, key: str | None) -> dict[str, torch.Tensor]:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            raise HubError(f"checkpoint has no entry {key!r} (top-level keys: {list(obj)[:10] if isinstance(obj, Mapping) else type(obj).__name__})")
        obj = obj[key]
    if not isinstance(obj, Mapping):
        raise HubError(f"checkpoint is a {type(obj).__name__}, not a state_dict")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj)
    for candidate in ("state_dict", "model", "model_state_dict", "module"):
        if candidate in obj and isinstance(obj[candidate], Mapping):
            return _unwrap_state_dict(obj[candidate], None)
    non_tensor = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)][:5]
    raise HubError(f"checkpoint is not a flat state_dict (non-tensor entries: {non_tensor})")
