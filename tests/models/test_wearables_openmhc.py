"""wbm-openmhc: OpenMHC's released WBM loaded into our CPU Mamba-2 (issue #26).

Stand-in releases are written as OpenMHC's release is (``model.ckpt``: a Lightning checkpoint whose
``state_dict`` holds the encoder under ``model.``; ``normalization_stats.json``;
``openmhc_manifest.json``), with random weights at tiny sizes, and the converted model is compared
with :mod:`domainfm.models.wearables.reference_openmhc`, a step-by-step restatement of the
official forward (float64), to 1e-5.
"""
from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import domainfm
from domainfm import zoo
from domainfm.data_loaders import wearables as W
from domainfm.models.wearables import openmhc
from domainfm.models.wearables.reference_openmhc import reference_forward

TINY = dict(d_model=16, tokenizer_hidden=12, n_layers=2, d_state=8, headdim=8, expand=2, d_conv=4, ffn_mult=4,
            proj_dim=6)
N_CHANS = 19
# continuous channels 0-6 scaled; binary 7-18 identity, as the release's constants are
MEANS = [150.0, 110.0, 0.8, 260.0, 190.0, 1.3, 22.0] + [0.0] * 12
STDS = [400.0, 300.0, 2.5, 600.0, 450.0, 0.25, 40.0] + [1.0] * 12


def _release_state_dict(seed: int = 0, *, projector: str = "mlp3", d_model=16, hidden=12, n_layers=2, d_state=8,
                        headdim=8, expand=2, d_conv=4, ffn_mult=4, proj_dim=6) -> dict[str, torch.Tensor]:
    """Random weights in the release's key layout and shapes (mamba_ssm Mamba2: in_proj rows
    [z, x, B, C, dt], depthwise conv over x|B|C, per-head dt_bias/A_log/D, gated-norm weight)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def near(n, around=0.0, spread=0.1):
        return around + spread * torch.randn(n, generator=g)

    sd = {"tokenizer.fc1.weight": w(hidden, 2 * N_CHANS), "tokenizer.fc1.bias": near(hidden),
          "tokenizer.fc2.weight": w(d_model, hidden), "tokenizer.fc2.bias": near(d_model)}
    d_inner = expand * d_model
    heads, conv_dim = d_inner // headdim, d_inner + 2 * d_state
    for i in range(n_layers):
        block = f"backbone.{i}"
        for direction in ("fwd", "bwd"):
            m = f"{block}.{direction}"
            dt = torch.exp(torch.rand(heads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            sd.update({
                f"{m}.dt_bias": dt + torch.log(-torch.expm1(-dt)),
                f"{m}.A_log": torch.log(1 + 15 * torch.rand(heads, generator=g)),
                f"{m}.D": near(heads, 1.0),
                f"{m}.in_proj.weight": w(2 * d_inner + 2 * d_state + heads, d_model),
                f"{m}.conv1d.weight": 0.5 * torch.randn(conv_dim, 1, d_conv, generator=g),
                f"{m}.conv1d.bias": near(conv_dim),
                f"{m}.norm.weight": near(d_inner, 1.0),
                f"{m}.out_proj.weight": w(d_model, d_inner),
            })
        sd.update({f"{block}.proj.weight": w(d_model, 2 * d_model), f"{block}.proj.bias": near(d_model),
                   f"{block}.norm1.weight": near(d_model, 1.0), f"{block}.norm1.bias": near(d_model),
                   f"{block}.ffn.0.weight": w(ffn_mult * d_model, d_model), f"{block}.ffn.0.bias": near(ffn_mult * d_model),
                   f"{block}.ffn.3.weight": w(d_model, ffn_mult * d_model), f"{block}.ffn.3.bias": near(d_model),
                   f"{block}.norm2.weight": near(d_model, 1.0), f"{block}.norm2.bias": near(d_model)})
    if projector == "linear":
        sd.update({"proj_head.0.weight": w(proj_dim, d_model), "proj_head.0.bias": near(proj_dim)})
    else:
        sd.update({"proj_head.0.weight": w(4 * d_model, d_model), "proj_head.0.bias": near(4 * d_model),
                   "proj_head.1.weight": near(4 * d_model, 1.0), "proj_head.1.bias": near(4 * d_model),
                   "proj_head.4.weight": w(d_model, 4 * d_model), "proj_head.4.bias": near(d_model),
                   "proj_head.5.weight": near(d_model, 1.0), "proj_head.5.bias": near(d_model),
                   "proj_head.8.weight": w(proj_dim, d_model), "proj_head.8.bias": near(proj_dim)})
    return sd


def _write_release(folder, state_dict, *, arch=None, extra=None):
    """The release's folder: a Lightning checkpoint (encoder under ``model.``), the stats, the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = {"epoch": 7, "global_step": 1234, "pytorch-lightning_version": "2.4.0",
                  "state_dict": {**{f"model.{k}": v for k, v in state_dict.items()}, **(extra or {})},
                  "hyper_parameters": {"lr": 1e-3, "temperature": 0.1}, "optimizer_states": [], "lr_schedulers": []}
    torch.save(checkpoint, folder / "model.ckpt")
    (folder / "normalization_stats.json").write_text(json.dumps(
        {"means": MEANS, "stds": STDS, "channels": list(range(7)), "epsilon": 1e-8}))
    arch = arch or {"in_dim": 2 * N_CHANS, "embed_dim": 16, "hidden_dim": 12, "num_layers": 2, "proj_dim": 6,
                    "dropout": 0.223}
    (folder / "openmhc_manifest.json").write_text(json.dumps(
        {"spec_version": 1, "kind": "wbm", "checkpoint": "model.ckpt", "normalization_stats": "normalization_stats.json",
         "arch": arch, "provenance": {"model": "wbm"}}))
    return folder


def _week(seed: int = 1, batch: int = 2, hours: int = 168):
    """Weeks in OpenMHC's units (NaN where missing), with a gap of whole hours and a channel never seen."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(STDS) * 1.5
    values = (torch.rand(batch, hours, N_CHANS, generator=g) * scale).double()
    values[..., 7:] = (values[..., 7:] > 0.5 * scale[7:]).double()  # binary channels are 0/1
    observed = torch.rand(batch, hours, N_CHANS, generator=g) > 0.25
    observed[0, 20:45] = False  # the Watch off for a day
    observed[1, :, 12] = False  # a workout type never recorded
    return values.masked_fill(~observed, float("nan")), observed


def _official_inputs(values, observed):
    """The 38 input columns as OpenMHC builds them: ((v - mean) / std) * (1 - missing) || missing,
    the missing values stored as 0 (IndexedWeekDataset's fill)."""
    missing = (~observed).double()
    raw = torch.where(observed, values, torch.zeros_like(values))
    z = (raw - torch.tensor(MEANS, dtype=torch.float64)) / torch.tensor(STDS, dtype=torch.float64)
    return torch.cat([z * (1 - missing), missing], dim=-1)


def _reference(state_dict, values, observed):
    return reference_forward(_official_inputs(values, observed), {k: v.double() for k, v in state_dict.items()})


@pytest.mark.parametrize("projector", ["mlp3", "linear"])
def test_release_loads_and_matches_the_official_forward(tmp_path, projector):
    sd = _release_state_dict(0, projector=projector)
    release = _write_release(tmp_path / "release", sd)
    model = domainfm.create_model("wbm-openmhc", pretrained=str(release / "model.ckpt"), projector=projector,
                                  zscore_mean=MEANS, zscore_std=STDS, **TINY).eval()
    assert model.domainfm_load_report.converter == "openmhc"
    values, observed = _week()
    h_ref, r_ref = _reference(sd, values, observed)
    with torch.no_grad():
        r = model.forward_features(values.float(), observed, raw=True)
        h = F.normalize(model.forward_projection(values.float(), observed, raw=True), dim=-1)
    assert r_ref.std(0).mean() > 0.05  # the two weeks give different embeddings: the comparison means something
    torch.testing.assert_close(r.double(), r_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=1e-5)


def test_load_openmhc_reads_architecture_stats_and_manifest(tmp_path):
    sd = _release_state_dict(3, projector="linear", d_state=4, headdim=4)
    release = _write_release(tmp_path / "release", sd)
    model = openmhc.load_openmhc(release, chunk_size=16).eval()  # architecture from the checkpoint's shapes
    assert model.projector_kind == "linear" and model.layers[0].fwd.d_state == 4 and model.layers[0].fwd.headdim == 4
    assert model.zscore_mean.tolist() == pytest.approx(MEANS) and model.zscore_std.tolist() == pytest.approx(STDS)
    values, observed = _week(seed=5)
    _, r_ref = _reference(sd, values, observed)
    with torch.no_grad():
        r = model.forward_features(values.float(), observed, raw=True)
    torch.testing.assert_close(r.double(), r_ref, atol=1e-5, rtol=1e-5)
    # our own format round-trips, statistics included
    saved = domainfm.save_pretrained(model, tmp_path / "saved", card=False)
    again = domainfm.create_model(saved).eval()
    assert again.zscore_mean.tolist() == pytest.approx(MEANS)
    with torch.no_grad():
        torch.testing.assert_close(again.forward_features(values.float(), observed, raw=True), r)

    manifest = json.loads((release / "openmhc_manifest.json").read_text())
    manifest["arch"]["num_layers"] = 3
    (release / "openmhc_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"arch disagrees with model.ckpt: n_layers 3 vs checkpoint 2"):
        openmhc.load_openmhc(release)


def test_mismatched_shapes_are_refused_naming_the_key(tmp_path):
    release = _write_release(tmp_path / "release", _release_state_dict(0))
    ckpt = str(release / "model.ckpt")
    kwargs = dict(TINY, zscore_mean=MEANS, zscore_std=STDS)
    with pytest.raises(ValueError, match=r"'model\.backbone\.0\.fwd\.in_proj\.weight' \(ours "
                                         r"'layers\.0\.fwd\.in_proj\.weight'\): checkpoint \(84, 16\) vs model "
                                         r"\(76, 16\).*d_state=8"):
        domainfm.create_model("wbm-openmhc", pretrained=ckpt, **{**kwargs, "d_state": 4})
    with pytest.raises(ValueError, match=r"'model\.tokenizer\.fc2\.weight' \(ours 'tokenizer\.fc2\.weight'\): "
                                         r"checkpoint \(16, 12\) vs model \(16, 10\)"):
        domainfm.create_model("wbm-openmhc", pretrained=ckpt, **{**kwargs, "tokenizer_hidden": 10})
    with pytest.raises(ValueError, match=r"checkpoint has 2 BiMamba2 blocks .* pass n_layers=2"):
        domainfm.create_model("wbm-openmhc", pretrained=ckpt, **{**kwargs, "n_layers": 3})
    with pytest.raises(ValueError, match=r"projection head is 'mlp3' .* pass projector='mlp3'"):
        domainfm.create_model("wbm-openmhc", pretrained=ckpt, **{**kwargs, "projector": "linear"})
    with pytest.raises(ValueError, match=r"backbone='bimamba2' and tokenizer='mlp'"):
        domainfm.create_model("wbm-openmhc", pretrained=ckpt, converter="openmhc", **{**kwargs, "backbone": "mamba2"})


def test_other_lightning_state_is_dropped_and_missing_stats_are_warned_about(tmp_path):
    sd = _release_state_dict(0)
    release = _write_release(tmp_path / "release", sd, extra={"criterion.logit_scale": torch.tensor(2.0)})
    ckpt = str(release / "model.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = domainfm.create_model("wbm-openmhc", pretrained=ckpt, **TINY)
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"dropped 1 checkpoint key.*criterion\.logit_scale", m) for m in messages), messages
    assert any(re.search(r"z-score statistics are the identity.*normalization_stats\.json", m) for m in messages)
    assert model.zscore_mean.abs().sum() == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare = domainfm.create_model("wbm-openmhc", pretrained=ckpt, zscore_mean=MEANS, zscore_std=STDS,
                                     **{**TINY, "proj_dim": None})
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"no projector \(proj_dim=None\): dropped .*model\.proj_head\.8\.weight", m)
               for m in messages), messages
    assert not any("identity" in m for m in messages)
    assert bare.projector is None
    # idempotent: our own keys pass through unchanged
    converted = openmhc.convert_openmhc_state_dict(model.state_dict(), model)
    assert set(converted) == set(model.state_dict())
    assert all(torch.equal(converted[k], v) for k, v in model.state_dict().items())


def test_registered_with_its_tagged_release():
    assert "wbm-openmhc.openmhc-v1" in domainfm.list_models(pretrained=True)
    assert "wbm-base" not in domainfm.list_models(pretrained=True)
    (source,) = zoo.get_card("wbm-openmhc").weights
    assert source.url == "hf://MyHeartCounts/openmhc-wbm-dp/model.ckpt" and source.revision == "v1.0"
    assert source.converter == "openmhc" and source.license == "CC-BY-4.0" and source.sha256 is None
    assert "OpenMHC" in source.overlaps and source.note
    defaults = zoo.get_card("wbm-openmhc").defaults
    assert defaults["variables"] == list(W.OPENMHC_CHANNELS) and defaults["d_state"] == 128


def _our_table():
    """Two days of one participant as our readers give them (NaN: no record)."""
    hours = pd.date_range("2024-03-04 00:00", periods=48, freq="h", name="time")  # a Monday
    table = pd.DataFrame(np.nan, index=hours, columns=list(W.VARIABLES))
    table.loc[hours[8:11], "steps"] = [100.0, 250.0, 0.0]
    table.loc[hours[8:10], "distance_km"] = [0.08, 0.2]
    table.loc[hours[9], "flights"] = 3.0
    table.loc[hours[9:11], "heart_rate"] = [72.0, 90.0]  # the Watch worn at 9 and 10 only
    table.loc[hours[9], "active_kcal"] = 15.0
    table.loc[hours[0:5], "sleep_min"] = [60.0, 60.0, 60.0, 60.0, 30.0]  # asleep until 04:30 on day 1
    table.loc[hours[0:6], "in_bed_min"] = [60.0] * 5 + [10.0]
    table.loc[hours[30], "resting_hr"] = 55.0  # not one of OpenMHC's channels
    return table


def test_our_loader_output_maps_onto_the_official_channels_z_scores_and_missing_flags():
    table = _our_table()
    out = W.openmhc_table(table)
    assert list(out.columns) == list(openmhc.CHANNELS) and len(openmhc.CHANNELS) == 19
    assert openmhc.CHANNELS[5] == "watch_hr" and openmhc.CHANNELS[7] == "sleep_asleep"
    h = out.index
    np.testing.assert_array_equal(out.loc[h[8:12], "iphone_steps"], [100.0, 250.0, 0.0, np.nan])
    np.testing.assert_allclose(out.loc[h[8:10], "iphone_distance"], [80.0, 200.0])  # metres
    np.testing.assert_array_equal(out.loc[h[8:11], "watch_steps"], [np.nan, 250.0, 0.0])  # only while worn
    np.testing.assert_allclose(out.loc[h[9:11], "watch_hr"], [1.2, 1.5])  # beats per second
    assert out.loc[h[9], "watch_energy"] == 15.0 and out.loc[h[9], "iphone_flights"] == 3.0
    np.testing.assert_array_equal(out.loc[h[0:24], "sleep_asleep"], [1.0] * 5 + [0.0] * 19)  # a tracked night
    np.testing.assert_array_equal(out.loc[h[0:24], "sleep_inbed"], [1.0] * 6 + [0.0] * 18)
    assert out.loc[h[24:48], ["sleep_asleep", "sleep_inbed"]].isna().all().all()  # no sleep record: missing
    assert out.filter(like="workout_").isna().all().all()
    # the predict/embed path: a model asking for OpenMHC's channels gets them derived; a table
    # that already has them is passed through
    pd.testing.assert_frame_equal(W.read_participant(table, list(openmhc.CHANNELS)), out)
    pd.testing.assert_frame_equal(W.read_participant(out, list(openmhc.CHANNELS)), out)

    weeks = W.to_weeks(out, variables=list(openmhc.CHANNELS), stats=W.ZScoreStats.identity(openmhc.CHANNELS))
    values, observed = torch.from_numpy(weeks.values), torch.from_numpy(weeks.observed)
    inputs = openmhc.openmhc_inputs(values.double(), observed, MEANS, STDS)
    assert inputs.shape == (1, 168, 38)
    # computed by hand: iPhone steps at 09:00 on Monday, missing at 11:00; heart rate; sleep
    assert inputs[0, 9, 0].item() == pytest.approx((250.0 - 150.0) / 400.0) and inputs[0, 9, 19].item() == 0.0
    assert inputs[0, 11, 0].item() == 0.0 and inputs[0, 11, 19].item() == 1.0
    assert inputs[0, 10, 5].item() == pytest.approx((1.5 - 1.3) / 0.25) and inputs[0, 8, 5 + 19].item() == 1.0
    assert inputs[0, 3, 7].item() == 1.0 and inputs[0, 12, 7].item() == 0.0 and inputs[0, 12, 26].item() == 0.0
    assert inputs[0, 30, 7].item() == 0.0 and inputs[0, 30, 26].item() == 1.0
    assert (inputs[0, 48:, 19:] == 1.0).all()  # the rest of the week was never recorded
    torch.testing.assert_close(inputs, _official_inputs(values.double(), observed))

    # and the model, fed raw weeks, sees exactly that input
    sd = _release_state_dict(7)
    model = domainfm.create_model("wbm-openmhc", zscore_mean=MEANS, zscore_std=STDS, **TINY).eval()
    model.load_state_dict(openmhc.convert_openmhc_state_dict(sd, model))
    _, r_ref = reference_forward(inputs, {k: v.double() for k, v in sd.items()})
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(values, observed, raw=True).double(), r_ref,
                                   atol=1e-5, rtol=1e-5)


def test_release_files_are_checked(tmp_path):
    bad = tmp_path / "normalization_stats.json"
    bad.write_text(json.dumps({"means": [0.0] * 7, "stds": [1.0] * 7}))
    with pytest.raises(ValueError, match=r"normalization_stats\.json: 'means' \(7,\) and 'stds' \(7,\): expected 19"):
        openmhc.read_normalization_stats(bad)
    (tmp_path / "openmhc_manifest.json").write_text(json.dumps({"spec_version": 1, "kind": "dlinear",
                                                                "checkpoint": "model.ckpt"}))
    with pytest.raises(ValueError, match=r"kind='dlinear': expected an OpenMHC encoder manifest"):
        openmhc.read_release_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"arch key 'ffn_dim' has no counterpart"):
        openmhc.kwargs_from_arch({"in_dim": 38, "ffn_dim": 1024})
