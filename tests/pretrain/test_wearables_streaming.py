"""WBM pretraining from a prepared corpus (``domainfm prepare wearables``), and on 2 ranks equal
to one process at the same global batch (per-sample draws, InfoNCE over the global batch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from domainfm import cli, streaming
from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort

_VARIABLES = "variables=[" + ",".join(SYNTHETIC_VARIABLES) + "]"


def _participant_files(folder: Path, n: int = 10) -> list[Path]:
    """The simulator's participants (SYNTHETIC, not real data) as long CSV files, one per person."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k, table in enumerate(synthetic_cohort(n, 3, seed=4).tables):
        long = table.rename_axis("timestamp").reset_index().melt(id_vars="timestamp", var_name="variable",
                                                                 value_name="value").dropna()
        path = folder / f"p{k:02d}.csv"
        long.to_csv(path, index=False)
        out.append(path)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("wearables_corpus")
    files = _participant_files(root / "people")
    code = cli.main(["prepare", "wearables", "--input", str(root / "people"), "--output", str(root / "corpus"),
                     "--workers", "1", _VARIABLES])
    assert code == 0
    return root / "corpus", files


def test_prepare_stores_each_participants_weeks_unscaled(corpus):
    folder, files = corpus
    data = streaming.PreparedCorpus(folder, family="wearables")
    assert len(data) == len(files) and data.settings["variables"] == list(SYNTHETIC_VARIABLES)
    from domainfm.data_loaders import wearables as W

    # an independent reading of one file: the sample holds exactly its weeks, in the variables' units
    first = {int(data[i]["participant"]): data[i] for i in range(len(data))}
    table = W.read_long(files[0])
    weeks = W.to_weeks(table, variables=list(SYNTHETIC_VARIABLES), stats=W.ZScoreStats.identity(SYNTHETIC_VARIABLES),
                       min_hours=24)
    match = [s for s in first.values() if np.asarray(s["values"]).shape == weeks.values.shape
             and np.allclose(np.asarray(s["values"]), weeks.values)]
    assert len(match) == 1 and np.array_equal(np.asarray(match[0]["observed"]).astype(bool), weeks.observed)


def test_pretrain_from_the_corpus_through_the_cli(corpus, tmp_path, capsys):
    folder, _ = corpus
    code = cli.main(["pretrain", "wearables", "--config", "pretrain_demo", "--runs-dir", str(tmp_path), "--name", "s",
                     "data.kind=streaming", f"data.path={folder}", "train.max_steps=4", "train.batch_size=4",
                     "train.log_every_steps=1"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "wearables" / "s" / "report.json").read_text())
    assert report["data_source"].startswith(f"prepared corpus {folder}") and report["steps"] == 4
    assert report["participants"] == 10 and report["train_participants"] + report["val_participants"] == 10
    assert np.isfinite(report["train_loss_last"])
    # a corpus prepared with other variables than the config asks is refused, naming both
    code = cli.main(["pretrain", "wearables", "--config", "pretrain_demo", "--runs-dir", str(tmp_path), "--name", "t",
                     "data.kind=streaming", f"data.path={folder}", "data.variables=[steps,heart_rate]"])
    err = capsys.readouterr().err
    assert code == 2 and "data.variables" in err and str(folder) in err, err


def _run(tmp_path: Path, name: str, devices: int, batch: int, *extra: str) -> Path:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                                                          "DOMAINFM_RUN_DIR")}
    env["OMP_NUM_THREADS"] = "1"
    strategy = ["train.devices=2", "train.strategy=ddp"] if devices == 2 else ["train.devices=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "domainfm.cli", "pretrain", "wearables", "--config", "pretrain_demo",
         "--runs-dir", str(tmp_path), "--name", name, *strategy, "train.accelerator=cpu", "train.precision=32-true",
         f"train.batch_size={batch}", "train.max_steps=5", "train.log_every_steps=1", *extra],
        capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "wearables" / name


def test_two_ranks_equal_one_process_at_the_same_global_batch(corpus, tmp_path):
    # streamed from the corpus (the in-memory datasets draw the same way: WeekDataset)
    extra = ("data.kind=streaming", f"data.path={corpus[0]}")
    one = _run(tmp_path, "one", 1, 8, *extra)
    two = _run(tmp_path, "two", 2, 4, *extra)

    def losses(folder):
        return [r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                if r.get("split") == "train"]

    assert len(losses(one)) == 5
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    a = torch.load(one / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5, msg=key)
