"""ExPLoRA fine-tuning: image classification (top-1 / top-5) in LoRA, full or linear-probe mode,
declared on the experiment layer; selected by validation top-1 unless ``train.monitor`` is set.

The paper's settings are in ``configs/explora/finetune_fmow_rgb.yaml`` / ``linear_probe_fmow_rgb.yaml``.
Weights (an official ExPLoRA file, or the ``backbone/`` of ``domainfm pretrain explora``) load through
:func:`domainfm.experiment.resolve` with the card's ``official`` converter (``norm`` -> ``fc_norm``
for average pooling). The embedded default (``configs/explora/finetune.yaml``) fine-tunes on tiles of
the shipped Sentinel-2 scene with labels **derived from spectral indices**, after an in-process
extended pretraining stage, in two arms: ``pretrained`` (the stage's output) and ``stage_init``
(the same starting weights without extended pretraining).

Retained capability (forgetting, :data:`RETAINED`): a k-NN classifier (scikit-learn, cosine, k=5)
on the arm's frozen pooled embeddings of tiles that neither train nor select the model (the
``data.retained_offset`` blocks of the shipped scene), for two *other* constructed labellings of
those tiles: texture (terciles of the tiles' brightness coefficient of variation) and moisture
(terciles of the mean NDMI, from B08/B11, which the RGB model never sees); 2-fold spatial
cross-validation, the mean accuracy is the summary (chance 1/3).

Apply a model: :func:`predict` (a class-map GeoTIFF with the scene's CRS, transform and size),
:func:`embed` (per-tile embeddings) and ``domainfm predict|embed explora``, declared on the shared
apply layer (:data:`APPLY`); a scene is prepared as in training (:func:`inference_settings`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from domainfm.data_loaders import satellite as S
from domainfm.engine import TrainConfig
from domainfm.experiment import AdaptSection, ArmContext, ExperimentConfig, Family, ModelSection, Retained, TaskData
from domainfm.experiment import apply
from domainfm.experiment import metrics as M
from domainfm.experiment.supervised import SupervisedRecipe
from domainfm.lora.settings import LoraSettings
from domainfm.models.explora.satmae import freeze_fixed_encodings

__all__ = ["Config", "DataSection", "ClassificationRecipe", "FAMILY", "LABELS_NOTE", "RETAINED", "InferenceSettings",
           "ApplyOptions", "APPLY", "ClassMap", "build_task", "run", "evaluate", "inference_settings", "predict",
           "embed", "plot_class_map", "class_map_picture", "retained_knn"]

LABELS_NOTE = (
    "constructed: each 12x12-px (720 m) tile of the shipped Sentinel-2 scene is labelled from spectral indices "
    "of its own pixels (water: >=50% pixels NDWI>0; shore_mixed: >=10%; else moderate/dense vegetation by mean "
    "NDVI < / >= 0.45). The model sees only RGB (B04,B03,B02). Not ground truth."
)


@dataclass
class DataSection:
    #: ``sample`` (shipped scene + spectral-index labels), ``folder`` (root/<class>/*.tif) or ``csv``
    source: str = "sample"
    path: str | None = None
    val_path: str | None = None
    bands: list[str] = field(default_factory=lambda: ["B04", "B03", "B02"])
    band_indices: list[int] | None = None
    n_bands: int | None = None
    tile_size: int = 12
    img_size: int = 32
    mean: list[float] | None = None
    std: list[float] | None = None
    #: sample: tiles in blocks of ``split_block`` x ``split_block`` tiles, every ``split_every``-th
    #: diagonal block validates
    split_block: int = 4
    split_every: int = 4
    #: sample: blocks with ``(block_row + block_col) % split_every == retained_offset`` are held out of
    #: training *and* validation, for the retained capability only (None: it uses validation tiles)
    retained_offset: int | None = 2
    #: folder/csv: at most this many validation images for the retained capability
    retained_max: int = 256
    #: folder/csv without val_path: fraction held out (seeded by ``train.seed``)
    val_fraction: float = 0.2

    def __post_init__(self):
        if self.source not in {"sample", "folder", "csv"}:
            raise ValueError(f"data.source={self.source!r}: expected sample, folder or csv")
        if self.retained_offset is not None and not 0 < self.retained_offset < self.split_every:
            raise ValueError(f"data.retained_offset={self.retained_offset}: expected 1 .. split_every-1 "
                             f"({self.split_every - 1}) or null (block offset 0 is validation)")


@dataclass
class Config(ExperimentConfig):
    label_smoothing: float = 0.1
    model: ModelSection = field(default_factory=lambda: ModelSection(
        name="explora-test", converter="official", kwargs={"global_pool": "avg", "drop_path_rate": 0.2}))
    adapt: AdaptSection = field(default_factory=lambda: AdaptSection(mode="lora", lora=LoraSettings(
        targets=["blocks.*.attn.qkv@q,v"], rank=8, alpha=8.0, unfreeze=["fc_norm.*"])))
    data: DataSection = field(default_factory=DataSection)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=1e-3, weight_decay=0.0))


class ClassificationRecipe(SupervisedRecipe):
    """Multiclass classification reporting top-1 and top-5 beside the shared metric set."""

    def metrics(self, outputs):
        result = super().metrics(outputs)
        result["top1"] = result["accuracy"]
        if outputs["scores"].shape[1] > 5:  # with <= 5 classes top-5 is always 1
            result["top5"] = M.top_k_accuracy(outputs["target"], outputs["scores"], k=5)
        return result


# ----------------------------------------------------------------------------- data


def _labels(ds) -> list[int]:
    if isinstance(ds, torch.utils.data.Subset):
        return [int(ds.dataset.samples[i][1]) for i in ds.indices]
    return ds.labels.tolist()


def _file_retained(data: DataSection, val, seed: int) -> dict:
    """Folder/CSV runs: up to ``data.retained_max`` validation images, labelled by texture terciles
    (the coefficient of variation of the normalised band mean); folds alternate."""
    order = torch.randperm(len(val), generator=torch.Generator().manual_seed(seed + 1)).tolist()[:data.retained_max]
    images = torch.stack([val[i][0] for i in order])
    bright = images.float().mean(1).flatten(1)
    cv = (bright.std(1) / (bright.mean(1).abs() + 1e-6)).numpy()
    return {"images": images, "labels": {"texture": S.terciles(cv)}, "folds": np.arange(len(order)) % 2,
            "split": "validation images"}


def build_task(cfg: Config) -> TaskData:
    """The classification task of ``cfg.data``; ``info`` carries the majority-class top-1 on
    validation (the class most frequent in training), the floor any model must beat, and the
    normalisation statistics that ``predict`` reuses; ``extras["retained"]`` the retained tiles."""
    d = cfg.data
    train_tf, eval_tf = S.Resize(d.img_size, flip=True), S.Resize(d.img_size)
    if d.source == "sample":
        train, val, retained, extra = S.sample_tile_task(
            bands=d.bands, mean=d.mean, std=d.std, tile_size=d.tile_size, split_block=d.split_block,
            split_every=d.split_every, retained_offset=d.retained_offset, train_transform=train_tf,
            eval_transform=eval_tf)
        classes = list(S.INDEX_CLASSES)
    else:
        if d.mean is None or d.std is None or d.path is None:
            raise ValueError(f"data.source={d.source!r} needs data.path, data.mean and data.std (per-band statistics)")
        train, val, classes = S.labelled_images(
            d.source, d.path, val_path=d.val_path, val_fraction=d.val_fraction, seed=cfg.train.seed,
            n_bands=d.n_bands, bands=d.band_indices, stats=S.BandStats(d.mean, d.std), train_transform=train_tf,
            eval_transform=eval_tf)
        retained = _file_retained(d, val, cfg.train.seed)
        extra = {"band_stats": {"mean": list(d.mean), "std": list(d.std)}}
    majority = int(np.bincount(_labels(train)).argmax())
    info = {"classes": classes, "n_train": len(train), "n_val": len(val),
            "majority_class_top1": float(np.mean(np.asarray(_labels(val)) == majority)), **extra}
    return TaskData(train, val, None, task="multiclass", n_outputs=len(classes), info=info,
                    labels=LABELS_NOTE if d.source == "sample" else "recorded", extras={"retained": retained})


# ----------------------------------------------------------------------------- retained capability


def retained_knn(ctx: ArmContext) -> dict[str, Any]:
    """Retained capability: k-NN accuracy (cosine, k=5) of the arm's frozen embeddings on other
    constructed labellings of held-out tiles; 2-fold spatial cross-validation."""
    from sklearn.neighbors import KNeighborsClassifier

    held, model = ctx.task.extras["retained"], ctx.model
    # pooled pre-logits features (what a linear head would see), in fp32
    z = apply.Runtime("32-true", next(model.parameters()).device, batch_size=128).batched(
        lambda x: model.forward_head(model.forward_features(x), pre_logits=True), held["images"]).numpy()
    z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
    folds = held["folds"]
    out: dict[str, Any] = {}
    for name, y in held["labels"].items():
        accs = []
        for k in (0, 1):
            fit, score = folds != k, folds == k
            knn = KNeighborsClassifier(n_neighbors=min(5, int(fit.sum())), metric="cosine", algorithm="brute")
            knn.fit(z[fit], y[fit])
            accs.append(float((knn.predict(z[score]) == y[score]).mean()))
        out[f"knn_{name}"] = float(np.mean(accs))
    out["knn_accuracy"] = float(np.mean([out[f"knn_{n}"] for n in held["labels"]]))
    out["n_tiles"] = int(len(z))
    return out


RETAINED = Retained(
    retained_knn, metric="knn_accuracy", direction="max",
    description=("k-NN (cosine, k=5, 2-fold spatial CV) accuracy of the frozen pooled embeddings on tiles that neither "
                 "train nor select the model (data.retained_offset blocks of the shipped scene), for two OTHER "
                 "CONSTRUCTED labellings: texture (terciles of the brightness coefficient of variation) and moisture "
                 "(terciles of mean NDMI from B08/B11, bands the RGB model never sees); mean of the two, chance 1/3. "
                 "Folder/CSV data: texture terciles of up to data.retained_max validation images"),
)


def class_map_picture(ctx: ArmContext) -> dict[str, Any]:
    """Protocol after adaptation: the arm's class map of the shipped scene beside its RGB (and the
    constructed reference labels), ``<arm>/class_map.png``; other data sources draw nothing."""
    cfg = ctx.cfg
    if cfg.data.source != "sample":
        return {}
    result = predict(S.sample_scene_path(), ctx.model, _run_settings(cfg, ctx.task.info),
                     device=next(ctx.model.parameters()).device)
    raster, ts = result.raster, result.tile_size
    raw = torch.from_numpy(raster.data.astype(np.float32))
    reference = S.stitch_tiles(np.array([S.spectral_index_classes(raw[:, r:r + ts, c:c + ts], raster.band_names)
                                         for r, c in result.origins]), result.origins, result.classes.shape, ts,
                               fill=result.nodata)
    path = ctx.run_dir / "class_map.png"
    plot_class_map(result, path, reference=reference,
                   title=f"{ctx.arm}: predicted class map (constructed labels, not ground truth)")
    return {"pictures": {"class_map": str(path.relative_to(ctx.run_root))}}


FAMILY = Family(
    name="explora",
    config=Config,
    data=build_task,
    model_kwargs=lambda cfg, task: {"n_outputs": task.n_outputs},
    recipe=lambda cfg, model, task: ClassificationRecipe(model, task.train, task.val, task="multiclass",
                                                         label_smoothing=cfg.label_smoothing),
    selection=lambda cfg, task: ("top1", "max"),
    head="head",
    prepare=lambda cfg, model, mode: freeze_fixed_encodings(model),  # fixed sin-cos tables stay frozen
    protocols=[class_map_picture],
    retained=RETAINED,
)
run, evaluate = FAMILY.run, FAMILY.evaluate


# ----------------------------------------------------------------------------- predict / embed


@dataclass
class InferenceSettings:
    """How a scene is prepared for a model, as in its training.

    From a run folder (``origin="run config"``): the run's ``data.bands`` (or ``band_indices``),
    the statistics it normalised with (``report.json`` ``data.band_stats``; for an older run the
    shipped scene's, recomputed), its tile side in scene pixels (``data.tile_size``, each tile
    resized to ``data.img_size`` as in training), its classes and pixel dtype. From a model name
    or a save_pretrained folder (``origin="card"``): the card's ``input_spec`` bands (``red,
    green, blue`` find ``B04, B03, B02``), tiles of the model's own ``img_size`` pixels (no
    resizing) and the scene's own per-band statistics (what fine-tuning does for a scene whose
    ``data.mean``/``std`` are unset); classes ``0 .. n_outputs-1``.
    """

    bands: list[str] | None = None
    band_indices: list[int] | None = None
    stats: S.BandStats | None = None  # None: the scene's own statistics
    tile_size: int = 32
    img_size: int = 32
    classes: list[str] | None = None
    dtype: str | None = None
    origin: str = "card"
    #: what ``--model`` named (the class map's ``model`` tag)
    model: str | None = None


def _model_img_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or getattr(model, "img_size", None)
    if size is None:
        size = getattr(model, "domainfm_kwargs", {}).get("img_size")
    return int(size[0] if isinstance(size, (tuple, list)) else size) if size is not None else None


def _n_outputs(model: nn.Module) -> int:
    head = getattr(model, "head", None)
    return int(getattr(head, "out_features", 0) or 0)


def _run_settings(cfg: Config, data: dict[str, Any]) -> InferenceSettings:
    """How a run prepared its images: its config and its report's ``data`` (the task's info)."""
    sample, recorded = cfg.data.source == "sample", data.get("band_stats")
    if recorded:
        stats = S.BandStats(list(recorded["mean"]), list(recorded["std"]))
    elif cfg.data.mean is not None and cfg.data.std is not None:
        stats = S.BandStats(list(cfg.data.mean), list(cfg.data.std))
    else:  # a sample run from before band_stats were recorded: its training scene's
        stats = S.load_scene("sample", bands=cfg.data.bands).stats if sample else None
    return InferenceSettings(
        bands=list(cfg.data.bands) if sample else None,
        band_indices=None if sample or not cfg.data.band_indices else list(cfg.data.band_indices),
        stats=stats, tile_size=cfg.data.tile_size if sample else cfg.data.img_size, img_size=cfg.data.img_size,
        classes=[str(c) for c in data["classes"]] if data.get("classes") else None, dtype=data.get("dtype"),
        origin="run config")


def _settings(ref: apply.ModelRef, model: nn.Module) -> InferenceSettings:
    cfg, img = ref.run_config(Config), _model_img_size(model)
    if cfg is not None:
        settings = _run_settings(cfg, (ref.run_report() or {}).get("data", {}))
    else:
        from domainfm.zoo import get_card

        name = getattr(model, "domainfm_name", None)
        spec = dict(get_card(name).input_spec) if name else {}
        n_chans = int(getattr(model, "domainfm_kwargs", {}).get("in_chans", spec.get("n_chans", 3)))
        bands = list(spec.get("bands") or [])
        img = img or int(spec.get("img_size", 224))
        settings = InferenceSettings(bands=bands if len(bands) == n_chans else None,
                                     band_indices=None if len(bands) == n_chans else list(range(n_chans)),
                                     tile_size=img, img_size=img)
    if settings.img_size != (img or settings.img_size):
        raise ValueError(f"the run's data.img_size={settings.img_size} differs from the model's input size {img}")
    if settings.classes is None:
        settings.classes = [str(i) for i in range(_n_outputs(model))]
    settings.model = str(ref.arg) if isinstance(ref.arg, (str, os.PathLike)) else None
    return settings


def inference_settings(model: nn.Module, model_arg: str | os.PathLike | None = None, *,
                       tile_size: int | None = None) -> InferenceSettings:
    """The :class:`InferenceSettings` for ``model``: the run's when ``model_arg`` is (or is inside)
    a run folder, else the model card's. ``tile_size`` overrides the tile side (scene pixels)."""
    settings = _settings(apply.ModelRef.of(model if model_arg is None else model_arg), model)
    if tile_size is not None:
        settings.tile_size = int(tile_size)
    return settings


@dataclass
class ApplyOptions:
    stride: int | None = apply.option(None, "tile step in scene pixels (default the tile size)")
    tile_size: int | None = apply.option(
        None, "tile side in scene pixels (default: the run's data.tile_size, or the model's input size)")
    edge: str = apply.option("shift", "shift: a last tile flush with the bottom/right edge covers the strip the grid "
                                      "leaves; drop: that strip stays nodata", choices=("shift", "drop"))
    probability: str | None = apply.option(None, "also write the chosen class's probability (float32 GeoTIFF)",
                                           output=apply.RASTER, commands=("predict",))
    plot: str | None = apply.option(None, "also draw the class map beside the RGB scene (PNG)", output=(".png",),
                                    commands=("predict",))


@dataclass(kw_only=True)
class ClassMap(apply.Raster):
    """What :func:`predict` returns: the stitched map, an :class:`~domainfm.experiment.apply.Raster`
    (``data``: ``(H, W)`` class ids, also :attr:`classes`; ``profile``: the scene's CRS and
    transform, the class names in its ``classes`` tag), and the per-tile results behind it."""

    #: ``(H, W)`` float32 probability of the chosen class, NaN where ``classes`` is nodata
    probability: np.ndarray
    #: ``(N,)`` class id of each tile, ``(N, K)`` its class probabilities
    tile_classes: np.ndarray
    tile_probabilities: np.ndarray
    origins: list[tuple[int, int]]
    tile_size: int
    class_names: list[str]
    #: in ``classes`` where no tile covers and where every band the model reads is missing (the
    #: input's nodata, NaN or inf); the class ids are uint8, or uint16 beyond 255 classes
    nodata: int
    raster: S.Raster  # the input as read (every band, CRS, transform)
    settings: InferenceSettings
    precision: str = "32-true"

    @property
    def classes(self) -> np.ndarray:
        return self.data


@dataclass
class _Tiles:
    scene: S.ModelInput
    origins: list[tuple[int, int]]
    settings: InferenceSettings
    source: str


def _read(path, settings: InferenceSettings, options: ApplyOptions | None) -> _Tiles:
    options = options or ApplyOptions()
    if options.tile_size is not None:
        settings = dataclasses.replace(settings, tile_size=int(options.tile_size))
    scene = S.read_scene_for_model(path, bands=settings.bands, band_indices=settings.band_indices,
                                   stats=settings.stats, dtype=settings.dtype)
    origins = S.tiles_with_data(scene, settings.tile_size, options.stride, edge=options.edge, source=str(path))
    return _Tiles(scene, origins, settings, str(path))


def _forward(data: _Tiles, model: nn.Module, run: apply.Runtime, *, pre_logits: bool) -> torch.Tensor:
    """Logits (or pooled embeddings) of each tile ``(N, K|D)``, float32."""
    image, n_model = data.scene.image, getattr(model, "domainfm_kwargs", {}).get("in_chans")
    if n_model is not None and image.shape[0] != int(n_model):
        raise S.SatelliteDataError(f"{data.source}: {image.shape[0]} bands {data.scene.bands} selected but the "
                                   f"model takes {n_model} bands")
    # the same per-tile bilinear (antialiased) resize as the fine-tuning's evaluation transform
    resize, ts = S.Resize(data.settings.img_size), data.settings.tile_size

    def tiles(origins: torch.Tensor) -> torch.Tensor:
        x = torch.stack([resize(image[:, r:r + ts, c:c + ts]) for r, c in origins.tolist()]).to(run.device)
        return model.forward_head(model.forward_features(x), pre_logits=pre_logits)

    return run.batched(tiles, torch.tensor(data.origins, dtype=torch.long))


def _predict(data: _Tiles, model: nn.Module, settings, options: ApplyOptions | None,
             run: apply.Runtime) -> apply.Output:
    from domainfm.precision import resolve_precision

    options, s, r = options or ApplyOptions(), data.settings, data.scene.raster
    probs = torch.softmax(_forward(data, model, run, pre_logits=False), dim=-1).numpy()
    names = list(s.classes or [str(i) for i in range(probs.shape[1])])
    tile_classes, nodata = probs.argmax(-1), 255 if len(names) < 255 else 65535
    shape, invalid = data.scene.image.shape[1:], ~data.scene.valid
    classes = S.stitch_tiles(tile_classes.astype(np.uint8 if nodata == 255 else np.uint16), data.origins, shape,
                             s.tile_size, fill=nodata)
    probability = S.stitch_tiles(probs.max(-1).astype(np.float32), data.origins, shape, s.tile_size, fill=np.nan)
    classes[invalid], probability[invalid] = nodata, np.nan
    precision = resolve_precision(run.precision, run.device)
    tags = {"classes": json.dumps(names), "tile_size": s.tile_size, "settings": s.origin, "precision": precision,
            **({"model": s.model} if s.model else {})}
    grid = dict(transform=r.transform, crs=r.crs, tags=tags)
    result = ClassMap(classes, S.geotiff_profile(dtype=classes.dtype, nodata=nodata, band_names=["class"], **grid),
                      probability=probability, tile_classes=tile_classes, tile_probabilities=probs,
                      origins=data.origins, tile_size=s.tile_size, class_names=names, nodata=nodata, raster=r,
                      settings=s, precision=precision)
    extras: dict[str, Any] = {}
    if options.probability:
        extras["probability"] = apply.Raster(probability[None], S.geotiff_profile(
            dtype=np.float32, nodata=float("nan"), band_names=["max_probability"], **grid))
    if options.plot:
        extras["plot"] = plot_class_map(result, title=f"{Path(data.source).name}: {Path(s.model or '?').name}")
    counts = np.bincount(tile_classes, minlength=len(names))
    return apply.Output(result, extras, f"{len(data.origins)} tiles of {s.tile_size} px ({precision}); "
                        + ", ".join(f"{n}: {c}" for n, c in zip(names, counts)))


def _embed(data: _Tiles, model: nn.Module, settings, options, run: apply.Runtime) -> apply.Output:
    z = _forward(data, model, run, pre_logits=True).numpy()
    ts, r = data.settings.tile_size, data.scene.raster
    rows, cols = np.array([o[0] for o in data.origins]), np.array([o[1] for o in data.origins])
    out = {"embeddings": z, "row": rows, "col": cols,
           "tile_row": np.unique(rows, return_inverse=True)[1], "tile_col": np.unique(cols, return_inverse=True)[1],
           "bounds": S.tile_bounds(r.transform, data.origins, ts), "crs": np.array(r.crs.to_wkt() if r.crs else ""),
           "transform": np.array(tuple(r.transform)[:6], dtype=np.float64), "tile_size": np.array(ts),
           "bands": np.array(data.scene.bands)}
    return apply.Output(out, summary=f"{z.shape[0]} tiles x {z.shape[1]}")


APPLY = apply.Applier(
    family="explora",
    input="a GeoTIFF/JP2 scene",
    description="Bands, normalisation and tile size are the run's (a run folder) or the model card's (a name or "
                "model folder).",
    read=_read, settings=_settings, options=ApplyOptions, batch_size=256,
    has_head=lambda model: _n_outputs(model) > 0,
    predict=apply.Command(_predict, apply.RASTER, needs_head=True,
                          what="Classify the tiles of a GeoTIFF/JP2 scene and write a class-map GeoTIFF with the "
                               "scene's CRS, transform and size."),
    embed=apply.Command(_embed, apply.ARRAYS,
                        what="Per-tile embeddings of a GeoTIFF/JP2 scene (.npz: embeddings, row, col, tile_row, "
                             "tile_col, bounds, crs, transform, tile_size, bands)."),
)


def predict(path: str | os.PathLike, model: nn.Module, settings: InferenceSettings | None = None, *,
            stride: int | None = None, edge: str = "shift", precision: str = "auto", device: str | torch.device = "cpu",
            batch_size: int = 256) -> ClassMap:
    """Classify every tile of a GeoTIFF/JP2 scene and stitch the class ids into a map.

    Tiles are ``settings.tile_size`` scene pixels (default :func:`inference_settings` of
    ``model``) every ``stride`` (default the tile size); ``edge="shift"`` adds a last tile flush
    with the bottom/right edge so that every pixel is covered, ``edge="drop"`` leaves that strip
    as nodata. Where tiles overlap each pixel takes the class of the covering tile whose centre is
    nearest (:func:`~domainfm.data_loaders.satellite.stitch_tiles`). A pixel missing in every band
    the model reads (the file's nodata value, NaN or inf) stays nodata; a missing value is left
    out of the scene's statistics and fed to the model as the band mean
    (:func:`~domainfm.data_loaders.satellite.read_scene_for_model`).

    Precision: ``auto`` is bf16 autocast where the device multiplies bf16 natively, fp32
    elsewhere. The documented (and tested) tolerance: probabilities within 0.05 of fp32 and at
    least 97 % of tiles of the same class (measured: benchmarks/README.md). Use
    ``precision="32-true"`` for fp32 maps.
    """
    return apply.run("predict", APPLY, model, path, settings=settings, precision=precision, device=device,
                     batch_size=batch_size, options=ApplyOptions(stride=stride, edge=edge)).value


def embed(path: str | os.PathLike, model: nn.Module, settings: InferenceSettings | None = None, *,
          stride: int | None = None, edge: str = "shift", precision: str = "auto", device: str | torch.device = "cpu",
          batch_size: int = 256) -> dict[str, Any]:
    """Pooled embeddings of every tile of a scene (tiled as :func:`predict`).

    Returns ``embeddings (N, num_features)`` float32, ``row``/``col`` (each tile's top-left pixel),
    ``tile_row``/``tile_col`` (its index along the grid), ``bounds (N, 4)`` (left, bottom, right,
    top in the scene's CRS), ``crs`` (WKT), ``transform`` (the scene's affine, 6 numbers),
    ``tile_size``, ``bands``.
    """
    return apply.run("embed", APPLY, model, path, settings=settings, precision=precision, device=device,
                     batch_size=batch_size, options=ApplyOptions(stride=stride, edge=edge)).value


def plot_class_map(result: ClassMap, path: str | os.PathLike | None = None, *, reference: np.ndarray | None = None,
                   title: str | None = None):
    """The scene's RGB beside the predicted class map (and ``reference`` labels if given)
    (:func:`~domainfm.data_loaders.satellite.class_map_figure`); with ``path``, written there as
    PNG (atomic) and released."""
    from domainfm.atomic import atomic_path

    fig = S.class_map_figure(result.raster, result.classes, result.class_names, nodata=result.nodata,
                             reference=reference, title=title)
    if path is None:
        return fig
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    fig.clf()
    return Path(path)
