"""The official FIM imputation repositories as pretrained tags: each is listed, a folder in its
Hub layout (official keys, ``config.json`` in the official field names, tiny sizes) loads into its
variant and then computes what an independent restatement of the official forward computes, a tag
with ``pretrained=True`` is fetched from its ``hf://`` repository (a local server answering like the
Hub, see tests/test_hub_hf.py), and a ``config.json`` of another class or architecture is refused
naming the file and the field."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import domainfm
from domainfm import zoo
from domainfm.models.fim import TEST_KWARGS
from domainfm.models.fim.reference import (_branch, _minmax, _time_enc, _vector_field, official_state_dict_layout,
                                           ref_local)

#: the official repositories under their current names (OpenFIM commit 2805a1f renamed them)
EXPECTED = {
    "fim-imputation-base.fim4science": "hf://FIM4Science/fim-imp-pointwise-base",
    "fim-imputation-temporal.fim4science": "hf://FIM4Science/fim-imp-temporal-base",
    "fim-imputation-temporal.fim4science-windowed": "hf://FIM4Science/fim-imp-temporal",
}
#: TEST_KWARGS in the official layout's terms
DIMS = dict(dim_time=16, dim_latent=16, n_heads=2, n_blocks=2, mlp_hidden=32, n_layers=2)
WINDOW = dict(n_heads=2, n_blocks=1, mlp_hidden=24)  # the window transformer (psi_2)
TEMPORAL_KWARGS = dict(local_kwargs=TEST_KWARGS, dropout=0.0, **WINDOW)
KWARGS = {"local": TEST_KWARGS, "temporal": TEMPORAL_KWARGS, "windowed": TEMPORAL_KWARGS}


# --------------------------------------------------------------------------- official layouts


def _random(layout, seed):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in layout.items():
        if "layer_norm" in key and key.endswith("weight"):
            sd[key] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[key] = torch.randn(shape, generator=g) * (0.4 if key.endswith(("weight", "vector")) else 0.1)
    return sd


def _temporal_layout():
    d = DIMS["dim_latent"]
    # psi_2 is the branch net's Transformer on [window embedding, scale features] (2 d = dim_time + 1)
    psi = official_state_dict_layout(dim_time=2 * d - 1, dim_latent=d, n_layers=1, **WINDOW)
    return {**{"fim_base." + k: s for k, s in official_state_dict_layout(**DIMS).items()},
            **{"psi_2." + k[len("branch_net."):]: s for k, s in psi.items() if k.startswith("branch_net.")},
            "scale_feature_mapping.weight": (d, 9), "scale_feature_mapping.bias": (d,)}


def _mlp(hidden, n_in, n_out):
    return {"name": "fim.models.blocks.MLP", "in_features": n_in, "out_features": n_out, "hidden_layers": hidden,
            "hidden_act": {"name": "torch.nn.SELU"}, "output_act": {"name": "torch.nn.Identity"}, "dropout": 0.1}


def _pointwise_config():
    """The published fim-imp-pointwise-base config.json's fields (FIMODE names), at the test sizes."""
    d, t, h = DIMS["dim_latent"], DIMS["dim_time"], DIMS["mlp_hidden"]
    minmax = {"name": "fim.models.blocks.normalization.MinMaxNormalization"}
    return {"architectures": ["FIMODE"], "model_type": "fimode",
            "time_encoding": {"name": "fim.models.blocks.SineTimeEncoding", "out_features": t},
            "branch_net": {"name": "fim.models.blocks.Transformer", "num_encoder_blocks": DIMS["n_blocks"] + 1,
                           "dim_model": d, "dim_time": t, "num_heads": DIMS["n_heads"], "dropout": 0.1,
                           "residual_mlp": _mlp([h], d, d)},
            "trunk_net": _mlp([h, h], t, d), "combiner_net": _mlp([h, h], 2 * d, d),
            "init_cond_net": _mlp([h, h], d + 1, 2), "vector_field_net": _mlp([], d, 2),
            "normalization_time": minmax, "normalization_values": dict(minmax),
            "loss_configs": {"loss_scale_drift": 1.0, "loss_scale_init_cond": 1.0, "loss_scale_unsuperv_loss": 10.0,
                             "ode_solver": "rk4"},
            "load_in_8bit": False, "torch_dtype": "float32", "transformers_version": "4.51.3"}


def _temporal_config():
    """FIMImpTempBaseConfig's fields (fim_imp_temporal_base.yaml) at the test sizes."""
    d = DIMS["dim_latent"]
    minmax = {"name": "fim.models.blocks.normalization.MinMaxNormalization"}
    return {"architectures": ["FIMImputation"], "model_type": "fim_imputation",
            "fim_base": "FIM4Science/fim-imputation-base",
            "psi_2": {"name": "fim.models.blocks.base.Transformer", "num_encoder_blocks": WINDOW["n_blocks"] + 1,
                      "dim_model": d, "dim_time": 2 * d - 1, "num_heads": WINDOW["n_heads"], "dropout": 0.1,
                      "residual_mlp": _mlp([WINDOW["mlp_hidden"]], d, d)},
            "global_normalization_values": minmax, "global_normalization_times": dict(minmax),
            "scale_feature_mapping": {"name": "torch.nn.Linear", "in_features": 9, "out_features": d, "bias": True},
            "use_fim_normalization": True,
            "loss_configs": {"loss_scale_drift": 1.0, "loss_scale_latent_embedding": 0.0,
                             "loss_scale_unsuperv_loss": 0.0},
            "torch_dtype": "float32", "transformers_version": "4.51.3"}


def _windowed_config():
    """The published fim-windowed-imputation (now fim-imp-temporal) config.json, whole: no architecture."""
    return {"architectures": ["FIMImputationWindowed"], "denoising_model": None,
            "fim_imputation": "FIM4Science/fim-imputation", "torch_dtype": "float32", "transformers_version": "4.51.3"}


def _release(tagged, seed=0):
    """(kind, config, file state_dict, the state_dict the reference reads) of one release."""
    if tagged == "fim-imputation-base.fim4science":
        sd = _random(official_state_dict_layout(**DIMS), seed)
        return "local", _pointwise_config(), sd, sd
    sd = _random(_temporal_layout(), seed)
    if tagged == "fim-imputation-temporal.fim4science":
        return "temporal", _temporal_config(), sd, sd
    return "windowed", _windowed_config(), {"fim_imputation." + k: v for k, v in sd.items()}, sd


def _write(folder, config, sd):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --------------------------------------------------------------------------- the reference restatement


def _series(b=2, d=2, seed=3):
    """A series over five windows of 10 points with window 2 missing; ``values`` NaN where not observed."""
    g = torch.Generator().manual_seed(seed)
    full = torch.linspace(0.0, 5.0, 50, dtype=torch.float64).view(5, 10)
    times = full[[0, 1, 3, 4]].expand(b, -1, -1).clone()
    values = torch.stack([torch.sin(times * (1 + c)) * (2 + c) + 0.5 * c for c in range(d)], dim=-1)
    values = values + 0.05 * torch.randn(values.shape, generator=g, dtype=torch.float64)
    observed = torch.rand(values.shape, generator=g) < 0.7
    observed[:, :, 0] = True
    gap = torch.linspace(full[1, -1].item(), full[3, 0].item(), 13, dtype=torch.float64).expand(b, -1)
    boundary = torch.randn(2, b, d, generator=g, dtype=torch.float64)
    return times, values.masked_fill(~observed, float("nan")), observed, gap, boundary[0], boundary[1]


def _ref_temporal_gap(sd, times, values, missing, gap, left, right):
    """Official ``FIMImpTempBase.forward`` for one channel: ``times, values, missing (B, W, K, 1)``
    (missing True, values finite everywhere), ``gap (B, L, 1)``, boundary values ``(B, 1)``;
    returns the blended gap path ``(B, L, 1)``."""
    b, w, k, _ = values.shape
    local = {key[len("fim_base."):]: v for key, v in sd.items() if key.startswith("fim_base.")}
    psi = {"branch_net." + key[len("psi_2."):]: v for key, v in sd.items() if key.startswith("psi_2.")}
    flat = missing.reshape(b, w * k, 1)
    x_min, x_rng = _minmax(values.reshape(b, w * k, 1), flat)  # global MinMax over every window
    t_min, t_rng = _minmax(times.reshape(b, w * k, 1), flat)
    gv, gt = (values - x_min[:, None]) / x_rng[:, None], (times - t_min[:, None]) / t_rng[:, None]
    # each window once more through the local model's own MinMax, then its branch net
    wv, wt, wm = gv.reshape(b * w, k, 1), gt.reshape(b * w, k, 1), missing.reshape(b * w, k, 1)
    (v_lo, v_rng), (t_lo, t_r) = _minmax(wv, wm), _minmax(wt, wm)
    tokens = torch.cat([_time_enc(local, (wt - t_lo) / t_r), (wv - v_lo) / v_rng], dim=-1)
    embedded = _branch(local, tokens, wm[..., 0], DIMS["n_heads"]).view(b, w, -1)
    # nine scale features per window on the globally normalised data
    miss = missing[..., 0]
    t_lo_w, t_hi_w = gt[..., 0].masked_fill(miss, torch.inf).amin(-1), gt[..., 0].masked_fill(miss, -torch.inf).amax(-1)
    v_lo_w, v_hi_w = gv[..., 0].masked_fill(miss, torch.inf).amin(-1), gv[..., 0].masked_fill(miss, -torch.inf).amax(-1)
    first_idx = (~miss).double().argmax(-1)
    last_idx = k - 1 - (~miss).flip(-1).double().argmax(-1)
    first = gv[..., 0].gather(-1, first_idx[..., None])[..., 0]
    last = gv[..., 0].gather(-1, last_idx[..., None])[..., 0]
    feats = torch.stack([t_lo_w, t_hi_w, t_hi_w - t_lo_w, v_lo_w, v_hi_w, v_hi_w - v_lo_w, first, last,
                         last - first], dim=-1)
    feats = feats @ sd["scale_feature_mapping.weight"].T + sd["scale_feature_mapping.bias"]
    pooled = _branch(psi, torch.cat([embedded, feats], dim=-1), torch.zeros(b, w, dtype=torch.bool), WINDOW["n_heads"])
    # the gap's times MinMax-normalised on their own; drift there and at the midpoints, Simpson steps
    g_min, g_rng = _minmax(gap, torch.zeros_like(gap, dtype=torch.bool))

    def path(grid_n, x0):
        fine = torch.zeros(b, 2 * grid_n.shape[1] - 1, 1, dtype=grid_n.dtype)
        fine[:, ::2], fine[:, 1::2] = grid_n, (grid_n[:, 1:] + grid_n[:, :-1]) / 2
        slope = _vector_field(local, fine, pooled)[0] / g_rng  # values stay globally normalised
        t = fine * g_rng + g_min
        steps = (t[:, 2::2] - t[:, :-2:2]) / 6 * (slope[:, :-2:2] + 4 * slope[:, 1::2] + slope[:, 2::2])
        return torch.cumsum(torch.cat([x0[:, None], steps], dim=1), dim=1)

    grid_n = (gap - g_min) / g_rng
    from_left = path(grid_n, (left - x_min[:, 0]) / x_rng[:, 0])
    from_right = path(grid_n.flip(1), (right - x_min[:, 0]) / x_rng[:, 0]).flip(1)
    alpha = torch.linspace(0, 1, gap.shape[1], dtype=gap.dtype)[None, :, None]
    return ((1 - alpha) * from_left + alpha * from_right) * x_rng + x_min


def _assert_local_matches(model, sd):
    """``impute`` of the local model (or the temporal model's local part) against ``ref_local``."""
    sd = {k: v.double() for k, v in sd.items()}
    times, values, observed, _, _, _ = _series()
    times, values, observed = times.flatten(1), values.flatten(1, 2), observed.flatten(1, 2)
    eval_times = torch.linspace(0, 5, 23, dtype=torch.float64).expand(times.shape[0], -1)
    with torch.no_grad():
        ours = model.impute(times, values, observed, eval_times)
    for ch in range(values.shape[-1]):
        ref = ref_local(sd, times[..., None], torch.nan_to_num(values[..., ch:ch + 1], nan=123.0),
                        ~observed[..., ch:ch + 1], eval_times[..., None], DIMS["n_heads"])
        torch.testing.assert_close(ours["values"][..., ch], ref["solution"][..., 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours["init_mean"][:, ch], ref["init_mean"][:, 0], atol=1e-6, rtol=1e-6)


def _assert_matches_reference(kind, model, sd):
    model = model.double().eval()
    if kind == "local":
        _assert_local_matches(model, sd)
        return
    _assert_local_matches(model.local, {k[len("fim_base."):]: v for k, v in sd.items() if k.startswith("fim_base.")})
    sd = {k: v.double() for k, v in sd.items()}
    times, values, observed, gap, left, right = _series()
    with torch.no_grad():
        ours = model.impute_gap(times, values, observed, gap, 2, left=left, right=right)["values"]
    for ch in range(values.shape[-1]):
        ref = _ref_temporal_gap(sd, times[..., None], torch.nan_to_num(values[..., ch:ch + 1], nan=123.0),
                                ~observed[..., ch:ch + 1], gap[..., None], left[:, ch:ch + 1], right[:, ch:ch + 1])
        torch.testing.assert_close(ours[..., ch], ref[..., 0], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- tests


def test_official_repositories_are_listed_as_pretrained_tags():
    names = domainfm.list_models("fim*", pretrained=True)  # answered from the manifest
    for tagged, url in EXPECTED.items():
        assert tagged in names
        source = zoo.weight_source(tagged)  # the live registry
        assert (source.url, source.converter, source.sha256, source.revision) == (url, "official", None, None)
        assert "unpinned" in source.note and "MIT" in source.note and source.license == "unknown"
        assert "synthetic" in source.pretraining_data and source.overlaps == ()
    # a bare name with pretrained=True takes the first source
    assert zoo.weight_source("fim-imputation-base").url == EXPECTED["fim-imputation-base.fim4science"]
    assert zoo.weight_source("fim-imputation-temporal").url == EXPECTED["fim-imputation-temporal.fim4science"]


@pytest.mark.parametrize("tagged", sorted(EXPECTED))
def test_hub_layout_folder_loads_and_matches_the_official_forward(tagged, tmp_path):
    kind, config, file_sd, ref_sd = _release(tagged)
    folder = _write(tmp_path / "release", config, file_sd)
    model = domainfm.create_model(tagged.split(".")[0], pretrained=str(folder), **KWARGS[kind])
    report = model.domainfm_load_report
    assert report.converter == "official" and not report.missing and not report.unexpected
    assert model.domainfm_upstream_config == config  # config.json was read (and checked)
    _assert_matches_reference(kind, model, ref_sd)
    # the check has something to see: another release's tensors give another answer
    other = domainfm.create_model(tagged.split(".")[0], pretrained=str(_write(tmp_path / "other", config,
                                                                                _release(tagged, seed=9)[2])),
                                  **KWARGS[kind])
    with pytest.raises(AssertionError):
        _assert_matches_reference(kind, other, ref_sd)


@pytest.mark.parametrize("tagged", sorted(EXPECTED))
def test_pretrained_tag_is_fetched_from_its_hub_repository(tagged, hf_hub, domainfm_home, tmp_path):
    kind, config, file_sd, ref_sd = _release(tagged, seed=4)
    repo = EXPECTED[tagged][len("hf://"):]
    folder = _write(tmp_path / "release", config, file_sd)
    for name in ("config.json", "model.safetensors"):
        hf_hub.add(repo, name, (folder / name).read_bytes(), lfs=name.endswith(".safetensors"))
    model = domainfm.create_model(tagged, pretrained=True, progress=False, **KWARGS[kind])
    assert model.domainfm_load_report.source == EXPECTED[tagged]
    assert model.domainfm_load_report.converter == "official"
    fetched = {path for _, _, path, _ in hf_hub.requests("hub")}
    assert {f"/{repo}/resolve/main/config.json", f"/{repo}/resolve/main/model.safetensors"} <= fetched
    lock = json.loads((domainfm_home / "weights.lock.json").read_text())["files"]
    assert f"hf://{repo}@main/model.safetensors" in lock  # unpinned: the first-seen digest is recorded
    assert model.domainfm_upstream_config == config
    _assert_matches_reference(kind, model, ref_sd)


def _set(config, path, value):
    node = config
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return config


@pytest.mark.parametrize("release, load_as, change, message", [
    ("fim-imputation-base.fim4science", "fim-imputation-base", (("branch_net", "num_heads"), 4),
     r"config\.json: .*n_heads: model 2 vs config\.json 4 \(branch_net\.num_heads\)"),
    ("fim-imputation-base.fim4science", "fim-imputation-base", (("normalization_values",), None),
     r"config\.json: normalization_values = None"),
    ("fim-imputation-temporal.fim4science", "fim-imputation-temporal", (("psi_2", "num_heads"), 4),
     r"config\.json: .*n_heads: model 2 vs config\.json 4 \(psi_2\.num_heads\)"),
    ("fim-imputation-temporal.fim4science", "fim-imputation-temporal", (("use_fim_normalization",), False),
     r"config\.json: use_fim_normalization = False"),
    ("fim-imputation-temporal.fim4science-windowed", "fim-imputation-temporal",
     (("denoising_model",), {"name": "fim.models.blocks.MLP"}), r"config\.json: denoising_model = "),
    ("fim-imputation-temporal.fim4science-windowed", "fim-imputation-base", None,
     r"config\.json: architectures \['FIMImputationWindowed'\] is the official FIMImpTemp .*"
     r"create_model\('fim-imputation-temporal'"),
    ("fim-imputation-base.fim4science", "fim-imputation-temporal", None,
     r"config\.json: model_type 'fimode' is the official FIMImpPointBase .*create_model\('fim-imputation-base'"),
    ("fim-imputation-base.fim4science", "fim-imputation-base", (("model_type",), "t5"),
     r"config\.json: model_type 't5' is not an official FIM imputation model"),
])
def test_config_of_another_class_or_architecture_is_refused_by_name(release, load_as, change, message, tmp_path):
    _, config, file_sd, _ = _release(release)
    if change is not None:
        config = _set(config, *change)
    folder = _write(tmp_path / "release", config, file_sd)
    kwargs = KWARGS["local" if load_as == "fim-imputation-base" else "temporal"]
    with pytest.raises(ValueError, match=message):
        domainfm.create_model(load_as, pretrained=str(folder), **kwargs)
