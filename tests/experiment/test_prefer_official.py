"""``model.prefer``: official weights first, domainfm's shipped checkpoint when they cannot be had,
and the run says which it took (FIM's embedded default declares both)."""
from __future__ import annotations

import json

import pytest

from domainfm import cli
from domainfm.experiment import ModelSection
from domainfm.experiment.weights import prefer_official
from domainfm.zoo import UnknownModelError

FAST = ["arms=[pretrained]"]


def _run(tmp_path, *overrides, name="run"):
    assert cli.main(["finetune", "fim", *overrides, "--runs-dir", str(tmp_path), "--name", name]) == 0
    return json.loads((tmp_path / "fim" / name / "report.json").read_text())


def test_offline_without_the_official_weights_uses_the_shipped_checkpoint_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")  # the fresh DOMAINFM_HOME / HF cache holds no FIM4Science file
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    report = _run(tmp_path, *FAST)  # the embedded default's model section, unchanged
    assert report["model"] == "fim-imputation-small.synthetic-prior"
    assert report["model_choice"].startswith("fim-imputation-small.synthetic-prior (fallback: the official weights of "
                                             "fim-imputation-base.fim4science are unavailable: OfflineError")
    assert "package://domainfm.models.fim/weights/fim-imputation-small.synthetic-prior" in \
        report["arms"]["pretrained"]["init"]
    assert "official weights of fim-imputation-base.fim4science unavailable" in capsys.readouterr().err


def test_reachable_preferred_weights_are_used_by_every_arm(tmp_path):
    # a preferred card whose weights can be had (here shipped in the package): it replaces model.name
    report = _run(tmp_path, "model.name=fim-imputation-test", "model.prefer=fim-imputation-small.synthetic-prior",
                  "arms=[pretrained, random]")
    assert report["model"] == "fim-imputation-small.synthetic-prior"
    assert report["model_choice"].startswith("fim-imputation-small.synthetic-prior (official weights, model.prefer")
    pre, rnd = report["arms"]["pretrained"], report["arms"]["random"]
    assert "fim-imputation-small.synthetic-prior.safetensors" in pre["init"] and rnd["init"].startswith("random")
    assert pre["params"]["total"] == rnd["params"]["total"] == 1_009_028  # both arms: the preferred architecture


def test_a_model_named_on_the_command_line_is_used_as_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    report = _run(tmp_path, "model.name=fim-imputation-small.synthetic-prior", *FAST)
    assert report["model"] == "fim-imputation-small.synthetic-prior" and "model_choice" not in report


def test_prefer_needs_the_cards_weights_and_other_failures_stop_the_run():
    with pytest.raises(ValueError, match="model.prefer='fim-imputation-base.fim4science' needs model.pretrained: true"):
        ModelSection(name="fim-imputation-small", prefer="fim-imputation-base.fim4science", pretrained=None)
    with pytest.raises(UnknownModelError, match="no-such-model-xyz"):  # not "unavailable": a name the zoo does not know is an error, not a fallback
        prefer_official("no-such-model-xyz", "fim-imputation-small.synthetic-prior", log=lambda m: None)
