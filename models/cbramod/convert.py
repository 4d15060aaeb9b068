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

braindecode's CBraMod (``braindecode.models.CBraMod``, 1.8) keeps the official module names
(``nn.MultiheadAttention`` included), so its backbone keys are the official ones above; it adds a
task head ``final_layer = Sequential(Flatten(), Linear(n_chans * n_patches * emb_dim, n_outputs))``
applied to ``proj_out``'s output (``final_layer.1.*``; absent with ``return_encoder_output=True``).
Our ``head_type="flatten_emb"`` head is that classifier: for a model with it, ``proj_out.0.*`` ->
``head.pre_logits.0.*`` (and also, unchanged, to the reconstruction ``proj_out`` when the model
keeps one) and ``final_layer.1.*`` -> ``head.fc.*``; a head of another size (``n_outputs``) is
dropped by the loader as a resized classifier, and one built for other ``n_chans``/``n_times``
(another ``C*N*emb_dim`` input) is not loaded, with a warning. Any other head type leaves
``final_layer`` unloaded: the model's head, if any, keeps its fresh initialisation (the loader
reports its keys as missing) and a warning names the keywords that would keep braindecode's
classifier (``head_type="flatten_emb", n_chans=..., n_times=..., n_outputs=...``, read from the
file and its ``config.json``). braindecode's Hub folders (``push_to_hub``/``save_pretrained``:
``config.json`` + ``model.safetensors``, also ``pytorch_model.bin``) are checked through the
hub's ``model.domainfm_upstream_config``: the architecture fields (``patch_size``, ``n_layer``,
``nhead``, ``dim_feedforward``, ``emb_dim``, ``activation``, ``channels_kernel_stride_padding_norm``)
and ``sfreq`` must agree with the model (``nhead`` is invisible in the weights: a different one
would load and silently compute something else; ``emb_dim`` must be the ``flatten_emb`` head's, or
the reconstruction ``proj_out``'s ``d`` when that is what takes ``proj_out``), and the signal
fields (``n_chans``/``chs_info``, ``n_times``/``input_window_seconds``, ``n_outputs``) must
describe the file's own ``final_layer``; any disagreement is a ``ValueError`` naming
``config.json`` and the field.

The converter is idempotent (our own keys pass through unchanged), so the hub may apply it to
any upstream file, whatever share of its keys already matches.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["convert_official_state_dict", "to_official_state_dict", "check_braindecode_config"]

_IN_PROJ = re.compile(r"^(encoder\.layers\.\d+\.self_attn_[st])\.in_proj_(weight|bias)$")
_HEAD_MAPS = {
    "all_patch_reps": {"1": "head.pre_logits.1", "4": "head.pre_logits.4", "7": "head.fc"},
    "avgpooling_patch_reps": {"3": "head.fc"},
}
#: braindecode's task head (``final_layer = Sequential(Flatten(), Linear(...))``)
_BRAINDECODE_HEAD = "final_layer."
#: our head type that computes braindecode's proj_out + final_layer
_FLATTEN_EMB = "flatten_emb"
#: braindecode's per-patch projection before final_layer (in the official file: the reconstruction head)
_PROJ_OUT = "proj_out.0."
#: braindecode's CBraMod defaults for the patch CNN: (channels, kernel, stride, padding, (groups, channels))
_BRAINDECODE_PATCH_CNN = [[25, 49, 25, 24, [5, 25]], [25, 3, 1, 1, [5, 25]], [25, 3, 1, 1, [5, 25]]]


def convert_official_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Rename an official (pretrained or fine-tuned) CBraMod state_dict to ``model``'s keys.

    ``proj_out.*`` (the reconstruction head) is dropped when ``model`` was built without it
    (``reconstruction_head=False``, as for fine-tuning); official classifier weights are kept
    only when ``model`` has a head of the same type. braindecode's ``proj_out.0.*`` and
    ``final_layer.1.*`` become the ``flatten_emb`` head's ``head.pre_logits.0.*`` and ``head.fc.*``
    when ``model`` has that head (``head.pre_logits.0.*`` keys already in ``state_dict`` win over
    the copy of ``proj_out``, so our own files pass unchanged); otherwise ``final_layer`` is not
    loaded and, when ``model`` has a head, a warning names the keywords that would keep it. A
    braindecode ``config.json`` the hub read beside the weights (``model.domainfm_upstream_config``)
    is checked first (:func:`check_braindecode_config`). Unknown keys are passed through so that
    the loader names them as unexpected.
    """
    config = getattr(model, "domainfm_upstream_config", None) or {}
    check_braindecode_config(config, model, state_dict)
    own = model.state_dict()
    head_type = getattr(model, "head_type", None)
    flatten_emb = head_type == _FLATTEN_EMB and getattr(model, "head", None) is not None
    out: dict[str, torch.Tensor] = {}
    braindecode_head = []
    projection: dict[str, torch.Tensor] = {}  # proj_out.0.* for the flatten_emb head, filled in last
    for key, value in state_dict.items():
        if key.startswith("module."):
            key = key[len("module."):]
        if key.startswith(_BRAINDECODE_HEAD):
            if flatten_emb and key.startswith(f"{_BRAINDECODE_HEAD}1."):
                out[f"head.fc.{key[len(_BRAINDECODE_HEAD) + 2:]}"] = value
            else:
                braindecode_head.append(key)
            continue
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
        if flatten_emb and key.startswith(_PROJ_OUT):
            projection[f"head.pre_logits.0.{key[len(_PROJ_OUT):]}"] = value
        if key.startswith("proj_out.") and getattr(model, "proj_out", None) is None:
            continue
        out[key] = value
    for key, value in projection.items():
        out.setdefault(key, value)
    if flatten_emb:
        _drop_misfitting_classifier(out, own, config, state_dict, model)
    elif braindecode_head and getattr(model, "head", None) is not None:
        keywords = _flatten_emb_keywords(config, state_dict, model)
        name = getattr(model, "domainfm_name", None) or "cbramod-base"
        warnings.warn(
            f"braindecode's classifier ({', '.join(braindecode_head)}: Linear over the flattened n_chans x "
            f"n_patches x emb_dim proj_out features) was not loaded into this model's head_type={head_type!r} "
            f"head, which keeps its fresh initialisation. To keep braindecode's classifier, pass {keywords} "
            f"(create_model({name!r}, pretrained=..., {keywords})); or train the fresh head, or pass "
            "n_outputs=None for the backbone alone",
            stacklevel=2,
        )
    return out


def _drop_misfitting_classifier(out: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor],
                                config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor],
                                model: nn.Module) -> None:
    """braindecode's ``final_layer`` over another ``C*N*emb_dim`` input than the model's
    ``flatten_emb`` head: its weight goes on to the loader (which drops it as a resized head) and
    its bias, whose shape may still fit, is withheld so that no half of a classifier is loaded."""
    weight, mine = out.get("head.fc.weight"), own.get("head.fc.weight")
    if weight is None or mine is None or weight.dim() != 2 or weight.shape[1] == mine.shape[1]:
        return  # fits, or only n_outputs differs: the loader drops both keys as a resized classifier
    out.pop("head.fc.bias", None)
    warnings.warn(
        f"braindecode's final_layer.1.weight takes {weight.shape[1]} inputs but the model's flatten_emb head "
        f"takes {mine.shape[1]} (n_chans={model.n_chans} x {model.head.n_patches} patches x "
        f"emb_dim={model.head.emb_dim}); the classifier was not loaded. To keep it, build the model with "
        f"{_flatten_emb_keywords(config, state_dict, model)}",
        stacklevel=3,
    )


def _flatten_emb_keywords(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> str:
    """The keywords that build a ``flatten_emb`` head fitting the file's ``final_layer``
    (``n_chans``/``n_times`` from ``config.json`` where it has them, else the model's when they
    fit, else the product the file fixes)."""
    head = _head_inputs(state_dict)
    projection = state_dict.get(_PROJ_OUT + "weight", state_dict.get(f"module.{_PROJ_OUT}weight"))
    emb_dim = int(projection.shape[0]) if projection is not None and projection.dim() == 2 else \
        int(config.get("emb_dim") or model.d_model)
    n_chans, n_times = _signal_sizes(config)
    if (n_chans is None or n_times is None) and head is not None:
        model_chans, model_times = getattr(model, "n_chans", None), getattr(model, "n_times", None)
        if model_chans and model_times and model_chans * (model_times // model.patch_size) * emb_dim == head[1]:
            n_chans, n_times = model_chans, model_times
    words = [f"head_type={_FLATTEN_EMB!r}"]
    if n_chans is not None and n_times is not None:
        words += [f"n_chans={int(n_chans)}", f"n_times={int(n_times)}"]
    elif head is not None:
        words.append(f"n_chans=C, n_times={model.patch_size}*N with C*N = {head[1]}/{emb_dim} = {head[1] // emb_dim}")
    else:
        words.append("n_chans=..., n_times=... (braindecode's)")
    if head is not None:
        words.append(f"n_outputs={head[0]}")
    if emb_dim != model.d_model:
        words.append(f"emb_dim={emb_dim}")
        if getattr(model, "proj_out", None) is not None:
            words.append("reconstruction_head=False")
    return ", ".join(words)


def _head_inputs(state_dict: Mapping[str, torch.Tensor]) -> tuple[int, int] | None:
    """(n_outputs, in_features) of braindecode's ``final_layer.1.weight``, if the file has one."""
    weight = state_dict.get(f"{_BRAINDECODE_HEAD}1.weight", state_dict.get(f"module.{_BRAINDECODE_HEAD}1.weight"))
    if weight is None or weight.dim() != 2:
        return None
    return int(weight.shape[0]), int(weight.shape[1])


def check_braindecode_config(config: Mapping[str, Any], model: nn.Module,
                             state_dict: Mapping[str, torch.Tensor] | None = None, where: str = "config.json") -> None:
    """Check a braindecode CBraMod ``config.json`` (``EEGModuleMixin``'s init keywords) against
    ``model`` and against the file's own ``final_layer``; a config with none of braindecode's
    CBraMod fields is ignored. Raises ``ValueError`` naming ``where`` and each disagreeing field.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    architecture = ("patch_size", "n_layer", "nhead", "dim_feedforward", "emb_dim", "activation",
                    "channels_kernel_stride_padding_norm", "return_encoder_output")
    if "braindecode_version" not in config and not any(field in config for field in architecture):
        return
    layer = model.encoder.layers[0] if len(model.encoder.layers) else None
    head = getattr(model, "head", None)
    flatten_emb = getattr(model, "head_type", None) == _FLATTEN_EMB and head is not None
    have = {  # braindecode's field: (our keyword, the model's value)
        "patch_size": ("patch_size", model.patch_size),
        "n_layer": ("n_layers", len(model.encoder.layers)),
        "nhead": ("n_heads", 2 * layer.self_attn_s.n_heads if layer is not None else None),
        "dim_feedforward": ("dim_feedforward", layer.linear1.out_features if layer is not None else None),
        # braindecode's proj_out is the flatten_emb head's projection, or else our reconstruction
        # proj_out (Linear(d, d)); its emb_dim only matters where it is loaded
        "emb_dim": ("emb_dim", head.emb_dim) if flatten_emb else
                   ("patch_size", model.d_model if getattr(model, "proj_out", None) is not None else None),
    }
    problems = []
    for field, (keyword, value) in have.items():
        want = config.get(field)
        if want is not None and value is not None and int(want) != int(value):
            problems.append(f"{field}={want} but the model has {keyword}={value}")
    emb_dim = config.get("emb_dim")
    if flatten_emb and emb_dim is not None and int(emb_dim) != model.d_model and model.proj_out is not None:
        problems.append(f"emb_dim={emb_dim}: braindecode's proj_out (Linear({model.d_model}, {emb_dim})) does not fit "
                        f"the model's reconstruction proj_out (Linear({model.d_model}, {model.d_model})); pass "
                        "reconstruction_head=False")
    activation = config.get("activation")
    if activation is not None and str(activation).rsplit(".", 1)[-1] != "GELU":
        problems.append(f"activation={activation!r} but CBraMod's feed-forward uses GELU")
    cnn = config.get("channels_kernel_stride_padding_norm")
    if cnn is not None and _json_lists(cnn) != _BRAINDECODE_PATCH_CNN:
        problems.append(f"channels_kernel_stride_padding_norm={cnn} but the model has the paper's patch CNN "
                        f"{_BRAINDECODE_PATCH_CNN}")
    sfreq = config.get("sfreq")
    if sfreq is not None and abs(float(sfreq) - float(model.sfreq)) > 1e-6:
        problems.append(f"sfreq={sfreq} but this CBraMod works on {model.sfreq:g} Hz EEG (its patches are "
                        f"{model.patch_size} samples = 1 s at 200 Hz)")
    problems += _signal_problems(config, state_dict or {}, int(config.get("patch_size") or model.patch_size),
                                 int(config.get("emb_dim") or model.d_model))
    if problems:
        raise ValueError(f"{where} (braindecode CBraMod) disagrees with the model or with its own weights: "
                         + "; ".join(problems)
                         + f". Build the model with matching keywords or fix {where}")


def _signal_problems(config: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], patch_size: int,
                     emb_dim: int) -> list[str]:
    """What in the signal fields contradicts itself or the file's ``final_layer`` (braindecode
    derives ``n_chans`` from ``chs_info`` and ``n_times`` from ``input_window_seconds * sfreq``)."""
    problems = []
    n_chans, chs_info = config.get("n_chans"), config.get("chs_info")
    if n_chans is not None and isinstance(chs_info, list) and len(chs_info) != int(n_chans):
        problems.append(f"n_chans={n_chans} but chs_info lists {len(chs_info)} channels")
    n_times, seconds, sfreq = config.get("n_times"), config.get("input_window_seconds"), config.get("sfreq")
    if seconds is not None and sfreq is not None and n_times is not None:
        derived = round(float(seconds) * float(sfreq))
        if int(n_times) != derived:
            problems.append(f"n_times={n_times} but input_window_seconds * sfreq = {derived}")
    n_chans, n_times = _signal_sizes(config)
    head = _head_inputs(state_dict)
    if head is None:
        return problems
    n_outputs, in_features = head
    if config.get("n_outputs") is not None and int(config["n_outputs"]) != n_outputs:
        problems.append(f"n_outputs={config['n_outputs']} but final_layer.1.weight has {n_outputs} outputs")
    if n_chans is not None and n_times is not None:
        expected = int(n_chans) * (int(n_times) // patch_size) * emb_dim
        if expected != in_features:
            problems.append(
                f"n_chans={n_chans}, n_times={n_times} give final_layer an input of {n_chans} x "
                f"{int(n_times) // patch_size} patches x {emb_dim} = {expected}, but final_layer.1.weight has "
                f"{in_features} inputs"
            )
    return problems


def _signal_sizes(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(n_chans, n_times) of a braindecode config, derived as braindecode does where absent
    (``len(chs_info)``, ``input_window_seconds * sfreq``)."""
    n_chans, chs_info = config.get("n_chans"), config.get("chs_info")
    if n_chans is None and isinstance(chs_info, list):
        n_chans = len(chs_info)
    n_times, seconds, sfreq = config.get("n_times"), config.get("input_window_seconds"), config.get("sfreq")
    if n_times is None and seconds is not None and sfreq is not None:
        n_times = round(float(seconds) * float(sfreq))
    return (int(n_chans) if n_chans is not None else None), (int(n_times) if n_times is not None else None)


def _json_lists(value: Any) -> Any:
    """Tuples as lists, recursively (how a config reads back from JSON)."""
    if isinstance(value, (list, tuple)):
        return [_json_lists(v) for v in value]
    return value


def to_official_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our backbone's weights under the official keys (the inverse rename; head excluded)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("head."):
            continue
        key = re.sub(r"\.in_proj\.(weight|bias)$", r".in_proj_\1", key)
        out[key] = value
    return out
