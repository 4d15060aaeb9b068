"""The ``domainfm`` console script.

    domainfm list [PATTERN] [--pretrained] [--family F]
    domainfm info NAME
    domainfm download NAME [--source URL]
    domainfm pretrain FAMILY [--config FILE] [--name RUN] [--precision P] [key=value ...]
    domainfm finetune FAMILY [--config FILE] [--name RUN] [--precision P] [key=value ...]
    domainfm evaluate RUN_DIR
    domainfm predict FAMILY --model MODEL_OR_RUN_DIR --input PATH --output PATH [family options]
    domainfm embed FAMILY --model MODEL_OR_RUN_DIR --input PATH --output PATH [family options]
    domainfm export MODEL_OR_RUN_DIR --output FILE [--format onnx|pt2] [--input-shape SHAPE ...]

Options of ``domainfm`` itself (``--debug``: show the traceback of a user error) may stand anywhere
on the command line, before or after the subcommand and among a predict/embed family's own
arguments (no family defines them); a ``--`` ends their search.

A family plugs in by providing ``domainfm.<kind>.<family>`` (kind = pretrain or finetune) with a
dataclass ``Config`` and ``run(cfg, run_dir) -> dict``; its default config is the shipped
``configs/<family>/<kind>.yaml``, which runs on the family's embedded data with nothing to
download. Each run writes ``runs/<family>/<name>/`` with ``config.yaml``, ``run.json``,
``metrics.jsonl``, ``checkpoints/`` and ``report.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from domainfm import distributed
from domainfm.launch import config_file as _config_file, family_entry

__all__ = ["main", "family_entry", "print_table"]


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

    # answered from the families' manifests: no family (timm, torch_geometric, ...) is imported
    names = list_models(args.pattern, pretrained=args.pretrained, family=args.family)
    models = set(list_models()) if args.pretrained else set()
    for name in names:
        card = zoo.card_view(name)
        if args.pretrained:
            # one line per weight source: where it lives, how it is verified, its licence
            tag = None if name in models else name.rsplit(".", 1)[1]  # "<model>.<tag>"
            for source in (zoo.WeightSource(**w) for w in card["weights"] if tag is None or w.get("tag") == tag):
                rev = f"@{source.revision}" if source.revision and "@" not in source.url else ""
                print(f"{name:<40} {card['family']:<10} {source.url}{rev}  licence={source.license}  "
                      f"verified={source.pinned}")
        else:
            flag = "pretrained" if card["weights"] else "-"
            print(f"{name:<40} {card['family']:<12} {flag}")
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
        for url, path, digest in hub.download(source, progress=not args.quiet):
            print(f"{url} -> {path} (sha256 {digest}, verified: {source.pinned})")
    return 0


def _run_family(kind: str, args) -> int:
    from domainfm import config as cfgmod
    from domainfm.experiment import RunFolder, RunFolderError, print_table as print_arms

    module = family_entry(kind, args.family)
    config_file = _config_file(args.family, kind, args.config)
    if getattr(args, "precision", None) is not None:
        args.overrides = list(args.overrides) + [f"train.precision={args.precision}"]
    overrides = list(args.overrides)
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if keys & {"model.name", "model.pretrained"} and "model.prefer" not in keys:
        overrides.append("model.prefer=null")  # a model or weights named on the command line are used as named
    raw = cfgmod.apply_overrides(cfgmod.load_yaml(config_file), overrides)
    if raw.get("model", {}).get("prefer") is None:
        raw.get("model", {}).pop("prefer", None)  # configs of commands without the key stay valid
    cfg = cfgmod.from_dict(module.Config, raw)
    resume = bool(getattr(getattr(cfg, "train", None), "resume", False))
    if distributed.launch_rank() != 0:
        return _run_follower(module, cfg, kind, args)
    name = args.name or f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(args.runs_dir) / args.family / name
    if resume and not (path / "run.json").is_file():
        raise RunFolderError(
            f"train.resume=true but there is nothing to resume in {path}: no run there (no run.json)\n"
            "  -> drop train.resume=true to start a new run, or name the run to continue with --name")
    folder = RunFolder.create(path, resume=resume)  # refuses a used name, or a folder in use
    try:
        changed: list[str] = []
        if resume:
            # the run's config.yaml and run.json stay as they are until the resumed run succeeds
            changed = _check_resume_config(folder, cfg)
        else:
            folder.write_config(cfg)
            folder.write_meta(family=args.family, kind=kind, name=name, config_source=str(config_file),
                              overrides=list(args.overrides))
        print(f"domainfm {kind} {args.family}: run folder {folder.path}" + (" (resumed)" if resume else ""))
        _seed(cfg)
        # the ranks Fabric launches from inside run() inherit this and use the same folder
        os.environ[distributed.RUN_DIR_ENV] = str(folder.path.resolve())
        start = time.perf_counter()
        report = dict(module.run(cfg, folder.path) or {})
        report.setdefault("family", args.family)
        report.setdefault("kind", kind)
        report["wall_time_s"] = round(time.perf_counter() - start, 2)
        if changed:
            report["resume_changed"] = changed
        if resume:
            meta = folder.read_meta()
            meta["resumes"] = list(meta.get("resumes", [])) + [
                {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "overrides": list(args.overrides), "changed": changed}]
            folder.write_config(cfg)
            folder.write_json(folder.meta_file.name, meta)
        folder.write_report(report)
        if kind == "finetune" and not getattr(cfg, "keep_checkpoints", True):
            freed = folder.prune_checkpoints()
            if freed:
                print(f"[domainfm] finished: kept each arm's selected model, removed {freed / 2**20:.0f} MB of training "
                      "checkpoints (keep_checkpoints=true keeps them)", file=sys.stderr, flush=True)
    except BaseException:
        if not resume:
            _discard_if_unused(folder)
        raise
    finally:
        folder.release()
    title = f"\n{args.family} {kind} report ({folder.report_file})"
    if isinstance(report.get("arms"), dict):
        print_arms(report, title=title)
    else:
        flat = {k: v for k, v in report.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
        print_table(flat, title=title)
    _print_outputs(folder.path, report)
    return 0


def _seed(cfg) -> None:
    seed = getattr(getattr(cfg, "train", None), "seed", None)
    if seed is not None:
        # before run() builds the model: the same config gives the same initial weights
        from lightning_fabric.utilities.seed import seed_everything

        seed_everything(seed, verbose=False)


def _run_follower(module, cfg, kind: str, args) -> int:
    """A rank other than 0 of a multi-process run: rank 0 owns the run folder (its lock, config,
    report, checkpoints, saved model); this rank trains in step with it, resumes from the same
    folder, and writes nothing there."""
    from domainfm.atomic import follower_writes
    from domainfm.errors import InputError

    given = os.environ.get(distributed.RUN_DIR_ENV)
    if given:
        path = Path(given)
    elif args.name:
        path = (Path(args.runs_dir) / args.family / args.name).resolve()
    else:
        raise InputError(
            f"domainfm {kind} {args.family}: process rank {distributed.launch_rank()} of a multi-process launch "
            "(torchrun/srun) cannot know the run folder rank 0 opens\n"
            "  -> give every rank the same --name")
    _seed(cfg)
    with follower_writes():
        module.run(cfg, path)
    return 0


def _cmd_prepare(args) -> int:
    from domainfm import streaming

    module = family_entry("pretrain", args.family)
    preparation = getattr(module, "PREPARE", None)
    if not isinstance(preparation, streaming.Preparation):
        from domainfm.errors import InputError

        raise InputError(f"domainfm prepare: family {args.family!r} declares no corpus preparation "
                         f"(domainfm.pretrain.{args.family}.PREPARE); its pretraining reads its data in memory")
    manifest = streaming.prepare_family(args.family, preparation, args.input, args.output, overrides=args.overrides,
                                        num_workers=args.workers, files_per_part=args.files_per_part)
    print(f"domainfm prepare {args.family}: {manifest['samples']} samples from {len(manifest['inputs'])} files "
          f"in {args.output} ({len(manifest['parts'])} parts; manifest {streaming.MANIFEST})")
    print(f"  -> domainfm pretrain {args.family} data.kind=streaming data.path={args.output}")
    return 0


def _print_outputs(run_dir: Path, report: dict) -> None:
    """The files a person opens next: report.md and every picture of the run and its arms."""
    markdown = run_dir / "report.md"
    if markdown.is_file():
        print(f"\nreport: {markdown}")
    pictures = [(name, path) for name, path in (report.get("pictures") or {}).items()]
    for arm, result in (report.get("arms") or {}).items():
        if isinstance(result, dict):
            pictures += [(f"{arm}/{name}", path) for name, path in (result.get("pictures") or {}).items()]
    for name, path in pictures:
        shown = Path(path) if Path(path).is_absolute() else run_dir / path
        print(f"picture {name}: {shown}")


#: config sections whose change makes a checkpoint unusable (the architecture and its adaptation):
#: never changed by a resume
_RESUME_FIXED = ("model", "adapt", "stages", "arms")
#: the keys a resume may change freely: how long to train and how to log it, never what is trained
_RESUME_FREE = frozenset({"train.resume", "train.resume_changed", "train.max_epochs", "train.max_steps",
                          "train.progress", "train.log_every_steps", "train.checkpoint_every_steps",
                          "train.num_workers", "train.loggers", "train.eval_batch_size"})


def _check_resume_config(folder, cfg) -> list[str]:
    """Refuse a resume whose config changes what the checkpoints were trained as (any section
    other than the free keys above: the task, the data, the optimiser); with
    ``train.resume_changed=true`` the data/task/optimiser changes are accepted and returned, to
    be recorded, but the architecture stays locked."""
    import yaml

    from domainfm import config as cfgmod
    from domainfm.experiment import RunFolderError

    if not folder.config_file.is_file():
        raise RunFolderError(f"train.resume=true but {folder.path} has no config.yaml to resume")
    saved = yaml.safe_load(folder.config_file.read_text()) or {}
    try:
        # a key added to the config since the run was saved means its default there
        saved = cfgmod.to_dict(cfgmod.from_dict(type(cfg), saved))
    except (TypeError, ValueError, KeyError):
        pass  # a key since removed: compared as written, and named in the refusal
    now = cfgmod.to_dict(cfg)
    fixed, other = [], []
    for section in sorted(set(now) | set(saved), key=str):
        diffs = [d for d in _diff(saved.get(section), now.get(section), section) if d.split(":")[0] not in _RESUME_FREE]
        (fixed if section in _RESUME_FIXED else other).extend(diffs)
    allow = bool(getattr(getattr(cfg, "train", None), "resume_changed", False))
    refused = fixed + ([] if allow else other)
    if refused:
        hint = ("  -> resume with the run's own settings (its config.yaml), or start a new run with another --name"
                + ("" if fixed else "; train.resume_changed=true accepts the change and records it in the run"))
        raise RunFolderError(
            f"cannot resume {folder.path}: the config changes what its checkpoints were trained as ("
            + "; ".join(refused[:5]) + (" ..." if len(refused) > 5 else "") + ")\n" + hint)
    return other


def _diff(old, new, where: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{where}.{key}")
        return out
    if isinstance(old, tuple):
        old = list(old)
    if isinstance(new, tuple):
        new = list(new)
    return [] if old == new else [f"{where}: {old!r} in config.yaml, {new!r} now"]


def _discard_if_unused(folder) -> None:
    """A new run that failed before producing anything leaves no folder behind, so its name can
    be used again; one that produced anything (logs, checkpoints) is kept."""
    import contextlib

    from domainfm.atomic import TMP_MARK

    own = {folder.config_file.name, folder.meta_file.name, folder.lock_file.name}
    files = [p for p in folder.path.rglob("*") if p.is_file() and TMP_MARK not in p.name]
    if any(p.parent != folder.path or p.name not in own for p in files):
        return
    for p in files:
        if p.name != folder.lock_file.name:
            p.unlink()
    folder.release()
    with contextlib.suppress(OSError):
        for d in sorted((p for p in folder.path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            d.rmdir()
        folder.path.rmdir()


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


def _cmd_apply(command: str, args) -> int:
    """``predict`` / ``embed``: ``domainfm.finetune.<family>.<command>_main(argv)`` parses the
    family's arguments (``--model``, ``--input``, ``--output`` and its own) and writes the output."""
    module = family_entry("finetune", args.family)
    applier = getattr(module, "APPLY", None)
    if applier is not None:
        from domainfm.experiment import apply

        applier.command(command)  # a family without this command: one-line error
        return apply.main(command, applier, args.rest)
    entry = getattr(module, f"{command}_main", None)
    if entry is None:
        print(f"family {args.family!r} has no {command} command", file=sys.stderr)
        return 2
    return int(entry(args.rest) or 0)


def _cmd_export(args) -> int:
    """``domainfm export``: :func:`domainfm.export.export` (torch.onnx and onnx load only here)."""
    from domainfm.export import export

    result = export(args.model, args.output, format=args.format, opset=args.opset,
                    dynamic_batch=not args.static_batch, input_shapes=args.input_shape,
                    features=args.features, pretrained=args.pretrained, arm=args.arm)
    print(result.summary())
    return 0


#: options of the ``domainfm`` command itself -> their help; recognised anywhere before ``--``
GLOBAL_FLAGS = {
    "--debug": "show the full traceback of an error (user errors are otherwise one line); "
               "also DOMAINFM_DEBUG=1",
}

#: commands that compute (and so read --precision / train.precision / DOMAINFM_PRECISION)
_COMPUTING = ("pretrain", "finetune", "evaluate", "predict", "embed")


def split_global_flags(argv: Sequence[str]) -> tuple[list[str], set[str]]:
    """``argv`` without the global flags, and the set of those given. The same rule for every
    subcommand: a global flag may stand anywhere up to a ``--`` (which ends options)."""
    rest: list[str] = []
    given: set[str] = set()
    for i, arg in enumerate(argv):
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg in GLOBAL_FLAGS:
            given.add(arg)
        else:
            rest.append(arg)
    return rest, given


def _precision_error(command: str, argv: Sequence[str]) -> str | None:
    """The one-line error for a precision no command accepts (``--precision`` among ``argv``, or
    ``DOMAINFM_PRECISION``), else None. Checked before anything is built or written."""
    if command not in _COMPUTING:
        return None
    from domainfm.precision import PRECISIONS

    allowed = ", ".join(PRECISIONS)
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        value = None
        if arg == "--precision" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--precision="):
            value = arg.split("=", 1)[1]
        if value is not None and value not in PRECISIONS:
            return f"argument --precision: invalid value {value!r} (allowed: {allowed})"
    env = os.environ.get("DOMAINFM_PRECISION", "").strip()
    if env and env not in PRECISIONS:
        return f"environment variable DOMAINFM_PRECISION={env!r}: invalid value (allowed: {allowed})"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="domainfm", description="Domain foundation models: zoo, weights, pretraining and fine-tuning.")
    # the global flags are taken out of argv before parsing (see split_global_flags); declared on
    # every parser so that each --help shows them
    glob = argparse.ArgumentParser(add_help=False)
    for flag, text in GLOBAL_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=text)
        glob.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[glob], **kwargs)

    p = add("list", help="list registered models", description="List registered models (fnmatch pattern).")
    p.add_argument("pattern", nargs="?", default="*")
    p.add_argument("--pretrained", action="store_true",
                   help="only models with a weight source; shows each source, its licence and how it is verified")
    p.add_argument("--family", default=None)
    p.set_defaults(func=_cmd_list)

    p = add("info", help="print a model card", description="Print a model's card as JSON.")
    p.add_argument("name")
    p.set_defaults(func=_cmd_info)

    p = add("download", help="download and verify a model's weights into the cache",
                       description="Download a model's weights (hf:// and timm:// sources into the Hugging Face "
                                   "cache, others into $DOMAINFM_HOME) and verify their sha256.")
    p.add_argument("name")
    p.add_argument("--source", default=None, help="one of the card's weight URLs (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_download)

    for kind in ("pretrain", "finetune"):
        p = add(kind, help=f"{kind} a model family (default config runs on embedded data)",
                           description=f"Run {kind}ing for FAMILY with its config (default configs/FAMILY/{kind}.yaml) "
                                       "and key=value overrides, e.g. train.lr=1e-4 train.max_epochs=2.")
        p.add_argument("family")
        p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
        p.add_argument("--config", default=None, help="YAML config file")
        p.add_argument("--name", default=None, help="run name (default: timestamp)")
        p.add_argument("--runs-dir", default="runs", help="root folder of runs (default: ./runs)")
        p.add_argument("--precision", default=None,
                       help="shorthand for the override train.precision=P (auto, 32-true, bf16-mixed, ...)")
        p.set_defaults(func=lambda a, k=kind: _run_family(k, a))

    p = add("prepare", help="convert a pretraining corpus once into streamed shards (LitData)",
            description="Convert FAMILY's pretraining files (--input: files, folders or globs) into LitData "
                        "shards in --output, in parallel over files; a run started again finishes an interrupted "
                        "one. key=value arguments set the family's preprocessing; pretrain with data.kind=streaming "
                        "data.path=OUTPUT (or its copy in s3://...).")
    p.add_argument("family")
    p.add_argument("overrides", nargs="*", help="key=value preprocessing settings of the family")
    p.add_argument("--input", nargs="+", required=True, help="input files, folders or globs")
    p.add_argument("--output", required=True, help="the corpus folder to write")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per CPU)")
    p.add_argument("--files-per-part", type=int, default=16,
                   help="files converted per part; a part is the unit an interrupted run does again (default 16)")
    p.set_defaults(func=_cmd_prepare)

    p = add("evaluate", help="evaluate a finished run's best checkpoint",
                       description="Evaluate RUN_DIR's best checkpoint with its saved config.")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", help="key=value overrides (e.g. data.root=OTHER)")
    p.set_defaults(func=_cmd_evaluate)

    for command, what in (("predict", "predictions"), ("embed", "embeddings")):
        p = add(command, help=f"apply a model to a file of the family's format: {what}",
                           description=f"Write FAMILY's {what} for --input (the family's own file format) to "
                                       f"--output with --model (a registered name, a saved model folder or a run "
                                       f"folder); arguments after FAMILY are the family's (see "
                                       f"`domainfm {command} FAMILY --help`).")
        p.add_argument("family")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda a, c=command: _cmd_apply(c, a))

    p = add("export", help="export a model to ONNX or a torch.export program (.pt2)",
            description="Write MODEL (a registered name, a saved model folder or a run folder) as an ONNX file "
                        "or a torch.export program, traced with its model card's example input; the file is "
                        "checked (ONNX: onnx.checker, and onnxruntime against the model's outputs when it is "
                        "installed; .pt2: reloaded and run) before it is written.")
    p.add_argument("model", metavar="MODEL", help="a registered model name, a save_pretrained folder, or a run folder")
    p.add_argument("--output", required=True, help="the file to write (.onnx or .pt2; written atomically)")
    p.add_argument("--format", default=None, help="onnx or pt2 (default: from --output's extension)")
    p.add_argument("--pretrained", default=None,
                   help="with a model name: the weights (a path, URL or hf:// source; 'none' for random init; "
                        "default the card's own)")
    p.add_argument("--arm", default=None, help="with a run folder: the arm whose model to export (default the first)")
    p.add_argument("--input-shape", action="append", default=None, metavar="SHAPE",
                   help="the shape of an input, e.g. 2,19,6000 (or 2,168,22:bool), once per input in order; "
                        "default: the model card's example input, resized to the model's own sizes")
    p.add_argument("--features", action="store_true",
                   help="export forward_features (the embedding) instead of forward: a backbone without a head")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset version (default the exporter's)")
    p.add_argument("--static-batch", action="store_true",
                   help="keep the example's batch size fixed (default: a free batch dimension where the model allows)")
    p.set_defaults(func=_cmd_export)
    return parser


def _user_error_types() -> tuple[type, ...]:
    from domainfm import hub
    from domainfm.config import ConfigError
    from domainfm.engine import ResumeError
    from domainfm.errors import InputError
    from domainfm.experiment import RunFolderError, WeightsUnavailable
    from domainfm.precision import PrecisionError
    from domainfm.zoo import UnknownModelError

    # OSError covers what the readers raise about a file they cannot read (h5py's "file signature
    # not found", rasterio's RasterioIOError) and an output path that is read-only, a folder or a
    # file standing where a folder must be
    return (ConfigError, RunFolderError, ResumeError, WeightsUnavailable, hub.HubError, OSError,
            UnknownModelError, PrecisionError, InputError)


def _is_reader_error(exc: BaseException) -> bool:
    """pandas' parser errors (an empty or malformed CSV): ValueError subclasses from pandas."""
    return isinstance(exc, ValueError) and type(exc).__module__.startswith("pandas")


def is_user_error(exc: BaseException) -> bool:
    """Errors about the user's input (config, data, weights, run folder, model name, precision):
    reported in one line, not as a traceback. Data errors are the ``ValueError`` subclasses the
    data loaders define; a precision no one accepts is :class:`domainfm.precision.PrecisionError`."""
    if isinstance(exc, _user_error_types()) or _is_reader_error(exc):
        return True
    return isinstance(exc, ValueError) and any(
        c.__module__.startswith(("domainfm.data_loaders", "data_loaders")) for c in type(exc).__mro__
        if issubclass(c, ValueError) and c is not ValueError)


def _one_line_message(exc: BaseException, args) -> str:
    """The message of a user error, naming the file: an OSError's own file name when it has one,
    else (a reader's error about the input's contents) the ``--input`` the command was given."""
    message = str(exc).strip() or type(exc).__name__
    filename = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
    if filename is not None:
        if exc.strerror:  # "[Errno 13] Permission denied: 'x'" -> "x: Permission denied"
            return f"{filename}: {exc.strerror}"
        return message if str(filename) in message else f"{filename}: {message}"
    source = getattr(args, "input", None)
    if (isinstance(exc, OSError) or _is_reader_error(exc)) and source and str(source) not in message:
        message = f"{source}: {message}"
    return message


_DEBUG_HINT = "  (run again with --debug for the traceback)"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Notices to the user (a dropped channel, a truncated file) as one line, not with the source
    line that raised them; other warnings keep their category."""
    if category is UserWarning:
        return f"warning: {message}\n"
    return f"{category.__name__}: {message} ({filename}:{lineno})\n"


def main(argv: Sequence[str] | None = None) -> int:
    as_script = argv is None  # the console script: its notices are one line each
    argv, flags = split_global_flags(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in flags or os.environ.get("DOMAINFM_DEBUG", "").strip() in {"1", "true", "yes"}
    if as_script and not debug:
        import warnings

        warnings.formatwarning = _one_line_warning
    parser = build_parser()
    # key=value overrides may also follow --options (argparse stops filling a positional list
    # at the first option); anything else left over is an error as usual
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    bad_precision = _precision_error(args.command, argv)
    if bad_precision:
        print(f"domainfm {args.command}: error: {bad_precision}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except Exception as exc:  # noqa: BLE001 - user errors become one line; anything else propagates
        if debug or not is_user_error(exc):
            raise
        message = _one_line_message(exc, args)
        first, *rest = message.splitlines()
        print(f"domainfm {args.command}: error: {first}", file=sys.stderr)
        for line in rest:
            print(line, file=sys.stderr)
        print(_DEBUG_HINT, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
