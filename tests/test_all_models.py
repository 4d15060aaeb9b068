"""One test module parametrized over every registered model (the registry is the one list).

Every card is checked, and every model's surface (``forward_features``, ``forward_head`` with
and without ``pre_logits``, ``reset_classifier``, ``num_features``, the card's ``head``) is
checked on the meta device. Every model whose card declares an ``example_input`` runs it through
that surface: on the CPU, with values compared, for the test variants and those up to
``CPU_MAX_PARAMS``; on the meta device (shapes only, no memory, no compute) for the larger ones.
The small variants (tag "test") are also run forward and backward and round-tripped through
save_pretrained/create_model.
"""
import inspect
import math

import pytest
import torch
from torch import nn

import domainfm
from domainfm import zoo
from domainfm.hub.loading import _is_head_key

ALL = domainfm.list_models()
SMALL = [n for n in ALL if "test" in zoo.get_card(n).tags]
WITH_EXAMPLE = [n for n in ALL if zoo.get_card(n).example_input is not None]
#: above this a non-test variant runs its example on the meta device: building and running a
#: 20-700M-parameter model on a shared 2-core CI machine costs seconds to minutes each, and its
#: class already runs on the CPU in the family's test variant
CPU_MAX_PARAMS = 5_000_000
#: above this even the meta-device forward is skipped (2-10 s each for the 200-700M T5s); their
#: surface without a forward is still checked by test_model_surface_on_meta
META_MAX_PARAMS = 100_000_000


def test_registry_is_not_empty_and_every_family_has_a_test_variant():
    families = domainfm.list_families()
    assert ALL, "no model registered"
    for family in families:
        assert any(zoo.get_card(n).family == family for n in SMALL), f"family {family} has no 'test'-tagged variant"


@pytest.mark.parametrize("name", ALL)
def test_model_card(name):
    info = domainfm.model_info(name)
    assert info["name"] == name and info["family"]
    assert info["paper"], f"{name}: model card names no paper"
    assert info["license"], f"{name}: model card names no licence"
    assert info["input_spec"], f"{name}: model card has no input spec"
    assert info["num_params"] > 0
    card = zoo.get_card(name)
    for source in card.weights:
        if source.sha256 is None:  # only Hub sources may go unpinned: verified against the Hub's digest + lock
            assert source.url.startswith(("hf://", "timm://")) and source.note, f"{name}: {source.url} unpinned, no note"
        else:
            assert len(source.sha256) == 64
        assert source.converter is None or source.converter in card.converters
    if "test" in card.tags:
        assert card.example_input is not None, f"{name}: test variant without example_input"


def _outputs(model, inputs):
    out = model(*inputs)
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


@pytest.mark.parametrize("name", SMALL)
def test_small_model_forward_backward_and_roundtrip(name, tmp_path):
    card = zoo.get_card(name)
    torch.manual_seed(0)
    model = domainfm.create_model(name)
    inputs = card.example_input()
    model.train()
    out = _outputs(model, inputs)
    assert torch.is_tensor(out) and out.is_floating_point()
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads), f"{name}: no gradient reached the parameters"
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == domainfm.model_info(name)["num_params"]

    model.eval()
    with torch.no_grad():
        first = _outputs(model, inputs)
        again = _outputs(model, inputs)
    assert torch.equal(first, again), f"{name}: eval forward is not deterministic"
    domainfm.save_pretrained(model, tmp_path / name)
    reloaded = domainfm.create_model(tmp_path / name).eval()
    with torch.no_grad():
        assert torch.equal(_outputs(reloaded, inputs), first)
    assert math.isfinite(float(first.float().abs().max()))


# --------------------------------------------------------------------------- the model surface


def _resolve(model: nn.Module, path: str):
    """The attribute ``path`` (dotted) of ``model``; AssertionError naming it if it does not exist."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    assert hasattr(parent, leaf), f"card.head names {path!r}, which {type(model).__name__} does not have"
    return getattr(parent, leaf)


def _check_heads(model: nn.Module, card: zoo.ModelCard, *, after_reset: bool) -> None:
    assert card.head, f"{card.name}: the card names no head module (card.head is empty)"
    for path in card.head:
        head = _resolve(model, path)
        # before reset_classifier a head may be absent (None): a tied LM head, a backbone built
        # without a classifier; after it, every named head is a real module
        allowed = (nn.Module,) if after_reset else (nn.Module, type(None))
        assert isinstance(head, allowed), f"{card.name}: card.head {path!r} is a {type(head).__name__}"


def _check_reset_touches_only_the_head(card, before: dict, after: dict, *, values: bool) -> None:
    """reset_classifier may change, add or remove only keys under card.head (the keys the hub drops
    when their shape changed); everything else keeps its shape (and, on the CPU, its values)."""
    changed = {k for k in set(before) | set(after)
               if k not in before or k not in after or before[k].shape != after[k].shape}
    stray = sorted(k for k in changed if not _is_head_key(k, card.head))
    assert not stray, f"{card.name}: reset_classifier changed keys outside card.head {card.head}: {stray[:5]}"
    assert any(_is_head_key(k, card.head) for k in after), f"{card.name}: after reset_classifier no key under {card.head}"
    if values:
        for key in before.keys() & after.keys():
            if not _is_head_key(key, card.head):
                assert torch.equal(before[key], after[key]), f"{card.name}: reset_classifier changed {key}"


def _n_params(name: str) -> int:
    return domainfm.model_info(name)["num_params"]


def _on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return zoo.build_model(name)


@pytest.mark.parametrize("name", ALL)
def test_model_surface_on_meta(name):
    """Every registered model (with or without an example input): the surface exists, card.head
    names real modules and reset_classifier replaces exactly those."""
    card = zoo.get_card(name)
    model = _on_meta(name)
    for method in ("forward_features", "forward_head", "reset_classifier"):
        assert callable(getattr(model, method, None)), f"{name}: {type(model).__name__} has no {method}()"
    assert isinstance(model.num_features, int) and model.num_features > 0, f"{name}: num_features {model.num_features!r}"
    _check_heads(model, card, after_reset=False)
    before = {k: v for k, v in model.state_dict().items()}
    with torch.device("meta"):
        model.reset_classifier(5)
    _check_heads(model, card, after_reset=True)
    _check_reset_touches_only_the_head(card, before, model.state_dict(), values=False)


def _first_tensor(out):
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _feature_inputs(model: nn.Module, inputs: tuple) -> tuple:
    """The leading example inputs that forward_features takes: forward may take trailing task
    inputs (query times, the tasks to predict) that only the head side uses."""
    params = [p for p in inspect.signature(model.forward_features).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(inputs[: len(params)])


@pytest.mark.parametrize("name", WITH_EXAMPLE)
def test_model_surface_runs_the_example_input(name):
    card = zoo.get_card(name)
    n_params = _n_params(name)
    on_cpu = "test" in card.tags or n_params <= CPU_MAX_PARAMS
    if not on_cpu and n_params > META_MAX_PARAMS:
        pytest.skip(f"{name}: {n_params / 1e6:.0f}M parameters, forward not run (several seconds even on the meta "
                    "device); its surface is checked without a forward in test_model_surface_on_meta, and its "
                    "class runs this forward in the family's test variant")
    device = torch.device("cpu") if on_cpu else torch.device("meta")
    torch.manual_seed(0)
    model = (domainfm.create_model(name) if on_cpu else _on_meta(name)).eval()
    inputs = tuple(x.to(device) if torch.is_tensor(x) else x for x in card.example_input())

    with torch.no_grad():
        out = model(*inputs)  # the card's example_input runs as given
        features = model.forward_features(*_feature_inputs(model, inputs))
        pre = model.forward_head(features, pre_logits=True)
        logits = model.forward_head(features, pre_logits=False)
    first = _first_tensor(out)
    assert torch.is_tensor(first) and first.is_floating_point(), f"{name}: forward returned {type(out).__name__}"
    if on_cpu:
        assert torch.isfinite(first).all() and torch.isfinite(features).all() and torch.isfinite(logits).all()
    assert pre.shape[-1] == model.num_features, (
        f"{name}: forward_head(pre_logits=True) is {pre.shape[-1]} wide, num_features is {model.num_features}")
    _check_heads(model, card, after_reset=False)

    n_outputs = logits.shape[-1] + 3  # differs from the current width, so the change shows
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with device:
        model.reset_classifier(n_outputs)
    model.eval()
    _check_heads(model, card, after_reset=True)
    _check_reset_touches_only_the_head(card, before, model.state_dict(), values=on_cpu)
    with torch.no_grad():
        out_new = model(*inputs)
        # on the meta device the body's output is only a shape: reuse it rather than run it again
        features_new = model.forward_features(*_feature_inputs(model, inputs)) if on_cpu else features
        pre_new = model.forward_head(features_new, pre_logits=True)
        logits_new = model.forward_head(features_new)
    assert logits_new.shape == (*logits.shape[:-1], n_outputs), f"{name}: reset_classifier({n_outputs}) gave {tuple(logits_new.shape)}"
    assert pre_new.shape == pre.shape and pre_new.shape[-1] == model.num_features
    if torch.is_tensor(out):  # a forward through the head follows it (a dict is a task output, e.g. imputation)
        assert out_new.shape == (*out.shape[:-1], n_outputs), f"{name}: forward is {tuple(out_new.shape)} after reset_classifier({n_outputs})"
    if on_cpu:
        # the body is untouched (pre-logits may change: a head can own its pre-logits MLP, as CBraMod's)
        assert torch.equal(features_new, features)
        assert torch.equal(logits_new, model.forward_head(features))  # the new head is what forward_head runs
