"""chronos-forecasting's Chronos-2 formats -> :class:`.chronos2.Chronos2`: checkpoints and inputs.

**Checkpoints.** A Hugging Face Chronos-2 repository (``amazon/chronos-2``) holds a T5-style
``config.json`` (architecture ``Chronos2Model``) whose ``chronos_config`` block sets the patching,
horizon, quantiles and normalisation, beside ``model.safetensors`` in upstream key names:
``encoder.block.{i}.layer.{0,1,2}`` (time attention, group attention, feed-forward, each with its
``layer_norm``), ``encoder.final_layer_norm``, ``input_patch_embedding`` / ``output_patch_embedding``
(``{hidden,output,residual}_layer``) and ``shared``. :func:`convert_chronos2` renames the keys;
:func:`apply_chronos2_config` makes the model the architecture ``config.json`` describes (the hub
calls it through ``model.domainfm_upstream_config`` before loading, so ``create_model("chronos-2",
pretrained=DIR)`` builds the folder's own sizes); :func:`load_chronos2` loads a folder or an
``hf://org/repo``.

**Inputs.** :func:`prepare_inputs` turns chronos-forecasting's inputs into tasks (rows of one
group: the targets first, then past-only covariates, then known-future covariates, each kind in
name order for dicts and in column order for DataFrames); categorical covariates (non-numeric
values) are encoded per item by the target's smoothed mean per category (``(item mean + sum) /
(1 + count)``, unseen categories get the item mean) when there is one target, by their category
index otherwise. :func:`prepare_data_frame` does the same for long-format DataFrames and
:func:`batch_tasks` batches tasks as the upstream dataset does.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from .chronos_bolt_convert import fetch_registered_repo, upstream_chronos_config

__all__ = ["convert_chronos2", "apply_chronos2_config", "load_chronos2", "chronos2_kwargs", "Task",
           "prepare_inputs", "prepare_dicts", "prepare_data_frame", "batch_tasks", "forecast_frame"]

# --------------------------------------------------------------------------- checkpoints

_SUBLAYERS = {"0": ("time_attn", "self_attention"), "1": ("group_attn", "self_attention"), "2": ("ffn", "mlp")}
_NORMS = {"0": "time_attn_norm", "1": "group_attn_norm", "2": "ffn_norm"}
_BLOCKS = {"input_patch_embedding": "patch_embed", "output_patch_embedding": "quantile_head"}
_LAYERS = {"hidden_layer": "hidden", "output_layer": "output", "residual_layer": "residual"}
_BLOCK_KEY = re.compile(r"encoder\.block\.(\d+)\.layer\.([012])\.(.+)")


def _our_key(key: str) -> str | None:
    """Our name for an upstream key; None when it is not an upstream key."""
    if key in ("shared.weight",):
        return key
    if key == "encoder.final_layer_norm.weight":
        return "encoder.final_norm.weight"
    block, _, rest = key.partition(".")
    layer, _, leaf = rest.partition(".")
    if block in _BLOCKS and layer in _LAYERS and leaf in ("weight", "bias"):
        return f"{_BLOCKS[block]}.{_LAYERS[layer]}.{leaf}"
    match = _BLOCK_KEY.fullmatch(key)
    if match is None:
        return None
    index, sub, rest = match.groups()
    if rest == "layer_norm.weight":
        return f"encoder.blocks.{index}.{_NORMS[sub]}.weight"
    ours, theirs = _SUBLAYERS[sub]
    parts = rest.split(".")
    allowed = ("q", "k", "v", "o") if theirs == "self_attention" else ("wi", "wo")
    if len(parts) == 3 and parts[0] == theirs and parts[1] in allowed and parts[2] == "weight":
        return f"encoder.blocks.{index}.{ours}.{parts[1]}.weight"
    return None


def convert_chronos2(state_dict: Mapping[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Rename an upstream ``Chronos2Model`` state_dict to our keys. Derived buffers (RoPE
    frequencies, the quantile levels) are dropped; any other unknown key is an error that names
    it. Idempotent: our own keys pass through."""
    ours = set(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        if key in ours:
            out[key] = value
        elif key.endswith(("rope_embed.inv_freq", "rope_embed.original_inv_freq")) or key == "quantiles":
            continue
        elif (new := _our_key(key)) is not None:
            out[new] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"unrecognised key(s) in the Chronos-2 checkpoint: {sorted(unknown)[:8]}")
    return out


def chronos2_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`.chronos2.Chronos2` keyword arguments from an upstream ``config.json``."""
    chronos = upstream_chronos_config(config, "Chronos2Model", "Chronos-2", ("context_length", "input_patch_size",
                                      "input_patch_stride", "output_patch_size", "quantiles"))
    projection = str(config.get("feed_forward_proj", "relu"))
    if projection.startswith("gated-") or config.get("is_gated_act", False):
        raise ValueError(f"config.json feed_forward_proj={projection!r}: gated feed-forward layers are not part of Chronos-2")
    kwargs = dict(context_length=int(chronos["context_length"]), input_patch_size=int(chronos["input_patch_size"]),
                  input_patch_stride=int(chronos["input_patch_stride"]),
                  output_patch_size=int(chronos["output_patch_size"]),
                  # the upstream dataclass's defaults for the optional fields
                  max_output_patches=int(chronos.get("max_output_patches", 1)),
                  quantiles=[float(q) for q in chronos["quantiles"]],
                  use_reg_token=bool(chronos.get("use_reg_token", False)),
                  use_arcsinh=bool(chronos.get("use_arcsinh", False)),
                  time_encoding_scale=int(chronos.get("time_encoding_scale") or chronos["context_length"]))
    for ours, theirs, cast, default in (("d_model", "d_model", int, 512), ("d_kv", "d_kv", int, 64),
                                        ("d_ff", "d_ff", int, 2048), ("num_layers", "num_layers", int, 6),
                                        ("num_heads", "num_heads", int, 8), ("dropout", "dropout_rate", float, 0.1),
                                        ("layer_norm_eps", "layer_norm_epsilon", float, 1e-6),
                                        ("initializer_factor", "initializer_factor", float, 0.05),
                                        ("rope_theta", "rope_theta", float, 10000.0)):
        kwargs[ours] = cast(config.get(theirs, default))
    kwargs["dense_act_fn"] = projection.split("-")[-1]
    return kwargs


def apply_chronos2_config(model, config: Mapping[str, Any]) -> None:
    """Make ``model`` the architecture an upstream ``config.json`` describes (modules whose shape
    changes are rebuilt before the weights load). Our own save format is left alone."""
    if isinstance(config, Mapping) and "domainfm" in config:
        return
    model.rebuild(**chronos2_kwargs(config))


def load_chronos2(source: str | os.PathLike, *, name: str = "chronos-2", sha256: Mapping[str, str] | None = None,
                  **kwargs):
    """A Chronos-2 model from a folder laid out as its Hugging Face repository (``config.json`` +
    ``model.safetensors``) or from ``"hf://org/repo"``; built with the sizes of its ``config.json``."""
    from domainfm import hub, zoo


    if str(source).startswith("hf://"):
        directory = fetch_registered_repo(str(source), pattern="chronos-2*", card=zoo.get_card(name), sha256=sha256)
    else:
        directory = Path(source)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{source}: expected a folder with config.json and model.safetensors")
    json.loads((Path(directory) / "config.json").read_text())  # a clear error for a broken file
    return hub.create_model(name, pretrained=str(directory), **kwargs)


# --------------------------------------------------------------------------- inputs


@dataclass
class Task:
    """One forecasting task: rows (targets, then covariates) forecast as one group."""

    context: torch.Tensor  # (rows, T) float32, NaN = missing
    future: torch.Tensor  # (rows, prediction_length) float32: known future values, NaN elsewhere
    n_targets: int
    n_covariates: int = 0
    n_future_covariates: int = 0


def _series(value, label: str) -> np.ndarray:
    if torch.is_tensor(value):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _numeric(values: np.ndarray, label: str) -> torch.Tensor:
    try:
        return torch.from_numpy(np.asarray(values, dtype=np.float32))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label}: expected numbers ({exc})") from None


def prepare_inputs(inputs, prediction_length: int) -> list[Task]:
    """Tasks from chronos-forecasting's input formats: a (tasks, variates, T) tensor/array; a list
    of (T,) or (variates, T) tensors/arrays; a list of dicts (``target``, ``past_covariates``,
    ``future_covariates``, see :func:`prepare_dicts`); a list of upstream prepared inputs
    (``context``, ``future_covariates``, ``n_targets``, ...). Also a (T,) series and a (B, T)
    batch of univariate series (which upstream refuses)."""
    nan = lambda rows: torch.full((rows, prediction_length), float("nan"))  # noqa: E731
    if torch.is_tensor(inputs) or isinstance(inputs, np.ndarray):
        data = _numeric(_series(inputs, "inputs"), "inputs")
        if data.ndim not in (1, 2, 3) or data.shape[-1] == 0:
            raise ValueError(f"inputs: expected a (tasks, variates, time) tensor, got shape {tuple(data.shape)}")
        data = data.view(1, 1, -1) if data.ndim == 1 else data[:, None] if data.ndim == 2 else data
        return [Task(series.clone(), nan(series.shape[0]), series.shape[0]) for series in data]
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise ValueError("inputs: expected a tensor/array, or a non-empty list of series or of dicts")
    if all(isinstance(item, Task) for item in inputs):
        for i, task in enumerate(inputs):
            if task.future.shape != (task.context.shape[0], prediction_length):
                raise ValueError(f"inputs[{i}].future: shape {tuple(task.future.shape)}, expected "
                                 f"(rows={task.context.shape[0]}, prediction_length={prediction_length})")
        return list(inputs)
    if isinstance(inputs[0], Mapping):
        if "context" in inputs[0]:
            return [_prepared(item, i, prediction_length) for i, item in enumerate(inputs)]
        return prepare_dicts(inputs, prediction_length)
    tasks = []
    for i, item in enumerate(inputs):
        if isinstance(item, Mapping):
            raise ValueError(f"inputs[{i}]: a dict in a list of series; give all tasks in one format")
        series = _numeric(_series(item, f"inputs[{i}]"), f"inputs[{i}]")
        if series.ndim not in (1, 2):
            raise ValueError(f"inputs[{i}]: expected a (time,) or (variates, time) series, got shape {tuple(series.shape)}")
        series = series.view(1, -1) if series.ndim == 1 else series
        tasks.append(Task(series, nan(series.shape[0]), series.shape[0]))
    return tasks


def _prepared(item: Mapping, i: int, prediction_length: int) -> Task:
    for key in ("context", "future_covariates", "n_targets", "n_covariates", "n_future_covariates"):
        if key not in item:
            raise ValueError(f"inputs[{i}]: a prepared input without {key!r}")
    context = torch.as_tensor(item["context"]).to(torch.float32)
    future = torch.as_tensor(item["future_covariates"]).to(torch.float32)
    if context.ndim != 2 or future.shape != (context.shape[0], prediction_length):
        raise ValueError(f"inputs[{i}]: context {tuple(context.shape)} and future_covariates {tuple(future.shape)}: "
                         f"expected (rows, time) and (rows, prediction_length={prediction_length})")
    return Task(context, future, int(item["n_targets"]), int(item["n_covariates"]), int(item["n_future_covariates"]))


def _unavailable(value) -> bool:
    return value is None or (hasattr(value, "__len__") and len(value) == 0)


def prepare_dicts(data: Sequence[Mapping], prediction_length: int) -> list[Task]:
    """Tasks from a list of dicts, one per item: ``target`` (T,) or (n_targets, T);
    ``past_covariates`` {name: (T,)}: past values of every covariate; ``future_covariates``
    {name: (prediction_length,)}: future values of the known-future ones (a subset of the past
    names; ``None`` for a covariate known in the future whose values are not given). All items share
    one schema (names, number of targets); only their lengths may differ. Errors name the field."""
    allowed = {"target", "past_covariates", "future_covariates"}
    targets, past, future, lengths = [], [], [], []
    for i, item in enumerate(data):
        if not isinstance(item, Mapping):
            raise ValueError(f"inputs[{i}]: expected a dict like the others, got {type(item).__name__}")
        extra = sorted(set(item) - allowed)
        if extra:
            raise ValueError(f"inputs[{i}]: unknown key(s) {extra}; allowed: {sorted(allowed)}")
        if "target" not in item:
            raise ValueError(f"inputs[{i}]: no 'target'")
        target = _numeric(_series(item["target"], f"inputs[{i}]['target']"), f"inputs[{i}]['target']")
        if target.ndim not in (1, 2):
            raise ValueError(f"inputs[{i}]['target']: expected (time,) or (n_targets, time), got shape {tuple(target.shape)}")
        target = target.view(1, -1) if target.ndim == 1 else target
        length = target.shape[-1]
        covariates = {}
        for group, expected in (("past_covariates", length), ("future_covariates", prediction_length)):
            given = item.get(group) or {}
            if not isinstance(given, Mapping):
                raise ValueError(f"inputs[{i}]['{group}']: expected a dict {{name: values}}, got {type(given).__name__}")
            arrays = {}
            for name, values in given.items():
                if group == "future_covariates" and _unavailable(values):
                    arrays[name] = None
                    continue
                array = _series(values, f"inputs[{i}]['{group}']['{name}']")
                if array.ndim != 1 or len(array) != expected:
                    what = "the target's length" if group == "past_covariates" else "prediction_length"
                    raise ValueError(f"inputs[{i}]['{group}']['{name}']: expected shape ({expected},) ({what}), "
                                     f"got {tuple(array.shape)}")
                arrays[name] = array
            covariates[group] = arrays
        unknown = sorted(set(covariates["future_covariates"]) - set(covariates["past_covariates"]))
        if unknown:
            raise ValueError(f"inputs[{i}]['future_covariates']: {unknown} have no past values in 'past_covariates' "
                             f"(known-future covariates need both; past names: {sorted(covariates['past_covariates'])})")
        if i and target.shape[0] != targets[0].shape[0]:
            raise ValueError(f"inputs[{i}]['target']: {target.shape[0]} target row(s) but inputs[0] has "
                             f"{targets[0].shape[0]}; forecast tasks of different shapes in separate calls")
        for group, seen in (("past_covariates", past), ("future_covariates", future)):
            if i and sorted(covariates[group]) != sorted(seen[0]):
                raise ValueError(f"inputs[{i}]['{group}']: names {sorted(covariates[group])} differ from inputs[0]'s "
                                 f"{sorted(seen[0])}; all tasks of a call share one schema")
        if i:
            mixed = [n for n in future[0] if (future[0][n] is None) != (covariates["future_covariates"][n] is None)]
            if mixed:
                raise ValueError(f"inputs[{i}]['future_covariates']: {mixed} given here but None in inputs[0] (or "
                                 "the other way round); every task gives or omits the same future values")
        targets.append(target)
        past.append(covariates["past_covariates"])
        future.append(covariates["future_covariates"])
        lengths.append(length)
    known = sorted(future[0])
    past_columns = {name: np.concatenate([p[name] for p in past]) for name in sorted(past[0])}
    future_columns = {name: np.concatenate([f[name] for f in future]) for name in known if future[0][name] is not None}
    # non-numeric values (strings, booleans, mixed objects) are categories
    categorical = {name for name, values in past_columns.items() if not np.issubdtype(values.dtype, np.number)}
    return _build_tasks(torch.cat(targets, dim=1).numpy(), past_columns, future_columns, known, lengths,
                        prediction_length, categorical)


def _encode_categorical(past, future: np.ndarray | None, target: np.ndarray | None,
                        items: np.ndarray, future_items: np.ndarray, n_items: int):
    """Encoded past (and future) values of one categorical covariate: by the target's smoothed
    mean per item and category when ``target`` is given, else by category index (NaN for a future
    category never seen in the past). Missing values are a category of their own."""
    import pandas as pd

    past = past if isinstance(past, pd.Categorical) else pd.Categorical(past)  # categories sorted
    categories = past.categories
    missing, unseen = len(categories), len(categories) + 1
    codes = np.where(past.codes < 0, missing, past.codes).astype(np.intp)
    future_codes = None
    if future is not None:
        found = categories.get_indexer(future)
        future_codes = np.where(found < 0, np.where(pd.isna(future), missing, unseen), found)
    if target is None:
        encoded = None if future_codes is None else np.where(future_codes == unseen, np.nan, future_codes)
        return codes.astype(np.float32), None if encoded is None else encoded.astype(np.float32)
    observed = np.isfinite(target)
    values = np.where(observed, target, 0.0)
    item_sum = np.bincount(items, weights=values, minlength=n_items)
    item_count = np.bincount(items, weights=observed.astype(float), minlength=n_items)
    item_mean = np.divide(item_sum, item_count, out=np.zeros(n_items), where=item_count > 0)
    slots = unseen + 1
    cell = items * slots + codes
    cell_sum = np.bincount(cell, weights=values, minlength=n_items * slots)
    cell_count = np.bincount(cell, weights=observed.astype(float), minlength=n_items * slots)
    table = (np.repeat(item_mean, slots) + cell_sum) / (1.0 + cell_count)
    encoded_future = None if future_codes is None else table[future_items * slots + future_codes].astype(np.float32)
    return table[cell].astype(np.float32), encoded_future


def _build_tasks(target: np.ndarray, past: dict[str, Any], future: dict[str, np.ndarray], known: list[str],
                 lengths: list[int], prediction_length: int, categorical: set[str]) -> list[Task]:
    """Tasks from columns stacked over items (``target`` (n_targets, sum(lengths)), each past
    column (sum(lengths),), each given future column (items * prediction_length,)); the columns
    named in ``categorical`` are encoded (see :func:`_encode_categorical`)."""
    n_items, n_targets = len(lengths), target.shape[0]
    items = np.repeat(np.arange(n_items), lengths)
    future_items = np.repeat(np.arange(n_items), prediction_length)
    columns = [c for c in past if c not in known] + [c for c in past if c in known]
    rows_past, rows_future = [], []
    for name in columns:
        values, ahead = past[name], future.get(name)
        if name in categorical:
            enc_past, enc_future = _encode_categorical(values, ahead, target[0] if n_targets == 1 else None,
                                                       items, future_items, n_items)
        else:
            enc_past = _numeric(values, f"past_covariates['{name}']").numpy()
            enc_future = None if ahead is None else _numeric(ahead, f"future_covariates['{name}']").numpy()
        rows_past.append(enc_past)
        rows_future.append(np.full(n_items * prediction_length, np.nan, np.float32) if enc_future is None else enc_future)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    tasks = []
    for i in range(n_items):
        a, b = bounds[i], bounds[i + 1]
        f = slice(i * prediction_length, (i + 1) * prediction_length)
        context = np.concatenate([target[:, a:b]] + [r[None, a:b] for r in rows_past]).astype(np.float32)
        ahead = np.concatenate([np.full((n_targets, prediction_length), np.nan, np.float32)]
                               + [r[None, f] for r in rows_future]).astype(np.float32)
        tasks.append(Task(torch.from_numpy(context), torch.from_numpy(ahead), n_targets, len(columns), len(known)))
    return tasks


def batch_tasks(tasks: Sequence[Task], batch_size: int, context_length: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]]:
    """``(context (rows, T), group_ids (rows,), future (rows, H), target row ranges)`` per batch:
    tasks are added while the batch has fewer than ``batch_size`` rows; each context keeps its last
    ``context_length`` values and is left-padded with NaN to the longest of its batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected a positive integer")
    i = 0
    while i < len(tasks):
        chosen, rows = [], 0
        while i < len(tasks) and rows < batch_size:
            chosen.append(tasks[i])
            rows += tasks[i].context.shape[0]
            i += 1
        contexts = [t.context[:, -context_length:] for t in chosen]
        longest = max(c.shape[-1] for c in contexts)
        context = torch.cat([torch.nn.functional.pad(c, (longest - c.shape[-1], 0), value=float("nan"))
                             for c in contexts])
        sizes = torch.tensor([t.context.shape[0] for t in chosen])
        starts = torch.cumsum(sizes, 0) - sizes
        yield (context, torch.repeat_interleave(torch.arange(len(chosen)), sizes), torch.cat([t.future for t in chosen]),
               [(int(s), int(s) + t.n_targets) for s, t in zip(starts, chosen)])


# --------------------------------------------------------------------------- DataFrames


def _grouped(frame, id_column: str, timestamp_column: str, order=None):
    """``frame`` with datetime timestamps, its rows grouped by item (first appearance, or ``order``)
    and in time order within each item."""
    import pandas as pd

    if not pd.api.types.is_datetime64_any_dtype(frame[timestamp_column]):
        frame = frame.assign(**{timestamp_column: pd.to_datetime(frame[timestamp_column])})
    codes = pd.factorize(frame[id_column])[0] if order is None else pd.Index(order).get_indexer(frame[id_column])
    stamps = frame[timestamp_column].to_numpy().view("int64")
    permutation = np.lexsort([stamps, codes])
    if (permutation != np.arange(len(frame))).any():
        frame = frame.iloc[permutation].reset_index(drop=True)
    return frame


def _check_frames(df, future_df, targets, prediction_length, id_column, timestamp_column) -> None:
    import pandas as pd

    missing = [c for c in [id_column, timestamp_column, *targets] if c not in df.columns]
    if missing:
        raise ValueError(f"df has no column(s) {missing} (id_column={id_column!r}, timestamp_column="
                         f"{timestamp_column!r}, target={targets}); its columns: {list(df.columns)}")
    for column in targets:
        if not pd.api.types.is_numeric_dtype(df[column]):
            raise ValueError(f"df[{column!r}] (a target) must be numeric, got dtype {df[column].dtype}")
    if future_df is None:
        return
    missing = [c for c in (id_column, timestamp_column) if c not in future_df.columns]
    if missing:
        raise ValueError(f"future_df has no column(s) {missing}")
    given_targets = [c for c in future_df.columns if c in targets]
    if given_targets:
        raise ValueError(f"future_df holds target column(s) {given_targets}: the targets are what is forecast")
    unknown = [c for c in future_df.columns if c not in df.columns]
    if unknown:
        raise ValueError(f"future_df column(s) {unknown} are not in df: a known-future covariate needs its past "
                         f"values in df as well (df's covariates: "
                         f"{[c for c in df.columns if c not in (id_column, timestamp_column, *targets)]})")
    ids, future_ids = set(df[id_column].unique()), set(future_df[id_column].unique())
    if ids != future_ids:
        raise ValueError(f"future_df[{id_column!r}] has other items than df: only in df "
                         f"{sorted(map(str, ids - future_ids))[:5]}, only in future_df {sorted(map(str, future_ids - ids))[:5]}")
    sizes = future_df[id_column].value_counts()
    wrong = sizes[sizes != prediction_length]
    if len(wrong):
        raise ValueError(f"future_df must hold prediction_length={prediction_length} rows per item; "
                         f"{dict(list(wrong.items())[:5])} do not")


def _frequency(df, id_column: str, timestamp_column: str) -> str:
    import pandas as pd

    found = set()
    for item, stamps in df.groupby(id_column, sort=False)[timestamp_column]:
        if len(stamps) >= 3:
            freq = pd.infer_freq(pd.DatetimeIndex(stamps))
            if freq is None:
                raise ValueError(f"item {item!r}: the timestamps are not regular (no frequency could be inferred); "
                                 "pass freq=")
            found.add(freq)
    if len(found) != 1:
        raise ValueError(f"the items' frequencies disagree ({sorted(found)})" if found else
                         "no item has 3 timestamps to infer the frequency from; pass freq=")
    return found.pop()


def prepare_data_frame(df, future_df=None, *, id_column: str, timestamp_column: str, targets: list[str],
                       prediction_length: int, freq: str | None = None, validate: bool = True):
    """``(tasks, future index)`` from a long-format DataFrame: one task per item (in order of first
    appearance), its rows the ``targets`` and every other column as a covariate (past-only, or
    known-future when ``future_df`` has it); the index lists ``(id, timestamp)`` of every forecast step."""
    import pandas as pd

    if validate:
        _check_frames(df, future_df, targets, prediction_length, id_column, timestamp_column)
    df = _grouped(df, id_column, timestamp_column)
    if future_df is not None:
        future_df = _grouped(future_df, id_column, timestamp_column, order=pd.unique(df[id_column]))
    covariates = [c for c in df.columns if c not in (id_column, timestamp_column) and c not in targets]
    types = pd.api.types
    categorical = {c for c in covariates if not types.is_numeric_dtype(df[c]) or types.is_bool_dtype(df[c])}
    past = {c: df[c].astype("category").array if c in categorical else df[c].to_numpy(np.float32, na_value=np.nan)
            for c in covariates}
    known = [c for c in covariates if future_df is not None and c in future_df.columns]
    future = {c: future_df[c].to_numpy() if c in categorical else future_df[c].to_numpy(np.float32, na_value=np.nan)
              for c in known}
    lengths = df[id_column].value_counts(sort=False).tolist()
    tasks = _build_tasks(df[targets].to_numpy(dtype=np.float32, na_value=np.nan).T, past, future, known, lengths,
                         prediction_length, categorical)

    freq = freq or _frequency(df, id_column, timestamp_column)
    offset = pd.tseries.frequencies.to_offset(freq)
    ends = np.cumsum(lengths) - 1
    last = pd.DatetimeIndex(df[timestamp_column].to_numpy()[ends])
    stamps = np.stack([last + step * offset for step in range(1, prediction_length + 1)], axis=1).ravel()
    index = pd.DataFrame({id_column: np.repeat(df[id_column].to_numpy()[ends], prediction_length),
                          timestamp_column: pd.DatetimeIndex(stamps)})
    if validate and future_df is not None:
        expected, given = pd.DatetimeIndex(index[timestamp_column]), pd.DatetimeIndex(future_df[timestamp_column])
        if (expected != given).any():
            bad = int(np.argmax(np.asarray(expected != given)))
            raise ValueError(f"future_df[{timestamp_column!r}]: item {index[id_column].iloc[bad]!r} has {given[bad]} "
                             f"where the forecast step is {expected[bad]} (the {prediction_length} steps after each "
                             f"item's last timestamp, frequency {freq})")
    return tasks, index


def forecast_frame(index, targets: list[str], quantiles: list[torch.Tensor], means: list[torch.Tensor],
                   levels: Sequence[float], prediction_length: int):
    """The forecasts as a long DataFrame: item, then target, then step (see ``predict_df``)."""
    n_items, n_targets = len(quantiles), len(targets)
    rows = np.arange(len(index)).reshape(n_items, prediction_length)
    out = index.iloc[np.repeat(rows, n_targets, axis=0).ravel()].reset_index(drop=True)
    out["target_name"] = np.tile(np.repeat(targets, prediction_length), n_items)
    out["predictions"] = torch.stack(means).numpy().ravel()
    values = torch.stack(quantiles).numpy().reshape(len(out), len(levels))
    for j, level in enumerate(levels):
        out[str(level)] = values[:, j]
    return out
