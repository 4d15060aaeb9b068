"""benchmarks/checkpoint_curve.py git: the multi-split, multi-seed protocol of the GIT card.

The script is not part of the package; it is loaded from the repository's benchmarks/ folder."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import domainfm
from domainfm.data_loaders import graph as G
from domainfm.models.git.in_context import in_context

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_curve.py"


@pytest.fixture(scope="module")
def curve():
    spec = importlib.util.spec_from_file_location("checkpoint_curve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_card_figure_is_mean_and_sample_std_over_every_run(curve):
    values = {"in-context accuracy (3-way 3-shot)": [0.43, 0.41, 0.44, 0.40, 0.47, 0.42]}
    mean, std, n = curve.spread(values["in-context accuracy (3-way 3-shot)"])
    assert (mean, n) == (pytest.approx(np.mean([0.43, 0.41, 0.44, 0.40, 0.47, 0.42])), 6)
    assert std == pytest.approx(np.std([0.43, 0.41, 0.44, 0.40, 0.47, 0.42], ddof=1))
    assert curve.git_rows(values) == {"in-context accuracy (3-way 3-shot)": f"{mean:.3f} ± {std:.3f} (n=6)"}
    # random init on the same splits and seeds: the gain is paired run by run
    random = {"in-context accuracy (3-way 3-shot)": [0.40, 0.42, 0.41, 0.40, 0.43, 0.40]}
    diff = np.subtract(values["in-context accuracy (3-way 3-shot)"], random["in-context accuracy (3-way 3-shot)"])
    row = curve.git_rows(values, random)["in-context accuracy (3-way 3-shot)"]
    assert row.endswith(f"; gain over random init {np.mean(diff):+.3f} ± {np.std(diff, ddof=1):.3f}, ahead in 4/6")


@pytest.mark.slow
def test_split_seed_changes_the_split_and_episode_seed_the_episodes(curve, tmp_path, monkeypatch):
    """Every in-context figure of the protocol is the run of the default's command with that split
    (data.seed) and episode seed; the same encoder on another split or seed scores differently.
    The runs are subprocesses with this process's thread count (bit-for-bit on one machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.setenv("DOMAINFM_HOME", str(tmp_path / "home"))
    torch.manual_seed(0)
    encoder = domainfm.create_model("git-test", in_channels=384, n_outputs=2).eval()
    folder = domainfm.save_pretrained(encoder, tmp_path / "encoder", card=False)
    splits = {s: G.load_dataset("karate", G.text_encoder("minilm"), seed=s) for s in (0, 1)}
    assert not torch.equal(splits[0].splits["test"], splits[1].splits["test"])

    class Args:
        pass

    args = Args()
    args.splits, args.episode_seeds, args.episodes, args.seeds, args.modes = [0, 1], [0, 1], 6, [0], []
    values = curve.git_protocol(folder, "git-test", tmp_path / "runs", args, arm="pretrained",
                                overrides=["data.dataset=karate", "protocols.k_shot=2", "protocols.n_query=2",
                                           "train.monitor=val/accuracy"])
    (key, runs), = values.items()
    assert key == "in-context accuracy (2-way 3-shot)"
    episodes = dict(n_way=5, k_shot=2, n_query=2, n_episodes=6, fanout=-1)
    direct = [in_context(encoder, splits[split], seed=seed, **episodes)["accuracy"] for split in (0, 1) for seed in (0, 1)]
    assert runs == pytest.approx(direct, abs=1e-6)  # split-major, one run per (split, episode seed)
    assert runs[0] != runs[1] and runs[0] != runs[2]
