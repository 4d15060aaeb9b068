"""``runs/<family>/<name>/``: one object owns every file of a run, and every write is atomic.

    RUN/
      config.yaml        the resolved config            run.json     family, kind, overrides, version
      report.json        the nested report              report.md    the same as a table
      metrics.jsonl      (single-arm runs) engine log   checkpoints/ last.ckpt, best.safetensors
      stages/<i>-<family>/   in-process stages (their own run folders)
      <arm>/             one folder per arm: metrics.jsonl, checkpoints/, model/ (create_model(RUN/<arm>/model)),
                         adapter/ (LoRA, PEFT file pair), seed<k>/ when an arm is repeated over seeds
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from domainfm.atomic import atomic_write_json, atomic_write_text, remove_stale_temps

__all__ = ["RunFolder", "RunFolderError"]


class RunFolderError(RuntimeError):
    pass


class RunFolder:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | os.PathLike, *, resume: bool = False) -> "RunFolder":
        """A folder for a new run. An existing non-empty folder is refused unless ``resume``
        (a finished run is never overwritten or mixed with another one)."""
        folder = cls(path)
        if folder.path.exists() and any(folder.path.iterdir()) and not resume:
            raise RunFolderError(
                f"run folder {folder.path} already holds a run: choose another --name, or pass "
                "train.resume=true to continue that run")
        folder.path.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(folder.path)
        return folder

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
        from domainfm.experiment.report import to_markdown

        atomic_write_text(self.path / "report.md", to_markdown(report))
        return atomic_write_json(self.report_file, report)

    def write_json(self, name: str, obj: Any) -> Path:
        return atomic_write_json(self.path / name, obj)

    # -- reads ------------------------------------------------------------------------------

    def read_meta(self) -> dict[str, Any]:
        if not self.meta_file.is_file():
            raise RunFolderError(f"{self.path} is not a domainfm run folder (no run.json)")
        return json.loads(self.meta_file.read_text())

    def read_report(self) -> dict[str, Any]:
        if not self.report_file.is_file():
            raise RunFolderError(f"{self.path}: no report.json (the run did not finish)")
        return json.loads(self.report_file.read_text())
