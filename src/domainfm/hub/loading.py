"""Loading weights into a model: key checks, converters, upstream repositories, load_pretrained."""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from domainfm import zoo
from domainfm.hub.base import CONFIG_NAME, ChecksumError, HubError, OWN_METADATA_KEY, WEIGHTS_NAME
from domainfm.hub.cache import sha256_file
from domainfm.hub.checkpoints import _unwrap_state_dict, load_checkpoint
from domainfm.hub.fetching import fetch, parse_hf, resolve_timm

# --------------------------------------------------------------------------- loading into a model


@dataclass
class LoadReport:
    """What happened when a checkpoint was loaded into a model."""

    source: str
    sha256: str | None = None
    #: ``"domainfm"`` (our own format, loaded as is) or ``"upstream"`` (went through the converter)
    kind: str = "upstream"
    converter: str | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    dropped_head: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"loaded {self.source} ({self.kind} file" + (f", sha256 {self.sha256[:12]}…)" if self.sha256 else ")")]
        if self.converter:
            lines.append(f"  converted with: {self.converter}")
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected), ("dropped head (shape changed)", self.dropped_head)):
            if keys:
                lines.append(f"  {label}: {', '.join(keys)}")
        return "\n".join(lines)


def _is_head_key(key: str, heads: tuple[str, ...]) -> bool:
    return any(key == h or key.startswith(h + ".") for h in heads)


def load_state_dict_into(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    heads: tuple[str, ...] = (),
    strict: bool = True,
    source: str = "<state_dict>",
) -> LoadReport:
    """Load ``state_dict`` into ``model``, naming every missing/unexpected key.

    Head keys (prefixes in ``heads``) whose shape changed are dropped and the head keeps its fresh
    initialisation; any other shape mismatch is an error. With ``strict`` any missing key outside
    the head or any unexpected key raises :class:`HubError`; otherwise they are warned about.
    """
    own = model.state_dict()
    report = LoadReport(source=source)
    filtered: dict[str, torch.Tensor] = {}
    mismatched = []
    for key, value in state_dict.items():
        if key not in own:
            report.unexpected.append(key)
            continue
        if own[key].shape != value.shape:
            if _is_head_key(key, heads):
                report.dropped_head.append(key)
                continue
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(own[key].shape)}")
            continue
        if own[key].is_floating_point() and not value.is_floating_point():
            # load_state_dict would copy it, rounding nothing but silently loading integers
            raise HubError(f"{source}: tensor {key!r} is stored as {value.dtype}, but the model's parameter is "
                           f"{own[key].dtype}: not a checkpoint of this model's floating-point weights")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise HubError(f"{source}: tensor {key!r} contains NaN or inf")
        filtered[key] = value
    report.missing = [k for k in own if k not in filtered and k not in report.dropped_head]
    if mismatched:
        raise HubError(f"{source}: shape mismatch for {len(mismatched)} key(s): " + "; ".join(mismatched))
    missing_body = [k for k in report.missing if not _is_head_key(k, heads)]
    problems = []
    if missing_body:
        problems.append(f"missing keys: {', '.join(missing_body)}")
    if report.unexpected:
        problems.append(f"unexpected keys: {', '.join(report.unexpected)}")
    if problems and strict:
        raise HubError(f"{source} does not match {type(model).__name__}: " + "; ".join(problems))
    if problems:
        warnings.warn(f"{source}: " + "; ".join(problems), stacklevel=2)
    model.load_state_dict(filtered, strict=False)
    return report


def is_own_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file written by domainfm (its metadata names the variant
    under ``domainfm_model``, as :func:`save_pretrained` writes it)."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:
        raise HubError(f"{path}: not a readable safetensors file ({exc})") from exc
    return bool(metadata.get(OWN_METADATA_KEY))


REPO_FILES = (CONFIG_NAME, WEIGHTS_NAME)


def _is_hf_repo(url: str) -> bool:
    return url.startswith("hf://") and len(url[len("hf://") :].strip("/").split("/")) == 2


def fetch_hf_repo(url: str, *, card: zoo.ModelCard | None = None, sha256: str | Mapping[str, str] | None = None,
                  files: tuple[str, ...] = REPO_FILES, optional: tuple[str, ...] = (), progress: bool = True,
                  revision: str | None = None) -> Path:
    """Fetch a repository laid out as ``config.json`` + ``model.safetensors`` (``hf://org/repo``
    or ``hf://org/repo@revision``) through :func:`fetch` and return its snapshot folder.

    Each file's sha256 comes from ``sha256`` (a mapping file -> digest) or from the card's weight
    source ``hf://org/repo/<file>``; a file with neither is verified against the digest the Hub
    publishes and the lock file. ``optional`` files (e.g. ``README.md``) are fetched when present.
    """
    repo, url_revision, path = parse_hf(url)
    if path is not None:
        raise ValueError(f"{url!r}: expected a whole repository, hf://org/repo[@revision]")
    revision = url_revision or revision
    digests = dict(sha256) if isinstance(sha256, Mapping) else {}
    if card is not None:
        for source in card.weights:
            if source.url.startswith(f"hf://{repo}/") and source.sha256:
                digests.setdefault(source.url[len(f"hf://{repo}/") :], source.sha256)
            elif source.url.rstrip("/") in (f"hf://{repo}", url.rstrip("/")) and source.sha256:
                digests.setdefault(WEIGHTS_NAME, source.sha256)  # a whole-repository source pins its weights
    base = f"hf://{repo}" + (f"@{revision}" if revision else "")
    folder = None
    for name in files:
        path = fetch(f"{base}/{name}", digests.get(name), progress=progress)
        folder = path.parent
    for name in optional:
        try:
            fetch(f"{base}/{name}", digests.get(name), progress=progress)
        except ChecksumError:
            raise
        except HubError:
            pass  # absent: optional
    return folder


def download(source: zoo.WeightSource | str, *, progress: bool = True) -> list[tuple[str, Path, str]]:
    """Fetch and verify one weight source (a file, or a whole ``hf://org/repo``):
    ``[(url, local path, sha256), ...]`` for each file. What ``domainfm download`` runs."""
    url, sha256, revision = (source, None, None) if isinstance(source, str) else (source.url, source.sha256, source.revision)
    if url.startswith("timm://"):
        url = resolve_timm(url)
    if _is_hf_repo(url):
        folder = fetch_hf_repo(url, progress=progress, revision=revision)
        return [(f"{url}/{name}", folder / name, sha256_file(folder / name)) for name in REPO_FILES]
    path = fetch(url, sha256, progress=progress, revision=revision)
    return [(url, path, sha256 or sha256_file(path))]


def _read_dir(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """(state_dict, config, own): ``own`` when ``config.json`` has our ``domainfm`` block (a
    :func:`save_pretrained` folder; its recorded sha256 is verified), else an upstream repo layout."""
    config = {}
    config_file = directory / CONFIG_NAME
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise HubError(f"{config_file}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise HubError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    own = isinstance(config.get("domainfm"), Mapping)
    for name in (WEIGHTS_NAME, "pytorch_model.bin", "model.pt", "model.pth"):
        path = directory / name
        if path.is_file():
            recorded = config["domainfm"].get("sha256") if own else None
            if recorded is not None and sha256_file(path) != recorded:
                raise ChecksumError(f"{path}: sha256 does not match the one recorded in {config_file}")
            return _unwrap_state_dict(load_checkpoint(path), None), config, own or is_own_file(path)
    raise FileNotFoundError(f"{directory}: no {WEIGHTS_NAME} (or pytorch_model.bin) in this directory")


def _pick_converter(
    converter: str | Callable | None,
    card: zoo.ModelCard | None,
    source_obj: zoo.WeightSource | None,
    location: str,
) -> tuple[str | None, Callable | None]:
    """The converter for an upstream file: ``converter=`` (a card name or a callable), else the
    weight source's recorded one (``None`` there: the source already holds our keys), else the
    card's only converter; several and none chosen is an error."""
    if callable(converter):
        return getattr(converter, "__name__", "callable"), converter
    if converter is not None:
        if card is None or converter not in card.converters:
            available = sorted(card.converters) if card is not None else []
            raise HubError(f"unknown converter {converter!r}; this model has {available}")
        return converter, card.converters[converter]
    if source_obj is not None:
        name = source_obj.converter
        return (name, card.converters[name]) if name is not None else (None, None)
    if card is None or not card.converters:
        return None, None
    if len(card.converters) == 1:
        return next(iter(card.converters.items()))
    raise HubError(
        f"{location} is an upstream checkpoint (not written by domainfm) and {card.name} has several "
        f"converters ({sorted(card.converters)}); pass converter=NAME"
    )


def load_pretrained(
    model: nn.Module,
    pretrained: bool | str | os.PathLike = True,
    *,
    card: zoo.ModelCard | str | None = None,
    converter: str | Callable | None = None,
    sha256: str | None = None,
    strict: bool = True,
    progress: bool = True,
) -> LoadReport:
    """Load weights into ``model`` from a card's source, a URL, a file or a directory.

    What the file is decides the conversion. Our own format (a :func:`save_pretrained` folder,
    or a safetensors file whose metadata names ``domainfm_model``) is loaded as is. Any other
    file is upstream and is always converted, by: the ``converter`` argument (a name in the
    card's converters, or a callable ``fn(state_dict, model) -> state_dict``); else the weight
    source's recorded converter; else the card's only converter. An explicit ``converter`` also
    applies to our own files (converters are idempotent, so that is harmless). Head weights
    whose shape changed are dropped.
    """
    if card is None:
        card = getattr(model, "domainfm_name", None)
    if isinstance(card, str):
        card = zoo.get_card(card)
    heads = card.head if card is not None else ()
    source_obj: zoo.WeightSource | None = None
    upstream_config: dict[str, Any] = {}

    if pretrained is True:
        if card is None or not card.weights:
            name = card.name if card is not None else type(model).__name__
            raise HubError(f"{name} has no pretrained weights registered; pass a path or URL as pretrained=")
        source_obj = card.weights[0]
    elif isinstance(pretrained, str) and "://" in pretrained and card is not None:
        source_obj = next((w for w in card.weights if w.url == pretrained), None)

    if source_obj is not None and _is_hf_repo(resolve_timm(source_obj.url) if source_obj.url.startswith("timm://")
                                              else source_obj.url):
        location = source_obj.url
        raw, config, own = _read_dir(fetch_hf_repo(source_obj.url, card=card, progress=progress,
                                                   revision=source_obj.revision))
        digest = None
        if not own:
            upstream_config = config
    elif source_obj is not None:
        location = source_obj.url
        path = fetch(source_obj.url, source_obj.sha256, progress=progress, revision=source_obj.revision)
        digest = source_obj.sha256 or sha256_file(path)
        raw = _unwrap_state_dict(load_checkpoint(path), source_obj.state_dict_key)
        own = is_own_file(path)
    else:
        location = str(pretrained)
        local = Path(pretrained) if "://" not in location else None
        if local is not None and local.is_dir():
            raw, config, own = _read_dir(local)
            digest = None
        elif _is_hf_repo(location):
            raw, config, own = _read_dir(fetch_hf_repo(location, card=card, sha256=sha256, progress=progress))
            digest = None
        else:
            path = fetch(location, sha256, progress=progress)
            digest = sha256 or sha256_file(path)
            raw = _unwrap_state_dict(load_checkpoint(path), None)
            own, config = is_own_file(path), {}
        if not own:
            upstream_config = config

    if upstream_config:
        # before conversion: a converter may need the upstream config (e.g. tied embeddings)
        model.domainfm_upstream_config = upstream_config
    if own and converter is None:
        converter_name, convert = None, None
    else:
        converter_name, convert = _pick_converter(converter, card, source_obj, location)
    state_dict = convert(raw, model) if convert is not None else raw
    report = load_state_dict_into(model, state_dict, heads=heads, strict=strict, source=location)
    report.sha256 = digest
    report.kind = "domainfm" if own else "upstream"
    report.converter = converter_name
    model.domainfm_load_report = report
    return report
