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


def test_collator_masks_as_officially():
    subs = _subslices()
    item = subs[0]
    n_cells = int((item["token_types"] == S.TOKEN_CELL).sum())
    collate = P.PretrainCollator(P.MaskingSection(), torch.Generator().manual_seed(0))
    batch = collate(subs[:2])
    t = len(item["token_types"])
    emb, labels = batch["token_embeddings"][0, :t], batch["labels"][0, :t]
    masked = (emb == -100).all(-1)
    labelled = (labels != -100).all(-1)
    assert int(masked.sum()) == int(0.12 * n_cells) and int(labelled.sum()) == int(0.12 * n_cells) + int(0.03 * n_cells)
    assert (masked <= labelled).all() and (item["token_types"][labelled] == S.TOKEN_CELL).all()
    torch.testing.assert_close(labels[labelled], item["token_embeddings"][labelled])
    torch.testing.assert_close(emb[~masked], item["token_embeddings"][~masked])
    # pair objective: labels are the true kNN distances on edges touching the chosen cells
    d0, pl, dn = item["distances"], batch["pair_labels"][0, :t, :t], batch["distances"][0, :t, :t]
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
    assert (dn[0] == 0).all() and (batch["token_types"][0, t:] == S.TOKEN_PAD).all()


def test_losses_are_the_official_forms():
    model = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
    batch = P.PretrainCollator(P.MaskingSection(), torch.Generator().manual_seed(1))(_subslices()[:2])
    lm_loss, pair_loss = P.pretraining_losses(model, batch)
    _, lm, pair = model.forward_pretrain(batch["token_embeddings"], batch["distances"], batch["token_types"])
    chosen = batch["labels"][..., 0] != -100
    want = torch.nn.CosineEmbeddingLoss()(lm[chosen], batch["labels"][chosen], torch.ones(int(chosen.sum())))
    torch.testing.assert_close(lm_loss, want)
    pairs = batch["pair_labels"] != -100
    torch.testing.assert_close(pair_loss, torch.nn.MSELoss()(pair[pairs], batch["pair_labels"][pairs]))
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
    batch = P.PretrainCollator(P.MaskingSection(), torch.Generator().manual_seed(0))([val[i] for i in range(len(val))])
    with torch.no_grad(), torch.random.fork_rng():
        with_heads = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
        with_heads.load_state_dict(trained)
        trained_loss = float(P.pretraining_losses(with_heads, batch)[0])
        for seed in range(3):
            torch.manual_seed(seed)
            untrained = domainfm.create_model("stofm-test", n_outputs=None, pretrain_heads=True).eval()
            assert trained_loss < float(P.pretraining_losses(untrained, batch)[0]) - 0.05, seed
    assert trained_loss < 0.95
