"""WaveToken pretraining from a prepared corpus (``domainfm prepare wavetoken``, then
``data.kind=streaming``), and per-sample randomness keyed by (seed, epoch, index): two ranks with
batch B equal one process with batch 2B."""
from __future__ import annotations

import importlib.resources
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import cli, streaming
from domainfm.data_loaders.timeseries import read_long
from domainfm.pretrain import wavetoken as P

_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "DOMAINFM_RUN_DIR")
# the demo config at test size: a small KernelSynth pool (a GP draw costs O(n^3))
_SMALL = ["data.kernel_synth_series=8", "data.kernel_synth_length=128", "train.progress=false"]


def _shipped_csv() -> Path:
    return Path(str(importlib.resources.files("domainfm.data_loaders") / "samples" / "timeseries"
                    / "statsmodels_series.csv"))


@pytest.fixture(autouse=True)
def one_thread():
    # two loaded cores: intra-op threads would only contend (and the DDP ranks run one each)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The shipped series (CSV) plus a Parquet copy with 40% of its values missing: futures with
    missing values give the ranks unequal numbers of labelled tokens."""
    folder = tmp_path_factory.mktemp("wavetoken_corpus")
    frame = pd.read_csv(_shipped_csv())
    frame["item_id"] = frame["item_id"] + "_gappy"
    frame.loc[np.random.default_rng(0).random(len(frame)) < 0.4, "target"] = np.nan
    frame.to_parquet(folder / "gappy.parquet")
    out = folder / "corpus"
    code = cli.main(["prepare", "wavetoken", "--input", str(_shipped_csv()), str(folder / "gappy.parquet"),
                     "--output", str(out), "--workers", "1", "prediction_length=16", "min_past=16"])
    assert code == 0
    return out


def test_prepare_writes_raw_series_and_pretraining_streams_them_below_the_uniform_baseline(corpus, tmp_path):
    manifest = json.loads((corpus / streaming.MANIFEST).read_text())
    assert manifest["family"] == "wavetoken" and manifest["samples"] == 28
    assert manifest["settings"]["prediction_length"] == 16 and manifest["settings"]["min_past"] == 16
    items = {}
    prepared = streaming.PreparedCorpus(corpus, family="wavetoken")
    for i in range(len(prepared)):
        sample = prepared[i]
        items[sample["item_id"]] = sample["target"]
    shipped = {s["item_id"]: s["target"] for s in read_long(_shipped_csv())}
    assert set(items) == set(shipped) | {f"{k}_gappy" for k in shipped}
    for item, values in shipped.items():  # the raw values, NaN where missing (co2 has 5 empty months)
        assert items[item].dtype == np.float32
        np.testing.assert_array_equal(items[item], values.astype(np.float32))
    assert 0.3 < np.mean([np.isnan(items[f"{k}_gappy"]).mean() for k in shipped]) < 0.5

    code = cli.main(["pretrain", "wavetoken", "--config", "pretrain_demo", "data.kind=streaming",
                     f"data.path={corpus}", "train.max_steps=60", "train.batch_size=8", "train.lr=0.01",
                     "train.schedule=constant", "train.log_every_steps=10", *_SMALL,
                     "--runs-dir", str(tmp_path), "--name", "s"])
    assert code == 0
    report = json.loads((tmp_path / "wavetoken" / "s" / "report.json").read_text())
    assert report["data_kind"] == "streaming" and report["corpus_path"] == str(corpus)
    assert report["corpus_series"] == 28 and report["steps"] == 60
    assert report["uniform_loss"] == pytest.approx(math.log(1024))
    # a model that knows nothing scores log(vocabulary); 60 steps on the corpus are well below it
    assert report["train_loss_last"] < report["uniform_loss"] - 0.5 < report["train_loss_first"], report


def test_a_corpus_prepared_with_other_settings_is_refused_naming_data_path_and_the_field(corpus, tmp_path, capsys):
    other = tmp_path / "horizon64"
    assert cli.main(["prepare", "wavetoken", "--input", str(_shipped_csv()), "--output", str(other),
                     "--workers", "1"]) == 0  # Chronos's defaults: prediction_length 64, min_past 60
    capsys.readouterr()
    runs = ["--runs-dir", str(tmp_path / "runs")]
    assert cli.main(["pretrain", "wavetoken", "--config", "pretrain_demo", "data.kind=streaming",
                     f"data.path={other}", *_SMALL, *runs]) == 2
    err = capsys.readouterr().err
    assert f"data.path {other}" in err and "prediction_length=64" in err and "prediction_length=16" in err, err
    assert cli.main(["pretrain", "wavetoken", "--config", "pretrain_demo", "data.kind=streaming",
                     f"data.path={corpus}", "data.min_past=20", *_SMALL, *runs]) == 2
    err = capsys.readouterr().err
    assert f"data.path {corpus}" in err and "min_past=16" in err and "data.min_past" in err, err
    assert cli.main(["pretrain", "wavetoken", "--config", "pretrain_demo", "data.kind=streaming", *_SMALL,
                     *runs]) == 2
    assert "needs data.path" in capsys.readouterr().err


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("split") == "train"]


def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(corpus, tmp_path):
    common = ["pretrain", "wavetoken", "--config", "pretrain_demo", "data.kind=streaming", f"data.path={corpus}",
              "train.max_steps=4", "train.log_every_steps=1", "train.schedule=constant", "train.accelerator=cpu",
              "train.precision=32-true", *_SMALL, "--runs-dir", str(tmp_path / "runs")]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    two = subprocess.run([sys.executable, "-m", "domainfm.cli", *common, "--name", "two", "train.devices=2",
                          "train.strategy=ddp", "train.batch_size=4"],
                         capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in two.stderr + two.stdout
    assert cli.main([*common, "--name", "one", "train.batch_size=8"]) == 0
    runs = tmp_path / "runs" / "wavetoken"
    # 28 series, global batch 8: 3 steps per epoch, so step 4 is in epoch 1 (set_epoch reached the dataset)
    assert len(_losses(runs / "two")) == 4
    np.testing.assert_allclose(_losses(runs / "two"), _losses(runs / "one"), rtol=1e-5)
    a = torch.load(runs / "two" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    b = torch.load(runs / "one" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    # float rounding only (the ranks' gradient sum is added in another order); Adam divides by
    # sqrt(v), so an entry whose gradient is near zero can carry that rounding into its step
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5, msg=key)


def _windows(kind: str, seed: int = 0, corpus_path: Path | None = None):
    from domainfm.data_loaders.synthetic_series import generate_kernel_synth

    pool = generate_kernel_synth(4, length=96, seed=0)
    common = dict(context_length=64, prediction_length=16, tsmixup_prob=0.5, missing_prob=0.2, min_past=16,
                  tsmixup={"min_length": 32, "max_length": 96}, seed=seed)
    if kind == "memory":
        return P.SeededWindows(pool, [], num_windows=40, **common)
    return P.CorpusWindows(streaming.PreparedCorpus(corpus_path, family="wavetoken"), pool, [], **common)


@pytest.mark.parametrize("kind", ["memory", "streaming"])
def test_a_window_depends_on_the_seed_epoch_and_index_only(kind, corpus):
    ds = _windows(kind, corpus_path=corpus)
    if kind == "streaming":
        assert len(ds) == 28 and ds.blocks == streaming.PreparedCorpus(corpus).blocks
    first = [ds[i] for i in range(8)]
    np.random.seed(123)
    torch.manual_seed(123)  # the process RNG plays no part
    again = [ds[i] for i in reversed(range(8))][::-1]

    def same(x, y):
        return all(torch.equal(torch.nan_to_num(a, 1e9), torch.nan_to_num(b, 1e9)) for a, b in zip(x, y))

    assert all(same(x, y) for x, y in zip(first, again))
    assert not same(first[0], first[1])
    ds.set_epoch(1)
    assert not same(ds[0], first[0])
    ds.set_epoch(0)
    assert same(ds[0], first[0])
    assert not same(_windows(kind, seed=1, corpus_path=corpus)[0], first[0])
    context, future = first[0]
    assert context.shape == (64,) and future.shape == (16,) and context.dtype == future.dtype == torch.float32


def test_series_per_row_files_arrow_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    targets = [[1.0, 2.0, None, 4.0] * 10, [1.0] * 5, [None] * 38 + [1.0, 2.0]]  # kept, too short, 95% missing
    table = pa.table({"start": pa.array([pd.Timestamp("2020-01-01")] * 3), "target": targets})
    with pa.ipc.new_file(str(tmp_path / "gluonts.arrow"), table.schema) as writer:  # GluonTS's ArrowWriter format
        writer.write_table(table)
    with pa.ipc.new_stream(str(tmp_path / "hf.arrow"), table.schema) as writer:  # Hugging Face datasets' cache files
        writer.write_table(table)
    pq.write_table(table.append_column("item_id", pa.array(["a", "b", "c"])), tmp_path / "rows.parquet")
    settings = P.PrepareSettings(prediction_length=16, min_past=16)
    for name, item in (("gluonts.arrow", "gluonts/0"), ("hf.arrow", "hf/0"), ("rows.parquet", "a")):
        samples = list(P.convert_series(settings, str(tmp_path / name)))
        assert [s["item_id"] for s in samples] == [item], name
        expected = np.array([1.0, 2.0, np.nan, 4.0] * 10, dtype=np.float32)
        np.testing.assert_array_equal(samples[0]["target"], expected)
        assert samples[0]["target"].dtype == np.float32
    with pytest.raises(ValueError, match="no column 'values'"):
        list(P.convert_series(P.PrepareSettings(target="values"), str(tmp_path / "gluonts.arrow")))
