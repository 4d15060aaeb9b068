"""Model cards written beside saved models."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from domainfm import zoo
from domainfm.atomic import atomic_write_text
from domainfm.hub.base import HubError
from domainfm.hub.fetching import parse_hf, resolve_timm

# --------------------------------------------------------------------------- model cards

MODEL_CARD_NAME = "README.md"


def _hub_repo_of(url: str | None) -> str | None:
    """The Hub repository id behind a weight location (hf://, timm://, a Hub cache path)."""
    if not url:
        return None
    url = str(url)
    if url.startswith("timm://"):
        try:
            url = resolve_timm(url)
        except HubError:
            return None
    if url.startswith("hf://"):
        try:
            return parse_hf(url)[0]
        except ValueError:
            return None
    marker = f"{os.sep}models--"
    if marker in url:  # a file in the Hugging Face cache: .../models--org--name/snapshots/...
        return url.split(marker, 1)[1].split(os.sep, 1)[0].replace("--", "/")
    return None


def _flat_numbers(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(prefix, value)]
    if isinstance(value, Mapping):
        out = []
        for key, item in value.items():
            out += _flat_numbers(item, f"{prefix}/{key}" if prefix else str(key))
        return out
    return []


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _started_from(zcard: zoo.ModelCard | None, load: Any, arm_report: Mapping[str, Any]
                  ) -> tuple[str, zoo.WeightSource | None, str | None]:
    """Where this model's weights began: ``(how, source, location)``. ``how`` is ``"random"`` (the
    run's arm started from random initialisation), ``"run"`` (the arm's recorded ``init``),
    ``"loaded"`` (the model's own load report), ``"card"`` (no start recorded, or a domainfm
    folder reloaded: the card's first source is assumed, as the licence line does) or
    ``"unknown"`` (an upstream file that is none of the card's sources). ``source`` is the card's
    weight source when one matches by location or digest (a local copy of a source matches)."""
    sources = zcard.weights if zcard is not None else ()

    def match(location: str | None, digest: str | None) -> zoo.WeightSource | None:
        for w in sources:
            if location is not None and (location == w.url or location.startswith((w.url + " ", w.url + ";"))):
                return w
            if digest and w.sha256 and w.sha256.startswith(digest.lower()):
                return w
        return None

    init = arm_report.get("init")
    if isinstance(init, str) and init.startswith("random"):
        return "random", None, None
    if isinstance(init, str) and init.startswith("pretrained "):
        location = init[len("pretrained "):]
        digest = location.split("(sha256 ", 1)[1].split(")", 1)[0] if "(sha256 " in location else None
        return "run", match(location, digest), location.split(" (sha256 ", 1)[0].split(";", 1)[0]
    loaded_from = getattr(load, "source", None)
    if loaded_from is not None:
        source = match(str(loaded_from), getattr(load, "sha256", None))
        if source is not None:
            return "loaded", source, str(loaded_from)
        if getattr(load, "kind", None) != "domainfm":
            return "unknown", None, str(loaded_from)
    if sources:
        return "card", sources[0], sources[0].url
    return "unknown", None, None


def _pretraining_lines(how: str, source: zoo.WeightSource | None, location: str | None) -> list[str]:
    """The card's ``## Pretraining data`` section: what the starting weights saw and which public
    benchmarks that data contains (a result on those is not a held-out result)."""
    lines = ["## Pretraining data", ""]
    if how == "random":
        return lines + ["- initialisation: random (the run's arm): no pretraining data", ""]
    if how == "card":
        lines.append(f"- weights: {location} (assumed, the card's weights: where this model's weights began was not "
                     "recorded; if it was trained from random initialisation it saw none of the data below)")
    elif location is not None:
        lines.append(f"- weights: {location}")
    if source is None or not source.pretraining_data:
        return lines + ["- pretraining data: not recorded", "- overlaps with public benchmarks: unknown", ""]
    lines.append(f"- pretraining data: {_md_cell(source.pretraining_data)}")
    if source.overlaps:
        lines.append(f"- overlaps with public benchmarks: {', '.join(source.overlaps)} (these weights saw their data "
                     "in pretraining: a result on them is not a held-out result)")
    else:
        lines.append("- overlaps with public benchmarks: none known")
    if source.note:
        lines.append(f"- note: {_md_cell(source.note)}")
    return lines + [""]


def model_card_text(model: nn.Module, report: Mapping[str, Any] | None = None, *, arm: str | None = None,
                    base_model: str | None = None, datasets: list[str] | None = None,
                    license: str | None = None) -> str:
    """The ``README.md`` model card of a domainfm model, in the Hub's format: YAML front matter
    (``library_name: domainfm``, ``license``, ``base_model``, ``tags``, ``datasets`` where known)
    and a body saying what the model is, what the weights it started from saw in pretraining and
    which public benchmarks that data overlaps (the weight source's ``pretraining_data`` and
    ``overlaps``; the source is the arm's recorded ``init``, else the one the model was loaded
    from), how it was trained and its metrics (from ``report``, a run's ``report.json`` as a dict;
    ``arm`` picks that arm's metrics), and the licence of the weights it started from."""
    import yaml

    name = getattr(model, "domainfm_name", None) or type(model).__name__
    try:
        zcard = zoo.get_card(name)
    except KeyError:
        zcard = None
    load = getattr(model, "domainfm_load_report", None)
    start = zcard.weights[0] if zcard is not None and zcard.weights else None
    loaded_from = getattr(load, "source", None)
    base = base_model or _hub_repo_of(loaded_from) or (_hub_repo_of(start.url) if start is not None else None)
    start_license = (start.license if start is not None and (loaded_from in (None, start.url)) else None)
    if start_license is None and zcard is not None and loaded_from is not None:
        start_license = next((w.license for w in zcard.weights if w.url == loaded_from), None)
    report = dict(report or {})
    arm_report = dict(report.get("arms", {}).get(arm, {})) if arm and isinstance(report.get("arms"), Mapping) else {}
    data = report.get("data") if isinstance(report.get("data"), Mapping) else {}
    if datasets is None:
        found = report.get("datasets") or data.get("dataset") or data.get("datasets")
        datasets = [found] if isinstance(found, str) else (list(found) if isinstance(found, (list, tuple)) else [])
    family = zcard.family if zcard is not None else None
    tags = ["domainfm"] + [t for t in (family, zcard.domain if zcard is not None else None) if t]
    meta: dict[str, Any] = {"library_name": "domainfm",
                            "license": _hub_license(license or (zcard.license if zcard is not None else None))}
    if base:
        meta["base_model"] = base
    meta["tags"] = tags
    if datasets:
        meta["datasets"] = [str(d) for d in datasets]

    n_params = sum(p.numel() for p in model.parameters())
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", ""]
    if zcard is not None and zcard.description:
        lines += [zcard.description, ""]
    lines += ["## Model", "", f"- architecture: `{type(model).__module__}.{type(model).__name__}`",
              f"- parameters: {n_params:,}"]
    if family:
        lines.append(f"- family: {family}" + (f" ({zcard.domain})" if zcard.domain else ""))
    if zcard is not None and zcard.paper:
        lines.append(f"- paper: {zcard.paper}")
    if zcard is not None and zcard.input_spec:
        spec = ", ".join(f"{k}={v}" for k, v in zcard.input_spec.items() if not isinstance(v, (list, dict)))
        lines.append(f"- input: {spec}")
    lines += ["", "Load it with domainfm:", "", "```python", "import domainfm", "",
              'model = domainfm.create_model("hf://USER/REPO")  # or a local folder path', "```", ""]

    if zcard is not None:
        lines += _pretraining_lines(*_started_from(zcard, load, arm_report))

    lines += ["## Training", ""]
    if report:
        for key in ("kind", "task", "model", "monitor", "labels", "wall_time_s"):
            if key in report and not isinstance(report[key], (Mapping, list)):
                lines.append(f"- {key}: {_md_cell(report[key])}")
        for key in ("init", "mode", "seed", "steps", "best_step"):
            if key in arm_report and not isinstance(arm_report[key], (Mapping, list)):
                lines.append(f"- {key}: {_md_cell(arm_report[key])}")
        for key, value in _flat_numbers(arm_report.get("params") or report.get("params") or {}, "params"):
            lines.append(f"- {key}: {_fmt(value)}")
        for key, value in data.items():
            if not isinstance(value, (Mapping, list)):
                lines.append(f"- data/{key}: {_md_cell(value)}")
        lines.append("")
        metrics = []
        if arm_report:
            for split in ("val", "test", "zero_shot", "probe", "retained"):
                metrics += _flat_numbers(arm_report.get(split, {}), split)
        elif isinstance(report.get("arms"), Mapping):
            for arm_name, arm_value in report["arms"].items():
                if isinstance(arm_value, Mapping):
                    metrics += _flat_numbers(arm_value.get("test", {}), f"{arm_name}/test")
        else:
            metrics = _flat_numbers(report.get("metrics", report))
        if metrics:
            lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
            lines += [f"| {_md_cell(k)} | {_fmt(v)} |" for k, v in metrics[:200]]
            lines.append("")
    else:
        lines += ["No training report was given: these are the weights as saved.", ""]

    lines += ["## Licence", ""]
    lines.append(f"- this model card's code licence (the {name} card): {zcard.license if zcard is not None else 'unknown'}")
    if loaded_from or start is not None:
        src = loaded_from or start.url
        lines.append(f"- started from {src}" + (f", weights licensed {start_license}" if start_license else "")
                     + "; the licence of the weights it started from applies to this derivative")
    lines.append("")
    return "\n".join(lines)


_HUB_LICENSES = {"apache-2.0", "mit", "cc-by-4.0", "cc-by-nc-4.0", "cc-by-sa-4.0", "cc-by-nc-sa-4.0", "bsd-3-clause",
                 "gpl-3.0", "cc0-1.0", "openrail", "other", "unknown"}


def _hub_license(text: str | None) -> str:
    """The Hub's licence identifier (lower-case SPDX-like), ``other`` for anything it does not know."""
    value = (text or "unknown").strip().lower()
    return value if value in _HUB_LICENSES else "other"


def write_model_card(directory: str | os.PathLike, model: nn.Module, report: Mapping[str, Any] | None = None, *,
                     arm: str | None = None, **kwargs: Any) -> Path:
    """Write ``directory/README.md`` (atomically): the model card of :func:`model_card_text`."""
    path = Path(directory) / MODEL_CARD_NAME
    atomic_write_text(path, model_card_text(model, report, arm=arm, **kwargs))
    return path
