"""domainfm.experiment.robust against hand computations: FLOW weights and loss, WiSE interpolation
(endpoints exact; LoRA scaling = interpolating merged weights), DaWin's lambda, the Beta mixture,
and SupervisedRecipe.per_sample_loss / logits."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domainfm import lora
from domainfm.experiment import robust as R
from domainfm.lora.inject import wrappers
from domainfm.experiment.supervised import LoraSettings, SupervisedRecipe, prepare_mode


def test_flow_weights_median_temperature_by_hand():
    losses = torch.tensor([0.2, 1.0, 0.6, 3.0])
    tau = (0.6 + 1.0) / 2  # median of an even count: mean of the two middle values
    w = R.flow_weights(losses)
    expected = [math.exp(-0.2 / tau), math.exp(-1.0 / tau), math.exp(-0.6 / tau), math.exp(-3.0 / tau)]
    assert w.tolist() == pytest.approx(expected, rel=1e-6)
    # odd count: the middle value; an explicit temperature overrides the median
    assert R.flow_weights([1.0, 2.0, 9.0]).tolist() == pytest.approx([math.exp(-0.5), math.exp(-1), math.exp(-4.5)], rel=1e-6)
    assert R.flow_weights([1.0, 2.0], temperature=0.5).tolist() == pytest.approx([math.exp(-2), math.exp(-4)], rel=1e-6)
    # easy samples (low pretrained loss) weigh more
    assert w[0] > w[2] > w[1] > w[3]
    with pytest.raises(ValueError, match="temperature"):
        R.flow_weights([1.0], temperature=0.0)
    with pytest.raises(ValueError, match="median pretrained loss is 0"):
        R.flow_weights([0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="loss 1 is nan"):
        R.flow_weights([1.0, float("nan")])


def test_flow_loss_is_the_unnormalised_weighted_mean():
    losses = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    w = torch.tensor([0.5, 0.25, 0.1])
    loss = R.flow_loss(losses, w)
    assert float(loss.detach()) == pytest.approx((0.5 * 1 + 0.25 * 2 + 0.1 * 4) / 3)  # not divided by sum(w)
    loss.backward()
    assert losses.grad.tolist() == pytest.approx([0.5 / 3, 0.25 / 3, 0.1 / 3])
    with pytest.raises(ValueError, match="2 weights for 3 losses"):
        R.flow_loss(losses, w[:2])


def _mlp(seed=0, k=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, k))


def test_interpolate_by_hand_and_integer_buffers_from_fine_tuned():
    pre = {"w": torch.tensor([0.0, 2.0]), "n": torch.tensor(3)}
    ft = {"w": torch.tensor([4.0, 6.0]), "n": torch.tensor(7)}
    mid = R.interpolate(pre, ft, 0.25)
    assert mid["w"].tolist() == [1.0, 3.0] and int(mid["n"]) == 7
    with pytest.raises(KeyError, match="'extra'"):
        R.interpolate(pre, {**ft, "extra": torch.zeros(1)}, 0.5)
    with pytest.raises(ValueError, match="'w' has shape"):
        R.interpolate(pre, {**ft, "w": torch.zeros(3)}, 0.5)


def test_wise_endpoints_give_the_two_models_outputs_exactly():
    pre, ft = _mlp(0).eval(), _mlp(1).eval()
    x = torch.randn(16, 4)
    model = copy.deepcopy(ft)
    interp = R.StateInterpolator(model, pre.state_dict())
    with torch.no_grad():
        assert torch.equal(interp.set(0.0)(x), pre(x))
        assert torch.equal(interp.set(1.0)(x), ft(x))
        half = interp.set(0.5)(x)
        assert not torch.equal(half, pre(x)) and not torch.equal(half, ft(x))
        assert torch.equal(interp.restore()(x), ft(x))
    # parameters really are the average at 0.5
    interp.set(0.5)
    torch.testing.assert_close(model[0].weight, (pre[0].weight + ft[0].weight) / 2)


@pytest.mark.parametrize("variant", ["lora", "replora"])
def test_lora_scaling_equals_interpolating_merged_weights(variant):
    torch.manual_seed(0)
    model = _mlp(2)
    model[1].eval()
    head_before = {k: v.clone() for k, v in model.named_parameters() if k.startswith("3.")}
    prepare_mode(model, "lora", head="3", lora=LoraSettings(targets=["0"], rank=2, alpha=4.0, variant=variant))
    # a "fine-tuned" adapter and head: random non-zero values
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    model.eval()
    x = torch.randn(10, 4)
    with torch.no_grad():
        ft_out = model(x)
    # reference: merged weights of the pretrained side (base + probe head) and fine-tuned side
    pre_model = copy.deepcopy(model)
    for layer in wrappers(pre_model).values():
        layer.scaling = 0.0
    with torch.no_grad():
        for k, v in head_before.items():
            dict(pre_model.named_parameters())[k].copy_(v)
    lora.merge(pre_model, unload=True)
    ft_model = copy.deepcopy(model)
    lora.merge(ft_model, unload=True)
    interp = R.LoraInterpolator(model, head_before)
    for alpha in (0.0, 0.3, 0.75, 1.0):
        reference = copy.deepcopy(ft_model)
        reference.load_state_dict(R.interpolate(pre_model.state_dict(), ft_model.state_dict(), alpha))
        with torch.no_grad():
            got, want = interp.set(alpha)(x), reference(x)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        assert torch.equal(interp.restore()(x), ft_out)
        # alpha = 0: no adapter contribution and the probe head: the pretrained model's outputs
        assert torch.allclose(interp.set(0.0)(x), pre_model(x), atol=1e-6)


def test_lora_interpolator_refuses_dora_and_merged_adapters():
    model = _mlp(3)
    prepare_mode(model, "lora", head="3", lora=LoraSettings(targets=["0"], rank=2, variant="dora"))
    with pytest.raises(ValueError, match="DoRA"):
        R.LoraInterpolator(model, {})
    model = _mlp(3)
    prepare_mode(model, "lora", head="3", lora=LoraSettings(targets=["0"], rank=2))
    lora.merge(model)
    with pytest.raises(ValueError, match="merged"):
        R.LoraInterpolator(model, {})


def test_dawin_lambda_by_hand():
    pre = torch.tensor([[0.0, 0.0], [5.0, 0.0], [0.0, 0.0]])
    ft = torch.tensor([[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]])

    def H(z):
        p = np.exp(z - np.max(z)) / np.exp(z - np.max(z)).sum()
        return -(p * np.log(p)).sum()

    expected = [math.exp(-H(f)) / (math.exp(-H(p)) + math.exp(-H(f))) for p, f in zip(pre.numpy(), ft.numpy())]
    lam = R.dawin_lambda(pre, ft)
    assert lam.tolist() == pytest.approx(expected, rel=1e-6)
    assert lam[0] > 0.5 > lam[1] and lam[2] == pytest.approx(0.5)  # the confident model gets the weight
    # binary: one logit each, sigmoid entropy
    z_pre, z_ft = torch.tensor([0.0, 2.0]), torch.tensor([1.0, -4.0])

    def Hb(z):
        p = 1 / (1 + math.exp(-z))
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    want = [math.exp(-Hb(f)) / (math.exp(-Hb(p)) + math.exp(-Hb(f))) for p, f in zip(z_pre.tolist(), z_ft.tolist())]
    assert R.dawin_lambda(z_pre, z_ft.reshape(-1, 1)).tolist() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="3 pretrained predictions but 2"):
        R.dawin_lambda(pre, ft[:2])


def test_beta_mixture_recovers_the_components_of_a_synthetic_mixture():
    rng = np.random.default_rng(0)
    truth = [(0.2, 2.0, 18.0), (0.5, 30.0, 30.0), (0.3, 20.0, 4.0)]  # weight, alpha, beta
    n = 6000
    counts = [int(w * n) for w, _, _ in truth]
    values = np.concatenate([rng.beta(a, b, c) for (_, a, b), c in zip(truth, counts)])
    labels = np.concatenate([np.full(c, i) for i, c in enumerate(counts)])
    fit = R.fit_beta_mixture(values, k=3, seed=0)
    assert fit.converged
    np.testing.assert_allclose(fit.weights, [0.2, 0.5, 0.3], atol=0.03)
    np.testing.assert_allclose(fit.means, [a / (a + b) for _, a, b in truth], atol=0.01)
    np.testing.assert_allclose(fit.alphas, [a for _, a, _ in truth], rtol=0.2)
    np.testing.assert_allclose(fit.betas, [b for _, _, b in truth], rtol=0.2)
    assert (fit.assignment == labels).mean() > 0.97
    assert np.array_equal(fit.predict(values), fit.assignment)
    summary = fit.to_dict()
    assert [c["n"] for c in summary["components"]] == np.bincount(fit.assignment).tolist()
    # fewer distinct values than components: k shrinks instead of failing
    assert len(R.fit_beta_mixture([0.3] * 5 + [0.7] * 5, k=3).weights) == 2


def test_supervised_per_sample_loss_and_logits():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    recipe = SupervisedRecipe(model, None, task="multiclass", label_smoothing=0.1)
    per = recipe.per_sample_loss(model, (x, y))
    assert per.shape == (6,)
    torch.testing.assert_close(per, F.cross_entropy(model(x), y, label_smoothing=0.1, reduction="none"))
    torch.testing.assert_close(per.mean(), recipe.step(model, (x, y))[0])
    assert torch.equal(recipe.logits(model, (x, y)), model(x))
    bin_model = nn.Linear(4, 1)
    yb = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    recipe = SupervisedRecipe(bin_model, None, task="binary")
    per = recipe.per_sample_loss(bin_model, (x, yb))
    z = bin_model(x).reshape(-1)
    manual = -(yb * torch.log(torch.sigmoid(z)) + (1 - yb) * torch.log(1 - torch.sigmoid(z)))
    torch.testing.assert_close(per, manual)
    assert recipe.logits(bin_model, (x, yb)).shape == (6,)


def test_flow_recipe_weights_each_batch_by_its_samples():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    inner = SupervisedRecipe(model, torch.utils.data.TensorDataset(x, y), task="multiclass")
    w = torch.linspace(0.1, 1.0, 8)
    recipe = R.FlowRecipe(inner, w, family="toy")
    items = [recipe.train_dataset[i] for i in (5, 2, 7)]
    batch = recipe.collate_fn(items)
    loss, _ = recipe.step(model, batch)
    manual = (w[[5, 2, 7]] * F.cross_entropy(model(x[[5, 2, 7]]), y[[5, 2, 7]], reduction="none")).mean()
    torch.testing.assert_close(loss, manual)
    assert recipe.model is model and recipe.val_dataset is None
    assert recipe.eval_collate_fn is torch.utils.data.default_collate

    class NoLoss:
        train_dataset, collate_fn = torch.utils.data.TensorDataset(x, y), None

    with pytest.raises(TypeError, match="family 'toy'.*NoLoss.*per_sample_loss"):
        R.FlowRecipe(NoLoss(), w, family="toy")


class _RowsDataset(torch.utils.data.Dataset):
    """Items holding several predictions each (like SToFM's sub-slices of cells)."""

    def __init__(self, n_items=40, d=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n_items):
            k = int(torch.randint(0 if i == 3 else 1, 5, (1,), generator=g))  # item 3 may hold no rows
            x = torch.randn(k, d, generator=g)
            self.items.append((x, (x[:, 0] > 0).long()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _rows_collate(items):
    return (torch.cat([x for x, _ in items]), torch.tensor([len(x) for x, _ in items])), torch.cat([y for _, y in items])


class _RowsRecipe:
    def __init__(self, model):
        self.model, self.collate_fn, self.eval_collate_fn, self.val_dataset = model, _rows_collate, _rows_collate, None

    def logits(self, model, batch):
        (x, _), _ = batch
        return model(x)

    def logits_per_item(self, batch):
        (_, counts), _ = batch
        return counts

    def eval_step(self, model, batch):
        (x, _), y = batch
        return {"scores": model(x).float(), "target": y}

    def metrics(self, outputs):
        return {"accuracy": float((outputs["scores"].argmax(-1) == outputs["target"]).float().mean()),
                "n": float(len(outputs["target"]))}


def test_dawin_on_items_with_several_predictions_matches_a_direct_computation():
    """DaWin where one dataset item carries several predictions (SToFM's sub-slices): an item's
    lambda is the mean of its rows' lambdas, the mixture is fitted on items (empty items left out),
    each component's merged model predicts its items' rows; compared with a direct computation."""
    from domainfm.engine import TrainConfig, Trainer

    torch.manual_seed(0)
    pre_model, ft_model = torch.nn.Linear(5, 2), torch.nn.Linear(5, 2)
    data = _RowsDataset()
    interp = R.StateInterpolator(ft_model, pre_model.state_dict())
    trainer = Trainer(TrainConfig(batch_size=7, accelerator="cpu", precision="32-true", progress=False))
    res = R.dawin_scores(trainer, _RowsRecipe(ft_model), data, interp, components=2, seed=0)

    counts = torch.tensor([len(x) for x, _ in data.items])
    x = torch.cat([x for x, _ in data.items])
    y = torch.cat([y for _, y in data.items])
    with torch.no_grad():
        lam_rows = R.dawin_lambda(pre_model(x), ft_model(x))
    owner = torch.repeat_interleave(torch.arange(len(data)), counts)
    valid = counts > 0
    lam_items = torch.stack([lam_rows[owner == i].mean() for i in range(len(data)) if valid[i]])
    mixture = R.fit_beta_mixture(lam_items.numpy(), k=2, seed=0)
    item_component = torch.full((len(data),), -1)
    item_component[valid] = torch.as_tensor(mixture.assignment)
    correct = 0
    for c, mean in enumerate(mixture.means):
        rows = item_component[owner] == c
        w = {k: (1 - mean) * pre_model.state_dict()[k] + mean * ft_model.state_dict()[k] for k in ("weight", "bias")}
        pred = (x[rows] @ w["weight"].T + w["bias"]).argmax(-1)
        correct += int((pred == y[rows]).sum())
    assert res["metrics"]["n"] == len(y)
    assert res["metrics"]["accuracy"] == pytest.approx(correct / len(y), abs=1e-6)  # float32 mean
    assert res["lambda_mean"] == pytest.approx(float(lam_items.mean()), abs=1e-6)
    # the interpolator is back at the fine-tuned weights
    assert torch.equal(ft_model.weight, interp.finetuned["weight"])
