"""Downloads: hf:// and timm:// through huggingface_hub, https:// and file:// streamed and verified, package:// read in place."""
from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path


from domainfm.atomic import atomic_path
from domainfm.hub.base import ChecksumError, HubError, OfflineError, WEIGHTS_NAME, _CHUNK
from domainfm.hub.cache import _download_url_for, _lock_entry, _lock_file, _record_entry, _record_sha256, _recorded_sha256, cache_path_for, is_offline, sha256_file

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
