"""create_model: a registered name, a saved folder or a run folder, with its weights."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from torch import nn

from domainfm import zoo
from domainfm.hub.base import CONFIG_NAME, ChecksumError, HubError, WEIGHTS_NAME
from domainfm.hub.cache import sha256_file
from domainfm.hub.cards import MODEL_CARD_NAME
from domainfm.hub.checkpoints import load_checkpoint
from domainfm.hub import loading
from domainfm.hub.loading import LoadReport, _is_hf_repo, load_pretrained, load_state_dict_into

def _create_from_saved(directory: Path, config: dict[str, Any], kwargs: dict[str, Any]) -> nn.Module:
    from safetensors.torch import load_model

    meta = config["domainfm"]
    model_kwargs = {**meta.get("model_kwargs", {}), **kwargs}
    model = zoo.build_model(meta["model_name"], **model_kwargs)
    weights = directory / WEIGHTS_NAME
    recorded = meta.get("sha256")
    if recorded is not None and sha256_file(weights) != recorded:
        raise ChecksumError(f"{weights}: sha256 does not match the one recorded in {directory / CONFIG_NAME}")
    changed_head = any(k in kwargs for k in ("n_outputs", "num_classes"))
    if changed_head:
        card = zoo.get_card(meta["model_name"])
        report = load_state_dict_into(
            model, load_checkpoint(weights), heads=card.head, strict=True, source=str(directory)
        )
    else:
        try:
            missing, unexpected = load_model(model, str(weights), strict=False)
        except Exception as exc:
            raise HubError(f"{weights}: could not be loaded ({exc})") from exc
        if missing or unexpected:
            raise HubError(f"{directory}: missing keys {sorted(missing)}; unexpected keys {sorted(unexpected)}")
        report = LoadReport(source=str(directory))
    report.sha256 = recorded
    report.kind = "domainfm"
    model.domainfm_load_report = report
    return model


def create_model(
    name: str | os.PathLike,
    pretrained: bool | str | os.PathLike = False,
    *,
    converter: str | Callable | None = None,
    sha256: str | None = None,
    strict: bool = True,
    progress: bool = True,
    **kwargs: Any,
) -> nn.Module:
    """Build a registered model (or one saved with :func:`save_pretrained`) and load weights.

    Args:
        name: a registered variant (``domainfm.list_models()``), a directory written by
            :func:`save_pretrained`, or such a folder on the Hub, ``"hf://user/repo[@revision]"``.
        pretrained: ``False`` (random init), ``True`` (the card's first weight source), a URL
            (``hf://org/repo/file``, ``https://…``, ``file://…``), a checkpoint file or directory.
        converter: name of one of the card's converters (or a callable) for upstream files.
        sha256: expected digest of a URL/file that is not one of the card's sources.
        strict: raise on any missing/unexpected key (the head excepted when its shape changed).
        **kwargs: override the variant's defaults (e.g. ``n_outputs=4, n_chans=22``).
    """
    if str(name).startswith("hf://"):
        if not _is_hf_repo(str(name)):
            raise HubError(f"{name}: create_model takes a whole repository, hf://user/repo[@revision]; for one "
                           "file of an upstream checkpoint use create_model(NAME, pretrained='hf://...')")
        folder = loading.fetch_hf_repo(str(name), sha256=sha256 and {WEIGHTS_NAME: sha256}, optional=(MODEL_CARD_NAME,),
                               progress=progress)
        config = json.loads((folder / CONFIG_NAME).read_text())
        if not isinstance(config, dict) or "domainfm" not in config:
            raise HubError(f"{name}: not a domainfm model repository (its {CONFIG_NAME} has no 'domainfm' block); "
                           "for an upstream repository use create_model(NAME, pretrained='" + str(name) + "')")
        model = _create_from_saved(folder, config, kwargs)
        model.domainfm_load_report.source = str(name)
        return model
    path = Path(name)
    if path.is_dir():
        config_file = path / CONFIG_NAME
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "domainfm" not in config:
            raise HubError(f"{path}: not a domainfm model directory (no 'domainfm' block in {config_file})")
        return _create_from_saved(path, config, kwargs)
    name = str(name)
    base, tag = zoo.split_tag(name)
    source = zoo.weight_source(name) if pretrained is True else None
    # the keywords a card's own weights go with (e.g. an inference option), beneath the caller's
    model = zoo.build_model(base, **{**(source.model_kwargs if source is not None else {}), **kwargs})
    if pretrained is True and tag is not None:  # "<model>.<tag>": that tag's source
        pretrained = source.url
    if pretrained is not False and pretrained is not None:
        load_pretrained(model, pretrained, card=base, converter=converter, sha256=sha256, strict=strict, progress=progress)
    return model
