"""CBraMod predict / embed through the CLI on the shipped recording, and the retained capability.

A tiny fine-tuning run (cbramod-test, 3 steps) on the embedded demo task and one on a labelled
4-channel EDF give the models; the tests check that recordings are windowed exactly as the
fine-tuning data were (same windows as the task's own), the output files, other formats, the
precision tolerance, clear errors for bad recordings, and the forgetting measurement.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import mne
import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import cli, create_model, save_pretrained
from domainfm.data_loaders import eeg
from domainfm.experiment.inference import run_config
from domainfm.finetune import cbramod as ft

SHIPPED = eeg.samples_dir() / "S001R02.edf"
POSTERIOR_0 = ["P7", "P5", "P3", "P1"]  # the first 4-channel group of the demo's posterior region


def _official_weights(path, seed=5):
    from domainfm.models.cbramod import to_official_state_dict

    torch.manual_seed(seed)
    source = create_model("cbramod-test", n_outputs=None)  # with the reconstruction head (proj_out)
    torch.save(to_official_state_dict(source), path)
    return path


def _write_labelled(path, seconds=30, sfreq=200.0, names=("Fp1", "Fp2", "O1", "O2"), seed=0):
    rng = np.random.default_rng(seed)
    n = int(seconds * sfreq)
    data = 5 * rng.standard_normal((len(names), n))
    onsets, labels = [], []
    for k, onset in enumerate(np.arange(1.0, seconds - 3, 3.0)):
        label = "A" if k % 2 == 0 else "B"
        s = int(onset * sfreq)
        t = np.arange(int(2 * sfreq)) / sfreq
        data[0 if label == "A" else 3, s:s + len(t)] += 40 * np.sin(2 * np.pi * 10 * t)
        onsets.append(onset)
        labels.append(label)
    raw = mne.io.RawArray(data * 1e-6, mne.create_info(list(names), sfreq, "eeg"), verbose="error")
    raw.set_annotations(mne.Annotations(onsets, [2.0] * len(onsets), labels))
    mne.export.export_raw(str(path), raw, fmt="edf", overwrite=True, verbose="error")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cbramod_predict")
    weights = _official_weights(root / "pretrained_weights.pth")
    common = ["model.name=cbramod-test", f"model.pretrained={weights}", "model.kwargs={}", "stages=[]",
              "train.max_steps=3", "train.batch_size=8", "train.progress=false", "--runs-dir", str(root / "runs")]
    assert cli.main(["finetune", "cbramod", "data.kind=demo", "n_outputs=3", *common, "--name", "demo"]) == 0
    data = root / "data"
    data.mkdir()
    _write_labelled(data / "train.edf", seed=0)
    _write_labelled(data / "val.edf", seconds=20, seed=1)
    assert cli.main(["finetune", "cbramod", "data.kind=files", f"data.root={data}", "data.train=[train.edf]",
                     "data.val=[val.edf]", "data.eeg.channels=[Fp1, Fp2, O1, O2]", "data.eeg.events={A: 0, B: 1}",
                     "data.eeg.window_s=2.0", "data.eeg.allow_upsample=false", "n_outputs=2", "arms=[pretrained]", *common, "--name", "files"]) == 0
    return {"root": root, "weights": weights, "demo": root / "runs" / "cbramod" / "demo",
            "files": root / "runs" / "cbramod" / "files", "data": data}


def _csv(path):
    return pd.read_csv(path)


def test_predict_cli_windows_the_recording_as_the_fine_tuning_task_did(runs, tmp_path):
    out = tmp_path / "pred.csv"
    assert cli.main(["predict", "cbramod", "--model", str(runs["demo"]), "--input", str(SHIPPED), "--output", str(out),
                     "--channels", ",".join(POSTERIOR_0), "--precision", "32-true", "--stride-s", "2"]) == 0
    frame = _csv(out)
    # the shipped recording is 61 s; 4-s windows every 2 s: starts 0, 2, ..., 56
    assert len(frame) == 29
    np.testing.assert_allclose(frame["start_s"], np.arange(29) * 2.0)
    np.testing.assert_allclose(frame["end_s"], frame["start_s"] + 4.0)
    assert list(frame.columns) == ["start_s", "end_s", "predicted", "p_frontal", "p_central", "p_posterior"]
    probs = frame[["p_frontal", "p_central", "p_posterior"]].to_numpy()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-9)
    assert (frame["predicted"].to_numpy() == np.array(["frontal", "central", "posterior"])[probs.argmax(1)]).all()
    # the first 19 windows (starts 0..36 s) are exactly the demo task's training windows of this
    # channel group: same reference, resampling, filters, units and cut
    train, _ = ft.build_demo_task(run_config(runs["demo"], ft.Config).data.eeg)
    group = 8 * 19  # region 2 (posterior), group 0, in build_demo_task's order
    model = create_model(runs["demo"] / "pretrained" / "model").eval()
    with torch.no_grad():
        expected = torch.softmax(model(train.x[group:group + 19]).double(), dim=-1).numpy()
    np.testing.assert_allclose(probs[:19], expected, atol=1e-5)
    assert (train.y[group:group + 19] == 2).all()


def test_predict_files_run_uses_its_channels_and_event_names_and_other_formats_agree(runs, tmp_path):
    rec = runs["data"] / "val.edf"
    out = tmp_path / "edf.csv"
    assert cli.main(["predict", "cbramod", "--model", str(runs["files"]), "--input", str(rec), "--output", str(out),
                     "--precision", "32-true"]) == 0
    frame = _csv(out)
    assert list(frame.columns) == ["start_s", "end_s", "predicted", "p_A", "p_B"]
    assert len(frame) == 10 and np.allclose(frame["start_s"], np.arange(10) * 2.0)
    np.testing.assert_allclose(frame[["p_A", "p_B"]].sum(axis=1), 1.0, atol=1e-9)
    # the same windows through load_windows' pipeline (files kind: pick, then preprocess)
    settings = ft.inference_settings(runs["files"], create_model(runs["files"] / "pretrained" / "model")).eeg
    # the run's config: the shipped finetune.yaml's average reference, 0.3-75 Hz, 60 Hz notch
    raw = eeg.preprocess(eeg.pick_channels(eeg.read_raw(rec), ["Fp1", "Fp2", "O1", "O2"]), sfreq=200.0,
                         reference="average")
    x, _ = eeg.fixed_windows(raw, window_s=2.0)
    model = create_model(runs["files"] / "pretrained" / "model").eval()
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(eeg.to_model_units(x))).double(), -1).numpy()
    assert settings.channels == ["Fp1", "Fp2", "O1", "O2"] and settings.window_s == 2.0
    np.testing.assert_allclose(frame[["p_A", "p_B"]].to_numpy(), expected, atol=1e-5)

    # FIF and BrainVision written from the same recording read the same
    raw = eeg.read_raw(rec)
    raw.save(str(tmp_path / "val_raw.fif"), fmt="double", verbose="error")
    _write_brainvision(tmp_path / "val.vhdr", raw)
    for name in ("val_raw.fif", "val.vhdr"):
        other = tmp_path / f"{name}.csv"
        assert cli.main(["predict", "cbramod", "--model", str(runs["files"]), "--input", str(tmp_path / name),
                         "--output", str(other), "--precision", "32-true"]) == 0
        got = _csv(other)
        assert (got["predicted"] == frame["predicted"]).all() and np.allclose(got["start_s"], frame["start_s"])
        np.testing.assert_allclose(got[["p_A", "p_B"]], frame[["p_A", "p_B"]], atol=1e-5)


def _write_brainvision(vhdr, raw):
    """A minimal BrainVision triplet (IEEE float32, multiplexed, µV), written by hand."""
    data = (raw.get_data() * 1e6).astype("<f4")
    stem = vhdr.with_suffix("")
    (stem.with_suffix(".eeg")).write_bytes(data.T.tobytes())
    (stem.with_suffix(".vmrk")).write_text(
        "Brain Vision Data Exchange Marker File, Version 1.0\n[Common Infos]\nCodepage=UTF-8\n"
        f"DataFile={stem.name}.eeg\n[Marker Infos]\nMk1=New Segment,,1,1,0\n")
    channels = "".join(f"Ch{i + 1}={name},,1,µV\n" for i, name in enumerate(raw.ch_names))
    vhdr.write_text(
        "Brain Vision Data Exchange Header File Version 1.0\n[Common Infos]\nCodepage=UTF-8\n"
        f"DataFile={stem.name}.eeg\nMarkerFile={stem.name}.vmrk\nDataFormat=BINARY\nDataOrientation=MULTIPLEXED\n"
        f"NumberOfChannels={len(raw.ch_names)}\nSamplingInterval={1e6 / raw.info['sfreq']:g}\n"
        "[Binary Infos]\nBinaryFormat=IEEE_FLOAT_32\n[Channel Infos]\n" + channels)


def test_embed_cli_width_values_and_copied_model_folder(runs, tmp_path):
    out = tmp_path / "emb.npz"
    model_dir = runs["files"] / "pretrained" / "model"
    # a model folder copied out of its run keeps its windowing (apply_settings.json beside it)
    copied = tmp_path / "copied"
    shutil.copytree(model_dir, copied)
    assert (copied / ft.SETTINGS_FILE).is_file()
    assert cli.main(["embed", "cbramod", "--model", str(copied), "--input", str(runs["data"] / "val.edf"),
                     "--output", str(out), "--precision", "32-true"]) == 0
    with np.load(out) as arrays:
        emb, starts, ends, chans = arrays["embeddings"], arrays["start_s"], arrays["end_s"], arrays["channels"]
    model = create_model(copied).eval()
    assert emb.shape == (10, model.num_features) and model.num_features == 200
    assert list(chans) == ["Fp1", "Fp2", "O1", "O2"] and np.allclose(ends - starts, 2.0)
    raw = eeg.preprocess(eeg.pick_channels(eeg.read_raw(runs["data"] / "val.edf"), list(chans)), sfreq=200.0,
                         reference="average")
    x = torch.from_numpy(eeg.to_model_units(eeg.fixed_windows(raw, window_s=2.0)[0]))
    with torch.no_grad():  # pooled as the head sees them: the input of its last linear layer
        expected = model.forward_head(model.forward_features(x), pre_logits=True).numpy()
        logits = model.head.fc(torch.from_numpy(emb))
    np.testing.assert_allclose(emb, expected, atol=1e-5)
    torch.testing.assert_close(logits, model(x), atol=1e-4, rtol=1e-4)

    # a backbone without head (card settings: 200 Hz, n_times from the model): mean-pooled patches
    bare = create_model("cbramod-test", n_outputs=None, n_chans=4, n_times=400)
    save_pretrained(bare, tmp_path / "bare")
    out2 = tmp_path / "bare.npz"
    assert cli.main(["embed", "cbramod", "--model", str(tmp_path / "bare"), "--input", str(runs["data"] / "val.edf"),
                     "--output", str(out2), "--precision", "32-true"]) == 0
    with np.load(out2) as arrays:
        assert arrays["embeddings"].shape == (10, 200) and np.allclose(arrays["start_s"], np.arange(10) * 2.0)


@pytest.mark.parametrize("case", ["wrong_channels", "too_short", "low_rate"])
def test_bad_recordings_are_one_line_errors_naming_the_file(runs, tmp_path, capsys, case):
    if case == "wrong_channels":
        rec = _write_labelled(tmp_path / "other.edf", seconds=10, names=("C3", "C4", "Cz", "Pz"))
        expected = "channel(s) ['Fp1', 'Fp2', 'O1', 'O2'] not found"
    elif case == "too_short":
        rec = _write_labelled(tmp_path / "short.edf", seconds=1.0)  # shorter than one 2-s window
        expected = "recording too short"
    else:
        rec = _write_labelled(tmp_path / "slow.edf", seconds=10, sfreq=100.0)
        expected = "sampling rate 100 Hz is below the target 200 Hz"
    out = tmp_path / "out.csv"
    capsys.readouterr()
    code = cli.main(["predict", "cbramod", "--model", str(runs["files"]), "--input", str(rec), "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    first = err.splitlines()[0]
    assert first.startswith("domainfm predict: error: ") and str(rec) in first and expected in first
    assert "Traceback" not in err and len([l for l in err.splitlines() if "error" in l]) == 1
    # the demo model takes 4 channels: naming 3 is a clear error, not a shape error
    if case == "wrong_channels":
        code = cli.main(["predict", "cbramod", "--model", str(runs["demo"]), "--input", str(SHIPPED),
                         "--output", str(out), "--channels", "Fp1,Fp2,Oz"])
        err = capsys.readouterr().err
        assert code == 2 and "the model takes 4 channels but the recording gives 3" in err and str(SHIPPED) in err


def test_predict_warns_about_a_truncated_edf_and_bad_channels_and_still_answers(runs, tmp_path):
    full = runs["data"] / "val.edf"  # 20 s: ten 2-s windows
    raw_bytes = full.read_bytes()
    header = int(raw_bytes[184:192])
    cut = tmp_path / "cut.edf"
    cut.write_bytes(raw_bytes[: header + (len(raw_bytes) - header) * 3 // 10])
    out = tmp_path / "cut.csv"
    with pytest.warns(UserWarning, match=r"cut\.edf: truncated EDF file: it holds 6 s of the 20 s"):
        assert cli.main(["predict", "cbramod", "--model", str(runs["files"]), "--input", str(cut), "--output",
                         str(out), "--precision", "32-true"]) == 0
    np.testing.assert_allclose(_csv(out)["start_s"], [0.0, 2.0, 4.0])
    # a FIF whose Fp1 is marked bad: the model needs Fp1, so it is interpolated (and said so), not read
    raw = eeg.read_raw(full)
    raw.info["bads"] = ["Fp1"]
    raw.save(str(tmp_path / "bad_raw.fif"), verbose="error")
    with pytest.warns(UserWarning, match=r"bad_raw\.fif: channel\(s\) \['Fp1'\] marked bad .* interpolated"):
        assert cli.main(["predict", "cbramod", "--model", str(runs["files"]), "--input", str(tmp_path / "bad_raw.fif"),
                         "--output", str(tmp_path / "bad.csv"), "--precision", "32-true"]) == 0
    assert len(_csv(tmp_path / "bad.csv")) == 10


def test_bf16_probabilities_stay_within_the_documented_tolerance(runs):
    from domainfm.precision import autocast

    # the fine-tuned demo model (the worst case measured), and a random one with the pooling head
    torch.manual_seed(0)
    pooled = create_model("cbramod-test", n_chans=4, n_times=800, n_outputs=3, head_type="avgpooling_patch_reps")
    settings = ft._apply_overrides(ft.inference_settings(runs["demo"], pooled), channels=POSTERIOR_0)
    worst = 0.0
    for model in (create_model(runs["demo"] / "pretrained" / "model").eval(), pooled.eval()):
        fp32 = ft.predict(SHIPPED, model, settings, precision="32-true")
        bf16 = ft.predict(SHIPPED, model, settings, precision="bf16-mixed")
        cols = [c for c in fp32.columns if c.startswith("p_")]
        diff = np.abs(fp32[cols].to_numpy() - bf16[cols].to_numpy())
        assert diff.mean() < 0.02 and (fp32["predicted"] == bf16["predicted"]).mean() >= 0.9  # documented
        np.testing.assert_allclose(bf16[cols].sum(axis=1), 1.0, atol=1e-9)
        x = torch.from_numpy(eeg.recording_windows(SHIPPED, settings.eeg, reference_all=True)[0])
        with torch.no_grad():
            logits = model(x)
            with autocast("bf16-mixed"):
                low = model(x).float()
        assert (low - logits).abs().max() < 0.02 * logits.abs().max()  # documented: 2 % of the logit scale
        worst = max(worst, diff.max())
    assert worst > 1e-3  # bf16 autocast was really in effect


def test_report_carries_retained_capability_before_and_after(runs):
    report = json.loads((runs["demo"] / "report.json").read_text())
    assert report["retained_capability"]["metric"] == "masked_mse" and report["retained_capability"]["direction"] == "min"
    assert set(report["arms"]) == {"pretrained", "random"}
    # the random arm's backbone is another model: its retained error is its own, not the pretrained one's
    random_before = report["arms"]["random"]["retained_before"]["masked_mse"]
    assert np.isfinite(random_before) and random_before != pytest.approx(report["retained_before"]["masked_mse"], rel=1e-3)
    # held-out data: channels of the recording that the demo task never uses
    assert not set(ft.DEMO_HELD_OUT) & {c for region in ft.DEMO_REGIONS.values() for c in region}
    # independent reference: the pretrained model itself (backbone + its own reconstruction head)
    # on the same windows and mask, with the pretraining objective's forward
    x, mask = ft.retained_windows(run_config(runs["demo"], ft.Config))
    assert x.shape == (15, 16, 800) and mask.shape == (15, 16, 4)
    pretrained = create_model("cbramod-test", pretrained=str(runs["weights"]), n_outputs=None).eval()
    with torch.no_grad():
        rec = pretrained.forward_reconstruction(x, mask)
    patches = x.reshape(15, 16, 4, 200)
    expected = torch.nn.functional.mse_loss(rec[mask], patches[mask]).item()
    assert report["retained_before"]["masked_mse"] == pytest.approx(expected, rel=1e-5)
    assert report["retained_before"]["zero_mse"] == pytest.approx(float((patches[mask] ** 2).mean()), rel=1e-5)
    # fine-tuning moved the backbone, so the retained error moved too
    after = report["arms"]["pretrained"]["retained"]["masked_mse"]
    assert after != pytest.approx(expected, rel=1e-6)


def test_reconstruction_head_comes_from_the_stage_or_is_reported_missing(tmp_path):
    from domainfm import config as cfgmod
    from domainfm.experiment import ArmContext, InitInfo, TaskData

    # an in-process pretraining stage's saved model (with its reconstruction head) is the source
    torch.manual_seed(3)
    stage_model = create_model("cbramod-test", n_outputs=None)
    saved = save_pretrained(stage_model, tmp_path / "run" / "stages" / "0-cbramod" / "model")
    (tmp_path / "run" / "stages" / "0-cbramod" / "report.json").write_text(json.dumps({"saved_model": str(saved)}))
    cfg = cfgmod.from_dict(ft.Config, cfgmod.load_yaml(cfgmod.config_path("cbramod", "finetune")))
    cfg = cfgmod.from_dict(ft.Config, cfgmod.apply_overrides(cfgmod.to_dict(cfg), [
        "model.name=cbramod-test", "model.kwargs={}", "model.pretrained=null",
        'stages=[{"family": "cbramod", "config": "pretrain_demo"}]']))
    arm_model = create_model("cbramod-test", n_chans=4, n_times=800, n_outputs=3, reconstruction_head=False).eval()
    ctx = ArmContext(cfg, "random", 1, arm_model, TaskData(None, None), tmp_path / "run" / "random" / "seed1",
                     InitInfo("random"), "full")
    assert ft._reconstruction_source(ctx) == str(saved)
    out = ft.RETAINED(ctx)
    x, mask = ft.retained_windows(cfg)
    expected = ft.masked_reconstruction_error(arm_model, stage_model.proj_out, x, mask)
    assert out["masked_mse"] == pytest.approx(expected, rel=1e-6) and np.isfinite(expected)
    # no pretrained model at all (random init, no stage): NaN with the reason, never a made-up head
    cfg.stages = []
    out = ft.RETAINED(ctx)
    assert np.isnan(out["masked_mse"]) and "no pretrained model" in out["note"]


# ----------------------------------------------------------------------------- the channel contract

DEMO_DEFAULT = ["Fp1", "Fpz", "Fp2", "Af7"]  # the first 4-channel group of the demo's frontal region
# non-scalp signals that TUH-style EDFs carry and type as EEG
EXTRAS = ["EEG EKG1-REF", "EOG ROC", "EEG A1-REF", "EEG 26-REF", "PHOTIC-REF"]


def _tuh_name(name):
    """A shipped (EEGMMIDB) label as TUH writes it: upper case, 'EEG ' and '-REF', old 10-20 names."""
    key = name.rstrip(".").upper()
    old = {"T7": "EEG T3-REF", "T8": "EEG T4-REF", "P7": "EEG T5-LE", "P8": "EEG T6-LE"}
    return old.get(key, f"EEG {key}-REF")


def _export(path, data, names, sfreq):
    raw = mne.io.RawArray(data, mne.create_info(list(names), sfreq, "eeg"), verbose="error")
    # each channel quantised on its own range, so its samples do not depend on the other channels
    mne.export.export_raw(str(path), raw, fmt="edf", physical_range="channelwise", overwrite=True, verbose="error")
    return path


def _clean_and_tuh(source, tmp_path, drop=()):
    """(clean, tuh): ``source``'s signals re-written as EDF under its own names, and again with TUH
    names, in reversed order, with five extra channels (±800 µV) in the middle, less ``drop``."""
    raw = eeg.read_raw(source)
    data, names, sfreq = raw.get_data(), list(raw.ch_names), raw.info["sfreq"]
    clean = _export(tmp_path / f"clean_{source.stem}.edf", data, names, sfreq)
    keep = [i for i, n in enumerate(names) if n.rstrip(".") not in drop][::-1]
    t = np.arange(data.shape[1]) / sfreq
    extra = np.stack([800e-6 * np.sin(2 * np.pi * (1.3 + k) * t) for k in range(len(EXTRAS))])
    half = len(keep) // 2
    rows = np.concatenate([data[keep[:half]], extra, data[keep[half:]]])
    tuh_names = [_tuh_name(names[i]) for i in keep[:half]] + EXTRAS + [_tuh_name(names[i]) for i in keep[half:]]
    return clean, _export(tmp_path / f"tuh_{source.stem}.edf", rows, tuh_names, sfreq)


def _probs(frame):
    return frame[[c for c in frame.columns if c.startswith("p_")]].to_numpy()


def test_the_demo_run_remembers_its_channels_and_predicts_the_shipped_recording_without_channels(runs, tmp_path,
                                                                                                 capsys):
    recorded = json.loads((runs["demo"] / "pretrained" / "model" / ft.SETTINGS_FILE).read_text())
    assert recorded["eeg"]["channels"] == DEMO_DEFAULT and recorded["reference_all"] is True
    out = tmp_path / "pred.csv"
    capsys.readouterr()
    assert cli.main(["predict", "cbramod", "--model", str(runs["demo"]), "--input", str(SHIPPED), "--output", str(out),
                     "--precision", "32-true", "--stride-s", "2"]) == 0
    summary = capsys.readouterr().out
    assert "4 of the model's 4 channels found by name (Fp1=Fp1., Fpz=Fpz., Fp2=Fp2., Af7=Af7.)" in summary
    assert "60 other channel(s) of the file dropped" in summary
    # the first 19 windows are the demo task's training windows of its first channel group (frontal)
    train, _ = ft.build_demo_task(run_config(runs["demo"], ft.Config).data.eeg)
    model = create_model(runs["demo"] / "pretrained" / "model").eval()
    with torch.no_grad():
        expected = torch.softmax(model(train.x[:19]).double(), dim=-1).numpy()
    assert (train.y[:19] == 0).all()
    np.testing.assert_allclose(_probs(_csv(out))[:19], expected, atol=1e-5)


@pytest.mark.parametrize("run, source, channels", [("demo", SHIPPED, None), ("demo", SHIPPED, "P7,P5,P3,P1"),
                                                   ("files", "val.edf", None)])
def test_a_tuh_style_edf_gives_the_clean_files_probabilities(runs, tmp_path, capsys, run, source, channels):
    source = runs["data"] / source if isinstance(source, str) else source
    clean, tuh = _clean_and_tuh(source, tmp_path)
    frames = {}
    for name, path in (("clean", clean), ("tuh", tuh)):
        out = tmp_path / f"{name}.csv"
        args = ["predict", "cbramod", "--model", str(runs[run]), "--input", str(path), "--output", str(out),
                "--precision", "32-true"] + (["--channels", channels] if channels else [])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert cli.main(args) == 0
        frames[name] = _csv(out)
    notices = [str(w.message) for w in record if "are not among the model's channels: dropped" in str(w.message)]
    assert len(notices) == 1 and notices[0].startswith(f"{tuh}: ") and "\n" not in notices[0]
    assert all(repr(x) in notices[0] for x in EXTRAS)
    summary = capsys.readouterr().out
    if channels == "P7,P5,P3,P1":  # P7 is the TUH file's old name T5, with a '-LE' suffix
        assert "P7=EEG T5-LE, P5=EEG P5-REF, P3=EEG P3-REF, P1=EEG P1-REF" in summary
    assert len(frames["tuh"]) == len(frames["clean"]) > 0
    assert (frames["tuh"]["predicted"] == frames["clean"]["predicted"]).all()
    np.testing.assert_allclose(_probs(frames["tuh"]), _probs(frames["clean"]), atol=1e-6)


def test_a_missing_channel_is_an_error_and_fill_missing_zeros_runs_and_says_so(runs, tmp_path, capsys):
    _, tuh = _clean_and_tuh(SHIPPED, tmp_path, drop=("Af7",))
    out = tmp_path / "pred.csv"
    capsys.readouterr()
    base = ["--model", str(runs["demo"]), "--input", str(tuh), "--precision", "32-true"]
    assert cli.main(["predict", "cbramod", *base, "--output", str(out)]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert f"{tuh}: channel(s) ['Af7'] not found" in first and "--fill-missing zeros" in first and not out.exists()
    assert "the file has ['EEG IZ-REF', 'EEG O2-REF'" in first and "'EEG EKG1-REF'" in first  # reversed order

    with pytest.warns(UserWarning, match=r"\['Af7'\] are not in the file: fed to the model as zeros"):
        assert cli.main(["predict", "cbramod", *base, "--output", str(out), "--fill-missing", "zeros"]) == 0
    assert "missing ['Af7'] filled with zeros (fill_missing='zeros')" in capsys.readouterr().out
    # independent: the 3 present channels as the loader gives them, and a row of zeros where Af7 goes
    settings = ft.inference_settings(runs["demo"], create_model(runs["demo"] / "pretrained" / "model"))
    present = dataclasses.replace(settings.eeg, channels=["Fp1", "Fpz", "Fp2"])
    x3 = eeg.recording_windows(tuh, present, reference_all=True, notify=False)[0]
    x = torch.from_numpy(np.concatenate([x3, np.zeros_like(x3[:, :1])], axis=1))
    model = create_model(runs["demo"] / "pretrained" / "model").eval()
    with torch.no_grad():
        expected = torch.softmax(model(x).double(), dim=-1).numpy()
    np.testing.assert_allclose(_probs(_csv(out)), expected, atol=1e-6)

    emb = tmp_path / "emb.npz"
    with pytest.warns(UserWarning, match="fed to the model as zeros"):
        assert cli.main(["embed", "cbramod", *base, "--output", str(emb), "--fill-missing", "zeros"]) == 0
    assert "missing ['Af7'] filled with zeros" in capsys.readouterr().out
    with np.load(emb) as arrays:
        assert arrays["embeddings"].shape == (len(expected), model.num_features)
        assert arrays["channels"].tolist() == DEMO_DEFAULT


def test_a_files_run_without_channel_names_records_the_first_files_channels(runs, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write_labelled(data / "train.edf", seed=0)
    # validation and test files list the same electrodes in another order: read by name, not by position
    _write_labelled(data / "val.edf", seconds=20, seed=1, names=("O2", "Fp2", "O1", "Fp1"))
    common = ["model.name=cbramod-test", f"model.pretrained={runs['weights']}", "model.kwargs={}", "stages=[]",
              "train.max_steps=2", "train.batch_size=8", "train.progress=false", "retained.enabled=false",
              "--runs-dir", str(tmp_path / "runs")]
    assert cli.main(["finetune", "cbramod", "data.kind=files", f"data.root={data}", "data.train=[train.edf]",
                     "data.val=[val.edf]", "data.eeg.channels=null", "data.eeg.events={A: 0, B: 1}",
                     "data.eeg.window_s=2.0", "n_outputs=2", "arms=[pretrained]", *common, "--name", "unnamed"]) == 0
    run = tmp_path / "runs" / "cbramod" / "unnamed"
    recorded = json.loads((run / "pretrained" / "model" / ft.SETTINGS_FILE).read_text())
    assert recorded["eeg"]["channels"] == ["Fp1", "Fp2", "O1", "O2"]
    assert json.loads((run / "report.json").read_text())["data"]["channels"] == ["Fp1", "Fp2", "O1", "O2"]
    # the reordered file, read by name, gives what the same signals in training order give
    raw = eeg.read_raw(data / "val.edf")
    reordered = _export(tmp_path / "val_ordered.edf", raw.get_data(picks=["Fp1", "Fp2", "O1", "O2"]),
                        ["Fp1", "Fp2", "O1", "O2"], raw.info["sfreq"])
    shuffled = _export(tmp_path / "val_shuffled.edf", raw.get_data(), raw.ch_names, raw.info["sfreq"])
    got = [ft.predict(path, run, precision="32-true") for path in (reordered, shuffled)]
    np.testing.assert_allclose(_probs(got[1]), _probs(got[0]), atol=1e-6)


@pytest.mark.parametrize("head_type", ["all_patch_reps", "flatten_emb"])
def test_a_head_that_fixes_the_channel_count_refuses_another_count_by_name(head_type):
    # braindecode's classifier (flatten_emb) fixes the channels as all_patch_reps does
    import types

    from domainfm.finetune.cbramod import _check_channels

    model = create_model("cbramod-test", head_type=head_type, n_chans=4, n_times=400, n_outputs=2)
    data = types.SimpleNamespace(x=np.zeros((2, 3, 400), dtype=np.float32), source="rec.edf",
                                 settings=types.SimpleNamespace(eeg=types.SimpleNamespace(channels=["Fp1", "Fp2", "Oz"])))
    with pytest.raises(eeg.EEGError, match="rec.edf: the model takes 4 channels but the recording gives 3"):
        _check_channels(data, model)
    data.x = np.zeros((2, 4, 400), dtype=np.float32)
    _check_channels(data, model)  # the model's own count passes
