"""The ``domainfm`` console script.

    domainfm list [PATTERN] [--pretrained] [--family F]
    domainfm info NAME
    domainfm download NAME [--source URL]
    domainfm pretrain FAMILY [--config FILE] [--name RUN] [key=value ...]
    domainfm finetune FAMILY [--config FILE] [--name RUN] [key=value ...]
    domainfm evaluate RUN_DIR
    domainfm predict FAMILY [family-specific arguments]

A family plugs in by providing ``domainfm.<kind>.<family>`` (kind = pretrain or finetune) with a
dataclass ``Config`` and ``run(cfg, run_dir) -> dict``; its default config is the shipped
``configs/<family>/<kind>.yaml``, which runs on the family's embedded data with nothing to
download. Each run writes ``runs/<family>/<name>/`` with ``config.yaml``, ``run.json``,
``metrics.jsonl``, ``checkpoints/`` and ``report.json``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "family_entry", "print_table"]


def family_entry(kind: str, family: str):
    """Import ``domainfm.<kind>.<family>`` and check that it provides ``Config`` and ``run``."""
    module_name = f"domainfm.{kind}.{family}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        from domainfm import list_families

        raise SystemExit(
            f"domainfm {kind}: no {kind} entry for family {family!r} (module {module_name}). "
            f"Families with models: {', '.join(list_families()) or 'none'}"
        ) from None
    for attr in ("Config", "run"):
        if not hasattr(module, attr):
            raise SystemExit(f"{module_name} must define {attr!r} to be run by the CLI")
    return module


def print_table(rows: dict[str, Any], title: str | None = None, file=None) -> None:
    file = file or sys.stdout
    if title:
        print(title, file=file)
    width = max((len(k) for k in rows), default=0)
    for key, value in rows.items():
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {text}", file=file)


def _cmd_list(args) -> int:
    from domainfm import list_models, zoo

    names = list_models(args.pattern, pretrained=args.pretrained, family=args.family)
    for name in names:
        card = zoo.get_card(name)
        flag = "pretrained" if card.has_pretrained else "-"
        print(f"{name:<40} {card.family:<12} {flag}")
    if not names:
        print("no models match", file=sys.stderr)
    return 0


def _cmd_info(args) -> int:
    from domainfm import model_info

    print(json.dumps(model_info(args.name), indent=2))
    return 0


def _cmd_download(args) -> int:
    from domainfm import hub, zoo

    card = zoo.get_card(args.name)
    sources = [w for w in card.weights if args.source in (None, w.url)]
    if not sources:
        print(f"{args.name} has no weight source {args.source or ''}".strip(), file=sys.stderr)
        return 1
    for source in sources:
        path = hub.fetch(source.url, source.sha256)
        print(f"{source.url} -> {path} (sha256 {source.sha256})")
    return 0


def _run_family(kind: str, args) -> int:
    from domainfm import config as cfgmod
    from domainfm.experiment import RunFolder, print_table as print_arms

    module = family_entry(kind, args.family)
    config_file = Path(args.config) if args.config else cfgmod.config_path(args.family, kind)
    raw = cfgmod.apply_overrides(cfgmod.load_yaml(config_file), args.overrides)
    cfg = cfgmod.from_dict(module.Config, raw)
    name = args.name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    resume = bool(getattr(getattr(cfg, "train", None), "resume", False))
    folder = RunFolder.create(Path(args.runs_dir) / args.family / name, resume=resume)
    folder.write_config(cfg)
    folder.write_meta(family=args.family, kind=kind, name=name, config_source=str(config_file),
                      overrides=list(args.overrides))
    print(f"domainfm {kind} {args.family}: run folder {folder.path}")
    seed = getattr(getattr(cfg, "train", None), "seed", None)
    if seed is not None:
        # before run() builds the model: the same config gives the same initial weights
        from lightning_fabric.utilities.seed import seed_everything

        seed_everything(seed, verbose=False)
    start = time.perf_counter()
    report = dict(module.run(cfg, folder.path) or {})
    report.setdefault("family", args.family)
    report.setdefault("kind", kind)
    report["wall_time_s"] = round(time.perf_counter() - start, 2)
    folder.write_report(report)
    title = f"\n{args.family} {kind} report ({folder.report_file})"
    if isinstance(report.get("arms"), dict):
        print_arms(report, title=title)
    else:
        flat = {k: v for k, v in report.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        print_table(flat, title=title)
    return 0


def _cmd_evaluate(args) -> int:
    from domainfm import config as cfgmod
    from domainfm.experiment import RunFolder, RunFolderError, print_table as print_arms

    folder = RunFolder(args.run_dir)
    try:
        meta = folder.read_meta()
    except RunFolderError as exc:
        print(exc, file=sys.stderr)
        return 2
    module = family_entry(meta["kind"], meta["family"])
    if not hasattr(module, "evaluate"):
        print(f"domainfm.{meta['kind']}.{meta['family']} has no evaluate()", file=sys.stderr)
        return 2
    cfg = cfgmod.from_dict(module.Config, cfgmod.apply_overrides(cfgmod.load_yaml(folder.config_file), args.overrides))
    metrics = dict(module.evaluate(cfg, folder.path) or {})
    folder.write_json("evaluation.json", metrics)
    if isinstance(metrics.get("arms"), dict):
        print_arms(metrics, title=f"evaluation of {folder.path}")
        if "max_abs_diff_val" in metrics:
            print(f"  largest difference from the run's validation metrics: {metrics['max_abs_diff_val']:.3g}")
    else:
        print_table({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}, title=f"evaluation of {folder.path}")
    return 0


def _cmd_predict(args) -> int:
    module = family_entry("finetune", args.family)
    if not hasattr(module, "predict"):
        print(f"family {args.family!r} has no predict command", file=sys.stderr)
        return 2
    return int(module.predict(args.rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="domainfm", description="Domain foundation models: zoo, weights, pretraining and fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="list registered models", description="List registered models (fnmatch pattern).")
    p.add_argument("pattern", nargs="?", default="*")
    p.add_argument("--pretrained", action="store_true", help="only models with pretrained weights")
    p.add_argument("--family", default=None)
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("info", help="print a model card", description="Print a model's card as JSON.")
    p.add_argument("name")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("download", help="download and verify a model's weights into the cache",
                       description="Download a model's weights into $DOMAINFM_HOME and verify their sha256.")
    p.add_argument("name")
    p.add_argument("--source", default=None, help="one of the card's weight URLs (default: all)")
    p.set_defaults(func=_cmd_download)

    for kind in ("pretrain", "finetune"):
        p = sub.add_parser(kind, help=f"{kind} a model family (default config runs on embedded data)",
                           description=f"Run {kind}ing for FAMILY with its config (default configs/FAMILY/{kind}.yaml) "
                                       "and key=value overrides, e.g. train.lr=1e-4 train.max_epochs=2.")
        p.add_argument("family")
        p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("--name", default=None, help="run name (default: timestamp)")
        p.add_argument("--runs-dir", default="runs", help="root folder of runs (default: ./runs)")
        p.set_defaults(func=lambda a, k=kind: _run_family(k, a))

    p = sub.add_parser("evaluate", help="evaluate a finished run's best checkpoint",
                       description="Evaluate RUN_DIR's best checkpoint with its saved config.")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. data.root=OTHER)")
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("predict", help="family-specific prediction (e.g. forecasts)",
                       description="Run FAMILY's predict command; arguments after FAMILY are the family's.")
    p.add_argument("family")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_predict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # key=value overrides may also follow --options (argparse stops filling a positional list
    # at the first option); anything else left over is an error as usual
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
