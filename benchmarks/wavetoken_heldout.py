"""Held-out zero-shot forecasting of WaveToken/Chronos checkpoints beside the baselines a forecaster runs first.

The held-out set is the package's ``statsmodels_series.csv`` (14 series in 6 datasets: co2, elnino,
elec_equip, macrodata's 9 series, sunspots, nile; public domain), which no domainfm pretraining run
trains on or selects with. Each series is cut at ``--origins`` rolling origins (the last
``--horizon`` steps, the ``--horizon`` steps before them, ...): each origin is one split. At every
context length in ``--context-lengths`` the models and the statistical baselines see the same last
values of each context; MASE's scale and seasonal naive use the whole history (GluonTS).

Scores are GluonTS's (MASE on the median, WQL on the quantiles 0.1..0.9), per dataset relative to
seasonal naive and aggregated by the geometric mean over datasets (Chronos's protocol). Each figure
is the mean ± std over origins (and, for the models, sampling seeds; for random init, init seeds).

Usage::

    python benchmarks/wavetoken_heldout.py wavetoken-micro.kernelsynth-tsmixup wavetoken-micro.real-mix \\
        --random wavetoken-micro --context-lengths 24 48 96 256
    python benchmarks/wavetoken_heldout.py step2000=PATH/TO/save_pretrained_folder ...

Prints the CPU, one table per context length, and the training-compute rows of the checkpoints.
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import torch
from checkpoint_curve import cpu_description  # noqa: E402  (benchmarks/ is the script's folder: on sys.path)

BASELINES = ("auto_ets", "auto_theta")
LEVELS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def origin_windows(horizon: int, origins: int) -> list[list[dict]]:
    """``origins`` lists of held-out windows: origin 0 ends at each series' last value."""
    from domainfm.data_loaders import timeseries as T

    _, windows = T.split_by_time(T.load_sample(), horizon, n_windows=origins, min_context=2)
    by_origin: dict[int, list[dict]] = {}
    for w in windows:  # split_by_time lists a series' windows from the earliest to the latest
        by_origin.setdefault(w["item_id"], []).append(w)
    return [[ws[len(ws) - 1 - o] for ws in by_origin.values()] for o in range(origins)]


def load(spec: str):
    """``NAME`` (a registered tag, its weights) or ``LABEL=PATH`` (a save_pretrained folder)."""
    import domainfm

    label, _, path = spec.partition("=")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (domainfm.create_model(path) if path else domainfm.create_model(label, pretrained=True)).eval()


def model_scores(model, windows: list[dict], horizon: int, context_length: int, seed: int) -> dict[str, float]:
    from domainfm.data_loaders.timeseries import left_pad_batch
    from domainfm.experiment.forecast_metrics import forecast_scores

    context = left_pad_batch([w["context"] for w in windows], min(context_length, model.context_length))
    with torch.no_grad():
        samples = model.predict(context, horizon, num_samples=20, seed=seed).numpy()
    return forecast_scores(windows, samples, LEVELS)


def summary(values: list[float]) -> str:
    v = np.asarray(values, dtype=np.float64)
    return f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help="registered tags (pretrained=True) or LABEL=PATH folders")
    parser.add_argument("--random", default=None, help="also this variant at random init (one init per seed)")
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[24, 48, 96, 256])
    parser.add_argument("--origins", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--horizon", type=int, default=12)
    parser.add_argument("--scaling-window", type=int, default=None,
                        help="also each model with its tokenizer's scaling_window set to this (inference only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"CPU: {cpu_description()}; torch {torch.__version__}; {torch.get_num_threads()} thread(s)")
    splits = origin_windows(args.horizon, args.origins)
    print(f"held out: {len(splits[0])} series of statsmodels_series.csv x {args.origins} origins, horizon {args.horizon}; "
          f"seeds {args.seeds}")
    models = {spec.partition("=")[0]: load(spec) for spec in args.models}
    if args.scaling_window:
        for spec in args.models:
            model = load(spec)
            model.tokenizer.scaling_window = args.scaling_window
            models[f"{spec.partition('=')[0]} (scaling_window {args.scaling_window})"] = model
    from domainfm.experiment.forecast_metrics import forecast_scores

    for length in args.context_lengths:
        start = time.perf_counter()
        rows: dict[str, tuple[list[float], list[float]]] = {}
        for o, windows in enumerate(splits):
            base = forecast_scores(windows, None, LEVELS, baselines=BASELINES, context_length=length)
            for b in BASELINES:
                mase, wql = rows.setdefault(b, ([], []))
                mase.append(base[f"{b}_mase_rel"])
                wql.append(base[f"{b}_wql_rel"])
            for seed in args.seeds:
                for name, model in models.items():
                    s = model_scores(model, windows, args.horizon, length, seed)
                    rows.setdefault(name, ([], []))[0].append(s["mase_rel"])
                    rows[name][1].append(s["wql_rel"])
                if args.random:
                    import domainfm

                    torch.manual_seed(seed)
                    random_model = domainfm.create_model(args.random).eval()
                    s = model_scores(random_model, windows, args.horizon, length, seed)
                    rows.setdefault(f"{args.random} (random init)", ([], []))[0].append(s["mase_rel"])
                    rows[f"{args.random} (random init)"][1].append(s["wql_rel"])
        print(f"\ncontext length {length} ({time.perf_counter() - start:.0f} s): geometric mean over datasets, "
              "relative to seasonal naive (1.000)")
        print(f"  {'':<44} {'MASE rel.':>16} {'WQL rel.':>16}")
        for name, (mase, wql) in rows.items():
            print(f"  {name:<44} {summary(mase):>16} {summary(wql):>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
