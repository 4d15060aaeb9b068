"""CBraMod pretraining from a streamed corpus: `domainfm prepare cbramod` converts the shipped
recording into LitData shards holding the windows the in-memory path reads, the pretraining
trains from them, refuses a corpus prepared with other settings, and a 2-rank DDP run equals one
process at the same global batch."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from domainfm import cli, distributed, streaming
from domainfm.config import config_path, from_dict, load_yaml
from domainfm.data_loaders import eeg
from domainfm.pretrain import cbramod as P

# the demo config's data.eeg, as `domainfm prepare` settings (the command in pretrain_demo.yaml)
DEMO_SETTINGS = ["channels=[Fp1,Fp2,F3,F4,C3,C4,P3,P4,O1,O2,F7,F8,T7,T8,P7,P8,Fz,Cz,Pz]", "allow_upsample=true",
                 "window_s=5.0", "stride_s=1.0", "min_duration_s=null", "trim_s=0.0", "reject_uv=null"]
# a tiny model, no dropout (see test_two_ranks_...), fp32, every step logged; 46 training windows
# in batches of 8: 5 steps per epoch, so 7 steps cross an epoch (new masks) and a validation
RUN = ["model.name=cbramod-test", "model.kwargs.dropout=0.0", "train.precision=32-true", "train.lr=3e-3",
       "train.max_steps=7", "train.log_every_steps=1", "train.progress=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "demo"
    assert cli.main(["prepare", "cbramod", "--input", str(eeg.samples_dir()), "--output", str(out),
                     "--workers", "1", *DEMO_SETTINGS]) == 0
    return out


def _losses(run: Path, split: str = "train") -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("split") == split]


@pytest.fixture(scope="module")
def single_run(corpus, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    assert cli.main(["pretrain", "cbramod", "--config", "pretrain_demo", "data.kind=streaming",
                     f"data.path={corpus}", "train.batch_size=8", *RUN, "--runs-dir", str(runs), "--name", "one"]) == 0
    return runs / "cbramod" / "one"


def test_the_corpus_holds_the_windows_the_in_memory_path_reads(corpus):
    manifest = json.loads((corpus / streaming.MANIFEST).read_text())
    assert manifest["family"] == "cbramod" and [Path(i["path"]).name for i in manifest["inputs"]] == ["S001R02.edf"]
    demo = from_dict(P.Config, load_yaml(config_path("cbramod", "pretrain_demo")))
    memory, _, _ = P.build_datasets(dataclasses.replace(demo.data, val_fraction=0.0))
    streamed, _, info = P.build_datasets(dataclasses.replace(demo.data, kind="streaming", path=str(corpus),
                                                             val_fraction=0.0))
    assert info["data_source"].startswith(f"prepared corpus {corpus}") and len(streamed) == len(memory) == 57
    for i in range(len(memory)):  # 61 s at 200 Hz in 5 s windows every 1 s, in model units
        assert streamed[i].dtype == torch.float32 and streamed[i].shape == (19, 1000)
        torch.testing.assert_close(streamed[i], memory[i], rtol=0, atol=0)


def test_prepare_defaults_are_the_paper_pipeline_of_the_default_config():
    # `domainfm prepare cbramod` without settings makes the corpus configs/cbramod/pretrain.yaml reads
    paper = from_dict(P.Config, load_yaml(config_path("cbramod", "pretrain")))
    assert P.CorpusSettings().eeg_settings() == paper.data.eeg == P.Config().data.eeg


def test_pretraining_trains_from_the_streamed_corpus(single_run, corpus):
    report = json.loads((single_run / "report.json").read_text())
    assert report["data_kind"] == "streaming" and report["data_source"].startswith(f"prepared corpus {corpus}")
    assert report["windows"] == 57 and report["val_windows"] == 11 and report["input"] == "19 ch x 5 patches"
    assert report["steps"] == 7
    losses = _losses(single_run)
    # from a random init's error (~10, in 100 µV units) the masked-reconstruction loss falls by more than half
    assert len(losses) == 7 and np.isfinite(losses).all() and np.isfinite(report["val_loss"])
    assert np.mean(losses[-2:]) < 0.5 * losses[0]


@pytest.mark.parametrize("override, field", [
    ("data.eeg.window_s=4.0", "window_s"),
    ("data.eeg.channels=[Fp1,Fp2,F3,F4]", "channels"),
    ("data.eeg.reject_uv=100.0", "reject_uv"),
])
def test_a_corpus_prepared_with_other_settings_is_refused_naming_the_field(corpus, tmp_path, capsys, override, field):
    code = cli.main(["pretrain", "cbramod", "--config", "pretrain_demo", "data.kind=streaming", f"data.path={corpus}",
                     override, *RUN, "--runs-dir", str(tmp_path), "--name", "refused"])
    err = capsys.readouterr().err
    assert code == 2 and f"data.path {corpus}" in err and f"data.eeg.{field}=" in err, err


def test_a_recording_that_fails_a_check_is_skipped_with_a_warning_naming_it(tmp_path):
    import mne

    short = tmp_path / "short.edf"
    raw = mne.io.RawArray(np.zeros((2, 2000)), mne.create_info(["Fp1", "Fp2"], 200.0, "eeg"), verbose="error")
    mne.export.export_raw(str(short), raw, fmt="edf", overwrite=True, verbose="error")
    settings = P.CorpusSettings(channels=["Fp1", "Fp2"])  # the paper's 5 min minimum: 10 s is too short
    with pytest.warns(UserWarning, match=r"skipped.*short\.edf.*too short"):
        assert P.prepare_recording(settings, str(short)) == []
    with pytest.raises(eeg.EEGError, match=r"short\.edf.*too short"):
        P.prepare_recording(dataclasses.replace(settings, skip_bad_files=False), str(short))


def test_channel_names_are_compared_as_sites():
    # T3 and T7 are one electrode; case and reference suffixes do not matter
    assert P._same("channels", ["FP1", "T3", "EEG T5-REF"], ["Fp1", "T7", "P7"])
    assert not P._same("channels", ["FP1", "T3"], ["T3", "FP1"])


def test_two_ranks_equal_one_process_at_the_same_global_batch(corpus, single_run, tmp_path):
    # DDP over 2 processes with 4 windows each against the single process with 8: the same samples
    # per step (the engine's sampler), the same masks (drawn per window index), the loss divided by
    # the global batch's masked values. Dropout is off in both: the backbone draws its dropout
    # masks from each process's RNG (models/cbramod), so with it the runs agree in distribution
    # only. Equal to float tolerance: the 2 ranks sum their gradients in another order.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", distributed.RUN_DIR_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "domainfm.cli", "pretrain", "cbramod", "--config", "pretrain_demo",
         "data.kind=streaming", f"data.path={corpus}", "train.batch_size=4", "train.devices=2", "train.strategy=ddp",
         "train.accelerator=cpu", *RUN, "--runs-dir", str(tmp_path / "runs"), "--name", "two"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    two = tmp_path / "runs" / "cbramod" / "two"
    np.testing.assert_allclose(_losses(two), _losses(single_run), rtol=1e-5)
    # validation (at the epoch's end) pools every masked value over both ranks' windows
    assert len(_losses(two, "val")) == 2
    np.testing.assert_allclose(_losses(two, "val"), _losses(single_run, "val"), rtol=1e-5)
    a = torch.load(single_run / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith("in_proj.bias"):
            # the key bias has no gradient (softmax ignores a shift of every score): it holds only
            # Adam's steps on rounding noise, which differs with the order of the sums; queries
            # and values are compared as the rest
            n = a[key].shape[0] // 3
            assert a[key][n:2 * n].abs().max() < 1e-3 and b[key][n:2 * n].abs().max() < 1e-3
            a[key], b[key] = (torch.cat([t[:n], t[2 * n:]]) for t in (a[key], b[key]))
        # 7 Adam steps of lr 3e-3 apart by less than 2 % of one step (measured: 1.2e-5)
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=5e-5, msg=key)
