"""Satellite imagery in, tensors out: multi-band GeoTIFF / JPEG2000 through rasterio.

* :func:`read_raster` reads one multi-band file, or several single-band files of *mixed*
  resolutions (Sentinel-2's 10/20/60 m bands), resampled onto one common grid (the finest
  resolution over the files' common extent, or the ``resolution`` asked for).
* :func:`select_bands`, :class:`BandStats` (per-band mean/std, computed or given) and
  :func:`write_geotiff` (atomic; its profile: :func:`geotiff_profile`) around them.
* Tiling a scene: :func:`tile_origins` (:func:`tiles_with_data`: only tiles holding data),
  :func:`stitch_tiles` (per-tile values back into a map), :func:`tile_bounds` (each tile's
  extent in the scene's CRS); :func:`rgb_preview` and :func:`class_map_figure` to show them.
* :func:`load_scene`: the shipped sample or your rasters as one normalised ``(C, H, W)`` scene.
* Missing values: a value equal to the file's nodata, or not finite (NaN, +-inf, in a float file),
  is missing (:func:`missing_values`); statistics leave it out and a model's input holds the
  band mean there (:func:`read_scene_for_model`).
* Memory: a raster whose pixels would take more than :data:`MAX_RASTER_BYTES` (2 GiB; the
  ``DOMAINFM_MAX_RASTER_BYTES`` environment variable or ``read_raster(max_bytes=...)`` change it)
  is refused with :class:`RasterTooLarge` before any pixel is read.
* Datasets: :class:`SceneTiles` (tiles cut from one scene), :class:`ImageFolder` (EuroSAT style
  ``root/<class>/<image>.tif``), :class:`CsvManifest` (fMoW style ``image_path,label`` CSV),
  split into train/validation by :func:`labelled_images`, and :class:`UnlabelledImages` (any of
  them without labels, for self-supervised pretraining).
* Transforms on ``(C, H, W)`` tensors with *any* number of bands: :class:`MultiCrop` (DINOv2:
  2 global + N local random-resized crops), :class:`MaeTransform` and :class:`Resize`.
* :func:`spectral_index_classes`: land-cover classes **derived from spectral indices**
  (NDVI/NDWI thresholds). They are a constructed demo label, not ground truth; so are the
  :func:`terciles` of a tile's :func:`brightness_cv` (texture) or :func:`mean_ndmi` (moisture).
  :func:`sample_tile_task` makes the shipped scene a spatially split tile-classification task
  with those labels.

**Shapes:** images are ``(C, H, W)``; a batch of multi-crops is a list of ``(B, C, h, w)``.
"""
from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from domainfm.atomic import atomic_path
from domainfm.errors import InputError

__all__ = [
    "SatelliteDataError",
    "RasterTooLarge",
    "MAX_RASTER_BYTES",
    "MAX_RASTER_BYTES_ENV",
    "raster_byte_limit",
    "missing_values",
    "read_raster",
    "read_scene_for_model",
    "ModelInput",
    "canonical_band",
    "match_bands",
    "tile_origins",
    "tiles_with_data",
    "stitch_tiles",
    "tile_bounds",
    "rgb_preview",
    "class_map_figure",
    "Raster",
    "select_bands",
    "BandStats",
    "geotiff_profile",
    "write_geotiff",
    "Scene",
    "load_scene",
    "SceneTiles",
    "ImageFolder",
    "CsvManifest",
    "labelled_images",
    "UnlabelledImages",
    "MultiCrop",
    "MaeTransform",
    "Resize",
    "random_resized_crop",
    "multicrop_collate",
    "ndvi",
    "ndwi",
    "ndmi",
    "mean_ndmi",
    "brightness_cv",
    "terciles",
    "spectral_index_classes",
    "INDEX_CLASSES",
    "SENTINEL2_BANDS",
    "EXPLORA_SENTINEL2_BANDS",
    "sample_scene_path",
    "SampleTileTask",
    "sample_tile_task",
]

#: the 13 Sentinel-2 L1C bands in file order
SENTINEL2_BANDS = ("B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12")
#: the 10 bands SatMAE / ExPLoRA keep (B1, B9, B10 dropped)
EXPLORA_SENTINEL2_BANDS = ("B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B11", "B12")
_RASTER_SUFFIXES = (".tif", ".tiff", ".jp2")

#: the most bytes a raster's pixels may take in memory (width x height x bands x bytes per value,
#: from the file's header) before :func:`read_raster` refuses it; a sparse or compressed file of a
#: few MB can claim tens of GiB, and the reader would allocate it all before anything else
MAX_RASTER_BYTES = 2 * 1024**3
#: the environment variable that overrides :data:`MAX_RASTER_BYTES` (a number of bytes)
MAX_RASTER_BYTES_ENV = "DOMAINFM_MAX_RASTER_BYTES"


class SatelliteDataError(ValueError):
    """A raster, image or manifest that cannot be used as asked (wrong bands, CRS, shape, ...);
    the message names the file and what was expected. The CLI reports it in one line."""


class RasterTooLarge(SatelliteDataError):
    """A raster whose pixels would take more memory than the limit (:func:`raster_byte_limit`);
    the message names the file, its size in memory and the limit."""


def raster_byte_limit(max_bytes: int | None = None) -> int:
    """The memory limit on one raster's pixels, in bytes: ``max_bytes`` when given, else the
    ``DOMAINFM_MAX_RASTER_BYTES`` environment variable when set, else :data:`MAX_RASTER_BYTES`.

    Raises:
        InputError: naming the keyword or the variable when it is not a positive number.
    """
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
            raise InputError(f"max_bytes={max_bytes!r}: expected a positive whole number of bytes")
        return int(max_bytes)
    text = os.environ.get(MAX_RASTER_BYTES_ENV, "").strip()
    if not text:
        return MAX_RASTER_BYTES
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise InputError(f"{MAX_RASTER_BYTES_ENV}={text!r}: expected a positive whole number of bytes "
                         f"(e.g. {4 * 1024**3} for 4 GiB)")
    return int(value)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _check_size(source: str, width: int, height: int, count: int, dtype, max_bytes: int | None) -> None:
    """Refuse, from the header alone, a raster whose pixels would exceed the memory limit."""
    dtype = np.dtype(dtype)
    size = int(width) * int(height) * int(count) * dtype.itemsize
    limit = raster_byte_limit(max_bytes)
    if size > limit:
        raise RasterTooLarge(
            f"{source}: {width} x {height} pixels x {count} bands of {dtype.name} take {_human_bytes(size)} "
            f"({size} bytes) in memory, over the limit of {_human_bytes(limit)} ({limit} bytes); read a window or "
            f"a coarser copy (gdal_translate -srcwin / -outsize), or raise the limit ({MAX_RASTER_BYTES_ENV}=BYTES, "
            f"or max_bytes=)")


def _check_file_size(ds, source: str, max_bytes: int | None) -> None:
    """:func:`_check_size` for one open rasterio dataset (its widest band dtype)."""
    _check_size(source, ds.width, ds.height, ds.count, max(map(np.dtype, ds.dtypes), key=lambda d: d.itemsize),
                max_bytes)


def _missing_words(nodata) -> str:
    return "not finite (NaN/inf)" if nodata is None else f"nodata ({nodata}) or not finite (NaN/inf)"


def missing_values(data: np.ndarray, nodata: float | None = None) -> np.ndarray:
    """``(C, H, W)`` bool, True where a value is not data: equal to the file's ``nodata`` value,
    or not finite (NaN, +-inf) in a float raster (a nodata of NaN, which equals nothing, is covered
    by the latter). A NaN left in a scene would turn every statistic it enters, and through them
    every tile, to NaN.
    """
    data = np.asarray(data)
    missing = ~np.isfinite(data) if data.dtype.kind in "fc" else np.zeros(data.shape, dtype=bool)
    if nodata is not None:
        missing |= data == nodata
    return missing


def _rasterio():
    try:
        import rasterio
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("reading satellite rasters needs rasterio: pip install rasterio") from exc
    return rasterio


@dataclass
class Raster:
    """Pixels and georeferencing of one (possibly resampled) scene."""

    data: np.ndarray  # (C, H, W), the files' dtype
    band_names: list[str]
    transform: object  # affine.Affine
    crs: object
    resolution: tuple[float, float]
    nodata: float | None = None


def _band_names_of(ds, path: Path) -> list[str]:
    names = list(ds.descriptions)
    if ds.count == 1 and not names[0]:
        return [path.stem.rsplit("_", 1)[-1]]  # s2_B04.jp2 -> B04
    return [n or f"band{i + 1}" for i, n in enumerate(names)]


def read_raster(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    bands: Sequence[str] | None = None,
    resolution: float | None = None,
    resampling: str = "bilinear",
    max_bytes: int | None = None,
) -> Raster:
    """Read one multi-band raster, or several rasters (e.g. one per band) onto a common grid.

    Args:
        paths: a GeoTIFF/JP2 path, or a list of them. With several files (or ``resolution``)
            every band is resampled onto one grid: the files' common extent at the finest pixel
            size among them (or ``resolution``, in CRS units).
        bands: band names to keep, in this order (names from the files' band descriptions, or
            from single-band file names ``*_B04.jp2``); ``None`` keeps all.
        resampling: a rasterio resampling name (``"bilinear"``, ``"average"``, ``"nearest"``, ...).
        max_bytes: the most bytes the pixels read may take (width x height x bands x bytes per
            value, of the file or of the common grid); default :func:`raster_byte_limit`
            (``DOMAINFM_MAX_RASTER_BYTES``, else :data:`MAX_RASTER_BYTES`, 2 GiB).

    Raises:
        FileNotFoundError / ValueError naming the file and what was wrong (missing file,
        different CRS, no overlap, unknown band); :class:`RasterTooLarge` (before any pixel is
        read) naming the file, its size in memory and the limit.
    """
    rasterio = _rasterio()
    import rasterio.errors
    from rasterio.enums import Resampling
    from rasterio.transform import from_origin
    from rasterio.windows import from_bounds

    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not files:
        raise SatelliteDataError("read_raster: no file given")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"raster file not found: {f}")
    try:
        method = Resampling[resampling]
    except KeyError:
        raise SatelliteDataError(f"resampling={resampling!r}: expected one of {[r.name for r in Resampling][:10]}...") from None

    datasets = []
    try:
        for f in files:
            datasets.append(rasterio.open(f))
    except rasterio.errors.RasterioIOError as exc:
        for ds in datasets:
            ds.close()
        raise SatelliteDataError(f"{f}: not a raster rasterio can read (GeoTIFF/JP2 expected): {exc}") from None
    try:
        crs = datasets[0].crs
        for ds, f in zip(datasets, files):
            if ds.crs != crs:
                raise SatelliteDataError(f"{f}: CRS {ds.crs} differs from {files[0]}'s {crs}; reproject first")
        names = [n for ds, f in zip(datasets, files) for n in _band_names_of(ds, f)]
        if len(datasets) == 1 and resolution is None:
            ds = datasets[0]
            _check_file_size(ds, str(files[0]), max_bytes)
            data = ds.read()
            res = (abs(ds.transform.a), abs(ds.transform.e))
            raster = Raster(data, names, ds.transform, crs, res, ds.nodata)
        else:
            left = max(ds.bounds.left for ds in datasets)
            right = min(ds.bounds.right for ds in datasets)
            bottom = max(ds.bounds.bottom for ds in datasets)
            top = min(ds.bounds.top for ds in datasets)
            if right <= left or top <= bottom:
                raise SatelliteDataError(f"the rasters {[str(f) for f in files]} do not overlap")
            res = float(resolution) if resolution is not None else min(min(abs(ds.transform.a), abs(ds.transform.e)) for ds in datasets)
            width, height = int(math.floor((right - left) / res)), int(math.floor((top - bottom) / res))
            if width < 1 or height < 1:
                raise SatelliteDataError(f"resolution={res} leaves no pixel in the common extent")
            right, bottom = left + width * res, top - height * res
            dtypes = {np.dtype(d) for ds in datasets for d in ds.dtypes}
            # mixed dtypes are concatenated as float32
            grid_dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
            _check_size(", ".join(map(str, files)), width, height, sum(ds.count for ds in datasets), grid_dtype,
                        max_bytes)
            out = []
            for ds in datasets:
                window = from_bounds(left, bottom, right, top, transform=ds.transform)
                out.append(ds.read(window=window, out_shape=(ds.count, height, width), resampling=method))
            dtypes = {a.dtype for a in out}
            data = np.concatenate(out, axis=0) if len(dtypes) == 1 else np.concatenate([a.astype(np.float32) for a in out])
            raster = Raster(data, names, from_origin(left, top, res, res), crs, (res, res), datasets[0].nodata)
    finally:
        for ds in datasets:
            ds.close()
    if bands is not None:
        raster.data = select_bands(raster.data, raster.band_names, bands, source=", ".join(map(str, files)))
        raster.band_names = list(bands)
    return raster


def select_bands(data: np.ndarray | torch.Tensor, names: Sequence[str], wanted: Sequence[str], *, source: str = "image"):
    """``data[(index of each wanted name)]`` along the band axis (0), with a clear error."""
    names = list(names)
    if len(names) != data.shape[0]:
        raise SatelliteDataError(f"{source}: {data.shape[0]} bands but {len(names)} band names")
    missing = [b for b in wanted if b not in names]
    if missing:
        raise SatelliteDataError(f"{source}: bands {missing} not found; it has {names}")
    index = [names.index(b) for b in wanted]
    return data[index]


#: common names of bands -> Sentinel-2 names (model cards say ``red, green, blue``)
BAND_ALIASES = {"blue": "B02", "green": "B03", "red": "B04", "nir": "B08", "swir1": "B11", "swir2": "B12"}


def canonical_band(name: str) -> str:
    """One spelling per band: ``red`` -> ``B04``, ``B2`` -> ``B02``, ``b8a`` -> ``B8A``."""
    key = str(name).strip()
    if key.lower() in BAND_ALIASES:
        return BAND_ALIASES[key.lower()]
    upper = key.upper()
    if len(upper) == 2 and upper[0] == "B" and upper[1].isdigit():
        return f"B0{upper[1]}"
    return upper


def _generic_names(names: Sequence[str]) -> bool:
    return all(n == f"band{i + 1}" for i, n in enumerate(names))


def match_bands(names: Sequence[str], wanted: Sequence[str], *, source: str = "image") -> list[int]:
    """Indices of the bands ``wanted`` (in that order) among a file's band ``names``.

    Names are compared after :func:`canonical_band` (so a card's ``red, green, blue`` finds a
    Sentinel-2 file's ``B04, B03, B02``). A file without band descriptions (``band1 ... bandN``)
    is taken in the model's order when it has exactly ``len(wanted)`` bands.

    Raises:
        SatelliteDataError: naming ``source`` and both band sets when a band is missing.
    """
    names, wanted = list(names), list(wanted)
    canon = [canonical_band(n) for n in names]
    if _generic_names(names) and len(names) == len(wanted) and not all(canonical_band(w) in canon for w in wanted):
        return list(range(len(names)))
    missing = [w for w in wanted if canonical_band(w) not in canon]
    if missing:
        raise SatelliteDataError(
            f"{source}: has {len(names)} bands {names}, but the model expects {len(wanted)} bands {wanted} "
            f"(missing {missing})")
    return [canon.index(canonical_band(w)) for w in wanted]


class ModelInput(NamedTuple):
    """A scene prepared for a model (unpacks as ``image, raster, bands, valid``)."""

    #: ``(C, H, W)`` float32 in the model's band order, normalised as in training; a missing value
    #: (:func:`missing_values`) holds 0, the band's mean
    image: torch.Tensor
    #: the file as read (every band, its dtype, CRS and transform)
    raster: Raster
    #: the model's band names, in order
    bands: list[str]
    #: ``(H, W)`` bool: pixels where at least one of the model's bands holds data
    valid: np.ndarray


def read_scene_for_model(path: str | os.PathLike, *, bands: Sequence[str] | None = None,
                         band_indices: Sequence[int] | None = None, stats: BandStats | None = None,
                         dtype: str | None = None) -> ModelInput:
    """Read one GeoTIFF/JP2 scene and prepare it as a model was trained: bands selected and
    ordered by name (``bands``, :func:`match_bands`) or by 0-based index (``band_indices``),
    pixels cast to float32 and normalised with ``stats`` (``None``: the scene's own per-band
    statistics, ignoring nodata, as :func:`load_scene` computes them for a scene without given
    statistics).

    Missing values (the file's nodata value, or NaN/inf in a float file; :func:`missing_values`)
    are left out of the statistics and set to the band mean (0 once normalised) in ``image``, so
    that a hole is neutral input whichever way the file marks it; ``valid`` is False where every
    selected band is missing.

    Args:
        dtype: the pixel dtype the model was trained on (e.g. ``uint16`` reflectance x 10000);
            a file of another dtype is refused, since its scaling would differ.

    Raises:
        SatelliteDataError naming the file and both band sets (or dtypes) on a mismatch, or when
        no selected value holds data; :class:`RasterTooLarge` (before reading) over the memory limit.
    """
    path = Path(path)
    raster = read_raster(path)
    if dtype is not None and raster.data.dtype.name != dtype:
        raise SatelliteDataError(f"{path}: pixels are {raster.data.dtype.name} but the model was trained on {dtype} "
                                 f"pixels (bands {list(bands or band_indices or [])}); convert with the same scaling")
    if bands is not None:
        index = match_bands(raster.band_names, bands, source=str(path))
        names = list(bands)
    elif band_indices is not None:
        if max(band_indices) >= raster.data.shape[0]:
            raise SatelliteDataError(f"{path}: has {raster.data.shape[0]} bands {raster.band_names}, but the model "
                                     f"reads band indices {list(band_indices)}")
        index, names = list(band_indices), [raster.band_names[i] for i in band_indices]
    else:
        index, names = list(range(raster.data.shape[0])), list(raster.band_names)
    if stats is not None and stats.n_bands != len(index):
        raise SatelliteDataError(f"{path}: the model's statistics are for {stats.n_bands} bands but {len(index)} "
                                 f"were selected ({names})")
    selected = raster.data[index]
    pixels = selected.astype(np.float32)
    missing = missing_values(selected, raster.nodata) | ~np.isfinite(pixels)  # float64 beyond float32's range too
    if missing.all():
        raise SatelliteDataError(f"{path}: every value of bands {names} is {_missing_words(raster.nodata)}; "
                                 f"there is no pixel to read")
    if missing.any():
        pixels[missing] = np.nan
    stats = stats or BandStats.compute(pixels, source=str(path), band_names=names)
    image = stats.normalize(torch.from_numpy(pixels))
    if missing.any():
        image.masked_fill_(torch.from_numpy(missing), 0.0)
    return ModelInput(image, raster, names, ~missing.all(0))


def tile_origins(height: int, width: int, tile_size: int, stride: int | None = None, *,
                 edge: str = "shift", source: str | None = None) -> list[tuple[int, int]]:
    """Top-left ``(row, col)`` of the tiles covering a ``height x width`` scene, row-major.

    Tiles start every ``stride`` pixels (default ``tile_size``). ``edge="shift"`` adds, where the
    grid leaves a strip at the bottom/right, one last tile flush with the edge (overlapping its
    neighbour), so every pixel is covered; ``edge="drop"`` leaves the strip uncovered. Errors
    start with ``source`` (the scene's file) when given.
    """
    stride = stride or tile_size
    at = f"{source}: " if source else ""
    if tile_size < 1 or stride < 1:
        raise SatelliteDataError(f"{at}tile_size={tile_size}, stride={stride}: both must be >= 1")
    if tile_size > height or tile_size > width:
        raise SatelliteDataError(f"{at}tile_size={tile_size} does not fit a scene of {height} x {width} pixels "
                                 f"(height x width); use a smaller tile size or a larger scene")
    if edge not in ("shift", "drop"):
        raise SatelliteDataError(f"{at}edge={edge!r}: expected 'shift' or 'drop'")

    def starts(n: int) -> list[int]:
        out = list(range(0, n - tile_size + 1, stride))
        if edge == "shift" and out[-1] + tile_size < n:
            out.append(n - tile_size)
        return out

    return [(r, c) for r in starts(height) for c in starts(width)]


def tiles_with_data(scene: ModelInput, tile_size: int, stride: int | None = None, *, edge: str = "shift",
                    source: str | None = None) -> list[tuple[int, int]]:
    """:func:`tile_origins` of a scene read by :func:`read_scene_for_model`, less the tiles in
    which no pixel holds data (``scene.valid``): those are not classified.

    Raises:
        SatelliteDataError naming ``source``, the tile size and the scene's bands when no tile is left.
    """
    _, height, width = scene.image.shape
    origins = tile_origins(height, width, tile_size, stride, edge=edge, source=source)
    if scene.valid.all():
        return origins
    origins = [(r, c) for r, c in origins if scene.valid[r:r + tile_size, c:c + tile_size].any()]
    if not origins:
        raise SatelliteDataError(f"{source}: no {tile_size} x {tile_size} tile (edge={edge!r}) covers a pixel with "
                                 f"data in bands {scene.bands}; the others are nodata ({scene.raster.nodata}), NaN "
                                 "or inf")
    return origins


def stitch_tiles(values: np.ndarray, origins: Sequence[tuple[int, int]], shape: tuple[int, int], tile_size: int, *,
                 fill) -> np.ndarray:
    """Per-tile values ``(N,)`` -> a ``shape`` map in which every covered pixel holds the value of
    one tile covering it: the one whose centre is nearest (Euclidean; ties: the first in ``origins``), so
    non-overlapping tiles keep their whole footprint and overlapping ones split the overlap
    down the middle. Pixels no tile covers hold ``fill``.
    """
    values = np.asarray(values)
    if len(values) != len(origins):
        raise SatelliteDataError(f"stitch_tiles: {len(values)} values for {len(origins)} tiles")
    out = np.full(shape, fill, dtype=values.dtype)
    best = np.full(shape, np.inf)
    half = (tile_size - 1) / 2.0
    rr, cc = np.arange(tile_size)[:, None], np.arange(tile_size)[None, :]
    # squared Euclidean distance to the tile centre: on a grid of tiles the nearest centre is the
    # nearest along rows and along columns separately (a max-norm would tie along a whole edge)
    dist = (rr - half) ** 2 + (cc - half) ** 2
    for value, (r, c) in zip(values, origins):
        window = best[r:r + tile_size, c:c + tile_size]
        closer = dist < window
        window[closer] = dist[closer]
        out[r:r + tile_size, c:c + tile_size][closer] = value
    return out


def tile_bounds(transform, origins: Sequence[tuple[int, int]], tile_size: int) -> np.ndarray:
    """``(N, 4)`` float64 extent (left, bottom, right, top, in the scene's CRS) of each tile whose
    top-left pixel is ``origins[i]``: its four corners through the affine ``transform``, so a
    rotated grid gives the box around the rotated tile."""
    a, b, c0, d, e, f = tuple(transform)[:6]
    rows, cols = np.array([o[0] for o in origins]), np.array([o[1] for o in origins])
    corners = np.stack([(cols + dc, rows + dr) for dc in (0, tile_size) for dr in (0, tile_size)])  # (4, 2, N)
    xs, ys = a * corners[:, 0] + b * corners[:, 1] + c0, d * corners[:, 0] + e * corners[:, 1] + f
    return np.stack([xs.min(0), ys.min(0), xs.max(0), ys.max(0)], 1).astype(np.float64)


@dataclass
class BandStats:
    """Per-band normalisation statistics: ``(x - mean) / std`` on ``(C, H, W)`` or ``(B, C, H, W)``."""

    mean: list[float]
    std: list[float]

    def __post_init__(self):
        if len(self.mean) != len(self.std):
            raise SatelliteDataError(f"BandStats: {len(self.mean)} means but {len(self.std)} stds")
        if any(s <= 0 for s in self.std):
            raise SatelliteDataError(f"BandStats: every std must be > 0, got {self.std}")

    @property
    def n_bands(self) -> int:
        return len(self.mean)

    @classmethod
    def compute(cls, data: np.ndarray | torch.Tensor, nodata: float | None = None, *, source: str = "BandStats.compute",
                band_names: Sequence[str] | None = None) -> "BandStats":
        """Statistics of ``(C, H, W)`` (or ``(N, C, H, W)``) pixels, ignoring missing values
        (``nodata``, NaN, +-inf: :func:`missing_values`). Errors start with ``source``."""
        arr = np.asarray(data, dtype=np.float64)
        arr = np.moveaxis(arr, -3, 0).reshape(arr.shape[-3], -1)
        mean, std = [], []
        for i, band in enumerate(arr):
            valid = band[~missing_values(band, nodata)]
            if valid.size == 0:
                name = f" ({band_names[i]})" if band_names is not None else ""
                raise SatelliteDataError(f"{source}: band {i + 1}{name} has no valid value (every one is "
                                         f"{_missing_words(nodata)})")
            mean.append(float(valid.mean()))
            std.append(float(max(valid.std(), 1e-6)))
        return cls(mean, std)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-3] != self.n_bands:
            raise SatelliteDataError(f"image has {x.shape[-3]} bands but the statistics are for {self.n_bands}")
        shape = (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=torch.float32).reshape(shape)
        std = torch.tensor(self.std, dtype=torch.float32).reshape(shape)
        return (x.float() - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(self.mean, dtype=torch.float32).reshape(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).reshape(-1, 1, 1)
        return x * std + mean


def geotiff_profile(*, transform, crs, dtype, nodata: float | None = None, compress: str = "deflate",
                    band_names: Sequence[str] | None = None, tags: dict[str, object] | None = None) -> dict:
    """The GeoTIFF creation profile of :func:`write_geotiff`: grid, nodata, deflate compression
    (with the horizontal predictor for integer pixels); ``band_names`` and ``tags`` ride along as
    ``descriptions`` and ``tags``, which a writer sets after the pixels (``set_band_description``,
    ``update_tags``; values as text). Width, height and band count come from the data written."""
    profile = dict(driver="GTiff", dtype=np.dtype(dtype).name, transform=transform, crs=crs, compress=compress,
                   nodata=nodata)
    if compress == "deflate" and np.dtype(dtype).kind in "ui":
        profile["predictor"] = 2
    if band_names is not None:
        profile["descriptions"] = list(band_names)
    if tags:
        profile["tags"] = {k: str(v) for k, v in tags.items()}
    return profile


def write_geotiff(path: str | os.PathLike, data: np.ndarray, *, transform, crs, band_names: Sequence[str] | None = None,
                  nodata: float | None = None, compress: str = "deflate", tags: dict[str, str] | None = None) -> Path:
    """Write ``(C, H, W)`` to a tiled, compressed GeoTIFF atomically (``domainfm.atomic``) with the
    profile of :func:`geotiff_profile`; ``tags`` become the file's metadata."""
    rasterio = _rasterio()
    path = Path(path)
    if data.ndim != 3:
        raise SatelliteDataError(f"write_geotiff: expected (C, H, W), got shape {data.shape}")
    if band_names is not None and len(band_names) != data.shape[0]:
        raise SatelliteDataError(f"write_geotiff: {len(band_names)} band names for {data.shape[0]} bands")
    profile = geotiff_profile(transform=transform, crs=crs, dtype=data.dtype, nodata=nodata, compress=compress,
                              band_names=band_names, tags=tags)
    descriptions, tags = profile.pop("descriptions", []), profile.pop("tags", None)
    with atomic_path(path, suffix=".tif") as tmp, rasterio.open(
            tmp, "w", width=data.shape[2], height=data.shape[1], count=data.shape[0], **profile) as dst:
        dst.write(data)
        for i, name in enumerate(descriptions):
            dst.set_band_description(i + 1, name)
        if tags:
            dst.update_tags(**tags)
    return path


class Scene(NamedTuple):
    """One scene read for training (unpacks as ``image, raw, band_names, stats``)."""

    #: ``(C, H, W)`` float32, normalised by ``stats``
    image: torch.Tensor
    #: ``(C, H, W)`` float32 pixels as read (e.g. reflectance, for labels derived from it)
    raw: np.ndarray
    band_names: list[str]
    stats: BandStats


def load_scene(source: str = "sample", *, paths: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
               bands: Sequence[str] | None = ("B04", "B03", "B02"), mean: Sequence[float] | None = None,
               std: Sequence[float] | None = None) -> Scene:
    """Read one scene and normalise it per band.

    Args:
        source: ``"sample"`` (the shipped Sentinel-2 scene, :func:`sample_scene_path`) or
            ``"raster"`` (``paths``: one multi-band file, or several single-band files that
            :func:`read_raster` puts on one grid).
        bands: band names to keep, in order (``None``: all).
        mean, std: per-band statistics; ``None`` computes them from the scene, ignoring nodata.

    **Shapes:** ``image`` and ``raw`` are ``(len(bands), H, W)``.
    """
    if source == "sample":
        raster = read_raster(sample_scene_path(), bands=bands)
    elif source == "raster":
        files = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or [])
        if not files:
            raise SatelliteDataError("load_scene: source='raster' needs paths (one raster file or a list of them)")
        raster = read_raster(files if len(files) > 1 else files[0], bands=bands)
    else:
        raise SatelliteDataError(f"load_scene: source={source!r}: expected 'sample' or 'raster'")
    if (mean is None) != (std is None):
        raise SatelliteDataError("load_scene: give both mean and std, or neither (then they are computed from the scene)")
    raw = raster.data.astype(np.float32)
    stats = BandStats(list(mean), list(std)) if mean is not None else BandStats.compute(raw, raster.nodata)
    if stats.n_bands != raw.shape[0]:
        raise SatelliteDataError(
            f"load_scene: mean/std have {stats.n_bands} values but the scene has {raw.shape[0]} bands {raster.band_names}"
        )
    return Scene(stats.normalize(torch.from_numpy(raw)), raw, list(raster.band_names), stats)


def _read_image(path: Path, n_bands: int | None, bands: Sequence[int] | None) -> torch.Tensor:
    suffix = path.suffix.lower()
    if suffix in _RASTER_SUFFIXES:
        rasterio = _rasterio()
        with rasterio.open(path) as ds:
            _check_file_size(ds, str(path), None)
            data = ds.read()
    elif suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    else:
        raise SatelliteDataError(f"{path}: unsupported image format {suffix!r}; expected {_RASTER_SUFFIXES + ('.npy',)}")
    if data.ndim != 3:
        raise SatelliteDataError(f"{path}: expected a (bands, height, width) image, got shape {data.shape}")
    if bands is not None:
        if max(bands) >= data.shape[0]:
            raise SatelliteDataError(f"{path}: has {data.shape[0]} bands, cannot select band index {max(bands)}")
        data = data[list(bands)]
    if n_bands is not None and data.shape[0] != n_bands:
        raise SatelliteDataError(f"{path}: has {data.shape[0]} bands, expected {n_bands}")
    return torch.from_numpy(data.astype(np.float32))


class SceneTiles(Dataset):
    """Square tiles cut from one ``(C, H, W)`` scene, optionally with one label per tile.

    Args:
        image: the scene (tensor or array).
        tile_size, stride: tile side and step in pixels (``stride < tile_size`` overlaps).
        transform: applied to each tile (e.g. :class:`MultiCrop`).
        labels_fn: ``fn(tile) -> int`` giving the tile's label (from the *raw* tile).
        keep: ``fn(row, col) -> bool`` on tile origins, to keep a subset (spatial splits).
        raw: scene used by ``labels_fn`` (default ``image``), e.g. unnormalised reflectance.
    """

    def __init__(self, image, tile_size: int, stride: int | None = None, *, transform: Callable | None = None,
                 labels_fn: Callable[[torch.Tensor], int] | None = None, keep: Callable[[int, int], bool] | None = None,
                 raw=None):
        image = torch.as_tensor(np.asarray(image) if not isinstance(image, torch.Tensor) else image).float()
        if image.ndim != 3:
            raise SatelliteDataError(f"SceneTiles: expected a (C, H, W) scene, got shape {tuple(image.shape)}")
        stride = stride or tile_size
        if tile_size < 1 or stride < 1 or tile_size > min(image.shape[1:]):
            raise SatelliteDataError(f"SceneTiles: tile_size={tile_size}, stride={stride} do not fit a scene of {tuple(image.shape[1:])}")
        self.image, self.tile_size, self.transform = image, tile_size, transform
        self.origins = [(r, c) for r in range(0, image.shape[1] - tile_size + 1, stride)
                        for c in range(0, image.shape[2] - tile_size + 1, stride) if keep is None or keep(r, c)]
        if not self.origins:
            raise SatelliteDataError("SceneTiles: `keep` rejected every tile")
        self.labels = None
        if labels_fn is not None:
            raw_t = torch.as_tensor(np.asarray(raw)).float() if raw is not None else image
            self.labels = torch.tensor([int(labels_fn(raw_t[:, r:r + tile_size, c:c + tile_size])) for r, c in self.origins])

    def __len__(self) -> int:
        return len(self.origins)

    def tile(self, index: int) -> torch.Tensor:
        r, c = self.origins[index]
        return self.image[:, r:r + self.tile_size, c:c + self.tile_size]

    def __getitem__(self, index: int):
        x = self.tile(index)
        x = self.transform(x) if self.transform is not None else x
        return (x, self.labels[index]) if self.labels is not None else x


class ImageFolder(Dataset):
    """EuroSAT-style ``root/<class name>/<image>.{tif,jp2,npy}``; classes sorted by name.

    Args:
        n_bands: bands every image must have (after ``bands`` selection); a mismatch names the file.
        bands: band indices (0-based) to keep, in order.
        stats: per-band normalisation applied after loading.
    """

    def __init__(self, root: str | os.PathLike, *, n_bands: int | None = None, bands: Sequence[int] | None = None,
                 stats: BandStats | None = None, transform: Callable | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.root}")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        if not self.classes:
            raise SatelliteDataError(f"{self.root}: no class sub-folders (expected root/<class>/<image>.tif)")
        self.samples = [(p, i) for i, c in enumerate(self.classes) for p in sorted((self.root / c).iterdir())
                        if p.suffix.lower() in _RASTER_SUFFIXES + (".npy",)]
        if not self.samples:
            raise SatelliteDataError(f"{self.root}: no images with suffix {_RASTER_SUFFIXES + ('.npy',)} in its class folders")
        self.n_bands, self.bands, self.stats, self.transform = n_bands, bands, stats, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        x = _read_image(path, self.n_bands, self.bands)
        if self.stats is not None:
            x = self.stats.normalize(x)
        return (self.transform(x) if self.transform else x), label


class CsvManifest(Dataset):
    """fMoW-style CSV manifest: one row per image with a path column and a label column.

    Relative paths are resolved against the CSV's folder. Labels may be names (mapped to sorted
    indices, ``self.classes``) or integers.
    """

    def __init__(self, csv_path: str | os.PathLike, *, image_column: str = "image_path", label_column: str = "category",
                 n_bands: int | None = None, bands: Sequence[int] | None = None, stats: BandStats | None = None,
                 transform: Callable | None = None, classes: Sequence[str] | None = None):
        self.csv_path = Path(csv_path)
        if not self.csv_path.is_file():
            raise FileNotFoundError(f"CSV manifest not found: {self.csv_path}")
        with open(self.csv_path, newline="") as fh:
            reader = csv.DictReader(fh)
            columns = reader.fieldnames or []
            for col in (image_column, label_column):
                if col not in columns:
                    raise SatelliteDataError(f"{self.csv_path}: no column {col!r}; columns are {columns}")
            rows = list(reader)
        if not rows:
            raise SatelliteDataError(f"{self.csv_path}: no rows")
        raw_labels = [r[label_column] for r in rows]
        if classes is None:
            numeric = all(v.strip().lstrip("-").isdigit() for v in raw_labels)
            classes = None if numeric else sorted(set(raw_labels))
        self.classes = list(classes) if classes is not None else None
        self.samples = []
        for line, r in enumerate(rows, start=2):
            p = Path(r[image_column])
            p = p if p.is_absolute() else self.csv_path.parent / p
            value = r[label_column]
            if self.classes is None:
                label = int(value)
            elif value in self.classes:
                label = self.classes.index(value)
            else:
                raise SatelliteDataError(f"{self.csv_path} line {line}: label {value!r} not in classes {self.classes[:10]}")
            self.samples.append((p, label))
        self.n_bands, self.bands, self.stats, self.transform = n_bands, bands, stats, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        if not path.is_file():
            raise FileNotFoundError(f"{self.csv_path}: image {path} (row {index + 2}) not found")
        x = _read_image(path, self.n_bands, self.bands)
        if self.stats is not None:
            x = self.stats.normalize(x)
        return (self.transform(x) if self.transform else x), label


def labelled_images(kind: str, path: str | os.PathLike, *, val_path: str | os.PathLike | None = None,
                    val_fraction: float = 0.2, seed: int = 0, n_bands: int | None = None,
                    bands: Sequence[int] | None = None, stats: BandStats | None = None,
                    train_transform: Callable | None = None, eval_transform: Callable | None = None):
    """Train and validation images of an :class:`ImageFolder` (``kind="folder"``) or a
    :class:`CsvManifest` (``kind="csv"``) at ``path``: ``val_path`` (of the same kind; a CSV's
    labels mapped onto the training classes) validates, else a ``val_fraction`` of ``path`` drawn
    with ``seed`` does. Returns ``(train, val, class names)``, two ``torch.utils.data.Subset`` of
    datasets with ``train_transform`` / ``eval_transform``."""
    from torch.utils.data import Subset

    make = {"folder": ImageFolder, "csv": CsvManifest}[kind]
    kw = dict(n_bands=n_bands, bands=bands, stats=stats)
    train_ds, eval_ds = make(path, transform=train_transform, **kw), make(path, transform=eval_transform, **kw)
    if val_path:
        same_classes = {} if kind == "folder" else {"classes": train_ds.classes}
        val_ds = make(val_path, transform=eval_transform, **kw, **same_classes)
        train, val = Subset(train_ds, range(len(train_ds))), Subset(val_ds, range(len(val_ds)))
    else:
        order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val = max(1, int(round(val_fraction * len(train_ds))))
        train, val = Subset(train_ds, order[n_val:]), Subset(eval_ds, order[:n_val])
    classes = list(train_ds.classes or range(max(label for _, label in train_ds.samples) + 1))
    return train, val, [str(c) for c in classes]


# ----------------------------------------------------------------------------- transforms


class UnlabelledImages(Dataset):
    """The images of a labelled dataset (``(image, label)`` items) without their labels, each
    passed through ``transform``: the input of self-supervised pretraining."""

    def __init__(self, dataset: Dataset, transform: Callable | None = None):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image = self.dataset[index][0]
        return self.transform(image) if self.transform is not None else image


def random_resized_crop(x: torch.Tensor, size: int, scale: tuple[float, float], ratio=(3 / 4, 4 / 3),
                        rng: random.Random | None = None) -> torch.Tensor:
    """torchvision's RandomResizedCrop on a ``(C, H, W)`` tensor of any number of bands."""
    rng = rng or random
    _, h, w = x.shape
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = rng.randint(0, h - ch), rng.randint(0, w - cw)
            break
    else:  # central crop, as torchvision's fallback
        ch, cw = h, w
        top, left = 0, 0
    crop = x[:, top:top + ch, left:left + cw]
    return F.interpolate(crop.unsqueeze(0), size=(size, size), mode="bilinear", align_corners=False,
                         antialias=True).squeeze(0)


def _flip(x: torch.Tensor, rng) -> torch.Tensor:
    # overhead imagery has no "up": vertical flips are as valid as horizontal ones
    if rng.random() < 0.5:
        x = x.flip(-1)
    if rng.random() < 0.5:
        x = x.flip(-2)
    return x


def _jitter(x: torch.Tensor, strength: float, rng) -> torch.Tensor:
    """Band-agnostic photometric jitter: per-image brightness shift and contrast scale (in
    normalised units). DINOv2's colour jitter / grayscale / solarisation assume RGB."""
    if strength <= 0:
        return x
    mean = x.mean(dim=(-2, -1), keepdim=True)
    contrast = 1 + rng.uniform(-strength, strength)
    return (x - mean) * contrast + mean + rng.uniform(-strength, strength)


class MultiCrop:
    """DINOv2 multi-crop: 2 global crops (``global_scale``) and ``n_local`` local crops
    (``local_scale``), each random-resized, flipped and jittered; works on any band count.

    ExPLoRA's ViT-L/14 setting: ``global_size=224, local_size=98, n_local=8,
    global_scale=(0.32, 1.0), local_scale=(0.05, 0.32)``.
    """

    def __init__(self, global_size: int = 224, local_size: int = 98, n_local: int = 8,
                 global_scale=(0.32, 1.0), local_scale=(0.05, 0.32), jitter: float = 0.2, seed: int | None = None):
        for name, (lo, hi) in (("global_scale", global_scale), ("local_scale", local_scale)):
            if not 0 < lo <= hi <= 1:
                raise SatelliteDataError(f"MultiCrop: {name}={(lo, hi)} must satisfy 0 < low <= high <= 1")
        self.global_size, self.local_size, self.n_local = global_size, local_size, n_local
        self.global_scale, self.local_scale, self.jitter = tuple(global_scale), tuple(local_scale), jitter
        self.rng = random.Random(seed) if seed is not None else random

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        crops = []
        for i in range(2 + self.n_local):
            size, scale = (self.global_size, self.global_scale) if i < 2 else (self.local_size, self.local_scale)
            crop = _flip(random_resized_crop(x, size, scale, rng=self.rng), self.rng)
            crops.append(_jitter(crop, self.jitter, self.rng))
        return crops


def multicrop_collate(batch: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """List of per-image crop lists -> list of ``(B, C, h, w)``, one per crop position."""
    return [torch.stack(crops) for crops in zip(*batch)]


class MaeTransform:
    """MAE pretraining augmentation: random-resized crop (scale 0.2-1) + flips, any band count."""

    def __init__(self, size: int = 224, scale=(0.2, 1.0), seed: int | None = None):
        self.size, self.scale = size, tuple(scale)
        self.rng = random.Random(seed) if seed is not None else random

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _flip(random_resized_crop(x, self.size, self.scale, rng=self.rng), self.rng)


class Resize:
    """Bilinear resize of a ``(C, H, W)`` tile to ``size x size`` (evaluation), optional flips."""

    def __init__(self, size: int, flip: bool = False, seed: int | None = None):
        self.size, self.flip = size, flip
        self.rng = random.Random(seed) if seed is not None else random

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size or x.shape[-2] != self.size:
            x = F.interpolate(x.unsqueeze(0), size=(self.size, self.size), mode="bilinear", align_corners=False,
                              antialias=True).squeeze(0)
        return _flip(x, self.rng) if self.flip else x


# ----------------------------------------------------------------------------- display


def rgb_preview(raster: Raster) -> np.ndarray:
    """``(H, W, 3)`` in [0, 1] for display: the raster's red, green and blue bands (found by
    name, :func:`match_bands`), each stretched between its 2nd and 98th percentile over the
    values that hold data; a file without them shows its first band in grey."""
    try:
        raw = raster.data[match_bands(raster.band_names, ["red", "green", "blue"])]
    except SatelliteDataError:
        raw = np.repeat(raster.data[:1], 3, axis=0)
    bands = raw.astype(np.float32)
    valid = np.where(missing_values(raw, raster.nodata) | ~np.isfinite(bands), np.nan, bands)
    lo, hi = np.nanpercentile(valid, 2, axis=(1, 2)), np.nanpercentile(valid, 98, axis=(1, 2))
    out = (bands - lo[:, None, None]) / np.maximum(hi - lo, 1e-6)[:, None, None]
    return np.nan_to_num(np.clip(out, 0, 1)).transpose(1, 2, 0)


def class_map_figure(raster: Raster, classes: np.ndarray, class_names: Sequence[str], *, nodata: int,
                     reference: np.ndarray | None = None, title: str | None = None):
    """A matplotlib figure (Agg canvas, no pyplot): the scene's RGB (:func:`rgb_preview`) beside a
    ``(H, W)`` class map (``nodata`` left blank) and, if given, ``reference`` labels on the same
    colours, with one legend entry per class."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    k = len(class_names)
    colours = colormaps["tab10" if k <= 10 else "tab20"](np.arange(k) % (10 if k <= 10 else 20))
    cmap, norm = ListedColormap(colours), BoundaryNorm(np.arange(k + 1) - 0.5, k)
    panels = [("scene (RGB)", None), ("predicted classes", classes)]
    if reference is not None:
        panels.append(("reference labels", reference))
    fig = Figure(figsize=(4.2 * len(panels), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (name, data) in zip(fig.subplots(1, len(panels)), panels):
        if data is None:
            ax.imshow(rgb_preview(raster))
        else:
            ax.imshow(np.ma.masked_equal(data, nodata), cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(name)
        ax.set_xticks([]), ax.set_yticks([])
    fig.legend(handles=[Patch(color=colours[i], label=n) for i, n in enumerate(class_names)],
               loc="lower center", ncol=min(k, 5), bbox_to_anchor=(0.5, -0.02), frameon=False)
    if title:
        fig.suptitle(title)
    fig.get_layout_engine().set(rect=(0, 0.06, 1, 0.94))
    return fig


# ----------------------------------------------------------------------------- spectral-index labels


def ndvi(red: torch.Tensor, nir: torch.Tensor) -> torch.Tensor:
    """Normalised difference vegetation index ``(NIR - red) / (NIR + red)``."""
    red, nir = red.float(), nir.float()
    return (nir - red) / (nir + red).clamp_min(1e-6)


def ndwi(green: torch.Tensor, nir: torch.Tensor) -> torch.Tensor:
    """McFeeters' normalised difference water index ``(green - NIR) / (green + NIR)``."""
    green, nir = green.float(), nir.float()
    return (green - nir) / (green + nir).clamp_min(1e-6)


def ndmi(nir: torch.Tensor, swir: torch.Tensor) -> torch.Tensor:
    """Normalised difference moisture index ``(NIR - SWIR) / (NIR + SWIR)`` (Sentinel-2: B08, B11)."""
    nir, swir = nir.float(), swir.float()
    return (nir - swir) / (nir + swir).clamp_min(1e-6)


def mean_ndmi(tile: torch.Tensor, band_names: Sequence[str]) -> float:
    """Mean :func:`ndmi` of a tile, from its bands B08 and B11 by name."""
    nir, swir = (select_bands(tile, band_names, [b], source="tile")[0] for b in ("B08", "B11"))
    return float(ndmi(nir, swir).mean())


def brightness_cv(tile: torch.Tensor, band_names: Sequence[str]) -> float:
    """Coefficient of variation of a tile's visible brightness (the mean of B02, B03, B04 by name):
    a texture measure."""
    bright = select_bands(tile, band_names, ["B02", "B03", "B04"], source="tile").float().mean(0)
    return float(bright.std() / bright.mean().clamp_min(1e-6))


def terciles(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """0/1/2 by the 1/3 and 2/3 quantiles of ``values``: three balanced constructed classes."""
    v = np.asarray(values, dtype=np.float64)
    return np.digitize(v, np.quantile(v, [1 / 3, 2 / 3]))


#: classes of :func:`spectral_index_classes`, in label order
INDEX_CLASSES = ("water", "shore_mixed", "moderate_vegetation", "dense_vegetation")


def spectral_index_classes(tile: torch.Tensor, band_names: Sequence[str], *, water_fraction: float = 0.5,
                           shore_fraction: float = 0.1, dense_ndvi: float = 0.45) -> int:
    """A *constructed* land-cover label for a tile from its spectral indices (not ground truth).

    With ``w`` the fraction of pixels with NDWI > 0: ``water`` if ``w >= water_fraction``,
    ``shore_mixed`` if ``w >= shore_fraction``, otherwise by mean NDVI ``moderate_vegetation``
    (``< dense_ndvi``) or ``dense_vegetation``. Needs bands B03 (green), B04 (red), B08 (NIR)
    by name.
    """
    green, red, nir = (select_bands(tile, band_names, [b], source="tile")[0] for b in ("B03", "B04", "B08"))
    w = float((ndwi(green, nir) > 0).float().mean())
    if w >= water_fraction:
        return 0
    if w >= shore_fraction:
        return 1
    return 2 if float(ndvi(red, nir).mean()) < dense_ndvi else 3


class SampleTileTask(NamedTuple):
    """The shipped scene as a constructed tile-classification task (:func:`sample_tile_task`)."""

    train: SceneTiles
    val: SceneTiles
    #: tiles that neither train nor validate: ``images`` (eval transform), two *other* constructed
    #: ``labels`` (``texture``: :func:`terciles` of :func:`brightness_cv`; ``moisture``: of
    #: :func:`mean_ndmi`, from bands B08/B11), 2 spatial ``folds`` (whole blocks), ``split`` (where from)
    retained: dict
    #: ``band_stats`` (of the selected bands), the file's pixel ``dtype``, ``pixel_size``, ``n_retained``
    info: dict


def sample_tile_task(*, bands: Sequence[str], tile_size: int, split_block: int, split_every: int,
                     retained_offset: int | None, mean: Sequence[float] | None = None,
                     std: Sequence[float] | None = None, train_transform: Callable | None = None,
                     eval_transform: Callable | None = None) -> SampleTileTask:
    """The shipped scene's ``tile_size`` tiles of ``bands`` (normalised by ``mean``/``std``, else
    the scene's own statistics), labelled by :func:`spectral_index_classes` (:data:`INDEX_CLASSES`)
    and split spatially: tiles in blocks of ``split_block`` x ``split_block`` tiles, block
    ``(block_row + block_col) % split_every`` 0 validates, ``retained_offset`` is held out of
    training and validation (None: the retained tiles are the validation tiles), the rest trains.
    """
    full = load_scene("sample", bands=None)  # every band: the labels need B03/B04/B08 (and B11)
    scene = load_scene("sample", bands=bands, mean=mean, std=std)
    raw = torch.from_numpy(full.raw)
    ts, blk, every, off = tile_size, split_block, split_every, retained_offset

    def part(r: int, c: int) -> str:
        k = ((r // ts) // blk + (c // ts) // blk) % every
        return "val" if k == 0 else "retained" if off is not None and k == off else "train"

    def label(tile: torch.Tensor) -> int:
        return spectral_index_classes(tile, full.band_names)

    train = SceneTiles(scene.image, ts, transform=train_transform, labels_fn=label, raw=raw,
                       keep=lambda r, c: part(r, c) == "train")
    val = SceneTiles(scene.image, ts, transform=eval_transform, labels_fn=label, raw=raw,
                     keep=lambda r, c: part(r, c) == "val")
    held = SceneTiles(scene.image, ts, transform=eval_transform,
                      keep=lambda r, c: part(r, c) == ("retained" if off else "val"))
    tiles = [raw[:, r:r + ts, c:c + ts] for r, c in held.origins]
    retained = {
        "images": torch.stack([held[i] for i in range(len(held))]),
        "labels": {"texture": terciles([brightness_cv(t, full.band_names) for t in tiles]),
                   "moisture": terciles([mean_ndmi(t, full.band_names) for t in tiles])},
        "folds": np.array([((r // ts) // blk) % 2 for r, _ in held.origins]),
        "split": "retained blocks" if off else "validation blocks",
    }
    info = {"band_stats": {"mean": scene.stats.mean, "std": scene.stats.std},
            "dtype": read_raster(sample_scene_path()).data.dtype.name, "pixel_size": 60.0, "n_retained": len(held)}
    return SampleTileTask(train, val, retained, info)


def sample_scene_path() -> Path:
    """The shipped Sentinel-2 sample scene (see ``samples/satellite/README.md``)."""
    import importlib.resources

    path = Path(str(importlib.resources.files("domainfm.data_loaders") / "samples" / "satellite" / "s2_sample_60m.tif"))
    if not path.is_file():
        raise FileNotFoundError(f"the shipped Sentinel-2 sample is missing: {path} (reinstall domainfm)")
    return path
