"""OpenMHC's released WBM (``hf://MyHeartCounts/openmhc-wbm-dp``) -> our CPU :class:`~.wbm.WBM`.

OpenMHC (github.com/AshleyLab/myheartcounts-dataset, the MyHeartCounts benchmark) publishes a
re-implementation of Apple's WBM whose own loader needs the CUDA-only ``mamba_ssm``. This module
loads its release into ``wbm-openmhc`` (our Mamba-2 in plain torch) and states its input contract.
What follows was read from that repository (commit 400d156); the files are named so it can be
checked.

**The release** (``tools/encoders/build_wbm_release.py``, ``src/openmhc/encoders/_release.py``;
tag ``v1.0`` per the model card's ``hf://MyHeartCounts/openmhc-wbm-dp@v1.0``; licence CC-BY-4.0 on
the Hub card, the repository's README says "Models OpenRAIL"): ``model.ckpt`` (a PyTorch
Lightning checkpoint: the encoder's state_dict under ``"state_dict"``, its keys prefixed
``model.`` or ``encoder.``, which ``downstream_evaluation/models/wbm/model.py::_load_wbm_encoder``
strips before ``load_state_dict(strict=False)``), ``normalization_stats.json`` (``{"means": [19],
"stds": [19], ...}``) and ``openmhc_manifest.json`` (``spec_version`` 1, ``kind`` ``"wbm"``,
``arch`` ``{in_dim: 38, embed_dim: 256, hidden_dim: 64, num_layers: 4, proj_dim: 128,
dropout: 0.223}``). No ``config.json``, no safetensors.

**The architecture** (``downstream_evaluation/models/wbm/week_encoders_mamba2.py``,
``tokenizers.py``): ``tokenizer.fc1`` (38 -> 64), GELU, ``tokenizer.fc2`` (64 -> 256); four
``backbone.{i}`` blocks, each ``fwd`` and ``bwd`` = ``mamba_ssm.Mamba2(d_model=256)`` with
mamba_ssm 2.2.4's defaults (``d_state`` 128, ``d_conv`` 4, ``expand`` 2, ``headdim`` 64, one group
of B/C, a per-head ``D``, gated RMSNorm after the gate, no in/out-projection bias), ``bwd`` run on
the time-reversed week, ``proj`` (512 -> 256), post-norm ``norm1``/``norm2`` LayerNorms and a GELU
FFN ``ffn.0`` (256 -> 1024) / ``ffn.3``; the representation ``r`` is the mean over all 168 hours
(no final norm); ``proj_head`` is ``Linear(256, 128)`` or a 3-layer MLP (``0``: 256 -> 1024,
``1`` LayerNorm, ``4``: 1024 -> 256, ``5`` LayerNorm, ``8``: 256 -> 128), the official loader
telling them apart by shape; ``h = normalize(proj_head(r))`` is for the contrastive loss only.
mamba_ssm's Mamba2 and ours share every parameter name (``in_proj.weight`` split
``[z, x, B, C, dt]``, ``conv1d.weight`` ``(conv_dim, 1, d_conv)``, ``conv1d.bias``, ``dt_bias``,
``A_log``, ``D``, ``norm.weight``, ``out_proj.weight``), so the conversion only renames
``backbone.`` -> ``layers.`` and ``proj_head.`` -> ``projector.``.

**The input contract** (``model.py::_process_example`` and ``_resolve_norm_stats``,
``data/datasets/indexed_week_dataset.py``, ``openmhc/_constants.py``): a week is ``(168, 38)`` =
168 hours (7 days x 24, hourly, built from ``daily_hourly_hf``) of the 19 channels of
:data:`CHANNELS` z-scored with the release's means and SDs (only channels 0-6 are scaled; 7-18,
binary, have mean 0 and SD 1), multiplied by ``1 - missing`` (0 where missing), then the 19
missing flags (1 = missing). Our loaders give hourly tables in our variables;
:func:`~domainfm.data_loaders.wearables.openmhc_table` maps them onto the 19 channels in
OpenMHC's units, :func:`~domainfm.data_loaders.wearables.read_participant` applies it when a
model asks for these channels, and the model z-scores them with its ``zscore_mean`` /
``zscore_std`` buffers (``raw=True``), which :func:`load_openmhc` fills from
``normalization_stats.json``.

Not confirmed here (no network; the training code is not public): the sha256 of the files and
that tag ``v1.0`` exists on the Hub; the Lightning module's other state (whatever is not
``tokenizer``/``backbone``/``proj_head`` is dropped, as the official loader ignores it); which
projection head the release holds (``wbm-openmhc`` defaults to the 3-layer MLP, the class's
default; :func:`load_openmhc` reads it from the checkpoint); that the checkpoint unpickles with
``weights_only=True`` (a Lightning ``hyper_parameters`` entry holding a non-plain object would be
refused: convert the file to safetensors in a trusted environment); the units noted in
:func:`~domainfm.data_loaders.wearables.openmhc_table`.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from domainfm.data_loaders.wearables import OPENMHC_CHANNELS

__all__ = ["CHANNELS", "N_TIMES", "ZSCORED_CHANNELS", "MISSING", "RELEASE_REPO", "RELEASE_REVISION", "RELEASE_ARCH",
           "ARCH_DEFAULTS", "kwargs_from_arch", "release_arch", "read_normalization_stats", "read_release_manifest",
           "openmhc_inputs", "convert_openmhc_state_dict", "load_openmhc"]

#: the 19 channels, in the order of the release's input (and of its normalisation constants)
CHANNELS: tuple[str, ...] = tuple(OPENMHC_CHANNELS)
N_TIMES = 168  # hours per week
#: the channels the release's constants scale (the continuous ones; 7-18 are binary, left as is)
ZSCORED_CHANNELS = tuple(range(7))
#: value of a missing flag (the second 19 input columns): 1 = missing, 0 = observed
MISSING = 1.0

RELEASE_REPO = "MyHeartCounts/openmhc-wbm-dp"
RELEASE_REVISION = "v1.0"
MANIFEST_NAME = "openmhc_manifest.json"
#: the release's ``openmhc_manifest.json`` ``arch`` (``model.py::_ARCH``)
RELEASE_ARCH = {"in_dim": 38, "embed_dim": 256, "hidden_dim": 64, "num_layers": 4, "proj_dim": 128, "dropout": 0.223}

#: ``wbm-openmhc``'s architecture: the manifest's ``arch`` and mamba_ssm 2.2.4's Mamba2 defaults
#: (``chunk_size`` is ours: any value computes the same scan)
ARCH_DEFAULTS: dict[str, Any] = dict(
    backbone="bimamba2", tokenizer="mlp", tokenizer_hidden=64, d_model=256, n_layers=4, ffn_mult=4, pool="all",
    proj_dim=128, projector="mlp3", d_state=128, headdim=64, expand=2, d_conv=4, chunk_size=64, dropout=0.223,
)

# manifest arch key -> our keyword (in_dim is two per channel: values and missing flags)
_ARCH_KEYS = {"embed_dim": "d_model", "hidden_dim": "tokenizer_hidden", "num_layers": "n_layers",
              "proj_dim": "proj_dim", "dropout": "dropout"}
_LIGHTNING_PREFIXES = ("model.", "encoder.")
_RELEASE_PARTS = {"tokenizer": "tokenizer", "backbone": "layers", "proj_head": "projector"}
_OUR_PARTS = ("tokenizer", "layers", "projector", "head", "norm", "zscore_mean", "zscore_std")


def kwargs_from_arch(arch: Mapping[str, Any], where: str = MANIFEST_NAME) -> dict[str, Any]:
    """The WBM keywords for a manifest's ``arch`` (``in_dim`` -> ``n_chans = in_dim / 2``,
    ``embed_dim`` -> ``d_model``, ``hidden_dim`` -> ``tokenizer_hidden``, ``num_layers`` ->
    ``n_layers``, ``proj_dim``, ``dropout``)."""
    out: dict[str, Any] = {}
    for key, value in arch.items():
        if key == "in_dim":
            if int(value) % 2:
                raise ValueError(f"{where}: arch in_dim={value} is not two columns (value, missing flag) per channel")
            out["n_chans"] = int(value) // 2
        elif key in _ARCH_KEYS:
            out[_ARCH_KEYS[key]] = value
        else:
            raise ValueError(f"{where}: arch key {key!r} has no counterpart in wbm-openmhc (known: in_dim, "
                             f"{', '.join(_ARCH_KEYS)})")
    return out


def _strip(key: str) -> str:
    for prefix in _LIGHTNING_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def release_arch(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The WBM keywords of a release-layout state_dict, read from its shapes (one group of B/C, as
    mamba_ssm's default): ``n_chans, d_model, tokenizer_hidden, n_layers, d_state, headdim, expand,
    d_conv, ffn_mult`` and ``projector``/``proj_dim`` (``proj_dim=None`` without a ``proj_head``)."""
    sd = {_strip(k): v for k, v in state_dict.items()}
    try:
        fc1, fc2 = sd["tokenizer.fc1.weight"], sd["tokenizer.fc2.weight"]
        blocks = sorted({int(m.group(1)) for k in sd if (m := re.match(r"backbone\.(\d+)\.", k))})
        norm, dt_bias = sd["backbone.0.fwd.norm.weight"], sd["backbone.0.fwd.dt_bias"]
        conv, ffn = sd["backbone.0.fwd.conv1d.weight"], sd["backbone.0.ffn.0.weight"]
    except KeyError as exc:
        raise ValueError(f"not an OpenMHC WBM checkpoint: no {exc.args[0]!r} (first keys: "
                         f"{list(state_dict)[:6]})") from None
    d_model, d_inner, nheads = fc2.shape[0], norm.shape[0], dt_bias.shape[0]
    arch = dict(n_chans=fc1.shape[1] // 2, d_model=d_model, tokenizer_hidden=fc1.shape[0], n_layers=len(blocks),
                d_state=(conv.shape[0] - d_inner) // 2, headdim=d_inner // nheads, expand=d_inner // d_model,
                d_conv=conv.shape[-1], ffn_mult=ffn.shape[0] // d_model)
    heads = sorted({int(m.group(1)) for k in sd if (m := re.match(r"proj_head\.(\d+)\.weight$", k))})
    if not heads:
        arch.update(proj_dim=None)
    else:
        arch.update(projector="linear" if heads == [0] else "mlp3", proj_dim=sd[f"proj_head.{heads[-1]}.weight"].shape[0])
    return arch


def read_normalization_stats(path: str | os.PathLike) -> tuple[list[float], list[float]]:
    """``(means, stds)`` of the release's ``normalization_stats.json`` (19 each, in :data:`CHANNELS`
    order): what ``zscore_mean`` / ``zscore_std`` take."""
    path = Path(path)
    try:
        stats = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable normalization_stats.json ({exc})") from exc
    if not isinstance(stats, dict) or "means" not in stats or "stds" not in stats:
        raise ValueError(f"{path}: expected a JSON object with 'means' and 'stds' (19 each)")
    mean, std = torch.as_tensor(stats["means"], dtype=torch.float64), torch.as_tensor(stats["stds"], dtype=torch.float64)
    if mean.shape != (len(CHANNELS),) or std.shape != (len(CHANNELS),):
        raise ValueError(f"{path}: 'means' {tuple(mean.shape)} and 'stds' {tuple(std.shape)}: expected "
                         f"{len(CHANNELS)} each, one per channel of {list(CHANNELS)}")
    if not torch.isfinite(mean).all() or not (std > 0).all():
        raise ValueError(f"{path}: means must be finite and stds positive")
    return mean.tolist(), std.tolist()


def read_release_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A release's ``openmhc_manifest.json`` (the file, or the folder holding it): its fields,
    with ``checkpoint`` and ``normalization_stats`` as paths beside it (``None`` when absent)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no OpenMHC release manifest (expected {MANIFEST_NAME} beside model.ckpt "
                                "and normalization_stats.json)")
    raw = json.loads(path.read_text())
    if raw.get("spec_version") != 1 or raw.get("kind") != "wbm":
        raise ValueError(f"{path}: spec_version={raw.get('spec_version')!r}, kind={raw.get('kind')!r}: expected an "
                         "OpenMHC encoder manifest with spec_version 1 and kind 'wbm'")
    if not raw.get("checkpoint"):
        raise ValueError(f"{path}: no 'checkpoint' field")
    stats = raw.get("normalization_stats")
    return {**raw, "checkpoint": path.parent / raw["checkpoint"],
            "normalization_stats": None if stats is None else path.parent / stats, "manifest": path,
            "files": {"checkpoint": raw["checkpoint"], "normalization_stats": stats}}


def openmhc_inputs(values: torch.Tensor, observed: torch.Tensor, mean: Sequence[float],
                   std: Sequence[float]) -> torch.Tensor:
    """The release's input ``(B, T, 38)`` from weeks in OpenMHC's units: ``[(values - mean) / std
    (0 where missing) || missing flags (1 = missing)]``, as OpenMHC builds it. (``wbm-openmhc``
    builds the same inside, from ``model(values, observed, raw=True)``.)

    **Shapes:** values, observed ``(B, T, 19)`` -> ``(B, T, 38)``.
    """
    mean = torch.as_tensor(mean, dtype=values.dtype)
    std = torch.as_tensor(std, dtype=values.dtype)
    observed = observed.bool()
    z = torch.where(observed, (torch.nan_to_num(values) - mean) / std, torch.zeros_like(values))
    return torch.cat([z, (~observed).to(values.dtype) * MISSING], dim=-1)


def _describe(arch: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in arch.items())


def convert_openmhc_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename an OpenMHC WBM checkpoint (its Lightning ``state_dict``, keys ``model.``/``encoder.``
    + ``tokenizer.*``, ``backbone.{i}.*``, ``proj_head.*``) to ``model``'s keys, refusing shapes
    that do not fit with an error naming the release's key, ours, both shapes and the
    checkpoint's architecture. Our own keys pass unchanged (the converter is idempotent).

    The Lightning module's other state is dropped with a warning (the official loader ignores
    it too); the release's ``proj_head`` is dropped when ``model`` has no projector
    (``proj_dim=None``). The z-score statistics are not in the checkpoint (they ship in
    ``normalization_stats.json``): ``model`` keeps its own buffers (set them with
    :func:`load_openmhc`, or ``zscore_mean``/``zscore_std``)."""
    if getattr(model, "backbone", None) != "bimamba2" or getattr(model, "tokenizer_kind", None) != "mlp":
        raise ValueError("the openmhc converter loads into a WBM built with backbone='bimamba2' and tokenizer='mlp' "
                         f"(wbm-openmhc); this one has backbone={getattr(model, 'backbone', None)!r}, "
                         f"tokenizer={getattr(model, 'tokenizer_kind', None)!r}")
    if "state_dict" in state_dict and isinstance(state_dict["state_dict"], Mapping):  # a whole Lightning file
        state_dict = state_dict["state_dict"]
    own = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    other, dropped_projector = [], []
    for key, value in state_dict.items():
        stripped = _strip(key)
        part, _, rest = stripped.partition(".")
        if part in _RELEASE_PARTS:
            if part == "proj_head" and model.projector is None:
                dropped_projector.append(key)
                continue
            target = f"{_RELEASE_PARTS[part]}.{rest}"
        elif part in _OUR_PARTS:
            target = stripped
        else:
            other.append(key)
            continue
        if target in out:
            raise ValueError(f"checkpoint keys {origin[target]!r} and {key!r} both map to {target!r}")
        out[target], origin[target] = value, key
    if not any(k.startswith("layers.") for k in out):
        raise ValueError(f"not an OpenMHC WBM checkpoint: no backbone.* (or layers.*) keys; first keys: "
                         f"{list(state_dict)[:6]}")
    back = {"layers": "backbone", "projector": "proj_head"}  # the release's names, for release_arch
    arch = release_arch({back.get(k.partition(".")[0], k.partition(".")[0]) + "." + k.partition(".")[2]: v
                         for k, v in out.items() if "." in k})
    ours_projector = None if model.projector is None else model.projector_kind
    if model.projector is not None and arch.get("proj_dim") is not None and arch["projector"] != ours_projector:
        raise ValueError(f"the checkpoint's projection head is {arch['projector']!r} ("
                         f"{', '.join(sorted(origin[k] for k in out if k.startswith('projector.')))}) but the model was "
                         f"built with projector={ours_projector!r}: pass projector={arch['projector']!r} (or "
                         "proj_dim=None to drop it)")
    n_layers = len(model.layers)
    if arch["n_layers"] != n_layers:
        raise ValueError(f"the checkpoint has {arch['n_layers']} BiMamba2 blocks (backbone.0-{arch['n_layers'] - 1}), "
                         f"the model {n_layers}: pass n_layers={arch['n_layers']} (checkpoint: {_describe(arch)})")
    mismatched = [f"{origin[k]!r} (ours {k!r}): checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in out.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if mismatched:
        raise ValueError(f"shape mismatch for {len(mismatched)} key(s): {'; '.join(mismatched)}. The checkpoint's "
                         f"architecture: {_describe(arch)} (load_openmhc builds the model from it)")
    if other:
        warnings.warn(f"dropped {len(other)} checkpoint key(s) outside the OpenMHC encoder (tokenizer, backbone, "
                      f"proj_head), as the official loader ignores them: {', '.join(other[:8])}"
                      + (" ..." if len(other) > 8 else ""), stacklevel=2)
    if dropped_projector:
        warnings.warn(f"the model has no projector (proj_dim=None): dropped the checkpoint's projection head "
                      f"({', '.join(dropped_projector)})", stacklevel=2)
    from_file = "zscore_mean" in out  # a checkpoint of ours carries them
    for buffer in ("zscore_mean", "zscore_std"):
        if buffer not in out:
            out[buffer] = own[buffer].clone()
    if not from_file and bool((own["zscore_mean"] == 0).all() and (own["zscore_std"] == 1).all()):
        warnings.warn("the model's z-score statistics are the identity: OpenMHC's constants ship beside the "
                      "checkpoint in normalization_stats.json, not in it. Load with load_openmhc(), or pass "
                      "zscore_mean/zscore_std (read_normalization_stats) before using raw=True", stacklevel=2)
    return out


def _release_files(source: str | os.PathLike, sha256: Mapping[str, str] | None) -> tuple[dict[str, Any], Path, Path | None]:
    from domainfm import hub

    text = str(source)
    if not text.startswith("hf://"):
        manifest = read_release_manifest(source)
        return manifest, manifest["checkpoint"], manifest["normalization_stats"]
    repo, revision, path = hub.parse_hf(text)
    if path is not None:
        raise ValueError(f"{source!r}: expected a whole release, hf://org/repo[@revision]")
    revision = revision or (RELEASE_REVISION if repo == RELEASE_REPO else None)
    base = f"hf://{repo}" + (f"@{revision}" if revision else "")
    digests = dict(sha256 or {})
    manifest_file = hub.fetch(f"{base}/{MANIFEST_NAME}", digests.get(MANIFEST_NAME))
    manifest = read_release_manifest(manifest_file)
    names = manifest["files"]  # paths in the repository, relative to the manifest (at its root)
    checkpoint = hub.fetch(f"{base}/{names['checkpoint']}", digests.get(names["checkpoint"]))
    stats = None if names["normalization_stats"] is None else hub.fetch(
        f"{base}/{names['normalization_stats']}", digests.get(names["normalization_stats"]))
    return manifest, Path(checkpoint), None if stats is None else Path(stats)


def load_openmhc(source: str | os.PathLike = f"hf://{RELEASE_REPO}@{RELEASE_REVISION}", *, name: str = "wbm-openmhc",
                 sha256: Mapping[str, str] | None = None, **kwargs: Any) -> nn.Module:
    """``wbm-openmhc`` with an OpenMHC release loaded: a release folder (``openmhc_manifest.json``
    beside ``model.ckpt`` and ``normalization_stats.json``), its manifest file, or
    ``hf://org/repo[@revision]`` (default: the v1.0 release; files fetched into the cache,
    verified against ``sha256={file: digest}`` or else the Hub's digests).

    The architecture is read from the checkpoint's shapes and checked against the manifest's
    ``arch``; the z-score buffers are set from ``normalization_stats.json``; ``kwargs`` override
    (e.g. ``n_outputs=1`` for a fresh head)."""
    from domainfm.hub import create_model, load_checkpoint
    from domainfm.hub.checkpoints import _unwrap_state_dict

    manifest, checkpoint, stats = _release_files(source, sha256)
    arch = release_arch(_unwrap_state_dict(load_checkpoint(checkpoint), None))
    declared = kwargs_from_arch(manifest.get("arch") or {}, str(manifest["manifest"]))
    disagree = {k: (v, arch[k]) for k, v in declared.items() if k in arch and arch[k] != v}
    if disagree:
        raise ValueError(f"{manifest['manifest']}: arch disagrees with {checkpoint.name}: "
                         + ", ".join(f"{k} {m!r} vs checkpoint {c!r}" for k, (m, c) in disagree.items()))
    model_kwargs: dict[str, Any] = {**arch, **{k: v for k, v in declared.items() if k not in arch}}
    if stats is not None:
        model_kwargs["zscore_mean"], model_kwargs["zscore_std"] = read_normalization_stats(stats)
    model_kwargs.update(kwargs)
    return create_model(name, pretrained=str(checkpoint), converter="openmhc", **model_kwargs)
