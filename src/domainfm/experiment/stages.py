"""In-process stages: a pretraining (or any) run whose saved model an arm starts from."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from domainfm.experiment.config import StageSection
from domainfm.experiment.run_folder import RunFolder

__all__ = ["run_stage"]


def run_stage(stage: StageSection, stage_dir: Path, *, seed: int | None = None, resume: bool = False) -> dict[str, Any]:
    """Run ``domainfm <kind> <family>`` in this process from its config file + overrides (never
    translated field by field). Returns the stage's report (with ``saved_model``)."""
    from domainfm import config as cfgmod
    from domainfm.launch import config_file, family_entry

    module = family_entry(stage.kind, stage.family)
    path = config_file(stage.family, stage.kind, stage.config)
    overrides = list(stage.overrides)
    if resume and (stage_dir / "report.json").is_file():
        # a resumed experiment reuses its finished stage instead of training it again
        done = RunFolder(stage_dir).read_report()
        if Path(done.get("saved_model", "")).is_dir():
            return done
    if resume and (stage_dir / "checkpoints" / "last.ckpt").is_file():
        overrides.append("train.resume=true")  # an interrupted stage continues from its checkpoint
    raw = cfgmod.apply_overrides(cfgmod.load_yaml(path), overrides)
    stage_cfg = cfgmod.from_dict(module.Config, raw)
    folder = RunFolder.create(stage_dir, resume=resume)
    folder.write_config(stage_cfg)
    folder.write_meta(family=stage.family, kind=stage.kind, config_source=str(path), overrides=list(stage.overrides))
    if seed is not None:
        from lightning_fabric.utilities.seed import seed_everything

        seed_everything(seed, verbose=False)
    print(f"[domainfm] stage: {stage.kind} {stage.family} ({path.name} {' '.join(stage.overrides)}) -> {stage_dir}",
          file=sys.stderr, flush=True)
    report = dict(module.run(stage_cfg, stage_dir) or {})
    folder.write_report({"family": stage.family, "kind": stage.kind, **report})
    if "saved_model" not in report:
        raise RuntimeError(f"domainfm.{stage.kind}.{stage.family}.run must return 'saved_model' (the folder written "
                           "by save_pretrained) to be used as a stage")
    return report
