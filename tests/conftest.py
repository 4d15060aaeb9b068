"""Shared fixtures: an isolated ``DOMAINFM_HOME``, tiny registered test models, a local HTTP server.

Nothing here touches the network or the user's cache: every test gets its own
``$DOMAINFM_HOME`` and the weights server listens on 127.0.0.1 only.
"""
from __future__ import annotations

import http.server
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from domainfm import zoo

TEST_FAMILY = "dfmtest"
TEST_FAMILY_OTHER = "dfmtestother"


@pytest.fixture(autouse=True)
def domainfm_home(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets a fresh, empty ``$DOMAINFM_HOME`` and starts online."""
    path = tmp_path_factory.mktemp("domainfm_home")
    monkeypatch.setenv("DOMAINFM_HOME", str(path))
    monkeypatch.delenv("DOMAINFM_OFFLINE", raising=False)
    # urllib honours *_proxy variables; the local server must be reached directly.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return path


# --------------------------------------------------------------------------- tiny models


class TinyNet(nn.Module):
    """A two-part model with the zoo's surface: a body and a classifier ``head``."""

    def __init__(self, n_chans: int = 3, n_outputs: int = 2, hidden: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_chans, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.head = nn.Linear(hidden, n_outputs)
        self.n_outputs = n_outputs
        self.register_buffer("scale", torch.ones(hidden))
        self.num_features = hidden

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return features if pre_logits else self.head(features)

    def reset_classifier(self, n_outputs: int) -> None:
        self.head = nn.Linear(self.num_features, n_outputs)
        self.n_outputs = n_outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def tiny_state_dict(seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    """A deterministic, non-default state_dict for ``TinyNet(**kwargs)``."""
    torch.manual_seed(seed)
    model = TinyNet(**kwargs)
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)  # differs from the fresh buffer, so a missed load shows
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@dataclass
class TinyZoo:
    """Registers test variants and removes them (restoring any previous card) afterwards."""

    _saved: dict[str, zoo.ModelCard | None] = field(default_factory=dict)
    # test modules reach these through the fixture (--import-mode=importlib: no `import conftest`)
    Net = TinyNet
    state_dict = staticmethod(tiny_state_dict)

    def register(self, name: str, *, family: str = TEST_FAMILY, builder: Callable[..., nn.Module] | None = None,
                 **card) -> str:
        if name not in self._saved:
            self._saved[name] = zoo._REGISTRY.get(name)
        card.setdefault("defaults", {"n_chans": 3, "n_outputs": 2, "hidden": 8})
        card.setdefault("head", "head")
        card.setdefault("paper", "https://example.org/tiny-paper")
        card.setdefault("license", "MIT")
        card.setdefault("input_spec", {"n_chans": 3, "sfreq": 100.0})
        zoo.register_model(name, family=family, overwrite=True, **card)(builder or _build_tiny)
        return name

    def restore(self) -> None:
        for name, previous in self._saved.items():
            zoo.unregister_model(name)
            if previous is not None:
                zoo._REGISTRY[name] = previous
        self._saved.clear()


def _build_tiny(**kwargs) -> nn.Module:
    """Tiny test network."""
    return TinyNet(**kwargs)


@pytest.fixture
def tiny_zoo():
    """``dfmtest-tiny`` and ``dfmtest-small`` (family dfmtest) and ``dfmtestother-tiny``; more via
    ``tiny_zoo.register(name, weights=[...], ...)``. All are removed after the test."""
    registry = TinyZoo()
    registry.register("dfmtest-tiny")
    registry.register("dfmtest-small", defaults={"n_chans": 3, "n_outputs": 2, "hidden": 16})
    registry.register("dfmtestother-tiny", family=TEST_FAMILY_OTHER)
    try:
        yield registry
    finally:
        registry.restore()


# --------------------------------------------------------------------------- local HTTP server


@dataclass
class _Route:
    body: bytes
    truncate: bool = False
    chunked: bool = False
    location: str | None = None  # answer 302 Found with this Location instead


class LocalServer:
    """Serves registered bytes on 127.0.0.1 and counts hits per path."""

    def __init__(self):
        self.routes: dict[str, _Route] = {}
        self.hits: dict[str, int] = {}
        self.authorization: list[str | None] = []  # the Authorization header of every request
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # for chunked responses; every connection is closed after one request
            timeout = 10  # a stuck client cannot hold a handler thread forever

            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                with server._lock:
                    server.hits[path] = server.hits.get(path, 0) + 1
                    server.authorization.append(self.headers.get("Authorization"))
                    route = server.routes.get(path)
                if route is None:
                    self.send_error(404, "not served by the test server")
                    return
                if route.location is not None:
                    self.send_response(302)
                    self.send_header("Location", route.location)
                    self.send_header("Content-Length", "0")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    return
                body = route.body[: len(route.body) // 2] if route.truncate else route.body
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Connection", "close")
                if route.chunked:
                    # HTTP/1.1 chunked: one chunk announcing the whole body; cut short, it stops midway
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"%x\r\n" % len(route.body) + body)
                    if not route.truncate:
                        self.wfile.write(b"\r\n0\r\n\r\n")
                else:
                    # A cut-short response promises the whole body, sends half of it, then closes.
                    self.send_header("Content-Length", str(len(route.body)))
                    self.end_headers()
                    self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args):  # keep pytest output clean
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve(self, path: str, body: bytes, *, truncate: bool = False, chunked: bool = False) -> str:
        """Serve ``body`` at ``path``; ``truncate`` sends half of what Content-Length (or the chunk
        header, with ``chunked``) promises, then closes the connection."""
        if not path.startswith("/"):
            path = "/" + path
        with self._lock:
            self.routes[path] = _Route(body=body, truncate=truncate, chunked=chunked)
        return self.base + path

    def redirect(self, path: str, location: str) -> str:
        """Answer ``path`` with 302 Found to ``location``."""
        with self._lock:
            self.routes[path] = _Route(body=b"", location=location)
        return self.base + path

    def hit_count(self, path: str) -> int:
        if not path.startswith("/"):
            path = "/" + path
        with self._lock:
            return self.hits.get(path, 0)

    def total_hits(self) -> int:
        with self._lock:
            return sum(self.hits.values())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def http_server():
    with LocalServer() as server:
        yield server


@pytest.fixture
def other_http_server():
    """A second server: another origin (another port on 127.0.0.1)."""
    with LocalServer() as server:
        yield server


@pytest.fixture
def hf_hub(monkeypatch, tmp_path):
    """A local server answering like the Hugging Face Hub (see tests/test_hub_hf.py's FakeHub), set
    as huggingface_hub's endpoint with a per-test cache: for tests elsewhere that load hf:// sources."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fake_hub_module", Path(__file__).with_name("test_hub_hf.py"))
    import sys

    module = sys.modules.get("_fake_hub_module")
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["_fake_hub_module"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    gen = module.fake_hub.__wrapped__(monkeypatch, tmp_path) if hasattr(module.fake_hub, "__wrapped__") else None
    if gen is None:  # pytest fixtures keep the function as __pytest_wrapped__
        gen = module.fake_hub.__pytest_wrapped__.obj(monkeypatch, tmp_path)
    server = next(gen)
    try:
        yield server
    finally:
        gen.close()
