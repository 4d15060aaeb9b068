"""Held-out figures of a pretraining run against training compute: the learning curve of a checkpoint.

For each engine checkpoint given (``RUN/checkpoints/last.ckpt`` copies taken during a run, or the
run's final ``RUN/model`` folder), the model is rebuilt, saved as a ``save_pretrained`` folder and
evaluated zero-shot through the same experiment command a user runs (``domainfm finetune FAMILY
adapt.mode=none``), beside the family's baselines:

* ``fim``: the embedded default's cases (CO2 artificial gaps, Lorenz, Van der Pol, Lotka-Volterra;
  MAE on hidden entries vs linear interpolation, a cubic spline held constant beyond the end observations and
  a Gaussian process (RBF + white noise)) and, with ``--odebench``, the
  ODEBench grid (fraction of trajectories with R^2 > 0.9, vs the same baselines);
* ``wavetoken``: zero-shot forecasts of the 14 shipped statsmodels series (held out of domainfm's
  pretraining), MASE and WQL relative to seasonal naive, geometric mean over the 6 datasets
  (Chronos's aggregate), beside statsforecast's AutoETS and AutoTheta fitted on the same context
  windows (the report's baselines; their fallbacks counted);
* ``git``: the embedded default's task, held out of domainfm's pretraining (Solubility classes;
  ``--dataset mutag`` for MUTAG): in-context accuracy and full fine-tuning (3 seeds; the selection
  metric on val and test, ± its seed spread), against random init (``--baseline``: one extra run
  of the random arm).

Usage::

    python benchmarks/checkpoint_curve.py fim fim-imputation-small SNAP1.ckpt SNAP2.ckpt RUN/model --odebench
    python benchmarks/checkpoint_curve.py wavetoken wavetoken-micro SNAP*.ckpt
    python benchmarks/checkpoint_curve.py git git-small SNAP*.ckpt RUN/encoder --baseline

Each row: the optimizer step, series seen (step x batch), the held-out figures. Prints the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def cpu_description() -> str:
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        have = set(next(line for line in info.splitlines() if line.startswith("flags")).split())
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have)
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model} [{flags}], {os.cpu_count()} logical CPUs"


def model_folder(source: Path, name: str, out: Path) -> tuple[Path, int | None]:
    """A save_pretrained folder for ``source`` (an engine checkpoint or a model folder) and its step."""
    import domainfm

    if source.is_dir():
        return source, None
    state = torch.load(source, map_location="cpu", weights_only=True)
    model = domainfm.create_model(name)
    weights = state["model"]
    if not set(model.state_dict()) <= set(weights):
        # a pretrainer that wraps the model (GIT: encoder + predictor + decoders): its encoder's weights
        weights = {k.removeprefix("encoder."): v for k, v in weights.items() if k.startswith("encoder.")}
    model.load_state_dict(weights)
    folder = domainfm.save_pretrained(model, out / source.stem, card=False)
    return folder, int(state["trainer"]["global_step"]) if "global_step" in state.get("trainer", {}) else None


def run_zero_shot(family: str, folder: Path, name: str, runs: Path, overrides: list[str]) -> dict:
    run_name = f"{folder.name}-{len(list(runs.glob('*')))}"
    cmd = [sys.executable, "-m", "domainfm.cli", "finetune", family, "adapt.mode=none", "arms=[pretrained]",
           f"model.name={name}", f"model.pretrained={folder}", "model.kwargs={}", "stages=[]", *overrides,
           "--runs-dir", str(runs), "--name", run_name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "DOMAINFM_OFFLINE": "1"})
    return json.loads((runs / family / run_name / "report.json").read_text())


def fim_row(report: dict) -> dict:
    arm = report["arms"]["pretrained"]
    row = {}
    for case, scores in (arm.get("zero_shot") or {}).items():
        if "fim" in scores:
            row[case] = (f"{scores['fim']['mae']:.3g} (lin {scores['linear']['mae']:.3g}, spl {scores['spline']['mae']:.3g}"
                         f", gp {scores['gp']['mae']:.3g})")
    for cell, scores in (arm.get("odebench") or {}).items():
        if isinstance(scores, dict) and "fim" in scores:
            row[f"odebench {cell} R2>0.9"] = (f"{scores['fim']['frac_r2_gt_0.9']:.2f} (lin "
                                              f"{scores['linear']['frac_r2_gt_0.9']:.2f}, gp "
                                              f"{scores['gp']['frac_r2_gt_0.9']:.2f})")
    return row


def wavetoken_row(report: dict) -> dict:
    """The checkpoint's test MASE and WQL relative to seasonal naive, then each baseline of the
    report (AutoETS, AutoTheta: the same windows, the same context) on the same scale."""
    test = report["arms"]["pretrained"]["test"]
    row = {"MASE / seasonal naive": f"{test['mase_rel']:.3f}", "WQL / seasonal naive": f"{test['wql_rel']:.3f}"}
    for column, prefix in (report.get("baselines") or {}).get("columns", {}).items():
        if prefix == "naive" or f"{prefix}_mase_rel" not in test:
            continue
        fallback = test.get(f"{prefix}_fallback_windows", 0)
        row[f"{column} MASE / WQL (rel.)"] = (f"{test[f'{prefix}_mase_rel']:.3f} / {test[f'{prefix}_wql_rel']:.3f}"
                                             + (f" ({fallback:.0f} windows by a fallback)" if fallback else ""))
    return row


def git_row(report: dict, arm: str = "pretrained") -> dict:
    a, metric = report["arms"][arm], report["data"]["metric"]
    ic = a["in_context"]
    out = {f"in-context accuracy ({report['data']['dataset']}, {ic['n_way']}-way 3-shot)": f"{ic['accuracy']:.3f}"}
    for split in ("val", "test"):
        spread = (a.get(f"{split}_std") or {}).get(metric)
        extra = f", balanced accuracy {a[split]['balanced_accuracy']:.3f}" if "balanced_accuracy" in a[split] else ""
        out[f"fine-tuned {split} {metric}"] = (f"{a[split][metric]:.3f}"
                                              + (f" ± {spread:.3f}" if spread is not None else "") + extra)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=["fim", "wavetoken", "git"])
    parser.add_argument("model", help="the registered variant the checkpoints were trained as")
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--batch-size", type=int, default=None, help="series per step (to print series seen)")
    parser.add_argument("--odebench", action="store_true", help="fim: also the ODEBench grid (about a CPU-minute each)")
    parser.add_argument("--baseline", action="store_true", help="git: also the random-init arm once")
    parser.add_argument("--dataset", default=None, help="git: another held-out dataset (mutag: monitored by ROC-AUC)")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_description()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        extra = [] if args.dataset is None else [f"data.dataset={args.dataset}"] + (
            ["train.monitor=val/roc_auc"] if args.dataset == "mutag" else [])
        if args.family == "git" and args.baseline:
            base = run_zero_shot("git", Path("random"), args.model, tmp / "runs", ["adapt.mode=full", "arms=[random]",
                                                                               "model.pretrained=null", *extra])
            print("\nrandom init:")
            for key, value in git_row(base, "random").items():
                print(f"  {key:<40} {value}")
        for source in args.checkpoints:
            folder, step = model_folder(source, args.model, tmp / "models")
            rows = {}
            if args.family == "fim":
                rows.update(fim_row(run_zero_shot("fim", folder, args.model, tmp / "runs", [])))
                if args.odebench:
                    rows.update(fim_row(run_zero_shot("fim", folder, args.model, tmp / "runs", ["data.kind=odebench"])))
            elif args.family == "git":  # the default's own protocol: fine-tuning, not zero-shot
                rows.update(git_row(run_zero_shot("git", folder, args.model, tmp / "runs", ["adapt.mode=full", *extra])))
            else:
                rows.update(wavetoken_row(run_zero_shot("wavetoken", folder, args.model, tmp / "runs", [])))
            seen = f", {step * args.batch_size} series seen" if step is not None and args.batch_size else ""
            print(f"\n{source.name}: step {step}{seen}")
            for key, value in rows.items():
                print(f"  {key:<40} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
