"""WBM fine-tuning: the linear probe on separable and on uninformative features, weeks from an
``.npz`` with their labels, and one pretraining stage + probe run through the CLI."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm import cli, config as cfgmod, create_model
from domainfm.finetune.wearables import Config, DataSection, build_task, linear_probe


def test_linear_probe_separates_informative_features_only():
    rng = np.random.default_rng(0)

    def split(n):
        y = rng.integers(0, 2, n).astype(float)
        signal = y + 0.3 * rng.standard_normal(n)
        # the signal is in two correlated columns, so it is the first principal component
        return np.c_[signal, signal + 0.1 * rng.standard_normal(n), rng.standard_normal((n, 3))], y

    feats, targets = {}, {}
    for part, n in (("train", 200), ("val", 80), ("test", 80)):
        feats[part], targets[part] = split(n)
    good = linear_probe(feats, targets, pca=2)
    assert good["auroc"] > 0.95 and good["balanced_accuracy"] > 0.85 and 0 < good["auprc"] <= 1
    noise = {k: v[:, 2:] for k, v in feats.items()}
    bad = linear_probe(noise, targets)
    assert 0.3 < bad["auroc"] < 0.7
    reg = linear_probe(feats, {k: 2 * v[:, 0] for k, v in feats.items()})
    assert reg["r2"] > 0.99


def test_npz_weeks_and_labels_become_the_task(tmp_path):
    rng = np.random.default_rng(0)
    participant = np.repeat(np.arange(10), 2)
    raw = rng.normal(size=(20, 168, 3)).astype(np.float32)
    raw[:, :10] = np.nan
    np.savez(tmp_path / "w.npz", values=raw, participant=participant, variables=np.array(["a", "b", "c"]))
    fit = rng.integers(0, 2, 10)
    pd.DataFrame({"participant": np.arange(10), "fit": fit}).to_csv(tmp_path / "l.csv", index=False)
    data = DataSection(kind="npz", path=str(tmp_path / "w.npz"), labels=str(tmp_path / "l.csv"))
    task = build_task(Config(target="fit", data=data))
    assert task.info["variables"] == "a,b,c" and task.info["weeks"] == 20 and task.task == "binary"
    for split, dataset in (("train", task.train), ("val", task.val), ("test", task.test)):
        idx = task.extras["split"][split]
        (values, observed), y = torch.utils.data.default_collate([dataset[i] for i in range(len(dataset))])
        np.testing.assert_array_equal(y.numpy(), fit[participant[idx]])  # each week has its participant's label
        np.testing.assert_array_equal(values.numpy(), np.nan_to_num(raw[idx]))
        assert not observed[:, :10].any() and observed[:, 10:].all()
    train = raw[task.extras["split"]["train"], 10:].reshape(-1, 3)
    np.testing.assert_allclose(task.extras["zscore"], [train.mean(0), train.std(0)], rtol=1e-5)


def test_probe_evaluation_through_cli(tmp_path):
    args = ["finetune", "wearables", "data.synthetic_participants=30", "data.synthetic_weeks=2",
            "stages=[{family: wearables, config: pretrain_demo, overrides: [data.synthetic_participants=12, "
            "data.synthetic_weeks=2, train.max_steps=2, train.batch_size=8]}]",
            "train.max_steps=2", "train.batch_size=8", "train.precision=32-true", "probe.c_grid=[1.0]",
            "--runs-dir", str(tmp_path), "--name", "f"]
    assert cli.main(args) == 0
    run = tmp_path / "wearables" / "f"
    report = json.loads((run / "report.json").read_text())
    assert report["labels"].startswith("synthetic:") and "SYNTHETIC" in report["data"]["data_source"]
    assert report["stages"][0]["saved_model"]
    pre, rnd = report["arms"]["pretrained"], report["arms"]["random"]
    assert pre["init"].startswith("pretrained") and rnd["init"].startswith("random")
    for arm in (pre, rnd):
        assert set(arm["probe"]) == {"short_sleep", "low_fitness", "shift_work", "short_sleep_week (per week)"}
        for metrics in arm["probe"].values():
            assert {"auroc", "auprc", "balanced_accuracy"} <= set(metrics)
        assert arm["probe_handmade"] == pre["probe_handmade"]  # one baseline, shown beside each arm
    assert report["params"]["trainable"] == 33  # linear probe: the head (32 + 1) only
    assert report["data"]["participants"] == 30 and report["data"]["test_weeks"] == 12  # 6 test people x 2 weeks
    assert (run / "pretrained" / "model").is_dir() and (run / "random" / "model").is_dir()
    # each arm's test figures, recomputed from its saved model on the test participants' weeks
    from sklearn.metrics import roc_auc_score

    test = build_task(cfgmod.from_dict(Config, cfgmod.load_yaml(run / "config.yaml"))).test
    (values, observed), y = torch.utils.data.default_collate([test[i] for i in range(len(test))])
    for name, arm in (("pretrained", pre), ("random", rnd)):
        with torch.no_grad():
            logits = create_model(run / name / "model").eval()(values, observed, raw=True).reshape(-1)
        assert arm["test"]["loss"] == pytest.approx(torch.nn.functional.binary_cross_entropy_with_logits(
            logits, y).item(), rel=1e-4)
        assert arm["test"]["roc_auc"] == pytest.approx(roc_auc_score(y.numpy(), logits.numpy()))
    # forgetting: the retained capability (probe AUROC on the tasks other than the target) is the
    # probe protocol's figure for those tasks, and, the backbone frozen by the linear probe,
    # unchanged by training
    assert report["retained_capability"]["metric"] == "auroc"
    for arm in (pre, rnd):
        others = [k for k, v in arm["probe"].items() if k != "low_fitness" and np.isfinite(v["auroc"])]
        assert others and set(arm["retained"]["tasks"]) == set(others)
        assert arm["retained"]["tasks"] == pytest.approx({k: arm["probe"][k]["auroc"] for k in others})
        assert arm["retained"]["auroc"] == pytest.approx(np.mean([arm["probe"][k]["auroc"] for k in others]))
        assert arm["retained_before"]["auroc"] == pytest.approx(arm["retained"]["auroc"])
        assert arm["retained_before"]["tasks"] == pytest.approx(arm["retained"]["tasks"])

    # predict / embed through the CLI, on one simulated participant written as a long CSV
    from domainfm.data_loaders.wearables_synthetic import synthetic_cohort

    table = synthetic_cohort(1, 2, seed=5).tables[0]
    long = table.rename_axis("timestamp").reset_index().melt("timestamp", var_name="variable").dropna()
    long.to_csv(tmp_path / "person.csv", index=False)
    out = tmp_path / "weeks.csv"
    assert cli.main(["predict", "wearables", "--model", str(run), "--arm", "random", "--input",
                     str(tmp_path / "person.csv"), "--output", str(out), "--precision", "32-true"]) == 0
    weeks = pd.read_csv(out)
    assert list(weeks.columns) == ["week_start", "week_end", "hours_observed", "p_low_fitness"]
    assert len(weeks) == 2 and ((weeks["p_low_fitness"] > 0) & (weeks["p_low_fitness"] < 1)).all()
    # the same numbers as the model applied directly to the cohort's own weeks
    from domainfm.data_loaders import wearables as W

    model = create_model(run / "random" / "model").eval()
    identity = W.ZScoreStats(tuple(model.variables), np.zeros(len(model.variables)), np.ones(len(model.variables)))
    v, o, _ = W.to_weeks(table, variables=model.variables, stats=identity, min_hours=24)
    with torch.no_grad():
        direct = torch.sigmoid(model(torch.as_tensor(v), torch.as_tensor(o), raw=True)).reshape(-1).numpy()
    np.testing.assert_allclose(weeks["p_low_fitness"], direct, rtol=1e-5, atol=1e-6)
    assert cli.main(["embed", "wearables", "--model", str(run), "--input", str(tmp_path / "person.csv"),
                     "--output", str(tmp_path / "e.npz")]) == 0
    emb = np.load(tmp_path / "e.npz")
    assert emb["X"].shape == (2, model.num_features) and np.isfinite(emb["X"]).all()


def test_predict_wearables_bad_input(tmp_path, capsys):
    from domainfm import save_pretrained

    model = create_model("wbm-test", n_chans=2, n_times=168, n_outputs=1, variables=["steps", "heart_rate"])
    save_pretrained(model, tmp_path / "m")
    (tmp_path / "x.txt").write_text("nothing")
    assert cli.main(["predict", "wearables", "--model", str(tmp_path / "m"), "--input", str(tmp_path / "x.txt"),
                     "--output", str(tmp_path / "o.csv")]) == 2
    assert "x.txt" in capsys.readouterr().err
    pd.DataFrame({"timestamp": ["2024-01-01 10:00"], "variable": ["sleep_min"], "value": [30.0]}).to_csv(
        tmp_path / "other.csv", index=False)
    assert cli.main(["predict", "wearables", "--model", str(tmp_path / "m"), "--input", str(tmp_path / "other.csv"),
                     "--output", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "none of the model's variables" in err and not (tmp_path / "o.csv").exists()


def test_model_without_variables_is_a_one_line_error_naming_the_folder(tmp_path, capsys):
    from domainfm import save_pretrained

    save_pretrained(create_model("wbm-test", n_chans=2, n_times=168, n_outputs=1), tmp_path / "no_vars")
    (tmp_path / "p.csv").write_text("timestamp,variable,value\n2024-01-01 10:00,steps,30\n")
    for command, out in (("predict", tmp_path / "o.csv"), ("embed", tmp_path / "o.npz")):
        assert cli.main([command, "wearables", "--model", str(tmp_path / "no_vars"), "--input", str(tmp_path / "p.csv"),
                         "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert str(tmp_path / "no_vars") in err and "variables" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) <= 2  # the message and the --debug hint
        assert not out.exists()
    save_pretrained(create_model("wbm-test", n_chans=2, n_times=168, n_outputs=None, variables=["steps", "heart_rate"]),
                    tmp_path / "headless")
    assert cli.main(["predict", "wearables", "--model", str(tmp_path / "headless"), "--input", str(tmp_path / "p.csv"),
                     "--output", str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "headless" in err and "no head" in err and "Traceback" not in err


def test_unzipped_apple_health_folder_gives_the_weeks_of_its_export_xml(tmp_path):
    from types import SimpleNamespace

    from domainfm.finetune.wearables import read_weeks

    records = "".join(
        f' <Record type="HKQuantityTypeIdentifier{kind}" sourceName="Watch" unit="{unit}" '
        f'startDate="2024-01-0{d} {h:02d}:00:00 +0100" endDate="2024-01-0{d} {h:02d}:10:00 +0100" value="{v + h}"/>\n'
        for d in (1, 2) for h in range(0, 24, 2) for kind, unit, v in (("StepCount", "count", 100),
                                                                       ("HeartRate", "count/min", 60)))
    folder = tmp_path / "apple_health_export"
    folder.mkdir()
    xml = folder / "export.xml"
    xml.write_text('<?xml version="1.0" encoding="UTF-8"?>\n<HealthData locale="en_GB">\n' + records
                   + "</HealthData>\n")
    model = SimpleNamespace(variables=["steps", "heart_rate"])
    direct = read_weeks(str(xml), model, min_hours=1)
    for given in (folder, tmp_path):  # the export folder, or the one export.zip was unpacked into
        weeks = read_weeks(str(given), model, min_hours=1)
        np.testing.assert_allclose(weeks.values, direct.values)
        assert (weeks.observed == direct.observed).all() and list(weeks.week_starts) == list(direct.week_starts)
    assert direct.observed.any(-1).sum() == 24 and direct.values[0, 10, 0] == pytest.approx(110)
