"""Multi-process runs from the CLI (domainfm.distributed, the CLI's run-folder ownership and
domainfm.atomic.follower_writes): only rank 0 owns the run folder; every rank trains and resumes
from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from domainfm import atomic, cli, distributed

_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               distributed.RUN_DIR_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, rank", [
    ({}, 0),
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, 3),            # torchrun
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, 0),
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, 1),       # Fabric's launcher, rank 1
    ({"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"}, 1000),    # Fabric, first process of node 1
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, 2),                     # srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, 0),                     # a one-task job
])
def test_launch_rank_reads_each_launchers_environment(clean_env, env, rank):
    for name, value in env.items():
        clean_env.setenv(name, value)
    assert distributed.launch_rank() == rank
    assert (distributed.launch_rank() == 0) == (rank == 0)


def test_a_rank_that_is_not_a_number_is_an_error_naming_the_variable(clean_env):
    clean_env.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one'"):
        distributed.launch_rank()


def test_follower_writes_leave_the_targets_untouched_and_nothing_behind(tmp_path):
    target = tmp_path / "run" / "report.json"
    with atomic.follower_writes() as scratch:
        assert atomic.atomic_write_json(target, {"a": 1}) == target
        with atomic.atomic_path(tmp_path / "run" / "model.safetensors") as tmp:
            tmp.write_bytes(b"x")
            assert tmp.parent == scratch
    assert not (tmp_path / "run").exists() and not scratch.exists()
    atomic.atomic_write_json(target, {"a": 1})  # outside the block: written as always
    assert json.loads(target.read_text()) == {"a": 1}


def test_a_torchrun_rank_without_name_is_refused_before_training(clean_env, tmp_path, capsys):
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    code = cli.main(["pretrain", "wearables", "--config", "pretrain_demo", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and "rank 1" in err and "--name" in err, err
    assert not (tmp_path / "runs").exists()


def _pretrain(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "domainfm.cli", "pretrain", "wearables", "--config", "pretrain_demo",
         "--runs-dir", str(tmp_path / "runs"), "--name", name, "train.devices=2", "train.strategy=ddp",
         "train.accelerator=cpu", "train.precision=32-true", "train.log_every_steps=1",
         # a schedule that does not depend on max_steps, so that a run stopped at step 3 and
         # resumed to 6 must equal the uninterrupted 6 steps
         "train.schedule=constant", "train.warmup_ratio=0", *overrides],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)


def test_pretrain_on_two_ranks_from_the_cli_owns_one_folder_and_resumes_exactly(tmp_path):
    # the command of the issue: rank 1, launched by Fabric re-running it, used to be refused by the lock
    straight = _pretrain(tmp_path, "straight", "train.max_steps=6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in straight.stderr + straight.stdout
    assert sorted(p.name for p in (tmp_path / "runs" / "wearables").iterdir()) == ["straight"]
    report = json.loads((tmp_path / "runs" / "wearables" / "straight" / "report.json").read_text())
    assert report["steps"] == 6
    # the same run stopped at step 3 (mid-epoch: 2 steps per epoch on 2 ranks) and resumed on 2 ranks from the folder rank 0 owns
    first = _pretrain(tmp_path, "resumed", "train.max_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _pretrain(tmp_path, "resumed", "train.max_steps=6", "train.resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs" / "wearables").iterdir()) == ["resumed", "straight"]
    resumed = tmp_path / "runs" / "wearables" / "resumed"
    events = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events if "event" in e] == [("resumed", 3)]
    # every step's loss, and the last weights, equal the uninterrupted run's (the saved best
    # model may differ: the stopped run validated at step 3, where the uninterrupted one did not)
    def losses(folder):
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("split") == "train"]

    straight_dir = tmp_path / "runs" / "wearables" / "straight"
    assert len(losses(straight_dir)) == 6
    np.testing.assert_allclose(losses(resumed), losses(straight_dir), rtol=1e-6)
    a = torch.load(straight_dir / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    b = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    # and training happened on both: the loss fell over the 6 steps
    assert report["train_loss_last"] < report["train_loss_first"]


def test_fsdp_on_a_machine_without_cuda_is_a_config_error_naming_the_alternative(clean_env, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: FSDP is allowed (see the GPU test below)")
    code = cli.main(["pretrain", "wearables", "--config", "pretrain_demo", "--runs-dir", str(tmp_path),
                     "train.strategy=fsdp", "train.devices=2"])
    err = capsys.readouterr().err
    assert code == 2 and "train.strategy='fsdp' needs CUDA GPUs" in err and "train.strategy=ddp" in err, err


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="FSDP through Fabric runs on CUDA devices only; this machine has fewer than 2 GPUs")
def test_fsdp_on_two_gpus_trains_and_resumes_from_the_folder_rank_0_owns(tmp_path):
    straight = _pretrain(tmp_path, "fsdp", "train.max_steps=4", "train.strategy=fsdp", "train.accelerator=cuda")
    assert straight.returncode == 0, straight.stderr[-3000:]
    again = _pretrain(tmp_path, "fsdp", "train.max_steps=6", "train.strategy=fsdp", "train.accelerator=cuda",
                      "train.resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "wearables" / "fsdp" / "report.json").read_text())
    assert report["steps"] == 6
