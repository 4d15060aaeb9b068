"""Chronos-Bolt against the ``chronos-forecasting`` package: for every registered size's shape a
randomly initialised upstream ``ChronosBoltModelForForecasting`` is saved in its Hugging Face
layout, loaded both by ``BaseChronosPipeline.from_pretrained`` and by
``domainfm.create_model(name, pretrained=DIR)``, and the forecasts, embeddings and losses compared."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch

import domainfm
from domainfm import zoo
from domainfm.models.wavetoken.chronos_bolt import ChronosBolt, instance_norm, patchify
from domainfm.models.wavetoken.chronos_bolt_convert import apply_chronos_bolt_config, convert_chronos_bolt

import chronos  # noqa: E402  (the test extra installs chronos-forecasting: the reference pipeline)
import transformers  # noqa: E402
from chronos.chronos_bolt import ChronosBoltModelForForecasting  # noqa: E402

BOLT = domainfm.list_models("chronos-bolt-*")
#: max |ours - pipeline| of predict_quantiles per variant, printed at the end of the module
MEASURED: dict[str, float] = {}


def _upstream_config(card: zoo.ModelCard, **chronos_overrides) -> transformers.T5Config:
    d = card.defaults
    config = transformers.T5Config(
        d_model=d["d_model"], d_ff=d["d_ff"], d_kv=d["d_kv"], num_layers=d["num_layers"],
        num_decoder_layers=d.get("num_decoder_layers") or d["num_layers"], num_heads=d["num_heads"],
        relative_attention_num_buckets=d["relative_attention_num_buckets"],
        relative_attention_max_distance=d["relative_attention_max_distance"], dropout_rate=d["dropout"],
        layer_norm_epsilon=d["layer_norm_eps"], initializer_factor=d["initializer_factor"],
        dense_act_fn=d["dense_act_fn"], feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1,
    )
    config.architectures = ["ChronosBoltModelForForecasting"]
    config.chronos_pipeline_class = "ChronosBoltPipeline"
    config.chronos_config = {
        "context_length": d["context_length"], "prediction_length": d["prediction_length"],
        "input_patch_size": d["input_patch_size"], "input_patch_stride": d["input_patch_stride"],
        "quantiles": list(d["quantiles"]), "use_reg_token": d["use_reg_token"], **chronos_overrides,
    }
    return config


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random at unit-friendly scales, cheaply (slices of one random pool: drawing
    205M fresh numbers for the base size costs more than the whole comparison): weights ~
    fan_in^-0.5, biases ~0.1, norms in [0.5, 1.5], embeddings and position biases ~1."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 22, generator=g)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            n = p.numel()
            start = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=g))
            values = pool[start : start + n].view_as(p)
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.5 * torch.tanh(values))
            elif name.endswith(".bias"):
                p.copy_(0.1 * values)
            elif "relative_attention_bias" in name or name.endswith("shared.weight"):
                p.copy_(values)
            else:
                p.copy_(values * p.shape[-1] ** -0.5)


def _write_upstream(directory, card: zoo.ModelCard, *, seed: int = 0, **chronos_overrides):
    """An upstream model with random weights saved by ``save_pretrained``; returns it (eval)."""
    config = _upstream_config(card, **chronos_overrides)
    with torch.device("meta"):  # no default init: every weight is drawn by _randomise
        model = ChronosBoltModelForForecasting(config)
    model.to_empty(device="cpu")
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared  # ties broken by to_empty
    model.quantiles = torch.tensor(config.chronos_config["quantiles"])  # the (non-persistent) buffer
    _randomise(model, seed)
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def upstream_dirs(tmp_path_factory):
    """One upstream folder per registered variant, written on first use."""
    made = {}

    def get(name):
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            _write_upstream(directory, zoo.get_card(name))
            made[name] = directory
        return made[name]

    yield get
    if MEASURED:
        print("\nmax |ours - pipeline| of predict_quantiles:", json.dumps(MEASURED))


def _pipeline(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return chronos.BaseChronosPipeline.from_pretrained(str(directory))


def _contexts(seed=0):
    """Three unit-scale series of different lengths (a list, left-padded with NaN inside), one with a gap."""
    g = torch.Generator().manual_seed(seed)
    series = [torch.randn(45, generator=g), torch.randn(30, generator=g) + 1.0, torch.randn(17, generator=g) * 0.5]
    series[0][6:10] = float("nan")
    return series


# --------------------------------------------------------------------------- equivalence with the pipeline


@pytest.mark.parametrize("name", BOLT)
def test_predict_quantiles_and_embed_match_the_pipeline(name, upstream_dirs):
    directory = upstream_dirs(name)
    pipeline = _pipeline(directory)
    ours = domainfm.create_model(name, pretrained=str(directory)).eval()
    assert ours.domainfm_load_report.converter == "official" and ours.domainfm_load_report.kind == "upstream"
    assert isinstance(pipeline, chronos.ChronosBoltPipeline)
    context = _contexts()

    ref_q, ref_mean = pipeline.predict_quantiles(context)
    q, mean = ours.predict_quantiles(context)
    h = ours.prediction_length
    assert q.shape == ref_q.shape == (3, h, 9) and mean.shape == (3, h)
    assert ref_q.std() > 0.1  # forecasts of substance, so a 1e-5 agreement means something
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(mean, ref_mean, atol=1e-5, rtol=0)
    MEASURED[name] = float((q - ref_q).abs().max())

    # levels between the model's (interpolated) and a (B, T) tensor input with NaN left padding
    padded = torch.stack([torch.nn.functional.pad(c, (45 - len(c), 0), value=float("nan")) for c in context])
    levels = [0.15, 0.5, 0.75]
    ref_q, _ = pipeline.predict_quantiles(padded, prediction_length=5, quantile_levels=levels)
    q, _ = ours.predict_quantiles(padded, 5, quantile_levels=levels)
    assert q.shape == (3, 5, 3)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=0)
    MEASURED[name] = max(MEASURED[name], float((q - ref_q).abs().max()))

    ref_emb, (ref_loc, ref_scale) = pipeline.embed(context)
    emb, (loc, scale) = ours.embed(context, return_state=True)
    n_patches = math.ceil(45 / ours.input_patch_size) + int(ours.use_reg_token)
    assert emb.shape == ref_emb.shape == (3, n_patches, ours.d_model)
    torch.testing.assert_close(emb, ref_emb, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loc, ref_loc, atol=1e-6, rtol=0)
    torch.testing.assert_close(scale, ref_scale, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["chronos-bolt-test", "chronos-bolt-tiny"])
def test_longer_horizon_rolls_out_as_the_pipeline(name, upstream_dirs):
    directory = upstream_dirs(name)
    pipeline = _pipeline(directory)
    ours = domainfm.create_model(name, pretrained=str(directory)).eval()
    h = ours.prediction_length * 2 + 3  # three passes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_q, ref_mean = pipeline.predict_quantiles(_contexts(1), prediction_length=h, quantile_levels=[0.05, 0.5, 0.8])
    with pytest.warns(UserWarning, match="rolling out"), pytest.warns(UserWarning, match="reach outside"):
        q, mean = ours.predict_quantiles(_contexts(1), h, quantile_levels=[0.05, 0.5, 0.8])
    assert q.shape == (3, h, 3)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(mean, ref_mean, atol=1e-5, rtol=0)
    # the roll-out continues the first pass: its first prediction_length steps are the one-pass forecast
    with pytest.warns(UserWarning, match="reach outside"):
        first, _ = ours.predict_quantiles(_contexts(1), quantile_levels=[0.05, 0.5, 0.8])
    torch.testing.assert_close(q[:, : ours.prediction_length], first, atol=0, rtol=0)
    with pytest.raises(ValueError, match="limit_prediction_length"):
        ours.predict(_contexts(1), h, limit_prediction_length=True)


def test_context_longer_than_context_length_and_all_missing_series(tmp_path):
    card = zoo.get_card("chronos-bolt-test")
    upstream = _write_upstream(tmp_path, card, seed=3)
    pipeline = _pipeline(tmp_path)
    ours = domainfm.create_model("chronos-bolt-test", pretrained=str(tmp_path)).eval()
    g = torch.Generator().manual_seed(4)
    long = torch.randn(2, card.defaults["context_length"] + 21, generator=g) * 4 + 10  # truncated to the last 64
    empty = torch.full((1, long.shape[1]), float("nan"))  # no observed value: loc 0, scale 1, no patch attended
    constant = torch.full((1, long.shape[1]), 3.0)  # scale 0 -> eps
    context = torch.cat([long, empty, constant])
    ref = pipeline.predict(context)
    got = ours.predict(context)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)  # values ~10: 1e-5 relative
    with torch.no_grad():
        direct = upstream(context=context[:, -64:]).quantile_preds
    torch.testing.assert_close(got, direct, atol=1e-4, rtol=1e-5)


# --------------------------------------------------------------------------- loss and gradients


def test_loss_matches_upstream_and_per_sample_loss_is_its_mean(tmp_path):
    card = zoo.get_card("chronos-bolt-test")
    upstream = _write_upstream(tmp_path, card, seed=5)
    ours = domainfm.create_model("chronos-bolt-test", pretrained=str(tmp_path)).eval()
    g = torch.Generator().manual_seed(6)
    context = torch.randn(3, 50, generator=g) * 2 + 1
    context[2, :20] = float("nan")
    target = torch.randn(3, 12, generator=g) * 2 + 1  # shorter than the 16-step horizon: the rest is not scored
    target[1, 4] = float("nan")
    target_mask = torch.ones(3, 12, dtype=torch.bool)
    target_mask[0, -2:] = False
    with torch.no_grad():
        ref = upstream(context=context, target=target.clone(), target_mask=target_mask & ~torch.isnan(target))
        out = ours(context, target, target_mask)
        per_sample = ours.per_sample_loss(context, target, target_mask)
    assert list(out) == ["quantile_preds", "loss"]
    torch.testing.assert_close(out["quantile_preds"], ref.quantile_preds, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], ref.loss, atol=1e-5, rtol=1e-5)
    assert per_sample.shape == (3,)
    torch.testing.assert_close(per_sample.mean(), out["loss"], atol=0, rtol=1e-6)

    # the same loss restated: pinball in normalised units, mean over levels, sum over scored steps
    loc, scale = instance_norm(context)
    normalised = (out["quantile_preds"] - loc.unsqueeze(-1)) / scale.unsqueeze(-1)
    levels = torch.tensor(card.defaults["quantiles"]).view(1, -1, 1)
    y = ((target - loc) / scale).unsqueeze(1)
    pinball = torch.where(y >= normalised[..., :12], levels * (y - normalised[..., :12]),
                          (1 - levels) * (normalised[..., :12] - y)) * 2
    valid = (target_mask & ~torch.isnan(target)).unsqueeze(1)
    expected = torch.where(valid, pinball, torch.zeros_like(pinball)).mean(1).sum(-1)
    torch.testing.assert_close(per_sample, expected, atol=1e-4, rtol=1e-4)

    # an explicit observed-mask, as upstream's `mask`
    mask = ~torch.isnan(context)
    mask[0, 30:35] = False
    with torch.no_grad():
        ref = upstream(context=context, mask=mask.float())
        got = ours(context, mask=mask)
    torch.testing.assert_close(got["quantile_preds"], ref.quantile_preds, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="H <= prediction_length=16"):
        ours(context, torch.zeros(3, 17))


def test_gradients_of_the_loss_reach_the_encoder_and_patch_embedding():
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-bolt-test").train()
    context = torch.randn(2, 40)
    loss = model(context, torch.randn(2, 16))["loss"]
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for module in (model.patch_embed, model.encoder.blocks[0].self_attn, model.encoder.relative_attention_bias,
                   model.decoder.blocks[-1].cross_attn, model.quantile_head):
        grads = [p.grad for p in module.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads), module
    assert model.shared.weight.grad[1].abs().sum() > 0  # the [REG] embedding is used
    # per-series weights (FLOW) work through per_sample_loss
    model.zero_grad()
    weights = torch.tensor([1.0, 0.0])
    (model.per_sample_loss(context, torch.randn(2, 16)) * weights).sum().backward()
    assert model.patch_embed.hidden.weight.grad.abs().sum() > 0


def test_every_parameter_is_initialised_and_bf16_autocast_runs():
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-bolt-test")
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.equal(model.encoder.final_norm.weight, torch.ones(32))
    assert torch.equal(model.patch_embed.hidden.bias, torch.zeros(64))
    model.eval()
    context = torch.randn(2, 40) * 3
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(context)["quantile_preds"]
    high = model(context)["quantile_preds"]
    assert low.dtype == torch.float32  # de-normalised in float32
    assert (low - high).abs().max() < 0.1 * high.abs().max()


# --------------------------------------------------------------------------- converter and config


def test_converter_is_idempotent_and_rejects_foreign_keys(tmp_path, upstream_dirs):
    from safetensors.torch import load_file

    model = domainfm.create_model("chronos-bolt-test")
    hf = load_file(str(upstream_dirs("chronos-bolt-test") / "model.safetensors"))
    assert any(k.startswith("input_patch_embedding.") for k in hf)
    once = convert_chronos_bolt(dict(hf, **{"lm_head.weight": torch.zeros(2, 32)}), model)
    assert set(once) == set(model.state_dict())
    assert torch.equal(once["patch_embed.residual.bias"], hf["input_patch_embedding.residual_layer.bias"])
    assert torch.equal(once["quantile_head.output.weight"], hf["output_patch_embedding.output_layer.weight"])
    assert torch.equal(once["decoder.blocks.1.cross_attn.k.weight"], hf["decoder.block.1.layer.1.EncDecAttention.k.weight"])
    twice = convert_chronos_bolt(once, model)
    assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)
    own = model.state_dict()
    assert all(convert_chronos_bolt(own, model)[k] is own[k] for k in own)
    with pytest.raises(ValueError, match="unrecognised key"):
        convert_chronos_bolt(dict(hf, **{"output_patch_embedding.layer_norm.weight": torch.ones(144)}), model)


def test_config_is_adopted_checked_and_round_trips(tmp_path):
    card = zoo.get_card("chronos-bolt-test")
    upstream = _write_upstream(tmp_path / "hf", card, seed=7, context_length=48, prediction_length=8,
                               quantiles=[0.1, 0.5, 0.9], input_patch_size=4, input_patch_stride=4, use_reg_token=False)
    model = domainfm.create_model("chronos-bolt-test", pretrained=str(tmp_path / "hf")).eval()
    assert (model.context_length, model.prediction_length, model.quantiles) == (48, 8, [0.1, 0.5, 0.9])
    assert (model.input_patch_size, model.use_reg_token, model.shared.num_embeddings) == (4, False, 1)
    context = torch.randn(2, 70)
    with torch.no_grad():
        torch.testing.assert_close(model(context)["quantile_preds"], upstream(context=context).quantile_preds,
                                   atol=1e-5, rtol=1e-5)
    saved = domainfm.save_pretrained(model, tmp_path / "saved")
    again = domainfm.create_model(saved).eval()
    assert torch.equal(again.predict(context), model.predict(context))
    with pytest.raises(ValueError, match=r"d_model: config 32 vs model 256.*chronos-bolt-\* variant"):
        domainfm.create_model("chronos-bolt-tiny", pretrained=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="no chronos_config"):
        apply_chronos_bolt_config(model, {"d_model": 32})
    with pytest.raises(ValueError, match="not a Chronos-Bolt"):
        apply_chronos_bolt_config(model, {"architectures": ["T5ForConditionalGeneration"], "chronos_config": {}})


def test_surface_shapes_and_reset_classifier():
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-bolt-test").eval()
    context = torch.randn(2, 40)
    features = model.forward_features(context)
    assert features.shape == (2, model.num_features) == (2, 32)
    assert model.forward_head(features).shape == (2, 9, 16)
    assert torch.equal(model.forward_head(features, pre_logits=True), features)
    assert model.embed(context).shape == (2, 5 + 1, 32)  # 40 values -> 5 patches of 8, + [REG]
    assert model.predict(context).shape == (2, 9, 16)
    assert model.predict(torch.randn(30)).shape == (1, 9, 16)  # one series
    model.reset_classifier(24, quantiles=[0.25, 0.5, 0.75])
    assert model.prediction_length == 24 and model.forward_head(features).shape == (2, 3, 24)
    assert torch.equal(model.forward_features(context), features)  # the body is untouched
    q, mean = model.predict_quantiles(context, quantile_levels=[0.5, 0.25])
    assert q.shape == (2, 24, 2) and torch.equal(q[..., 0], mean)
    with pytest.warns(UserWarning, match="reach outside the levels"):  # 0.1 and 0.9 lie outside 0.25..0.75
        assert model.predict_quantiles(context, num_samples=20, seed=0)[0].shape == (2, 24, 9)  # sampling keywords ignored
    with pytest.raises(TypeError, match="bogus"):
        model.predict(context, bogus=1)
    with pytest.raises(ValueError, match="n_chans=3"):
        ChronosBolt(n_chans=3)


def test_patchify_pads_left_and_respects_the_stride():
    x = torch.arange(10.0).view(1, 10)
    patches = patchify(x, 4, 4, float("nan"))
    assert patches.shape == (1, 3, 4)
    assert torch.isnan(patches[0, 0, :2]).all() and patches[0, 0, 2:].tolist() == [0.0, 1.0]
    assert patches[0, 2].tolist() == [6.0, 7.0, 8.0, 9.0]
    overlapping = patchify(x, 4, 2, 0.0)
    assert overlapping.shape == (1, 5, 4) and overlapping[0, 1].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cards_name_the_published_repositories():
    for size, shape in (("tiny", (256, 1024, 4, 4)), ("mini", (384, 1536, 4, 8)), ("small", (512, 2048, 6, 8)),
                        ("base", (768, 3072, 12, 12))):
        card = zoo.get_card(f"chronos-bolt-{size}")
        d = card.defaults
        assert (d["d_model"], d["d_ff"], d["num_layers"], d["num_heads"], d["d_kv"]) == (*shape, 64)
        assert card.license == "Apache-2.0" and "official" in card.converters and card.head == ("quantile_head",)
        if "revision" in {f.name for f in dataclasses.fields(zoo.WeightSource)}:  # the zoo pins Hub revisions
            (source,) = card.weights
            assert source.url == f"hf://amazon/chronos-bolt-{size}" and source.converter == "official"
            assert len(source.revision) == 40 and source.license == "Apache-2.0"
    assert domainfm.model_info("chronos-bolt-small")["num_params"] == 47_718_016  # the published checkpoint's count


def test_pretrained_true_loads_the_registered_repository(upstream_dirs, monkeypatch):
    """create_model(..., pretrained=True) and load_chronos_bolt("hf://...") go through the card's
    whole-repository source (pinned revision) and the official converter; the download itself is
    replaced by the upstream folder written here (the hub's own tests cover downloading)."""
    from domainfm import hub
    from domainfm.models.wavetoken.chronos_bolt import load_chronos_bolt

    card = zoo.get_card("chronos-bolt-tiny")
    if not card.weights:
        pytest.skip("this zoo registers no weight source without a full sha256")
    directory = upstream_dirs("chronos-bolt-tiny")
    asked = []

    def fake_fetch_hf_repo(url, **kwargs):
        asked.append((url, kwargs.get("revision")))
        return directory

    monkeypatch.setattr(hub.loading, "fetch_hf_repo", fake_fetch_hf_repo)
    model = domainfm.create_model("chronos-bolt-tiny", pretrained=True).eval()
    assert model.domainfm_load_report.converter == "official"
    again = load_chronos_bolt("hf://amazon/chronos-bolt-tiny").eval()
    assert again.domainfm_name == "chronos-bolt-tiny"  # variant chosen from config.json's sizes
    assert asked == [("hf://amazon/chronos-bolt-tiny", card.weights[0].revision)] * 2
    ref_q, _ = _pipeline(directory).predict_quantiles(_contexts())
    torch.testing.assert_close(model.predict_quantiles(_contexts())[0], ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(again.predict_quantiles(_contexts())[0], ref_q, atol=1e-5, rtol=0)
