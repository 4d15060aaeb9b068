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


def test_pretrain_recipe_loss_under_bf16_uses_fp32_tokens():
    # the pretraining recipe's labels under autocast are the fp32 labels: its token accuracy
    # counts the same positions and the same targets
    from domainfm.pretrain.wavetoken import ForecastRecipe

    torch.manual_seed(0)
    model = domainfm.create_model("wavetoken-test").train()
    context, future = _series(), _series(seed=1)[:, :16]
    recipe = ForecastRecipe(model, None)
    _, _, ref_total = recipe._loss(model, (context, future))
    ids, mask, labels = model.training_tokens(context, future)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, correct, total = recipe._loss(model, (context, future))
    assert torch.equal(total, ref_total) and int(total) == int((labels != -100).sum())
    assert torch.isfinite(loss)


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
