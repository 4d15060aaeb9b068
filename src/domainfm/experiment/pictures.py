"""Pictures of a fine-tuning run, written into the run folder and listed in ``report.json``
(``arms[ARM]["pictures"]`` and ``report["pictures"]``: ``{name: path relative to the run folder}``).

A protocol may return ``{"pictures": {name: path}}``; :class:`~domainfm.experiment.family.Family`
merges those with :func:`arm_pictures`'s.

Work in progress (issue 11, item 5): learning curves, confusion matrix, ROC curve.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

__all__ = ["arm_pictures", "run_pictures"]


def arm_pictures(ctx) -> dict[str, Any]:
    """The pictures every arm gets (after adaptation, on its selected model)."""
    return {}


def run_pictures(report: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run's pictures (across arms); returns ``{"pictures": {...}}`` to merge into the report."""
    return {}
