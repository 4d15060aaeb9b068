"""WBM pretraining: augmentations, the InfoNCE loss against a hand computation, participant
positives, the synthetic cohort's labels, and one pretraining run through the CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import domainfm
from domainfm import cli
from domainfm.data_loaders.wearables_synthetic import SYNTHETIC_VARIABLES, synthetic_cohort
from domainfm.pretrain.wearables import AugmentSection, WeekDataset, augment, info_nce


def test_augment_shift_masks_and_scaling():
    g = torch.Generator().manual_seed(0)
    values = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(2, 10, 3) + 1
    observed = torch.ones(2, 10, 3, dtype=torch.bool)
    v, o = augment(values, observed, AugmentSection(max_shift=2, mask_hours=0, mask_variables=0, scale_std=0), generator=g)
    for b in range(2):
        # a pure shift: the observed part equals the input moved by s hours, shifted-in hours unobserved
        shifts = [s for s in range(-2, 3) if torch.equal(v[b][o[b].all(-1)],
                                                          values[b][max(0, -s):10 - max(0, s)])]
        assert len(shifts) == 1
        assert int((~o[b].all(-1)).sum()) == abs(shifts[0])
    assert (v[~o] == 0).all()
    many, all_obs = values[:1].expand(400, 10, 3), observed[:1].expand(400, 10, 3)
    v, o = augment(many, all_obs, AugmentSection(max_shift=0, mask_hours=0.3, mask_variables=0.2, scale_std=0),
                   generator=g)
    assert abs((~o).float().mean().item() - (1 - 0.7 * 0.8)) < 0.03
    torch.testing.assert_close(v[o], many[o])
    v, o = augment(values, observed, AugmentSection(max_shift=0, mask_hours=0, mask_variables=0, scale_std=0.5),
                   generator=g)
    ratio = v / values
    assert torch.allclose(ratio, ratio[:, :1, :].expand_as(ratio))  # one factor per example and variable
    assert not torch.allclose(ratio, torch.ones_like(ratio))


def test_info_nce_equals_hand_computation_and_masks_same_participant():
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    loss, _ = info_nce(z1, z2, 0.5)
    a = z1 / z1.norm(dim=1, keepdim=True)
    b = z2 / z2.norm(dim=1, keepdim=True)
    s = (a @ b.T).numpy() / 0.5
    rows = [-s[i, i] + math.log(np.exp(s[i]).sum()) for i in range(4)]
    cols = [-s[i, i] + math.log(np.exp(s[:, i]).sum()) for i in range(4)]
    assert loss.item() == pytest.approx(0.5 * (np.mean(rows) + np.mean(cols)), rel=1e-6)
    group = torch.tensor([0, 0, 1, 2])
    loss_g, _ = info_nce(z1, z2, 0.5, group)
    rows[0] = -s[0, 0] + math.log(np.exp(s[0, [0, 2, 3]]).sum())  # row 0 does not count column 1 as a negative
    rows[1] = -s[1, 1] + math.log(np.exp(s[1, [1, 2, 3]]).sum())
    cols[0] = -s[0, 0] + math.log(np.exp(s[[0, 2, 3], 0]).sum())
    cols[1] = -s[1, 1] + math.log(np.exp(s[[1, 2, 3], 1]).sum())
    assert loss_g.item() == pytest.approx(0.5 * (np.mean(rows) + np.mean(cols)), rel=1e-6)
    # identical views give a lower loss and perfect partner accuracy
    low, acc = info_nce(z1, z1, 0.1)
    assert acc.item() == 1.0 and low.item() < loss.item()


def test_participant_positives_pair_weeks_of_the_same_person():
    values = np.arange(5 * 168 * 2, dtype=np.float32).reshape(5, 168, 2)
    ds = WeekDataset(values, np.ones_like(values, dtype=bool), np.array([0, 0, 0, 1, 2]), positives="participant")
    for i in range(5):
        x1, _, pid, x2, _ = ds[i]
        if i < 3:
            assert not torch.equal(x1, x2) and any(torch.equal(x2, ds.values[k]) for k in (0, 1, 2) if k != i)
        else:
            assert torch.equal(x1, x2)  # no other week: the same week, two augmentations


def test_partner_and_views_depend_on_seed_epoch_and_index_only():
    # the same draws whatever the process RNG, rank or batch (so 2 ranks equal one process), new
    # draws each epoch, and none without an epoch (validation: fixed views)
    values = np.arange(6 * 168, dtype=np.float32).reshape(6, 168, 1)
    settings = AugmentSection(max_shift=2, mask_hours=0.2, mask_variables=0.0, scale_std=0.1)
    make = lambda seed=0: WeekDataset(values, np.ones_like(values, dtype=bool), np.zeros(6, dtype=int),  # noqa: E731
                                      positives="participant", seed=seed, augment=settings)

    def draws(dataset, order=range(6)):
        return {i: tuple(t.clone() for t in dataset[i]) for i in order}

    a, b = make(), make()
    torch.manual_seed(0)
    first = draws(a)
    torch.manual_seed(1)
    again = draws(b, order=reversed(range(6)))  # another process RNG, another order
    for i in range(6):
        for x, y in zip(first[i], again[i]):
            assert torch.equal(x, y), i
    a.set_epoch(1)
    later = draws(a)
    assert any(not torch.equal(first[i][0], later[i][0]) for i in range(6))
    other_seed = draws(make(seed=1))
    assert any(not torch.equal(first[i][0], other_seed[i][0]) for i in range(6))


def test_synthetic_labels_follow_the_simulated_physiology():
    cohort = synthetic_cohort(60, 2, seed=3)
    assert len(cohort.tables) == 60 and list(cohort.tables[0].columns) == list(SYNTHETIC_VARIABLES)
    labels = cohort.labels
    np.testing.assert_array_equal(labels["short_sleep"], (labels["sleep_need_h"] < 6.5).astype(int))
    np.testing.assert_array_equal(labels["low_fitness"], (labels["fitness"] < -0.5).astype(int))
    # the physiology shows in the data: resting HR falls with fitness, sleep minutes follow sleep need
    rhr = np.array([t["resting_hr"].mean() for t in cohort.tables])
    sleep = np.array([t["sleep_min"].mean() for t in cohort.tables])
    assert np.corrcoef(labels["fitness"], rhr)[0, 1] < -0.7
    assert np.corrcoef(labels["sleep_need_h"], sleep)[0, 1] > 0.5
    table = cohort.tables[0]
    assert table.isna().all(axis=1).any()  # device-wear gaps are NaN hours
    assert (table["steps"].dropna() >= 0).all() and (table["sleep_min"].dropna() <= 60).all()


def test_pretraining_run_through_cli(tmp_path):
    args = ["pretrain", "wearables", "model.name=wbm-test", "data.synthetic_participants=10", "data.synthetic_weeks=2",
            "data.val_fraction=0.2", "positives=participant", "train.max_steps=3", "train.batch_size=6",
            "train.progress=false", "train.log_every_steps=1", "--runs-dir", str(tmp_path), "--name", "p"]
    assert cli.main(args) == 0
    run = tmp_path / "wearables" / "p"
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 3 and report["participants"] == 10 and report["val_weeks"] == 4
    assert "SYNTHETIC" in report["data_source"] and np.isfinite(report["train_loss_last"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r.get("split") == "train"]) == 3 and any(r.get("split") == "val" for r in records)
    model = domainfm.create_model(report["saved_model"])
    assert model.variables == list(SYNTHETIC_VARIABLES)
    assert model.zscore()["std"] != [1.0] * 8  # the z-score statistics travel with the weights
    assert cli.main(["evaluate", str(run)]) == 0
    assert np.isfinite(json.loads((run / "evaluation.json").read_text())["loss"])
