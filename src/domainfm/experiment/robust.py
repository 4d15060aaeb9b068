"""Fine-tuning that keeps what pretraining taught: FLOW sample weighting, WiSE-FT and DaWin weight
interpolation, and the picture of target metric against retained capability.

- **FLOW** (Sanyal et al., ICML 2025, "Upweighting Easy Samples in Fine-Tuning Mitigates
  Forgetting"): :func:`flow_weights` gives :math:`w_i = e^{-\\ell_i/\\tau}` from the *pretrained*
  model's per-sample loss :math:`\\ell_i` (``tau`` = the median of those losses unless given), and
  :func:`flow_loss` the training loss :math:`\\frac1B\\sum_i w_i\\,\\ell_i^{ft}` with no
  renormalisation of the weights (as the official ``torch.mean(weights * losses)``).
- **WiSE-FT** (Wortsman et al., CVPR 2022): :func:`interpolate` gives
  :math:`\\theta(\\alpha) = (1-\\alpha)\\,\\theta_{pre} + \\alpha\\,\\theta_{ft}` per floating tensor;
  :class:`StateInterpolator` / :class:`LoraInterpolator` move a live model along it (with LoRA,
  :math:`\\theta(\\alpha)` is the base weight plus :math:`\\alpha` times the adapter's delta: the
  adapter's ``scaling`` is multiplied by :math:`\\alpha`, exact and without a second copy of the backbone).
- **DaWin** (Oh et al., ICLR 2025): :func:`dawin_lambda` gives the per-sample coefficient
  :math:`\\lambda(x) = e^{-H_{ft}(x)} / (e^{-H_{pre}(x)} + e^{-H_{ft}(x)})` from the softmax
  entropies of the two models; :func:`fit_beta_mixture` fits a Beta mixture to those values
  (k-means initialisation, EM with a responsibility-weighted method-of-moments M-step, as the
  official ``dawin_rft/mixturemodel.py``), so that one merge per component replaces one per sample.
  The official scripts add an optional "offset adjustment" to :math:`\\lambda`; the issue names the
  plain ratio, which is what is computed here.
- :func:`plot_tradeoff`: target metric against retained capability for every arm of a report and
  along each WiSE curve.

Recipe contract (what the experiment layer calls on a family's recipe):

- FLOW: ``recipe.per_sample_loss(model, batch) -> Tensor[B]``, the *unreduced* training loss of
  each sample of a training batch (a batch as ``recipe.collate_fn`` builds it), such that its mean
  is what ``recipe.step`` minimises. The shared ``SupervisedRecipe`` implements it; a family
  recipe without it makes ``adapt.sample_weighting=flow`` a ``TypeError`` naming the family, the
  recipe and the method. The weights are computed once, in dataset order over ``task.train``
  (:func:`per_sample_losses`), and each batch carries its samples' weights
  (:class:`WeightedDataset` + :func:`weighted_collate`); :class:`FlowRecipe` multiplies.
- DaWin: ``recipe.logits(model, batch) -> Tensor[B, K]`` (or ``Tensor[B]`` for one binary
  logit) on an evaluation batch, and ``recipe.eval_step`` outputs whose first axis is the batch
  (they are reassembled in dataset order before ``recipe.metrics``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

__all__ = [
    "flow_weights", "flow_loss", "interpolate", "softmax_entropy", "dawin_lambda", "BetaMixture", "fit_beta_mixture",
    "StateInterpolator", "LoraInterpolator", "WeightedDataset", "weighted_collate", "FlowRecipe", "plot_tradeoff",
]


# --------------------------------------------------------------------------- FLOW


def flow_weights(pretrained_losses, temperature: float | None = None) -> torch.Tensor:
    """FLOW's sample weights :math:`w_i = \\exp(-\\ell_i / \\tau)`.

    Args:
        pretrained_losses: ``(N,)`` per-sample losses of the *pretrained* model on the
            fine-tuning set (for a classifier, of a linear probe on the frozen backbone).
        temperature: :math:`\\tau`; ``None`` = the median of the losses (``np.median``: the mean of
            the two middle values for an even count, as the official ``get_dataset_temperature``).

    Returns:
        ``(N,)`` float tensor of weights in ``(0, exp(max(-l)/tau)]``; not renormalised.
    """
    losses = torch.as_tensor(pretrained_losses).detach().double().reshape(-1)
    if losses.numel() == 0:
        raise ValueError("flow_weights: no losses given")
    if not torch.isfinite(losses).all():
        bad = int((~torch.isfinite(losses)).nonzero()[0])
        raise ValueError(f"flow_weights: pretrained loss {bad} is {float(losses[bad])}; expected finite losses")
    if temperature is None:
        temperature = float(np.median(losses.numpy()))
        if temperature <= 0:
            raise ValueError(f"flow_weights: the median pretrained loss is {temperature}, so tau cannot be the median; "
                             "give adapt.flow_temperature > 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"flow_weights: temperature={temperature!r}; expected a finite number > 0")
    return torch.exp(-losses / float(temperature)).float()


def flow_loss(per_sample_losses: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """FLOW's training loss :math:`\\mathrm{mean}_i(w_i\\,\\ell_i)` (no renormalisation of ``w``)."""
    if per_sample_losses.ndim != 1:
        raise ValueError(f"flow_loss: per-sample losses must be 1-D (B,), got shape {tuple(per_sample_losses.shape)}")
    weights = torch.as_tensor(weights, device=per_sample_losses.device).reshape(-1)
    if weights.shape != per_sample_losses.shape:
        raise ValueError(f"flow_loss: {weights.numel()} weights for {per_sample_losses.numel()} losses")
    return (weights.to(per_sample_losses.dtype) * per_sample_losses).mean()


class WeightedDataset(torch.utils.data.Dataset):
    """``dataset[i]`` paired with ``weights[i]``: ``(item, w_i)``."""

    def __init__(self, dataset, weights: torch.Tensor):
        if len(dataset) != len(weights):
            raise ValueError(f"WeightedDataset: {len(weights)} weights for a dataset of {len(dataset)} items")
        self.dataset, self.weights = dataset, torch.as_tensor(weights, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i], self.weights[i]


def weighted_collate(collate_fn=None):
    """A collate for :class:`WeightedDataset` items: ``(collate_fn(items), weights (B,))``."""
    inner = collate_fn or torch.utils.data.default_collate

    def collate(items):
        return inner([item for item, _ in items]), torch.stack([w for _, w in items])

    return collate


def _default_collate():
    return torch.utils.data.default_collate


class FlowRecipe:
    """Wraps a recipe so that its training step is :func:`flow_loss` of ``recipe.per_sample_loss``
    with each sample's weight carried by its batch (:class:`WeightedDataset`); evaluation, metrics,
    parameter groups and hooks are the wrapped recipe's. The engine is unchanged."""

    def __init__(self, recipe, weights: torch.Tensor, family: str = "?"):
        require_per_sample_loss(recipe, family)
        self.inner = recipe
        self.train_dataset = WeightedDataset(recipe.train_dataset, weights)
        self.collate_fn = weighted_collate(recipe.collate_fn)

    # what the engine reads, delegated
    model = property(lambda self: self.inner.model, lambda self, m: setattr(self.inner, "model", m))
    val_dataset = property(lambda self: self.inner.val_dataset)
    eval_collate_fn = property(lambda self: self.inner.eval_collate_fn or self.inner.collate_fn or _default_collate())

    def step(self, model, batch):
        inner_batch, weights = batch
        loss = flow_loss(self.inner.per_sample_loss(model, inner_batch).float(), weights)
        return loss, {"loss": loss.detach()}

    def eval_step(self, model, batch):
        return self.inner.eval_step(model, batch)

    def metrics(self, outputs):
        return self.inner.metrics(outputs)

    def param_groups(self, model, config):
        return self.inner.param_groups(model, config)

    def before_optimizer_step(self, optimizer, step, total_steps):
        return self.inner.before_optimizer_step(optimizer, step, total_steps)

    def on_train_step_end(self, model, step, total_steps):
        return self.inner.on_train_step_end(model, step, total_steps)


def require_per_sample_loss(recipe, family: str) -> None:
    if not callable(getattr(recipe, "per_sample_loss", None)):
        raise TypeError(
            f"adapt.sample_weighting=flow: family {family!r} uses recipe {type(recipe).__name__}, which has no "
            "per_sample_loss(model, batch) -> Tensor[B] (the unreduced training loss) that FLOW weights")


# --------------------------------------------------------------------------- WiSE-FT


def interpolate(pretrained_state: Mapping[str, torch.Tensor], finetuned_state: Mapping[str, torch.Tensor],
                alpha: float) -> dict[str, torch.Tensor]:
    """:math:`\\theta(\\alpha) = (1-\\alpha)\\theta_{pre} + \\alpha\\theta_{ft}` for every floating tensor
    (computed in fp32 or wider, cast back); integer/bool buffers (step counters) come from the
    fine-tuned side. ``alpha = 0`` returns the pretrained tensors and ``alpha = 1`` the fine-tuned
    ones bit-exactly. Keys or shapes that differ are an error naming the key."""
    alpha = float(alpha)
    if not math.isfinite(alpha):
        raise ValueError(f"interpolate: alpha={alpha}; expected a finite number")
    missing = sorted(set(finetuned_state) - set(pretrained_state))
    extra = sorted(set(pretrained_state) - set(finetuned_state))
    if missing or extra:
        key = (missing or extra)[0]
        side = "the pretrained" if missing else "the fine-tuned"
        raise KeyError(f"interpolate: key {key!r} is missing from {side} state "
                       f"({len(missing)} missing from pretrained, {len(extra)} missing from fine-tuned)")
    out = {}
    for key, ft in finetuned_state.items():
        pre = pretrained_state[key]
        if pre.shape != ft.shape:
            raise ValueError(f"interpolate: {key!r} has shape {tuple(pre.shape)} (pretrained) but "
                             f"{tuple(ft.shape)} (fine-tuned)")
        if not ft.is_floating_point():
            out[key] = ft.clone()
        elif alpha == 0.0:
            out[key] = pre.to(ft.dtype).clone()
        elif alpha == 1.0:
            out[key] = ft.clone()
        else:
            compute = torch.promote_types(ft.dtype, torch.float32)
            mixed = (1.0 - alpha) * pre.to(device=ft.device, dtype=compute) + alpha * ft.to(compute)
            out[key] = mixed.to(ft.dtype)
    return out


class StateInterpolator:
    """Moves ``model`` along :math:`\\theta(\\alpha)` between a pretrained state and the model's own
    (fine-tuned) state, loaded in place; :meth:`restore` puts the fine-tuned weights back."""

    def __init__(self, model: nn.Module, pretrained_state: Mapping[str, torch.Tensor]):
        self.model = model
        self.finetuned = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.pretrained = {k: v.detach().to(self.finetuned[k].device) for k, v in pretrained_state.items()
                           if k in self.finetuned}
        unknown = sorted(set(self.finetuned) - set(self.pretrained))
        if unknown:
            raise KeyError(f"StateInterpolator: the pretrained state has no {unknown[0]!r} ({len(unknown)} keys missing)")

    @torch.no_grad()
    def set(self, alpha: float) -> nn.Module:
        self.model.load_state_dict(interpolate(self.pretrained, self.finetuned, alpha))
        return self.model

    def restore(self) -> nn.Module:
        return self.set(1.0)


class LoraInterpolator:
    """WiSE-FT of a model fine-tuned with (unmerged) LoRA adapters: each adapter's ``scaling`` becomes
    ``alpha * scaling`` (the base weight plus ``alpha`` times its delta, which *is*
    :math:`(1-\\alpha)W + \\alpha(W + \\Delta)`), and parameters trained in full beside the adapters
    (the head, ``lora.unfreeze``) are interpolated from ``pretrained_params`` (their values before
    training). No copy of the backbone is made.

    The delta is linear in ``scaling`` for LoRA and RepLoRA (whose factors do not depend on it);
    DoRA renormalises the merged weight, so it is refused here (use :class:`StateInterpolator` on
    the merged weights)."""

    def __init__(self, model: nn.Module, pretrained_params: Mapping[str, torch.Tensor]):
        from domainfm.lora.inject import wrappers

        self.model = model
        self.layers = wrappers(model)
        if not self.layers:
            raise ValueError("LoraInterpolator: the model has no LoRA adapters")
        nonlinear = [n for n, w in self.layers.items() if w.variant == "dora"]
        if nonlinear:
            raise ValueError(f"LoraInterpolator: {nonlinear[0]} is a DoRA adapter, whose merged weight is not linear "
                             "in its delta; interpolate the merged weights instead")
        merged = [n for n, w in self.layers.items() if w.merged]
        if merged:
            raise ValueError(f"LoraInterpolator: adapter {merged[0]} is merged; interpolate before lora.merge")
        self.scales = {n: w.scaling for n, w in self.layers.items()}
        params = dict(model.named_parameters())
        unknown = sorted(set(pretrained_params) - set(params))
        if unknown:
            raise KeyError(f"LoraInterpolator: the model has no parameter {unknown[0]!r}")
        self.pretrained = {k: v.detach().clone() for k, v in pretrained_params.items()}
        self.finetuned = {k: params[k].detach().clone() for k in pretrained_params}

    @torch.no_grad()
    def set(self, alpha: float) -> nn.Module:
        alpha = float(alpha)
        for name, layer in self.layers.items():
            layer.scaling = self.scales[name] * alpha if alpha != 1.0 else self.scales[name]
        params = dict(self.model.named_parameters())
        for key, value in interpolate(self.pretrained, self.finetuned, alpha).items():
            params[key].copy_(value)
        return self.model

    def restore(self) -> nn.Module:
        return self.set(1.0)


# --------------------------------------------------------------------------- DaWin


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the prediction of each row: softmax over the last axis of ``(N, K)``
    logits; a binary model's single logit (``(N,)`` or ``(N, 1)``) is read through the sigmoid."""
    logits = torch.as_tensor(logits).detach().double()
    if logits.ndim == 1 or logits.shape[-1] == 1:
        z = logits.reshape(-1)
        p = torch.sigmoid(z)
        # H = -p log p - (1-p) log(1-p), with log-sigmoids for stability
        return -(p * torch.nn.functional.logsigmoid(z) + (1 - p) * torch.nn.functional.logsigmoid(-z))
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def dawin_lambda(pretrained_logits: torch.Tensor, finetuned_logits: torch.Tensor) -> torch.Tensor:
    """DaWin's per-sample coefficient :math:`\\lambda = e^{-H_{ft}} / (e^{-H_{pre}} + e^{-H_{ft}})`
    (weight of the fine-tuned model; ``(N,)``, in (0, 1)), computed as a sigmoid of the entropy
    difference :math:`H_{pre} - H_{ft}`, which is the same ratio."""
    h_pre, h_ft = softmax_entropy(pretrained_logits), softmax_entropy(finetuned_logits)
    if h_pre.shape != h_ft.shape:
        raise ValueError(f"dawin_lambda: {h_pre.numel()} pretrained predictions but {h_ft.numel()} fine-tuned ones")
    return torch.sigmoid(h_pre - h_ft).float()


@dataclass
class BetaMixture:
    """A fitted mixture of Beta distributions on (0, 1).

    ``weights`` (k,), ``alphas`` (k,), ``betas`` (k,), ``means`` = alpha / (alpha + beta) (the
    coefficient each component merges with), ``assignment`` (N,) the most probable component of
    each fitted value, ``log_likelihood`` the mean log-likelihood, ``converged``."""

    weights: np.ndarray
    alphas: np.ndarray
    betas: np.ndarray
    assignment: np.ndarray
    log_likelihood: float
    converged: bool

    @property
    def means(self) -> np.ndarray:
        return self.alphas / (self.alphas + self.betas)

    def log_prob(self, values) -> np.ndarray:
        """``(N, k)`` log p(x | component) + log weight."""
        from scipy.special import betaln

        x = _clip01(values)[:, None]
        a, b = self.alphas[None], self.betas[None]
        return (a - 1) * np.log(x) + (b - 1) * np.log1p(-x) - betaln(a, b) + np.log(self.weights)[None]

    def predict(self, values) -> np.ndarray:
        return np.argmax(self.log_prob(values), axis=1)

    def to_dict(self) -> dict[str, Any]:
        counts = np.bincount(self.assignment, minlength=len(self.weights))
        return {"components": [{"weight": float(w), "alpha": float(a), "beta": float(b), "mean": float(m), "n": int(n)}
                               for w, a, b, m, n in zip(self.weights, self.alphas, self.betas, self.means, counts)],
                "log_likelihood": float(self.log_likelihood), "converged": bool(self.converged)}


_EPS = 1e-6


def _clip01(values) -> np.ndarray:
    x = np.asarray(torch.as_tensor(values).detach().double().reshape(-1).cpu().numpy() if isinstance(values, torch.Tensor)
                   else values, dtype=np.float64).reshape(-1)
    return np.clip(x, _EPS, 1 - _EPS)


def _moments(x: np.ndarray, resp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted method-of-moments M-step: mixture weights and Beta (alpha, beta) per component from
    the responsibility-weighted mean and variance (variance capped at mean(1-mean)/4, so that
    alpha, beta stay >= 1-ish and finite, as the official M-step)."""
    counts = resp.sum(0) + 10 * np.finfo(np.float64).eps
    weights = counts / counts.sum()
    mean = (resp * x[:, None]).sum(0) / counts
    var = (resp * x[:, None] ** 2).sum(0) / counts - mean ** 2
    var = np.minimum(var, mean * (1 - mean) / 4) + 10 * np.finfo(np.float64).eps
    common = mean * (1 - mean) / (var + 1e-10) - 1
    return weights, common * mean, common * (1 - mean)


def fit_beta_mixture(values, k: int = 3, *, n_init: int = 3, max_iter: int = 1000, tol: float = 1e-4,
                     seed: int = 0) -> BetaMixture:
    """Fit a ``k``-component Beta mixture to values in (0, 1) by EM.

    Each of ``n_init`` starts takes hard responsibilities from k-means (``random_state = seed +
    start``), then alternates the E-step (posterior responsibilities) and a responsibility-weighted
    method-of-moments M-step until the mean log-likelihood changes by less than ``tol``; the start
    with the highest log-likelihood wins. Values are clipped to ``[1e-6, 1 - 1e-6]``. With fewer
    distinct values than ``k``, ``k`` is reduced to their number.
    """
    from scipy.special import logsumexp
    from sklearn.cluster import KMeans

    x = _clip01(values)
    if x.size == 0:
        raise ValueError("fit_beta_mixture: no values")
    if not np.isfinite(x).all():
        raise ValueError("fit_beta_mixture: values must be finite")
    if k < 1:
        raise ValueError(f"fit_beta_mixture: k={k}; expected >= 1")
    k = min(k, len(np.unique(x)))
    best: BetaMixture | None = None
    for start in range(n_init):
        labels = KMeans(n_clusters=k, n_init=1, random_state=seed + start).fit(x[:, None]).labels_
        resp = np.zeros((x.size, k))
        resp[np.arange(x.size), labels] = 1
        resp += 10 * np.finfo(np.float64).eps
        weights, alphas, betas = _moments(x, resp)
        ll, converged = -np.inf, False
        for _ in range(max_iter):
            fit = BetaMixture(weights, alphas, betas, labels, ll, converged)
            joint = fit.log_prob(x)
            norm = logsumexp(joint, axis=1)
            resp = np.exp(joint - norm[:, None])
            weights, alphas, betas = _moments(x, resp)
            previous, ll = ll, float(norm.mean())
            if abs(ll - previous) < tol:
                converged = True
                break
        fit = BetaMixture(weights, alphas, betas, labels, ll, converged)
        fit.assignment = fit.predict(x)
        if best is None or ll > best.log_likelihood:
            best = fit
    # components in increasing order of their mean (component 0 leans to the pretrained model)
    order = np.argsort(best.means)
    remap = np.empty_like(order)
    remap[order] = np.arange(k)
    return BetaMixture(best.weights[order], best.alphas[order], best.betas[order], remap[best.assignment],
                       best.log_likelihood, best.converged)


# --------------------------------------------------------------------------- picture


def plot_tradeoff(points: Sequence[Mapping[str, Any]], curves: Mapping[str, Sequence[Mapping[str, Any]]],
                  path: str | Path, *, target: str, retained: str, title: str = "",
                  retained_before: float | None = None) -> Path:
    """Target metric (x) against retained capability (y): one marker per arm (``points``: dicts
    with ``arm``, ``target``, ``retained``) and one line per WiSE curve (``curves``: arm ->
    [{``alpha``, ``target``, ``retained``}], each point labelled with its alpha, in the colour of
    its arm's marker); ``retained_before``: the pretrained model's value, a dashed line. Written
    atomically as PNG (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    from domainfm.atomic import atomic_path

    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.add_subplot()
    palette = [f"C{i}" for i in range(10)]
    colours = {p["arm"]: palette[i % 10] for i, p in enumerate(points)}
    for name in curves:
        colours.setdefault(name, palette[len(colours) % 10])
    for name, curve in curves.items():
        pts = [(p["target"], p["retained"], p["alpha"]) for p in curve
               if _finite(p.get("target")) and _finite(p.get("retained"))]
        if not pts:
            continue
        xs, ys, alphas = zip(*pts)
        ax.plot(xs, ys, "-", color=colours[name], alpha=0.6, label=f"{name} WiSE (alpha marked)")
        for x, y, a in pts:
            ax.annotate(f"{a:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7, color=colours[name])
    markers = "osD^vP*Xh<>"
    for i, p in enumerate(points):
        if _finite(p.get("target")) and _finite(p.get("retained")):
            ax.scatter([p["target"]], [p["retained"]], marker=markers[i % len(markers)], s=50, label=p["arm"],
                       color=colours[p["arm"]], zorder=3)
    if _finite(retained_before):
        ax.axhline(float(retained_before), color="grey", linestyle="--", linewidth=1, label="pretrained, before fine-tuning")
    ax.set_xlabel(f"target: {target}")
    ax.set_ylabel(f"retained: {retained}")
    ax.set_title(title or "target metric vs retained capability")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(str(tmp), format="png", dpi=110)
    return path


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) and math.isfinite(float(v))


# --------------------------------------------------------------------------- outputs through the engine


class _Capture:
    """A recipe whose evaluation step is ``fn(model, batch) -> {name: Tensor[B, ...]}`` and whose
    ``metrics`` keeps the gathered outputs (``self.outputs``): lets :meth:`Trainer.evaluate` do the
    device placement, autocast, ordering and gathering across processes."""

    def __init__(self, recipe, fn, collate_fn):
        self.model, self.val_dataset = recipe.model, None
        self.collate_fn = self.eval_collate_fn = collate_fn or _default_collate()
        self.fn, self.outputs = fn, {}

    def eval_step(self, model, batch):
        return self.fn(model, batch)

    def metrics(self, outputs):
        self.outputs = outputs
        return {}


def collect(trainer, recipe, dataset, model: nn.Module, fn, *, training_batches: bool = False) -> dict[str, torch.Tensor]:
    """``fn(model, batch)`` over ``dataset`` in order (no shuffling, no dropped batch), through
    ``trainer.evaluate``; returns the outputs concatenated over batches. ``training_batches``:
    batches built with the recipe's training collate (what ``per_sample_loss`` takes) instead of
    its evaluation collate."""
    collate = recipe.collate_fn if training_batches else (recipe.eval_collate_fn or recipe.collate_fn)
    capture = _Capture(recipe, fn, collate)
    trainer.evaluate(capture, dataset, model=model)
    return capture.outputs


def per_sample_losses(trainer, recipe, dataset, model: nn.Module, family: str = "?") -> torch.Tensor:
    """``recipe.per_sample_loss`` of every item of ``dataset``, in dataset order: ``(N,)``."""
    require_per_sample_loss(recipe, family)
    out = collect(trainer, recipe, dataset, model, lambda m, b: {"loss": recipe.per_sample_loss(m, b).float()},
                  training_batches=True)["loss"]
    if out.shape != (len(dataset),):
        raise ValueError(f"family {family!r}: {type(recipe).__name__}.per_sample_loss returned {tuple(out.shape)} losses "
                         f"over {len(dataset)} samples; expected one loss per sample (Tensor[B])")
    return out


def dawin_scores(trainer, recipe, dataset, interpolator, *, components: int = 3, seed: int = 0) -> dict[str, Any]:
    """DaWin on one split: lambda from the logits of the pretrained (alpha 0) and fine-tuned
    (alpha 1) ends of ``interpolator``, a Beta mixture on the lambdas, one merge per component (at
    the component's Beta mean, as the official code) predicting its samples, and the recipe's
    metrics of the reassembled outputs. Returns ``{"metrics", "mixture", "lambda_mean"}``; leaves
    the interpolator at alpha 1."""
    logits = lambda m, b: {"logits": recipe.logits(m, b).float()}
    pre = collect(trainer, recipe, dataset, interpolator.set(0.0), logits)["logits"]
    ft = collect(trainer, recipe, dataset, interpolator.set(1.0), logits)["logits"]
    n = len(dataset)
    lam = dawin_lambda(pre, ft)
    valid = np.ones(n, dtype=bool)
    if lam.shape[0] != n:
        # items holding several predictions (SToFM: a sub-slice's cells, which attend to each other,
        # so one item is predicted by one merged model): an item's lambda is the mean of its rows'
        per_item = getattr(recipe, "logits_per_item", None)
        if not callable(per_item):
            raise ValueError(f"{type(recipe).__name__}.logits gave {lam.shape[0]} rows for {n} samples; a recipe whose "
                             "items hold several predictions needs logits_per_item(batch) -> Tensor[B] (rows per item)")
        counts = collect(trainer, recipe, dataset, interpolator.set(1.0),
                         lambda m, b: {"n": torch.as_tensor(per_item(b)).reshape(-1)})["n"].long().cpu()
        if counts.shape != (n,) or int(counts.sum()) != lam.shape[0]:
            raise ValueError(f"{type(recipe).__name__}.logits_per_item: {tuple(counts.shape)} counts summing to "
                             f"{int(counts.sum())}, expected {n} counts summing to {lam.shape[0]} logit rows")
        owner = torch.repeat_interleave(torch.arange(n), counts)
        lam = torch.zeros(n, dtype=lam.dtype).index_add(0, owner, lam) / counts.clamp(min=1).to(lam.dtype)
        valid = counts.numpy() > 0  # an item without predictions plays no part in the mixture
    mixture = fit_beta_mixture(lam.numpy()[valid], k=components, seed=seed)
    assignment = np.full(n, -1)
    assignment[valid] = mixture.assignment
    lam = lam[torch.as_tensor(valid)]
    pieces: list[dict[str, torch.Tensor]] = []
    order = []
    for c, mean in enumerate(mixture.means):
        idx = np.flatnonzero(assignment == c)
        if idx.size == 0:
            continue
        model = interpolator.set(float(mean))
        capture = _Capture(recipe, recipe.eval_step, recipe.eval_collate_fn or recipe.collate_fn)
        trainer.evaluate(capture, torch.utils.data.Subset(dataset, idx.tolist()), model=model)
        pieces.append(capture.outputs)
        order.append(idx)
    interpolator.restore()
    positions = torch.as_tensor(np.concatenate(order))
    m = len(positions)
    inverse = torch.empty(n, dtype=torch.long)
    inverse[positions] = torch.arange(m)
    inverse = inverse[torch.as_tensor(assignment >= 0)]
    outputs = {}
    for key in pieces[0]:
        value = torch.cat([p[key] for p in pieces])
        # per-sample outputs back in dataset order; per-row outputs (several per item) stay grouped
        # by component, the same order for every key, which is all the metrics need
        outputs[key] = value[inverse] if value.shape[0] == m else value
    return {"metrics": {k: float(v) for k, v in recipe.metrics(outputs).items()}, "mixture": mixture.to_dict(),
            "lambda_mean": float(lam.mean())}
