"""Predict and embed, written once: ``domainfm predict|embed FAMILY`` and the Python
:func:`predict` / :func:`embed` for every family.

A family declares only what it knows (``finetune/<family>.py``)::

    @dataclass
    class Options:                                    # its own options, generated as --stride-s ...
        stride_s: float | None = option(None, "window step in seconds", type=positive_float)

    APPLY = Applier(
        family="cbramod", input="an EEG recording (EDF/BDF/FIF/.vhdr/.set)", options=Options,
        settings=inference_settings,                  # fn(ref, model) -> how inputs become model inputs
        read=read,                                    # fn(source, settings, options) -> the family's inputs
        predict=Command(predict_outputs, writes=TABLE, needs_head=True),
        embed=Command(embed_outputs, writes=ARRAYS, default_model="cbramod-base"))

where a command's function is ``fn(inputs, model, settings, options, run) -> Output``.

The layer owns the rest: the shared options (``--model NAME|FOLDER|RUN``, ``--arm``,
``--pretrained``, ``--input``, ``--output``, ``--precision``, ``--device``, ``--batch-size``),
resolving the model once (:func:`resolve`), the run's or model folder's recorded settings
(:class:`ModelRef`), device, autocast and batching (:meth:`Runtime.batched`), and writing outputs
by type (table -> CSV/Parquet, arrays -> NPZ, AnnData -> h5ad, raster -> GeoTIFF, figure -> PNG),
every file of one command committed together, after every output path was checked and before
anything was computed.

Python: ``domainfm.predict(model, inputs, **options)`` and ``domainfm.embed(...)`` return the
output's value in one convention per type: a ``pandas.DataFrame`` (table), a ``dict`` of numpy
arrays (arrays), an ``AnnData`` or a :class:`Raster`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from domainfm.errors import InputError

__all__ = ["Applier", "Command", "Output", "Raster", "Runtime", "ModelRef", "option", "resolve", "run", "main",
           "predict", "embed", "applier_of", "family_of_model", "SETTINGS_FILE", "write_settings", "RUN_RECORD",
           "write_run_record",
           "TABLE", "ARRAYS", "ANNDATA", "RASTER", "FIGURE"]

#: written beside a fine-tuned arm's saved model: how inputs become its inputs (a model folder is
#: self-describing: copied elsewhere, it predicts as it was trained)
SETTINGS_FILE = "apply_settings.json"

#: written beside every arm's saved model at the end of a fine-tuning run: the run's family, config
#: and report, so that a model folder copied out of its run applies as it was trained
RUN_RECORD = "run_record.json"

#: output kinds -> the file extensions each is written as
TABLE = (".csv", ".parquet", ".tsv")
ARRAYS = (".npz",)
ANNDATA = (".h5ad",)
RASTER = (".tif", ".tiff")
FIGURE = (".png", ".pdf", ".svg")


# --------------------------------------------------------------------------- declarations


def option(default: Any = None, help: str = "", *, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, flag: str | None = None, output: Sequence[str] | None = None,
           default_from: str | None = None, commands: Sequence[str] | None = None) -> Any:
    """A family option: a dataclass field whose metadata makes its command-line flag.

    ``type`` parses the text (default from the annotation: ``int`` -> an integer >= 1, ``float``
    -> a finite number > 0, ``list[str]`` -> comma-separated names, ``bool`` -> a switch);
    ``output``: the option names a second output file, of these extensions (written together
    with ``--output``); ``default_from``: for an output, its default is ``--output`` with this
    extension; ``commands``: the commands that offer it (default both)."""
    meta = {"help": help, "type": type, "choices": choices, "flag": flag, "commands": tuple(commands or ()),
            "output": tuple(output) if output else None, "default_from": default_from}
    if isinstance(default, (list, dict)):
        return field(default_factory=default.copy, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Command:
    """One of a family's commands: ``run(inputs, model, settings, options, runtime) -> Output``.

    ``writes``: the extensions ``--output`` may have (:data:`TABLE`, :data:`ARRAYS`, ...);
    ``default_model``: the model used without ``--model``; ``default_pretrained``: its weights
    when ``--pretrained`` is not given (a card that pins none); ``needs_head``: refuse a headless
    backbone (a pretrained model), pointing at ``embed``."""

    run: Callable[..., "Output"]
    writes: Sequence[str]
    default_model: str | None = None
    default_pretrained: str | None = None
    needs_head: bool = False
    what: str = ""


@dataclass(frozen=True)
class Applier:
    """A family's predict/embed declaration (see the module docstring)."""

    family: str
    input: str
    read: Callable[[Any, Any, Any], Any]
    settings: Callable[["ModelRef", Any], Any] | None = None
    options: type | None = None
    predict: Command | None = None
    embed: Command | None = None
    batch_size: int = 32
    description: str = ""
    has_head: Callable[[Any], bool] = lambda model: getattr(model, "head", None) is not None
    #: names ``--input`` takes besides files: the family's shipped samples, resolved by its ``read``
    samples: Sequence[str] = ()

    def command(self, name: str) -> Command:
        cmd = getattr(self, name, None)
        if cmd is None:
            raise InputError(f"family {self.family!r} has no {name} command")
        return cmd


@dataclass
class Raster:
    """A georeferenced array: ``data`` (bands, H, W) or (H, W) and the rasterio ``profile`` of its
    grid (crs, transform, nodata, creation options such as compress), with two keys that are set
    after the pixels: ``descriptions`` (one name per band) and ``tags`` (the file's metadata)."""

    data: Any
    profile: dict[str, Any]


@dataclass
class Output:
    """What a command returns: its ``value`` (written to ``--output``), ``extras`` keyed by the
    option that names their path (a figure for ``--plot``), and the line printed after writing."""

    value: Any
    extras: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


# --------------------------------------------------------------------------- the model and its settings


@dataclass
class ModelRef:
    """What ``--model`` named: a registered name (``name``), a ``save_pretrained`` folder
    (``model_dir``) or a run folder (``run``, whose arm ``arm`` holds ``<arm>/model``)."""

    arg: Any
    arm: str | None = None
    model_dir: Path | None = None
    run: Path | None = None

    @classmethod
    def of(cls, model: Any, arm: str | None = None) -> "ModelRef":
        from domainfm.experiment.inference import resolve_model_dir, run_root

        if not isinstance(model, (str, Path)):
            return cls(model, arm)
        model_dir = resolve_model_dir(model, arm)
        return cls(model, arm, model_dir, run_root(model_dir or model))

    @property
    def label(self) -> str:
        return str(self.arg) if isinstance(self.arg, (str, Path)) else type(self.arg).__name__

    def recorded(self, name: str = SETTINGS_FILE) -> tuple[dict[str, Any], Path] | None:
        """The settings file ``name`` beside the model (``<model_dir>/<name>``), parsed."""
        if self.model_dir is None or not (self.model_dir / name).is_file():
            return None
        path = self.model_dir / name
        try:
            return json.loads(path.read_text()), path
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}: not valid JSON ({exc})") from None

    def _run_record(self) -> dict[str, Any] | None:
        recorded = self.recorded(RUN_RECORD)
        return recorded[0] if recorded is not None else None

    def run_config(self, config_cls: type) -> Any | None:
        """The run's ``config.yaml`` parsed into ``config_cls``, or the one recorded beside a model
        folder copied out of its run (None: neither)."""
        from domainfm import config as cfgmod

        if self.run is not None:
            return cfgmod.from_dict(config_cls, cfgmod.load_yaml(self.run / "config.yaml"))
        record = self._run_record()
        return None if record is None else cfgmod.from_dict(config_cls, record["config"])

    def run_report(self) -> dict[str, Any] | None:
        """The run's ``report.json``, or the one recorded beside a model folder (None: neither)."""
        if self.run is not None and (self.run / "report.json").is_file():
            return json.loads((self.run / "report.json").read_text())
        record = self._run_record() if self.run is None else None
        return None if record is None else record["report"]


def write_settings(model_dir: str | Path, settings: Mapping[str, Any]) -> Path:
    """Record how inputs become a saved model's inputs (``<model_dir>/apply_settings.json``)."""
    from domainfm.atomic import atomic_write_json

    return atomic_write_json(Path(model_dir) / SETTINGS_FILE, dict(settings))


def write_run_record(model_dir: str | Path, *, family: str, config: Any, report: Mapping[str, Any]) -> Path:
    """Record the run a model folder came from (:data:`RUN_RECORD`): its family, config and report."""
    from domainfm import config as cfgmod
    from domainfm.atomic import atomic_write_json

    return atomic_write_json(Path(model_dir) / RUN_RECORD,
                             {"family": family, "config": cfgmod.to_dict(config), "report": dict(report)})


def resolve(model: Any, *, arm: str | None = None, pretrained: Any = None, device: Any = "cpu", **kwargs: Any):
    """``(model, ref)``: the module ``model`` names, in eval mode on ``device``, resolved once."""
    from torch import nn

    from domainfm import create_model, zoo

    ref = ModelRef.of(model, arm)
    if isinstance(model, nn.Module):
        module = model
    elif ref.model_dir is not None:
        module = create_model(ref.model_dir, **kwargs)
    elif pretrained is None and not zoo.get_card(zoo.split_tag(str(model))[0]).weights:
        # a registered name whose card lists no weights (a test-sized variant): random init, said aloud,
        # and seeded (seed 0) so that two calls give the same outputs; the caller's RNG is left alone
        print(f"warning: {model} has no registered weights: RANDOM initialisation, seed 0 (pass a run or model "
              "folder as --model, or --pretrained, for a trained model)", file=sys.stderr)
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = create_model(str(model), **kwargs)
    else:
        if isinstance(pretrained, str) and pretrained.strip().lower() in ("none", "false", "random"):
            pretrained = False  # --pretrained none: random init
        module = create_model(str(model), pretrained=True if pretrained is None else pretrained, **kwargs)
    return module.to(device).eval(), ref


# --------------------------------------------------------------------------- running


@dataclass
class Runtime:
    """Where and how a command computes: ``batched`` runs a function over batches under
    ``torch.no_grad`` and autocast and gathers float32 CPU results."""

    precision: str = "auto"
    device: Any = "cpu"
    batch_size: int = 32
    output: Path | None = None

    def batched(self, fn: Callable[..., Any], *tensors: Any, batch_size: int | None = None) -> Any:
        """``fn(*batch)`` over ``tensors`` split along dim 0; the outputs (a tensor or a tuple of
        tensors) concatenated, as float32 on the CPU."""
        import torch

        from domainfm.precision import autocast

        size = batch_size or self.batch_size
        n = len(tensors[0])
        outs: list[Any] = []
        with torch.no_grad():
            for start in range(0, n, size):
                batch = [t[start:start + size] for t in tensors]
                batch = [torch.as_tensor(b).to(self.device) if not isinstance(b, torch.Tensor) else b.to(self.device)
                         for b in batch]
                with autocast(self.precision, self.device):
                    out = fn(*batch)
                outs.append(tuple(o.float().cpu() for o in out) if isinstance(out, tuple) else out.float().cpu())
        if not outs:
            raise InputError("nothing to compute: the input gave no items")
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)


def _options(applier: Applier, given: Mapping[str, Any]):
    if applier.options is None:
        if given:
            raise TypeError(f"{applier.family}: unexpected option(s) {sorted(given)}")
        return None
    names = {f.name for f in dataclasses.fields(applier.options)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{applier.family}: unknown option(s) {unknown}; options: {sorted(names)}")
    return applier.options(**given)


def run(command: str, applier: Applier, model: Any, inputs: Any, *, settings: Any = None, arm: str | None = None,
        pretrained: Any = None, precision: str = "auto", device: Any = "cpu", batch_size: int | None = None,
        output: Path | None = None, options: Any = None, label: str | None = None) -> Output:
    """Apply ``command`` of ``applier``: resolve the model once, take its recorded settings
    (unless ``settings`` is given), read ``inputs``, compute; the :class:`Output` (unwritten)."""
    cmd = applier.command(command)
    if model is None:
        if cmd.default_model is None:
            raise InputError(f"{command} {applier.family}: name a model (--model NAME|FOLDER|RUN)")
        model = cmd.default_model
    if pretrained is None and cmd.default_pretrained is not None and model == cmd.default_model:
        pretrained = cmd.default_pretrained
    module, ref = resolve(model, arm=arm, pretrained=pretrained, device=device)
    if cmd.needs_head and not applier.has_head(module):
        raise InputError(f"--model {label or ref.label}: the model has no head (a {applier.family} backbone); predict "
                         f"needs a fine-tuned model with a head (a `domainfm finetune {applier.family}` run folder or "
                         f"its <arm>/model); for features use `domainfm embed {applier.family}`")
    if settings is None and applier.settings is not None:
        settings = applier.settings(ref, module)
    if isinstance(inputs, (str, Path)) and not Path(inputs).exists() and str(inputs) not in applier.samples:
        raise FileNotFoundError(f"{inputs}: no such file (--input: {applier.input})")
    data = applier.read(inputs, settings, options)
    runtime = Runtime(precision=precision, device=device, batch_size=batch_size or applier.batch_size, output=output)
    result = cmd.run(data, module, settings, options, runtime)
    if not isinstance(result, Output):
        result = Output(result)
    return result


def applier_of(family: str) -> Applier:
    """The family's :class:`Applier` (``domainfm.finetune.<family>.APPLY``)."""
    module = importlib.import_module(f"domainfm.finetune.{family}")
    applier = getattr(module, "APPLY", None)
    if not isinstance(applier, Applier):
        raise InputError(f"family {family!r} declares no predict/embed (domainfm.finetune.{family}.APPLY)")
    return applier


def family_of_model(model: Any) -> str:
    """The family of a model, a model folder, a run folder or a registered name."""
    from domainfm import zoo

    name = getattr(model, "domainfm_name", None)
    if name is None and isinstance(model, (str, Path)):
        ref = ModelRef.of(model)
        if ref.model_dir is not None and (ref.model_dir / "config.json").is_file():
            config = json.loads((ref.model_dir / "config.json").read_text())
            own = config.get("domainfm") or {}
            name = own.get("model_name") or own.get("name") or config.get("name")
        elif ref.run is not None and (ref.run / "run.json").is_file():
            return json.loads((ref.run / "run.json").read_text())["family"]
        elif ref._run_record() is not None:
            return ref._run_record()["family"]
        else:
            name = str(model)
    if name is None:
        raise InputError("cannot tell the family of this model; pass family='...'")
    return zoo.get_card(name).family


def predict(model: Any, inputs: Any, *, family: str | None = None, arm: str | None = None, pretrained: Any = None,
            precision: str = "auto", device: Any = "cpu", batch_size: int | None = None, **options: Any) -> Any:
    """Predictions of ``model`` (a fine-tuned model, its folder, a run folder or a name) for
    ``inputs`` (a file path, or the family's Python object: an MNE Raw, an AnnData, a graph, a
    DataFrame ...); ``options`` are the family's (``domainfm predict FAMILY --help``)."""
    applier = applier_of(family or family_of_model(model))
    return run("predict", applier, model, inputs, arm=arm, pretrained=pretrained, precision=precision, device=device,
                  batch_size=batch_size, options=_options(applier, options)).value


def embed(model: Any, inputs: Any, *, family: str | None = None, arm: str | None = None, pretrained: Any = None,
          precision: str = "auto", device: Any = "cpu", batch_size: int | None = None, **options: Any) -> Any:
    """Embeddings of ``inputs`` by ``model`` (see :func:`predict`)."""
    applier = applier_of(family or family_of_model(model))
    return run("embed", applier, model, inputs, arm=arm, pretrained=pretrained, precision=precision, device=device,
                  batch_size=batch_size, options=_options(applier, options)).value


# --------------------------------------------------------------------------- the command line


def _type_of(f: dataclasses.Field, hints: Mapping[str, Any]) -> tuple[Callable[[str], Any] | None, bool]:
    """(argparse type, is_switch) of an option field."""
    from domainfm.experiment.inference import positive_float, positive_int

    if f.metadata.get("type") is not None:
        return f.metadata["type"], False
    tp = hints[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp
    if base is bool:
        return None, True
    if base is int:
        return positive_int, False
    if base is float:
        return positive_float, False
    if typing.get_origin(base) is list:
        return (lambda text: [p.strip() for p in text.split(",") if p.strip()]), False
    return str, False


def build_parser(command: str, applier: Applier) -> argparse.ArgumentParser:
    """The shared options and the family's, generated from its ``Options`` dataclass."""
    from domainfm.experiment.inference import positive_int

    cmd = applier.command(command)
    parser = argparse.ArgumentParser(prog=f"domainfm {command} {applier.family}",
                                     description=" ".join(p for p in (cmd.what, applier.description) if p))
    parser.add_argument("--model", default=cmd.default_model, required=cmd.default_model is None,
                        help="a registered model name, a save_pretrained folder, or a run folder"
                             + (f" (default {cmd.default_model})" if cmd.default_model else ""))
    parser.add_argument("--arm", default=None, help="with a run folder: the arm whose model to use (default the first)")
    weights = f"{cmd.default_pretrained} for {cmd.default_model}, else " if cmd.default_pretrained else ""
    parser.add_argument("--pretrained", default=None,
                        help="with a model name: the weights (a path, URL or hf:// source; 'none' for random "
                             f"init; default {weights}the card's own)")
    parser.add_argument("--input", required=True, help=f"the input: {applier.input}")
    parser.add_argument("--output", required=True,
                        help=f"the output file ({', '.join(cmd.writes)}; written atomically)")
    parser.add_argument("--precision", default="auto",
                        help="auto (bf16 where the hardware has it natively, else fp32), 32-true or bf16-mixed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=positive_int, default=applier.batch_size)
    if applier.options is not None:
        hints = typing.get_type_hints(applier.options)
        for f in dataclasses.fields(applier.options):
            if f.metadata.get("commands") and command not in f.metadata["commands"]:
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            kind, switch = _type_of(f, hints)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if switch:
                parser.add_argument(flag, dest=f.name, action="store_true", help=f.metadata.get("help"))
            else:
                parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                                    help=f.metadata.get("help"))
    return parser


def _output_paths(applier: Applier, cmd: Command, args: argparse.Namespace) -> dict[str, tuple[Path, Sequence[str]]]:
    """Every file the command writes: option -> (path, accepted extensions)."""
    paths = {"--output": (Path(args.output), tuple(cmd.writes))}
    if applier.options is not None:
        for f in dataclasses.fields(applier.options):
            if not f.metadata.get("output") or not hasattr(args, f.name):
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            value = getattr(args, f.name, None)
            if value is None and f.metadata.get("default_from"):
                value = str(Path(args.output).with_suffix(f.metadata["default_from"]))
                setattr(args, f.name, value)
            if value is not None:
                paths[flag] = (Path(value), f.metadata["output"])
    return paths


def check_outputs(paths: Mapping[str, tuple[Path, Sequence[str]]]) -> None:
    """Refuse, before anything is read or computed, an output of the wrong kind, a folder where
    a file goes, a file where a folder must be, or two outputs on one path."""
    seen: dict[Path, str] = {}
    for flag, (path, suffixes) in paths.items():
        if path.is_dir():
            raise InputError(f"{flag} {path}: is a folder; expected a file path")
        if suffixes and path.suffix.lower() not in suffixes:
            raise InputError(f"{flag} {path}: expected a {' or '.join(suffixes)} file, got "
                             f"{path.suffix or 'no extension'!r}")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise InputError(f"{flag} {path}: {parent} is a file, not a folder")
                break
        key = path.resolve()
        if key in seen:
            raise InputError(f"{flag} {path} and {seen[key]} are the same file; give each output its own path")
        seen[key] = flag


def write(value: Any, path: Path) -> None:
    """Write ``value`` to ``path`` by its type and extension (``path`` is a temporary that keeps
    the target's extension; the caller commits it)."""
    import numpy as np

    suffix = path.suffix.lower()
    if hasattr(value, "savefig"):
        value.savefig(path, dpi=120, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(value)
    elif isinstance(value, Raster):
        import rasterio

        data = np.asarray(value.data)
        data = data[None] if data.ndim == 2 else data
        profile = {**value.profile, "driver": "GTiff", "count": data.shape[0], "height": data.shape[1],
                   "width": data.shape[2], "dtype": str(data.dtype)}
        descriptions, tags = profile.pop("descriptions", None) or (), profile.pop("tags", None) or {}
        with rasterio.open(path, "w", **profile) as dst:
            dst.write(data)
            for band, name in enumerate(descriptions, start=1):
                dst.set_band_description(band, name)
            dst.update_tags(**{k: str(v) for k, v in tags.items()})
    elif suffix == ".npz":
        if not isinstance(value, Mapping):
            raise TypeError(f"{path}: .npz takes a mapping of arrays, got {type(value).__name__}")
        with open(path, "wb") as fh:
            np.savez(fh, **{k: np.asarray(v) for k, v in value.items()})
    elif suffix == ".h5ad":
        value.write_h5ad(path)
    elif suffix == ".parquet":
        value.to_parquet(path, index=False)
    elif suffix in (".csv", ".tsv"):
        value.to_csv(path, index=False, sep="\t" if suffix == ".tsv" else ",")
    else:
        raise TypeError(f"{path}: no writer for {type(value).__name__} as {suffix!r}")


def main(command: str, applier: Applier, argv: Sequence[str]) -> int:
    """``domainfm <command> <family> ...``: parse, check every output path, resolve the model
    once, read, compute, and commit every output together."""
    from domainfm.atomic import atomic_paths

    cmd = applier.command(command)
    parser = build_parser(command, applier)
    args = parser.parse_args(list(argv))
    paths = _output_paths(applier, cmd, args)
    check_outputs(paths)
    options = None
    if applier.options is not None:
        options = applier.options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(applier.options)
                                     if hasattr(args, f.name)})
    result = run(command, applier, args.model, args.input, arm=args.arm, pretrained=args.pretrained,
                    precision=args.precision, device=args.device, batch_size=args.batch_size,
                    output=Path(args.output), options=options, label=args.model)
    flags = list(paths)
    values = {"--output": result.value}
    for key, extra in result.extras.items():
        flag = key if key.startswith("--") else "--" + key.replace("_", "-")
        if flag in paths:
            values[flag] = extra
    chosen = [f for f in flags if f in values]
    with atomic_paths(*(paths[f][0] for f in chosen)) as tmps:
        for flag, tmp in zip(chosen, tmps):
            write(values[flag], tmp)
    written = ", ".join(str(paths[f][0]) for f in chosen)
    print(f"{command} {applier.family}: {result.summary + ' -> ' if result.summary else ''}{written}")
    return 0
