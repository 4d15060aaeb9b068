"""Export a model out of Python: ONNX (for onnxruntime, TensorRT, ...) or a PyTorch 2 program
(``torch.export``'s ``.pt2``, loaded with ``torch.export.load`` without the model's code).

    from domainfm.export import export
    result = export("runs/cbramod/tuab/pretrained/model", "cbramod.onnx")   # or a module, a name
    result = export(model, "cbramod.pt2", format="pt2")

    domainfm export runs/cbramod/tuab --format onnx --output cbramod.onnx

The input signature is the model card's ``example_input``: for a model built with other sizes
than its card's (a saved folder with ``n_chans=6``), the example is resized along the dimensions
those sizes name (:data:`INPUT_SIZE_KEYS`); a card without an example borrows one from a variant
of the same class in its family. ``input_shapes`` (``--input-shape``) states the inputs outright.

The batch dimension (dim 0 of the inputs that share the first input's leading size) is exported
dynamic when the model's outputs follow it: the first item alone gives the first item of the
outputs. Otherwise (a graph's nodes, a batch of one) the example's shapes are fixed, and said so.

ONNX goes through the dynamo exporter (``torch.onnx.export(dynamo=True)``) and falls back to the
TorchScript exporter when that fails; each result is checked with ``onnx.checker.check_model`` and,
where onnxruntime is installed, run on the example and compared with the model's own outputs
(and on one item, when the batch is dynamic) before it is committed. A ``.pt2`` is reloaded and
compared the same way. The file appears only when all of that passed (:mod:`domainfm.atomic`).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from domainfm.errors import InputError

__all__ = ["export", "ExportResult", "ExportError", "example_inputs_for", "parse_input_shape", "flat_outputs",
           "FORMATS", "INPUT_SIZE_KEYS"]

#: format -> the file extension it is written with
FORMATS = {"onnx": ".onnx", "pt2": ".pt2"}

#: the model keywords that size an input (the shared signal description, braindecode's names, and
#: the image/graph/token equivalents): a model built with other values than its card's example was
#: made for gets the example resized along the dimensions of those values
INPUT_SIZE_KEYS = ("n_chans", "n_times", "in_chans", "img_size", "in_channels", "input_dim")

#: beyond this many bytes of weights an ONNX file is written as ``FILE`` + ``FILE.data`` (protobuf
#: cannot serialise a message over 2 GiB; onnxruntime reads the pair from the same folder)
EXTERNAL_DATA_BYTES = 1_800_000_000

#: an export is accepted when every output x of the file and y of the model has
#: |x - y| <= ATOL + RTOL * |y| (float32 kernels of two runtimes: they differ in summation order)
ATOL, RTOL = 1e-4, 1e-4

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
           "int": torch.int64, "bool": torch.bool}


class ExportError(InputError):
    """The model could not be exported in this format (every exporter tried is named with its reason)."""


@dataclass
class ExportResult:
    """What :func:`export` wrote: ``path`` (and ``extra_files``: an ONNX model's external weights),
    the ``exporter`` that made it, its ``seconds``, the input and output names, whether the batch is
    dynamic, how it was checked (``verified``: the largest output difference found, None when not
    run) and ``notes`` (a fallback and its reason, a fixed batch and why)."""

    path: Path
    format: str
    exporter: str
    seconds: float
    input_names: list[str]
    input_shapes: list[tuple[int, ...]]
    output_names: list[str]
    dynamic_batch: bool
    verified: float | None = None
    extra_files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shapes = ", ".join(f"{n} {tuple(s)}" for n, s in zip(self.input_names, self.input_shapes))
        check = ("not run: onnxruntime is not installed" if self.verified is None
                 else f"largest difference from the model's outputs {self.verified:.2g}")
        lines = [f"exported {self.path} ({self.format}, {self.exporter}, {self.seconds:.1f} s)",
                 f"  inputs: {shapes}; batch {'dynamic' if self.dynamic_batch else 'fixed'}",
                 f"  outputs: {', '.join(self.output_names)}", f"  check: {check}"]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- inputs


def parse_input_shape(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``"2,19,6000"`` or ``"2,168,22:bool"`` -> (shape, dtype or None)."""
    spec, _, dtype_name = text.partition(":")
    try:
        shape = tuple(int(p) for p in spec.split(","))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise InputError(f"--input-shape {text!r}: expected sizes >= 1 separated by commas, e.g. 2,19,6000 "
                         "(optionally :DTYPE, e.g. 2,168,22:bool)")
    if dtype_name and dtype_name.strip().lower() not in _DTYPES:
        raise InputError(f"--input-shape {text!r}: unknown dtype {dtype_name!r} (one of {', '.join(sorted(_DTYPES))})")
    return shape, (_DTYPES[dtype_name.strip().lower()] if dtype_name else None)


def _resize(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``tensor`` tiled and cropped to ``shape``: the values keep their law (token ids stay in the
    vocabulary, masks stay masks, NaN stays where values are missing)."""
    out = tensor
    for dim, size in enumerate(shape):
        if out.shape[dim] != size:
            reps = -(-size // out.shape[dim])
            out = out.repeat(*[reps if d == dim else 1 for d in range(out.ndim)])
            out = out.narrow(dim, 0, size)
    return out.contiguous()


def _from_shape(shape: Sequence[int], dtype: torch.dtype | None, like: torch.Tensor | None,
                generator: torch.Generator) -> torch.Tensor:
    if like is not None and (dtype is None or dtype == like.dtype) and like.ndim == len(shape):
        return _resize(like, shape)
    dtype = dtype or (like.dtype if like is not None else torch.float32)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) < 0.7
    if not dtype.is_floating_point:
        high = int(like.max()) + 1 if like is not None and like.numel() else 2
        low = int(like.min()) if like is not None and like.numel() else 0
        return torch.randint(low, max(high, low + 1), shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def _sizes(values: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in values.items() if k in INPUT_SIZE_KEYS and isinstance(v, int) and not isinstance(v, bool)}


def _card_example(model: nn.Module):
    """(the card the example comes from, its inputs) for a model made by ``create_model``."""
    from domainfm import zoo

    name = getattr(model, "domainfm_name", None)
    if name is None:
        return None, None
    card = zoo.get_card(name)
    if card.example_input is not None:
        return card, tuple(card.example_input())
    # a card without an example (a full-size variant): a variant of the same class in the family
    # has one, made for its own sizes, which the caller resizes to this model's
    siblings = sorted((c for c in map(zoo.get_card, zoo.list_models(family=card.family)) if c.example_input is not None),
                      key=lambda c: ("test" not in c.tags, c.name))
    for sibling in siblings:
        with torch.device("meta"):
            try:
                same = type(zoo.build_model(sibling.name)) is type(model)
            except Exception:  # noqa: BLE001 - a builder that cannot run on meta is not a match
                same = False
        if same:
            return sibling, tuple(sibling.example_input())
    return card, None


def example_inputs_for(model: nn.Module, input_shapes: Sequence[str | tuple] | None = None) -> tuple:
    """The inputs ``model`` is exported with: the card's ``example_input`` resized to the model's
    own sizes, or ``input_shapes`` (one ``"2,19,6000[:dtype]"`` per leading input; the example's
    tensors, tiled and cropped, fill them where it has them, random values otherwise)."""
    from domainfm import zoo

    label = getattr(model, "domainfm_name", None) or type(model).__name__
    card, example = _card_example(model)
    if input_shapes:
        parsed = [parse_input_shape(s) if isinstance(s, str) else (tuple(s), None) for s in input_shapes]
        likes = [x for x in (example or ()) if torch.is_tensor(x)]
        if example is not None and len(parsed) != len(likes):
            raise InputError(f"--input-shape: {label} is exported with {len(likes)} input tensor(s) ("
                             f"{_shapes(example)}, from {card.name}'s example); give one --input-shape for each, in order")
        generator = torch.Generator().manual_seed(0)
        made = iter([_from_shape(shape, dtype, likes[i] if likes else None, generator)
                     for i, (shape, dtype) in enumerate(parsed)])
        return tuple(next(made) if torch.is_tensor(x) else x for x in example) if example is not None else tuple(made)
    if example is None:
        raise InputError(f"{label}: its model card declares no example input to export it with; give one "
                         "--input-shape per input (e.g. --input-shape 2,19,6000), or example_inputs= in Python")
    own = zoo.get_card(model.domainfm_name)
    was = _sizes({**card.input_spec, **card.defaults})
    now = _sizes({**own.input_spec, **own.defaults, **getattr(model, "domainfm_kwargs", {})})
    mapping: dict[int, int] = {}
    for key in was.keys() & now.keys():
        old, new = was[key], now[key]
        if mapping.setdefault(old, new) != new:
            raise InputError(f"{label}: its example input ({_shapes(example)}, from {card.name}'s card) cannot be "
                             f"resized to its sizes {now}: {old} stands for several of them; give one --input-shape "
                             "per input, in order")
    resized = []
    for x in example:
        if torch.is_tensor(x) and x.ndim > 1 and any(mapping.get(s, s) != s for s in x.shape[1:]):
            x = _resize(x, (x.shape[0], *(mapping.get(s, s) for s in x.shape[1:])))
        resized.append(x)
    return tuple(resized)


def _shapes(inputs: Sequence[Any]) -> str:
    return ", ".join(str(tuple(x.shape)) if torch.is_tensor(x) else repr(x) for x in inputs)


def flat_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output in the order an exported file returns them (a dict's values
    in its order, a tuple's items; ``None`` left out)."""
    return [x for x in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(x)]


def _output_names(out: Any) -> list[str]:
    """Readable names: a dict's keys (``quantile_preds``), ``output`` for one tensor, else ``output_<i>``."""
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(out)
    names = []
    for i, (path, leaf) in enumerate(leaves):
        if not torch.is_tensor(leaf):
            continue
        keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path
                if isinstance(getattr(k, "key", None), str) or hasattr(k, "name")]
        names.append(".".join(keys) if keys else f"output_{i}")
    if names == ["output_0"]:
        names = ["output"]
    return names


def _unclash(outputs: list[str], inputs: list[str]) -> list[str]:
    """An output named like an input (an imputer's ``values``) becomes ``output.values``: one ONNX
    graph cannot hold both, and the TorchScript exporter silently renames the input instead."""
    return [f"output.{name}" if name in inputs else name for name in outputs]


def _positional(fn: Callable) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class _Features(nn.Module):
    """A model's ``forward_features`` as the module's forward: what a backbone without a head exports."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, *inputs: Any) -> Any:
        return self.backbone.forward_features(*inputs)


def _input_names(model: nn.Module, inputs: Sequence[Any]) -> list[str]:
    params = _positional(model.backbone.forward_features if isinstance(model, _Features) else model.forward)
    return [params[i] if i < len(params) else f"input_{i}" for i, x in enumerate(inputs) if torch.is_tensor(x)]


# --------------------------------------------------------------------------- the batch dimension


def _close(got: Sequence[Any], want: Sequence[torch.Tensor]) -> float:
    """The largest |got - want|; raises AssertionError naming the first output that differs."""
    import numpy as np

    if len(got) != len(want):
        raise AssertionError(f"{len(got)} outputs, the model gives {len(want)}")
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g.detach().cpu().numpy() if torch.is_tensor(g) else g)
        w = w.detach().cpu().numpy()
        if g.shape != w.shape:
            raise AssertionError(f"output {i} has shape {g.shape}, the model's {w.shape}")
        if w.dtype.kind in "fc":
            g, w = g.astype(np.float64), w.astype(np.float64)
            both_nan = np.isnan(g) & np.isnan(w)
            diff = np.where(both_nan, 0.0, np.abs(g - w))
            bad = ~(diff <= ATOL + RTOL * np.abs(w))
            if bad.any():
                raise AssertionError(f"output {i} differs by up to {np.nanmax(diff):.3g} (allowed {ATOL} + {RTOL}*|y|)")
            worst = max(worst, float(diff.max()) if diff.size else 0.0)
        elif not np.array_equal(g, w):
            raise AssertionError(f"output {i} differs")
    return worst


def _batch_inputs(model: nn.Module, inputs: tuple, reference: list[torch.Tensor]) -> tuple[list[int], str | None]:
    """The positions of the inputs whose dim 0 is a batch the outputs follow, or ([], why not)."""
    tensors = [i for i, x in enumerate(inputs) if torch.is_tensor(x)]
    if not tensors or inputs[tensors[0]].ndim == 0:
        return [], "the inputs have no leading dimension"
    n = inputs[tensors[0]].shape[0]
    if n < 2:
        return [], "the example has a batch of 1 (give 2 or more items for a dynamic batch)"
    batch = [i for i in tensors if inputs[i].ndim and inputs[i].shape[0] == n]
    one = tuple(x[:1] if i in batch else x for i, x in enumerate(inputs))
    try:
        if any(r.ndim == 0 or r.shape[0] != n for r in reference):
            raise AssertionError(f"an output does not lead with the batch of {n}")
        with torch.no_grad():
            single = flat_outputs(model(*one))
        _close(single, [r[:1] for r in reference])
    except Exception as exc:  # noqa: BLE001 - any failure means: no batch dimension to free
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [], f"the outputs do not follow the inputs' leading dimension ({reason})"
    return batch, None


# --------------------------------------------------------------------------- exporters


@contextlib.contextmanager
def _quiet():
    """The exporters print their progress, and on a failure the traced graph, to stdout/stderr:
    the reason reaches the user in the error instead."""
    import sys
    import tempfile

    buffer = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}  # the TorchScript exporter logs its graph from C++
    try:
        with tempfile.TemporaryFile() as sink:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            try:
                # and their warnings (TracerWarning: "the trace might not generalize"): the file is
                # run against the model before it is kept, which is the answer to that warning
                with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), \
                        warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    yield buffer
            finally:
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
    finally:
        for copy in saved.values():
            os.close(copy)


@contextlib.contextmanager
def _math_attention():
    # The dynamo exporter decomposes scaled_dot_product_attention through the CPU flash kernel,
    # whose output layout it then views wrongly ("Cannot view a tensor ... with strides") in every
    # T5 here; the math kernel decomposes into plain matmul/softmax, which exports and runs alike.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _first_line(exc: BaseException) -> str:
    """The reason in one line: the cause's first line (the dynamo exporter wraps the real error in
    a "step 1/3" banner), without terminal colour codes."""
    import re

    for candidate in (exc.__cause__, exc):
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(candidate or "")).strip()
        if text:
            line = f"{type(candidate).__name__}: {text.splitlines()[0][:300]}"
            if "data-dependent" in text:
                line += " [the model branches on its input values, which a traced graph cannot hold]"
            return line
    return type(exc).__name__


def _weights_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _ort_outputs(path: Path, input_names: list[str], inputs: Sequence[Any]) -> list[Any]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # its failures reach the user as our error
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    # by name: the TorchScript exporter leaves out an input the graph does not use
    wanted = {i.name for i in session.get_inputs()}
    tensors = [x for x in inputs if torch.is_tensor(x)]
    feeds = {name: x.detach().cpu().numpy() for name, x in zip(input_names, tensors) if name in wanted}
    return session.run(None, feeds)


def _dynamic_shapes(model: nn.Module, inputs: tuple, batch: list[int]) -> tuple:
    """torch.export's spec: one shared ``batch`` dimension at dim 0 of the inputs in ``batch``."""
    dim = torch.export.Dim("batch")
    spec = tuple({0: dim} if i in batch else None for i in range(len(inputs)))
    return (spec,) if isinstance(model, _Features) else spec  # _Features.forward(*inputs): one argument


def _onnx_once(dynamo: bool, model: nn.Module, inputs: tuple, target: Path, *, names: dict, batch: list[int],
               opset: int | None, external: bool) -> None:
    """One ONNX exporter writing ``target`` (+ ``target.data`` when ``external``), then the checker."""
    import onnx

    kwargs: dict[str, Any] = dict(input_names=names["inputs"], output_names=names["outputs"], opset_version=opset)
    if dynamo:
        kwargs["external_data"] = external
        if batch:
            kwargs["dynamic_shapes"] = _dynamic_shapes(model, inputs, batch)
    else:
        if batch:
            positions = [i for i, x in enumerate(inputs) if torch.is_tensor(x)]
            axes = {name: {0: "batch"} for name, i in zip(names["inputs"], positions) if i in batch}
            kwargs["dynamic_axes"] = {**axes, **{name: {0: "batch"} for name in names["outputs"]}}
    # not under no_grad: there nn.MultiheadAttention takes its fused fast path
    # (aten._transform_bias_rescale_qkv), which neither exporter translates
    with _quiet(), _math_attention():
        torch.onnx.export(model, inputs, str(target), dynamo=dynamo, **kwargs)
    # by path: the checker then also reads (and checks) weights stored beside the file
    onnx.checker.check_model(str(target), full_check=True)


def _export_onnx(model, inputs, target: Path, *, names, batch, opset, reference,
                 commit: Callable) -> tuple[str, float | None, list[str], list[int]]:
    import importlib.util

    runnable = importlib.util.find_spec("onnxruntime") is not None  # else checked by onnx.checker alone
    external = _weights_bytes(model) > EXTERNAL_DATA_BYTES
    failures: list[str] = []
    for exporter, dynamo in (("dynamo", True), ("torchscript", False)):
        with _staging(target) as staged:
            try:
                _onnx_once(dynamo, model, inputs, staged, names=names, batch=batch, opset=opset, external=external)
                worst = _verify(lambda xs: _ort_outputs(staged, names["inputs"], xs), inputs, reference, batch, model) \
                    if runnable else None
            except Exception as exc:  # noqa: BLE001 - the next exporter, or the error naming both
                failures.append(f"{exporter} exporter: {_first_line(exc)}")
                continue
            commit(staged)
        notes = [f"the dynamo exporter failed, the TorchScript exporter was used ({failures[0]})"] if failures else []
        return exporter, worst, notes, batch
    raise ExportError("cannot export to ONNX: " + "; ".join(failures))


def _export_pt2(model, inputs, target: Path, *, batch, reference, commit: Callable) -> tuple[str, float | None, list[str], list[int]]:
    notes: list[str] = []
    for free in ([batch, []] if batch else [[]]):
        dynamic = _dynamic_shapes(model, inputs, free) if free else None
        with _staging(target) as staged:
            try:
                with _quiet():
                    program = torch.export.export(model, inputs, dynamic_shapes=dynamic)
                torch.export.save(program, str(staged))
                loaded = torch.export.load(str(staged)).module()
                worst = _verify(lambda xs: flat_outputs(loaded(*xs)), inputs, reference, free, model)
            except Exception as exc:  # noqa: BLE001 - a fixed batch next, else one line naming why
                if free:
                    notes.append(f"batch fixed at the example's: with a free batch, {_first_line(exc)}")
                    continue
                raise ExportError(f"cannot export to pt2 with torch.export: {_first_line(exc)}") from exc
            commit(staged)
        return "torch.export", worst, notes, free
    raise AssertionError("unreachable")


def _verify(run: Callable[[tuple], list], inputs: tuple, reference: list[torch.Tensor], batch: list[int],
            model: nn.Module) -> float:
    """Run the written file on the example (and on its first item when the batch is dynamic)."""
    worst = _close(run(inputs), reference)
    if batch:
        one = tuple(x[:1] if i in batch else x for i, x in enumerate(inputs))
        with torch.no_grad():
            want = flat_outputs(model(*one))
        try:
            got = run(one)
            worst = max(worst, _close(got, want))
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"with a batch of 1, {_first_line(exc)} (the file fixed the example's batch "
                                 "somewhere; export with a fixed batch: --static-batch)") from None
    return worst


@contextlib.contextmanager
def _staging(target: Path):
    """A private folder beside ``target`` where an exporter writes ``target``'s name (so that an
    ONNX file's reference to its ``.data`` file is already the final one); removed afterwards."""
    from domainfm.atomic import TMP_MARK

    folder = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-{time.monotonic_ns()}")
    folder.mkdir(parents=True)
    try:
        yield folder / target.name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _commit_into(target: Path, written: list[Path]) -> Callable[[Path], None]:
    """Move the staged file(s) onto ``target`` atomically: weights beside the file first, the file last."""
    from domainfm.atomic import atomic_path

    def commit(staged: Path) -> None:
        extras = sorted(p for p in staged.parent.iterdir() if p != staged)
        for extra in extras:
            with atomic_path(target.parent / extra.name, suffix=extra.suffix) as tmp:
                os.replace(extra, tmp)
            written.append(target.parent / extra.name)
        with atomic_path(target, suffix=target.suffix) as tmp:
            os.replace(staged, tmp)

    return commit


# --------------------------------------------------------------------------- export


def _resolve(model: Any, pretrained: Any, arm: str | None) -> nn.Module:
    if isinstance(model, nn.Module):
        return model.eval()
    from domainfm.experiment.apply import resolve

    return resolve(model, arm=arm, pretrained=pretrained, device="cpu")[0]


def _format_of(format: str | None, path: Path) -> str:
    """``format``, checked against ``path``'s extension (or taken from it when None)."""
    by_suffix = {suffix: name for name, suffix in FORMATS.items()}
    if format is None:
        if path.suffix.lower() not in by_suffix:
            raise InputError(f"--output {path}: cannot tell the format from {path.suffix or 'no extension'!r}; "
                             f"name a {' or '.join(FORMATS.values())} file, or give --format {'|'.join(FORMATS)}")
        return by_suffix[path.suffix.lower()]
    if format not in FORMATS:
        raise InputError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if path.suffix.lower() != FORMATS[format]:
        raise InputError(f"--output {path}: expected a {FORMATS[format]} file for --format {format}, got "
                         f"{path.suffix or 'no extension'!r}")
    return format


def _check_writable(path: Path) -> None:
    """Refuse, before a model is built or traced, an output that cannot be written: a folder, a
    file standing where a folder must be, or a folder that refuses a new file (read-only, no
    permission); the error names ``path``."""
    from domainfm.atomic import TMP_MARK

    if path.is_dir():
        raise InputError(f"--output {path}: is a folder; expected a file path")
    for parent in path.parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise InputError(f"--output {path}: {parent} is a file, not a folder")
        probe = parent / f".{path.name}{TMP_MARK}{os.getpid()}-probe"
        try:
            probe.open("xb").close()
            probe.unlink()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write here ({exc.strerror})", str(path)) from None
        return


def export(model: Any, path: str | os.PathLike, *, format: str | None = None, example_inputs: Sequence[Any] | None = None,
           opset: int | None = None, dynamic_batch: bool = True, input_shapes: Sequence[str | tuple] | None = None,
           features: bool = False, pretrained: Any = None, arm: str | None = None) -> ExportResult:
    """Write ``model`` to ``path`` as ONNX (``format="onnx"``) or a ``torch.export`` program (``"pt2"``).

    Args:
        model: an ``nn.Module``, a registered name (its card's weights, or ``pretrained``), a
            ``save_pretrained`` folder or a run folder (its arm ``arm``, default the first).
        path: the file (``.onnx`` or ``.pt2``); its folder is created. Written only once exported
            and checked.
        format: ``"onnx"`` or ``"pt2"`` (default: from ``path``'s extension).
        example_inputs: the positional inputs to trace with (default: from the model card, see
            :func:`example_inputs_for`; ``input_shapes`` states their shapes instead).
        opset: the ONNX opset (default the exporter's own).
        dynamic_batch: export dim 0 as a free batch size where the outputs follow it.
        input_shapes: one shape per leading input (``"2,19,6000"``, ``"2,168,22:bool"`` or a tuple).
        features: export ``forward_features`` (the embedding) instead of ``forward``: a pretrained
            backbone without a head.
        pretrained, arm: as in ``domainfm.predict``, when ``model`` is a name or a run folder.

    Returns:
        :class:`ExportResult`. Raises :class:`ExportError` (naming every exporter tried and why it
        failed) when no file could be made that reproduces the model's outputs.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--output {path}: is a folder; expected a file path")
    format = _format_of(format, path)
    _check_writable(path)
    for text in input_shapes or ():  # a malformed shape is refused before the model is built
        if isinstance(text, str):
            parse_input_shape(text)
    module = _resolve(model, pretrained, arm)
    label = getattr(module, "domainfm_name", None) or type(module).__name__
    inputs = tuple(example_inputs) if example_inputs is not None else example_inputs_for(module, input_shapes)
    if features:
        if not callable(getattr(module, "forward_features", None)):
            raise InputError(f"--features: {label} has no forward_features()")
        module = _Features(module).eval()
        inputs = inputs[:len(_positional(module.backbone.forward_features))]
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = module(*inputs)
    except Exception as exc:
        kwargs = getattr(module, "domainfm_kwargs", None)
        headless = not features and getattr(module, "head", ...) is None
        hint = ("; it has no head (a pretrained backbone): --features exports its forward_features (features=True "
                "in Python)" if headless else "; give one --input-shape per input (e.g. --input-shape 2,19,6000), "
                "or example_inputs= in Python")
        raise InputError(f"{label}: the model does not run on the example input ({_shapes(inputs)}"
                         f"{f'; built with {kwargs}' if kwargs else ''}): {_first_line(exc)}{hint}") from exc
    reference = flat_outputs(out)
    if not reference:
        raise ExportError(f"{type(module).__name__}: the model's output holds no tensor to export")
    notes: list[str] = []
    batch: list[int] = []
    if dynamic_batch:
        batch, why = _batch_inputs(module, inputs, reference)
        if why:
            notes.append(f"batch fixed at the example's shapes: {why}")
    names = {"inputs": _input_names(module, inputs)}
    names["outputs"] = _unclash(_output_names(out), names["inputs"])
    written: list[Path] = []
    commit = _commit_into(path, written)
    if format == "onnx":
        exporter, worst, more, batch = _export_onnx(module, inputs, path, names=names, batch=batch, opset=opset,
                                                    reference=reference, commit=commit)
    else:
        exporter, worst, more, batch = _export_pt2(module, inputs, path, batch=batch, reference=reference,
                                                   commit=commit)
    return ExportResult(path=path, format=format, exporter=exporter, seconds=round(time.perf_counter() - start, 2),
                        input_names=names["inputs"], input_shapes=[tuple(x.shape) for x in inputs if torch.is_tensor(x)],
                        output_names=names["outputs"], dynamic_batch=bool(batch), verified=worst,
                        extra_files=written, notes=notes + more)
