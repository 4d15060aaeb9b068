"""FIM's pinned readout: the path moved onto the observations by its linearly interpolated residuals,
checked against an independent numpy restatement; the official readout stays the default for official
weights, and a saved model keeps its readout."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import domainfm
from domainfm.models.fim import FIMInputError
from domainfm.models.fim.fim import interpolate_knots


def _series(b=3, t=48, d=2, seed=1, p_obs=0.3):
    g = torch.Generator().manual_seed(seed)
    times = torch.sort(torch.rand(b, t, generator=g, dtype=torch.float64) * 5, dim=1).values
    values = torch.stack([torch.sin(times * (1 + k)) * (k + 1) + 0.3 * k for k in range(d)], dim=-1)
    observed = torch.rand(b, t, d, generator=g) < p_obs
    observed[0, :5, 0] = False  # a channel whose first observation comes late (residual held before it)
    observed[-1, -6:, -1] = False  # and one whose last comes early
    observed[:, 10] = True
    return times, values.masked_fill(~observed, float("nan")), observed


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return domainfm.create_model("fim-imputation-test").double().eval()


def test_interpolate_knots_is_np_interp_per_row():
    g = torch.Generator().manual_seed(3)
    knots = torch.sort(torch.rand(5, 30, generator=g, dtype=torch.float64), dim=1).values
    vals = torch.randn(5, 30, generator=g, dtype=torch.float64)
    valid = torch.rand(5, 30, generator=g) < 0.3
    valid[:, 7] = True
    valid[4] = False
    valid[4, 12] = True  # a row with a single valid knot: constant
    query = torch.sort(torch.rand(5, 41, generator=g, dtype=torch.float64) * 1.4 - 0.2, dim=1).values
    query[:, 3] = knots[:, 7]  # exactly on a knot
    out = interpolate_knots(query, knots, vals, valid).numpy()
    for i in range(5):
        v = valid[i].numpy()
        np.testing.assert_allclose(out[i], np.interp(query[i].numpy(), knots[i].numpy()[v], vals[i].numpy()[v]),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("windows", [None, 3])
def test_pinned_path_passes_through_the_observations_and_is_the_path_plus_the_residual(model, windows):
    times, values, observed = _series()
    with torch.no_grad():
        official = model.impute(times, values, observed, times, windows=windows)
        pinned = model.impute(times, values, observed, times, windows=windows, readout="pinned")
    # at observed points the pinned path is the observation; the official one is not
    torch.testing.assert_close(pinned["values"][observed], values[observed], atol=1e-5, rtol=0)
    assert (official["values"][observed] - values[observed]).abs().max() > 1e-2
    # independent restatement, in numpy: official path + np.interp of its residuals at the observed times
    t, v, o, path = times.numpy(), values.numpy(), observed.numpy(), official["values"].numpy()
    want = np.empty_like(path)
    for i in range(t.shape[0]):
        for c in range(v.shape[2]):
            m = o[i, :, c]
            want[i, :, c] = path[i, :, c] + np.interp(t[i], t[i, m], v[i, m, c] - path[i, m, c])
    np.testing.assert_allclose(pinned["values"].numpy(), want, rtol=1e-9, atol=1e-9)
    # only the path changes
    for key in ("values_std", "drift_mean", "drift_std", "init_mean", "init_std"):
        torch.testing.assert_close(pinned[key], official[key])


def test_pinned_readout_on_another_evaluation_grid(model):
    # evaluation points that are not the observation times: the path at each observed time is read by
    # linear interpolation of the evaluation grid, so the pinned path at an observed time is exact only
    # where that time is on the grid; between, it is the path plus the interpolated residual
    times, values, observed = _series(b=1, d=1)
    eval_times = torch.cat([times[:, :1], torch.linspace(0.01, 4.99, 300, dtype=torch.float64)[None]], dim=1)
    eval_times = torch.sort(eval_times, dim=1).values
    with torch.no_grad():
        official = model.impute(times, values, observed, eval_times)["values"][0, :, 0].numpy()
        pinned = model.impute(times, values, observed, eval_times, readout="pinned")["values"][0, :, 0].numpy()
    e, t, v, o = eval_times[0].numpy(), times[0].numpy(), values[0, :, 0].numpy(), observed[0, :, 0].numpy()
    residual = v[o] - np.interp(t[o], e, official)
    np.testing.assert_allclose(pinned, official + np.interp(e, t[o], residual), rtol=1e-9, atol=1e-9)


def test_readout_defaults_and_errors(model):
    # official weights' architectures default to the paper's readout: an impute without the option is it
    for name in ("fim-imputation-base", "fim-imputation-small", "fim-imputation-test"):
        assert domainfm.create_model(name).readout == "official"
    times, values, observed = _series()
    with torch.no_grad():
        default = model.impute(times, values, observed, times)["values"]
        official = model.impute(times, values, observed, times, readout="official")["values"]
    torch.testing.assert_close(default, official, rtol=0, atol=0)
    with pytest.raises(FIMInputError, match="readout='snapped'; expected one of official, pinned"):
        model.impute(times, values, observed, times, readout="snapped")
    with pytest.raises(FIMInputError, match="readout='snapped'"):
        domainfm.create_model("fim-imputation-test", readout="snapped")


def test_a_saved_model_keeps_its_readout(tmp_path):
    torch.manual_seed(0)
    model = domainfm.create_model("fim-imputation-test", readout="pinned").eval()
    folder = domainfm.save_pretrained(model, tmp_path / "m", card=False)
    loaded = domainfm.create_model(folder).eval()
    assert loaded.readout == "pinned"
    times, values, observed = _series()
    times, values = times.float(), values.float()
    with torch.no_grad():
        out = loaded.impute(times, values, observed, times)["values"]
    torch.testing.assert_close(out[observed], values[observed], atol=1e-5, rtol=0)
    # the caller's option still wins
    assert domainfm.create_model(folder, readout="official").readout == "official"


def test_a_weight_source_carries_its_readout_beneath_the_callers_keywords(monkeypatch):
    import dataclasses

    from domainfm import zoo

    card = zoo.get_card("fim-imputation-small")
    shipped = zoo.weight_source("fim-imputation-small.synthetic-prior")
    other = dataclasses.replace(shipped, model_kwargs={"readout": "pinned"})
    monkeypatch.setattr(card, "weights", [other if w is shipped else w for w in card.weights])
    assert domainfm.create_model("fim-imputation-small.synthetic-prior", pretrained=True).readout == "pinned"
    assert domainfm.create_model("fim-imputation-small", pretrained=True).readout == "pinned"  # the first source
    assert domainfm.create_model("fim-imputation-small.synthetic-prior", pretrained=True,
                                 readout="official").readout == "official"
    assert domainfm.create_model("fim-imputation-small").readout == "official"  # random init: the card's defaults
    with pytest.raises(ValueError, match="model_kwargs must map keyword names"):
        dataclasses.replace(shipped, model_kwargs=["readout"])


def test_shipped_checkpoint_records_the_pinned_readout_and_official_weights_keep_theirs(monkeypatch, tmp_path):
    from domainfm import zoo

    monkeypatch.setenv("DOMAINFM_OFFLINE", "1")
    monkeypatch.setenv("DOMAINFM_HOME", str(tmp_path))
    # domainfm's own checkpoint: the readout its card measured better, with no option
    assert domainfm.create_model("fim-imputation-small.synthetic-prior", pretrained=True).readout == "pinned"
    # the published weights: the paper's readout (their sources carry no keywords)
    for name in ("fim-imputation-base.fim4science", "fim-imputation-temporal.fim4science"):
        assert dict(zoo.weight_source(name).model_kwargs) == {}
