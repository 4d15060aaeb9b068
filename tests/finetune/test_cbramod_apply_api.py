"""``domainfm.predict`` / ``domainfm.embed`` for CBraMod on the shipped recording: the same windows
and numbers as the model applied by hand to the loader's windows, from a module or a saved folder
(whose family is read from its config.json), and ``--help`` lists the family's options."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import domainfm
from domainfm import cli
from domainfm.data_loaders import eeg

SHIPPED = eeg.samples_dir() / "S001R02.edf"
CHANNELS = ["C3", "C1", "C2", "C4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = domainfm.create_model("cbramod-test", n_chans=4, n_times=800, n_outputs=3)
    return domainfm.save_pretrained(model, tmp_path_factory.mktemp("cbramod") / "model")


def test_predict_and_embed_equal_the_model_on_the_loaders_windows(model_dir):
    model = domainfm.create_model(model_dir).eval()
    settings = eeg.EEGSettings(channels=CHANNELS, window_s=4.0, allow_upsample=True)
    x, starts = eeg.recording_windows(SHIPPED, settings)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).double()
        pooled = model.forward_head(model.forward_features(torch.from_numpy(x)), pre_logits=True)
    want = torch.softmax(logits, dim=-1).numpy()

    for given in (model, model_dir):  # a module, and a folder whose family is read from config.json
        frame = domainfm.predict(given, SHIPPED, channels=CHANNELS, allow_upsample=True, precision="32-true")
        assert list(frame.columns) == ["start_s", "end_s", "predicted", "p_0", "p_1", "p_2"]
        np.testing.assert_allclose(frame["start_s"], starts)
        np.testing.assert_allclose(frame["end_s"], starts + 4.0)
        np.testing.assert_allclose(frame[["p_0", "p_1", "p_2"]].to_numpy(), want, atol=1e-5)
        assert frame["predicted"].tolist() == [str(i) for i in want.argmax(1)]

    out = domainfm.embed(model_dir, SHIPPED, channels=CHANNELS, allow_upsample=True, precision="32-true")
    assert out["embeddings"].shape == (len(x), pooled.shape[-1])
    np.testing.assert_allclose(out["embeddings"], pooled.numpy(), atol=1e-5)
    assert out["channels"].tolist() == CHANNELS
    with pytest.raises(TypeError, match="unknown option"):
        domainfm.predict(model, SHIPPED, stride=3)


def test_help_lists_the_family_options(capsys):
    for command in ("predict", "embed"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "cbramod", "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        for flag in ("--channels", "--stride-s", "--allow-upsample", "--model", "--batch-size", "--precision"):
            assert flag in text, (command, flag)
