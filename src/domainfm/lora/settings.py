"""The ``lora:`` section of a fine-tune config: what :func:`domainfm.lora.apply` is given."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoraSettings"]


@dataclass
class LoraSettings:
    """The ``lora:`` section of a fine-tune config (see :func:`domainfm.lora.apply`)."""

    targets: list[str] = field(default_factory=list)
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    variant: str = "lora"
    use_rslora: bool = False
    unfreeze: list[str] = field(default_factory=list)
    preset: str | None = None
