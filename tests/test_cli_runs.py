"""Run folders that are never overwritten or shared, resume that fails loudly and refuses a changed
run, and one-line CLI errors (domainfm.cli, domainfm.experiment.run_folder, the engine's resume),
through a toy family."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_toys import ClassifyRecipe, TinyNet, make_dataset  # noqa: E402

from domainfm import cli  # noqa: E402
from domainfm.engine import ResumeError, TrainConfig, Trainer  # noqa: E402
from domainfm.experiment import RunFolder, RunFolderError  # noqa: E402


# --------------------------------------------------------------------------- a toy CLI family


@dataclasses.dataclass
class ToyModel:
    hidden: int = 16


@dataclasses.dataclass
class ToyData:
    seed: int = 0
    target: str = "label"


@dataclasses.dataclass
class ToyConfig:
    model: ToyModel = dataclasses.field(default_factory=ToyModel)
    data: ToyData = dataclasses.field(default_factory=ToyData)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    fail: bool = False


def _toy_run(cfg, run_dir):
    if cfg.fail:
        # a data loader's own error class: a user error, reported in one line
        from domainfm.data_loaders.gapped_series import GappedSeriesError

        raise GappedSeriesError("toy.csv: the model could not be built")
    torch.manual_seed(cfg.train.seed)
    model = TinyNet(hidden=cfg.model.hidden)
    result = Trainer(cfg.train, run_dir=run_dir).fit(ClassifyRecipe(model, make_dataset(n=64), make_dataset(n=32, seed=1)))
    losses = [r["loss"] for r in result.history if r.get("split") == "train"]
    return {"steps": result.global_step, "train_loss_first": losses[0]}


@pytest.fixture
def toy_family(monkeypatch, tmp_path):
    module = types.ModuleType("domainfm.finetune.dfmtoy")
    module.Config, module.run = ToyConfig, _toy_run
    monkeypatch.setitem(sys.modules, "domainfm.finetune.dfmtoy", module)
    config = tmp_path / "toy.yaml"
    config.write_text(textwrap.dedent("""\
        model: {hidden: 16}
        train: {max_epochs: 2, batch_size: 16, lr: 0.01, progress: false, accelerator: cpu, log_every_steps: 1}
        """))

    def run(*overrides, name="r1"):
        return cli.main(["finetune", "dfmtoy", "--config", str(config), "--runs-dir", str(tmp_path / "runs"),
                         "--name", name, *overrides])

    run.folder = lambda name="r1": tmp_path / "runs" / "dfmtoy" / name
    return run


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- run folders


def test_rerun_of_a_finished_name_is_refused_and_leaves_it_byte_equal(toy_family, capsys):
    assert toy_family() == 0
    before = _snapshot(toy_family.folder())
    assert "checkpoints/best.safetensors" in before and "checkpoints/last.ckpt" in before
    assert toy_family("train.lr=0.5") == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--name" in err and "train.resume=true" in err
    assert _snapshot(toy_family.folder()) == before


_HOLDER = """
import sys, time
from domainfm.experiment import RunFolder
RunFolder.create(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_process_on_the_same_folder_is_refused(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        # even with resume (the folder is not empty), a live holder is refused, naming its pid
        with pytest.raises(RunFolderError, match=f"in use by process {holder.pid}"):
            RunFolder.create(folder, resume=True)
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead: its lock is stale and taken over
    taken = RunFolder.create(folder, resume=True)
    assert (folder / ".lock").read_text().split()[0] == str(os.getpid())
    taken.release()
    assert not (folder / ".lock").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").write_text(f"{dead.pid}\n")
    folder = RunFolder.create(tmp_path / "run")  # a folder holding only a stale lock is empty
    assert (tmp_path / "run" / ".lock").read_text().split()[0] == str(os.getpid())
    folder.release()


def test_resume_without_a_run_is_an_error_naming_the_folder(toy_family, capsys):
    assert toy_family("train.resume=true", name="never") == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and str(toy_family.folder("never")) in err
    assert not toy_family.folder("never").exists()


def test_failed_resume_leaves_config_and_meta_unchanged(toy_family, capsys):
    assert toy_family() == 0
    config = (toy_family.folder() / "config.yaml").read_bytes()
    meta = (toy_family.folder() / "run.json").read_bytes()
    # the architecture changed by an override: refused before anything is written
    assert toy_family("train.resume=true", "model.hidden=32") == 2
    assert "model.hidden" in capsys.readouterr().err
    # a resume that fails inside the run
    assert toy_family("train.resume=true", "fail=true") == 2
    assert (toy_family.folder() / "config.yaml").read_bytes() == config
    assert (toy_family.folder() / "run.json").read_bytes() == meta


def test_resume_refuses_a_changed_task_data_or_optimiser_and_names_them(toy_family, capsys):
    assert toy_family() == 0
    before = _snapshot(toy_family.folder())
    for override, key in [("data.target=short_sleep", "data.target"), ("data.seed=7", "data.seed"),
                          ("train.lr=0.5", "train.lr"), ("fail=false", None)]:
        code = toy_family("train.resume=true", "train.max_epochs=3", override)
        err = capsys.readouterr().err
        if key is None:  # an unchanged value is no change
            assert code == 0, err
            continue
        assert code == 2 and key in err and "train.resume_changed=true" in err, err
        assert _snapshot(toy_family.folder()) == before  # refused before anything was written
    # training longer is what resume is for
    meta = json.loads((toy_family.folder() / "run.json").read_text())
    assert meta["resumes"][-1]["changed"] == []


def test_a_run_saved_before_a_config_key_existed_resumes_with_that_keys_default(toy_family, capsys):
    # a run folder written by an older domainfm lacks a key added since (here data.target): its
    # config.yaml means that key's default, so resuming it with the default is no change
    assert toy_family() == 0
    import yaml

    config = toy_family.folder() / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    del saved["data"]["target"]
    config.write_text(yaml.safe_dump(saved))
    assert toy_family("train.resume=true", "train.max_epochs=3") == 0, capsys.readouterr().err
    meta = json.loads((toy_family.folder() / "run.json").read_text())
    assert meta["resumes"][-1]["changed"] == []
    # a value other than the default is still a change
    saved = yaml.safe_load(config.read_text())
    del saved["data"]["target"]
    config.write_text(yaml.safe_dump(saved))
    assert toy_family("train.resume=true", "train.max_epochs=4", "data.target=other") == 2
    assert "data.target: 'label' in config.yaml, 'other' now" in capsys.readouterr().err


def test_an_explicit_resume_changed_is_recorded_in_the_run_and_its_report(toy_family, capsys):
    assert toy_family() == 0
    assert toy_family("train.resume=true", "train.max_epochs=3", "data.seed=7", "train.resume_changed=true") == 0, \
        capsys.readouterr().err
    meta = json.loads((toy_family.folder() / "run.json").read_text())
    report = json.loads((toy_family.folder() / "report.json").read_text())
    assert meta["resumes"][-1]["changed"] == ["data.seed: 0 in config.yaml, 7 now"]
    assert report["resume_changed"] == ["data.seed: 0 in config.yaml, 7 now"]
    # the architecture stays locked even then
    assert toy_family("train.resume=true", "model.hidden=32", "train.resume_changed=true") == 2
    assert "model.hidden" in capsys.readouterr().err


def test_a_schedule_typo_given_as_override_is_blamed_on_the_override(toy_family, capsys):
    assert toy_family("train.schedule=foo") == 2
    err = capsys.readouterr().err
    assert "train.schedule='foo'" in err and "override" in err and "toy.yaml" not in err, err
    assert not toy_family.folder().exists()


def test_unwritable_runs_dir_and_outputs_are_one_line_errors_naming_the_path(toy_family, tmp_path, capsys):
    runs_file = tmp_path / "runs_is_a_file"
    runs_file.write_text("x")
    code = cli.main(["finetune", "dfmtoy", "--config", str(tmp_path / "toy.yaml"), "--runs-dir", str(runs_file)])
    err = capsys.readouterr().err
    assert code == 2 and str(runs_file) in err and "Traceback" not in err, err
    # an OSError from a reader that names no file is reported against --input
    import argparse

    message = cli._one_line_message(OSError("Unable to open file (file signature not found)"),
                                    argparse.Namespace(input="cells.h5ad"))
    assert message == "cells.h5ad: Unable to open file (file signature not found)"
    message = cli._one_line_message(PermissionError(13, "Permission denied", "/ro/out.csv"), argparse.Namespace())
    assert message == "/ro/out.csv: Permission denied"
    import pandas as pd

    assert cli.is_user_error(pd.errors.EmptyDataError("No columns to parse from file"))


def test_new_run_that_fails_before_producing_anything_leaves_the_name_free(toy_family, capsys):
    assert toy_family("fail=true") == 2
    assert "model could not be built" in capsys.readouterr().err
    assert not toy_family.folder().exists()
    assert toy_family() == 0


def test_resume_with_no_checkpoint_is_an_engine_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 1.0}\n')  # killed before its first save
    trainer = Trainer(TrainConfig(max_epochs=1, batch_size=16, progress=False, accelerator="cpu", resume=True), run_dir=run_dir)
    with pytest.raises(ResumeError, match=f"nothing to resume.*{run_dir}"):
        trainer.fit(ClassifyRecipe(TinyNet(), make_dataset(n=64)))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class _Kill(BaseException):
    """Stands for kill -9: nothing after it runs (not even the engine's last save)."""


class _KilledRecipe(ClassifyRecipe):
    def __init__(self, *a, kill_at, **kw):
        super().__init__(*a, **kw)
        self.kill_at, self.calls = kill_at, 0

    def step(self, model, batch):
        self.calls += 1
        if self.calls == self.kill_at:
            raise _Kill()
        return super().step(model, batch)


def test_resume_truncates_history_to_the_checkpoint_and_keeps_first_loss(tmp_path):
    cfg = dict(max_epochs=3, batch_size=16, lr=1e-2, progress=False, accelerator="cpu", checkpoint_every_steps=5,
               log_every_steps=1)
    torch.manual_seed(0)
    reference = TinyNet(dropout=0.3)
    init = {k: v.clone() for k, v in reference.state_dict().items()}
    ref = Trainer(TrainConfig(**cfg), run_dir=tmp_path / "a").fit(ClassifyRecipe(reference, make_dataset(), make_dataset(seed=1)))

    killed = TinyNet(dropout=0.3)
    killed.load_state_dict(init)
    with pytest.raises(_Kill):  # killed at micro-batch 23: steps 21, 22 logged after the step-20 checkpoint
        Trainer(TrainConfig(**cfg), run_dir=tmp_path / "b").fit(
            _KilledRecipe(killed, make_dataset(), make_dataset(seed=1), kill_at=23))
    # a kill during a checkpoint write leaves its temporary file behind
    stale = tmp_path / "b" / "checkpoints" / f".last.ckpt.tmp-{_dead_pid()}-0"
    stale.write_bytes(b"half a checkpoint")

    resumed = TinyNet(dropout=0.3)
    result = Trainer(TrainConfig(resume=True, **cfg), run_dir=tmp_path / "b").fit(
        ClassifyRecipe(resumed, make_dataset(), make_dataset(seed=1)))
    assert not stale.exists()
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if r.get("split") == "train"]
    assert train_steps == list(range(1, 49))  # one history, no step repeated
    ref_records = [r for r in ref.history if r.get("split") == "train"]
    assert [r["loss"] for r in records if r.get("split") == "train"] == [r["loss"] for r in ref_records]
    # the history the caller gets is the whole run's, so the first loss is the first step's
    assert [r["loss"] for r in result.history if r.get("split") == "train"][0] == ref_records[0]["loss"]
    assert result.best_val == ref.best_val and result.best_step == ref.best_step


# --------------------------------------------------------------------------- CLI errors


def _cli(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "domainfm.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_user_errors_are_one_line_with_exit_2_and_debug_shows_the_traceback(tmp_path):
    done = _cli("finetune", "cbramod", "no_such.key=1", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert lines[0].startswith("domainfm finetune: error: unknown config key(s) ['no_such'")
    assert lines[-1].strip() == "(run again with --debug for the traceback)" and len(lines) == 2
    assert not (tmp_path / "cbramod").exists()  # nothing written for a config that is not valid

    debug = _cli("--debug", "finetune", "cbramod", "no_such.key=1", "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_data_loader_and_missing_input_errors_are_user_errors(toy_family, capsys, tmp_path):
    assert toy_family("fail=true") == 2
    err = capsys.readouterr().err
    assert err.startswith("domainfm finetune: error: toy.csv: the model could not be built") and "Traceback" not in err
    assert cli.main(["finetune", "dfmtoy", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    # an unexpected error (a bug) keeps its traceback
    assert not cli.is_user_error(ValueError("bug")) and not cli.is_user_error(KeyError("x"))
