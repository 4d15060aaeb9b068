"""The one atomic writer: every file domainfm writes goes to a temporary name beside its target
and is renamed over it only when complete, so a crash, a full disk or Ctrl-C never leaves a
half-written checkpoint, report or output behind (``os.replace`` is atomic on one filesystem).

    with atomic_path("out/model.safetensors") as tmp:
        save_file(tensors, str(tmp))          # written to .model.safetensors.tmp-PID-N

Temporary names start with ``.`` and contain ``.tmp-``: :func:`remove_stale_temps` clears those
left by a killed process.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_path", "atomic_paths", "follower_writes", "atomic_write_text", "atomic_write_bytes", "atomic_write_json", "atomic_torch_save",
           "remove_stale_temps", "TMP_MARK"]

TMP_MARK = ".tmp-"
_counter = itertools.count()
#: where a follower process's writes go instead of their targets (see :func:`follower_writes`)
_scratch: Path | None = None


@contextlib.contextmanager
def follower_writes() -> Iterator[Path]:
    """Within the block, every write through this module goes to a private scratch folder and
    is discarded instead of being renamed onto its target: for the ranks of a multi-process run
    other than rank 0, which compute the same model but must not write into the run folder rank
    0 owns (two writers renaming onto one checkpoint or report). Process-wide; the CLI enters it
    only in those ranks."""
    import shutil
    import tempfile

    global _scratch
    previous = _scratch
    _scratch = Path(tempfile.mkdtemp(prefix="domainfm-follower-"))
    try:
        yield _scratch
    finally:
        shutil.rmtree(_scratch, ignore_errors=True)
        _scratch = previous


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` when the block succeeds,
    remove it when the block raises. ``suffix`` keeps an extension some writers insist on
    (e.g. ``.npz``, ``.tif``)."""
    path = Path(path)
    if _scratch is not None:
        tmp = _scratch / f"{next(_counter)}-{path.name}{suffix}"
        try:
            yield tmp
        finally:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                tmp.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{next(_counter)}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) == str(tmp):
            # the user asked for ``path``; the hidden temporary beside it means nothing to them
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        if (type(exc) is RuntimeError or (type(exc) is OSError and exc.filename is None)) and str(path) not in str(exc):
            # writers such as torch.save report a full or read-only disk without naming the file
            # (only those bare errors: a caller's own exception types pass through unchanged)
            raise OSError(f"cannot write {path}: {exc}") from exc
        raise


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike | None) -> Iterator[list[Path | None]]:
    """Several outputs committed together: yield one temporary path per target (``None`` stays
    ``None``, for an optional output); only when the block succeeds are they renamed onto their
    targets, so a failure while writing the second file (an unwritable ``--plot``) leaves none of
    them behind. Each temporary keeps its target's extension (writers such as matplotlib and
    numpy choose the format by it)."""
    with contextlib.ExitStack() as stack:
        tmps = [None if p is None else stack.enter_context(atomic_path(p, suffix=Path(p).suffix)) for p in paths]
        yield tmps


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete temporary files of :func:`atomic_path` under ``directory`` whose writing process is
    gone (killed mid-write); files of a live process are left alone. Returns what was removed."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for tmp in directory.rglob(f".*{TMP_MARK}*"):
        pid_text = tmp.name.split(TMP_MARK, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and _alive(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            tmp.unlink()
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
