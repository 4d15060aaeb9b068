"""WaveToken / Chronos engine: wavelet transform, tokenizers, T5 encoder-decoder, converter, sampling."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import pywt
import torch

import domainfm
from domainfm import zoo
from domainfm.models.wavetoken import (
    MeanScaleUniformBins,
    WaveletTokenizer,
    WaveletTransform,
    convert_hf_t5,
    filter_logits,
    load_chronos,
    relative_position_bucket,
)
from domainfm.models.wavetoken.convert import hf_t5_key

# --------------------------------------------------------------------------- wavelet transform


@pytest.mark.parametrize("wavelet", ["haar", "db2", "bior2.2", "sym4", "coif1", "bior4.4"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_dwt_idwt_match_pywavelets(wavelet, level):
    rng = np.random.default_rng(level)
    transform = WaveletTransform(wavelet, level)
    for n in (8, 64, 512):
        x = rng.normal(size=(3, n)) * 5 + 2
        ours = transform.forward(torch.from_numpy(x))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pywt warns that short signals feel the boundary
            ref = np.concatenate(pywt.wavedec(x, wavelet, mode="periodization", level=level, axis=-1), axis=-1)
        assert ours.shape == x.shape  # maximally decimated: as many coefficients as samples
        np.testing.assert_allclose(ours.numpy(), ref, atol=1e-9, rtol=0)
        back = transform.inverse(torch.from_numpy(ref))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_back = pywt.waverec(pywt.wavedec(x, wavelet, mode="periodization", level=level, axis=-1), wavelet,
                                    mode="periodization", axis=-1)
        np.testing.assert_allclose(back.numpy(), ref_back, atol=1e-9, rtol=0)
        np.testing.assert_allclose(back.numpy(), x, atol=1e-9, rtol=0)
    # float32 path (what the tokenizer uses) within 1e-5 relative of float64
    x32 = torch.randn(4, 64)
    np.testing.assert_allclose(transform.forward(x32).numpy(), transform.forward(x32.double()).numpy(), atol=1e-5)


def test_wavelet_transform_rejects_bad_settings():
    with pytest.raises(ValueError, match="periodization"):
        WaveletTransform("bior2.2", 1, "symmetric")
    with pytest.raises(ValueError, match="not a discrete wavelet"):
        WaveletTransform("morl")
    with pytest.raises(ValueError, match="wavelet_level"):
        WaveletTransform("haar", 0)
    with pytest.raises(ValueError, match="multiple of 2\\*\\*level = 4"):
        WaveletTransform("haar", 2).forward(torch.zeros(1, 6))


# --------------------------------------------------------------------------- tokenizers


def _idwt_inf_norm(tok: WaveletTokenizer, n: int) -> float:
    eye = torch.eye(n, dtype=torch.float64)
    synthesis = tok.transform.inverse(eye)  # row i: the signal of unit coefficient i
    return float(synthesis.abs().sum(0).max())  # max over samples of sum over coefficients


def test_wavelet_tokenizer_round_trip_within_half_a_bin():
    tok = WaveletTokenizer(vocab_size=1024, context_length=64, use_eos_token=False)
    g = torch.Generator().manual_seed(0)
    context = torch.randn(5, 64, generator=g) * torch.tensor([[1.0], [10.0], [0.01], [300.0], [2.0]]) + 50
    ids, mask, state = tok.encode_context(context)
    assert ids.shape == (5, 64) and mask.all() and (ids >= tok.n_special_tokens).all()
    assert state.n_clipped.sum() == 0
    # coefficient domain: each dequantized coefficient is within half a bin of the true one
    scaled = (context - state.loc[:, None]) / state.scale[:, None]
    coeffs = tok.transform.forward(scaled)
    assert (tok.dequantize(ids) - coeffs).abs().max() <= tok.bin_width / 2 + 1e-6
    # value domain: bounded by half a bin through the synthesis operator, times the scale
    future = context[:, -16:]
    labels, lmask = tok.encode_labels(future, state)
    decoded = tok.decode(labels.unsqueeze(1), state, 16)[:, 0]
    bound = tok.bin_width / 2 * _idwt_inf_norm(tok, 16) * state.scale + 1e-4 * state.scale.abs()
    assert ((decoded - future).abs() <= bound[:, None]).all()
    assert (decoded - future).abs().max() > 0  # it is a quantizer, not the identity


def test_wavelet_tokenizer_counts_clipping():
    tok = WaveletTokenizer(vocab_size=64, context_length=16, low_limit=-2.5, high_limit=2.5, use_eos_token=False)
    context = torch.zeros(2, 16)
    context[0, 9] = 1000.0  # a spike: z-score 3.9, its detail coefficient -2.9 falls outside the bins
    context[1] = torch.sin(torch.arange(16) * 2 * math.pi / 16)  # smooth and periodic: nothing clipped
    ids, _, state = tok.encode_context(context)
    assert state.n_clipped[0] > 0 and state.n_clipped[1] == 0
    assert ids[0].min() == tok.n_special_tokens  # clipped to the lowest bin, not wrapped into special ids


def test_chronos_tokenizer_semantics_and_round_trip():
    tok = MeanScaleUniformBins(-15.0, 15.0, n_tokens=4096, context_length=512)
    assert len(tok.centers) == 4093 and tok.centers[0] == -15 and tok.centers[-1] == 15
    context = torch.tensor([[float("nan"), 2.0, -2.0, 4.0, 0.0]])
    ids, mask, state = tok.encode_context(context)
    assert state.scale.item() == pytest.approx(2.0)  # mean |x| over observed values
    assert ids[0, 0] == 0 and not mask[0, 0]  # NaN -> PAD, masked
    assert ids[0, -1] == 1 and mask[0, -1]  # EOS appended and attended
    # x/scale = 1 lies on centre k where linspace(-15, 15, 4093)[k] == 1; id = k + 3 (PAD, EOS, offset 1)
    k = int(torch.argmin((tok.centers - 1.0).abs()))
    assert ids[0, 1] == k + 3
    assert ids[0, 4] == int(torch.argmin(tok.centers.abs())) + 3  # 0 -> the zero centre
    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 40, generator=g) * 4
    ids, _, state = tok.encode_context(values)
    decoded = tok.decode(ids[:, None, :-1], state, 40)[:, 0]
    assert ((decoded - values).abs() <= tok.bin_width / 2 * state.scale[:, None] + 1e-5).all()
    # all-zero context: scale falls back to 1
    assert tok.encode_context(torch.zeros(1, 8))[2].scale.item() == 1.0


def test_special_tokens_decode_to_the_location_not_garbage():
    wav = WaveletTokenizer(vocab_size=128, context_length=16)
    _, _, state = wav.encode_context(torch.arange(16.0).unsqueeze(0) + 100)
    specials = torch.tensor([[[0, 1] * 4]])
    decoded = wav.decode(specials, state, 8)
    assert torch.allclose(decoded, state.loc.view(1, 1, 1).expand_as(decoded))
    chron = MeanScaleUniformBins(n_tokens=256, context_length=16)
    _, _, cstate = chron.encode_context(torch.full((1, 16), 5.0))
    assert torch.equal(chron.decode(torch.tensor([[[0, 1, 0]]]), cstate, 3), torch.zeros(1, 1, 3))


@pytest.mark.parametrize("name", ["wavetoken-test", "chronos-t5-test"])
def test_degenerate_series_give_finite_forecasts(name):
    torch.manual_seed(0)
    model = domainfm.create_model(name)
    nan = float("nan")
    series = [
        torch.full((40,), 7.0),  # constant
        torch.zeros(30),  # all zero
        torch.tensor([3.0]),  # a single point
        torch.tensor([nan, nan, nan]),  # nothing observed
        torch.tensor([1.0, nan, 2.0, nan, nan, 5.0, 4.0]),  # gaps
        torch.cat([torch.full((10,), nan), torch.randn(20) * 1e6]),  # huge values after leading NaNs
    ]
    samples = model.predict(series, 16, num_samples=4, seed=0)
    assert samples.shape == (6, 4, 16)
    assert torch.isfinite(samples).all()
    emb = model.embed(series)
    assert torch.isfinite(emb).all()
    if name == "wavetoken-test":  # z-scored: a constant series is forecast around its level
        assert (samples[0] - 7.0).abs().max() < 7.0 * 0 + 10 * model.tokenizer.high_limit


def test_thresholding_options_zero_small_details():
    g = torch.Generator().manual_seed(0)
    t = torch.arange(64.0)
    signal = torch.sin(t / 4) * 5 + 0.05 * torch.randn(64, generator=g)
    base = WaveletTokenizer(vocab_size=1024, context_length=64, use_eos_token=False)
    zero_id = int(torch.argmin(base.centers.abs())) + 2
    for method in ("visushrink", "fdrc"):
        tok = WaveletTokenizer(vocab_size=1024, context_length=64, use_eos_token=False, threshold=method)
        ids = tok.encode_context(signal.unsqueeze(0))[0][0]
        raw = base.encode_context(signal.unsqueeze(0))[0][0]
        assert torch.equal(ids[:32], raw[:32])  # approximation coefficients untouched
        assert (ids[32:] == zero_id).sum() > (raw[32:] == zero_id).sum()  # noise-level details removed
    with pytest.raises(ValueError, match="threshold="):
        WaveletTokenizer(threshold="bogus")


# --------------------------------------------------------------------------- T5 pieces


def test_relative_position_bucket_values():
    rel = torch.tensor([0, 1, -1, 7, -7, 8, -20, 20, -200, 200])
    got = relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128).tolist()
    # 16 buckets per direction, 8 exact; 20 -> 8 + floor(log(20/8) / log(16) * 8) = 10; >= 128 -> 15
    assert got == [0, 17, 1, 23, 7, 24, 10, 26, 15, 31]
    causal = relative_position_bucket(torch.tensor([0, -1, -15, -16, -20, -200, 5]), bidirectional=False,
                                      num_buckets=32, max_distance=128).tolist()
    # 32 buckets for the past, 16 exact; 20 -> 16 + floor(log(20/16) / log(8) * 16) = 17; future -> 0
    assert causal == [0, 1, 15, 16, 17, 31, 0]


def _rms(x, w, eps=1e-6):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_attention(x, source, sd, prefix, bias, mask, heads, d_kv):
    """Plain T5 attention: unscaled scores + bias + mask, softmax, weighted values, output proj."""
    q = x @ sd[f"{prefix}.q.weight"].T
    k = source @ sd[f"{prefix}.k.weight"].T
    v = source @ sd[f"{prefix}.v.weight"].T
    b, n, _ = q.shape
    m = k.shape[1]
    q, k, v = (t.view(b, -1, heads, d_kv).transpose(1, 2) for t in (q, k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) + bias
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).transpose(1, 2).reshape(b, n, heads * d_kv)
    return out @ sd[f"{prefix}.o.weight"].T


def _reference_t5(sd, ids, attn_mask, dec_ids, *, layers, heads, d_kv, buckets, max_distance):
    """A from-scratch T5 forward over a Hugging Face-key state dict (float64)."""
    sd = {k: v.double() for k, v in sd.items()}
    emb = sd["shared.weight"]
    x = emb[ids]
    length = ids.shape[1]
    pos = torch.arange(length)
    rel = pos[None, :] - pos[:, None]
    table = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    enc_bias = table[relative_position_bucket(rel, bidirectional=True, num_buckets=buckets, max_distance=max_distance)]
    enc_bias = enc_bias.permute(2, 0, 1).unsqueeze(0)
    key_mask = attn_mask[:, None, None, :]
    for i in range(layers):
        p = f"encoder.block.{i}"
        h = _rms(x, sd[f"{p}.layer.0.layer_norm.weight"])
        x = x + _reference_attention(h, h, sd, f"{p}.layer.0.SelfAttention", enc_bias, key_mask, heads, d_kv)
        h = _rms(x, sd[f"{p}.layer.1.layer_norm.weight"])
        x = x + torch.relu(h @ sd[f"{p}.layer.1.DenseReluDense.wi.weight"].T) @ sd[f"{p}.layer.1.DenseReluDense.wo.weight"].T
    enc = _rms(x, sd["encoder.final_layer_norm.weight"])
    y = emb[dec_ids]
    t = dec_ids.shape[1]
    dpos = torch.arange(t)
    dtable = sd["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    dec_bias = dtable[relative_position_bucket(dpos[None, :] - dpos[:, None], bidirectional=False, num_buckets=buckets,
                                               max_distance=max_distance)].permute(2, 0, 1).unsqueeze(0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    for i in range(layers):
        p = f"decoder.block.{i}"
        h = _rms(y, sd[f"{p}.layer.0.layer_norm.weight"])
        y = y + _reference_attention(h, h, sd, f"{p}.layer.0.SelfAttention", dec_bias, causal, heads, d_kv)
        h = _rms(y, sd[f"{p}.layer.1.layer_norm.weight"])
        y = y + _reference_attention(h, enc, sd, f"{p}.layer.1.EncDecAttention", 0.0, key_mask, heads, d_kv)
        h = _rms(y, sd[f"{p}.layer.2.layer_norm.weight"])
        y = y + torch.relu(h @ sd[f"{p}.layer.2.DenseReluDense.wi.weight"].T) @ sd[f"{p}.layer.2.DenseReluDense.wo.weight"].T
    y = _rms(y, sd["decoder.final_layer_norm.weight"])
    d_model = emb.shape[1]
    return enc, (y * d_model**-0.5) @ emb.T


_OURS_TO_HF = None


def _to_hf_keys(model) -> dict[str, torch.Tensor]:
    """Our state dict in Hugging Face T5 key names (the inverse of the converter), plus the
    duplicated input embeddings a Hugging Face file carries."""
    ours = model.state_dict()
    hf = {}
    candidates = ["shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"]
    for stack, n_layers, n_sub in (("encoder", len(model.encoder.blocks), 2), ("decoder", len(model.decoder.blocks), 3)):
        candidates.append(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        for i in range(n_layers):
            for j in range(n_sub):
                candidates.append(f"{stack}.block.{i}.layer.{j}.layer_norm.weight")
            for p in "qkvo":
                candidates.append(f"{stack}.block.{i}.layer.0.SelfAttention.{p}.weight")
                if stack == "decoder":
                    candidates.append(f"{stack}.block.{i}.layer.1.EncDecAttention.{p}.weight")
            for w in ("wi", "wo"):
                candidates.append(f"{stack}.block.{i}.layer.{n_sub - 1}.DenseReluDense.{w}.weight")
    for key in candidates:
        hf[key] = ours[hf_t5_key(key)].clone()
    hf["encoder.embed_tokens.weight"] = hf["shared.weight"].clone()
    hf["decoder.embed_tokens.weight"] = hf["shared.weight"].clone()
    assert len(candidates) == len(ours)
    return hf


_TEST_ARCH = dict(layers=2, heads=4, d_kv=8, buckets=8, max_distance=32)


def _hf_config(model, *, n_tokens: int, context_length: int = 64, prediction_length: int = 16) -> dict:
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64,
        "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32, "vocab_size": n_tokens, "feed_forward_proj": "relu", "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-6, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
        "is_encoder_decoder": True, "initializer_factor": 0.05,
        "chronos_config": {
            "tokenizer_class": "MeanScaleUniformBins", "tokenizer_kwargs": {"low_limit": -15.0, "high_limit": 15.0},
            "n_tokens": n_tokens, "n_special_tokens": 2, "pad_token_id": 0, "eos_token_id": 1, "use_eos_token": True,
            "model_type": "seq2seq", "context_length": context_length, "prediction_length": prediction_length,
            "num_samples": 20, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
        },
    }


def _write_hf_dir(tmp_path, seed=0, *, n_tokens=512, drop_lm_head=True, context_length=64):
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    source = domainfm.create_model("chronos-t5-test", vocab_size=n_tokens)
    with torch.no_grad():  # non-trivial norms and biases so that a wrong key shows up
        for name, p in source.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if "relative_attention_bias" in name:
                p.normal_(0, 1.0)
        # PAD (also the decoder start token) and EOS get zero embeddings: their tied logits are then
        # exactly 0, below the best of the other tokens, so a greedy path never picks them (Chronos
        # would decode a PAD to low_limit * scale; ours never samples special tokens)
        source.shared.weight[:2] = 0
    hf = _to_hf_keys(source)
    if not drop_lm_head:
        hf["lm_head.weight"] = hf["shared.weight"].clone()
    directory = tmp_path / f"chronos-hf-{seed}"
    directory.mkdir()
    save_file(hf, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(_hf_config(source, n_tokens=n_tokens, context_length=context_length)))
    return directory, hf


def test_hf_checkpoint_loads_and_matches_reference_t5(tmp_path):
    directory, hf = _write_hf_dir(tmp_path)
    model = domainfm.create_model("chronos-t5-test", pretrained=str(directory))
    assert model.domainfm_load_report.converter == "hf_t5"
    assert torch.equal(model.shared.weight, hf["shared.weight"])
    assert torch.equal(model.decoder.blocks[1].cross_attn.v.weight, hf["decoder.block.1.layer.1.EncDecAttention.v.weight"])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 512, (3, 21), generator=g)
    mask = torch.ones(3, 21, dtype=torch.bool)
    mask[1, :6] = False  # left padding
    mask[2, 10] = False  # a gap
    dec = torch.randint(2, 512, (3, 9), generator=g)
    model.eval()
    with torch.no_grad():
        enc = model.encode(ids, mask)
        logits = model(ids, mask, dec)
    ref_enc, ref_logits = _reference_t5(hf, ids, mask, dec, **_TEST_ARCH)
    torch.testing.assert_close(enc.double(), ref_enc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_converter_is_idempotent(tied, tmp_path):
    model = domainfm.create_model("chronos-t5-test", tie_word_embeddings=tied)
    own = model.state_dict()
    assert ("lm_head.weight" in own) is not tied
    again = convert_hf_t5(dict(own), model)  # our own keys: unchanged
    assert list(again) == list(own) and all(again[k] is own[k] for k in own)
    _, hf = _write_hf_dir(tmp_path, drop_lm_head=False)
    once = convert_hf_t5(hf, model)
    assert set(once) == set(own)
    twice = convert_hf_t5(once, model)
    assert list(twice) == list(once) and all(twice[k] is once[k] for k in once)


def test_hf_weights_file_alone_loads_through_create_model_without_converter_argument(tmp_path):
    """The Hugging Face ``model.safetensors`` by itself (no config.json beside it, no domainfm
    metadata): upstream, so the card's converter applies, as when it is called by hand."""
    from safetensors.torch import load_file

    directory, hf = _write_hf_dir(tmp_path)
    alone = tmp_path / "alone.safetensors"
    alone.write_bytes((directory / "model.safetensors").read_bytes())
    model = domainfm.create_model("chronos-t5-test", pretrained=str(alone)).eval()
    report = model.domainfm_load_report
    assert report.kind == "upstream" and report.converter == "hf_t5"
    assert report.missing == [] and report.unexpected == []
    explicit = domainfm.create_model("chronos-t5-test")
    explicit.load_state_dict(convert_hf_t5(load_file(str(alone)), explicit), strict=True)
    explicit.eval()
    ids, mask, dec = zoo.get_card("chronos-t5-test").example_input()
    with torch.no_grad():
        got = model(ids, mask, dec)
        assert torch.equal(got, explicit(ids, mask, dec))
    _, ref_logits = _reference_t5(hf, ids, mask, dec, **_TEST_ARCH)
    torch.testing.assert_close(got.double(), ref_logits, atol=1e-5, rtol=1e-5)


def test_converter_errors_and_tied_head(tmp_path):
    model = domainfm.create_model("chronos-t5-test")
    directory, hf = _write_hf_dir(tmp_path, drop_lm_head=False)
    assert "lm_head.weight" not in convert_hf_t5(hf, model)  # tied: equal head dropped
    bad = dict(hf, **{"lm_head.weight": hf["shared.weight"] + 1})
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        convert_hf_t5(bad, model)
    with pytest.raises(ValueError, match="unrecognised key"):
        convert_hf_t5(dict(hf, **{"encoder.block.0.layer.1.DenseReluDense.wi_0.weight": torch.zeros(1)}), model)
    with pytest.raises(ValueError, match="d_model: config 32 vs model 256"):
        domainfm.create_model("chronos-t5-tiny", pretrained=str(directory))


def test_chronos_config_is_adopted_and_round_trips(tmp_path):
    directory, _ = _write_hf_dir(tmp_path, context_length=48)
    model = load_chronos(directory)  # variant chosen from config.json sizes
    assert model.domainfm_name == "chronos-t5-test"
    assert model.context_length == 48 and model.tokenizer.context_length == 48
    ids, _, _ = model.tokenize(torch.randn(80))
    assert ids.shape == (1, 49)  # truncated to 48 + EOS
    saved = domainfm.save_pretrained(model, tmp_path / "saved")
    again = domainfm.create_model(saved)
    assert again.context_length == 48
    x = torch.randn(2, 30)
    assert torch.equal(again.predict(x, 8, num_samples=3, seed=1), model.predict(x, 8, num_samples=3, seed=1))
    with pytest.raises(ValueError, match="hf://org/repo"):
        load_chronos("hf://amazon")


def _chronos_available():
    try:
        import chronos  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _chronos_available(), reason="chronos-forecasting (optional test dependency) is not installed")
def test_embed_and_greedy_predict_match_chronos_pipeline(tmp_path):
    from chronos import ChronosPipeline

    directory, _ = _write_hf_dir(tmp_path, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = ChronosPipeline.from_pretrained(str(directory))
    ours = domainfm.create_model("chronos-t5-test", pretrained=str(directory))
    g = torch.Generator().manual_seed(0)
    context = [torch.randn(40, generator=g) * 3 + 5, torch.randn(70, generator=g), torch.randn(20, generator=g) - 2]
    context[0][5:9] = float("nan")
    context[1][-3] = float("nan")
    emb_ref, scale_ref = pipeline.embed(context)
    emb, state = ours.embed(context, return_state=True)
    assert emb.shape == emb_ref.shape == (3, 65, 32)  # truncated to 64 + EOS, left-padded to the longest
    torch.testing.assert_close(emb, emb_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.scale, scale_ref)
    ref = pipeline.predict(context, prediction_length=16, num_samples=1, top_k=1)
    got = ours.predict(context, 16, num_samples=1, top_k=1)
    # Chronos may sample PAD, which it decodes to low_limit * scale; ours never samples PAD. With
    # these weights and contexts it does not happen, so the greedy paths are identical.
    assert not torch.isclose(ref, -15.0 * scale_ref.view(-1, 1, 1)).any()
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------- sampling


def test_kv_cache_greedy_equals_uncached_token_for_token():
    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test").eval()
    ids, mask, _ = model.tokenize([torch.randn(64), torch.randn(20)])
    uniforms = torch.rand(2, 3, 16)
    cached = model.generate(ids, mask, 16, uniforms=uniforms, top_k=1, use_cache=True)
    plain = model.generate(ids, mask, 16, uniforms=uniforms, top_k=1, use_cache=False)
    assert torch.equal(cached, plain)
    assert (cached[:, 0] == cached[:, 1]).all()  # greedy: every path identical
    sampled_c = model.generate(ids, mask, 16, uniforms=uniforms, top_k=50, use_cache=True)
    sampled_p = model.generate(ids, mask, 16, uniforms=uniforms, top_k=50, use_cache=False)
    assert torch.equal(sampled_c, sampled_p)
    assert (sampled_c >= model.tokenizer.n_special_tokens).all()  # never PAD/EOS


def test_sampling_is_seeded_and_independent_of_batch_composition():
    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test")
    g = torch.Generator().manual_seed(5)
    a, b, c = torch.randn(50, generator=g), torch.randn(64, generator=g) * 3, torch.randn(12, generator=g) + 4
    batch = model.predict([a, b, c], 16, num_samples=6, seed=11)
    again = model.predict([a, b, c], 16, num_samples=6, seed=11)
    assert torch.equal(batch, again)
    alone = model.predict([b], 16, num_samples=6, seed=11)
    reordered = model.predict([c, b], 16, num_samples=6, seed=11)
    assert torch.equal(alone[0], batch[1]) and torch.equal(reordered[1], batch[1]) and torch.equal(reordered[0], batch[2])
    other_seed = model.predict([b], 16, num_samples=6, seed=12)
    assert not torch.equal(other_seed, alone)
    assert batch[1].std(0).mean() > 0  # paths differ from one another


def test_filter_logits_matches_hf_semantics():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    top2 = filter_logits(logits, top_k=2)
    assert torch.isinf(top2).tolist() == [[False, False, False, True, True]]  # the tie with the 2nd is kept
    distinct = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = distinct.softmax(-1)[0]
    top_p = filter_logits(distinct, top_p=float(probs[0] + 0.5 * probs[1]))
    assert torch.isfinite(top_p).tolist() == [[True, True, False, False, False]]  # the smallest set reaching p
    assert torch.allclose(filter_logits(logits, temperature=2.0), logits / 2)
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(logits, temperature=0.0)


def test_rollout_quantiles_and_input_errors():
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-t5-test")
    with pytest.warns(UserWarning, match="rolling out"):
        samples = model.predict(torch.randn(30), 40, num_samples=3, seed=0)
    assert samples.shape == (1, 3, 40)
    quantiles, mean = model.predict_quantiles(torch.randn(2, 30), 8, quantile_levels=[0.1, 0.5, 0.9], num_samples=9, seed=0)
    assert quantiles.shape == (2, 8, 3) and mean.shape == (2, 8)
    assert (quantiles[..., 0] <= quantiles[..., 1]).all() and (quantiles[..., 1] <= quantiles[..., 2]).all()
    with pytest.raises(ValueError, match="infinite"):
        model.predict(torch.tensor([1.0, math.inf]))
    with pytest.raises(ValueError, match="prediction_length"):
        model.predict(torch.randn(10), 0)
    with pytest.raises(ValueError, match="n_chans=3"):
        domainfm.create_model("wavetoken-test", n_chans=3)
    with pytest.raises(ValueError, match="unknown setting"):
        domainfm.create_model("wavetoken-test", tokenizer_kwargs={"wavelet_levels": 2})


def test_training_loss_masks_missing_future_and_backpropagates():
    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test")
    context, future = torch.randn(4, 64), torch.randn(4, 16)
    future[0, :] = float("nan")
    ids, mask, labels = model.training_tokens(context, future)
    assert labels.shape == (4, 17) and (labels[0, :16] == -100).all() and labels[0, 16] == 1  # EOS kept
    loss, logs = model.loss(context, future)
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(1024)) < 1.5  # near uniform at init
    loss.backward()
    assert model.shared.weight.grad.abs().sum() > 0


def test_repo_level_hf_source_loads_like_the_local_directory(tmp_path, hf_hub, domainfm_home):
    # create_model("chronos-t5-…", pretrained="hf://org/repo"): config.json + model.safetensors are
    # fetched through huggingface_hub from a local server that answers like the Hub
    directory, _ = _write_hf_dir(tmp_path, seed=5)
    for name in ("config.json", "model.safetensors"):
        hf_hub.add("amazon/chronos-t5-mock", name, (directory / name).read_bytes(), lfs=name.endswith(".safetensors"))
    remote = domainfm.create_model("chronos-t5-test", pretrained="hf://amazon/chronos-t5-mock", progress=False)
    local = domainfm.create_model("chronos-t5-test", pretrained=str(directory))
    assert remote.domainfm_load_report.converter == "hf_t5"
    for key, value in local.state_dict().items():
        assert torch.equal(value, remote.state_dict()[key]), key
    assert sorted(p.name for p in (hf_hub.cache).rglob("*") if p.is_file() and "snapshots" in p.parts) == [
        "config.json", "model.safetensors"]


# --------------------------------------------------------------------------- speed paths (issue 15)


def test_chronos_tokenizer_ids_equal_bucketize_at_every_boundary_and_extreme():
    # the arithmetic bucketing must give exactly torch.bucketize(right=True) over the boundaries,
    # also on each boundary, one ulp either side, far outside the range and for NaN (-> PAD)
    tok = MeanScaleUniformBins(-15.0, 15.0, n_tokens=4096, context_length=10**6, use_eos_token=False)
    b = tok.boundaries
    g = torch.Generator().manual_seed(0)
    extremes = torch.tensor([1e21, -1e21, 1e19, -1e19, 1e30, -1e30, 0.0, -0.0, 15.0, -15.0, 15.004, -15.004, 3.4e38,
                             -3.4e38, float("nan")])
    values = torch.cat([torch.randn(20000, generator=g) * 8, b, b.nextafter(torch.tensor(1e30)),
                        b.nextafter(torch.tensor(-1e30)), extremes])
    ids, observed, clipped = tok._ids(values[None], torch.ones(1))
    reference = (torch.bucketize(values, b, right=True) + 2).clamp(0, 4095)
    reference[torch.isnan(values)] = 0
    assert torch.equal(ids[0], reference)
    assert torch.equal(observed[0], ~torch.isnan(values))
    half = tok.bin_width / 2
    assert clipped.item() == int(((values < -15 - half) | (values > 15 + half)).sum())
    # Chronos's scale: nansum(|x| * mask) / nansum(mask), 1 where not > 0
    context = torch.randn(5, 30, generator=g) * 3
    context[1, :7] = float("nan")
    context[2] = 0.0
    context[3] = float("nan")
    _, _, state = tok.encode_context(context)
    mask = ~torch.isnan(context)
    expected = torch.nansum(context.abs() * mask, -1) / mask.sum(-1)
    expected[~(expected > 0)] = 1.0
    assert torch.equal(state.scale, expected)


def test_bf16_decoding_tolerance():
    # Documented tolerance of bf16 autocast decoding (fp32 weights, bf16 matmuls, float32 sampling):
    # logits within 1% of their largest magnitude; on a model whose logits are well separated the
    # sampled tokens agree with fp32 for >= 95% of the positions (measured: all of them)
    from domainfm.precision import autocast

    torch.manual_seed(0)
    model = domainfm.create_model("chronos-t5-test").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0, 1.0)
        model.shared.weight.mul_(20)
    g = torch.Generator().manual_seed(1)
    ids, mask, _ = model.tokenize(torch.randn(8, 64, generator=g).cumsum(-1))
    uniforms = torch.rand(8, 4, 16, generator=g)
    start = torch.zeros(8, 1, dtype=torch.long)
    with torch.no_grad():
        ref_logits = model(ids, mask, start)
        with autocast("bf16-mixed", "cpu"):
            logits = model(ids, mask, start)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref_logits).abs().max() <= 0.01 * ref_logits.abs().max()
    for top_k in (1, 50):
        ref = model.generate(ids, mask, 16, uniforms=uniforms, top_k=top_k)
        with autocast("bf16-mixed", "cpu"):
            got = model.generate(ids, mask, 16, uniforms=uniforms, top_k=top_k)
        assert (got == ref).float().mean() >= 0.95
        assert (got >= model.tokenizer.n_special_tokens).all()


def test_shared_cross_attention_cache_equals_repeated_cache():
    # the grouped cache (cross K/V once per series, first step once per series) gives the decoder
    # states of the plain per-row cache with K/V repeated for every sample
    from domainfm.models.wavetoken.t5 import _mask_bias

    torch.manual_seed(0)
    model = domainfm.create_model("chronos-t5-test").eval()
    ids, mask, _ = model.tokenize([torch.randn(64), torch.randn(30)])
    s, steps = 3, 5
    with torch.no_grad():
        states = model.encode(ids, mask)
        bias = _mask_bias(mask, states.dtype)
        tokens = torch.randint(2, model.vocab_size, (2 * s, steps))
        tokens[:, 0] = model.decoder_start_token_id
        plain = model.new_cache(states, steps, repeat=s)
        shared = model.new_cache(states, steps)
        first = model.decode_step(tokens[::s, :1], shared, bias)
        torch.testing.assert_close(model.decode_step(tokens[:, :1], plain, bias.repeat_interleave(s, 0)),
                                   first.repeat_interleave(s, 0),
                                   atol=1e-6, rtol=1e-5)
        shared.expand(s, steps)
        assert shared.group == s and shared.cross_k[0].shape[0] == 2
        for t in range(1, steps):
            a = model.decode_step(tokens[:, t : t + 1], plain, bias.repeat_interleave(s, 0))
            b = model.decode_step(tokens[:, t : t + 1], shared, bias)
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- horizons and the trained token layout


@pytest.mark.parametrize("name", ["wavetoken-test", "chronos-t5-test"])
def test_any_horizon_decodes_like_the_trained_horizon_truncated(name):
    # The wavelet tokenizer lays a horizon out coarse-to-fine ([approximation | detail] of the whole
    # horizon), so the token at position i means something else for another horizon: a model
    # trained on 64 steps must generate the 64-step layout and keep the first h values. Roll-outs'
    # last chunk likewise: h=100 is the first 100 values of two full chunks (h=128).
    torch.manual_seed(0)
    model = domainfm.create_model(name, prediction_length=64, context_length=64).eval()
    g = torch.Generator().manual_seed(3)
    t = torch.arange(90, dtype=torch.float32)
    context = [torch.sin(t / 4) + 0.1 * torch.randn(90, generator=g), 3 + t / 30 + 0.2 * torch.randn(90, generator=g)]
    full = model.predict(context, 64, num_samples=4, seed=7)
    for h in (1, 12, 24, 63, 64):
        torch.testing.assert_close(model.predict(context, h, num_samples=4, seed=7), full[..., :h], rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        two_chunks = model.predict(context, 128, num_samples=4, seed=7)
        for h in (65, 100):
            torch.testing.assert_close(model.predict(context, h, num_samples=4, seed=7), two_chunks[..., :h], rtol=0, atol=0)
    torch.testing.assert_close(two_chunks[..., :64], full, rtol=0, atol=0)


def test_short_future_trains_on_the_trained_layout():
    # Fine-tuning at h < prediction_length teaches the same token positions the decoder reads:
    # the labels of a 12-step future are those of the 64-step layout with the missing tail ignored.
    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test", prediction_length=64, context_length=64)
    context, future = torch.randn(2, 64), torch.randn(2, 12)
    padded = torch.cat([future, torch.full((2, 52), float("nan"))], dim=-1)
    _, _, short = model.training_tokens(context, future)
    _, _, full = model.training_tokens(context, padded)
    assert short.shape == full.shape == (2, 65)
    assert torch.equal(short, full)
    assert (short[:, :6] != -100).all()  # the approximation of the first 12 steps is learned


def test_scaling_window_z_scores_the_recent_values():
    # independent reference: numpy's mean/std over the last W observed values
    g = np.random.default_rng(0)
    t = np.arange(128, dtype=np.float64)
    trend = 5 + 0.3 * t + g.normal(0, 1, 128)
    gappy = trend.copy()
    gappy[-20:-10] = np.nan
    sparse = np.full(128, np.nan)
    sparse[:50] = g.normal(size=50)
    sparse[-1] = 3.0  # one observed value in the window: the whole context's statistics
    context = torch.tensor(np.stack([trend, gappy, sparse]), dtype=torch.float32)
    tok = WaveletTokenizer(context_length=128, scaling_window=32)
    _, _, state = tok.encode_context(context)
    for row, series in enumerate((trend, gappy)):
        recent = series[-32:][~np.isnan(series[-32:])]
        np.testing.assert_allclose(state.loc[row], recent.mean(), rtol=1e-5)
        np.testing.assert_allclose(state.scale[row], recent.std(), rtol=1e-4)
    whole = sparse[~np.isnan(sparse)]
    np.testing.assert_allclose(state.loc[2], whole.mean(), rtol=1e-5)
    np.testing.assert_allclose(state.scale[2], whole.std(), rtol=1e-4)
    _, _, paper = WaveletTokenizer(context_length=128).encode_context(context)
    np.testing.assert_allclose(paper.loc[0], trend.mean(), rtol=1e-5)  # None: the whole context (the paper's)
    with pytest.raises(ValueError, match="scaling_window"):
        WaveletTokenizer(context_length=128, scaling_window=1)


def test_scaling_window_is_a_model_setting_that_round_trips(tmp_path):
    kwargs = {"wavelet": "bior2.2", "wavelet_level": 1, "wavelet_mode": "periodization", "scaling": "standard",
              "threshold": "none", "low_limit": -10.0, "high_limit": 10.0, "scaling_window": 16}
    model = domainfm.create_model("wavetoken-test", tokenizer_kwargs=kwargs)
    assert model.tokenizer.scaling_window == 16
    domainfm.save_pretrained(model, tmp_path / "m", card=False)
    again = domainfm.create_model(tmp_path / "m")
    assert again.tokenizer.scaling_window == 16
    context = torch.cat([torch.zeros(48), torch.linspace(10, 20, 16)])
    torch.testing.assert_close(again.predict(context, 8, num_samples=3, seed=1), model.predict(context, 8, num_samples=3, seed=1))
