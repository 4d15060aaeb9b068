"""hf:// and timm:// weights through huggingface_hub, against a local server that answers like the Hub.

The fake Hub has two origins on 127.0.0.1 (two ports), as the real one has huggingface.co and
its CDN: ``HEAD/GET /{repo}/resolve/{revision}/{file}`` on the Hub origin answers an LFS file
with ``302`` to the CDN origin plus ``X-Repo-Commit``, ``X-Linked-Etag`` (the quoted sha256),
``X-Linked-Size`` and ``ETag``; a regular (non-LFS) file is served by the Hub origin itself with
its git blob id as ``ETag``. The CDN serves the bytes with ``Content-Length`` and honours
``Range`` (huggingface_hub resumes a cut download with it). The Hugging Face cache and
``$DOMAINFM_HOME`` are per-test temporary folders.
"""
from __future__ import annotations

import argparse
import hashlib
import http.server
import io
import json
import threading
from dataclasses import dataclass

import pytest
import torch
import yaml
from safetensors.torch import save as safetensors_bytes

import domainfm
from domainfm import cli, hub
from domainfm.hub import ChecksumError, HubError, OfflineError
from domainfm.zoo import WeightSource


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


@dataclass
class _File:
    body: bytes  # what the Hub publishes (its digest)
    served: bytes  # what the CDN sends (differs when tampered)
    commit: str
    lfs: bool
    cut: int = 0  # the next `cut` CDN responses send half the body, then close


class FakeHub:
    """A Hub origin and a CDN origin on 127.0.0.1; records every request's headers."""

    def __init__(self):
        self.files: dict[tuple[str, str], _File] = {}
        self.log: list[tuple[str, str, str, dict]] = []  # (origin, method, path, headers)
        self._lock = threading.Lock()
        self.hub = self._server(self._hub_answer, "hub")
        self.cdn = self._server(self._cdn_answer, "cdn")

    # -- setup
    def _server(self, answer, origin):
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10

            def _handle(self, method):
                with owner._lock:
                    owner.log.append((origin, method, self.path, {k.lower(): v for k, v in self.headers.items()}))
                answer(self, method)
                self.close_connection = True

            def do_HEAD(self):  # noqa: N802
                self._handle("HEAD")

            def do_GET(self):  # noqa: N802
                self._handle("GET")

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return server

    def base(self, origin="hub") -> str:
        host, port = getattr(self, origin).server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, filename: str, body: bytes, *, lfs: bool = True, served: bytes | None = None,
            commit: str = "a" * 40, cut: int = 0) -> None:
        with self._lock:
            self.files[(repo, filename)] = _File(body, body if served is None else served, commit, lfs, cut)

    def stop(self):
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    # -- queries
    def requests(self, origin=None, method=None):
        with self._lock:
            return [r for r in self.log if origin in (None, r[0]) and method in (None, r[1])]

    # -- answers
    @staticmethod
    def _send(handler, code, headers, body=b""):
        handler.send_response(code)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Connection", "close")
        handler.end_headers()
        if body:
            handler.wfile.write(body)
        handler.wfile.flush()

    def _hub_answer(self, handler, method):
        path = handler.path.split("?", 1)[0].lstrip("/")
        parts = path.split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            self._send(handler, 404, {"X-Error-Code": "RepoNotFound", "Content-Length": "0"})
            return
        repo, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        with self._lock:
            entry = self.files.get((repo, filename))
        if entry is None:
            self._send(handler, 404, {"X-Error-Code": "EntryNotFound", "Content-Length": "0",
                                      "X-Repo-Commit": "a" * 40})
            return
        if revision not in ("main", entry.commit):
            self._send(handler, 404, {"X-Error-Code": "RevisionNotFound", "Content-Length": "0"})
            return
        common = {"X-Repo-Commit": entry.commit}
        if entry.lfs:
            sha = _sha(entry.body)
            self._send(handler, 302, {**common, "Location": f"{self.base('cdn')}/blobs/{sha}?repo={repo}",
                                      "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(entry.body)),
                                      "ETag": f'"{_git_id(b"pointer " + sha.encode())}"', "Content-Length": "0"})
            return
        headers = {**common, "ETag": f'"{_git_id(entry.body)}"', "Content-Length": str(len(entry.served))}
        self._send(handler, 200, headers, entry.served if method == "GET" else b"")

    def _cdn_answer(self, handler, method):
        sha = handler.path.split("?", 1)[0].rsplit("/", 1)[-1]
        with self._lock:
            entry = next((f for f in self.files.values() if f.lfs and _sha(f.body) == sha), None)
            cut = entry is not None and method == "GET" and entry.cut > 0
            if cut:
                entry.cut -= 1
        if entry is None:
            self._send(handler, 404, {"Content-Length": "0"})
            return
        data, start = entry.served, 0
        ranged = handler.headers.get("Range")
        if ranged and ranged.startswith("bytes=") and ranged.endswith("-"):
            start = int(ranged[len("bytes="):-1])
        part = data[start:]
        headers = {"Content-Length": str(len(part)), "Content-Type": "application/octet-stream"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if method == "HEAD":
            self._send(handler, 200, headers)
            return
        # a cut response promises the whole (remaining) body, sends half of it and closes
        self._send(handler, 206 if start else 200, headers, part[: len(part) // 2] if cut else part)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The fake Hub as huggingface_hub's endpoint, with a per-test Hugging Face cache and no token."""
    from huggingface_hub import constants

    server = FakeHub()
    base = server.base("hub")
    monkeypatch.setattr(constants, "ENDPOINT", base)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", base + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # never read a real token file
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    server.cache = tmp_path / "hf-cache"
    try:
        yield server
    finally:
        server.stop()


def _lock(domainfm_home) -> dict:
    path = domainfm_home / hub.LOCK_FILE_NAME
    return json.loads(path.read_text())["files"] if path.is_file() else {}


def _repo_files(cache, repo):
    folder = cache / f"models--{repo.replace('/', '--')}"
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if (p.is_file() or p.is_symlink()) and "/refs/" not in f"/{p.relative_to(folder).as_posix()}") \
        if folder.exists() else []


def _assert_state_equal(model, expected):
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# --------------------------------------------------------------------------- verified downloads


def test_good_download_is_verified_recorded_and_then_served_from_the_cache(fake_hub, tiny_zoo, domainfm_home):
    expected = tiny_zoo.state_dict(seed=1)
    body = safetensors_bytes(expected)
    fake_hub.add("org/tiny", "sub/tiny.safetensors", body, commit="c" * 40)
    tiny_zoo.register("dfmtest-hub", weights=[WeightSource("hf://org/tiny/sub/tiny.safetensors")])

    model = domainfm.create_model("dfmtest-hub", pretrained=True, progress=False)
    _assert_state_equal(model, expected)
    assert model.domainfm_load_report.sha256 == _sha(body)
    # huggingface_hub's cache layout: the blob is named after the published sha256
    assert _repo_files(fake_hub.cache, "org/tiny") == [f"blobs/{_sha(body)}", f"snapshots/{'c' * 40}/sub/tiny.safetensors"]
    entry = _lock(domainfm_home)["hf://org/tiny@main/sub/tiny.safetensors"]
    assert entry["sha256"] == _sha(body) and entry["commit"] == "c" * 40 and entry["size"] == len(body)
    assert entry["published"] == f"sha256 {_sha(body)}"
    assert len(fake_hub.requests("cdn", "GET")) == 1

    again = domainfm.create_model("dfmtest-hub", pretrained=True, progress=False)
    _assert_state_equal(again, expected)
    assert len(fake_hub.requests("cdn", "GET")) == 1  # bytes not fetched again


def test_pinned_revision_and_pinned_sha256(fake_hub, tiny_zoo, domainfm_home):
    body = safetensors_bytes(tiny_zoo.state_dict(seed=2))
    commit = "d" * 40
    fake_hub.add("org/pin", "w.safetensors", body, commit=commit)
    source = WeightSource("hf://org/pin/w.safetensors", sha256=_sha(body), revision=commit)
    tiny_zoo.register("dfmtest-pin", weights=[source])
    model = domainfm.create_model("dfmtest-pin", pretrained=True, progress=False)
    _assert_state_equal(model, tiny_zoo.state_dict(seed=2))
    heads = fake_hub.requests("hub", "HEAD")
    assert heads and all(f"/resolve/{commit}/" in r[2] for r in heads)
    assert _lock(domainfm_home) == {}  # a pinned sha256 needs no lock entry
    # a pinned commit already in the cache needs no request at all
    n = len(fake_hub.log)
    domainfm.create_model("dfmtest-pin", pretrained=True, progress=False)
    assert len(fake_hub.log) == n
    # a card pinning another sha256 is refused, naming both digests
    wrong = _sha(body + b"x")
    tiny_zoo.register("dfmtest-pin-wrong", weights=[WeightSource("hf://org/pin/w.safetensors", sha256=wrong)])
    with pytest.raises(ChecksumError) as info:
        domainfm.create_model("dfmtest-pin-wrong", pretrained=True, progress=False)
    assert wrong in str(info.value) and _sha(body) in str(info.value)


def test_tampered_file_is_refused_and_nothing_stays_in_the_cache(fake_hub, tiny_zoo, domainfm_home):
    body = safetensors_bytes(tiny_zoo.state_dict(seed=3))
    tampered = bytearray(body)
    tampered[-1] ^= 0xFF  # same length: only the digest can tell
    fake_hub.add("org/evil", "model.safetensors", body, served=bytes(tampered))
    url = "hf://org/evil/model.safetensors"

    with pytest.raises(ChecksumError) as info:
        hub.fetch(url, progress=False)
    message = str(info.value)
    assert _sha(body) in message and _sha(bytes(tampered)) in message
    assert not any(name.startswith(("blobs/", "snapshots/")) for name in _repo_files(fake_hub.cache, "org/evil"))
    assert _lock(domainfm_home) == {}  # nothing recorded for a refused file
    with pytest.raises(ChecksumError):  # not trusted on a second call either: fetched and refused again
        hub.fetch(url, progress=False)
    assert len(fake_hub.requests("cdn", "GET")) == 2

    fake_hub.add("org/evil", "model.safetensors", body)  # the CDN now serves the published bytes
    assert hub.fetch(url, progress=False).read_bytes() == body


def test_tampered_regular_file_is_refused_against_its_git_id(fake_hub, domainfm_home):
    config = json.dumps({"d": 1}).encode()
    fake_hub.add("org/cfg", "config.json", config, lfs=False, served=json.dumps({"d": 2}).encode())
    with pytest.raises(ChecksumError, match=_git_id(config)):
        hub.fetch("hf://org/cfg/config.json", progress=False)
    fake_hub.add("org/cfg", "config.json", config, lfs=False)
    assert hub.fetch("hf://org/cfg/config.json", progress=False).read_bytes() == config
    assert _lock(domainfm_home)["hf://org/cfg@main/config.json"]["published"] == f"git-sha1 {_git_id(config)}"


def test_changed_upstream_file_is_refused_against_the_lock(fake_hub, domainfm_home):
    first, second = b"first version" * 50, b"second version" * 50
    fake_hub.add("org/moving", "w.bin", first, commit="1" * 40)
    url = "hf://org/moving/w.bin"
    assert hub.fetch(url, progress=False).read_bytes() == first
    fake_hub.add("org/moving", "w.bin", second, commit="2" * 40)  # main moved on, correctly published
    with pytest.raises(ChecksumError) as info:
        hub.fetch(url, progress=False)
    message = str(info.value)
    assert _sha(first) in message and _sha(second) in message and hub.LOCK_FILE_NAME in message
    assert _lock(domainfm_home)["hf://org/moving@main/w.bin"]["sha256"] == _sha(first)  # unchanged
    # the first commit, asked for by revision, is another lock entry and still loads
    assert hub.fetch(url, progress=False, revision="1" * 40).read_bytes() == first


def test_interrupted_download_leaves_no_file_and_succeeds_on_retry(fake_hub, monkeypatch, domainfm_home):
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(time, "sleep", lambda s: None)  # huggingface_hub waits 1 s between its retries
    # it writes (and can resume after) whole chunks of 10 MiB; small chunks make a small file resumable
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    body = bytes(range(256)) * 256
    fake_hub.add("org/cut", "w.bin", body, cut=100)  # every attempt is cut
    url = "hf://org/cut/w.bin"
    with pytest.raises(HubError, match="could not download hf://org/cut/w.bin"):
        hub.fetch(url, progress=False)
    assert len(fake_hub.requests("cdn", "GET")) >= 2  # huggingface_hub did retry (resuming)
    files = _repo_files(fake_hub.cache, "org/cut")
    assert not any(f.startswith("blobs/") and not f.endswith(".incomplete") for f in files)
    assert not any(f.startswith("snapshots/") for f in files)
    assert _lock(domainfm_home) == {}

    fake_hub.add("org/cut", "w.bin", body, cut=1)  # the next attempt is cut once, then resumed
    before = len(fake_hub.requests("cdn", "GET"))
    assert hub.fetch(url, progress=False).read_bytes() == body
    gets = fake_hub.requests("cdn", "GET")[before:]
    assert len(gets) == 2 and gets[1][3].get("range", "").startswith("bytes=")  # resumed with Range
    assert _lock(domainfm_home)["hf://org/cut@main/w.bin"]["sha256"] == _sha(body)


@pytest.mark.parametrize("switch", ["HF_HUB_OFFLINE", "DOMAINFM_OFFLINE"])
def test_offline_uses_the_cached_file_and_names_what_is_missing(switch, fake_hub, monkeypatch, domainfm_home):
    from huggingface_hub import constants

    body = b"cached weights" * 20
    fake_hub.add("org/off", "w.bin", body)
    assert hub.fetch("hf://org/off/w.bin", progress=False).read_bytes() == body
    n = len(fake_hub.log)
    if switch == "HF_HUB_OFFLINE":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    assert hub.fetch("hf://org/off/w.bin", progress=False).read_bytes() == body
    with pytest.raises(OfflineError) as info:
        hub.fetch("hf://org/off/other.bin", progress=False)
    assert "hf download org/off other.bin" in str(info.value)
    assert len(fake_hub.log) == n  # no request at all


def test_unreachable_hub_is_offline_at_once_and_the_cache_still_serves(fake_hub, monkeypatch, domainfm_home):
    import socket
    import time

    from huggingface_hub import constants

    body = b"cached before the network went away" * 10
    fake_hub.add("org/net", "w.bin", body)
    assert hub.fetch("hf://org/net/w.bin", progress=False).read_bytes() == body
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub.fetching, "_REACHABLE", {})
    start = time.monotonic()
    assert hub.fetch("hf://org/net/w.bin", progress=False).read_bytes() == body  # verified against the lock
    with pytest.raises(OfflineError, match="could not reach the Hub.*hf download org/net missing.bin"):
        hub.fetch("hf://org/net/missing.bin", progress=False)
    assert time.monotonic() - start < 10  # no half-minute of retries


def test_token_goes_to_the_hub_origin_but_not_to_the_cdn(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_for_tests")
    body = b"private weights" * 30
    fake_hub.add("org/private", "w.bin", body)
    assert hub.fetch("hf://org/private/w.bin", progress=False).read_bytes() == body
    hub_requests, cdn_requests = fake_hub.requests("hub"), fake_hub.requests("cdn")
    assert hub_requests and cdn_requests
    assert all(r[3].get("authorization") == "Bearer hf_dummy_for_tests" for r in hub_requests)
    assert all("authorization" not in r[3] for r in cdn_requests)


# --------------------------------------------------------------------------- sources


def test_timm_source_is_resolved_through_timms_pretrained_config(fake_hub, domainfm_home):
    import timm

    cfg = timm.models.get_pretrained_cfg("vit_small_patch14_dinov2.lvd142m")
    assert hub.resolve_timm("timm://vit_small_patch14_dinov2.lvd142m") == f"hf://{cfg.hf_hub_id}/model.safetensors"
    body = b"timm weights" * 10
    fake_hub.add(cfg.hf_hub_id, "model.safetensors", body)
    assert hub.fetch("timm://vit_small_patch14_dinov2.lvd142m", progress=False).read_bytes() == body
    assert f"hf://{cfg.hf_hub_id}@main/model.safetensors" in _lock(domainfm_home)
    with pytest.raises(HubError, match="no pretrained config"):
        hub.resolve_timm("timm://no_such_model.tag")


def test_whole_upstream_repository_source_with_its_config(fake_hub, tiny_zoo, domainfm_home):
    expected = tiny_zoo.state_dict(seed=4)
    config = {"model_type": "tiny", "d": 8}
    fake_hub.add("org/whole", "model.safetensors", safetensors_bytes(expected))
    fake_hub.add("org/whole", "config.json", json.dumps(config).encode(), lfs=False)
    tiny_zoo.register("dfmtest-repo", weights=[WeightSource("hf://org/whole")])
    model = domainfm.create_model("dfmtest-repo", pretrained=True, progress=False)
    _assert_state_equal(model, expected)
    assert model.domainfm_upstream_config == config
    assert {"hf://org/whole@main/model.safetensors", "hf://org/whole@main/config.json"} <= set(_lock(domainfm_home))


def test_explora_official_layouts_load_through_the_hub(fake_hub, tiny_zoo):
    """The ExPLoRA sources' converter on their files' layouts: the MAE fMoW-Sentinel encoder-only
    file (``{"model": SatMAE keys with norm.*, "args": Namespace}``) and the DINOv2 encoder-only file
    (``{"model": DINOv2 keys with mask_token}``, position table at another grid)."""
    from domainfm.models.explora import GroupChannelViT, convert_official
    from domainfm.zoo import get_card

    card = get_card("explora-vit-large-mae-fmow-sentinel")
    (source,) = card.weights
    assert source.url == "hf://samarkhanna/ExPLoRA/explora_mae_multispectral/explora_mae_fmow_sentinel_encoder_only.pth"
    kwargs = get_card("explora-multispectral-test").defaults
    torch.manual_seed(0)
    reference = GroupChannelViT(**{**kwargs, "n_outputs": 0})
    official = {("norm." + k[len("fc_norm."):] if k.startswith("fc_norm.") else k): v.clone()
                for k, v in reference.state_dict().items()}
    buffer = io.BytesIO()
    torch.save({"model": official, "args": argparse.Namespace(model="mae_vit_large_patch16", input_size=96)}, buffer)
    fake_hub.add("samarkhanna/ExPLoRA", "explora_mae_multispectral/explora_mae_fmow_sentinel_encoder_only.pth",
                 buffer.getvalue())
    tiny_zoo.register("dfmtest-sentinel", builder=lambda **kw: GroupChannelViT(**kw),
                      defaults={**kwargs, "n_outputs": 0}, weights=[source],
                      converters={"official": convert_official})
    model = domainfm.create_model("dfmtest-sentinel", pretrained=True, progress=False)
    _assert_state_equal(model, reference.state_dict())
    assert model.domainfm_load_report.converter == "official"

    rgb = get_card("explora-vit-large-dinov2-fmow-rgb").weights[0]
    assert rgb.url.endswith("explora_dinov2_fmow_rgb/explora_dinov2_vit_large_fmow_rgb_encoder_only.pth")
    small = domainfm.create_model("explora-test", n_outputs=0)
    sd = small.state_dict()
    from timm.layers import resample_abs_pos_embed

    bigger = resample_abs_pos_embed(sd["pos_embed"], new_size=[10, 10], num_prefix_tokens=1)
    dinov2_file = {"model": {**sd, "pos_embed": bigger, "mask_token": torch.zeros(1, sd["cls_token"].shape[-1])}}
    buffer = io.BytesIO()
    torch.save(dinov2_file, buffer)
    fake_hub.add("samarkhanna/ExPLoRA", "explora_dinov2_fmow_rgb/explora_dinov2_vit_large_fmow_rgb_encoder_only.pth",
                 buffer.getvalue())
    tiny_zoo.register("dfmtest-rgb", builder=get_card("explora-test").builder, defaults={"n_outputs": 0},
                      weights=[rgb], converters={"official": convert_official})
    loaded = domainfm.create_model("dfmtest-rgb", pretrained=True, progress=False)
    expected_pos = resample_abs_pos_embed(bigger, new_size=list(small.patch_embed.grid_size), num_prefix_tokens=1)
    assert torch.allclose(loaded.state_dict()["pos_embed"], expected_pos)
    for key, value in sd.items():
        if key != "pos_embed":
            assert torch.equal(loaded.state_dict()[key], value), key


def test_every_registered_source_is_listed_and_well_formed(capsys):
    from domainfm import zoo

    assert cli.main(["list", "--pretrained"]) == 0
    out = capsys.readouterr().out
    names = zoo.list_models(pretrained=True)
    for required in ["chronos-t5-tiny", "chronos-t5-mini", "chronos-t5-small", "chronos-t5-base", "chronos-t5-large",
                     "explora-vit-large-dinov2-fmow-rgb", "explora-vit-large-mae-fmow-sentinel",
                     "explora-dinov2-vit-small", "explora-dinov2-vit-large", "explora-mae-vit-base",
                     "explora-mae-vit-large", "cbramod-base"]:
        assert required in names
    for name in names:  # generic: whatever registers a source (e.g. chronos-bolt-*) is listed
        for source in zoo.get_card(name).weights:
            assert f"{name}" in out and source.url in out and f"licence={source.license}" in out
            assert source.sha256 is not None or source.url.startswith(("hf://", "timm://"))
            if source.url.startswith("timm://"):
                assert hub.resolve_timm(source.url).startswith("hf://timm/")
    assert "licence=Apache-2.0" in out and "timm://vit_large_patch14_dinov2.lvd142m" in out


def test_cli_download_fetches_and_verifies_each_source(fake_hub, tiny_zoo, domainfm_home, capsys):
    weights = safetensors_bytes(tiny_zoo.state_dict(seed=5))
    config = json.dumps({"d": 8}).encode()
    extra = b"second file" * 10
    fake_hub.add("org/fake", "model.safetensors", weights)
    fake_hub.add("org/fake", "config.json", config, lfs=False)
    fake_hub.add("org/other", "extra.bin", extra)
    tiny_zoo.register("dfmtest-dl", weights=[WeightSource("hf://org/fake", license="MIT"),
                                             WeightSource("hf://org/other/extra.bin", sha256=_sha(extra))])
    assert cli.main(["download", "dfmtest-dl", "--quiet"]) == 0
    out = capsys.readouterr().out
    for data in (weights, config, extra):
        assert f"sha256 {_sha(data)}" in out
    assert "verified: lock" in out and "verified: sha256" in out
    assert {"hf://org/fake@main/model.safetensors", "hf://org/fake@main/config.json"} <= set(_lock(domainfm_home))

    fake_hub.add("org/other", "extra.bin", extra + b"!", commit="e" * 40)  # changed upstream: the pin refuses it
    assert cli.main(["download", "dfmtest-dl", "--quiet", "--source", "hf://org/other/extra.bin"]) == 2
    assert _sha(extra) in capsys.readouterr().err


# --------------------------------------------------------------------------- Hub-ready folders


def test_saved_folder_on_the_hub_loads_by_repo_id(fake_hub, tiny_zoo, tmp_path, domainfm_home):
    torch.manual_seed(6)
    model = domainfm.create_model("dfmtest-tiny")
    report = {"task": "classification", "arms": {"lora": {"test": {"accuracy": 0.875}}}}
    folder = domainfm.save_pretrained(model, tmp_path / "model", report=report, arm="lora")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    for path in folder.iterdir():
        fake_hub.add("user/finetuned", path.name, path.read_bytes(), lfs=path.suffix == ".safetensors")

    loaded = domainfm.create_model("hf://user/finetuned", progress=False)
    _assert_state_equal(loaded, model.state_dict())
    assert loaded.domainfm_load_report.kind == "domainfm" and loaded.domainfm_load_report.source == "hf://user/finetuned"
    snapshot = hub.fetch("hf://user/finetuned/README.md", progress=False)
    meta = yaml.safe_load(snapshot.read_text().split("---")[1])
    assert meta["library_name"] == "domainfm"
    # a repository that is not a domainfm folder is refused with what to do instead
    fake_hub.add("org/upstream", "config.json", b'{"model_type": "t5"}', lfs=False)
    fake_hub.add("org/upstream", "model.safetensors", safetensors_bytes(model.state_dict()))
    with pytest.raises(HubError, match="pretrained="):
        domainfm.create_model("hf://org/upstream", progress=False)


@pytest.mark.parametrize("name", ["explora-dinov2-vit-small", "explora-dinov2-vit-base", "explora-dinov2-vit-large",
                                  "explora-mae-vit-base", "explora-mae-vit-large"])
def test_timm_starting_points_fit_their_cards(name):
    """timm's pretrained model for each start has our card's keys and shapes (on the meta device,
    no memory), except DINOv2's position table at 518 px, which the card's converter resamples."""
    import timm

    from domainfm.zoo import get_card

    (source,) = get_card(name).weights
    assert source.url.startswith("timm://") and source.converter == "official"
    tag = source.url[len("timm://"):]
    with torch.device("meta"):
        theirs = timm.create_model(tag, pretrained=False).state_dict()
        ours = domainfm.create_model(name).state_dict()
    assert sorted(theirs) == sorted(ours)
    differ = [k for k in ours if ours[k].shape != theirs[k].shape]
    assert differ == (["pos_embed"] if "dinov2" in name else [])
    assert get_card(name).license == source.license == ("Apache-2.0" if "dinov2" in name else "CC-BY-NC-4.0")


def test_dinov2_start_loads_timms_file_from_the_hub(fake_hub):
    """``explora-dinov2-vit-small``, pretrained=True: timm's file (518-px position table) is fetched
    from the repository timm names, verified, converted and loaded; every tensor but the resampled
    position table equals timm's."""
    import timm
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    reference = timm.create_model("vit_small_patch14_dinov2.lvd142m", pretrained=False)
    sd = {k: v.contiguous() for k, v in reference.state_dict().items()}
    cfg = timm.models.get_pretrained_cfg("vit_small_patch14_dinov2.lvd142m")
    fake_hub.add(cfg.hf_hub_id, "model.safetensors", safetensors_bytes(sd))
    model = domainfm.create_model("explora-dinov2-vit-small", pretrained=True, progress=False)
    got = model.state_dict()
    assert got["pos_embed"].shape == (1, 1 + 16 * 16, 384)
    assert torch.equal(got["pos_embed"], resample_abs_pos_embed(sd["pos_embed"], new_size=[16, 16], num_prefix_tokens=1))
    assert all(torch.equal(got[k], v) for k, v in sd.items() if k != "pos_embed")
