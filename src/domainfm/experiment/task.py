"""The one structure a family's data function returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch.utils.data import Dataset

__all__ = ["TaskData"]


@dataclass
class TaskData:
    """Datasets and what they mean.

    Args:
        train, val, test: datasets yielding what the recipe's step expects (``(x, y)`` for the
            shared supervised recipe); ``val`` selects the best checkpoint; ``test`` is optional.
        task: ``multiclass`` | ``binary`` | ``regression`` for the shared recipe, or a family's
            own task name (``forecast``, ``imputation``, ...) with its own recipe.
        n_outputs: head width (``None`` when the task has no head).
        collate_fn / eval_collate_fn: batch builders (``eval_collate_fn`` defaults to ``collate_fn``).
        forward_fn: ``fn(model, x) -> output`` for the shared recipe (default ``model(x)``).
        labels: ``"recorded"`` or ``"constructed: <how>"`` / ``"synthetic: <how>"``: printed in
            the report, so that nobody mistakes constructed labels for ground truth.
        info: free-form facts about the data (source, sizes, classes) copied into the report.
    """

    train: Dataset | None
    val: Dataset | None
    test: Dataset | None = None
    task: str = "multiclass"
    n_outputs: int | None = None
    collate_fn: Callable | None = None
    eval_collate_fn: Callable | None = None
    forward_fn: Callable | None = None
    labels: str = "recorded"
    info: dict[str, Any] = field(default_factory=dict)
    #: family objects the protocols need (e.g. a graph dataset), never written to the report
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not (self.labels == "recorded" or self.labels.split(":", 1)[0] in {"constructed", "synthetic", "recorded"}):
            raise ValueError(f"TaskData.labels={self.labels!r}: expected 'recorded', 'constructed: ...' or 'synthetic: ...'")
