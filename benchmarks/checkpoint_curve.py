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
  ``--dataset mutag`` for MUTAG), through the default's own runs: in-context accuracy
  (``adapt.mode=none``; ``--episodes`` per run, one run per ``--episode-seeds`` entry) and
  fine-tuning (``--modes``: full, linear_probe, ...; one run per ``--seeds`` entry; the selection
  metric on val and test), each on every split in ``--splits`` (``data.seed``: the stratified
  split's seed), against random init (``--baseline``: the same runs of the random arm, whose
  initialisation is drawn from the run's seed). Every figure is the mean ± std (ddof 1) over all
  runs (splits x seeds), with their count; ``--json`` writes every run's value.

Usage::

    python benchmarks/checkpoint_curve.py fim fim-imputation-small SNAP1.ckpt SNAP2.ckpt RUN/model --odebench
    python benchmarks/checkpoint_curve.py wavetoken wavetoken-micro SNAP*.ckpt
    python benchmarks/checkpoint_curve.py git git-small SNAP*.ckpt RUN/encoder --baseline
    # the card of git-small.graph-mixture (models/git/weights/git-small.graph-mixture.md):
    python benchmarks/checkpoint_curve.py git git-small.graph-mixture shipped --baseline --splits 0 1 2 \
        --episode-seeds 0 1 2 3 4 --episodes 200 --seeds 0 1 2 --modes full linear_probe [--dataset mutag]

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
import time
from pathlib import Path

import numpy as np
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
    run_name = f"{folder.name}-{len(list((runs / family).glob('*')))}"  # runs/<family>/<name>: unique per call
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


def _repeats(arm: dict) -> list[dict]:
    """The per-seed results of one arm of a report (the arm itself when it ran one seed)."""
    return arm["seeds"] if "seeds" in arm else [arm]


def spread(values: list[float]) -> tuple[float, float, int]:
    """(mean, std with ddof 1 -- as the reports' ``<section>_std`` -- , count) of per-run values."""
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0, int(arr.size)


def git_runs(folder: Path, name: str, runs: Path, *, arm: str, split: int, seeds: list[int], mode: str,
             episodes: int | None, overrides: list[str]) -> dict[str, list[float]]:
    """Per-run figures of one arm on one split: ``mode`` none gives in-context accuracy (one run of
    ``episodes`` episodes per seed, drawn with that seed), another mode the fine-tuned metrics."""
    common = [f"data.seed={split}", f"adapt.seeds=[{', '.join(map(str, seeds))}]", f"adapt.mode={mode}",
              "retained.datasets=[]", *overrides]
    if arm == "random":
        common += ["arms=[random]", "model.pretrained=null"]
    if mode == "none":
        common += ["protocols.in_context=true"] + ([] if episodes is None else [f"protocols.n_episodes={episodes}"])
    else:
        common += ["protocols.in_context=false"]
    report = run_zero_shot("git", folder, name, runs, common)
    metric, out = report["data"]["metric"], {}
    for r in _repeats(report["arms"][arm]):
        if mode == "none":
            ic = r["in_context"]
            out.setdefault(f"in-context accuracy ({ic['n_way']}-way 3-shot)", []).append(ic["accuracy"])
            continue
        for part in ("val", "test"):
            out.setdefault(f"{mode} {part} {metric}", []).append(r[part][metric])
            if "balanced_accuracy" in r[part] and metric != "balanced_accuracy":
                out.setdefault(f"{mode} {part} balanced accuracy", []).append(r[part]["balanced_accuracy"])
    return out


def git_protocol(folder: Path, name: str, runs: Path, args, *, arm: str, overrides: list[str]) -> dict[str, list[float]]:
    """Every figure of one arm over ``args.splits`` x seeds: ``{figure: per-run values}`` (split-major)."""
    values: dict[str, list[float]] = {}
    for split in args.splits:
        jobs = [("none", args.episode_seeds)] + [(mode, args.seeds) for mode in args.modes]
        for mode, seeds in jobs:
            got = git_runs(folder, name, runs, arm=arm, split=split, seeds=seeds, mode=mode, episodes=args.episodes,
                           overrides=overrides)
            for key, vs in got.items():
                values.setdefault(key, []).extend(vs)
    return values


def git_rows(values: dict[str, list[float]], baseline: dict[str, list[float]] | None = None) -> dict[str, str]:
    """``mean ± std (n=runs)`` per figure; with ``baseline`` (random init's values from the same
    splits and seeds, hence the same episodes) also the paired gain: mean ± std of the per-run
    differences, and in how many runs the checkpoint is ahead."""
    rows = {}
    for key, vs in values.items():
        mean, std, n = spread(vs)
        rows[key] = f"{mean:.3f} ± {std:.3f} (n={n})"
        if baseline is not None and len(baseline.get(key, [])) == len(vs):
            diff = np.subtract(vs, baseline[key])
            gain, gain_std, _ = spread(list(diff))
            rows[key] += f"; gain over random init {gain:+.3f} ± {gain_std:.3f}, ahead in {int((diff > 0).sum())}/{n}"
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=["fim", "wavetoken", "git"])
    parser.add_argument("model", help="the registered variant the checkpoints were trained as")
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--batch-size", type=int, default=None, help="series per step (to print series seen)")
    parser.add_argument("--odebench", action="store_true", help="fim: also the ODEBench grid (about a CPU-minute each)")
    parser.add_argument("--baseline", action="store_true", help="git: also the random-init arm, same runs")
    parser.add_argument("--dataset", default=None, help="git: another held-out dataset (mutag: monitored by ROC-AUC)")
    parser.add_argument("--splits", type=int, nargs="+", default=[0], help="git: data.seed of each split (default 0)")
    parser.add_argument("--episode-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="git: one in-context run per seed (its episodes; random init: also its initialisation)")
    parser.add_argument("--episodes", type=int, default=None, help="git: in-context episodes per run (default: the "
                                                                   "config's protocols.n_episodes)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="git: fine-tuning seeds per split")
    parser.add_argument("--modes", nargs="*", default=["full"],
                        help="git: adaptation modes to fine-tune with (full, linear_probe, lora; none: in-context only)")
    parser.add_argument("--json", type=Path, default=None, help="git: write every run's value here")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes if m != "none"]
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    start = time.perf_counter()
    every: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        extra = [] if args.dataset is None else [f"data.dataset={args.dataset}"] + (
            ["train.monitor=val/roc_auc"] if args.dataset == "mutag" else [])
        if args.family == "git" and args.baseline:
            every["random init"] = git_protocol(Path("random"), args.model, tmp / "runs", args, arm="random",
                                                overrides=extra)
            print("\nrandom init:")
            for key, value in git_rows(every["random init"]).items():
                print(f"  {key:<40} {value}")
        for source in args.checkpoints:
            # git: "shipped" is the variant's registered weights (model.pretrained=true)
            shipped = args.family == "git" and str(source) == "shipped"
            folder, step = (Path("true"), None) if shipped else model_folder(source, args.model, tmp / "models")
            rows = {}
            if args.family == "fim":
                rows.update(fim_row(run_zero_shot("fim", folder, args.model, tmp / "runs", [])))
                if args.odebench:
                    rows.update(fim_row(run_zero_shot("fim", folder, args.model, tmp / "runs", ["data.kind=odebench"])))
            elif args.family == "git":  # the default's own protocol: in-context and fine-tuning
                every[str(source)] = git_protocol(folder, args.model, tmp / "runs", args, arm="pretrained",
                                                  overrides=extra)
                rows.update(git_rows(every[str(source)], every.get("random init")))
            else:
                rows.update(wavetoken_row(run_zero_shot("wavetoken", folder, args.model, tmp / "runs", [])))
            seen = f", {step * args.batch_size} series seen" if step is not None and args.batch_size else ""
            print(f"\n{source.name}: step {step}{seen}")
            for key, value in rows.items():
                print(f"  {key:<40} {value}")
    wall = time.perf_counter() - start
    print(f"\nwall time {wall:.0f} s")
    if args.json is not None and every:
        args.json.write_text(json.dumps({"cpu": cpu_description(), "threads": torch.get_num_threads(),
                                         "wall_time_s": round(wall, 1), "dataset": args.dataset or "solubility",
                                         "splits": args.splits, "episode_seeds": args.episode_seeds,
                                         "episodes": args.episodes, "seeds": args.seeds, "modes": args.modes,
                                         "runs": every}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
