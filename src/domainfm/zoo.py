"""The model registry: one list of every model variant, with its model card.

A family registers a small builder per variant::

    @register_model(
        "cbramod-base", family="cbramod", paper="...", license="MIT",
        input_spec={"n_chans": 19, "sfreq": 200.0, "patch_size": 200},
        weights=[WeightSource("hf://weighting666/CBraMod/pretrained_weights.pth", sha256="...",
                              converter="official")],
        converters={"official": convert_official_state_dict},
        head="head",
    )
    def cbramod_base(**kwargs):
        return CBraMod(**kwargs)

``create_model(name, pretrained=..., **kwargs)`` calls the builder with the card's ``defaults``
updated by the caller's keywords, then hands the model to :mod:`domainfm.hub` for weights.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "WeightSource",
    "ModelCard",
    "register_model",
    "unregister_model",
    "list_models",
    "list_families",
    "get_card",
    "UnknownModelError",
    "manifests",
    "write_manifests",
    "family_module_of",
    "model_info",
    "build_model",
    "split_tag",
    "weight_source",
]


@dataclass(frozen=True)
class WeightSource:
    """Where one set of weights for a variant lives.

    Args:
        url: ``"hf://org/repo/path/in/repo"`` (one file), ``"hf://org/repo"`` (a whole repository:
            ``config.json`` + ``model.safetensors``), ``"timm://<model>.<tag>"`` (timm's own
            pretrained config says which Hub repository and file), ``"https://..."`` or ``"file://..."``.
        sha256: full hex sha256 of the file, verified after every download and load. ``None``
            where no digest could be confirmed: an ``hf://``/``timm://`` file is then verified
            against the sha256 the Hub publishes for it (at ``revision``) and the digest seen on
            first download is recorded in ``$DOMAINFM_HOME/weights.lock.json`` and enforced after.
        converter: key of the card's ``converters`` that turns this file's state_dict into our
            keys (``None``: the file already holds our keys).
        license: licence of the weights (may differ from the code's).
        description: what was trained on what.
        state_dict_key: key under which a checkpoint dict nests its state_dict (e.g. ``"model"``);
            ``None`` means the file is the state_dict itself (the converter may still unwrap).
        revision: the Hub revision (commit, tag or branch) the source is pinned to; ``None``: ``main``.
        note: what could not be confirmed about this source (shown by ``domainfm info``).
        tag: the pretrained tag (timm's ``<model>.<tag>``): ``create_model("<model>.<tag>",
            pretrained=True)`` loads this source; ``list_models(pretrained=True)`` lists it so.
            ``package://<module>/<path>`` sources are files shipped inside an installed package.
        card: a model card shipped beside a ``package://`` file (``package://<module>/<path>.md``):
            what was trained on what, for how long, and its held-out figures.
        pretraining_data: what these weights saw before any fine-tuning (the corpora, and the
            splits where only some were used); ``""``: not recorded. Shown by ``domainfm info``
            and written into every model card saved from a model that started from them.
        overlaps: the public benchmarks whose data ``pretraining_data`` contains, by the names
            their papers use (``("TUAB", "TUEV")``): a result on one of them is not a held-out
            result for these weights. ``()`` with ``pretraining_data`` set: none known.
        model_kwargs: keywords the variant is built with when these weights are loaded by
            ``pretrained=True`` (or their tag), beneath the caller's own: a setting that is not a
            weight but belongs to the checkpoint (an inference option it was measured best with), as
            a ``save_pretrained`` folder records it in its config. ``{}``: the card's defaults.
    """

    url: str
    sha256: str | None = None
    converter: str | None = None
    license: str = "unknown"
    description: str = ""
    state_dict_key: str | None = None
    revision: str | None = None
    note: str = ""
    tag: str | None = None
    card: str | None = None
    pretraining_data: str = ""
    overlaps: tuple[str, ...] = ()
    model_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if not isinstance(self.model_kwargs, Mapping) or not all(isinstance(k, str) for k in self.model_kwargs):
            raise ValueError(f"WeightSource({self.url!r}): model_kwargs must map keyword names to values, "
                             f"got {self.model_kwargs!r}")
        if not isinstance(self.pretraining_data, str):
            raise ValueError(f"WeightSource({self.url!r}): pretraining_data must be a string (what the weights "
                             f"saw), got {type(self.pretraining_data).__name__}")
        overlaps = () if isinstance(self.overlaps, str) else tuple(self.overlaps)
        if isinstance(self.overlaps, str) or not all(isinstance(o, str) and o.strip() for o in overlaps):
            raise ValueError(f"WeightSource({self.url!r}): overlaps must be a sequence of benchmark names such as "
                             f"('TUAB', 'TUEV'), got {self.overlaps!r}")
        # a list read back from a manifest compares equal to the registered tuple
        object.__setattr__(self, "overlaps", tuple(o.strip() for o in overlaps))
        if self.overlaps and not self.pretraining_data:
            raise ValueError(f"WeightSource({self.url!r}): overlaps {self.overlaps} need the pretraining_data "
                             "that contains them")
        if self.tag is not None and (not self.tag or "." in self.tag or "/" in self.tag or self.tag != self.tag.strip()):
            raise ValueError(f"WeightSource({self.url!r}): tag {self.tag!r} must be a non-empty word without '.' or '/'")
        if self.sha256 is None:
            if not self.url.startswith(("hf://", "timm://")):
                raise ValueError(f"WeightSource({self.url!r}): a non-Hub source needs a pinned sha256 (64 hex digits)")
            return
        digest = str(self.sha256).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"WeightSource({self.url!r}): sha256 must be 64 hex digits, got {self.sha256!r}")
        object.__setattr__(self, "sha256", digest)

    @property
    def filename(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def pinned(self) -> str:
        """How this source is verified: ``"sha256"``, ``"revision"`` (the Hub's digest at a
        pinned revision, then the lock file) or ``"lock"`` (the Hub's digest, then the lock file)."""
        return "sha256" if self.sha256 else ("revision" if self.revision else "lock")


@dataclass
class ModelCard:
    """Everything the zoo knows about one variant, independent of any instance."""

    name: str
    family: str
    builder: Callable[..., nn.Module]
    paper: str = ""
    license: str = "Apache-2.0"
    description: str = ""
    input_spec: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    weights: tuple[WeightSource, ...] = ()
    converters: dict[str, Callable[[dict[str, torch.Tensor], nn.Module], dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )
    head: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    example_input: Callable[[], tuple] | None = None

    @property
    def has_pretrained(self) -> bool:
        return bool(self.weights)

    @property
    def domain(self) -> str | None:
        """The scientific domain (``input_spec["domain"]``, else the family's usual one)."""
        return self.input_spec.get("domain") or manifests().get(self.family, {}).get("domain")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view of the card (what ``domainfm info`` prints)."""
        return {
            "name": self.name,
            "family": self.family,
            "paper": self.paper,
            "license": self.license,
            "description": self.description,
            "input_spec": dict(self.input_spec),
            "defaults": dict(self.defaults),
            "head": list(self.head),
            "tags": list(self.tags),
            # model_kwargs only where a source has some (manifests written before it existed stay current)
            "weights": [{k: v for k, v in dataclasses.asdict(w).items() if k != "model_kwargs" or v}
                        for w in self.weights],
        }


_REGISTRY: dict[str, ModelCard] = {}

MANIFEST = "manifest.json"


@functools.lru_cache(maxsize=1)
def manifests() -> dict[str, dict[str, Any]]:
    """Each family's manifest (``models/<family>/manifest.json``), read without importing the
    family: its ``domain``, the fnmatch ``name_patterns`` of the names it registers, and its
    ``models`` (every registered name's card as :meth:`ModelCard.to_dict` gives it, with
    ``num_params``). ``domainfm list`` and ``domainfm info`` answer from these at once (importing a
    family costs seconds: explora imports timm, git torch_geometric and transformers);
    ``python -m domainfm.zoo`` rewrites them, and ``tests/test_zoo_lazy.py`` fails when one is stale."""
    import json
    from pathlib import Path

    import domainfm.models

    out = {}
    for root in domainfm.models.__path__:
        for path in sorted(Path(root).glob(f"*/{MANIFEST}")):
            data = json.loads(path.read_text())
            out[data["family"]] = data
    return out


def family_module_of(name: str) -> str | None:
    """The module that registers ``name`` according to the families' manifests (None: none matches)."""
    for family, manifest in manifests().items():
        if name in manifest.get("models", {}) or any(fnmatch.fnmatchcase(name, p) for p in manifest["name_patterns"]):
            return f"domainfm.models.{family}"
    return None


def _manifest_card(name: str) -> dict[str, Any] | None:
    for manifest in manifests().values():
        if name in manifest.get("models", {}):
            return manifest["models"][name]
    return None


def write_manifests(families: Sequence[str] | None = None) -> list[str]:
    """Rewrite the ``models`` of each family's manifest from its live registry (the family is
    imported); ``domain`` and ``name_patterns`` are kept as written. Returns the paths written."""
    import json
    from pathlib import Path

    import domainfm.models
    from domainfm.atomic import atomic_write_text

    _ensure_families_imported()
    written = []
    for root in domainfm.models.__path__:
        for path in sorted(Path(root).glob(f"*/{MANIFEST}")):
            data = json.loads(path.read_text())
            if families is not None and data["family"] not in families:
                continue
            names = sorted(n for n, c in _REGISTRY.items() if c.family == data["family"]
                           and str(getattr(c.builder, "__module__", "")).startswith("domainfm.models."))
            data["models"] = {n: _live_info(n) for n in names}
            atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
            written.append(str(path))
    manifests.cache_clear()
    return written


def _ensure_families_imported() -> None:
    # Imported lazily: the families import this module to register themselves.
    from domainfm.models import import_families

    import_families()


def _ensure_name_imported(name: str) -> None:
    """Make ``name`` registered if any family registers it, importing as little as possible:
    nothing when it already is, else its family (by the manifests), else every family."""
    if name in _REGISTRY:
        return
    # "<model>.<tag>": the model's family registers it
    base = name.rsplit(".", 1)[0] if isinstance(name, str) else name
    if base in _REGISTRY:
        return
    module = family_module_of(name) if isinstance(name, str) else None
    if module is not None:
        importlib.import_module(module)
        if name in _REGISTRY or base in _REGISTRY:
            return
    _ensure_families_imported()


def register_model(
    name: str,
    *,
    family: str,
    paper: str = "",
    license: str = "Apache-2.0",
    description: str = "",
    input_spec: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    weights: Sequence[WeightSource] = (),
    converters: Mapping[str, Callable] | None = None,
    head: str | Sequence[str] = (),
    tags: Sequence[str] = (),
    example_input: Callable[[], tuple] | None = None,
    overwrite: bool = False,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a builder ``fn(**kwargs) -> nn.Module`` as variant ``name``.

    ``defaults`` are the variant's keyword arguments; the caller's keywords override them.
    ``head`` names the classifier module(s): their weights are dropped from a pretrained
    checkpoint when their shape no longer fits (e.g. another ``n_outputs``).
    ``example_input`` returns positional inputs for ``model.forward`` of the variant built with
    its defaults; the test parametrized over every registered model runs it for the small
    variants (tag ``"test"``).
    """
    if not name or name != name.strip() or "/" in name:
        raise ValueError(f"register_model: invalid model name {name!r}")
    converters = dict(converters or {})
    for w in weights:
        if w.converter is not None and w.converter not in converters:
            raise ValueError(
                f"register_model({name!r}): weight source {w.url!r} names converter {w.converter!r}, "
                f"but the card's converters are {sorted(converters)}"
            )

    def decorator(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"register_model: a model named {name!r} is already registered")
        _REGISTRY[name] = ModelCard(
            name=name,
            family=family,
            builder=builder,
            paper=paper,
            license=license,
            description=description or (builder.__doc__ or "").strip().split("\n")[0],
            input_spec=dict(input_spec or {}),
            defaults=dict(defaults or {}),
            weights=tuple(weights),
            converters=converters,
            head=(head,) if isinstance(head, str) else tuple(head),
            tags=tuple(tags),
            example_input=example_input,
        )
        return builder

    return decorator


def unregister_model(name: str) -> None:
    """Remove a variant (for tests and plugins that register temporary models)."""
    _REGISTRY.pop(name, None)


class UnknownModelError(KeyError):
    """No registered model has this name (a ``KeyError`` whose ``str`` is the message itself)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def get_card(name: str) -> ModelCard:
    """The card of ``name`` (or of ``<model>.<tag>``'s model); imports only the family that registers
    it (see :func:`manifests`)."""
    _ensure_name_imported(name)
    if isinstance(name, str) and name not in _REGISTRY and "." in name:
        name = split_tag(name)[0]
    try:
        return _REGISTRY[name]
    except KeyError:
        close = [n for n in _REGISTRY if name.split("-")[0] in n][:8]
        hint = f" Similar names: {', '.join(close)}." if close else ""
        raise UnknownModelError(
            f"Unknown model {name!r}. `domainfm.list_models()` lists the {len(_REGISTRY)} registered models.{hint}"
        ) from None


def _card_views() -> dict[str, dict[str, Any]]:
    """Every known name -> its card as a dict: the manifests', overridden by the live registry
    (models registered at run time, and families already imported)."""
    views = {n: c for m in manifests().values() for n, c in m.get("models", {}).items()}
    views.update({n: c.to_dict() for n, c in _REGISTRY.items()})
    return views


def card_view(name: str) -> dict[str, Any]:
    """The card of ``name`` (or ``<model>.<tag>``'s model) as a dict, from the manifests when its
    family is not imported (nothing is imported then)."""
    if name not in _REGISTRY:
        base = name.rsplit(".", 1)[0] if "." in name and name not in _card_views() else name
        view = _manifest_card(base)
        if view is not None:
            if base != name and not any(w.get("tag") == name.rsplit(".", 1)[1] for w in view["weights"]):
                split_tag(name)  # raises the unknown-tag error, naming the tags
            return view
    return get_card(name).to_dict()


def list_models(pattern: str | Sequence[str] = "*", pretrained: bool = False, family: str | None = None) -> list[str]:
    """Registered model names matching ``pattern`` (fnmatch, or a list of patterns), sorted;
    answered from the families' manifests, importing no family.

    ``pretrained=True`` keeps only variants with at least one weight source and lists them as
    timm does: ``<model>.<tag>`` for each tagged source (``create_model`` takes that name), the
    bare ``<model>`` for an untagged one.
    """
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    names = []
    for name, card in _card_views().items():
        if family is not None and card["family"] != family:
            continue
        candidates = [name]
        if pretrained:
            candidates = [f"{name}.{w['tag']}" if w.get("tag") else name for w in card["weights"]]
        for candidate in dict.fromkeys(candidates):
            if any(fnmatch.fnmatchcase(candidate, p) or fnmatch.fnmatchcase(name, p) for p in patterns):
                names.append(candidate)
    return sorted(names)


def split_tag(name: str) -> tuple[str, str | None]:
    """``"<model>.<tag>"`` -> ``("<model>", "<tag>")`` when ``<model>`` is registered and one of
    its weight sources carries ``<tag>``; a registered name -> ``(name, None)``. Raises
    :class:`UnknownModelError` for an unknown tag of a known model, naming the tags it has."""
    _ensure_name_imported(name)
    if name in _REGISTRY or "." not in name:
        return name, None
    base, tag = name.rsplit(".", 1)  # _ensure_name_imported(name) has imported base's family
    card = _REGISTRY.get(base)
    if card is None:
        return name, None
    tags = [w.tag for w in card.weights if w.tag]
    if tag not in tags:
        raise UnknownModelError(f"{base!r} has no pretrained tag {tag!r}; its tags: {tags or 'none'} "
                                f"(`domainfm list {base}* --pretrained`)")
    return base, tag


def weight_source(name: str) -> WeightSource | None:
    """The weight source ``name`` selects: ``<model>.<tag>`` its tagged source, a bare model name
    its first source (None when it has none)."""
    base, tag = split_tag(name)
    card = get_card(base)
    if tag is None:
        return card.weights[0] if card.weights else None
    return next(w for w in card.weights if w.tag == tag)


def list_families() -> list[str]:
    return sorted(set(manifests()) | {card.family for card in _REGISTRY.values()})


def build_model(name: str, **kwargs) -> nn.Module:
    """Instantiate variant ``name`` with random weights: card defaults updated by ``kwargs``.

    The returned model remembers how it was made (``model.domainfm_name`` and
    ``model.domainfm_kwargs``) so that :func:`domainfm.save_pretrained` can write a config that
    rebuilds it.
    """
    card = get_card(name)
    merged = {**card.defaults, **kwargs}
    model = card.builder(**merged)
    if not isinstance(model, nn.Module):
        raise TypeError(f"builder of {name!r} returned {type(model).__name__}, not an nn.Module")
    model.domainfm_name = card.name
    model.domainfm_kwargs = merged
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


#: in-place initialisers (and the arithmetic some initialisers use) that a model built on the meta
#: device may skip: they leave shapes as they are and compute nothing there
_META_INIT_OPS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "copy_", "bernoulli_", "exponential_",
    "random_", "cauchy_", "log_normal_", "geometric_", "erfinv_", "mul_", "add_", "sub_", "div_", "clamp_",
})


class _SkipInitOnMeta(torch.overrides.TorchFunctionMode):
    """Skips :data:`_META_INIT_OPS` on meta tensors: they compute nothing there, but their Python
    decompositions import ``torch._dynamo`` on first use (about 1.5 s of a ``domainfm info``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__name__", None) in _META_INIT_OPS and args and isinstance(args[0], torch.Tensor)
                and args[0].is_meta):
            return args[0]
        return func(*args, **(kwargs or {}))


def _live_info(name: str, count_params: bool = True) -> dict[str, Any]:
    card = get_card(name)
    info = card.to_dict()
    if count_params:
        with torch.device("meta"), _SkipInitOnMeta():
            model = build_model(name)
        info["num_params"] = count_parameters(model)
    return info


def model_info(name: str, count_params: bool = True) -> dict[str, Any]:
    """The model card of ``name`` as a dict with ``num_params``: from its family's manifest when
    the family is not imported (nothing imported), else counted on the meta device (no memory)."""
    if name not in _REGISTRY:
        base = name.rsplit(".", 1)[0] if "." in name and _manifest_card(name) is None else name
        if base not in _REGISTRY and _manifest_card(base) is not None:
            info = dict(card_view(name))
            if not count_params:
                info.pop("num_params", None)
            return info
    return _live_info(name, count_params)


if __name__ == "__main__":  # python -m domainfm.zoo: rewrite the families' manifests
    from domainfm import zoo as _registered  # the module the families register into (not __main__)

    for written in _registered.write_manifests():
        print(written)
