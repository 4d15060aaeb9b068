"""What ``domainfm predict|embed FAMILY --model M`` loads: ``M`` is a registered model name (with
its card's weights, or ``--pretrained SRC``), a folder written by ``save_pretrained``, or a run
folder (``runs/<family>/<name>``, whose arm ``--arm`` — default the first arm in its report —
holds ``<arm>/model``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["run_root", "resolve_model_dir", "run_config", "run_report", "positive_int",
           "positive_float", "unit_interval", "quantile_levels"]


def _number(text: str, cast: type, noun: str):
    """``cast(text)``, or argparse's error naming the text and what was expected."""
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 and negatives are refused, never read as 'the default')."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text, float, "a number")
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value}: must be a finite number > 0")
    return value


def unit_interval(text: str) -> float:
    """argparse type: a fraction in [0, 1) (an overlap of 1 would never advance)."""
    value = _number(text, float, "a number")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value}: must lie in [0, 1)")
    return value


def quantile_levels(text: str) -> list[float]:
    """argparse type: comma-separated quantile levels, each strictly between 0 and 1."""
    levels = []
    for part in (p.strip() for p in text.split(",")):
        level = _number(part, float, "a number (expected levels like 0.1,0.5,0.9)")
        if not 0.0 < level < 1.0:
            raise argparse.ArgumentTypeError(f"{level}: a quantile level must lie strictly between 0 and 1")
        levels.append(level)
    if not levels:
        raise argparse.ArgumentTypeError("no quantile levels given")
    return levels


def resolve_model_dir(model: str | Path, arm: str | None = None) -> Path | None:
    """The save_pretrained folder ``model`` names (a run folder resolves to ``<arm>/model``), or
    None when ``model`` is not a folder."""
    path = Path(model)
    if not path.is_dir():
        return None
    if (path / "report.json").is_file() and not (path / "config.json").is_file():
        from domainfm.experiment.run_folder import RunFolder, RunFolderError

        folder = RunFolder(path)
        report = folder.read_report()
        arms = list(report.get("arms", {}))
        if arm is None:
            candidates = [a for a in arms if folder.model_dir(a).is_dir()]
            if not candidates:
                if report.get("saved_model") and Path(report["saved_model"]).is_dir():
                    return Path(report["saved_model"])  # a pretraining run
                raise RunFolderError(f"{path}: the run folder holds no saved model (arms: {arms or 'none'})")
            arm = candidates[0]
        elif arm not in arms:
            raise RunFolderError(f"{path}: no arm {arm!r} in this run (arms: {', '.join(arms)})")
        model_dir = folder.model_dir(arm)
        if not model_dir.is_dir():
            raise RunFolderError(f"{model_dir}: arm {arm!r} saved no model")
        return model_dir
    return path


def run_root(model: str | Path) -> Path | None:
    """The run folder ``model`` is or lies in (:meth:`RunFolder.of`)."""
    from domainfm.experiment.run_folder import RunFolder

    folder = RunFolder.of(Path(str(model)))
    return None if folder is None else folder.path


def run_config(model: str | Path, config_cls: type) -> Any | None:
    """The config a run was trained with, when ``model`` is a run folder (or a model folder
    inside one), parsed into ``config_cls``; None otherwise. Predict/embed reuse its data
    settings (windowing, channels, normalisation, sub-slicing) so that inputs are prepared as in
    training."""
    root = run_root(model)
    if root is None:
        return None
    from domainfm import config as cfgmod

    return cfgmod.from_dict(config_cls, cfgmod.load_yaml(root / "config.yaml"))


def run_report(model: str | Path) -> dict[str, Any] | None:
    """The run's ``report.json`` (e.g. its class names) when ``model`` is, or is inside, a run folder."""
    root = run_root(model)
    if root is None:
        return None
    import json

    return json.loads((root / "report.json").read_text())
