"""WaveToken / Chronos: the tokenizer is precision-independent (fp32 under any autocast), and the
fast decoding paths give the tokens of the plain ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import domainfm
from domainfm.models.wavetoken import MeanScaleUniformBins, WaveletTokenizer


def _series(batch: int = 16, length: int = 64, seed: int = 0) -> torch.Tensor:
    # random walks with a level far from zero (bf16 keeps 8 bits: 100.3 and 100.5 collide) and gaps
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, generator=g).cumsum(-1) + 100.0
    x[1, :10] = float("nan")
    x[2, 20:25] = float("nan")
    return x


@pytest.mark.parametrize("kind", ["wavelet", "chronos"])
def test_tokenizer_under_bf16_autocast_equals_fp32_exactly(kind):
    if kind == "wavelet":
        tok = WaveletTokenizer(vocab_size=1024, context_length=64)
    else:
        tok = MeanScaleUniformBins(-15.0, 15.0, n_tokens=4096, context_length=64)
    context, future = _series(), _series(seed=1)[:, :16]
    ids, mask, state = tok.encode_context(context)
    labels, label_mask = tok.encode_labels(future, state)
    sampled = torch.randint(tok.n_special_tokens, tok.vocab_size, (16, 3, tok.num_label_tokens(16)),
                            generator=torch.Generator().manual_seed(2))
    values = tok.decode(sampled, state, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids_bf, mask_bf, state_bf = tok.encode_context(context)
        labels_bf, label_mask_bf = tok.encode_labels(future, state_bf)
        values_bf = tok.decode(sampled, state_bf, 16)
        # a bf16 input (e.g. from a bf16 data pipeline) is tokenized in fp32 too
        ids_half, _, _ = tok.encode_context(context.bfloat16())
    assert torch.equal(ids_bf, ids) and torch.equal(mask_bf, mask)
    assert torch.equal(labels_bf, labels) and torch.equal(label_mask_bf, label_mask)
    assert torch.equal(state_bf.scale, state.scale) and torch.equal(state_bf.loc, state.loc)
    assert state_bf.scale.dtype == torch.float32
    assert values_bf.dtype == torch.float32 and torch.equal(values_bf, values)
    assert torch.equal(ids_half, tok.encode_context(context.bfloat16().float())[0])
    # the tokens are not trivially equal: the wavelet tokenizer spreads over many bins
    assert ids[:, :-1].unique().numel() > 20


@pytest.mark.parametrize("name", ["wavetoken-test", "chronos-t5-test"])
def test_model_tokenization_and_training_tokens_precision_independent(name):
    # the model's own tokenization (predict, embed, training) under bf16 autocast = fp32, without any
    # caller-side workaround (pretrain/wavetoken.py tokenizes inside the engine's autocast)
    torch.manual_seed(0)
    model = domainfm.create_model(name).eval()
    context, future = _series(), _series(seed=1)[:, :16]
    ref = model.tokenize(context)
    ref_train = model.training_tokens(context, future)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.tokenize(context)
        got_train = model.training_tokens(context, future)
    for a, b in zip(ref[:2] + ref_train, got[:2] + got_train):
        assert torch.equal(a, b)


def test_pretrain_recipe_under_bf16_feeds_the_network_fp32_tokens():
    # the pretraining recipe tokenizes inside the engine's autocast with no guard of its own: the
    # network must receive the fp32 tokens (context ids, mask, shifted labels) and be scored on them
    from domainfm.pretrain.wavetoken import ForecastRecipe

    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test").train()
    context, future = _series(), _series(seed=1)[:, :16]
    ids, mask, labels = model.training_tokens(context, future)
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(args))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, correct, total = ForecastRecipe(model, None)._loss(model, (context, future))
    finally:
        hook.remove()
    got_ids, got_mask, got_decoder = seen[0]
    assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)
    assert torch.equal(got_decoder, model.shift_right(labels))
    assert int(total) == int((labels != -100).sum()) and torch.isfinite(loss)


def test_bf16_predict_keeps_float32_values_and_scale():
    # forecasts decode in float32 (bf16 would round a level of ~100 to steps of 0.5)
    torch.manual_seed(0)
    model = domainfm.create_model("chronos-t5-test").eval()
    context = _series(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.predict(context, 8, num_samples=3, seed=0)
    assert out.dtype == torch.float32
    _, _, state = model.tokenize(context)
    # every value is a bin centre times the fp32 scale
    centers = model.tokenizer.centers
    ratios = out / state.scale.view(-1, 1, 1)
    nearest = (ratios.unsqueeze(-1) - centers).abs().min(-1).values
    assert nearest.max() < 1e-4


def _reference_choice(logits, u, n_special, temperature, top_k, top_p):
    """Independent float64 restatement: HF's warpers (temperature, top-k with ties, top-p) over the
    regular tokens, then the token where the CDF in id order first exceeds ``u * total``."""
    x = logits[:, n_special:].double() / temperature
    out = []
    for row, ur in zip(x, u.double()):
        keep = torch.ones_like(row, dtype=torch.bool)
        if top_k is not None:
            keep &= row >= row.sort(descending=True).values[top_k - 1]
        p = torch.where(keep, (row - row[keep].max()).exp(), torch.zeros_like(row))
        p = p / p.sum()
        if top_p is not None and top_p < 1.0:
            order = p.argsort(stable=True)  # ascending, ties by id; remove the low tail of mass <= 1 - top_p
            tail = p[order].cumsum(0) <= 1 - top_p
            tail[-1] = False
            p[order[tail]] = 0
        cdf = p.cumsum(0)
        out.append(int(torch.searchsorted(cdf, ur * cdf[-1], right=True).clamp(max=len(cdf) - 1)) + n_special)
    return torch.tensor(out)


def test_top_k_candidate_sampler_equals_full_vocabulary_sampling():
    # the CPU sampler works on the top_k + margin largest logits; it must pick the token of the
    # full-vocabulary filter, including ties with the k-th logit (bf16 logits have many) and
    # top-p and temperature; ties past the margin fall back to the full vocabulary
    from domainfm.models.wavetoken.forecast import TokenForecaster, _sample_top_k

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(128, 514, generator=g) * 2).bfloat16()
    u = torch.rand(128, generator=g)
    values = logits[:, 2:].float()
    kth = values.sort(-1, descending=True).values[:, 49:50]
    assert ((values == kth).sum(-1) > 1).any()  # ties at the 50th logit do occur
    for temperature, top_k, top_p in [(1.0, 50, 1.0), (0.7, 10, 0.9), (1.3, 1, None), (1.0, 5, 0.5), (2.0, 50, 0.8)]:
        got = TokenForecaster._sample(logits, u, 2, temperature=temperature, top_k=top_k, top_p=top_p)
        assert _sample_top_k(logits[:, 2:], u, temperature=temperature, top_k=top_k, top_p=top_p) is not None
        assert torch.equal(got, _reference_choice(logits, u, 2, temperature, top_k, top_p))
    flat = torch.zeros(4, 514)
    flat[:, 2:52] = 1.0  # 50 tokens tied for the top: more than top_k + margin (44) for top_k=30
    u4 = torch.tensor([0.0, 0.31, 0.71, 0.999])  # away from the CDF steps (k/50)
    assert _sample_top_k(flat[:, 2:], u4, temperature=1.0, top_k=30, top_p=None) is None
    got = TokenForecaster._sample(flat, u4, 2, temperature=1.0, top_k=30, top_p=None)
    assert torch.equal(got, _reference_choice(flat, u4, 2, 1.0, 30, None))
    assert got.tolist() == [2, 2 + 15, 2 + 35, 51]
    # with fewer ties than the margin the candidates hold them all
    flat[:, 40:52] = 0.0
    assert torch.equal(_sample_top_k(flat[:, 2:], u4, temperature=1.0, top_k=30, top_p=None) + 2,
                       _reference_choice(flat, u4, 2, 1.0, 30, None))


def test_bf16_cached_decoding_keeps_a_float32_self_attention_cache():
    # under bf16 autocast the self-attention cache stays float32 (no per-step cast of the cache),
    # cross-attention keys/values are bf16, and the cached states match the uncached decoder
    from domainfm.models.wavetoken.t5 import _mask_bias

    torch.manual_seed(0)
    model = domainfm.create_model("chronos-t5-test").eval()
    ids, mask, _ = model.tokenize(_series(3))
    tokens = torch.randint(2, model.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = model.decoder_start_token_id
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        states = model.encode(ids, mask)
        cache = model.new_cache(states, 6)
        assert cache.self_k[0].dtype == torch.float32 and cache.cross_k[0].dtype == torch.bfloat16
        bias = _mask_bias(mask, states.dtype)
        stepped = torch.cat([model.decode_step(tokens[:, t : t + 1], cache, bias) for t in range(6)], 1)
        full = model.decode(tokens, states, mask)
    assert stepped.shape == full.shape == (3, 6, model.d_model)
    torch.testing.assert_close(stepped.float(), full.float(), atol=0.05 * full.float().abs().max().item(), rtol=0)
