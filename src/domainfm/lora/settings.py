"""The ``lora:`` section of a fine-tune config: what :func:`domainfm.lora.apply` is given."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["LoraSettings"]

#: the options passed on only when the config sets them (None: the preset's value, else apply's default)
_OPTIONAL = ("rank", "alpha", "dropout", "variant", "use_rslora", "replora_hidden")

@dataclass
class LoraSettings:
    """The ``lora:`` section of a fine-tune config (see :func:`domainfm.lora.apply`).

    An option left out (``None``) is the preset's value when ``preset`` is set, else
    :func:`~domainfm.lora.apply`'s default (rank 8, alpha 16, dropout 0, ``lora``, no rsLoRA,
    RepLoRA hidden width 64); a value the config sets wins over the preset. ``unfreeze`` patterns
    are added to the preset's."""

    targets: list[str] = field(default_factory=list)
    rank: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    variant: str | None = None
    use_rslora: bool | None = None
    replora_hidden: int | None = None
    unfreeze: list[str] = field(default_factory=list)
    preset: str | None = None

    def apply_kwargs(self, model, *, extra_unfreeze: Sequence[str] = ()) -> dict[str, Any]:
        """Keyword arguments of :func:`~domainfm.lora.apply` for ``model``: the targets and preset,
        the options this section sets, and ``unfreeze`` = the preset's + this section's +
        ``extra_unfreeze`` (e.g. a classifier head that always trains)."""
        from domainfm.lora.presets import resolve_preset

        kwargs: dict[str, Any] = {"targets": list(self.targets) or None, "preset": self.preset}
        kwargs.update({name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None})
        preset_unfreeze = list(resolve_preset(self.preset, model)[1].get("unfreeze", ())) if self.preset else []
        kwargs["unfreeze"] = preset_unfreeze + list(self.unfreeze) + list(extra_unfreeze)
        return kwargs
