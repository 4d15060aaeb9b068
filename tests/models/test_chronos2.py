"""Chronos-2 against the ``chronos-forecasting`` package: a randomly initialised upstream
``Chronos2Model`` at a tiny size is saved in its Hugging Face layout (its own ``save_pretrained``),
loaded both by ``Chronos2Pipeline.from_pretrained`` and by ``domainfm.create_model("chronos-2",
pretrained=DIR)``, and the forecasts compared on every input kind the pipeline takes."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

import domainfm
from domainfm import zoo
from domainfm.models.wavetoken.chronos2 import Chronos2, interpolate_quantiles
from domainfm.models.wavetoken.chronos2_convert import apply_chronos2_config, convert_chronos2

import chronos  # noqa: E402  (the test extra installs chronos-forecasting: the reference pipeline)
from chronos.chronos2 import Chronos2CoreConfig, Chronos2Model, Chronos2Pipeline  # noqa: E402

LEVELS = [0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9,
          0.95, 0.99]
#: a tiny upstream config: 4 future tokens of 16 steps per pass, so 100 steps roll out
TINY = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1, rope_theta=10000.0,
            chronos_config=dict(context_length=256, input_patch_size=16, input_patch_stride=16, output_patch_size=16,
                                max_output_patches=4, quantiles=LEVELS, use_reg_token=True, use_arcsinh=True,
                                time_encoding_scale=256))
HORIZONS = (24, 64, 100)
#: max |ours - pipeline| / the series' scale, per case, printed at the end of the module
MEASURED: dict[str, float] = {}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random at unit-friendly scales: weights ~ fan_in^-0.5, biases ~0.1, norms in
    [0.5, 1.5], the [REG] embedding ~1 (upstream's own init is too small to show differences); the
    head a third of that, so that forecasts stay within a few scales of the series as a trained
    model's do (``sinh`` of wide random outputs would amplify float rounding 20-fold)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            values = torch.randn(p.shape, generator=g)
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.5 * torch.tanh(values))
            elif name.endswith(".bias"):
                p.copy_(0.1 * values)
            elif name == "shared.weight":
                p.copy_(values)
            else:
                p.copy_(values * p.shape[-1] ** -0.5 / (3.0 if name.startswith("output_patch") else 1.0))


def _write_upstream(directory, seed: int = 0, **overrides) -> Chronos2Model:
    config = Chronos2CoreConfig(**{**TINY, **overrides})
    config.architectures = ["Chronos2Model"]
    config.chronos_pipeline_class = "Chronos2Pipeline"
    torch.manual_seed(seed)
    model = Chronos2Model(config)
    _randomise(model, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """(folder, pipeline, ours) for the tiny upstream model; ours loaded as the brief's user would."""
    directory = tmp_path_factory.mktemp("chronos2-hf")
    _write_upstream(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = chronos.BaseChronosPipeline.from_pretrained(str(directory))
    assert isinstance(pipeline, Chronos2Pipeline)
    ours = domainfm.create_model("chronos-2", pretrained=str(directory)).eval()
    yield directory, pipeline, ours
    if MEASURED:
        print("\nmax |ours - pipeline| / series scale:", json.dumps(MEASURED))


def _scale(target) -> torch.Tensor:
    """Each target row's scale (population std of its observed values, at least 1e-3): (rows, 1, 1)."""
    t = torch.as_tensor(np.asarray(target, dtype=np.float32)).view(-1, np.shape(target)[-1])
    mean = torch.nanmean(t, -1, keepdim=True)
    return torch.nan_to_num((t - mean).square().nanmean(-1).sqrt(), nan=1.0).clamp(min=1e-3).view(-1, 1, 1)


def _compare(label, pipeline, ours, inputs, targets, **kwargs) -> None:
    """predict_quantiles of both on ``inputs`` at every horizon, with and without cross-learning;
    ``targets[i]`` is task i's target history (for its scale)."""
    worst = 0.0
    for horizon in HORIZONS:
        for cross in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref_q, ref_mean = pipeline.predict_quantiles(inputs, prediction_length=horizon, cross_learning=cross,
                                                             quantile_levels=[0.1, 0.33, 0.5, 0.99], **kwargs)
                q, mean = ours.predict_quantiles(inputs, prediction_length=horizon, cross_learning=cross,
                                                 quantile_levels=[0.1, 0.33, 0.5, 0.99], **kwargs)
            assert len(q) == len(ref_q) == len(targets)
            for i, target in enumerate(targets):
                assert q[i].shape == ref_q[i].shape and mean[i].shape == ref_mean[i].shape
                assert q[i].shape[1:] == (horizon, 4)
                error = float(((q[i] - ref_q[i]).abs() / _scale(target)).max())
                error = max(error, float(((mean[i] - ref_mean[i]).abs() / _scale(target)[..., 0]).max()))
                assert error < 1e-4, f"{label}: horizon {horizon}, cross_learning={cross}, task {i}: {error:.2e}"
                worst = max(worst, error)
    MEASURED[label] = worst


def _series(g, n, length, level=0.0, spread=1.0):
    return [(torch.randn(length - 7 * i, generator=g).cumsum(0) * spread + level).numpy() for i in range(n)]


# --------------------------------------------------------------------------- equivalence with the pipeline


def test_univariate_with_gaps_and_lengths_matches_the_pipeline(upstream):
    _, pipeline, ours = upstream
    g = torch.Generator().manual_seed(1)
    series = [torch.as_tensor(s) for s in _series(g, 3, 120, level=50.0, spread=3.0)]
    series[0][30:41] = float("nan")  # a gap of a whole patch and more
    series[1][:5] = float("nan")
    series.append(torch.randn(300, generator=g).cumsum(0))  # longer than the context (256)
    series.append(torch.full((20,), float("nan")))  # nothing observed
    _compare("univariate", pipeline, ours, series, series)
    # batches of 2 rows (cross-learning joins the tasks of a batch only) and a shorter context
    _compare("univariate-batch2-context48", pipeline, ours, series, series, batch_size=2, context_length=48)
    # the future tokens attend to each other: 24 steps of a 24- and of a 64-step forecast differ
    short, long = ours.predict(series[:1], 24)[0], ours.predict(series[:1], 64)[0]
    assert (short - long[..., :24]).abs().max() > 1e-4
    # a (B, T) tensor is a batch of univariate series (upstream takes only (B, variates, T))
    batch = torch.stack([s[-100:] for s in series[:3]])
    assert all(torch.equal(a, b) for a, b in zip(ours.predict(batch, 24), ours.predict(batch[:, None], 24)))


def test_multivariate_tensor_and_list_match_the_pipeline(upstream):
    _, pipeline, ours = upstream
    g = torch.Generator().manual_seed(2)
    batch = torch.randn(2, 3, 90, generator=g).cumsum(-1) * torch.tensor([1.0, 10.0, 0.1]).view(1, 3, 1)
    _compare("multivariate-3d", pipeline, ours, batch, list(batch))
    mixed = [batch[0], batch[1, 0, 20:]]  # a 2-D and a 1-D task in one list
    _compare("multivariate-list", pipeline, ours, mixed, [batch[0], batch[1, 0, 20:]])


def test_past_and_known_future_covariates_match_the_pipeline(upstream):
    _, pipeline, ours = upstream
    rng = np.random.default_rng(3)
    items = []
    for length in (80, 61):
        weather = rng.choice(["sunny", "rainy", "cloudy"], size=length + max(HORIZONS))
        temperature = rng.normal(20, 5, size=length + max(HORIZONS))
        effect = np.where(weather == "rainy", -3.0, 1.0)
        target = np.cumsum(rng.normal(size=length)) + 0.5 * temperature[:length] + effect[:length]
        footfall = rng.poisson(30, size=length).astype(float)  # past-only
        items.append((length, target, temperature, weather, footfall))
    items[1][3][items[1][0] + 3] = "snow"  # a future category never seen in the past
    targets = [item[1] for item in items]
    for horizon in HORIZONS:  # known-future values cover exactly the horizon
        inputs = [{"target": target,
                   "past_covariates": {"temperature": temp[:n], "weather": weather[:n], "footfall": footfall},
                   "future_covariates": {"temperature": temp[n:n + horizon], "weather": weather[n:n + horizon]}}
                  for n, target, temp, weather, footfall in items]
        _compare_one(f"covariates-h{horizon}", pipeline, ours, inputs, targets, horizon)
    # only past covariates (one numeric, one categorical), and two targets (categories by index)
    past_only = [{"target": target, "past_covariates": {"footfall": footfall, "weather": weather[:n]}}
                 for n, target, _, weather, footfall in items]
    _compare("past-covariates", pipeline, ours, past_only, targets)
    two_targets = [{**d, "target": np.stack([d["target"], d["past_covariates"]["footfall"]])} for d in past_only]
    _compare("two-targets-ordinal", pipeline, ours, two_targets, [d["target"] for d in two_targets])


def _compare_one(label, pipeline, ours, inputs, targets, horizon):
    worst = 0.0
    for cross in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_q, _ = pipeline.predict_quantiles(inputs, prediction_length=horizon, cross_learning=cross)
            q, _ = ours.predict_quantiles(inputs, prediction_length=horizon, cross_learning=cross)
        for i, target in enumerate(targets):
            assert q[i].shape == ref_q[i].shape == (1, horizon, 9)
            error = float(((q[i] - ref_q[i]).abs() / _scale(target)).max())
            assert error < 1e-4, f"{label}: cross_learning={cross}, task {i}: {error:.2e}"
            worst = max(worst, error)
    MEASURED[label] = worst


def test_known_future_covariates_change_the_forecast(upstream):
    """The comparisons above would pass if covariates were dropped on both sides: they are not."""
    _, _, ours = upstream
    rng = np.random.default_rng(4)
    base = {"target": rng.normal(size=64), "past_covariates": {"x": rng.normal(size=64)},
            "future_covariates": {"x": np.zeros(24)}}
    other = {**base, "future_covariates": {"x": np.full(24, 5.0)}}
    a, b = ours.predict_quantiles([base, other], 24)[0]
    assert (a - b).abs().max() > 1e-3


def test_predict_df_matches_the_pipeline(upstream):
    _, pipeline, ours = upstream
    rng = np.random.default_rng(5)
    frames, futures = [], []
    for item, length in (("b", 70), ("a", 50)):
        stamps = pd.date_range("2024-01-01", periods=length + 24, freq="h")
        promo = rng.choice(["none", "promo"], size=length + 24)
        price = rng.normal(10, 1, size=length + 24)
        frames.append(pd.DataFrame({"item_id": item, "timestamp": stamps[:length], "sales": rng.poisson(20, length)
                                    + 5.0 * (promo[:length] == "promo"), "price": price[:length],
                                    "promo": promo[:length], "visits": rng.normal(100, 10, length)}))
        futures.append(pd.DataFrame({"item_id": item, "timestamp": stamps[length:], "price": price[length:],
                                     "promo": promo[length:]}))
    df = pd.concat(frames).sample(frac=1.0, random_state=0)  # shuffled rows: both sort them
    future_df = pd.concat(futures)
    for kwargs in (dict(future_df=future_df, target="sales"), dict(target=["sales", "visits"])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = pipeline.predict_df(df, prediction_length=24, quantile_levels=[0.1, 0.5, 0.9], **kwargs)
            got = ours.predict_df(df, prediction_length=24, quantile_levels=[0.1, 0.5, 0.9], **kwargs)
        assert list(got.columns) == list(ref.columns)
        pd.testing.assert_frame_equal(got[["item_id", "timestamp", "target_name"]],
                                      ref[["item_id", "timestamp", "target_name"]])
        values = ["predictions", "0.1", "0.5", "0.9"]
        np.testing.assert_allclose(got[values].to_numpy(), ref[values].to_numpy(), rtol=0, atol=1e-3)


def test_embed_matches_the_pipeline(upstream):
    _, pipeline, ours = upstream
    g = torch.Generator().manual_seed(6)
    batch = torch.randn(3, 2, 64, generator=g).cumsum(-1)  # equal lengths: no padded patch
    ref, ref_loc_scale = pipeline.embed(batch)
    got, loc_scale = ours.embed(batch)
    for a, b, (la, sa), (lb, sb) in zip(got, ref, loc_scale, ref_loc_scale):
        assert a.shape == b.shape == (2, 64 // 16 + 2, 32)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close((la, sa), (lb, sb))


def test_forward_and_loss_match_the_model_and_inference_matches_training_path(tmp_path):
    upstream = _write_upstream(tmp_path, seed=9, dropout_rate=0.0)
    ours = domainfm.create_model("chronos-2-test", pretrained=str(tmp_path)).eval()
    g = torch.Generator().manual_seed(7)
    context = torch.randn(5, 70, generator=g).cumsum(-1)
    context[1, :20] = float("nan")
    groups = torch.tensor([0, 0, 1, 2, 2])
    future = torch.full((5, 40), float("nan"))
    future[4] = torch.randn(40, generator=g)
    target = torch.randn(5, 40, generator=g)
    target[0, 3] = float("nan")
    with torch.no_grad():
        ref = upstream(context=context, group_ids=groups, future_covariates=future, num_output_patches=3,
                       future_target=target)
        got = ours(context, groups, future, 3, future_target=target)
    torch.testing.assert_close(got["quantile_preds"], ref.quantile_preds, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["loss"], ref.loss, atol=1e-5, rtol=1e-5)
    # the training path (no chunks, no fused group attention, out-of-place) computes the same
    for group_ids in (groups, None):
        with torch.no_grad():
            fast = ours(context, group_ids, future, 3)["quantile_preds"]
        slow = ours(context, group_ids, future, 3)["quantile_preds"]
        assert slow.requires_grad
        torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- checkpoints and config


def test_key_layout_round_trips_and_config_is_the_folders(upstream, tmp_path):
    from safetensors.torch import load_file

    directory, _, ours = upstream
    report = ours.domainfm_load_report
    assert report.converter == "official" and report.kind == "upstream"
    assert not report.missing and not report.unexpected
    # built with the folder's own config.json, not the chronos-2 defaults
    assert (ours.d_model, len(ours.encoder.blocks), ours.context_length, ours.max_output_patches) == (32, 2, 256, 4)
    hf = load_file(str(directory / "model.safetensors"))
    converted = convert_chronos2(hf, ours)
    assert set(converted) == set(ours.state_dict()) and len(converted) == len(hf)
    assert torch.equal(converted["encoder.blocks.1.group_attn.v.weight"], hf["encoder.block.1.layer.1.self_attention.v.weight"])
    assert torch.equal(converted["encoder.blocks.0.ffn_norm.weight"], hf["encoder.block.0.layer.2.layer_norm.weight"])
    assert torch.equal(converted["quantile_head.residual.bias"], hf["output_patch_embedding.residual_layer.bias"])
    own = ours.state_dict()
    assert all(convert_chronos2(own, ours)[k] is own[k] for k in own)  # idempotent
    with pytest.raises(ValueError, match="unrecognised key"):
        convert_chronos2({**hf, "encoder.block.0.layer.3.mlp.wi.weight": torch.zeros(1)}, ours)
    from domainfm.models.wavetoken.chronos2 import load_chronos2

    x = [torch.randn(50)]
    assert torch.equal(load_chronos2(directory).eval().predict(x, 30)[0], ours.predict(x, 30)[0])
    # our own save format reloads into the same model
    saved = domainfm.save_pretrained(ours, tmp_path / "saved")
    again = domainfm.create_model(saved).eval()
    assert torch.equal(again.predict(x, 30)[0], ours.predict(x, 30)[0])
    with pytest.raises(ValueError, match="not a Chronos-2"):
        apply_chronos2_config(ours, {"architectures": ["T5ForConditionalGeneration"], "chronos_config": {}})
    with pytest.raises(ValueError, match="no chronos_config"):
        apply_chronos2_config(ours, {"d_model": 32})


def test_bad_inputs_name_the_field(upstream):
    _, _, ours = upstream
    good = {"target": np.arange(40.0), "past_covariates": {"temp": np.ones(40)}, "future_covariates": {"temp": np.ones(24)}}
    with pytest.raises(ValueError, match=r"inputs\[1\]\['future_covariates'\]\['temp'\]: expected shape \(24,\)"):
        ours.predict([good, {**good, "future_covariates": {"temp": np.ones(20)}}], 24)
    with pytest.raises(ValueError, match=r"inputs\[0\]\['past_covariates'\]\['temp'\]: expected shape \(40,\)"):
        ours.predict([{**good, "past_covariates": {"temp": np.ones(39)}}], 24)
    with pytest.raises(ValueError, match=r"\['rain'\] have no past values"):
        ours.predict([{**good, "future_covariates": {"temp": np.ones(24), "rain": np.ones(24)}}], 24)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['covariates'\]"):
        ours.predict([{"target": np.ones(30), "covariates": {}}], 24)
    df = pd.DataFrame({"item_id": "a", "timestamp": pd.date_range("2024", periods=30, freq="D"),
                       "target": np.arange(30.0), "temp": np.ones(30)})
    future_df = pd.DataFrame({"item_id": "a", "timestamp": pd.date_range("2024-01-31", periods=5, freq="D"),
                              "temp": np.ones(5), "rain": np.ones(5)})
    with pytest.raises(ValueError, match=r"future_df column\(s\) \['rain'\] are not in df"):
        ours.predict_df(df, future_df, prediction_length=5)
    with pytest.raises(ValueError, match=r"prediction_length=6 rows per item"):
        ours.predict_df(df, future_df.drop(columns="rain"), prediction_length=6)
    with pytest.raises(ValueError, match=r"df has no column\(s\) \['sales'\]"):
        ours.predict_df(df, target="sales", prediction_length=5)
    with pytest.raises(ValueError, match="limit_prediction_length"):
        ours.predict([np.ones(30)], 65, limit_prediction_length=True)


def test_surface_reset_classifier_and_bf16():
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-2-test").eval()
    (context,) = zoo.get_card("chronos-2-test").example_input()
    features = model.forward_features(context, num_output_patches=2)
    assert features.shape == (2, 2, model.num_features)
    assert model.forward_head(features).shape == (2, 32, 21)
    model.reset_classifier(4)
    assert model.quantiles == [0.2, 0.4, 0.6, 0.8] and model.forward_head(features).shape == (2, 32, 4)
    model.reset_classifier(3, quantiles=[0.1, 0.5, 0.9])
    assert model(context, num_output_patches=2)["quantile_preds"].shape == (2, 3, 32)
    with torch.no_grad():
        high = model(context * 5)["quantile_preds"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(context * 5)["quantile_preds"]
    assert low.dtype == torch.float32 and (low - high).abs().max() < 0.1 * high.abs().max()
    with pytest.raises(ValueError, match="output_patch_size=8 differs"):
        Chronos2(output_patch_size=8)


def test_interpolation_between_levels_is_linear_with_flat_ends():
    values = torch.tensor([[1.0, 2.0, 4.0]])
    got = interpolate_quantiles([0.0, 0.15, 0.3, 0.6, 0.95], [0.1, 0.5, 0.9], values)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.125, 1.5, 2.5, 4.0]]))


def test_cards_and_registered_sources():
    for name, repo, d_model in (("chronos-2", "amazon/chronos-2", 768), ("chronos-2-small", "autogluon/chronos-2-small", 512)):
        card = zoo.get_card(name)
        (source,) = card.weights
        assert source.url == f"hf://{repo}" and source.converter == "official" and source.license == "Apache-2.0"
        assert source.sha256 is None and source.note and card.defaults["d_model"] == d_model
    assert zoo.get_card("chronos-2-small").weights[0].revision == "ddec01313e50b6bc58ebaa92ede81bc24a3d9f9a"
    assert zoo.get_card("chronos-2").weights[0].revision is None and "unpinned" in zoo.get_card("chronos-2").weights[0].note
    assert domainfm.model_info("chronos-2")["num_params"] == 119_477_664  # the published 120M


def test_pretrained_true_fetches_the_registered_repository(upstream, monkeypatch):
    from domainfm import hub

    directory, pipeline, _ = upstream
    asked = []

    def fake_fetch_hf_repo(url, **kwargs):
        asked.append((url, kwargs.get("revision")))
        return directory

    monkeypatch.setattr(hub.loading, "fetch_hf_repo", fake_fetch_hf_repo)
    model = domainfm.create_model("chronos-2-small", pretrained=True).eval()
    assert asked == [("hf://autogluon/chronos-2-small", "ddec01313e50b6bc58ebaa92ede81bc24a3d9f9a")]
    x = [torch.randn(60)]
    torch.testing.assert_close(model.predict(x, 16)[0], pipeline.predict(x, prediction_length=16)[0],
                               atol=1e-4, rtol=1e-4)
