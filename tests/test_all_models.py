"""One test module parametrized over every registered model (the registry is the one list).

Every card is checked; the small variants (tag "test") are also built, run forward and backward,
and round-tripped through save_pretrained/create_model.
"""
import math

import pytest
import torch

import domainfm
from domainfm import zoo

ALL = domainfm.list_models()
SMALL = [n for n in ALL if "test" in zoo.get_card(n).tags]


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
