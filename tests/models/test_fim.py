"""FIM imputation: official-layout checkpoints load, ``impute`` equals an independent restatement
of the official forward + integration (local model and FIM-ℓ), the mask conventions, the temporal
model's pieces, and input errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import domainfm
from domainfm.models.fim import (TEST_KWARGS, FIMInputError, balanced_windows, blend_windows, missing_from_observed,
                                 observed_from_missing, overlapping_window_slices, scale_features)
from domainfm.models.fim.reference import official_state_dict_layout, ref_local, ref_windowed

DIMS = dict(dim_time=16, dim_latent=16, n_heads=2, n_blocks=2, mlp_hidden=32, n_layers=2)


def _official_state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in official_state_dict_layout(**DIMS).items():
        scale = 0.4 if key.endswith("weight") or key.endswith("vector") else 0.1
        sd[key] = (torch.randn(shape, generator=g) * scale).float()
        if "layer_norm" in key and key.endswith("weight"):
            sd[key] = 1 + 0.1 * torch.randn(shape, generator=g)
    return sd


def _official_config():
    mlp = lambda hidden: {"name": "fim.models.blocks.base.Mlp", "hidden_layers": hidden}  # noqa: E731
    return {"model_type": "FIMImpPointBase",
            "time_encoding": {"name": "fim.models.blocks.positional_encodings.SineTimeEncoding", "out_features": 16},
            "branch_net": {"name": "fim.models.blocks.base.Transformer", "num_encoder_blocks": 3, "dim_model": 16,
                           "dim_time": 16, "num_heads": 2, "residual_mlp": mlp([32])},
            "trunk_net": mlp([32, 32]), "combiner_net": mlp([32, 32]), "init_cond_net": mlp([32, 32]),
            "vector_field_net": mlp([])}


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fim-official")
    save_file(_official_state_dict(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_official_config()))
    return folder


def _series(b=3, t=40, d=2, seed=1, p_obs=0.6):
    g = torch.Generator().manual_seed(seed)
    times = torch.sort(torch.rand(b, t, generator=g, dtype=torch.float64) * 5, dim=1).values
    values = torch.stack([torch.sin(times * (1 + k)) * (k + 1) + 0.3 * k for k in range(d)], dim=-1)
    values = values + 0.05 * torch.randn(values.shape, generator=g, dtype=torch.float64)
    observed = torch.rand(b, t, d, generator=g) < p_obs
    observed[:, :2] = True
    return times, values.masked_fill(~observed, float("nan")), observed


def _load(official_dir):
    model = domainfm.create_model("fim-imputation-test", pretrained=str(official_dir)).double().eval()
    report = model.domainfm_load_report
    assert report.converter == "official" and not report.missing and not report.unexpected
    return model


def test_official_layout_loads_without_converter_argument(official_dir):
    model = _load(official_dir)
    sd = _official_state_dict()
    torch.testing.assert_close(model.branch.blocks[1].attn.in_proj.weight.float(),
                               sd["branch_net.encoder_blocks.1.self_attn.in_proj_weight"])
    torch.testing.assert_close(model.init_head.hidden[1].bias.float(), sd["init_cond_net.layers.linear_1.bias"])
    assert model.branch.pool_query.shape == (1, 1, 16)


def test_weights_only_folder_loads_with_the_configured_architecture(official_dir, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((official_dir / "model.safetensors").read_bytes())
    model = domainfm.create_model("fim-imputation-test", pretrained=str(tmp_path))
    assert not model.domainfm_load_report.missing


def test_config_that_disagrees_with_the_model_is_named(official_dir, tmp_path):
    (tmp_path / "model.safetensors").write_bytes((official_dir / "model.safetensors").read_bytes())
    config = _official_config()
    config["branch_net"]["num_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="n_heads: model 2 vs config.json 4"):
        domainfm.create_model("fim-imputation-test", pretrained=str(tmp_path))


def _ref_rows(times, values, observed, eval_times, fn, **kw):
    """Run the reference per channel with the official [B, T, 1] tensors and missing-mask."""
    sd = {k: v.double() for k, v in _official_state_dict().items()}
    outs = []
    for ch in range(values.shape[-1]):
        missing = ~observed[..., ch:ch + 1]  # official convention: True = missing
        vals = torch.nan_to_num(values[..., ch:ch + 1], nan=123.0)  # any value at a missing point
        outs.append(fn(sd, times[..., None], vals, missing, eval_times[..., None], DIMS["n_heads"], **kw))
    return outs


def test_local_model_matches_official_forward_and_integration(official_dir):
    model = _load(official_dir)
    times, values, observed = _series()
    eval_times = torch.linspace(0, 5, 57, dtype=torch.float64).expand(3, -1)
    with torch.no_grad():
        ours = model.impute(times, values, observed, eval_times)
        refs = _ref_rows(times, values, observed, eval_times, ref_local)
    for ch, ref in enumerate(refs):
        torch.testing.assert_close(ours["values"][..., ch], ref["solution"][..., 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["drift_mean"][..., ch], ref["drift_mean"][..., 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["drift_std"][..., ch], ref["drift_log_std"][..., 0].exp(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["init_mean"][:, ch], ref["init_mean"][:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["init_std"][:, ch], ref["init_log_std"][:, 0].exp(), atol=1e-5, rtol=1e-5)
    # the path starts at the initial condition and its spread grows from std(x0)
    torch.testing.assert_close(ours["values"][:, 0], ours["init_mean"])
    torch.testing.assert_close(ours["values_std"][:, 0], ours["init_std"])
    assert (ours["values_std"][:, 1:] >= ours["values_std"][:, :-1] - 1e-12).all()


def test_fim_l_four_windows_matches_official_padded_blend(official_dir):
    model = _load(official_dir)
    times, values, observed = _series(b=2, t=64, seed=3, p_obs=0.7)
    for w in range(4):  # every window must have an observed point
        observed[:, w * 16 + 3] = True
    values = torch.where(observed, torch.nan_to_num(values), values)
    eval_times = torch.sort(torch.cat([times, torch.rand(2, 30, dtype=torch.float64) * 5], dim=1), dim=1).values
    with torch.no_grad():
        ours = model.impute(times, values, observed, eval_times, windows=4, overlap=0.25)
        refs = _ref_rows(times, values, observed, eval_times, ref_windowed, count=4, overlap=0.25)
        padded = model.windowed(times[:, None].expand(-1, 2, -1).reshape(4, -1), values.permute(0, 2, 1).reshape(4, -1),
                                ~observed.permute(0, 2, 1).reshape(4, -1), eval_times[:, None].expand(-1, 2, -1).reshape(4, -1),
                                4, 0.25, pad_to_full_grid=True)
    for ch, ref in enumerate(refs):
        torch.testing.assert_close(ours["values"][..., ch], ref["solution"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["drift_mean"][..., ch], ref["drift_mean"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["drift_std"][..., ch], ref["drift_log_std"].exp(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["init_mean"][:, ch], ref["init_mean"][:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded["values"].view(2, 2, -1).permute(0, 2, 1), ours["values"], atol=1e-9, rtol=1e-9)
    # windowing changes the answer (the test would not see a no-op): the local model differs
    with torch.no_grad():
        whole = model.impute(times, values, observed, eval_times)
    assert (whole["values"] - ours["values"]).abs().max() > 1e-3


def test_mask_conventions_both_ways(official_dir):
    observed = torch.tensor([[True, False, True]])
    missing = missing_from_observed(observed)
    assert missing.tolist() == [[False, True, False]]
    assert torch.equal(observed_from_missing(missing), observed)
    # a value at an unobserved point does not change the result; flipping the mask does
    model = _load(official_dir)
    times, values, observed = _series(b=1, t=20, d=1)
    ev = torch.linspace(0, 5, 11, dtype=torch.float64)
    with torch.no_grad():
        a = model.impute(times, torch.nan_to_num(values, nan=0.0), observed, ev)["values"]
        b = model.impute(times, torch.nan_to_num(values, nan=1e3), observed, ev)["values"]
        c = model.impute(times, torch.nan_to_num(values, nan=1e3), ~observed | torch.eye(20, dtype=torch.bool)[:1, :, None], ev)["values"]
    torch.testing.assert_close(a, b)
    assert (a - c).abs().max() > 1e-3


def test_windows_and_blend_rules():
    size, stride = balanced_windows(128, 4, 0.25)
    assert (size, stride) == (39, 29)  # round(128 / (1 + 3 * 0.75)), round(39 * 0.75)
    slices = overlapping_window_slices(128, 4, size, stride)
    assert slices[:, 0].tolist() == [0, 29, 58, 89] and slices[:, 1].tolist() == [39, 68, 97, 128]
    vals = torch.tensor([[[1.0, 1, 1, 1, 0], [0, 0, 3, 3, 3]]])
    mask = torch.tensor([[[1.0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]])
    out = blend_windows(vals, mask)  # overlap on 2 points: weights 2/3, 1/3 then 1/3, 2/3
    torch.testing.assert_close(out, torch.tensor([[1.0, 1, 1 * 2 / 3 + 3 / 3, 1 / 3 + 3 * 2 / 3, 3]]))


def test_input_errors_name_the_problem():
    model = domainfm.create_model("fim-imputation-test").eval()
    t = torch.linspace(0, 1, 20)
    v = torch.randn(1, 20, 1)
    obs = torch.ones(1, 20, 1, dtype=torch.bool)
    with pytest.raises(FIMInputError, match="strictly increasing; row 0, positions 4 and 5"):
        model.impute(torch.cat([t[:5], t[4:5], t[6:]]), v, obs, t)
    with pytest.raises(FIMInputError, match="non-finite"):
        model.impute(torch.where(t > 0.5, float("inf"), t), v, obs, t)
    with pytest.raises(FIMInputError, match=r"values\[0, 3, 0\] is marked observed but is not finite"):
        model.impute(t, v.index_fill(1, torch.tensor([3]), float("nan")), obs, t)
    with pytest.raises(FIMInputError, match="windows='many'; expected None, a window count or 'auto'"):
        model.impute(t, v, obs, t, windows="many")
    # a window without observations no longer fails (issue 35): tests/models/test_fim_sparse.py


def test_temporal_model_pieces_and_official_checkpoint_keys():
    model = domainfm.create_model("fim-imputation-temporal", local_kwargs=TEST_KWARGS, n_heads=2, n_blocks=1,
                                  mlp_hidden=16, dropout=0.0).eval()
    # scale features on a hand example
    t = torch.tensor([[[0.0, 1, 2, 3]]])
    v = torch.tensor([[[5.0, 1, 4, 9]]])
    miss = torch.tensor([[[False, False, False, True]]])
    assert scale_features(t, v, miss)[0, 0].tolist() == [0, 2, 2, 1, 5, 4, 5, 4, -1]
    # official keys (fim_imputation.fim_base.*, psi_2.*, scale_feature_mapping.*) convert fully
    sd = {"fim_imputation.fim_base." + k: v for k, v in _official_state_dict().items()}
    ours = model.state_dict()
    for key, value in ours.items():
        if key.startswith("window_transformer."):
            off = key.replace("window_transformer.", "fim_imputation.psi_2.").replace("input_proj.", "input_projection.")
            off = off.replace("blocks.0.attn.in_proj.weight", "encoder_blocks.0.self_attn.in_proj_weight")
            sd[off] = value
    from domainfm.models.fim import convert_official_temporal
    converted = convert_official_temporal(sd, model)
    assert set(k for k in converted if k.startswith("local.")) == set(k for k in ours if k.startswith("local."))
    # a smooth series with a gap: the imputed gap joins both sides (blend endpoints = boundary values)
    times = torch.linspace(0, 4, 5 * 12, dtype=torch.float64).view(1, 5, 12)
    vals = torch.sin(times)[..., None]
    gap = torch.linspace(4 * 2 / 5 - 0.02, 4 * 3 / 5, 9, dtype=torch.float64)[None]
    model = model.double()
    keep = torch.tensor([0, 1, 3, 4])
    with torch.no_grad():
        out = model.impute_gap(times[:, keep], vals[:, keep], torch.ones_like(vals[:, keep], dtype=torch.bool), gap, 2,
                               left=torch.tensor([[0.5]], dtype=torch.float64),
                               right=torch.tensor([[-0.25]], dtype=torch.float64))
    assert out["values"].shape == (1, 9, 1)
    torch.testing.assert_close(out["values"][0, 0, 0], torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(out["values"][0, -1, 0], torch.tensor(-0.25, dtype=torch.float64))
