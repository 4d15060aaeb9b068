"""SToFM pretraining: the official masking of both objectives, the losses, one CLI run."""
from __future__ import annotations

import json

import igraph  # noqa: F401 - a required dependency (Leiden): missing, these tests fail rather than skip
import numpy as np
import torch

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.pretrain import stofm as P


def _subslices():
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 100, (400, 2))
    emb = rng.normal(size=(400, 256)).astype(np.float32)
    clusters = (xy[:, 0] > 50).astype(int)
    return S.build_subslices(xy, emb, cells_per_subslice=120, knn=8, clusters=clusters)


def test_masks_are_drawn_as_officially():
    subs = _subslices()
    item = subs[0]
    n_cells = int((item["token_types"] == S.TOKEN_CELL).sum())
    masked_item = P.mask_subslice(item, P.MaskingSection(), torch.Generator().manual_seed(0))
    t = len(item["token_types"])
    emb, labels = masked_item["token_embeddings"], masked_item["labels"]
    masked = (emb == -100).all(-1)
    labelled = (labels != -100).all(-1)
    assert int(masked.sum()) == int(0.12 * n_cells) and int(labelled.sum()) == int(0.12 * n_cells) + int(0.03 * n_cells)
    assert (masked <= labelled).all() and (item["token_types"][labelled] == S.TOKEN_CELL).all()
    torch.testing.assert_close(labels[labelled], item["token_embeddings"][labelled])
    torch.testing.assert_close(emb[~masked], item["token_embeddings"][~masked])
    # pair objective: labels are the true kNN distances on edges touching the chosen cells
    d0, pl, dn = item["distances"], masked_item["pair_labels"], masked_item["distances"]
    has = pl != -100
    assert has.any()
    torch.testing.assert_close(pl[has], d0[has])
    assert (d0[has] != S.NON_EDGE_DISTANCE).all() and (d0[has] != 0).all()
    cells = item["token_types"] == S.TOKEN_CELL
    assert not has[~cells].any() and not has[:, ~cells].any()
    # the jittered rows are dense (all distances recomputed), symmetric, and differ from the truth
    changed = (dn != d0).any(1)
    jittered = changed & cells & ((dn != S.NON_EDGE_DISTANCE) & (dn != 0)).sum(1).ge(t - 3)
    assert int(jittered.sum()) == int(0.12 * n_cells)
    torch.testing.assert_close(dn, dn.t())
    assert (dn[0] == 0).all()


def test_draws_come_from_the_sample_index_and_epoch_not_the_process_rng():
    subs = _subslices()
    data = P.PretrainSubslices(subs, P.MaskingSection(), seed=3)
    first = data[1]
    torch.manual_seed(123)  # the process RNG plays no part
    again = data[1]
    for key in ("token_embeddings", "distances", "labels", "pair_labels"):
        assert torch.equal(first[key], again[key]), key
    assert first["dropout_seed"] == again["dropout_seed"]
    # another epoch, another sample or another run seed: other draws
    assert data[0]["dropout_seed"] != first["dropout_seed"]
    data.set_epoch(1)
    assert not torch.equal(data[1]["labels"], first["labels"])
    assert not torch.equal(P.PretrainSubslices(subs, P.MaskingSection(), seed=4)[1]["labels"], first["labels"])
    # a held-out part reads its sub-slices in the source's order and draws by its own positions
    from domainfm.engine import SampleSeeds

    part = P.PretrainSubslices(subs, P.MaskingSection(), seed=3, indices=[3, 1])
    want = P.mask_subslice(subs[1], P.MaskingSection(), SampleSeeds(3).generator(0))
    assert torch.equal(part[0]["cell_index"], subs[1]["cell_index"]) and torch.equal(part[0]["labels"], want["labels"])


def test_losses_are_the_official_forms():
    # the official batched losses over a padded batch: one mean over all masked cells (pairs) of
    # the batch; ours takes each sub-slice through the model alone and pools the sums
    model = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
    g = torch.Generator().manual_seed(1)
    items = [P.mask_subslice(s, P.MaskingSection(), g) for s in _subslices()[:3]]
    assert len({len(i["token_types"]) for i in items}) > 1  # padding is exercised
    lm_loss, pair_loss = P.pretraining_losses(model, items)
    batch = S.collate_subslices([{k: i[k] for k in ("token_embeddings", "distances", "token_types")} for i in items])
    n, d = batch["token_types"].shape[1], items[0]["labels"].shape[1]
    labels = torch.full((len(items), n, d), -100.0)
    pair_labels = torch.full((len(items), n, n), -100.0)
    for k, item in enumerate(items):
        t = len(item["token_types"])
        labels[k, :t], pair_labels[k, :t, :t] = item["labels"], item["pair_labels"]
    _, lm, pair = model.forward_pretrain(batch["token_embeddings"], batch["distances"], batch["token_types"])
    chosen = labels[..., 0] != -100
    want = torch.nn.CosineEmbeddingLoss()(lm[chosen], labels[chosen], torch.ones(int(chosen.sum())))
    torch.testing.assert_close(lm_loss, want, rtol=1e-5, atol=1e-6)
    pairs = pair_labels != -100
    torch.testing.assert_close(pair_loss, torch.nn.MSELoss()(pair[pairs], pair_labels[pairs]), rtol=1e-5, atol=1e-5)
    model.zero_grad()
    (lm_loss + pair_loss).backward()
    assert model.pair_head[0].weight.grad.abs().sum() > 0 and model.lm_head[0].weight.grad.abs().sum() > 0
    assert model.gaussian.proj[0].weight.grad.abs().sum() > 0


def test_cli_pretraining_run_saves_a_loadable_backbone(tmp_path):
    rc = main(["pretrain", "stofm", "model.name=stofm-test", "model.kwargs={}",
               "data.cell_encoder.name=stofm-cell-encoder-test", "data.cell_encoder.kwargs={}",
               "data.cells_per_subslice=300", "data.val_fraction=0.34", "train.max_steps=3", "train.max_epochs=3",
               "train.progress=false", "--runs-dir", str(tmp_path), "--name", "r"])
    assert rc == 0
    report = json.loads((tmp_path / "stofm" / "r" / "report.json").read_text())
    assert report["steps"] == 3 and report["subslices"] >= 3 and np.isfinite(report["val_loss"])
    model = domainfm.create_model(report["saved_model"], n_outputs=4)
    assert model.lm_head is None and model.head[-1].out_features == 4
    best = domainfm.create_model(report["saved_model"])
    from safetensors.torch import load_file

    trained = load_file(str(tmp_path / "stofm" / "r" / "checkpoints" / "best.safetensors"))
    # the saved backbone holds the selected (best) step's weights, without the pretraining heads
    assert {k for k in trained if not k.startswith(("lm_head.", "pair_head."))} == set(best.state_dict())
    for key, value in best.state_dict().items():
        assert torch.equal(value, trained[key]), key
    # paired, on the held-out sub-slice with the same masks: the trained backbone + heads (the best
    # checkpoint) predict masked cells better than the same model randomly initialised (3 seeds)
    # and than an uninformative prediction (cosine 0 to every target: loss 1)
    data = P.DataSection(cell_encoder=P.CellEncoderSection(name="stofm-cell-encoder-test"), cells_per_subslice=300,
                         val_fraction=0.34)
    _, val, _ = P.build_datasets(data, seed=0)
    batch = [val[i] for i in range(len(val))]  # the held-out masks of the run (fixed per sample)
    with torch.no_grad(), torch.random.fork_rng():
        with_heads = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
        with_heads.load_state_dict(trained)
        trained_loss = float(P.pretraining_losses(with_heads, batch)[0])
        for seed in range(3):
            torch.manual_seed(seed)
            untrained = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
            assert trained_loss < float(P.pretraining_losses(untrained, batch)[0]) - 0.05, seed
    assert trained_loss < 0.95
