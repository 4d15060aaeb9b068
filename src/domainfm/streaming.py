"""Pretraining corpora as LitData optimized shards: converted once (``domainfm prepare FAMILY``),
then read by any number of processes, from local disk or object storage.

* :func:`prepare` runs a family's per-file conversion over the input files with
  :func:`litdata.optimize` (in parallel over files, in parts: an interrupted conversion started
  again converts only the parts not yet done) and writes ``domainfm_prepared.json`` beside the parts (each a LitData folder with its ``index.json``):
  the family, what went in (each file's path, size and sha256), the preprocessing settings and
  the sample count. The manifest is written last: a folder without it is unfinished.
* :class:`PreparedCorpus` reads such a folder (a path, or ``s3://...``/``gs://...`` through
  LitData's downloader and chunk cache) as a map-style dataset whose :attr:`~PreparedCorpus.blocks`
  are LitData's chunks.

Why the engine's own sampler and not LitData's shuffling: LitData assigns chunks to ranks, so the
samples of a global batch depend on the number of processes. The engine's
:class:`~domainfm.engine.ResumableSampler` draws one global order per epoch from the seed alone
(chunks shuffled, then samples within windows of a few chunks, so reads stay within the chunks
in LitData's cache) and deals it out to the ranks: one process with batch 2B and two with batch
B see the same samples at every step, and a resumed run restarts at the exact sample.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from domainfm.errors import InputError

__all__ = ["MANIFEST", "PrepareError", "Preparation", "PreparedCorpus", "prepare", "prepare_family", "file_sha256",
           "is_remote", "iter_files"]

#: the file that says a folder is a finished domainfm corpus, and what went in
MANIFEST = "domainfm_prepared.json"
_REMOTE = ("s3://", "gs://", "azure://", "hf://")


class PrepareError(InputError):
    """A corpus folder that cannot be written or read as asked (names the folder and the field)."""


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(_REMOTE)


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _jsonable(settings: Any) -> Any:
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        settings = dataclasses.asdict(settings)
    return json.loads(json.dumps(settings, default=str))


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PrepareError(f"{path}: not a valid manifest ({exc})") from None


@dataclasses.dataclass
class _Guarded:
    """``fn`` run in LitData's worker, its samples yielded one by one; an input that raises is
    recorded under ``failures`` and gives no samples (an exception inside a LitData worker leaves
    its parent waiting forever)."""

    fn: Callable[[str], Iterable[Mapping[str, Any]]]
    failures: str

    def __call__(self, path: str):
        try:
            items = list(self.fn(path))
        except Exception as exc:  # noqa: BLE001 - reported by prepare(), naming the file
            target = Path(self.failures) / (hashlib.sha256(path.encode()).hexdigest()[:16] + ".json")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps({"path": path, "error": f"{type(exc).__name__}: {exc}"}))
            return
        yield from items


_PROGRESS = ".domainfm-progress.json"


def prepare(inputs: Sequence[str | os.PathLike], fn: Callable[[str], Iterable[Mapping[str, Any]]],
            output: str | os.PathLike, *, family: str, settings: Any = None, num_workers: int | None = None,
            files_per_part: int = 16, chunk_bytes: str = "64MB") -> dict:
    """Convert ``inputs`` (files) into LitData shards under ``output`` (a local folder).

    ``fn(path)`` returns or yields the samples of one input file, each a dict of
    arrays/tensors/numbers; it must be picklable (a module-level function or a
    :func:`functools.partial` of one), as LitData runs it in worker processes, in parallel over
    files. The files are converted in parts of ``files_per_part`` (``part-00000/``, ... each a
    LitData folder); a part is recorded as done only when complete, so an interrupted run
    started again converts only the parts not yet done. ``settings``: the preprocessing that
    ``fn`` applies (a dataclass or dict), recorded in the manifest; a folder already prepared from
    the same files and settings is kept as it is, one prepared from others is refused. Returns
    the manifest."""
    from litdata import StreamingDataset, optimize

    if is_remote(output):
        raise PrepareError(f"--output {output}: prepare writes a local folder; copy it to object storage "
                           "afterwards (e.g. aws s3 sync) and train with data.path=s3://...")
    if files_per_part < 1:
        raise PrepareError(f"files_per_part={files_per_part}: expected at least 1")
    output = Path(output)
    files = [Path(p) for p in inputs]
    if not files:
        raise PrepareError(f"{output}: no input files to prepare")
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise PrepareError(f"input files not found: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if len({p.resolve() for p in files}) != len(files):
        raise PrepareError(f"{output}: an input file is given twice")
    record = [{"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files]
    wanted = {"family": family, "settings": _jsonable(settings or {}), "inputs": record}
    done = _read_manifest(output)
    if done is not None:
        if all(done.get(k) == v for k, v in wanted.items()):
            return done
        differs = [k for k, v in wanted.items() if done.get(k) != v]
        raise PrepareError(f"{output}: already holds a corpus prepared from other {' and '.join(differs)}; "
                           "choose another --output, or delete that folder to prepare it again")
    progress_file = output / _PROGRESS
    plan = {**wanted, "files_per_part": files_per_part}
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else None
    if progress is not None and progress.get("plan") != plan:
        raise PrepareError(f"{output}: holds an unfinished preparation of other files or settings; "
                           "choose another --output, or delete that folder")
    if progress is None and output.exists() and any(output.iterdir()):
        raise PrepareError(f"{output}: exists and is not empty; choose an empty or new folder")
    progress = progress or {"plan": plan, "parts": {}}
    output.mkdir(parents=True, exist_ok=True)
    from domainfm.atomic import atomic_write_json

    start = time.perf_counter()
    import shutil
    import tempfile

    paths = [r["path"] for r in record]
    for first in range(0, len(paths), files_per_part):
        name = f"part-{first // files_per_part:05d}"
        if name in progress["parts"]:
            continue
        group = paths[first:first + files_per_part]
        folder = output / name
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted run left of this part
        failures = Path(tempfile.mkdtemp(prefix="domainfm-prepare-"))
        try:
            optimize(fn=_Guarded(fn, str(failures)), inputs=group, output_dir=str(folder), chunk_bytes=chunk_bytes,
                     num_workers=max(1, min(num_workers or os.cpu_count() or 1, len(group))), verbose=False,
                     mode="overwrite")
            failed = [json.loads(p.read_text()) for p in sorted(failures.glob("*.json"))]
        finally:
            shutil.rmtree(failures, ignore_errors=True)
        if failed:
            shutil.rmtree(folder, ignore_errors=True)
            lines = "; ".join(f"{f['path']}: {f['error']}" for f in failed[:5])
            raise PrepareError(f"{output}: {len(failed)} input files could not be prepared ({lines}"
                               + (" ..." if len(failed) > 5 else "") + "); fix or leave them out and run again "
                               "(the parts already done are kept; the folder is not a corpus until it has its "
                               "manifest)")
        samples = sum(int(b) - int(a) for a, b in StreamingDataset(str(folder)).region_of_interest) \
            if (folder / "index.json").is_file() else 0
        if not samples:
            shutil.rmtree(folder, ignore_errors=True)
        progress["parts"][name] = {"samples": samples, "files": len(group)}
        atomic_write_json(progress_file, progress)
    parts = [{"dir": name, "samples": info["samples"]} for name, info in sorted(progress["parts"].items())
             if info["samples"]]
    total = sum(p["samples"] for p in parts)
    if total == 0:
        raise PrepareError(f"{output}: the input files gave no samples (check the preprocessing settings)")
    import litdata

    from domainfm import __version__

    manifest = {**wanted, "format": "litdata", "parts": parts, "samples": total, "litdata_version": litdata.__version__,
                "domainfm_version": __version__, "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "wall_time_s": round(time.perf_counter() - start, 2)}
    atomic_write_json(output / MANIFEST, manifest)
    progress_file.unlink()
    return manifest


class PreparedCorpus(torch.utils.data.Dataset):
    """A folder written by :func:`prepare`, as a map-style dataset over all its parts.

    Args:
        path: the folder, or its copy in object storage (``s3://bucket/corpus``; LitData downloads
            chunks into ``cache_dir`` as they are read).
        family: the family that must have prepared it (checked against the manifest).
        transform: applied to each sample (a dict) after reading.
    """

    def __init__(self, path: str | os.PathLike, *, family: str | None = None, cache_dir: str | None = None,
                 transform: Callable[[dict], Any] | None = None):
        from litdata import StreamingDataset

        self.path = str(path).rstrip("/")
        self.manifest = self._manifest(cache_dir)
        if family is not None and self.manifest.get("family") != family:
            raise PrepareError(f"data.path {self.path}: prepared for family {self.manifest.get('family')!r}, "
                               f"not {family!r}")
        self._parts, self._offsets, self._blocks = [], [], []
        offset = 0
        for part in self.manifest.get("parts") or []:
            where = f"{self.path}/{part['dir']}"
            dataset = StreamingDataset(where, cache_dir=None if cache_dir is None else f"{cache_dir}/{part['dir']}",
                                       shuffle=False)
            self._parts.append(dataset)
            self._offsets.append(offset)
            # LitData's region_of_interest: each chunk's own (start, end) of the items it serves. Not
            # len(dataset): inside a process group LitData gives each rank's share of it, while
            # integer indexing stays global (every rank reads any sample; the engine's sampler deals)
            for a, b in dataset.region_of_interest:
                self._blocks.append((offset, offset + int(b) - int(a)))
                offset += int(b) - int(a)
            if offset - self._offsets[-1] != part["samples"]:
                raise PrepareError(f"{where}: {MANIFEST} says {part['samples']} samples, the shards hold "
                                   f"{offset - self._offsets[-1]}; the folder was changed after it was prepared")
        self._length = offset
        self.transform = transform

    def _manifest(self, cache_dir: str | None) -> dict:
        if not is_remote(self.path):
            folder = Path(self.path)
            manifest = _read_manifest(folder) if folder.is_dir() else None
            if manifest is None:
                hint = ("its preparation did not finish: run the same `domainfm prepare` again to complete it"
                        if (folder / _PROGRESS).is_file() else
                        "write one with `domainfm prepare FAMILY --input ... --output DIR`")
                raise PrepareError(f"data.path {self.path}: not a prepared corpus (no {MANIFEST}); {hint}")
            return manifest
        import tempfile

        from litdata.streaming.downloader import get_downloader

        local = Path(cache_dir or tempfile.mkdtemp(prefix="domainfm-corpus-")) / MANIFEST
        local.parent.mkdir(parents=True, exist_ok=True)
        get_downloader(self.path, str(local.parent), []).download_file(f"{self.path}/{MANIFEST}", str(local))
        return json.loads(local.read_text())

    @property
    def settings(self) -> dict:
        """The preprocessing the corpus was prepared with."""
        return dict(self.manifest.get("settings") or {})

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """``[start, end)`` index ranges of LitData's chunks, over all parts in order."""
        return list(self._blocks)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int):
        index = int(index)
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for {self._length} samples")
        import bisect

        part = bisect.bisect_right(self._offsets, index) - 1
        item = self._parts[part][index - self._offsets[part]]
        return self.transform(item) if self.transform is not None else item

    def describe(self) -> str:
        n = len(self.manifest.get("inputs") or [])
        return f"prepared corpus {self.path}: {len(self)} samples from {n} files (litdata)"


def iter_files(patterns: Iterable[str], suffixes: Sequence[str]) -> list[Path]:
    """Input files from paths, folders (searched recursively for ``suffixes``) and globs, sorted."""
    import glob

    out: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            # by the end of the name, so that .fif.gz and other double suffixes are found
            out += [p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(tuple(suffixes))]
        elif any(ch in pattern for ch in "*?["):
            out += [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
        else:
            out.append(path)
    return sorted(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True)
class Preparation:
    """What ``domainfm prepare FAMILY`` runs, declared by the family's pretraining module as
    ``PREPARE``.

    ``convert(settings, path)``: the samples of one input file (a module-level function: it runs
    in LitData's worker processes); ``settings``: the dataclass of its preprocessing settings,
    filled from ``key=value`` arguments (and recorded in the manifest); ``suffixes``: the file
    types searched for in an input folder; ``what``: one line for ``--help``."""

    convert: Callable[[Any, str], Iterable[Mapping[str, Any]]]
    settings: type
    suffixes: tuple[str, ...]
    what: str = ""


def prepare_family(family: str, preparation: Preparation, inputs: Sequence[str], output: str, *,
                   overrides: Sequence[str] = (), num_workers: int | None = None, files_per_part: int = 16) -> dict:
    """``domainfm prepare``: a family's declared conversion over the files found under ``inputs``."""
    import functools

    from domainfm import config as cfgmod

    settings = cfgmod.from_dict(preparation.settings, cfgmod.apply_overrides({}, list(overrides)))
    files = iter_files(inputs, tuple(s.lower() for s in preparation.suffixes))
    if not files:
        raise PrepareError(f"--input {' '.join(inputs)}: no {'/'.join(preparation.suffixes)} files found")
    return prepare(files, functools.partial(preparation.convert, settings), output, family=family, settings=settings,
                   num_workers=num_workers, files_per_part=files_per_part)
