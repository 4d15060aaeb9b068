"""Weights hub: download, verify, cache, offline mode, safe loading, load reports, own format."""
from __future__ import annotations

import builtins
import hashlib
import io
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

import domainfm
from domainfm import hub
from domainfm.hub import ChecksumError, HubError, OfflineError, UnsafeCheckpointError
from domainfm.zoo import WeightSource



def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pth_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _files_under(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) if path.exists() else []


def _assert_state_equal(model, expected):
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# --------------------------------------------------------------------------- download + cache


@pytest.mark.parametrize("filename", ["tiny.safetensors", "tiny.pth"])
def test_download_verify_cache_and_load(filename, http_server, tiny_zoo, domainfm_home):
    expected = tiny_zoo.state_dict(seed=1)
    body = safetensors_bytes(expected) if filename.endswith(".safetensors") else _pth_bytes(expected)
    url = http_server.serve(f"/weights/{filename}", body)
    tiny_zoo.register("dfmtest-served", weights=[WeightSource(url, sha256=_sha(body))])

    model = domainfm.create_model("dfmtest-served", pretrained=True, progress=False)

    dest = hub.cache_path_for(url)
    assert dest.is_relative_to(domainfm_home / "weights")
    assert dest.name == filename
    assert dest.read_bytes() == body
    assert _files_under(domainfm_home / "weights") == [dest.relative_to(domainfm_home / "weights").as_posix()]
    _assert_state_equal(model, expected)
    report = model.domainfm_load_report
    assert report.sha256 == _sha(body)
    assert report.missing == [] and report.unexpected == [] and report.dropped_head == []
    assert http_server.hit_count(f"/weights/{filename}") == 1

    again = domainfm.create_model("dfmtest-served", pretrained=True, progress=False)
    assert http_server.hit_count(f"/weights/{filename}") == 1  # served from the cache
    _assert_state_equal(again, expected)


def test_fetch_returns_cache_path_and_rejects_corrupted_cache(http_server):
    body = b"weights-bytes" * 100
    url = http_server.serve("/a/b/file.bin", body)
    path = hub.fetch(url, _sha(body), progress=False)
    assert path == hub.cache_path_for(url)
    assert hub.sha256_file(path) == _sha(body)

    path.write_bytes(b"tampered")
    with pytest.raises(ChecksumError, match="delete it"):
        hub.fetch(url, _sha(body), progress=False)
    assert http_server.hit_count("/a/b/file.bin") == 1


def test_local_file_and_file_url_are_verified_in_place(tmp_path, tiny_zoo, domainfm_home):
    expected = tiny_zoo.state_dict(seed=8)
    path = tmp_path / "local.safetensors"
    path.write_bytes(safetensors_bytes(expected))
    digest = hub.sha256_file(path)
    assert hub.fetch(path.as_uri(), digest) == path
    model = domainfm.create_model("dfmtest-tiny", pretrained=path.as_uri(), sha256=digest)
    _assert_state_equal(model, expected)
    assert model.domainfm_load_report.sha256 == digest
    with pytest.raises(ChecksumError, match=digest):
        domainfm.create_model("dfmtest-tiny", pretrained=str(path), sha256="c" * 64)
    with pytest.raises(FileNotFoundError, match="nothere.pth"):
        domainfm.create_model("dfmtest-tiny", pretrained=str(tmp_path / "nothere.pth"))
    assert _files_under(domainfm_home) == []  # nothing copied into the cache


def test_url_without_sha_warns_with_digest(http_server, tiny_zoo):
    expected = tiny_zoo.state_dict(seed=2)
    body = safetensors_bytes(expected)
    url = http_server.serve("/free/tiny.safetensors", body)
    with pytest.warns(UserWarning, match=_sha(body)):
        model = domainfm.create_model("dfmtest-tiny", pretrained=url, progress=False)
    _assert_state_equal(model, expected)


def test_url_with_wrong_sha_argument_raises(http_server, tiny_zoo, domainfm_home):
    body = safetensors_bytes(tiny_zoo.state_dict())
    url = http_server.serve("/free/tiny.safetensors", body)
    with pytest.raises(ChecksumError):
        domainfm.create_model("dfmtest-tiny", pretrained=url, sha256="0" * 64, progress=False)
    assert _files_under(domainfm_home) == []


# hf:// and timm:// sources go through huggingface_hub: tested against a Hub-like server in
# tests/test_hub_hf.py (endpoint, revisions, whole repositories, tampering, lock, offline, token).


def test_hub_token_is_sent_only_to_the_hub_origin(http_server, monkeypatch):
    # A dummy token; HF_TOKEN wins over any token file, so no real credential is read.
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_for_tests")
    body = b"data" * 10
    url = http_server.serve("/f.bin", body)
    # an "endpoint" that is a string prefix of the server's origin (port 4123 vs 41234)
    monkeypatch.setenv("HF_ENDPOINT", http_server.base[:-1])
    hub.fetch(url, _sha(body), progress=False)
    assert http_server.authorization == [None]

    hub.cache_path_for(url).unlink()
    monkeypatch.setenv("HF_ENDPOINT", http_server.base)
    hub.fetch(url, _sha(body), progress=False)
    assert http_server.authorization == [None, "Bearer hf_dummy_for_tests"]


def test_hub_token_follows_same_origin_redirects_only(http_server, other_http_server, monkeypatch):
    """The Hub redirects file downloads to a CDN: the token must not travel there."""
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_for_tests")
    monkeypatch.setenv("HF_ENDPOINT", http_server.base)
    cdn = other_http_server
    body = b"weights" * 7
    target = cdn.serve("/blob.bin", body)
    http_server.serve("/moved.bin", body)
    http_server.redirect("/same.bin", http_server.base + "/moved.bin")
    http_server.redirect("/cross.bin", target)

    hub.fetch(http_server.base + "/same.bin", _sha(body), progress=False)
    assert http_server.authorization == ["Bearer hf_dummy_for_tests"] * 2  # kept on the same origin

    hub.fetch(http_server.base + "/cross.bin", _sha(body), progress=False)
    assert http_server.authorization[-1] == "Bearer hf_dummy_for_tests"
    assert cdn.hit_count("/blob.bin") == 1 and cdn.authorization == [None]  # dropped for another origin


def test_hf_url_must_name_a_file_inside_the_cache():
    with pytest.raises(ValueError, match="must name a file"):
        hub.cache_path_for("hf://org/repo")
    with pytest.raises(ValueError):
        hub.cache_path_for("hf://org/repo/../../../../outside.bin")
    with pytest.raises(ValueError):
        hub.cache_path_for("ftp://host/x.bin")
    # http(s) paths are sanitised: they can never climb out of the cache
    assert hub.cache_path_for("https://h.org/../../x.bin").is_relative_to(hub.weights_dir())


# --------------------------------------------------------------------------- failures leave nothing


def test_wrong_hash_raises_and_caches_nothing(http_server, tiny_zoo, domainfm_home):
    body = safetensors_bytes(tiny_zoo.state_dict())
    url = http_server.serve("/w/tiny.safetensors", body)
    wrong = _sha(body + b"x")
    tiny_zoo.register("dfmtest-badsha", weights=[WeightSource(url, sha256=wrong)])
    with pytest.raises(ChecksumError) as info:
        domainfm.create_model("dfmtest-badsha", pretrained=True, progress=False)
    assert wrong in str(info.value) and _sha(body) in str(info.value)
    assert _files_under(domainfm_home) == []  # neither the file nor a .part- temp
    assert not hub.cache_path_for(url).exists()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("with_sha", [True, False], ids=["sha", "no-sha"])
def test_interrupted_download_raises_and_leaves_no_partial_file(with_sha, chunked, http_server, domainfm_home):
    body = bytes(range(256)) * 64
    url = http_server.serve("/w/cut.bin", body, truncate=True, chunked=chunked)
    with pytest.raises(HubError, match="cut short|could not download") as info:
        hub.fetch(url, _sha(body) if with_sha else None, progress=False)
    assert url in str(info.value)
    assert http_server.hit_count("/w/cut.bin") == 1
    assert _files_under(domainfm_home) == []


def test_chunked_download_completes(http_server):
    body = bytes(range(256)) * 64
    url = http_server.serve("/w/chunked.bin", body, chunked=True)
    assert hub.fetch(url, _sha(body), progress=False).read_bytes() == body


def test_http_error_names_url_and_destination(http_server, domainfm_home):
    url = http_server.base + "/missing/file.bin"
    with pytest.raises(HubError) as info:
        hub.fetch(url, "a" * 64, progress=False)
    assert url in str(info.value) and str(hub.cache_path_for(url)) in str(info.value)
    assert _files_under(domainfm_home) == []


def test_offline_names_url_and_cache_path_then_uses_placed_file(http_server, tiny_zoo, monkeypatch, domainfm_home):
    expected = tiny_zoo.state_dict(seed=4)
    body = safetensors_bytes(expected)
    url = http_server.serve("/off/tiny.safetensors", body)
    tiny_zoo.register("dfmtest-offline", weights=[WeightSource(url, sha256=_sha(body))])
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")

    dest = hub.cache_path_for(url)
    with pytest.raises(OfflineError) as info:
        domainfm.create_model("dfmtest-offline", pretrained=True, progress=False)
    message = str(info.value)
    assert url in message and str(dest) in message and _sha(body) in message
    assert http_server.total_hits() == 0

    dest.parent.mkdir(parents=True)
    dest.write_bytes(body)
    model = domainfm.create_model("dfmtest-offline", pretrained=True, progress=False)
    _assert_state_equal(model, expected)
    assert http_server.total_hits() == 0


# --------------------------------------------------------------------------- no code execution


class _Payload:
    """Unpickling this runs ``exec``, which writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'w').write('executed')",))


@pytest.mark.parametrize("writer", ["torch_zip", "torch_legacy", "plain_pickle"])
def test_pickle_with_code_is_refused(writer, tmp_path, tiny_zoo):
    marker = tmp_path / "MARKER"
    path = tmp_path / "evil.pth"
    payload = {**tiny_zoo.state_dict(), "evil": _Payload(marker)}
    if writer == "torch_zip":
        torch.save(payload, path)
    elif writer == "torch_legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    assert not marker.exists()

    with pytest.raises(UnsafeCheckpointError, match="refused"):
        hub.load_checkpoint(path)
    with pytest.raises(UnsafeCheckpointError):
        domainfm.create_model("dfmtest-tiny", pretrained=str(path), progress=False)
    assert not marker.exists()

    if writer == "torch_zip":  # the payload is live: an unsafe load does run it
        torch.load(shutil.copy(path, tmp_path / "copy.pth"), weights_only=False)
        assert marker.read_text() == "executed"


def test_truncated_torch_checkpoint_is_a_hub_error(tmp_path, tiny_zoo):
    path = tmp_path / "cut.pth"
    data = _pth_bytes(tiny_zoo.state_dict())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(HubError, match="cut.pth"):
        hub.load_checkpoint(path)


# --------------------------------------------------------------------------- load reports


def test_extra_and_missing_key_strict_then_lenient(tmp_path, tiny_zoo):
    state = tiny_zoo.state_dict(seed=5)
    del state["body.2.bias"]
    state["body.9.weight"] = torch.ones(3)
    path = tmp_path / "odd.safetensors"
    from safetensors.torch import save_file

    save_file(state, str(path))

    with pytest.raises(HubError) as info:
        domainfm.create_model("dfmtest-tiny", pretrained=str(path), progress=False)
    assert "body.2.bias" in str(info.value) and "body.9.weight" in str(info.value)

    with pytest.warns(UserWarning, match="body.2.bias"):
        model = domainfm.create_model("dfmtest-tiny", pretrained=str(path), strict=False, progress=False)
    report = model.domainfm_load_report
    assert report.missing == ["body.2.bias"] and report.unexpected == ["body.9.weight"]
    got = model.state_dict()
    for key in state:
        if key in got:
            assert torch.equal(got[key], state[key]), key


def test_changed_head_is_dropped_and_reported(tmp_path, tiny_zoo):
    state = tiny_zoo.state_dict(seed=6)
    path = tmp_path / "tiny.pth"
    torch.save(state, path)
    model = domainfm.create_model("dfmtest-tiny", pretrained=str(path), n_outputs=5, progress=False)
    assert model.head.out_features == 5
    report = model.domainfm_load_report
    assert sorted(report.dropped_head) == ["head.bias", "head.weight"]
    assert report.missing == [] and report.unexpected == []
    for key, value in state.items():
        if not key.startswith("head."):
            assert torch.equal(model.state_dict()[key], value), key
    assert "head.weight" in str(report)


def test_body_shape_mismatch_names_key_and_shapes(tmp_path, tiny_zoo):
    path = tmp_path / "wide.pth"
    torch.save(tiny_zoo.state_dict(n_chans=4), path)  # body.0.weight is (8, 4); the model's is (8, 3)
    with pytest.raises(HubError) as info:
        domainfm.create_model("dfmtest-tiny", pretrained=str(path), progress=False)
    message = str(info.value)
    assert "body.0.weight" in message and "(8, 4)" in message and "(8, 3)" in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor_raises(bad, tmp_path, tiny_zoo):
    state = tiny_zoo.state_dict()
    state["body.0.weight"][0, 0] = bad
    path = tmp_path / "nan.pth"
    torch.save(state, path)
    with pytest.raises(HubError, match="body.0.weight"):
        domainfm.create_model("dfmtest-tiny", pretrained=str(path), progress=False)


def _strip_module(state_dict, model):
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


def test_card_converter_applies_to_upstream_keys(http_server, tmp_path, tiny_zoo):
    expected = tiny_zoo.state_dict(seed=7)
    upstream = {"module." + k: v for k, v in expected.items()}
    body = _pth_bytes({"model": upstream, "epoch": 12})
    url = http_server.serve("/upstream/ckpt.pth", body)
    tiny_zoo.register(
        "dfmtest-upstream",
        weights=[WeightSource(url, sha256=_sha(body), converter="strip_module", state_dict_key="model")],
        converters={"strip_module": _strip_module},
    )
    model = domainfm.create_model("dfmtest-upstream", pretrained=True, progress=False)
    _assert_state_equal(model, expected)
    assert model.domainfm_load_report.converter == "strip_module"

    # a local upstream file (no domainfm metadata): the card's only converter applies
    local = tmp_path / "upstream.pth"
    torch.save(upstream, local)
    model = domainfm.create_model("dfmtest-upstream", pretrained=str(local), progress=False)
    _assert_state_equal(model, expected)
    assert model.domainfm_load_report.converter == "strip_module"

    with pytest.raises(HubError, match="unknown converter 'nope'.*strip_module"):
        domainfm.create_model("dfmtest-upstream", pretrained=str(local), converter="nope", progress=False)


def _drop_pooling_norm(state_dict, model):
    """Like GIT's converter: drops a module the upstream file carries but never used; idempotent."""
    return {k: v for k, v in state_dict.items() if not k.startswith("pool_norm.")}


def _register_counting(tiny_zoo, name="dfmtest-conv", **card):
    calls = []

    def convert(state_dict, model):
        calls.append(sorted(state_dict))
        return _drop_pooling_norm(state_dict, model)

    tiny_zoo.register(name, converters={"official": convert}, **card)
    return calls


def test_upstream_file_is_converted_even_when_nearly_all_keys_match(tmp_path, tiny_zoo):
    # Every key of the model is in the file, plus one unused upstream module: the old rule (skip the
    # converter when >= 90% of the keys match) loaded it unconverted and failed on the extra key.
    calls = _register_counting(tiny_zoo)
    expected = tiny_zoo.state_dict(seed=11)
    upstream = {**expected, "pool_norm.weight": torch.ones(8)}
    for path in (tmp_path / "official.pth", tmp_path / "official.safetensors"):
        if path.suffix == ".pth":
            torch.save({"model": upstream, "epoch": 3}, path)
        else:
            from safetensors.torch import save_file

            save_file(upstream, str(path))  # a safetensors file without our metadata is upstream too
        model = domainfm.create_model("dfmtest-conv", pretrained=str(path), progress=False)
        _assert_state_equal(model, expected)
        report = model.domainfm_load_report
        assert report.kind == "upstream" and report.converter == "official"
        assert report.unexpected == [] and report.missing == []
    assert len(calls) == 2 and all("pool_norm.weight" in keys for keys in calls)


def test_own_files_are_never_converted(tmp_path, tiny_zoo):
    calls = _register_counting(tiny_zoo)
    original = domainfm.create_model("dfmtest-conv")
    with torch.no_grad():
        original.scale.uniform_(0.5, 1.5)
    folder = domainfm.save_pretrained(original, tmp_path / "saved")
    assert hub.is_own_file(folder / "model.safetensors")
    # the folder and its weights file alone, loaded into the registered variant by name
    for source in (folder, folder / "model.safetensors"):
        model = domainfm.create_model("dfmtest-conv", pretrained=str(source), progress=False)
        _assert_state_equal(model, original.state_dict())
        assert model.domainfm_load_report.kind == "domainfm" and model.domainfm_load_report.converter is None
    assert calls == []
    # an explicit converter= is honoured even for our own file (converters are idempotent)
    model = domainfm.create_model("dfmtest-conv", pretrained=str(folder), converter="official")
    _assert_state_equal(model, original.state_dict())
    assert len(calls) == 1 and model.domainfm_load_report.converter == "official"


def test_own_folder_loaded_by_name_verifies_its_recorded_digest(tmp_path, tiny_zoo):
    folder = domainfm.save_pretrained(domainfm.create_model("dfmtest-tiny"), tmp_path / "saved")
    from safetensors.torch import save_file

    other = tiny_zoo.state_dict(seed=3)
    save_file(other, str(folder / "model.safetensors"), metadata={"format": "pt", "domainfm_model": "dfmtest-tiny"})
    with pytest.raises(ChecksumError, match="model.safetensors.*recorded in"):
        domainfm.create_model("dfmtest-tiny", pretrained=str(folder))


def test_weight_source_with_no_converter_is_loaded_as_is(http_server, tiny_zoo):
    calls = []
    expected = tiny_zoo.state_dict(seed=12)
    body = _pth_bytes(expected)
    url = http_server.serve("/ours/plain.pth", body)
    tiny_zoo.register(
        "dfmtest-plain-source", weights=[WeightSource(url, sha256=_sha(body))],
        converters={"official": lambda sd, model: calls.append(1) or sd},
    )
    model = domainfm.create_model("dfmtest-plain-source", pretrained=True, progress=False)
    _assert_state_equal(model, expected)
    assert calls == [] and model.domainfm_load_report.converter is None


def test_upstream_file_with_several_converters_needs_a_choice(tmp_path, tiny_zoo):
    tiny_zoo.register("dfmtest-two", converters={"a": _strip_module, "b": _drop_pooling_norm})
    path = tmp_path / "up.pth"
    torch.save(tiny_zoo.state_dict(), path)
    with pytest.raises(HubError, match=r"up.pth is an upstream checkpoint.*\['a', 'b'\].*converter=NAME"):
        domainfm.create_model("dfmtest-two", pretrained=str(path))
    model = domainfm.create_model("dfmtest-two", pretrained=str(path), converter="b")
    assert model.domainfm_load_report.converter == "b"


def test_card_naming_an_unknown_converter_is_rejected(tiny_zoo):
    with pytest.raises(ValueError, match="names converter 'missing'"):
        tiny_zoo.register("dfmtest-noconv", weights=[WeightSource("https://h.org/x.pth", "b" * 64, converter="missing")])


# --------------------------------------------------------------------------- own format


def test_save_pretrained_round_trip(tmp_path, tiny_zoo):
    model = domainfm.create_model("dfmtest-tiny", n_outputs=3, hidden=6)
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)
    saved = domainfm.save_pretrained(model, tmp_path / "run")
    assert sorted(p.name for p in saved.iterdir()) == ["README.md", "config.json", "model.safetensors"]  # no temp files
    config = json.loads((saved / "config.json").read_text())["domainfm"]
    assert config["model_name"] == "dfmtest-tiny"
    assert config["model_kwargs"] == {"n_chans": 3, "n_outputs": 3, "hidden": 6}
    assert config["sha256"] == hub.sha256_file(saved / "model.safetensors")

    loaded = domainfm.create_model(saved)
    assert loaded.domainfm_name == "dfmtest-tiny"
    assert loaded.domainfm_load_report.sha256 == config["sha256"]
    _assert_state_equal(loaded, model.state_dict())
    x = torch.randn(4, 3)
    model.eval(), loaded.eval()
    assert torch.equal(model(x), loaded(x))


def test_saved_dir_with_new_n_outputs_drops_only_head(tmp_path, tiny_zoo):
    model = domainfm.create_model("dfmtest-tiny")
    saved = domainfm.save_pretrained(model, tmp_path / "run")
    loaded = domainfm.create_model(saved, n_outputs=7)
    assert loaded.head.out_features == 7
    assert sorted(loaded.domainfm_load_report.dropped_head) == ["head.bias", "head.weight"]
    x = torch.randn(2, 3)
    assert torch.equal(model.forward_features(x), loaded.forward_features(x))
    for key, value in model.state_dict().items():
        if not key.startswith("head."):
            assert torch.equal(loaded.state_dict()[key], value), key


def test_truncated_safetensors_in_saved_dir_raises(tmp_path, tiny_zoo):
    saved = domainfm.save_pretrained(domainfm.create_model("dfmtest-tiny"), tmp_path / "run")
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-40])
    with pytest.raises(HubError, match="model.safetensors"):
        domainfm.create_model(saved)

    # without a recorded digest the file itself is found unreadable, still as a HubError
    config_path = saved / "config.json"
    config = json.loads(config_path.read_text())
    del config["domainfm"]["sha256"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(HubError, match="model.safetensors"):
        domainfm.create_model(saved)
    with pytest.raises(HubError, match="not a readable safetensors"):
        hub.load_checkpoint(weights)


def test_directory_without_domainfm_config_is_rejected(tmp_path, tiny_zoo):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HubError, match="not a domainfm model directory"):
        domainfm.create_model(tmp_path)


def test_save_pretrained_needs_a_zoo_model(tmp_path, tiny_zoo):
    with pytest.raises(ValueError, match="create_model"):
        domainfm.save_pretrained(tiny_zoo.Net(), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_pretrained_after_reset_classifier_records_the_new_head(tiny_zoo, tmp_path):
    model = domainfm.create_model("dfmtest-tiny")
    model.reset_classifier(5)
    domainfm.save_pretrained(model, tmp_path / "m")
    reloaded = domainfm.create_model(tmp_path / "m")
    assert reloaded.head.out_features == 5
    x = torch.randn(4, 3)
    assert torch.equal(reloaded(x), model(x))


# --------------------------------------------------------------------------- model cards


def _front_matter(text: str) -> dict:
    import yaml

    assert text.startswith("---\n")
    head, _, _ = text[4:].partition("\n---\n")
    return yaml.safe_load(head)


def test_save_pretrained_writes_a_hub_model_card(tmp_path, tiny_zoo):
    tiny_zoo.register("dfmtest-carded", license="MIT", description="a tiny carded test net",
                      weights=[WeightSource("hf://org/base-repo/w.safetensors", license="CC-BY-4.0")])
    model = domainfm.create_model("dfmtest-carded")
    folder = domainfm.save_pretrained(model, tmp_path / "m")
    text = (folder / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "domainfm" and meta["license"] == "mit"
    assert meta["base_model"] == "org/base-repo"
    assert meta["tags"] == ["domainfm", "dfmtest"] and "datasets" not in meta
    n_params = sum(p.numel() for p in model.parameters())
    assert "a tiny carded test net" in text and f"{n_params:,}" in text and "TinyNet" in text
    assert "CC-BY-4.0" in text  # the licence of the weights it started from
    assert "No training report" in text and "## Metrics" not in text
    # a source that records no pretraining data: the card says so rather than "no overlaps"
    assert _card_section(text, "Pretraining data")[-2:] == ["- pretraining data: not recorded",
                                                            "- overlaps with public benchmarks: unknown"]
    # the folder still round-trips (the card is not read back)
    _assert_state_equal(domainfm.create_model(folder), model.state_dict())


def _card_section(text: str, title: str) -> list[str]:
    """The non-empty lines of a model card's ``## title`` section."""
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in body.splitlines() if line]


def test_saved_card_names_the_pretraining_data_and_overlaps_of_the_loaded_weights(tmp_path, tiny_zoo):
    """A model loaded from a weight source that records what it saw: every card saved from it
    (save_pretrained, and a re-saved copy of that folder with the run's report) names the data
    and the public benchmarks it contains; a random-init arm of the same run names none."""
    torch.manual_seed(3)
    upstream = domainfm.save_pretrained(domainfm.create_model("dfmtest-tiny"), tmp_path / "up", card=False)
    weights = upstream / "model.safetensors"
    digest = hub.sha256_file(weights)
    tiny_zoo.register("dfmtest-seen", weights=[
        WeightSource("https://example.org/unused.safetensors", "cd" * 32, pretraining_data="nothing public"),
        WeightSource(weights.as_uri(), digest, pretraining_data="the TUH EEG Corpus (TUEG), unlabelled",
                     overlaps=("TUAB", "TUEV"), note="exclusions not confirmed")])
    model = domainfm.create_model("dfmtest-seen", pretrained=weights.as_uri())
    text = (domainfm.save_pretrained(model, tmp_path / "m") / "README.md").read_text()
    assert _card_section(text, "Pretraining data") == [
        f"- weights: {weights.as_uri()}",
        "- pretraining data: the TUH EEG Corpus (TUEG), unlabelled",
        "- overlaps with public benchmarks: TUAB, TUEV (these weights saw their data in pretraining: a result on "
        "them is not a held-out result)",
        "- note: exclusions not confirmed"]
    # a local copy of that file, loaded by path, is recognised by its sha256
    copy = shutil.copy(weights, tmp_path / "copy.safetensors")
    local = domainfm.create_model("dfmtest-seen", pretrained=str(copy))
    assert "TUAB, TUEV" in _card_section(hub.model_card_text(local), "Pretraining data")[2]
    # the experiment layer re-creates each arm's model from its folder (its load report then names
    # the folder) and passes the run's report: the arm's recorded init picks the source
    from domainfm.experiment.weights import InitInfo

    report = {"arms": {"pretrained": {"init": str(InitInfo("pretrained", source=weights.as_uri(), sha256=digest))},
                       "random": {"init": str(InitInfo("random", reason="no pretrained weights requested"))}}}
    reloaded = domainfm.create_model(tmp_path / "m")
    card = hub.model_card_text(reloaded, report, arm="pretrained")
    assert _card_section(card, "Pretraining data")[1:3] == [
        "- pretraining data: the TUH EEG Corpus (TUEG), unlabelled",
        "- overlaps with public benchmarks: TUAB, TUEV (these weights saw their data in pretraining: a result on "
        "them is not a held-out result)"]
    assert _card_section(hub.model_card_text(reloaded, report, arm="random"), "Pretraining data") == [
        "- initialisation: random (the run's arm): no pretraining data"]
    # an upstream file that is none of the card's sources: what it saw is not known
    from safetensors.torch import save_file

    stranger = tmp_path / "stranger.safetensors"
    save_file(dict(model.state_dict()), str(stranger))  # no domainfm metadata: an upstream file
    unknown = domainfm.create_model("dfmtest-seen", pretrained=str(stranger), converter=lambda sd, m: sd)
    assert unknown.domainfm_load_report.kind == "upstream"
    assert _card_section(hub.model_card_text(unknown), "Pretraining data") == [
        f"- weights: {stranger}", "- pretraining data: not recorded", "- overlaps with public benchmarks: unknown"]
    # the other source of the same card is named when it is the one loaded from the run's record
    other = {"arms": {"a": {"init": "pretrained https://example.org/unused.safetensors (sha256 cdcdcdcdcdcd)"}}}
    assert _card_section(hub.model_card_text(reloaded, other, arm="a"), "Pretraining data")[1:] == [
        "- pretraining data: nothing public", "- overlaps with public benchmarks: none known"]


def test_model_card_shows_the_reports_metrics_and_training(tmp_path, tiny_zoo):
    model = domainfm.create_model("dfmtest-tiny")
    report = {"family": "dfmtest", "task": "classification", "monitor": "val/accuracy",
              "data": {"dataset": "TUAB", "n_chans": 3, "train_windows": 120},
              "arms": {"lora": {"init": "pretrained hf://org/x", "mode": "lora", "steps": 40, "best_step": 30,
                                "params": {"total": 100, "trainable": 12},
                                "val": {"accuracy": 0.8125}, "test": {"accuracy": 0.79, "per_class": {"a": 0.5}}},
                       "random": {"test": {"accuracy": 0.41}}}}
    path = domainfm.hub.write_model_card(tmp_path, model, report, arm="lora")
    text = path.read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "domainfm" and meta["datasets"] == ["TUAB"]
    assert "| test/accuracy | 0.79 |" in text and "| val/accuracy | 0.8125 |" in text
    assert "| test/per_class/a | 0.5 |" in text and "0.41" not in text  # only the chosen arm
    assert "- steps: 40" in text and "- params/trainable: 12" in text and "- data/train_windows: 120" in text
    # without an arm: every arm's test metrics
    text = domainfm.hub.model_card_text(model, report)
    assert "| lora/test/accuracy | 0.79 |" in text and "| random/test/accuracy | 0.41 |" in text
    # save_pretrained passes the report on; the card is written atomically (no temp file left)
    folder = domainfm.save_pretrained(model, tmp_path / "m", report=report, arm="lora")
    assert "| test/accuracy | 0.79 |" in (folder / "README.md").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not (domainfm.save_pretrained(model, tmp_path / "n", card=False) / "README.md").exists()


def test_integer_tensor_for_a_float_parameter_is_refused(tiny_zoo, tmp_path):
    """A checkpoint storing a float parameter as int32 would load with most weights rounded to 0:
    refused, naming the key and both dtypes (float dtypes convert as load_state_dict does)."""
    from safetensors.torch import save_file

    from domainfm import hub

    model = domainfm.create_model("dfmtest-small")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    key = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
    bad = dict(state, **{key: state[key].to(torch.int32)})
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(hub.HubError, match=rf"{key}.*torch.int32.*torch.float32"):
        domainfm.create_model("dfmtest-small", pretrained=str(tmp_path / "bad.safetensors"), converter=lambda sd, m: sd)
    half = dict(state, **{key: state[key].half()})  # a float dtype: converted, as load_state_dict does
    save_file(half, str(tmp_path / "half.safetensors"))
    loaded = domainfm.create_model("dfmtest-small", pretrained=str(tmp_path / "half.safetensors"),
                                   converter=lambda sd, m: sd)
    torch.testing.assert_close(loaded.state_dict()[key], state[key].half().float())
