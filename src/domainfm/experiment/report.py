"""One nested report for every family, and its table (one column per arm, then one per baseline).

    {"family", "task", "model", "labels", "data", "adapt", "stages",
     "params": {"total", "trainable"},
     "arms": {ARM: {"init", "mode", "best_step", "steps", "val": {...}, "test": {...},
                    "<protocol>": {...}, "seeds": [...], "val_std": {...}, "test_std": {...}}},
     "baselines": {"columns": {COLUMN: PREFIX}, "description": "..."},   (optional)
     "wall_time_s"}

**Baselines** are reference forecasts scored beside the arms on the same data (seasonal naive,
AutoETS, ...), not trained arms: their scores sit in the arms' sections under ``PREFIX_<metric>``
(``test.co2.naive_mase``, ``test.auto_ets_wql_rel``), identical in every arm. The table moves
them out of the arm columns into one column per baseline, in the row of the arm metric they
correspond to (``test.auto_ets_wql_rel`` in row ``test.wql_rel``, column ``AutoETS``).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["aggregate_seeds", "flatten", "table_rows", "format_table", "print_table", "to_markdown", "wise_markdown"]

_NOT_METRICS = {"init", "mode", "best_step", "steps", "seed", "seeds", "model_dir", "adapter_dir", "skipped", "params",
                "alpha", "derived_from", "method", "pretrained_side"}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"val": {"kappa": 0.2}}`` -> ``{"val.kappa": 0.2}`` (lists are left out)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif not isinstance(value, (list, tuple)):
            out[name] = value
    return out


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the results of one arm over seeds: numeric leaves become means (``<section>_std``
    holds the standard deviations, ``seeds`` the per-seed results); the first run's other fields
    are kept."""
    if len(runs) == 1:
        return dict(runs[0])
    flats = [flatten(r) for r in runs]
    merged = dict(flats[0])
    stds: dict[str, float] = {}
    for key, value in flats[0].items():
        if key.split(".")[0] in _NOT_METRICS or key.endswith("n_way") or not _is_number(value):
            continue
        values = [f.get(key) for f in flats]
        if all(_is_number(v) for v in values):
            arr = np.asarray(values, dtype=np.float64)
            merged[key] = float(arr.mean())
            stds[key] = float(arr.std(ddof=1))
    out = _unflatten(merged)
    for key, std in stds.items():
        section, _, rest = key.partition(".")
        if rest:
            out.setdefault(f"{section}_std", {})
            node = out[f"{section}_std"]
            *parents, leaf = rest.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = std
    out["seeds"] = runs
    return out


def _baseline_key(key: str, columns: Mapping[str, str]) -> tuple[str, str] | None:
    """``(column, arm metric)`` when ``key`` is a baseline's score (its last part starts with a
    column's ``PREFIX_``): ``test.d.auto_ets_mase`` -> ``("AutoETS", "test.d.mase")``."""
    head, _, last = key.rpartition(".")
    for column, prefix in columns.items():
        if last.startswith(prefix + "_") and len(last) > len(prefix) + 1:
            return column, f"{head}.{last[len(prefix) + 1:]}" if head else last[len(prefix) + 1:]
    return None


def table_rows(report: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[Any]]]]:
    """(column names: the arms, then the baselines of ``report["baselines"]["columns"]``; rows of
    (metric, one value per column)), ``init`` first. A metric repeated over seeds reads
    ``mean ± std``; a baseline's value is taken from the first arm that holds it."""
    arms = list(report.get("arms", {}))
    columns = dict((report.get("baselines") or {}).get("columns") or {})
    per_arm, per_baseline = {}, {c: {} for c in columns}
    for a in arms:
        arm = report["arms"][a]
        flat = flatten({k: v for k, v in arm.items() if k != "seeds" and not k.endswith("_std")})
        stds = flatten({k[:-4]: v for k, v in arm.items() if k.endswith("_std") and isinstance(v, Mapping)})
        own = {}
        for k, v in flat.items():
            found = _baseline_key(k, columns) if columns else None
            if found is None:
                own[k] = f"{_fmt(v)} ± {_fmt(stds[k])}" if k in stds and _is_number(v) else v
            elif _is_number(v):
                per_baseline[found[0]].setdefault(found[1], v)
        per_arm[a] = own
    keys: list[str] = []
    for values in [*per_arm.values(), *per_baseline.values()]:
        for k, v in values.items():
            if k not in keys and k not in ("model_dir", "adapter_dir", "seed") and (
                    _is_number(v) or isinstance(v, str) and ("±" in v or k in ("init", "mode", "skipped"))):
                keys.append(k)
    front = [k for k in ("init", "mode", "skipped", "best_step") if k in keys]
    keys = front + [k for k in keys if k not in front]
    values = [per_arm[a] for a in arms] + [per_baseline[c] for c in columns]
    return arms + list(columns), [(k, [v.get(k) for v in values]) for k in keys]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (float, np.floating)):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def format_table(report: Mapping[str, Any], *, markdown: bool = False) -> str:
    arms, rows = table_rows(report)
    if not arms:
        return ""
    header = ["metric"] + arms
    cells = [[k] + [_fmt(v) for v in vals] for k, vals in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
        return "\n".join(lines)
    # long strings (init lines) are cut in the terminal table; report.json keeps them whole
    cells = [[c if len(c) <= 48 else c[:45] + "..." for c in row] for row in cells]
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells])


def print_table(report: Mapping[str, Any], *, title: str | None = None, file=None) -> None:
    file = file or sys.stdout
    if title:
        print(title, file=file)
    for key in ("family", "task", "model", "labels"):
        if key in report:
            print(f"  {key}: {report[key]}", file=file)
    if "params" in report:
        print(f"  params: {report['params']}", file=file)
    print(format_table(report), file=file)


def _lines(items: Iterable[tuple[str, Any]]) -> list[str]:
    return [f"- **{k}**: {v}" for k, v in items]


def wise_markdown(report: Mapping[str, Any]) -> list[str]:
    """The WiSE curves (``report["wise_curve"]``) as one table per fine-tuned arm: alpha, the
    monitored metric on val/test and the retained capability's metric."""
    curves = report.get("wise_curve") or {}
    if not curves:
        return []
    metric = str(report.get("monitor", "")).split("/", 1)[-1]
    kept = (report.get("retained_capability") or {}).get("metric")
    lines = ["## WiSE-FT curves", "",
             "theta(alpha) = (1 - alpha) * pretrained + alpha * fine-tuned (alpha 0: the pretrained side, "
             "alpha 1: the fine-tuned arm)", ""]
    for arm, curve in curves.items():
        header = ["alpha", f"val {metric}", f"test {metric}"] + ([f"retained {kept}"] if kept else [])
        lines += [f"**{arm}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for point in curve:
            row = [f"{point['alpha']:g}", _fmt(point.get("val", {}).get(metric)), _fmt(point.get("test", {}).get(metric))]
            if kept:
                row.append(_fmt(point.get("retained", {}).get(kept)))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def to_markdown(report: Mapping[str, Any]) -> str:
    head = [f"# {report.get('family', '')} {report.get('kind', 'finetune')} report", ""]
    head += _lines((k, report[k]) for k in ("task", "model", "labels", "params", "wall_time_s") if k in report)
    if (report.get("baselines") or {}).get("description"):
        head += _lines([("baselines", report["baselines"]["description"])])
    if report.get("retained_capability"):
        cap = report["retained_capability"]
        head += _lines([("retained capability", f"{cap.get('metric')} ({cap.get('direction')}): {cap.get('description', '')}")])
    tail = wise_markdown(report)
    skipped = (report.get("robust") or {}).get("skipped_arms") or {}
    if skipped:
        tail += ["## Arms without FLOW / WiSE / DaWin", ""] + _lines(skipped.items()) + [""]
    return "\n".join(head + ["", format_table(report, markdown=True), ""] + tail)
