"""The model registry: listing, cards, keyword overrides, registration errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import domainfm
from domainfm import zoo
from domainfm.zoo import WeightSource

SHA = "ab" * 32


def _with_weights(tiny_zoo):
    tiny_zoo.register(
        "dfmtest-pre",
        weights=[WeightSource("https://example.org/dfmtest-pre.safetensors", SHA, license="CC-BY-4.0",
                              description="pretrained on nothing")],
    )


def test_list_models_glob_patterns_and_filters(tiny_zoo):
    _with_weights(tiny_zoo)
    assert domainfm.list_models("dfmtest-*") == ["dfmtest-pre", "dfmtest-small", "dfmtest-tiny"]
    assert domainfm.list_models("dfmtest*-tiny") == ["dfmtest-tiny", "dfmtestother-tiny"]
    assert domainfm.list_models("dfmtest-t?ny") == ["dfmtest-tiny"]
    assert domainfm.list_models(["dfmtest-small", "dfmtestother-*"]) == ["dfmtest-small", "dfmtestother-tiny"]
    assert domainfm.list_models("dfmtest*", pretrained=True) == ["dfmtest-pre"]
    assert domainfm.list_models("dfmtest*", family="dfmtestother") == ["dfmtestother-tiny"]
    assert domainfm.list_models("dfmtest*", family="dfmtest", pretrained=True) == ["dfmtest-pre"]
    assert domainfm.list_models("DFMTEST-*") == []  # case-sensitive, like the names
    assert domainfm.list_models("no-such-*") == []
    everything = domainfm.list_models()
    assert everything == sorted(everything)
    assert {"dfmtest-pre", "dfmtest-small", "dfmtest-tiny", "dfmtestother-tiny"} <= set(everything)
    assert {"dfmtest", "dfmtestother"} <= set(domainfm.list_families())


def test_fixture_unregisters_its_models(tiny_zoo):
    tiny_zoo.register("dfmtest-temporary")
    assert "dfmtest-temporary" in domainfm.list_models("dfmtest*")
    tiny_zoo.restore()
    assert domainfm.list_models("dfmtest*") == []


def test_model_info_fields(tiny_zoo):
    _with_weights(tiny_zoo)
    info = domainfm.model_info("dfmtest-pre")
    assert info["name"] == "dfmtest-pre" and info["family"] == "dfmtest"
    assert info["paper"] == "https://example.org/tiny-paper"
    assert info["license"] == "MIT"
    assert info["input_spec"] == {"n_chans": 3, "sfreq": 100.0}
    assert info["defaults"] == {"n_chans": 3, "n_outputs": 2, "hidden": 8}
    assert info["head"] == ["head"]
    assert info["description"] == "Tiny test network."  # first docstring line of the builder
    (weights,) = info["weights"]
    assert weights["url"] == "https://example.org/dfmtest-pre.safetensors"
    assert weights["sha256"] == SHA and weights["license"] == "CC-BY-4.0"
    real = sum(p.numel() for p in tiny_zoo.Net(n_chans=3, n_outputs=2, hidden=8).parameters())
    assert info["num_params"] == real == 3 * 8 + 8 + 8 + 8 + 8 * 2 + 2
    assert domainfm.model_info("dfmtest-small")["num_params"] == sum(
        p.numel() for p in domainfm.create_model("dfmtest-small").parameters()
    )
    json.dumps(info)  # what `domainfm info` prints must be JSON-able
    assert "num_params" not in domainfm.model_info("dfmtest-pre", count_params=False)


def test_caller_keywords_override_defaults(tiny_zoo):
    model = domainfm.create_model("dfmtest-tiny", n_outputs=5)
    assert model.head.out_features == 5 and model.body[0].in_features == 3
    assert model.domainfm_name == "dfmtest-tiny"
    assert model.domainfm_kwargs == {"n_chans": 3, "n_outputs": 5, "hidden": 8}
    assert model(torch.randn(2, 3)).shape == (2, 5)
    # the card's defaults are not mutated by the override
    assert zoo.get_card("dfmtest-tiny").defaults == {"n_chans": 3, "n_outputs": 2, "hidden": 8}
    assert domainfm.create_model("dfmtest-tiny").head.out_features == 2


def test_duplicate_registration_raises_unless_overwrite(tiny_zoo):
    with pytest.raises(ValueError, match="'dfmtest-tiny' is already registered"):
        zoo.register_model("dfmtest-tiny", family="dfmtest")(lambda **kw: tiny_zoo.Net(**kw))
    assert zoo.get_card("dfmtest-tiny").defaults["hidden"] == 8  # the first card survives
    tiny_zoo.register("dfmtest-tiny", defaults={"n_chans": 3, "n_outputs": 2, "hidden": 4})
    assert domainfm.create_model("dfmtest-tiny").body[0].out_features == 4


@pytest.mark.parametrize("name", ["", " padded ", "org/name"])
def test_invalid_names_are_rejected(name):
    with pytest.raises(ValueError, match="invalid model name"):
        zoo.register_model(name, family="dfmtest")


@pytest.mark.parametrize("digest", ["ab" * 31, "ab" * 33, "zz" * 32, ""])
def test_weight_source_rejects_bad_sha256(digest):
    with pytest.raises(ValueError, match="64 hex digits"):
        WeightSource("https://example.org/w.pth", sha256=digest)


def test_weight_source_normalises_digest_and_names_file():
    source = WeightSource("hf://org/repo/sub/w.pth", sha256="AB" * 32)
    assert source.sha256 == "ab" * 32
    assert source.filename == "w.pth"


def test_unknown_model_error_points_to_list_models(tiny_zoo):
    with pytest.raises(KeyError, match="list_models") as info:
        domainfm.create_model("dfmtest-huge")
    assert "dfmtest-huge" in str(info.value) and "dfmtest-tiny" in str(info.value)  # similar names
    with pytest.raises(KeyError, match="list_models"):
        domainfm.model_info("no-such-model")


def test_builder_must_return_a_module(tiny_zoo):
    tiny_zoo.register("dfmtest-broken", builder=lambda **kw: "not a module")
    with pytest.raises(TypeError, match="dfmtest-broken.*str"):
        domainfm.create_model("dfmtest-broken")


def test_pretrained_true_without_weights_raises(tiny_zoo):
    with pytest.raises(domainfm.hub.HubError, match="no pretrained weights"):
        domainfm.create_model("dfmtest-tiny", pretrained=True)


def test_hub_sources_may_leave_the_sha256_to_the_hub_and_the_lock():
    source = WeightSource("hf://org/repo/w.safetensors", revision="a" * 40)
    assert source.sha256 is None and source.pinned == "revision"
    assert WeightSource("timm://vit_small_patch14_dinov2.lvd142m").pinned == "lock"
    assert WeightSource("hf://org/repo/w.pth", sha256="AB" * 32).pinned == "sha256"
    with pytest.raises(ValueError, match="needs a pinned sha256"):  # nothing else vouches for a plain URL
        WeightSource("https://example.org/w.pth")
    with pytest.raises(ValueError, match="64 hex digits"):
        WeightSource("hf://org/repo/w.pth", sha256="")


def test_card_domain_for_model_card_tags(tiny_zoo):
    assert zoo.get_card("cbramod-base").domain == "eeg"
    assert zoo.get_card("explora-test").domain == "remote-sensing"
    tiny_zoo.register("dfmtest-dom", input_spec={"n_chans": 3, "domain": "seismology"})
    assert zoo.get_card("dfmtest-dom").domain == "seismology"
    assert zoo.get_card("dfmtest-tiny").domain is None


def test_weight_source_records_pretraining_data_and_overlaps():
    source = WeightSource("hf://org/repo/w.pth", pretraining_data="TUEG, unlabelled", overlaps=["TUAB", " TUEV "])
    assert source.overlaps == ("TUAB", "TUEV")  # a manifest's list reads back as the registered tuple
    assert WeightSource(**json.loads(json.dumps(dataclasses.asdict(source)))) == source
    unrecorded = WeightSource("hf://org/repo/w.pth")
    assert unrecorded.pretraining_data == "" and unrecorded.overlaps == ()
    # a bare string would otherwise iterate into letters
    with pytest.raises(ValueError, match=r"hf://org/repo/w.pth.*overlaps must be a sequence of benchmark names.*'TUAB'"):
        WeightSource("hf://org/repo/w.pth", pretraining_data="TUEG", overlaps="TUAB")
    with pytest.raises(ValueError, match="overlaps must be a sequence of benchmark names"):
        WeightSource("hf://org/repo/w.pth", pretraining_data="TUEG", overlaps=("TUAB", ""))
    with pytest.raises(ValueError, match=r"overlaps \('TUAB',\) need the pretraining_data"):
        WeightSource("hf://org/repo/w.pth", overlaps=("TUAB",))
    with pytest.raises(ValueError, match="pretraining_data must be a string"):
        WeightSource("hf://org/repo/w.pth", pretraining_data=["TUEG"])


def test_model_info_shows_pretraining_data_and_overlaps(tiny_zoo):
    tiny_zoo.register("dfmtest-seen", weights=[WeightSource("https://example.org/seen.safetensors", SHA,
                                                            pretraining_data="the TUH EEG Corpus", overlaps=("TUAB",))])
    (weights,) = json.loads(json.dumps(domainfm.model_info("dfmtest-seen")))["weights"]
    assert weights["pretraining_data"] == "the TUH EEG Corpus" and weights["overlaps"] == ["TUAB"]
