"""Weights for an experiment arm: one :class:`ModelSpec`, one :func:`resolve`, and an honest
:class:`InitInfo` saying what was loaded.

The random fallback exists for one situation only: the *card's own* weight source
(``pretrained=True``) cannot be had (offline without the file in the cache, no network, or no
source registered). A file or URL the user named, a download that fails verification, an unsafe
or mismatched checkpoint always stop the run with the hub's message.
"""
from __future__ import annotations

import sys
import urllib.error
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["ModelSpec", "InitInfo", "resolve", "init_label", "WeightsUnavailable", "FALLBACKS", "prefer_official"]

FALLBACKS = ("error", "random")


class WeightsUnavailable(RuntimeError):
    """The pretrained weights could not be had and ``fallback="error"``."""


@dataclass
class ModelSpec:
    """What to build: a registered variant ``name`` (or a ``save_pretrained`` folder), its weights
    and keyword overrides.

    ``pretrained``: ``True`` (the card's source), a path / folder / URL, or ``None``/``False``
    (random init). ``fallback``: ``"error"`` or ``"random"`` (only for the card's own source being
    unreachable). ``converter``: a converter name of the card forced for every file (e.g. to drop
    a pretraining head); by default the hub decides from what the file is.
    """

    name: str
    pretrained: bool | str | None = None
    fallback: str = "error"
    kwargs: dict[str, Any] = field(default_factory=dict)
    converter: str | None = None

    def __post_init__(self):
        if self.fallback not in FALLBACKS:
            raise ValueError(f"model.fallback={self.fallback!r}: expected one of {FALLBACKS}")
        if isinstance(self.pretrained, str) and self.pretrained.strip().lower() in {"true", "false", "none", "null", ""}:
            raise ValueError(f"model.pretrained={self.pretrained!r} is a string: write true / false / null without quotes")


@dataclass
class InitInfo:
    """Where an arm's weights came from; ``str(info)`` is the report's ``init`` line."""

    kind: str  # "pretrained" | "random"
    source: str | None = None
    sha256: str | None = None
    converter: str | None = None
    reason: str | None = None

    def __str__(self) -> str:
        if self.kind == "random":
            return "random" + (f" ({self.reason})" if self.reason else "")
        text = f"pretrained {self.source}"
        if self.sha256:
            text += f" (sha256 {self.sha256[:12]})"
        return text + (f"; {self.reason}" if self.reason else "")


def _unreachable(exc: BaseException) -> bool:
    from domainfm import hub

    return isinstance(exc, (hub.OfflineError, urllib.error.URLError, ConnectionError, TimeoutError))


def resolve(spec: ModelSpec, *, log=None) -> tuple[nn.Module, InitInfo]:
    """Build ``spec``'s model and load its weights; returns ``(model, InitInfo)``.

    Raises :class:`WeightsUnavailable` when the card's weights are unreachable and
    ``spec.fallback == "error"``; any other loading failure propagates unchanged.
    """
    from domainfm import hub, zoo

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if spec.pretrained is None or spec.pretrained is False:
        return hub.create_model(spec.name, **spec.kwargs), InitInfo("random", reason="no pretrained weights requested")
    if spec.pretrained is True:
        card = zoo.get_card(spec.name)
        if not card.weights:
            return _fallback(spec, f"{spec.name} has no registered weight source", log)
    try:
        model = hub.create_model(spec.name, pretrained=spec.pretrained, converter=spec.converter, **spec.kwargs)
    except Exception as exc:  # noqa: BLE001 - only "unreachable" errors of the card's source fall back
        if spec.pretrained is True and _unreachable(exc):
            return _fallback(spec, f"{type(exc).__name__}: {exc}", log)
        raise
    report = getattr(model, "domainfm_load_report", None)
    source = report.source if report is not None and report.source else str(spec.pretrained)
    return model, InitInfo("pretrained", source=source, sha256=getattr(report, "sha256", None),
                           converter=getattr(report, "converter", None))


def _fallback(spec: ModelSpec, reason: str, log) -> tuple[nn.Module, InitInfo]:
    from domainfm import hub

    if spec.fallback != "random":
        raise WeightsUnavailable(
            f"pretrained weights of {spec.name} unavailable: {reason}\n"
            f"  -> place the file where the message says, run `domainfm download {spec.name}` with network "
            "access, pass model.pretrained=PATH, or set model.fallback=random to train from random init "
            "(the report then says init: random)")
    log(f"[domainfm] pretrained weights of {spec.name} unavailable ({reason}); model.fallback=random: "
        "training from RANDOM initialisation (the report says init: random)")
    return hub.create_model(spec.name, **spec.kwargs), InitInfo("random", reason=f"fallback: {reason}")


def init_label(pretrained: bool | str | None, info: InitInfo) -> str:
    """A pretraining report's ``init``: ``random``, ``pretrained: <source asked for>``, or the
    fallback taken instead of it."""
    if not pretrained:
        return "random"
    return f"pretrained: {pretrained}" if info.kind == "pretrained" else str(info)



def prefer_official(preferred: str, name: str, *, converter: str | None = None, log=None) -> tuple[str, str]:
    """Which variant a run uses: ``preferred`` (a variant with official weights) when its card's
    weights load (from the cache, or downloaded and verified), else ``name`` (e.g. domainfm's own
    shipped checkpoint). Returns ``(variant, what was chosen and why)``; only an unreachable source
    (offline and not cached, no network) falls back, any other failure stops the run."""
    from domainfm import hub

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        hub.create_model(preferred, pretrained=True, converter=converter)
    except Exception as exc:  # noqa: BLE001 - only "unreachable" falls back
        if not _unreachable(exc):
            raise
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        log(f"[domainfm] official weights of {preferred} unavailable ({reason}); using {name} instead "
            "(both arms use its architecture)")
        return name, f"{name} (fallback: the official weights of {preferred} are unavailable: {reason})"
    log(f"[domainfm] using the official weights of {preferred} (model.prefer) instead of {name}")
    return preferred, f"{preferred} (official weights, model.prefer; the fallback would have been {name})"
