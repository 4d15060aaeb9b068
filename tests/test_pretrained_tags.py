"""Pretrained tags (timm's ``<model>.<tag>``) and ``package://`` weight sources shipped in a package."""
from __future__ import annotations

import sys

import pytest
import torch

import domainfm
from domainfm import hub, zoo
from domainfm.zoo import WeightSource


def _saved_file(tiny_zoo, tmp_path, name="dfmtest-small", seed=1):
    """A domainfm safetensors file of ``name`` with seeded weights; returns (path, state_dict)."""
    torch.manual_seed(seed)
    model = domainfm.create_model(name)
    folder = domainfm.save_pretrained(model, tmp_path / f"saved{seed}", card=False)
    return folder / "model.safetensors", {k: v.clone() for k, v in model.state_dict().items()}


def test_tagged_source_loads_by_model_dot_tag(tiny_zoo, tmp_path):
    path_a, state_a = _saved_file(tiny_zoo, tmp_path, seed=1)
    path_b, state_b = _saved_file(tiny_zoo, tmp_path, seed=2)
    tiny_zoo.register("dfmtest-tagged", defaults={"n_chans": 3, "n_outputs": 2, "hidden": 16}, weights=[
        WeightSource(path_a.as_uri(), hub.sha256_file(path_a), tag="first"),
        WeightSource(path_b.as_uri(), hub.sha256_file(path_b), tag="second"),
    ])
    # the files were saved from dfmtest-small; this card builds the same architecture
    second = domainfm.create_model("dfmtest-tagged.second", pretrained=True)
    first = domainfm.create_model("dfmtest-tagged.first", pretrained=True)
    default = domainfm.create_model("dfmtest-tagged", pretrained=True)  # the first source
    for key in state_a:
        assert torch.equal(first.state_dict()[key], state_a[key])
        assert torch.equal(second.state_dict()[key], state_b[key])
        assert torch.equal(default.state_dict()[key], state_a[key])
    assert not all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    # the model remembers its variant, not the tag: save_pretrained / create_model(folder) rebuild it
    assert second.domainfm_name == "dfmtest-tagged"
    assert second.domainfm_load_report.sha256 == hub.sha256_file(path_b)


def test_list_models_pretrained_lists_model_dot_tag(tiny_zoo, tmp_path):
    path, _ = _saved_file(tiny_zoo, tmp_path)
    digest = hub.sha256_file(path)
    tiny_zoo.register("dfmtest-tagged", weights=[WeightSource(path.as_uri(), digest, tag="demo"),
                                                 WeightSource(path.as_uri() + "?2", digest)])
    assert domainfm.list_models("dfmtest-tagged*", pretrained=True) == ["dfmtest-tagged", "dfmtest-tagged.demo"]
    assert domainfm.list_models("dfmtest-tagged.demo", pretrained=True) == ["dfmtest-tagged.demo"]
    assert domainfm.list_models("dfmtest-tagged*") == ["dfmtest-tagged"]
    assert zoo.get_card("dfmtest-tagged.demo").name == "dfmtest-tagged"
    assert zoo.weight_source("dfmtest-tagged.demo").tag == "demo"


def test_unknown_tag_names_the_tags_there_are(tiny_zoo, tmp_path):
    path, _ = _saved_file(tiny_zoo, tmp_path)
    tiny_zoo.register("dfmtest-tagged", weights=[WeightSource(path.as_uri(), hub.sha256_file(path), tag="demo")])
    with pytest.raises(zoo.UnknownModelError, match=r"no pretrained tag 'other'.*\['demo'\]"):
        domainfm.create_model("dfmtest-tagged.other", pretrained=True)


def test_tag_without_pretrained_is_random_init(tiny_zoo, tmp_path):
    path, state = _saved_file(tiny_zoo, tmp_path)
    tiny_zoo.register("dfmtest-tagged", defaults={"n_chans": 3, "n_outputs": 2, "hidden": 16},
                      weights=[WeightSource(path.as_uri(), hub.sha256_file(path), tag="demo")])
    torch.manual_seed(123)
    model = domainfm.create_model("dfmtest-tagged.demo")
    assert not all(torch.equal(model.state_dict()[k], state[k]) for k in state)


@pytest.mark.parametrize("tag", ["", "a.b", "a/b", " x"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(ValueError, match="tag"):
        WeightSource("https://example.org/x.safetensors", "ab" * 32, tag=tag)


@pytest.fixture
def shipped_package(tmp_path, monkeypatch):
    """A throwaway importable package ``dfmtest_weights_pkg`` with a ``weights/`` folder."""
    root = tmp_path / "site"
    package = root / "dfmtest_weights_pkg"
    (package / "weights").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root))
    yield package
    sys.modules.pop("dfmtest_weights_pkg", None)


def test_package_source_is_read_in_place_and_verified(tiny_zoo, tmp_path, shipped_package, monkeypatch):
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    monkeypatch.setenv("DOMAINFM_HOME", str(tmp_path / "home"))
    path, state = _saved_file(tiny_zoo, tmp_path)
    shipped = shipped_package / "weights" / "dfmtest-tagged.demo.safetensors"
    shipped.write_bytes(path.read_bytes())
    url = "package://dfmtest_weights_pkg/weights/dfmtest-tagged.demo.safetensors"
    tiny_zoo.register("dfmtest-tagged", defaults={"n_chans": 3, "n_outputs": 2, "hidden": 16},
                      weights=[WeightSource(url, hub.sha256_file(path), tag="demo")])
    model = domainfm.create_model("dfmtest-tagged.demo", pretrained=True)
    for key in state:
        assert torch.equal(model.state_dict()[key], state[key])
    assert hub.fetch(url, hub.sha256_file(path)) == shipped  # no copy into the cache
    assert not (tmp_path / "home").exists()
    # a changed file is refused by its pinned digest
    data = bytearray(shipped.read_bytes())
    data[-1] ^= 1
    shipped.write_bytes(bytes(data))
    with pytest.raises(hub.ChecksumError, match="does not match"):
        domainfm.create_model("dfmtest-tagged.demo", pretrained=True)


@pytest.mark.parametrize("url, message", [
    ("package://dfmtest_weights_pkg/../x.safetensors", "expected package://"),
    ("package://no_such_module_dfmtest/w.safetensors", "not installed"),
    ("package://dfmtest_weights_pkg/weights/missing.safetensors", "missing from this installation"),
])
def test_package_urls_that_cannot_resolve_say_why(shipped_package, url, message):
    with pytest.raises((hub.HubError, FileNotFoundError), match=message):
        hub.package_path(url)
