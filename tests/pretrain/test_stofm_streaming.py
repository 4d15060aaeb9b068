"""SToFM pretraining from a corpus prepared once (``domainfm prepare stofm``, LitData shards): the
corpus holds the sub-slices the in-memory path builds, a corpus prepared with other settings is
refused, and a 2-rank run equals one process at the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from domainfm import streaming
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.pretrain import stofm as P

SLICE = S.samples_dir() / "pbmc68k_niches.h5ad"
#: the corpus's settings (700 cells -> 9 sub-slices; the tiny test cell encoder)
SETTINGS = ["cells_per_subslice=150", "cell_encoder.name=stofm-cell-encoder-test", "cell_encoder.kwargs={}"]
#: the demo config (configs/stofm/pretrain.yaml) with the tiny model, reading the corpus
TRAIN = ["--config", "pretrain", "model.name=stofm-test", "model.kwargs={}", "data.kind=streaming",
         *[f"data.{s}" for s in SETTINGS], "train.progress=false", "train.accelerator=cpu",
         "train.precision=32-true", "train.log_every_steps=1", "train.max_steps=3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stofm") / "corpus"
    assert main(["prepare", "stofm", "--input", str(SLICE), "--output", str(out), "--workers", "1", *SETTINGS]) == 0
    return out


def _train_records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("split") == "train"]


def test_a_sample_restores_its_subslice_exactly():
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 100, (300, 2))
    xy[5] = xy[4]  # two cells at one place: a distance 0 that is a non-edge, as officially
    subs = S.build_subslices(xy, rng.normal(size=(300, 8)).astype(np.float32), cells_per_subslice=70, knn=6,
                             clusters=(xy[:, 0] > 50).astype(int))
    samples = [P.subslice_sample(sub) for sub in subs]
    # the kNN edges only: a fraction of the dense matrices
    assert sum(len(s["edge_index"]) for s in samples) < 0.3 * sum(sub["distances"].numel() for sub in subs)
    for sub, sample in zip(subs, samples):
        assert all(isinstance(v, np.ndarray) for v in sample.values())
        back = P.sample_subslice(sample)
        assert back.keys() == sub.keys()
        for key, value in sub.items():
            assert torch.equal(back[key], value), key


def test_the_corpus_holds_the_subslices_pretraining_builds_in_memory(corpus):
    manifest = json.loads((corpus / streaming.MANIFEST).read_text())
    assert manifest["family"] == "stofm" and manifest["settings"]["cells_per_subslice"] == 150
    data = P.DataSection(slices=[str(SLICE)], cells_per_subslice=150,
                         cell_encoder=P.CellEncoderSection(name="stofm-cell-encoder-test"))
    memory, _, _ = P.build_datasets(data, seed=0)
    streamed, _, info = P.build_datasets(P.DataSection(kind="streaming", path=str(corpus), slices=[],
                                                       cells_per_subslice=150, cell_encoder=data.cell_encoder), seed=0)
    assert len(streamed) == len(memory) == 9 and "prepared corpus" in info["data_source"]
    for i in range(len(memory)):
        a, b = memory.subslices[i], P.sample_subslice(streamed.subslices[i])
        for key in ("token_types", "cell_index", "distances", "spatial"):
            assert torch.equal(a[key], b[key]), (i, key)
        # cell embeddings computed in LitData's worker: the same encoder, another process
        torch.testing.assert_close(a["token_embeddings"], b["token_embeddings"], rtol=1e-5, atol=1e-6)
        # and the masks are the same: drawn from (seed, epoch, index), not from where the sample is read
        assert torch.equal(memory[i]["labels"] != -100, streamed[i]["labels"] != -100)
    # a held-out split keeps the corpus's chunks contiguous for the sampler
    train, val, _ = P.build_datasets(P.DataSection(kind="streaming", path=str(corpus), slices=[], val_fraction=0.3,
                                                   cells_per_subslice=150, cell_encoder=data.cell_encoder), seed=0)
    assert len(train) + len(val) == 9 and train.blocks[0][0] == 0 and train.blocks[-1][1] == len(train)


def test_pretraining_reads_the_corpus_through_the_cli(corpus, tmp_path):
    assert main(["pretrain", "stofm", *TRAIN, f"data.path={corpus}", "--runs-dir", str(tmp_path), "--name", "s"]) == 0
    report = json.loads((tmp_path / "stofm" / "s" / "report.json").read_text())
    assert report["data_source"] == f"prepared corpus {corpus}: 9 samples from 1 files (litdata)"
    assert report["steps"] == 3 and report["subslices"] == 9
    losses = [r["loss"] for r in _train_records(tmp_path / "stofm" / "s")]
    assert len(losses) == 3 and np.isfinite(losses).all()
    # the cosine loss of the masked cells starts near 1 (a random head: cos ~ 0) and falls
    assert report["train_mcm_loss_last"] < report["train_mcm_loss_first"] < 1.1


def test_a_corpus_prepared_with_other_settings_is_refused_naming_the_field(corpus, tmp_path, capsys):
    code = main(["pretrain", "stofm", *TRAIN, f"data.path={corpus}", "data.knn=30", "--runs-dir", str(tmp_path),
                 "--name", "r"])
    err = capsys.readouterr().err
    assert code != 0 and f"data.path {corpus}" in err and "data.knn=30" in err and "knn=50" in err, err
    assert not (tmp_path / "stofm" / "r" / "checkpoints").exists()


def test_two_ranks_equal_one_process_at_the_same_global_batch(corpus, tmp_path):
    # 9 sub-slices of unequal size, the demo's dropout 0.1 and gradient clipping; 3 steps cross an
    # epoch boundary (2 steps per epoch). Each rank sees other cell counts than the other: the
    # losses must be normalised by the global batch's counts, and dropout drawn per sub-slice.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    ddp = subprocess.run([sys.executable, "-m", "domainfm.cli", "pretrain", "stofm", *TRAIN, f"data.path={corpus}",
                          "train.batch_size=2", "train.devices=2", "train.strategy=ddp", "--runs-dir",
                          str(tmp_path), "--name", "ddp"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in ddp.stderr + ddp.stdout
    assert main(["pretrain", "stofm", *TRAIN, f"data.path={corpus}", "train.batch_size=4", "--runs-dir",
                 str(tmp_path), "--name", "one"]) == 0
    two, one = _train_records(tmp_path / "stofm" / "ddp"), _train_records(tmp_path / "stofm" / "one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    for key in ("loss", "mcm_loss", "pair_loss"):
        np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-5, err_msg=key)
    a = torch.load(tmp_path / "stofm" / "ddp" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    b = torch.load(tmp_path / "stofm" / "one" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=key)
    assert len({r["loss"] for r in one}) == 3  # it trained: every step's loss differs
