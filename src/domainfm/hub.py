"""Weights hub: resolve, download, verify (sha256), cache, convert and load.

``create_model(name, pretrained=...)`` accepts

* ``True``: the first weight source of the variant's model card;
* ``"hf://org/repo"``: an upstream repository with ``config.json`` + ``model.safetensors``;
* ``"hf://org/repo/path/to/file"`` or ``"https://..."`` / ``"file://..."``: a URL. When the
  URL is one of the card's sources its recorded sha256 is verified; any other URL needs
  ``sha256=`` or is loaded with a warning that prints the digest it had;
* a local file (``.safetensors`` or a torch checkpoint, read with ``weights_only=True``);
* a directory written by :func:`save_pretrained`, or one laid out as an upstream repo
  (``model.safetensors`` / ``pytorch_model.bin`` beside a ``config.json``).

Which files are converted is decided by what the file is, never by how many keys happen to
match: our own format (a :func:`save_pretrained` folder, whose ``config.json`` has a
``domainfm`` block, or a safetensors file whose metadata names ``domainfm_model``) is loaded as
is; any other file is an upstream checkpoint and always goes through a converter (the
``converter=`` argument, else the weight source's recorded one, else the card's only one).
Every converter is idempotent, so a file that already holds our keys passes through unchanged.

Downloads go to a temporary file beside the destination, are hashed while streaming, and are
renamed into the cache (``$DOMAINFM_HOME/weights``, default ``~/.cache/domainfm/weights``) only
when the full sha256 matches, so the cache never holds a partial or unverified file. A file
downloaded without a pinned sha256 has its digest recorded in ``$DOMAINFM_HOME/weights.lock.json``
and verified on every later load (a file changed in the cache is refused). The cache key is the
whole URL (query string included; credentials and queries only as a digest in the path). With
``DOMAINFM_OFFLINE=1`` nothing is downloaded; a missing file is an error that names where to
put it. Nothing is ever unpickled with arbitrary code.
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import pickle
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from domainfm import zoo
from domainfm.atomic import atomic_path, atomic_write_text

__all__ = [
    "HubError",
    "ChecksumError",
    "OfflineError",
    "UnsafeCheckpointError",
    "LoadReport",
    "home",
    "weights_dir",
    "is_offline",
    "cache_path_for",
    "fetch",
    "fetch_hf_repo",
    "sha256_file",
    "load_checkpoint",
    "load_state_dict_into",
    "load_pretrained",
    "is_own_file",
    "create_model",
    "save_pretrained",
    "write_model_card",
    "model_card_text",
    "download",
    "parse_hf",
    "resolve_timm",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "OWN_METADATA_KEY",
    "LOCK_FILE_NAME",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: safetensors metadata key that marks a file written by domainfm (its value: the variant name)
OWN_METADATA_KEY = "domainfm_model"
_CHUNK = 1 << 20


class HubError(RuntimeError):
    """Base class of every weights-hub error."""


class ChecksumError(HubError):
    pass


class OfflineError(HubError):
    pass


class UnsafeCheckpointError(HubError):
    pass


# --------------------------------------------------------------------------- locations


def home() -> Path:
    """``$DOMAINFM_HOME`` or ``~/.cache/domainfm``."""
    return Path(os.environ.get("DOMAINFM_HOME") or Path.home() / ".cache" / "domainfm").expanduser()


def weights_dir() -> Path:
    return home() / "weights"


def is_offline() -> bool:
    return os.environ.get("DOMAINFM_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _split_hf(url: str) -> tuple[str, str]:
    """``hf://org/repo/a/b.pth`` -> (``org/repo``, ``a/b.pth``)."""
    parts = url[len("hf://") :].strip("/").split("/")
    if len(parts) < 3:
        raise ValueError(f"{url!r}: an hf:// source must name a file, as hf://org/repo/path/to/file")
    if any(p in {"", ".", ".."} for p in parts):
        # the path becomes the cache path: an empty, '.' or '..' segment could leave the cache
        raise ValueError(f"{url!r}: an hf:// path may not contain empty, '.' or '..' segments")
    return "/".join(parts[:2]), "/".join(parts[2:])


def cache_path_for(url: str) -> Path:
    """Where the cache keeps the file behind ``url`` (hf://org/repo/f -> weights/hf/org/repo/f).

    The whole URL is the key: a query string (``?version=2``) or credentials give another file,
    kept under a ``q-<digest>`` folder, so neither credentials nor tokens ever appear in a path."""
    if url.startswith("hf://"):
        repo, path = _split_hf(url)
        return weights_dir() / "hf" / repo / path
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in {"http", "https"}:
        raise ValueError(f"{url!r}: not a downloadable URL (expected hf://, https:// or http://)")
    safe = [p for p in parsed.path.split("/") if p not in {"", ".", ".."}]
    host = (parsed.hostname or "") + (f"_{parsed.port}" if parsed.port else "")
    userinfo = parsed.netloc.rpartition("@")[0]
    if parsed.query or userinfo:
        key = hashlib.sha256(f"{userinfo}@?{parsed.query}".encode()).hexdigest()[:16]
        safe = [*safe[:-1], f"q-{key}", *safe[-1:]] if safe else [f"q-{key}"]
    return weights_dir() / "url" / host / Path(*safe) if safe else weights_dir() / "url" / host / "index"


#: ``$DOMAINFM_HOME/<this>``: the sha256 of every file downloaded without a pinned digest,
#: recorded at download and verified on every later load
LOCK_FILE_NAME = "weights.lock.json"


def _lock_file() -> Path:
    return home() / LOCK_FILE_NAME


def _redact(url: str) -> str:
    parsed = urllib.parse.urlsplit(url)
    if "@" in parsed.netloc:
        parsed = parsed._replace(netloc=parsed.netloc.rpartition("@")[2])
    return urllib.parse.urlunsplit(parsed._replace(query="…" if parsed.query else ""))


def _lock_key(dest: Path) -> str:
    return dest.relative_to(weights_dir()).as_posix()


def _lock_entry(key: str) -> dict | None:
    path = _lock_file()
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text()).get("files", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        raise HubError(f"{path}: not a readable weights lock file ({exc}); delete it to record digests anew") from exc
    entry = files.get(key)
    return entry if isinstance(entry, dict) else None


def _recorded_sha256(dest: Path) -> str | None:
    entry = _lock_entry(_lock_key(dest))
    return entry.get("sha256") if entry else None


def _record_entry(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` in the lock file (read-modify-write under an flock where available)."""
    import contextlib
    import time

    path = _lock_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    guard = open(path.with_name(f".{path.name}.guard"), "a+")
    try:
        with contextlib.suppress(ImportError):
            import fcntl

            fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
        data = {"files": {}}
        if path.is_file():
            with contextlib.suppress(json.JSONDecodeError):
                data = json.loads(path.read_text())
        data.setdefault("files", {})[key] = {**entry, "recorded": time.strftime("%Y-%m-%dT%H:%M:%S")}
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    finally:
        guard.close()


def _record_sha256(dest: Path, url: str, digest: str) -> None:
    _record_entry(_lock_key(dest), {"url": _redact(url), "sha256": digest, "size": dest.stat().st_size})


def _download_url_for(url: str) -> str:
    if url.startswith("hf://"):
        repo, path = _split_hf(url)
        revision = "main"
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        from huggingface_hub import hf_hub_url

        return hf_hub_url(repo_id=repo, filename=path, revision=revision)
    return url


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- download


# ----- hf:// and timm:// through huggingface_hub

_HEX64 = frozenset("0123456789abcdef")


def _is_hex(text: str, n: int) -> bool:
    return len(text) == n and set(text) <= _HEX64


def parse_hf(url: str) -> tuple[str, str | None, str | None]:
    """``hf://org/repo[@rev][/path]`` -> (``org/repo``, ``rev`` or None, ``path`` or None)."""
    parts = url[len("hf://") :].strip("/").split("/")
    if len(parts) < 2 or any(p in {"", ".", ".."} for p in parts):
        raise ValueError(f"{url!r}: expected hf://org/repo[@revision][/path/to/file] without empty, '.' or '..' segments")
    repo, revision = "/".join(parts[:2]), None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        if not revision:
            raise ValueError(f"{url!r}: empty revision after '@'")
    return repo, revision, "/".join(parts[2:]) or None


def resolve_timm(url: str) -> str:
    """``timm://<model>.<tag>`` -> the ``hf://`` file timm's own pretrained config names
    (``hf_hub_id`` + ``hf_hub_filename``, default ``model.safetensors`` as timm itself loads)."""
    name = url[len("timm://") :].strip("/")
    try:
        from timm.models import get_pretrained_cfg
    except ImportError as exc:  # pragma: no cover - timm is a dependency
        raise HubError(f"{url}: timm is not installed") from exc
    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise HubError(f"{url}: timm has no pretrained config {name!r} (timm.list_pretrained() lists them)")
    hub_id = getattr(cfg, "hf_hub_id", None)
    if not hub_id:
        raise HubError(f"{url}: timm's pretrained config for {name!r} names no Hugging Face repository (hf_hub_id)")
    repo, _, revision = hub_id.partition("@")
    filename = getattr(cfg, "hf_hub_filename", None) or WEIGHTS_NAME
    return f"hf://{repo}" + (f"@{revision}" if revision else "") + f"/{filename}"


def _hf_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.is_offline_mode())
    except Exception:  # pragma: no cover
        return False


def _is_unreachable(exc: BaseException | None) -> bool:
    """A network that cannot be reached (no route, DNS, timeout, offline mode), as opposed to an
    answer from the Hub (404, 401, ...)."""
    if exc is None:
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, urllib.error.URLError)):
        return True
    try:
        import httpx2 as httpx  # huggingface_hub >= 2 ships its own httpx fork
    except ImportError:  # pragma: no cover
        try:
            import httpx
        except ImportError:
            httpx = None
    if httpx is not None and isinstance(exc, (httpx.ConnectError, httpx.TimeoutException)):
        return True
    return type(exc).__name__ in {"OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "ReadTimeout"}


_REACHABLE: dict[tuple[str, int], tuple[float, bool]] = {}


def _endpoint_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub endpoint accepts a TCP connection (remembered for a minute). Without it,
    huggingface_hub would retry an unreachable Hub with back-off for about half a minute before
    saying a file is not cached; we then go straight to the cache."""
    import socket
    import time

    from huggingface_hub import constants

    parsed = urllib.parse.urlsplit(constants.ENDPOINT)
    key = (parsed.hostname or "", parsed.port or (443 if parsed.scheme == "https" else 80))
    now = time.monotonic()
    if key in _REACHABLE and now - _REACHABLE[key][0] < 60:
        return _REACHABLE[key][1]
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or os.environ.get("HTTP_PROXY"):
        ok = True  # through a proxy the endpoint itself may not be reachable directly: let the client decide
    else:
        try:
            socket.create_connection(key, timeout=timeout).close()
            ok = True
        except OSError:
            ok = False
    _REACHABLE[key] = (now, ok)
    return ok


def _git_blob_sha1(path: Path) -> str:
    """The git object id of a file (what the Hub publishes as the ETag of a non-LFS file)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324 - git's id, not security
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _published_digest(local: Path) -> tuple[str | None, str | None]:
    """(kind, digest) the Hub published for a file in its cache: the blob a snapshot entry links
    to is named after the file's ETag, the sha256 for LFS files (``X-Linked-Etag``) and the git
    blob id for the others. (None, None) where the cache keeps no link (symlinks unsupported)."""
    blob = Path(os.path.realpath(local))
    if blob.parent.name != "blobs":
        return None, None
    name = blob.name.lower()
    if _is_hex(name, 64):
        return "sha256", name
    if _is_hex(name, 40):
        return "git-sha1", name
    return None, None


def _evict(local: Path) -> None:
    """Remove a refused file from the Hub cache: its blob and the snapshot entry linking to it."""
    import contextlib

    blob = Path(os.path.realpath(local))
    for path in (local, blob):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class _QuietTqdm:
    """A progress-bar class that shows nothing (``progress=False``)."""

    def __new__(cls, *args, **kwargs):
        from tqdm.auto import tqdm

        kwargs["disable"] = True
        return tqdm(*args, **kwargs)


def _fetch_hf(url: str, sha256: str | None, *, progress: bool = True, revision: str | None = None) -> Path:
    """Download one ``hf://org/repo[@rev]/file`` through huggingface_hub (its cache, resumable
    downloads, ``HF_HUB_OFFLINE`` and ``HF_TOKEN``), then verify it (see :func:`fetch`)."""
    repo, url_revision, filename = parse_hf(url)
    if filename is None:
        raise ValueError(f"{url!r}: an hf:// source must name a file, as hf://org/repo/path/to/file")
    revision = url_revision or revision
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = is_offline() or _hf_offline()
    shown = f"hf://{repo}" + (f"@{revision}" if revision else "") + f"/{filename}"
    unreachable = not offline and not _endpoint_reachable()
    try:
        local = Path(hf_hub_download(repo, filename, revision=revision, local_files_only=is_offline() or unreachable,
                                     library_name="domainfm", tqdm_class=None if progress else _QuietTqdm))
    except LocalEntryNotFoundError as exc:
        cause = exc.__cause__ or exc.__context__
        if unreachable:
            cause = ConnectionError(f"cannot connect to {constants.ENDPOINT}")
        if not offline and not _is_unreachable(cause):
            raise HubError(f"could not download {shown} ({type(cause or exc).__name__}: {cause or exc})") from exc
        if not offline:
            raise OfflineError(
                f"could not reach the Hub for {shown} ({type(cause).__name__}: {cause}) and it is not in the Hugging "
                f"Face cache ({constants.HF_HUB_CACHE}). With network access run `hf download {repo} {filename}"
                + (f" --revision {revision}" if revision else "") + "` (or `domainfm download NAME`), or pass the "
                "file's path as pretrained=PATH.") from exc
        raise OfflineError(
            f"offline (DOMAINFM_OFFLINE or HF_HUB_OFFLINE is set) and {shown} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). On a connected machine run `hf download {repo} {filename}"
            + (f" --revision {revision}" if revision else "") + "` (or `domainfm download NAME`) and copy that cache "
            "here, or download the file and pass its path as pretrained=PATH"
            + (f" (sha256 {sha256.lower()})" if sha256 else "") + "."
        ) from exc
    except (OSError, ValueError) as exc:
        raise HubError(f"could not download {shown} ({exc})") from exc
    except Exception as exc:  # noqa: BLE001 - httpx/huggingface_hub errors, named with the source
        raise HubError(f"could not download {shown} ({type(exc).__name__}: {exc})") from exc

    actual = sha256_file(local)
    kind, published = _published_digest(local)
    if sha256 is not None and actual != sha256.lower():
        _evict(local)
        raise ChecksumError(f"{shown}: downloaded file has sha256 {actual}, but the card pins {sha256.lower()}; "
                            "removed from the Hugging Face cache")
    if kind == "sha256" and actual != published:
        _evict(local)
        raise ChecksumError(f"{shown}: downloaded file has sha256 {actual}, but the Hub publishes sha256 {published} "
                            "for it; removed from the Hugging Face cache")
    if kind == "git-sha1" and (git_id := _git_blob_sha1(local)) != published:
        _evict(local)
        raise ChecksumError(f"{shown}: downloaded file has git id {git_id} (sha256 {actual}), but the "
                            f"Hub publishes git id {published} for it; removed from the Hugging Face cache")
    if sha256 is None:
        # trust on first use, enforced after: the digest seen first is recorded in the lock file
        key = f"hf://{repo}@{revision or 'main'}/{filename}"
        entry = _lock_entry(key)
        depth = len(filename.split("/"))
        commit = local.parents[depth - 1].name if len(local.parents) >= depth else None
        if entry is None:
            if kind is None:
                warnings.warn(f"{shown}: the Hub published no digest this cache could keep (no blob link); its sha256 "
                              f"{actual} is recorded in {_lock_file()} and enforced from now on", stacklevel=3)
            _record_entry(key, {"url": key, "sha256": actual, "size": local.stat().st_size, "commit": commit,
                                "published": f"{kind} {published}" if kind else "none"})
        elif entry.get("sha256") != actual:
            raise ChecksumError(
                f"{shown}: the file now has sha256 {actual} (commit {commit}), but sha256 {entry.get('sha256')} was "
                f"recorded for it on first download (commit {entry.get('commit')}) in {_lock_file()}. Refusing a "
                f"changed file; if the upstream change is expected, delete the entry {key!r} from that file.")
    return local




def _origin(url: str) -> tuple[str, str]:
    return urllib.parse.urlsplit(url)[:2]


class _SameOriginAuthRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects, re-sending the Authorization header only to the same origin.

    The token is added as an "unredirected" header, which urllib never copies onto a redirect
    (its default handler would copy an ordinary one to any host, e.g. the CDN the Hub redirects
    file downloads to); this handler puts it back when the new URL has the same origin."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        auth = req.unredirected_hdrs.get("Authorization")
        if new is not None and auth and _origin(newurl) == _origin(req.full_url):
            new.add_unredirected_header("Authorization", auth)
        return new


def _stream_to(url: str, tmp_path: Path, progress: bool, desc: str) -> str:
    request = urllib.request.Request(url, headers={"User-Agent": "domainfm"})
    # The token goes only to the Hub's own origin: a prefix test would also match
    # https://huggingface.co.example.net (or port 80 of an endpoint on port 8080).
    endpoints = ("https://huggingface.co", os.environ.get("HF_ENDPOINT", ""))
    if _origin(url) in {_origin(e) for e in endpoints if e}:
        try:
            from huggingface_hub import get_token

            token = get_token()
            if token:
                request.add_unredirected_header("Authorization", f"Bearer {token}")
        except Exception:  # pragma: no cover - token lookup is best effort
            pass
    digest = hashlib.sha256()
    opener = urllib.request.build_opener(_SameOriginAuthRedirects)
    with opener.open(request, timeout=60) as response:
        total = response.headers.get("Content-Length")
        total = int(total) if total and total.isdigit() else None
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)
        received = 0
        try:
            with open(tmp_path, "wb") as out:
                while True:
                    chunk = response.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
        if total is not None and received != total:
            raise HubError(f"download of {url} was cut short: {received} of {total} bytes")
    return digest.hexdigest()


def fetch(url: str, sha256: str | None = None, *, progress: bool = True, revision: str | None = None) -> Path:
    """Return the local path of ``url``, downloading and verifying it if it is not cached.

    ``hf://org/repo[@rev]/file`` (and ``timm://model.tag``, resolved through timm's pretrained
    config) go through ``huggingface_hub.hf_hub_download``: its shared cache, resumable
    downloads, ``HF_HUB_OFFLINE``/``HF_TOKEN`` (the token goes to the Hub only, never to the CDN
    it redirects to). The file is then verified against ``sha256`` when given, else against the
    digest the Hub publishes for it (the sha256 of an LFS file, the git id of another) at
    ``revision``, and its sha256 is recorded in the lock file on first download and enforced from
    then on. A refused file is removed from the Hugging Face cache.

    ``file://`` URLs and plain paths are verified in place (not copied). A cached file is trusted
    only when its sha256 matches (when one is given); a mismatching cached file is an error.
    """
    if url.startswith(("file://", PACKAGE_SCHEME)) or "://" not in url:
        if url.startswith(PACKAGE_SCHEME):
            path = package_path(url)
        else:
            path = Path(urllib.parse.urlparse(url).path if url.startswith("file://") else url)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        if sha256 is not None:
            actual = sha256_file(path)
            if actual != sha256.lower():
                raise ChecksumError(f"{path}: sha256 {actual} does not match the expected {sha256.lower()}")
        return path

    if url.startswith("timm://"):
        url = resolve_timm(url)
    if url.startswith("hf://"):
        return _fetch_hf(url, sha256, progress=progress, revision=revision)
    dest = cache_path_for(url)
    if dest.is_file():
        if sha256 is not None:
            actual = sha256_file(dest)
            if actual != sha256.lower():
                raise ChecksumError(
                    f"cached file {dest} has sha256 {actual}, expected {sha256.lower()}: delete it to download again"
                )
            return dest
        # no pinned digest: the one recorded at download (lock file) is verified on every load
        recorded = _recorded_sha256(dest)
        actual = sha256_file(dest)
        if recorded is None:
            warnings.warn(f"cached file {dest} has no recorded sha256 (cached before digests were recorded); "
                          f"recording its sha256 {actual} in {_lock_file()}", stacklevel=2)
            _record_sha256(dest, url, actual)
        elif actual != recorded:
            raise ChecksumError(
                f"cached file {dest} has sha256 {actual}, but {recorded} was recorded when it was downloaded "
                f"({_lock_file()}): it changed since; delete it to download again")
        return dest
    if is_offline():
        raise OfflineError(
            f"DOMAINFM_OFFLINE is set and {url} is not in the cache. Download it elsewhere and place the "
            f"file at {dest}" + (f" (sha256 {sha256.lower()})" if sha256 else "") + ", or unset DOMAINFM_OFFLINE."
        )
    # the temporary file is renamed into the cache only when complete and verified; on any
    # error (or Ctrl-C) atomic_path removes it, so no partial file stays behind
    with atomic_path(dest) as tmp_path:
        try:
            actual = _stream_to(_download_url_for(url), tmp_path, progress, dest.name)
        except (urllib.error.URLError, http.client.HTTPException, OSError, TimeoutError) as exc:
            raise HubError(
                f"could not download {url} ({exc}). If this machine is offline, download it elsewhere and place "
                f"it at {dest}" + (f" (sha256 {sha256.lower()})" if sha256 else "") + "."
            ) from exc
        if sha256 is not None and actual != sha256.lower():
            raise ChecksumError(f"{url}: downloaded file has sha256 {actual}, expected {sha256.lower()}; not cached")
        if sha256 is None:
            warnings.warn(f"{url} has no recorded sha256; the downloaded file's sha256 is {actual}", stacklevel=2)
    if sha256 is None:
        _record_sha256(dest, url, actual)
    return dest


#: files shipped inside an installed package: ``package://<module>/<path inside the module>``
PACKAGE_SCHEME = "package://"


def package_path(url: str) -> Path:
    """The local path of a ``package://domainfm.models.fim/weights/FILE`` source (a file shipped in
    the installed package: nothing to download, verified by its pinned sha256 like any other)."""
    import importlib.resources

    rest = url[len(PACKAGE_SCHEME):]
    module, _, inner = rest.partition("/")
    if not module or not inner or ".." in inner.split("/"):
        raise HubError(f"{url}: expected package://<module>/<path inside the module>")
    try:
        root = importlib.resources.files(module)
    except ModuleNotFoundError as exc:
        raise HubError(f"{url}: module {module!r} is not installed") from exc
    path = Path(str(root.joinpath(*inner.split("/"))))
    if not path.is_file():
        raise FileNotFoundError(f"{url}: the shipped file {path} is missing from this installation (a wheel built "
                                "without its package data?)")
    return path


# --------------------------------------------------------------------------- reading checkpoints


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint without executing code: safetensors, or ``torch.load(weights_only=True)``.

    A file that is none of safetensors, a torch zip archive or a pickle is reported as not a
    checkpoint; "would execute code" is said only where the unpickler met a code reference."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    kind = _file_kind(path)
    if kind is None:
        with open(path, "rb") as fh:
            head = fh.read(16)
        raise HubError(f"{path}: not a checkpoint: not a safetensors file, not a torch zip archive, not a pickle "
                       f"(it starts with {head!r})")
    if kind == "safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:
            raise HubError(f"{path}: not a readable safetensors file ({exc})") from exc
    try:
        # argparse.Namespace is the one extra class allowed, as plain data: MAE-style training
        # scripts (MAE, SatMAE, ExPLoRA) store their command-line ``args`` in the checkpoint
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        code = _code_reference(str(exc))
        if code is not None:
            raise UnsafeCheckpointError(
                f"{path}: refused to load. The file contains Python objects that are not plain tensors/containers "
                f"and loading it would execute code ({code}). Convert it to safetensors in a trusted environment."
            ) from exc
        raise HubError(f"{path}: corrupt {_KIND_NAMES[kind]} ({_last_line(exc)})") from exc
    except Exception as exc:  # noqa: BLE001 - the unpickler raises KeyError/IndexError/... on damaged data
        raise HubError(f"{path}: corrupt or truncated {_KIND_NAMES[kind]} ({type(exc).__name__}: {_last_line(exc)})") from exc


_KIND_NAMES = {"zip": "torch zip archive", "pickle": "pickle (legacy torch checkpoint)", "safetensors": "safetensors file"}


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("Check the documentation")]
    return lines[-1] if lines else type(exc).__name__


def _code_reference(message: str) -> str | None:
    """The global the weights-only unpickler refused (a class or function the file would call)."""
    import re

    match = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"[Uu]nsupported global:? ([\w.]+)", message)
    if match:
        return f"it references {match.group(1)}"
    match = re.search(r"(Trying to (?:call reduce|instantiate|set) [^\n]*)", message)
    return match.group(1) if match else None


def _file_kind(path: Path) -> str | None:
    """``"safetensors"``, ``"zip"`` (torch's format), ``"pickle"`` (legacy torch / plain pickle)
    or ``None`` (none of these), from the file's bytes, not its name."""
    import pickletools
    import struct

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(9)
        if len(head) == 9:
            (n,) = struct.unpack("<Q", head[:8])
            if 2 <= n <= size - 8 and head[8:9] == b"{":
                return "safetensors"
        if zipfile.is_zipfile(fh):
            return "zip"
        fh.seek(0)
        # a pickle: a stream of known opcodes ending in STOP (for a legacy torch file, the first of
        # its pickles: the magic number); text and random bytes fail within a few opcodes
        try:
            for opcode, _arg, _pos in pickletools.genops(fh):
                if opcode.name == "STOP":
                    return "pickle"
        except Exception:  # noqa: BLE001 - anything the opcode reader rejects is not a pickle
            return None
    return None


def _unwrap_state_dict(obj: Any, key: str | None) -> dict[str, torch.Tensor]:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            raise HubError(f"checkpoint has no entry {key!r} (top-level keys: {list(obj)[:10] if isinstance(obj, Mapping) else type(obj).__name__})")
        obj = obj[key]
    if not isinstance(obj, Mapping):
        raise HubError(f"checkpoint is a {type(obj).__name__}, not a state_dict")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj)
    for candidate in ("state_dict", "model", "model_state_dict", "module"):
        if candidate in obj and isinstance(obj[candidate], Mapping):
            return _unwrap_state_dict(obj[candidate], None)
    non_tensor = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)][:5]
    raise HubError(f"checkpoint is not a flat state_dict (non-tensor entries: {non_tensor})")


# --------------------------------------------------------------------------- loading into a model


@dataclass
class LoadReport:
    """What happened when a checkpoint was loaded into a model."""

    source: str
    sha256: str | None = None
    #: ``"domainfm"`` (our own format, loaded as is) or ``"upstream"`` (went through the converter)
    kind: str = "upstream"
    converter: str | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    dropped_head: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"loaded {self.source} ({self.kind} file" + (f", sha256 {self.sha256[:12]}…)" if self.sha256 else ")")]
        if self.converter:
            lines.append(f"  converted with: {self.converter}")
        for label, keys in (("missing", self.missing), ("unexpected", self.unexpected), ("dropped head (shape changed)", self.dropped_head)):
            if keys:
                lines.append(f"  {label}: {', '.join(keys)}")
        return "\n".join(lines)


def _is_head_key(key: str, heads: tuple[str, ...]) -> bool:
    return any(key == h or key.startswith(h + ".") for h in heads)


def load_state_dict_into(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    heads: tuple[str, ...] = (),
    strict: bool = True,
    source: str = "<state_dict>",
) -> LoadReport:
    """Load ``state_dict`` into ``model``, naming every missing/unexpected key.

    Head keys (prefixes in ``heads``) whose shape changed are dropped and the head keeps its fresh
    initialisation; any other shape mismatch is an error. With ``strict`` any missing key outside
    the head or any unexpected key raises :class:`HubError`; otherwise they are warned about.
    """
    own = model.state_dict()
    report = LoadReport(source=source)
    filtered: dict[str, torch.Tensor] = {}
    mismatched = []
    for key, value in state_dict.items():
        if key not in own:
            report.unexpected.append(key)
            continue
        if own[key].shape != value.shape:
            if _is_head_key(key, heads):
                report.dropped_head.append(key)
                continue
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(own[key].shape)}")
            continue
        if own[key].is_floating_point() and not value.is_floating_point():
            # load_state_dict would copy it, rounding nothing but silently loading integers
            raise HubError(f"{source}: tensor {key!r} is stored as {value.dtype}, but the model's parameter is "
                           f"{own[key].dtype}: not a checkpoint of this model's floating-point weights")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise HubError(f"{source}: tensor {key!r} contains NaN or inf")
        filtered[key] = value
    report.missing = [k for k in own if k not in filtered and k not in report.dropped_head]
    if mismatched:
        raise HubError(f"{source}: shape mismatch for {len(mismatched)} key(s): " + "; ".join(mismatched))
    missing_body = [k for k in report.missing if not _is_head_key(k, heads)]
    problems = []
    if missing_body:
        problems.append(f"missing keys: {', '.join(missing_body)}")
    if report.unexpected:
        problems.append(f"unexpected keys: {', '.join(report.unexpected)}")
    if problems and strict:
        raise HubError(f"{source} does not match {type(model).__name__}: " + "; ".join(problems))
    if problems:
        warnings.warn(f"{source}: " + "; ".join(problems), stacklevel=2)
    model.load_state_dict(filtered, strict=False)
    return report


def is_own_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file written by domainfm (its metadata names the variant
    under ``domainfm_model``, as :func:`save_pretrained` writes it)."""
    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as exc:
        raise HubError(f"{path}: not a readable safetensors file ({exc})") from exc
    return bool(metadata.get(OWN_METADATA_KEY))


REPO_FILES = (CONFIG_NAME, WEIGHTS_NAME)


def _is_hf_repo(url: str) -> bool:
    return url.startswith("hf://") and len(url[len("hf://") :].strip("/").split("/")) == 2


def fetch_hf_repo(url: str, *, card: zoo.ModelCard | None = None, sha256: str | Mapping[str, str] | None = None,
                  files: tuple[str, ...] = REPO_FILES, optional: tuple[str, ...] = (), progress: bool = True,
                  revision: str | None = None) -> Path:
    """Fetch a repository laid out as ``config.json`` + ``model.safetensors`` (``hf://org/repo``
    or ``hf://org/repo@revision``) through :func:`fetch` and return its snapshot folder.

    Each file's sha256 comes from ``sha256`` (a mapping file -> digest) or from the card's weight
    source ``hf://org/repo/<file>``; a file with neither is verified against the digest the Hub
    publishes and the lock file. ``optional`` files (e.g. ``README.md``) are fetched when present.
    """
    repo, url_revision, path = parse_hf(url)
    if path is not None:
        raise ValueError(f"{url!r}: expected a whole repository, hf://org/repo[@revision]")
    revision = url_revision or revision
    digests = dict(sha256) if isinstance(sha256, Mapping) else {}
    if card is not None:
        for source in card.weights:
            if source.url.startswith(f"hf://{repo}/") and source.sha256:
                digests.setdefault(source.url[len(f"hf://{repo}/") :], source.sha256)
            elif source.url.rstrip("/") in (f"hf://{repo}", url.rstrip("/")) and source.sha256:
                digests.setdefault(WEIGHTS_NAME, source.sha256)  # a whole-repository source pins its weights
    base = f"hf://{repo}" + (f"@{revision}" if revision else "")
    folder = None
    for name in files:
        path = fetch(f"{base}/{name}", digests.get(name), progress=progress)
        folder = path.parent
    for name in optional:
        try:
            fetch(f"{base}/{name}", digests.get(name), progress=progress)
        except ChecksumError:
            raise
        except HubError:
            pass  # absent: optional
    return folder


def download(source: zoo.WeightSource | str, *, progress: bool = True) -> list[tuple[str, Path, str]]:
    """Fetch and verify one weight source (a file, or a whole ``hf://org/repo``):
    ``[(url, local path, sha256), ...]`` for each file. What ``domainfm download`` runs."""
    url, sha256, revision = (source, None, None) if isinstance(source, str) else (source.url, source.sha256, source.revision)
    if url.startswith("timm://"):
        url = resolve_timm(url)
    if _is_hf_repo(url):
        folder = fetch_hf_repo(url, progress=progress, revision=revision)
        return [(f"{url}/{name}", folder / name, sha256_file(folder / name)) for name in REPO_FILES]
    path = fetch(url, sha256, progress=progress, revision=revision)
    return [(url, path, sha256 or sha256_file(path))]


def _read_dir(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """(state_dict, config, own): ``own`` when ``config.json`` has our ``domainfm`` block (a
    :func:`save_pretrained` folder; its recorded sha256 is verified), else an upstream repo layout."""
    config = {}
    config_file = directory / CONFIG_NAME
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise HubError(f"{config_file}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise HubError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    own = isinstance(config.get("domainfm"), Mapping)
    for name in (WEIGHTS_NAME, "pytorch_model.bin", "model.pt", "model.pth"):
        path = directory / name
        if path.is_file():
            recorded = config["domainfm"].get("sha256") if own else None
            if recorded is not None and sha256_file(path) != recorded:
                raise ChecksumError(f"{path}: sha256 does not match the one recorded in {config_file}")
            return _unwrap_state_dict(load_checkpoint(path), None), config, own or is_own_file(path)
    raise FileNotFoundError(f"{directory}: no {WEIGHTS_NAME} (or pytorch_model.bin) in this directory")


def _pick_converter(
    converter: str | Callable | None,
    card: zoo.ModelCard | None,
    source_obj: zoo.WeightSource | None,
    location: str,
) -> tuple[str | None, Callable | None]:
    """The converter for an upstream file: ``converter=`` (a card name or a callable), else the
    weight source's recorded one (``None`` there: the source already holds our keys), else the
    card's only converter; several and none chosen is an error."""
    if callable(converter):
        return getattr(converter, "__name__", "callable"), converter
    if converter is not None:
        if card is None or converter not in card.converters:
            available = sorted(card.converters) if card is not None else []
            raise HubError(f"unknown converter {converter!r}; this model has {available}")
        return converter, card.converters[converter]
    if source_obj is not None:
        name = source_obj.converter
        return (name, card.converters[name]) if name is not None else (None, None)
    if card is None or not card.converters:
        return None, None
    if len(card.converters) == 1:
        return next(iter(card.converters.items()))
    raise HubError(
        f"{location} is an upstream checkpoint (not written by domainfm) and {card.name} has several "
        f"converters ({sorted(card.converters)}); pass converter=NAME"
    )


def load_pretrained(
    model: nn.Module,
    pretrained: bool | str | os.PathLike = True,
    *,
    card: zoo.ModelCard | str | None = None,
    converter: str | Callable | None = None,
    sha256: str | None = None,
    strict: bool = True,
    progress: bool = True,
) -> LoadReport:
    """Load weights into ``model`` from a card's source, a URL, a file or a directory.

    What the file is decides the conversion. Our own format (a :func:`save_pretrained` folder,
    or a safetensors file whose metadata names ``domainfm_model``) is loaded as is. Any other
    file is upstream and is always converted, by: the ``converter`` argument (a name in the
    card's converters, or a callable ``fn(state_dict, model) -> state_dict``); else the weight
    source's recorded converter; else the card's only converter. An explicit ``converter`` also
    applies to our own files (converters are idempotent, so that is harmless). Head weights
    whose shape changed are dropped.
    """
    if card is None:
        card = getattr(model, "domainfm_name", None)
    if isinstance(card, str):
        card = zoo.get_card(card)
    heads = card.head if card is not None else ()
    source_obj: zoo.WeightSource | None = None
    upstream_config: dict[str, Any] = {}

    if pretrained is True:
        if card is None or not card.weights:
            name = card.name if card is not None else type(model).__name__
            raise HubError(f"{name} has no pretrained weights registered; pass a path or URL as pretrained=")
        source_obj = card.weights[0]
    elif isinstance(pretrained, str) and "://" in pretrained and card is not None:
        source_obj = next((w for w in card.weights if w.url == pretrained), None)

    if source_obj is not None and _is_hf_repo(resolve_timm(source_obj.url) if source_obj.url.startswith("timm://")
                                              else source_obj.url):
        location = source_obj.url
        raw, config, own = _read_dir(fetch_hf_repo(source_obj.url, card=card, progress=progress,
                                                   revision=source_obj.revision))
        digest = None
        if not own:
            upstream_config = config
    elif source_obj is not None:
        location = source_obj.url
        path = fetch(source_obj.url, source_obj.sha256, progress=progress, revision=source_obj.revision)
        digest = source_obj.sha256 or sha256_file(path)
        raw = _unwrap_state_dict(load_checkpoint(path), source_obj.state_dict_key)
        own = is_own_file(path)
    else:
        location = str(pretrained)
        local = Path(pretrained) if "://" not in location else None
        if local is not None and local.is_dir():
            raw, config, own = _read_dir(local)
            digest = None
        elif _is_hf_repo(location):
            raw, config, own = _read_dir(fetch_hf_repo(location, card=card, sha256=sha256, progress=progress))
            digest = None
        else:
            path = fetch(location, sha256, progress=progress)
            digest = sha256 or sha256_file(path)
            raw = _unwrap_state_dict(load_checkpoint(path), None)
            own, config = is_own_file(path), {}
        if not own:
            upstream_config = config

    if upstream_config:
        # before conversion: a converter may need the upstream config (e.g. tied embeddings)
        model.domainfm_upstream_config = upstream_config
    if own and converter is None:
        converter_name, convert = None, None
    else:
        converter_name, convert = _pick_converter(converter, card, source_obj, location)
    state_dict = convert(raw, model) if convert is not None else raw
    report = load_state_dict_into(model, state_dict, heads=heads, strict=strict, source=location)
    report.sha256 = digest
    report.kind = "domainfm" if own else "upstream"
    report.converter = converter_name
    model.domainfm_load_report = report
    return report


# --------------------------------------------------------------------------- own format


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    raise TypeError(f"model keyword value {value!r} ({type(value).__name__}) cannot be written to JSON")


def save_pretrained(model: nn.Module, directory: str | os.PathLike, *, report: Mapping[str, Any] | None = None,
                    arm: str | None = None, card: bool = True) -> Path:
    """Write ``model.safetensors`` + ``config.json`` so that ``create_model(directory)`` rebuilds it,
    and a ``README.md`` model card in the Hub's format (see :func:`write_model_card`; ``report``
    and ``arm`` are passed on to it, ``card=False`` skips it). The folder can be uploaded as is
    (``hf upload user/repo DIR``) and loaded back with ``create_model("hf://user/repo")``.

    The model must come from :func:`create_model` (it remembers its variant and keywords). Both
    files are written through :mod:`domainfm.atomic`, so a crash leaves no half-written file.
    """
    from safetensors.torch import save_model

    name = getattr(model, "domainfm_name", None)
    if name is None:
        raise ValueError("save_pretrained needs a model made by domainfm.create_model (it records the variant name)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = dict(getattr(model, "domainfm_kwargs", {}))
    n_outputs = getattr(model, "n_outputs", None)
    if "n_outputs" in kwargs and isinstance(n_outputs, int):
        # reset_classifier() after create_model() changed the head: record its size as it is now
        kwargs["n_outputs"] = n_outputs
    config = {
        "domainfm": {
            "model_name": name,
            "model_kwargs": _jsonable(kwargs),
            "format_version": 1,
        }
    }
    # weights first, then the config that records their digest: a crash in between leaves a
    # folder whose digest check fails loudly, never one that loads the wrong weights silently
    with atomic_path(directory / WEIGHTS_NAME) as tmp_weights:
        save_model(model, str(tmp_weights), metadata={"format": "pt", OWN_METADATA_KEY: name})
        config["domainfm"]["sha256"] = sha256_file(tmp_weights)
    atomic_write_text(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    if card:
        write_model_card(directory, model, report=report, arm=arm)
    return directory


# --------------------------------------------------------------------------- model cards

MODEL_CARD_NAME = "README.md"


def _hub_repo_of(url: str | None) -> str | None:
    """The Hub repository id behind a weight location (hf://, timm://, a Hub cache path)."""
    if not url:
        return None
    url = str(url)
    if url.startswith("timm://"):
        try:
            url = resolve_timm(url)
        except HubError:
            return None
    if url.startswith("hf://"):
        try:
            return parse_hf(url)[0]
        except ValueError:
            return None
    marker = f"{os.sep}models--"
    if marker in url:  # a file in the Hugging Face cache: .../models--org--name/snapshots/...
        return url.split(marker, 1)[1].split(os.sep, 1)[0].replace("--", "/")
    return None


def _flat_numbers(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(prefix, value)]
    if isinstance(value, Mapping):
        out = []
        for key, item in value.items():
            out += _flat_numbers(item, f"{prefix}/{key}" if prefix else str(key))
        return out
    return []


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def model_card_text(model: nn.Module, report: Mapping[str, Any] | None = None, *, arm: str | None = None,
                    base_model: str | None = None, datasets: list[str] | None = None,
                    license: str | None = None) -> str:
    """The ``README.md`` model card of a domainfm model, in the Hub's format: YAML front matter
    (``library_name: domainfm``, ``license``, ``base_model``, ``tags``, ``datasets`` where known)
    and a body saying what the model is, how it was trained and its metrics (from ``report``, a
    run's ``report.json`` as a dict; ``arm`` picks that arm's metrics), and the licence of the
    weights it started from."""
    import yaml

    name = getattr(model, "domainfm_name", None) or type(model).__name__
    try:
        zcard = zoo.get_card(name)
    except KeyError:
        zcard = None
    load = getattr(model, "domainfm_load_report", None)
    start = zcard.weights[0] if zcard is not None and zcard.weights else None
    loaded_from = getattr(load, "source", None)
    base = base_model or _hub_repo_of(loaded_from) or (_hub_repo_of(start.url) if start is not None else None)
    start_license = (start.license if start is not None and (loaded_from in (None, start.url)) else None)
    if start_license is None and zcard is not None and loaded_from is not None:
        start_license = next((w.license for w in zcard.weights if w.url == loaded_from), None)
    report = dict(report or {})
    arm_report = dict(report.get("arms", {}).get(arm, {})) if arm and isinstance(report.get("arms"), Mapping) else {}
    data = report.get("data") if isinstance(report.get("data"), Mapping) else {}
    if datasets is None:
        found = report.get("datasets") or data.get("dataset") or data.get("datasets")
        datasets = [found] if isinstance(found, str) else (list(found) if isinstance(found, (list, tuple)) else [])
    family = zcard.family if zcard is not None else None
    tags = ["domainfm"] + [t for t in (family, zcard.domain if zcard is not None else None) if t]
    meta: dict[str, Any] = {"library_name": "domainfm",
                            "license": _hub_license(license or (zcard.license if zcard is not None else None))}
    if base:
        meta["base_model"] = base
    meta["tags"] = tags
    if datasets:
        meta["datasets"] = [str(d) for d in datasets]

    n_params = sum(p.numel() for p in model.parameters())
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {name}", ""]
    if zcard is not None and zcard.description:
        lines += [zcard.description, ""]
    lines += ["## Model", "", f"- architecture: `{type(model).__module__}.{type(model).__name__}`",
              f"- parameters: {n_params:,}"]
    if family:
        lines.append(f"- family: {family}" + (f" ({zcard.domain})" if zcard.domain else ""))
    if zcard is not None and zcard.paper:
        lines.append(f"- paper: {zcard.paper}")
    if zcard is not None and zcard.input_spec:
        spec = ", ".join(f"{k}={v}" for k, v in zcard.input_spec.items() if not isinstance(v, (list, dict)))
        lines.append(f"- input: {spec}")
    lines += ["", "Load it with domainfm:", "", "```python", "import domainfm", "",
              'model = domainfm.create_model("hf://USER/REPO")  # or a local folder path', "```", ""]

    lines += ["## Training", ""]
    if report:
        for key in ("kind", "task", "model", "monitor", "labels", "wall_time_s"):
            if key in report and not isinstance(report[key], (Mapping, list)):
                lines.append(f"- {key}: {_md_cell(report[key])}")
        for key in ("init", "mode", "seed", "steps", "best_step"):
            if key in arm_report and not isinstance(arm_report[key], (Mapping, list)):
                lines.append(f"- {key}: {_md_cell(arm_report[key])}")
        for key, value in _flat_numbers(arm_report.get("params") or report.get("params") or {}, "params"):
            lines.append(f"- {key}: {_fmt(value)}")
        for key, value in data.items():
            if not isinstance(value, (Mapping, list)):
                lines.append(f"- data/{key}: {_md_cell(value)}")
        lines.append("")
        metrics = []
        if arm_report:
            for split in ("val", "test", "zero_shot", "probe", "retained"):
                metrics += _flat_numbers(arm_report.get(split, {}), split)
        elif isinstance(report.get("arms"), Mapping):
            for arm_name, arm_value in report["arms"].items():
                if isinstance(arm_value, Mapping):
                    metrics += _flat_numbers(arm_value.get("test", {}), f"{arm_name}/test")
        else:
            metrics = _flat_numbers(report.get("metrics", report))
        if metrics:
            lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
            lines += [f"| {_md_cell(k)} | {_fmt(v)} |" for k, v in metrics[:200]]
            lines.append("")
    else:
        lines += ["No training report was given: these are the weights as saved.", ""]

    lines += ["## Licence", ""]
    lines.append(f"- this model card's code licence (the {name} card): {zcard.license if zcard is not None else 'unknown'}")
    if loaded_from or start is not None:
        src = loaded_from or start.url
        lines.append(f"- started from {src}" + (f", weights licensed {start_license}" if start_license else "")
                     + "; the licence of the weights it started from applies to this derivative")
    lines.append("")
    return "\n".join(lines)


_HUB_LICENSES = {"apache-2.0", "mit", "cc-by-4.0", "cc-by-nc-4.0", "cc-by-sa-4.0", "cc-by-nc-sa-4.0", "bsd-3-clause",
                 "gpl-3.0", "cc0-1.0", "openrail", "other", "unknown"}


def _hub_license(text: str | None) -> str:
    """The Hub's licence identifier (lower-case SPDX-like), ``other`` for anything it does not know."""
    value = (text or "unknown").strip().lower()
    return value if value in _HUB_LICENSES else "other"


def write_model_card(directory: str | os.PathLike, model: nn.Module, report: Mapping[str, Any] | None = None, *,
                     arm: str | None = None, **kwargs: Any) -> Path:
    """Write ``directory/README.md`` (atomically): the model card of :func:`model_card_text`."""
    path = Path(directory) / MODEL_CARD_NAME
    atomic_write_text(path, model_card_text(model, report, arm=arm, **kwargs))
    return path


def _create_from_saved(directory: Path, config: dict[str, Any], kwargs: dict[str, Any]) -> nn.Module:
    from safetensors.torch import load_model

    meta = config["domainfm"]
    model_kwargs = {**meta.get("model_kwargs", {}), **kwargs}
    model = zoo.build_model(meta["model_name"], **model_kwargs)
    weights = directory / WEIGHTS_NAME
    recorded = meta.get("sha256")
    if recorded is not None and sha256_file(weights) != recorded:
        raise ChecksumError(f"{weights}: sha256 does not match the one recorded in {directory / CONFIG_NAME}")
    changed_head = any(k in kwargs for k in ("n_outputs", "num_classes"))
    if changed_head:
        card = zoo.get_card(meta["model_name"])
        report = load_state_dict_into(
            model, load_checkpoint(weights), heads=card.head, strict=True, source=str(directory)
        )
    else:
        try:
            missing, unexpected = load_model(model, str(weights), strict=False)
        except Exception as exc:
            raise HubError(f"{weights}: could not be loaded ({exc})") from exc
        if missing or unexpected:
            raise HubError(f"{directory}: missing keys {sorted(missing)}; unexpected keys {sorted(unexpected)}")
        report = LoadReport(source=str(directory))
    report.sha256 = recorded
    report.kind = "domainfm"
    model.domainfm_load_report = report
    return model


def create_model(
    name: str | os.PathLike,
    pretrained: bool | str | os.PathLike = False,
    *,
    converter: str | Callable | None = None,
    sha256: str | None = None,
    strict: bool = True,
    progress: bool = True,
    **kwargs: Any,
) -> nn.Module:
    """Build a registered model (or one saved with :func:`save_pretrained`) and load weights.

    Args:
        name: a registered variant (``domainfm.list_models()``), a directory written by
            :func:`save_pretrained`, or such a folder on the Hub, ``"hf://user/repo[@revision]"``.
        pretrained: ``False`` (random init), ``True`` (the card's first weight source), a URL
            (``hf://org/repo/file``, ``https://…``, ``file://…``), a checkpoint file or directory.
        converter: name of one of the card's converters (or a callable) for upstream files.
        sha256: expected digest of a URL/file that is not one of the card's sources.
        strict: raise on any missing/unexpected key (the head excepted when its shape changed).
        **kwargs: override the variant's defaults (e.g. ``n_outputs=4, n_chans=22``).
    """
    if str(name).startswith("hf://"):
        if not _is_hf_repo(str(name)):
            raise HubError(f"{name}: create_model takes a whole repository, hf://user/repo[@revision]; for one "
                           "file of an upstream checkpoint use create_model(NAME, pretrained='hf://...')")
        folder = fetch_hf_repo(str(name), sha256=sha256 and {WEIGHTS_NAME: sha256}, optional=(MODEL_CARD_NAME,),
                               progress=progress)
        config = json.loads((folder / CONFIG_NAME).read_text())
        if not isinstance(config, dict) or "domainfm" not in config:
            raise HubError(f"{name}: not a domainfm model repository (its {CONFIG_NAME} has no 'domainfm' block); "
                           "for an upstream repository use create_model(NAME, pretrained='" + str(name) + "')")
        model = _create_from_saved(folder, config, kwargs)
        model.domainfm_load_report.source = str(name)
        return model
    path = Path(name)
    if path.is_dir():
        config_file = path / CONFIG_NAME
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if "domainfm" not in config:
            raise HubError(f"{path}: not a domainfm model directory (no 'domainfm' block in {config_file})")
        return _create_from_saved(path, config, kwargs)
    name = str(name)
    base, tag = zoo.split_tag(name)
    model = zoo.build_model(base, **kwargs)
    if pretrained is True and tag is not None:  # "<model>.<tag>": that tag's source
        pretrained = next(w.url for w in zoo.get_card(base).weights if w.tag == tag)
    if pretrained is not False and pretrained is not None:
        load_pretrained(model, pretrained, card=base, converter=converter, sha256=sha256, strict=strict, progress=progress)
    return model
