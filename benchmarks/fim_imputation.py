"""FIM imputation accuracy beside the interpolations a practitioner tries first (issue 35).

A FIM checkpoint with its two readouts (``official``: the paper's path ``x0 + ∫ f``; ``pinned``: that path
moved onto the observations) against linear interpolation, a natural cubic spline held constant beyond the
end observations, and a Gaussian process (scikit-learn, RBF + white noise, fitted per series), all from
:func:`domainfm.data_loaders.gapped_series.interpolate_baseline`. MAE on the hidden (unobserved) points
against the clean path; lower is better.

* **Held-out prior draws**: series of domainfm's synthetic ODE prior (:mod:`domainfm.pretrain.fim`) drawn
  with seeds ``HELD_OUT_SEED + s`` (no training run or recipe uses them: training draws are seeded
  ``seed * 1_000_003 + chunk`` with seeds 0-4 and chunks below 300,000), noise up to ``--noise-max`` of each
  path's std (default 0.1, the prior the issue's table was measured on). Observation patterns on the
  128-point grid, at 8/16/32/64 observed points: ``random`` (a uniform random subset), ``regular`` (every
  ``128/n``-th point from t0) and ``gap`` (a 32-point central gap, the ``n`` observed points drawn at random
  outside it). ``--series`` series per seed and cell; the figure is the mean over ``--seeds`` seeds with
  the standard deviation of the per-seed means.
* **ODE systems integrated with scipy** (:func:`domainfm.data_loaders.odebench.simulate`, LSODA): a
  damped harmonic oscillator, Lotka-Volterra, Van der Pol and Lorenz, 128 points, every channel a series,
  32 of 128 points observed (random and central-gap patterns, no noise); MAE divided by each channel's std
  (so channels of different units average), mean over channels and ``--seeds`` patterns.

The local model runs on the whole 128-point grid; the ODE table is repeated with FIM-ℓ at ``--ode-windows``
windows (default 4: about half a cycle of the oscillators per window).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/fim_imputation.py                       # the shipped checkpoint
    OMP_NUM_THREADS=1 python benchmarks/fim_imputation.py --weights RUN/checkpoints/last.ckpt --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch

import domainfm
from domainfm.data_loaders.gapped_series import BASELINES, interpolate_baseline
from domainfm.data_loaders.odebench import DEMO_SYSTEMS, simulate
from domainfm.pretrain.fim import PriorSection, sample_prior

#: no training run uses these prior seeds (see the module docstring)
HELD_OUT_SEED = 20_261_205
GRID = 128
COUNTS = (8, 16, 32, 64)
PATTERNS = ("random", "regular", "gap")
METHODS = ("fim", "fim_pinned", *BASELINES)


def pattern_mask(pattern: str, n_obs: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``(n, 128)`` bool, True where observed."""
    observed = np.zeros((n, GRID), dtype=bool)
    if pattern == "regular":
        observed[:, :: GRID // n_obs] = True
        return observed
    pool = np.arange(GRID) if pattern == "random" else np.r_[0:48, 80:GRID]  # gap: points 48..79 hidden
    for i in range(n):
        observed[i, rng.choice(pool, size=n_obs, replace=False)] = True
    return observed


def load_model(args) -> torch.nn.Module:
    if args.weights is None:
        return domainfm.create_model(args.model, pretrained=True).eval()
    path = Path(args.weights)
    if path.is_dir():
        return domainfm.create_model(path).eval()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = domainfm.create_model(args.model.split(".")[0])
    model.load_state_dict(state["model"])
    return model.eval()


def impute_both(model, times: np.ndarray, values: np.ndarray, observed: np.ndarray, windows=None
                ) -> dict[str, np.ndarray]:
    """Rows of one channel each: the official and the pinned readout, ``(n, T)`` float64 (FIM-ℓ with
    ``windows``; rows too sparse for them get fewer)."""
    t = torch.as_tensor(times, dtype=torch.float64)
    v = torch.as_tensor(np.where(observed, values, np.nan), dtype=torch.float64)
    o = torch.as_tensor(observed)
    out = {}
    with torch.no_grad():
        for name, readout in (("fim", "official"), ("fim_pinned", "pinned")):
            out[name] = model.impute(t, v, o, t, windows=windows, readout=readout)["values"].numpy()
    return out


def score_rows(model, times, noisy, clean, observed, scale=None, baselines=True, windows=None) -> dict[str, float]:
    """Mean over rows of the MAE on hidden points (divided by ``scale`` per row when given)."""
    preds = impute_both(model, times, noisy, observed, windows)
    for kind in BASELINES if baselines else ():
        preds[kind] = np.stack([interpolate_baseline(times, noisy[i][:, None], observed[i][:, None], kind)[:, 0]
                                for i in range(len(noisy))])
    hidden = ~observed
    scale = np.ones(len(noisy)) if scale is None else scale
    return {m: float(np.mean([np.abs(preds[m][i] - clean[i])[hidden[i]].mean() / scale[i] for i in range(len(noisy))]))
            for m in preds}


def _with_baselines(table: dict, cell: str, scores: dict[str, list[float]], reuse: dict | None) -> None:
    """``table[cell]``: the FIM scores, and the baselines' scored now or taken from ``reuse`` (a previous
    run's table over the same series and patterns: the baselines do not depend on the checkpoint)."""
    if reuse is not None:
        scores = {**scores, **{k: reuse[cell][k] for k in BASELINES}}
    table[cell] = {m: scores[m] for m in METHODS}


def prior_table(model, args, reuse=None) -> dict[str, dict[str, list[float]]]:
    prior = PriorSection(noise_max=args.noise_max, regular_fraction=0.0)
    draws = [sample_prior(args.series, prior, seed=HELD_OUT_SEED + s) for s in range(args.seeds)]
    table = {}
    for pattern in PATTERNS:
        for n_obs in COUNTS:
            per_seed = []
            for s, d in enumerate(draws):
                rng = np.random.default_rng([HELD_OUT_SEED, s, n_obs, PATTERNS.index(pattern)])
                observed = pattern_mask(pattern, n_obs, args.series, rng)
                per_seed.append(score_rows(model, d["times"], d["noisy"], d["values"], observed,
                                           baselines=reuse is None))
            _with_baselines(table, f"{pattern}/{n_obs}", {m: [r[m] for r in per_seed] for m in per_seed[0]}, reuse)
            print(f"  prior {pattern}/{n_obs}: " + ", ".join(f"{m} {np.mean(table[f'{pattern}/{n_obs}'][m]):.4f}"
                                                             for m in METHODS), flush=True)
    return table


def _damped_oscillator(x, c):
    return [x[1], -c[0] ** 2 * x[0] - 2 * c[1] * c[0] * x[1]]


ODE_SYSTEMS = {  # name: (f, consts, init, t_end)
    "damped_oscillator": (_damped_oscillator, [2 * math.pi * 0.5, 0.1], [1.0, 0.0], 4.0),  # 2 cycles
    "lotka_volterra": (DEMO_SYSTEMS["lotka_volterra"][0], [], DEMO_SYSTEMS["lotka_volterra"][1], 15.0),
    "van_der_pol": (DEMO_SYSTEMS["van_der_pol"][0], [], DEMO_SYSTEMS["van_der_pol"][1], 10.0),
    "lorenz": (DEMO_SYSTEMS["lorenz"][0], [], DEMO_SYSTEMS["lorenz"][1], 1.0),
}


def ode_table(model, args, reuse=None, windows=None) -> dict[str, dict[str, list[float]]]:
    table = {}
    for name, (f, consts, init, t_end) in ODE_SYSTEMS.items():
        times, clean = simulate(f, consts, init, t_end=t_end, n_points=GRID)
        rows = clean.T  # one channel per row
        for pattern in ("random", "gap"):
            per_seed = []
            for s in range(args.seeds):
                rng = np.random.default_rng([HELD_OUT_SEED, s, 32, PATTERNS.index(pattern), 7])
                observed = pattern_mask(pattern, 32, len(rows), rng)
                per_seed.append(score_rows(model, times, rows, rows, observed, scale=rows.std(axis=1),
                                           baselines=reuse is None, windows=windows))
            _with_baselines(table, f"{name}/{pattern}", {m: [r[m] for r in per_seed] for m in per_seed[0]}, reuse)
            print(f"  ode {name}/{pattern} (windows {windows}): " + ", ".join(f"{m} {np.mean(table[f'{name}/{pattern}'][m]):.4f}"
                                                         for m in METHODS), flush=True)
    return table


def markdown(table: dict[str, dict[str, list[float]]], first: str) -> str:
    head = f"| {first} | FIM official | FIM pinned | linear | spline (clamped) | GP |\n|---|---|---|---|---|---|\n"
    lines = []
    for cell, scores in table.items():
        means = {m: float(np.mean(v)) for m, v in scores.items()}
        best = min(means.values())
        fmt = lambda m: (f"**{means[m]:.4f}**" if means[m] == best else f"{means[m]:.4f}") + (  # noqa: E731
            f" ± {np.std(scores[m]):.4f}" if len(scores[m]) > 1 else "")
        lines.append(f"| {cell} | " + " | ".join(fmt(m) for m in METHODS) + " |")
    return head + "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="fim-imputation-small.synthetic-prior",
                        help="registered name (its pretrained weights), or the variant --weights was trained as")
    parser.add_argument("--weights", default=None, help="an engine checkpoint (.ckpt) or a save_pretrained folder")
    parser.add_argument("--series", type=int, default=128, help="prior series per seed and cell")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--noise-max", type=float, default=0.1, help="prior noise, fraction of each path's std")
    parser.add_argument("--no-ode", action="store_true")
    parser.add_argument("--no-prior", action="store_true")
    parser.add_argument("--ode-windows", type=int, default=4,
                        help="the ODE table also with FIM-ℓ at this many windows (0: local model only)")
    parser.add_argument("--json", default=None, help="write the per-seed figures here")
    parser.add_argument("--reuse-baselines", default=None,
                        help="a previous --json with the same --series/--seeds/--noise-max: its linear/spline/GP "
                             "figures (they do not depend on the checkpoint) instead of fitting them again")
    args = parser.parse_args(argv)
    reuse = None
    if args.reuse_baselines:
        reuse = json.loads(Path(args.reuse_baselines).read_text())
        setup = {k: getattr(args, k) for k in ("series", "seeds", "noise_max")} | {"held_out_seed": HELD_OUT_SEED}
        if {k: reuse.get(k) for k in setup} != setup:
            raise SystemExit(f"--reuse-baselines {args.reuse_baselines}: measured on {({k: reuse.get(k) for k in setup})}"
                             f", not on this run's {setup}")
    torch.set_num_threads(1)
    start = time.time()
    model = load_model(args).double()
    print(f"model {args.weights or args.model} (readout recorded: {model.readout}); {platform.processor() or ''} "
          f"torch {torch.__version__}", flush=True)
    out = {"model": args.weights or args.model, "series": args.series, "seeds": args.seeds,
           "noise_max": args.noise_max, "held_out_seed": HELD_OUT_SEED, }
    if not args.no_prior:
        out["prior"] = prior_table(model, args, reuse and reuse["prior"])
    if not args.no_ode:
        out["ode"] = ode_table(model, args, reuse and reuse.get("ode"))
        if args.ode_windows > 1:
            out[f"ode_w{args.ode_windows}"] = ode_table(model, args, reuse and reuse.get("ode"), args.ode_windows)
    out["wall_s"] = time.time() - start
    if "prior" in out:
        print("\nHeld-out prior draws (pattern / observed of 128): MAE on hidden points, mean ± std over seeds\n")
        print(markdown(out["prior"], "pattern / observed"))
    for key in [k for k in out if k.startswith("ode")]:
        local = "the local model" if key == "ode" else f"FIM-ℓ, {key[5:]} windows"
        print(f"\nODE systems, 32 of 128 observed, {local}: MAE / channel std on hidden points, mean ± std over seeds\n")
        print(markdown(out[key], "system / pattern"))
    print(f"\nwall {out['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
