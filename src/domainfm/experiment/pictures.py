"""Pictures of a fine-tuning run, written into the run folder and listed in ``report.json``
(``arms[ARM]["pictures"]`` and ``report["pictures"]``: ``{name: path relative to the run folder}``).

A protocol may return ``{"pictures": {name: path}}``; :class:`~domainfm.experiment.family.Family`
merges those with :func:`arm_pictures`'s.

Every arm (in its own folder, beside its ``metrics.jsonl``):

- ``learning_curve``: the train loss per logged step and the monitored validation metric per
  evaluation against the optimizer step, the selected (best) step marked; arms that trained only.
- ``confusion_matrix`` (``multiclass`` / ``binary`` tasks): on the test set (validation when there
  is none), from the arm's selected model through its recipe's own ``eval_step``.
- ``roc_curve`` (``binary``): the same scores, AUROC in the legend.

The run (:func:`run_pictures`): ``learning_curves``, the monitored metric and the train loss of
every arm that trained (first seed) on one set of axes, when at least two arms trained.

A picture that cannot be drawn (no ``metrics.jsonl``, no evaluation set, a recipe whose
``eval_step`` gives no ``scores``/``target``) is left out, never an error. Figures are drawn on
matplotlib's Agg canvas without pyplot (no global figure registry, no backend switch for the
caller), written atomically, and released after saving.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from domainfm.atomic import atomic_path

__all__ = ["arm_pictures", "run_pictures", "read_metrics", "markdown_section", "fan_figure", "fan_chart"]

DPI = 110


# ----------------------------------------------------------------------------- drawing


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _save(fig, path: Path) -> Path:
    try:
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=DPI)
    finally:
        fig.clf()  # released (no pyplot registry holds it)
    return path


def _rel(path: Path, run_root: Path) -> str:
    try:
        return path.relative_to(run_root).as_posix()
    except ValueError:
        return path.as_posix()


# ----------------------------------------------------------------------------- learning curves


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, val records) of an engine ``metrics.jsonl``; unreadable lines are skipped
    (a line cut by a killed process)."""
    train, val = [], []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if record.get("split") == "train" and _finite(record.get("loss")):
            train.append(record)
        elif record.get("split") == "val":
            val.append(record)
    # a resumed run repeats nothing (the engine cuts the log back), but keep the last record per step
    return _last_per_step(train), _last_per_step(val)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _last_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _metric_key(monitor: str | None) -> str | None:
    return monitor.split("/", 1)[-1] if monitor else None


def learning_curve(metrics_file: Path, out: Path, *, monitor: str | None, best_step: int | None,
                   title: str = "") -> Path | None:
    """Train loss and the monitored validation metric against the step; ``None`` when there is
    nothing to draw."""
    if not Path(metrics_file).is_file():
        return None
    train, val = read_metrics(metrics_file)
    if not train:
        return None
    key = _metric_key(monitor)
    val_points = [(r["step"], r[key]) for r in val if key and _finite(r.get(key))]
    val_loss = [(r["step"], r["loss"]) for r in val if key != "loss" and _finite(r.get("loss"))]
    fig, axes = _figure(9.0 if val_points else 5.0, 3.6, ncols=2 if val_points else 1)
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], "-", color="tab:blue", lw=1.5, label="train loss")
    if val_loss:
        ax.plot(*zip(*val_loss), "o-", color="tab:orange", ms=3, lw=1.2, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if best_step is not None:
        ax.axvline(best_step, color="tab:green", ls="--", lw=1, label=f"best step {best_step}")
    ax.legend(fontsize=8)
    if val_points:
        ax = axes[1]
        steps, values = zip(*val_points)
        ax.plot(steps, values, "o-", color="tab:purple", ms=3, lw=1.2, label=f"val {key}")
        if best_step is not None and best_step in steps:
            best = values[steps.index(best_step)]
            ax.plot([best_step], [best], marker="*", ms=14, color="tab:green", ls="none",
                    label=f"best: {best:.4g} at step {best_step}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"val {key}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, out)


# ----------------------------------------------------------------------------- classification


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


@torch.no_grad()
def predict_scores(ctx, dataset) -> tuple[np.ndarray, np.ndarray] | None:
    """(scores, targets) of ``ctx.model`` on ``dataset`` through ``ctx.recipe.eval_step`` (the
    forward the metrics use); ``None`` when the recipe gives no ``scores``/``target``."""
    from torch.utils.data import DataLoader

    recipe, model, task = ctx.recipe, ctx.model, ctx.task
    if recipe is None or not hasattr(recipe, "eval_step"):
        return None
    train_cfg = getattr(ctx.trainer, "config", None) or getattr(ctx.cfg, "train", None)
    batch_size = (getattr(train_cfg, "eval_batch_size", None) or getattr(train_cfg, "batch_size", None) or 64)
    collate = task.eval_collate_fn or task.collate_fn
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate, num_workers=0)
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    fabric = getattr(ctx.trainer, "fabric", None)
    was_training = model.training
    model.eval()
    scores, targets = [], []
    try:
        for batch in loader:
            batch = fabric.to_device(batch) if fabric is not None else _to_device(batch, device)
            if fabric is not None:
                with fabric.autocast():
                    out = recipe.eval_step(model, batch)
            else:
                out = recipe.eval_step(model, batch)
            if not isinstance(out, Mapping) or "scores" not in out or "target" not in out:
                return None
            scores.append(torch.as_tensor(out["scores"]).detach().float().cpu())
            targets.append(torch.as_tensor(out["target"]).detach().cpu())
    finally:
        model.train(was_training)
    if not scores:
        return None
    return torch.cat(scores).numpy(), torch.cat(targets).numpy()


def _class_names(info: Mapping[str, Any], n: int) -> list[str]:
    for key in ("classes", "class_names", "label_names"):
        names = info.get(key)
        if isinstance(names, (list, tuple)) and len(names) == n:
            return [str(c) for c in names]
    return [str(i) for i in range(n)]


def confusion_matrix_picture(y_true: np.ndarray, y_pred: np.ndarray, names: list[str], out: Path, *,
                             title: str = "") -> Path:
    from sklearn.metrics import confusion_matrix

    k = len(names)
    cm = confusion_matrix(y_true, y_pred, labels=list(range(k)))
    rows = cm.sum(axis=1, keepdims=True)
    share = np.divide(cm, rows, out=np.zeros(cm.shape, dtype=float), where=rows > 0)
    side = min(10.0, 2.6 + 0.45 * k)
    fig, (ax,) = _figure(side + 1.2, side)
    im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if k <= 30:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, str(cm[i, j]), ha="center", va="center", fontsize=8 if k <= 12 else 6,
                        color="white" if share[i, j] > 0.5 else "black")
    ticks = list(range(k))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xticklabels(names, rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center", fontsize=8)
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = float(np.trace(cm)) / max(1, int(cm.sum()))
    ax.set_title(f"{title}  (accuracy {accuracy:.3f}, n={int(cm.sum())})".strip(), fontsize=10)
    return _save(fig, out)


def roc_picture(y_true: np.ndarray, prob: np.ndarray, out: Path, *, title: str = "") -> Path | None:
    from sklearn.metrics import roc_auc_score, roc_curve

    if len(np.unique(y_true)) < 2:
        return None  # AUROC undefined with one class
    fpr, tpr, _ = roc_curve(y_true, prob)
    auroc = roc_auc_score(y_true, prob)
    fig, (ax,) = _figure(4.6, 4.4)
    ax.plot(fpr, tpr, "-", color="tab:blue", lw=1.8, label=f"AUROC = {auroc:.3f}")
    ax.plot([0, 1], [0, 1], ":", color="grey", lw=1, label="chance")
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.01, 1.01)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{title}  (n={len(y_true)})".strip(), fontsize=10)
    return _save(fig, out)


# ----------------------------------------------------------------------------- hooks


def _skipped(name: str, where: Any, err: BaseException) -> None:
    import warnings

    warnings.warn(f"picture {name} of {where} not drawn: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)


def arm_pictures(ctx) -> dict[str, Any]:
    """The pictures every arm gets (after adaptation, on its selected model). A picture whose
    drawing fails is left out with a warning: pictures never end a finished run."""
    arm_dir = Path(ctx.run_dir)
    root = ctx.run_root
    label = f"{ctx.arm} (seed {ctx.seed})"
    pictures: dict[str, str] = {}
    monitor = getattr(getattr(ctx.trainer, "config", None), "monitor", None) or ctx.cfg.train.monitor
    try:
        curve = learning_curve(arm_dir / "metrics.jsonl", arm_dir / "learning_curve.png", monitor=monitor,
                               best_step=ctx.results.get("best_step"), title=f"{label}: learning curve")
        if curve is not None:
            pictures["learning_curve"] = _rel(curve, root)
    except Exception as err:  # noqa: BLE001 - a picture never fails the run
        _skipped("learning_curve", arm_dir, err)
    task = ctx.task
    if task.task in ("multiclass", "binary"):
        try:
            pictures.update(_classification_pictures(ctx, arm_dir, root, label))
        except Exception as err:  # noqa: BLE001
            _skipped("confusion_matrix/roc_curve", arm_dir, err)
    return {"pictures": pictures} if pictures else {}


def _classification_pictures(ctx, arm_dir: Path, root: Path, label: str) -> dict[str, str]:
    task = ctx.task
    split, dataset = ("test", task.test) if task.test is not None else ("val", task.val)
    predicted = predict_scores(ctx, dataset) if dataset is not None and len(dataset) > 0 else None
    if predicted is None:
        return {}
    scores, target = predicted
    target = target.reshape(-1).astype(np.int64)
    n = len(target)
    if n == 0 or scores.size % n:
        return {}  # not one score row per target: not a plain classifier's output
    out: dict[str, str] = {}
    if task.task == "binary":
        if scores.size != n:
            return {}
        prob = scores.reshape(-1)
        pred = (prob >= 0.5).astype(np.int64)
        names = _class_names(task.info, 2)
    else:
        logits = scores.reshape(n, -1)
        pred = logits.argmax(-1)
        names = _class_names(task.info, max(logits.shape[1], int(target.max()) + 1))
    cm = confusion_matrix_picture(target, pred, names, arm_dir / "confusion_matrix.png", title=f"{label}, {split}")
    out["confusion_matrix"] = _rel(cm, root)
    if task.task == "binary":
        roc = roc_picture(target, prob, arm_dir / "roc_curve.png", title=f"{label}, {split}")
        if roc is not None:
            out["roc_curve"] = _rel(roc, root)
    return out


def _arm_metrics_file(run_dir: Path, arm: str, report: Mapping[str, Any]) -> Path:
    base = Path(run_dir) / arm.replace(":", "-")
    seeds = (report.get("adapt") or {}).get("seeds") or [0]
    if (base / "metrics.jsonl").is_file() or len(seeds) == 1:
        return base / "metrics.jsonl"
    return base / f"seed{seeds[0]}" / "metrics.jsonl"


def run_pictures(report: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run's pictures (across arms); returns ``{"pictures": {...}}`` to merge into the report
    (the report's existing pictures are kept)."""
    run_dir = Path(run_dir)
    pictures = dict(report.get("pictures") or {})
    key = _metric_key(report.get("monitor"))
    curves = []
    arms = report.get("arms")
    for arm, result in (arms.items() if isinstance(arms, Mapping) else ()):
        path = _arm_metrics_file(run_dir, arm, report)
        if not path.is_file():
            continue
        train, val = read_metrics(path)
        if train:
            curves.append((arm, train, [(r["step"], r[key]) for r in val if key and _finite(r.get(key))],
                           result.get("best_step") if isinstance(result, Mapping) else None))
    if len(curves) >= 2:
        try:
            pictures["learning_curves"] = _rel(_overlay(report, run_dir, curves, key), run_dir)
        except Exception as err:  # noqa: BLE001 - a picture never fails the run
            _skipped("learning_curves", run_dir, err)
    return {"pictures": pictures} if pictures else {}


def _overlay(report: Mapping[str, Any], run_dir: Path, curves: list, key: str | None) -> Path:
    """Train loss and the monitored metric of every trained arm on one set of axes."""
    has_val = any(v for _, _, v, _ in curves)
    fig, axes = _figure(10.0 if has_val else 5.5, 4.0, ncols=2 if has_val else 1)
    colors = [f"C{i % 10}" for i in range(len(curves))]
    for (arm, train, val, best), color in zip(curves, colors):
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], "-", color=color, lw=1.4, label=arm)
        if has_val and val:
            steps, values = zip(*val)
            axes[1].plot(steps, values, "o-", color=color, ms=3, lw=1.2, label=arm)
            if best in steps:
                axes[1].plot([best], [values[steps.index(best)]], marker="*", ms=12, color=color, ls="none")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("train loss")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if has_val:
        axes[1].set_xlabel("step")
        axes[1].set_ylabel(f"val {key} (star: selected step)")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=8)
    fig.suptitle(f"{report.get('family', '')}: learning curves of every arm", fontsize=10)
    return _save(fig, run_dir / "learning_curves.png")


def markdown_section(report: Mapping[str, Any]) -> str:
    """``## Pictures``: every picture of ``report["pictures"]`` and of each arm's ``pictures``,
    embedded with paths relative to the run folder (where ``report.md`` lives); ``""`` if none."""
    from urllib.parse import quote

    groups: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(report.get("pictures"), Mapping) and report["pictures"]:
        groups.append(("run", report["pictures"]))
    arms = report.get("arms")
    for arm, result in (arms.items() if isinstance(arms, Mapping) else ()):
        if isinstance(result, Mapping) and isinstance(result.get("pictures"), Mapping) and result["pictures"]:
            groups.append((f"arm {arm}", result["pictures"]))
    if not groups:
        return ""
    lines = ["## Pictures", ""]
    for heading, items in groups:
        lines += [f"### {heading}", ""]
        for name, path in items.items():
            lines += [f"![{name}]({quote(str(path), safe='/@+:-_.~')})", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- forecasts


def fan_figure(records: list[dict[str, Any]], *, max_series: int = 6, title: str | None = None,
               history: int | None = None):
    """A fan chart (a matplotlib ``Figure``, Agg): for each of the first ``max_series`` records,
    the last ``history`` observed values (default ``max(4 * horizon, 48)``), the median (the 0.5
    level, else the mean), the bands between symmetric quantile levels (e.g. 10-90%, 20-80%, ...;
    darker inside) and the held-out target when the record has one.

    ``records``: dicts with ``item_id``, ``history``, ``history_index``, ``future_index``,
    ``quantiles`` (H, Q), ``levels`` (Q), ``mean`` (H,), optional ``target`` (H,)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = list(records)[:max_series]
    if not records:
        raise ValueError("fan_chart: no series to draw")
    ncols = 1 if len(records) == 1 else 2
    nrows = -(-len(records) // ncols)
    fig = Figure(figsize=(6.0 * ncols, 2.4 * nrows + 0.4), dpi=90)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, r in zip(axes.flat, records):
        levels = [float(q) for q in r["levels"]]
        q = np.asarray(r["quantiles"], dtype=np.float64)
        horizon = q.shape[0]
        keep = history or max(4 * horizon, 48)
        ax.plot(r["history_index"][-keep:], np.asarray(r["history"])[-keep:], color="black", lw=1.0, label="history")
        pairs = sorted(((lo, hi) for lo in levels for hi in levels if lo < 0.5 and abs(lo + hi - 1) < 1e-9),
                       key=lambda p: p[0])
        for k, (lo, hi) in enumerate(pairs):  # the outer band first, lightest
            alpha = 0.15 + 0.45 * (k + 1) / len(pairs)
            ax.fill_between(r["future_index"], q[:, levels.index(lo)], q[:, levels.index(hi)], color="tab:blue",
                            alpha=alpha, lw=0, label=f"{lo:.0%}-{hi:.0%}" if k in (0, len(pairs) - 1) else None)
        median = q[:, levels.index(0.5)] if 0.5 in levels else np.asarray(r["mean"])
        ax.plot(r["future_index"], median, color="tab:blue", lw=1.5, label="median" if 0.5 in levels else "mean")
        if r.get("target") is not None:
            ax.plot(r["future_index"], r["target"], "o", ms=2.5, color="tab:red", label="target")
        ax.set_title(str(r["item_id"]), fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(records):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    # fixed margins: tight_layout would draw the figure once more (a third of the time)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / fig.get_figheight(), top=1 - 0.55 / fig.get_figheight(),
                        wspace=0.18, hspace=0.55)
    return fig


def fan_chart(path: str | Path, records: list[dict[str, Any]], **kwargs: Any) -> Path:
    """:func:`fan_figure` written as a PNG to ``path``, atomically."""
    fig = fan_figure(records, **kwargs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)
