"""``runs/<family>/<name>/``: one object owns every file of a run, and every write is atomic.

    RUN/
      config.yaml        the resolved config            run.json     family, kind, overrides, version
      report.json        the nested report              report.md    the same as a table
      metrics.jsonl      (single-arm runs) engine log   checkpoints/ last.ckpt, best.safetensors
      stages/<i>-<family>/   in-process stages (their own run folders)
      <arm>/             one folder per arm: metrics.jsonl, checkpoints/, model/ (create_model(RUN/<arm>/model)),
                         adapter/ (LoRA, PEFT file pair), seed<k>/ when an arm is repeated over seeds
                         (a finished experiment keeps model/ and adapter/ only: its checkpoints/ are
                         removed unless keep_checkpoints: true)
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from domainfm.atomic import atomic_write_json, atomic_write_text, remove_stale_temps

__all__ = ["RunFolder", "RunFolderError", "LOCK_NAME"]

#: the lock file of a run folder: holds the pid of the process running it
LOCK_NAME = ".lock"
#: locks this process holds: path -> open file descriptor (re-entrant within one process)
_HELD: dict[Path, int] = {}


class RunFolderError(RuntimeError):
    pass


class RunFolder:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def of(cls, path: str | os.PathLike) -> "RunFolder | None":
        """The finished run ``path`` is, or lies in (a model folder ``RUN/<arm>/model`` or
        ``RUN/<arm>/seed<k>/model``, an arm folder): the nearest folder at most three levels up
        holding ``config.yaml`` and ``report.json``; None when there is none."""
        path = Path(path)
        for candidate in [path, *list(path.parents)[:3]]:
            if (candidate / "report.json").is_file() and (candidate / "config.yaml").is_file():
                return cls(candidate)
        return None

    @classmethod
    def create(cls, path: str | os.PathLike, *, resume: bool = False) -> "RunFolder":
        """A folder for a new run. An existing non-empty folder is refused unless ``resume``
        (a finished run is never overwritten or mixed with another one)."""
        folder = cls(path)
        if folder.path.is_dir():
            folder.lock()  # refuses a folder another live process is running
        try:
            if folder.path.exists() and any(p.name != LOCK_NAME for p in folder.path.iterdir()) and not resume:
                raise RunFolderError(
                    f"run folder {folder.path} already holds a run: choose another --name, or pass "
                    "train.resume=true to continue that run")
            folder.path.mkdir(parents=True, exist_ok=True)
            folder.lock()
        except BaseException:
            folder.release()
            raise
        remove_stale_temps(folder.path)
        return folder

    # -- the lock: one process per run folder -------------------------------------------------

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_NAME

    def lock(self) -> None:
        """Hold ``RUN/.lock`` for this process's life (released by :meth:`release` or at exit).

        The file is created with ``O_EXCL`` and holds the pid. A lock whose process is gone
        (killed) is stale and taken over; one of a live process is refused. Where ``fcntl`` exists
        the file is also ``flock``-ed, so two processes taking over the same stale lock cannot
        both win. Re-entrant within one process (stages and arms of one run share it)."""
        key = self.lock_file.resolve()
        if key in _HELD:
            return
        for _ in range(20):
            try:
                fd = os.open(self.lock_file, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            except FileExistsError:
                owner = self._lock_owner()
                held = self._locked_by_other()
                if (held if held is not None else owner is not None) and (owner is None or _alive(owner)):
                    who = f"process {owner}" if owner is not None else "another process"
                    raise RunFolderError(
                        f"run folder {self.path} is in use by {who} (lock {self.lock_file}): wait for "
                        "it to finish, or choose another --name") from None
                # stale: its process is gone (or it never got to write its pid)
                if self._try_take_over():
                    return
                continue
            if self._finish_lock(fd):
                return
        raise RunFolderError(f"run folder {self.path}: could not take the lock {self.lock_file}")

    def release(self) -> None:
        """Give up the lock (nothing if this process does not hold it)."""
        key = self.lock_file.resolve()
        fd = _HELD.pop(key, None)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if self._lock_owner() == os.getpid():
                self.lock_file.unlink()
        with contextlib.suppress(OSError):
            os.close(fd)

    def _finish_lock(self, fd: int) -> bool:
        try:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
        except ImportError:  # pragma: no cover - no fcntl (Windows): pid only
            pass
        # the file may have been replaced between open and flock: hold it only if it is still ours
        try:
            same = os.fstat(fd).st_ino == os.stat(self.lock_file).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        _HELD[self.lock_file.resolve()] = fd
        return True

    def _try_take_over(self) -> bool:
        try:
            fd = os.open(self.lock_file, os.O_RDWR)
        except FileNotFoundError:
            return False
        return self._finish_lock(fd)

    def _locked_by_other(self) -> bool | None:
        """Whether another open file holds an flock on the lock file (None where unknowable)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover
            return None
        try:
            fd = os.open(self.lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def _lock_owner(self) -> int | None:
        try:
            text = self.lock_file.read_text().split()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return int(text[0]) if text and text[0].isdigit() else None

    # -- paths ------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def report_file(self) -> Path:
        return self.path / "report.json"

    @property
    def meta_file(self) -> Path:
        return self.path / "run.json"

    def arm_dir(self, arm: str, seed: int | None = None) -> Path:
        safe = arm.replace(":", "-")
        return self.path / safe / f"seed{seed}" if seed is not None else self.path / safe

    def model_dir(self, arm: str) -> Path:
        return self.arm_dir(arm) / "model"

    def adapter_dir(self, arm: str) -> Path:
        return self.arm_dir(arm) / "adapter"

    def stage_dir(self, index: int, family: str) -> Path:
        return self.path / "stages" / f"{index}-{family}"

    # -- writes (all atomic) ----------------------------------------------------------------

    def write_config(self, cfg: Any) -> Path:
        from domainfm import config as cfgmod

        cfgmod.save_yaml(cfg, self.config_file)  # atomic (domainfm.atomic)
        return self.config_file

    def write_meta(self, **meta: Any) -> Path:
        from domainfm import __version__

        meta = {"domainfm_version": __version__, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
        return atomic_write_json(self.meta_file, meta)

    def write_report(self, report: dict[str, Any]) -> Path:
        """``report.json`` and ``report.md`` (the comparison table, then every picture the report
        lists, embedded: see :func:`domainfm.experiment.pictures.markdown_section`)."""
        from domainfm.experiment.pictures import markdown_section
        from domainfm.experiment.report import to_markdown

        text = to_markdown(report)
        section = markdown_section(report)
        if section:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
        atomic_write_text(self.path / "report.md", text)
        return atomic_write_json(self.report_file, report)

    def write_json(self, name: str, obj: Any) -> Path:
        return atomic_write_json(self.path / name, obj)

    def prune_checkpoints(self) -> int:
        """After a finished experiment: remove its training checkpoints (``last.ckpt`` for resuming
        and ``best.safetensors``, in every arm, seed and stage folder below the run's top level);
        each arm's selected model stays in ``<arm>/model`` (or ``adapter``) and each stage's in its
        saved model folder. Returns the bytes freed."""
        freed = 0
        for folder in sorted(self.path.glob("*/**/checkpoints")):
            for name in ("last.ckpt", "best.safetensors"):
                file = folder / name
                if file.is_file():
                    freed += file.stat().st_size
                    file.unlink()
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when nothing else is in it
        return freed

    # -- reads ------------------------------------------------------------------------------

    def read_meta(self) -> dict[str, Any]:
        if not self.meta_file.is_file():
            raise RunFolderError(f"{self.path} is not a domainfm run folder (no run.json)")
        return json.loads(self.meta_file.read_text())

    def read_report(self) -> dict[str, Any]:
        if not self.report_file.is_file():
            raise RunFolderError(f"{self.path}: no report.json (the run did not finish)")
        return json.loads(self.report_file.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        RunFolder(key.parent).release()
