"""Where weights live: the cache folder, the lock file of digests seen on first download, sha256."""
from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


from domainfm.atomic import atomic_write_text
from domainfm.hub.base import HubError, _CHUNK

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
