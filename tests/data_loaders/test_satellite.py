"""Satellite loading: GeoTIFF round trip, mixed resolutions, band selection, normalisation,
datasets and crop transforms on any band count."""
import re

import numpy as np
import pytest
import torch

import rasterio  # noqa: E402
from rasterio.transform import from_origin  # noqa: E402

from domainfm.data_loaders import satellite as S  # noqa: E402


def _scene(c=4, h=20, w=24, seed=0, dtype=np.uint16):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 10000, size=(c, h, w)).astype(dtype)


def test_geotiff_round_trip_bands_dtype_and_normalisation(tmp_path):
    data = _scene()
    names = ["B02", "B03", "B04", "B08"]
    path = S.write_geotiff(tmp_path / "scene.tif", data, transform=from_origin(500000, 4200000, 10, 10),
                           crs="EPSG:32618", band_names=names)
    r = S.read_raster(path)
    assert r.data.dtype == np.uint16 and r.band_names == names and r.resolution == (10.0, 10.0)
    assert np.array_equal(r.data, data)
    r2 = S.read_raster(path, bands=["B08", "B02"])
    assert np.array_equal(r2.data, data[[3, 0]]) and r2.band_names == ["B08", "B02"]
    stats = S.BandStats.compute(r.data)
    assert stats.mean == pytest.approx(data.reshape(4, -1).mean(1).tolist())
    assert stats.std == pytest.approx(data.reshape(4, -1).std(1).tolist())
    z = stats.normalize(torch.from_numpy(r.data.astype(np.float32)))
    torch.testing.assert_close(z.mean(dim=(1, 2)), torch.zeros(4), atol=1e-4, rtol=0)
    torch.testing.assert_close(z.std(dim=(1, 2), unbiased=False), torch.ones(4), atol=1e-4, rtol=0)
    torch.testing.assert_close(stats.denormalize(z), torch.from_numpy(data.astype(np.float32)), atol=1e-2, rtol=1e-5)
    with pytest.raises(ValueError, match=r"bands \['B11'\] not found"):
        S.read_raster(path, bands=["B11"])
    with pytest.raises(ValueError, match="image has 3 bands but the statistics are for 4"):
        stats.normalize(torch.zeros(3, 2, 2))
    assert not list(tmp_path.glob(".*tmp*"))


def test_mixed_resolutions_are_resampled_onto_the_finest_common_grid(tmp_path):
    fine = np.arange(8 * 8, dtype=np.float32).reshape(1, 8, 8)
    coarse = np.array([[[1.0, 2.0], [3.0, 4.0]]], dtype=np.float32)  # 40 m pixels over the same 80 m
    S.write_geotiff(tmp_path / "x_B02.tif", fine, transform=from_origin(0, 80, 10, 10), crs="EPSG:32618")
    S.write_geotiff(tmp_path / "x_B11.tif", coarse, transform=from_origin(0, 80, 40, 40), crs="EPSG:32618")
    r = S.read_raster([tmp_path / "x_B02.tif", tmp_path / "x_B11.tif"], resampling="nearest")
    assert r.data.shape == (2, 8, 8) and r.band_names == ["B02", "B11"] and r.resolution == (10.0, 10.0)
    assert np.array_equal(r.data[0], fine[0])
    assert np.array_equal(r.data[1], np.kron(coarse[0], np.ones((4, 4))))  # each 40 m pixel -> 4x4
    avg = S.read_raster([tmp_path / "x_B02.tif"], resolution=20.0, resampling="average")
    assert avg.data.shape == (1, 4, 4) and avg.data[0, 0, 0] == pytest.approx(fine[0, :2, :2].mean())
    S.write_geotiff(tmp_path / "y.tif", coarse, transform=from_origin(0, 80, 40, 40), crs="EPSG:4326")
    with pytest.raises(ValueError, match="CRS"):
        S.read_raster([tmp_path / "x_B02.tif", tmp_path / "y.tif"])
    with pytest.raises(FileNotFoundError, match="missing.tif"):
        S.read_raster(tmp_path / "missing.tif")


def test_image_folder_and_csv_manifest_check_band_count(tmp_path):
    for cls, seed in (("forest", 1), ("river", 2)):
        for i in range(2):
            S.write_geotiff(tmp_path / "eurosat" / cls / f"{i}.tif", _scene(c=5, h=8, w=8, seed=seed + 10 * i),
                            transform=from_origin(0, 0, 10, 10), crs="EPSG:32618")
    ds = S.ImageFolder(tmp_path / "eurosat", n_bands=5)
    assert ds.classes == ["forest", "river"] and len(ds) == 4
    x, y = ds[3]
    assert x.shape == (5, 8, 8) and x.dtype == torch.float32 and y == 1
    with pytest.raises(ValueError, match=r"1\.tif: has 5 bands, expected 3"):
        S.ImageFolder(tmp_path / "eurosat", n_bands=3)[1]
    sub = S.ImageFolder(tmp_path / "eurosat", n_bands=2, bands=[4, 0])
    assert torch.equal(sub[0][0], ds[0][0][[4, 0]])
    (tmp_path / "m.csv").write_text("image_path,category\neurosat/river/0.tif,river\neurosat/forest/1.tif,forest\n")
    man = S.CsvManifest(tmp_path / "m.csv", n_bands=5)
    assert man.classes == ["forest", "river"] and man[0][1] == 1 and torch.equal(man[1][0], ds[1][0])
    (tmp_path / "bad.csv").write_text("path,label\nx.tif,1\n")
    with pytest.raises(ValueError, match="no column 'image_path'"):
        S.CsvManifest(tmp_path / "bad.csv")


def test_multicrop_and_mae_transforms_on_ten_bands():
    x = torch.randn(10, 40, 40)
    crops = S.MultiCrop(global_size=32, local_size=16, n_local=3, seed=0)(x)
    assert [c.shape for c in crops] == [(10, 32, 32)] * 2 + [(10, 16, 16)] * 3
    batch = S.multicrop_collate([crops, crops])
    assert len(batch) == 5 and batch[0].shape == (2, 10, 32, 32)
    assert S.MaeTransform(24, seed=0)(x).shape == (10, 24, 24)
    # a full-scale crop with no jitter is the resized image (up to flips)
    full = S.random_resized_crop(x, 40, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    torch.testing.assert_close(full, x, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="global_scale"):
        S.MultiCrop(global_scale=(0.5, 1.2))


def test_scene_tiles_and_spectral_index_labels():
    names = ["B02", "B03", "B04", "B08"]
    img = torch.full((4, 8, 16), 1000.0)
    img[2, :, :8] = 1000.0  # left half: red 1000, NIR 5000 -> NDVI 0.667 (dense vegetation)
    img[3, :, :8] = 5000.0
    img[1, :, 8:] = 3000.0  # right half: green 3000 > NIR 1000 -> NDWI 0.5 (water)
    img[3, :, 8:] = 1000.0
    tiles = S.SceneTiles(img, 8, labels_fn=lambda t: S.spectral_index_classes(t, names))
    assert tiles.origins == [(0, 0), (0, 8)] and tiles.labels.tolist() == [3, 0]
    assert float(S.ndvi(torch.tensor(1000.0), torch.tensor(5000.0))) == pytest.approx(4000 / 6000)
    half = S.SceneTiles(img, 4, keep=lambda r, c: c >= 8)
    assert len(half) == 4 and all(c >= 8 for _, c in half.origins)
    with pytest.raises(ValueError, match="do not fit"):
        S.SceneTiles(img, 20)


def test_shipped_sentinel2_sample():
    r = S.read_raster(S.sample_scene_path(), bands=list(S.EXPLORA_SENTINEL2_BANDS))
    assert r.data.shape[0] == 10 and r.data.dtype == np.uint16 and r.resolution == (60.0, 60.0)
    assert str(r.crs) == "EPSG:32618"


def test_load_scene_from_rasters_normalises_with_computed_or_given_statistics(tmp_path):
    data = _scene(c=3, h=12, w=10, seed=4)
    path = S.write_geotiff(tmp_path / "s.tif", data, transform=from_origin(0, 120, 10, 10), crs="EPSG:32618",
                           band_names=["B02", "B03", "B04"])
    image, raw, names, stats = S.load_scene("raster", paths=path, bands=["B04", "B02"])
    assert names == ["B04", "B02"] and np.array_equal(raw, data[[2, 0]].astype(np.float32))
    expected = (data[[2, 0]] - data[[2, 0]].reshape(2, -1).mean(1)[:, None, None]) / data[[2, 0]].reshape(2, -1).std(
        1)[:, None, None]
    torch.testing.assert_close(image, torch.from_numpy(expected.astype(np.float32)), atol=1e-5, rtol=1e-5)
    given = S.load_scene("raster", paths=[path], bands=["B03"], mean=[1000.0], std=[500.0])
    torch.testing.assert_close(given.image, torch.from_numpy((data[[1]] - 1000.0) / 500.0).float())
    assert given.stats == S.BandStats([1000.0], [500.0])
    with pytest.raises(ValueError, match="mean/std have 2 values but the scene has 1 bands"):
        S.load_scene("raster", paths=path, bands=["B03"], mean=[0.0, 0.0], std=[1.0, 1.0])
    with pytest.raises(ValueError, match="both mean and std"):
        S.load_scene("raster", paths=path, mean=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="needs paths"):
        S.load_scene("raster")
    with pytest.raises(ValueError, match="expected 'sample' or 'raster'"):
        S.load_scene("folder")
    sample = S.load_scene()  # the shipped scene, RGB by default
    assert sample.band_names == ["B04", "B03", "B02"] and sample.image.shape[0] == 3


def test_unlabelled_images_drop_labels_and_apply_the_transform(tmp_path):
    labelled = [(torch.full((2, 3, 3), float(i)), i % 2) for i in range(4)]
    ds = S.UnlabelledImages(labelled, transform=lambda x: x * 10)
    assert len(ds) == 4 and torch.equal(ds[3], torch.full((2, 3, 3), 30.0))
    assert torch.equal(S.UnlabelledImages(labelled)[2], labelled[2][0])


def test_match_bands_by_name_alias_and_order_with_errors_naming_both_sets():
    s2 = ["B01", "B02", "B03", "B04", "B08", "B8A"]
    assert S.match_bands(s2, ["red", "green", "blue"]) == [3, 2, 1]
    assert S.match_bands(s2, ["B4", "B8", "b8a"]) == [3, 4, 5]
    assert S.match_bands(["band1", "band2", "band3"], ["red", "green", "blue"]) == [0, 1, 2]  # no descriptions
    with pytest.raises(S.SatelliteDataError, match=r"x.tif: has 2 bands \['B02', 'B03'\], but the model expects "
                                                   r"3 bands \['red', 'green', 'blue'\] \(missing \['red'\]\)"):
        S.match_bands(["B02", "B03"], ["red", "green", "blue"], source="x.tif")
    with pytest.raises(S.SatelliteDataError, match="has 4 bands"):
        S.match_bands(["band1", "band2", "band3", "band4"], ["red", "green", "blue"])


def test_tile_origins_cover_the_scene_and_stitching_takes_the_nearest_tile_centre():
    assert S.tile_origins(10, 7, 4) == [(r, c) for r in (0, 4, 6) for c in (0, 3)]
    assert S.tile_origins(10, 7, 4, edge="drop") == [(r, 0) for r in (0, 4)]
    assert S.tile_origins(8, 8, 4, 2) == [(r, c) for r in (0, 2, 4) for c in (0, 2, 4)]
    origins = S.tile_origins(10, 7, 4)
    m = S.stitch_tiles(np.arange(len(origins)), origins, (10, 7), 4, fill=-1)
    # by hand: row starts 0, 4, 6 (centres 1.5, 5.5, 7.5): row 6 is nearer 5.5, row 7 nearer 7.5;
    # column starts 0, 3 (centres 1.5, 4.5): column 3 ties (1.5 each) and goes to the first tile
    row_owner = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    col_owner = [0, 0, 0, 0, 1, 1, 1]
    expected = np.array([[2 * row_owner[r] + col_owner[c] for c in range(7)] for r in range(10)])
    np.testing.assert_array_equal(m, expected)
    dropped = S.stitch_tiles(np.arange(2), [(0, 0), (4, 0)], (10, 7), 4, fill=-1)
    assert (dropped[8:] == -1).all() and (dropped[:, 4:] == -1).all() and (dropped[:8, :4] >= 0).all()
    with pytest.raises(S.SatelliteDataError, match="does not fit"):
        S.tile_origins(3, 7, 4)


def test_read_scene_for_model_selects_by_name_normalises_and_checks_dtype(tmp_path):
    data = _scene(c=4)
    path = S.write_geotiff(tmp_path / "s.tif", data, transform=from_origin(0, 0, 10, 10), crs="EPSG:32618",
                           band_names=["B02", "B03", "B04", "B08"])
    stats = S.BandStats([100.0, 200.0, 300.0], [10.0, 20.0, 30.0])
    scene = S.read_scene_for_model(path, bands=["red", "green", "blue"], stats=stats, dtype="uint16")
    expected = (data[[2, 1, 0]].astype(np.float32) - np.array([100, 200, 300])[:, None, None]) / np.array([10, 20, 30])[:, None, None]
    torch.testing.assert_close(scene.image, torch.from_numpy(expected.astype(np.float32)))
    assert scene.bands == ["red", "green", "blue"] and scene.raster.data.shape == (4, 20, 24)
    own = S.read_scene_for_model(path, band_indices=[3])  # no statistics: the scene's own
    assert abs(float(own.image.mean())) < 1e-4 and abs(float(own.image.std(unbiased=False)) - 1) < 1e-4
    with pytest.raises(S.SatelliteDataError, match=f"{path}: pixels are uint16 but the model was trained on float32"):
        S.read_scene_for_model(path, bands=["B02"], dtype="float32")
    with pytest.raises(S.SatelliteDataError, match="missing"):
        S.read_scene_for_model(path, bands=["B11"])
    (tmp_path / "not.tif").write_text("hello")
    with pytest.raises(S.SatelliteDataError, match="not.tif: not a raster"):
        S.read_scene_for_model(tmp_path / "not.tif")


def test_non_finite_values_are_missing_like_nodata_in_statistics_and_the_model_input(tmp_path):
    data = _scene(c=3, dtype=np.float32)
    data[0, 2, 3], data[1, 4, 5], data[:, 6, 7] = np.nan, np.inf, -np.inf
    as_nodata = data.copy()
    as_nodata[~np.isfinite(as_nodata)] = -9999.0
    finite = [band[np.isfinite(band)] for band in data.astype(np.float64)]
    for nodata, pixels in ((None, data), (-9999.0, as_nodata)):
        stats = S.BandStats.compute(pixels, nodata)
        assert stats.mean == pytest.approx([b.mean() for b in finite], rel=1e-9)
        assert stats.std == pytest.approx([b.std() for b in finite], rel=1e-9)
    nan_path = S.write_geotiff(tmp_path / "nan.tif", data, transform=from_origin(0, 0, 10, 10), crs="EPSG:32618",
                               band_names=["B02", "B03", "B04"])
    nodata_path = S.write_geotiff(tmp_path / "nodata.tif", as_nodata, transform=from_origin(0, 0, 10, 10),
                                  crs="EPSG:32618", band_names=["B02", "B03", "B04"], nodata=-9999.0)
    a, b = S.read_scene_for_model(nan_path), S.read_scene_for_model(nodata_path)
    assert torch.isfinite(a.image).all()
    torch.testing.assert_close(a.image, b.image, atol=1e-6, rtol=0)
    # a missing value is the band mean (0 once normalised); a pixel is valid while any band holds data
    assert float(a.image[0, 2, 3]) == 0.0 and float(a.image[1, 4, 5]) == 0.0 and (a.image[:, 6, 7] == 0).all()
    np.testing.assert_array_equal(a.valid, b.valid)
    assert a.valid.sum() == a.valid.size - 1 and not a.valid[6, 7] and a.valid[2, 3] and a.valid[4, 5]
    nothing = S.write_geotiff(tmp_path / "nothing.tif", np.full((2, 4, 4), np.nan, np.float32),
                              transform=from_origin(0, 0, 10, 10), crs="EPSG:32618")
    with pytest.raises(S.SatelliteDataError, match=re.escape(f"{nothing}: every value")):
        S.read_scene_for_model(nothing)
    with pytest.raises(S.SatelliteDataError, match="x.tif: band 2 has no valid value"):
        S.BandStats.compute(np.stack([data[0], np.full_like(data[0], np.nan)]), source="x.tif")


def test_a_raster_over_the_memory_limit_is_refused_before_its_pixels_are_read(tmp_path, monkeypatch):
    import tracemalloc

    huge = tmp_path / "huge.tif"
    with rasterio.open(huge, "w", driver="GTiff", width=100000, height=100000, count=3, dtype="uint8", tiled=True,
                       sparse_ok=True, crs="EPSG:32618", transform=from_origin(0, 0, 10, 10)):
        pass  # nothing written: a sparse file of a few MB claiming 100000 x 100000 x 3 bytes
    assert huge.stat().st_size < 16 * 2**20
    tracemalloc.start()
    try:
        with pytest.raises(S.RasterTooLarge) as err:
            S.read_raster(huge)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # refused before any pixel buffer exists
    message = str(err.value)
    assert str(huge) in message and "27.9 GiB" in message and "limit of 2.0 GiB" in message
    assert S.MAX_RASTER_BYTES_ENV in message and "max_bytes" in message
    with pytest.raises(S.RasterTooLarge, match=re.escape(str(huge))):
        S.read_scene_for_model(huge)
    # the limit is a keyword or an environment variable; equal to the size is allowed
    small = S.write_geotiff(tmp_path / "s.tif", _scene(c=3), transform=from_origin(0, 0, 10, 10), crs="EPSG:32618")
    size = 3 * 20 * 24 * 2
    assert S.read_raster(small, max_bytes=size).data.shape == (3, 20, 24)
    with pytest.raises(S.RasterTooLarge, match=r"over the limit of 2.8 KiB \(2879 bytes\)"):
        S.read_raster(small, max_bytes=size - 1)
    monkeypatch.setenv(S.MAX_RASTER_BYTES_ENV, str(size - 1))
    with pytest.raises(S.RasterTooLarge, match=re.escape(f"{small}: 24 x 20 pixels x 3 bands of uint16")):
        S.read_raster(small)
    monkeypatch.setenv(S.MAX_RASTER_BYTES_ENV, "lots")
    from domainfm.errors import InputError

    with pytest.raises(InputError, match=f"{S.MAX_RASTER_BYTES_ENV}='lots'"):
        S.read_raster(small)
    monkeypatch.delenv(S.MAX_RASTER_BYTES_ENV)
    # resampling onto a finer grid is checked on the grid it would allocate
    with pytest.raises(S.RasterTooLarge, match="24000 x 20000 pixels"):
        S.read_raster(small, resolution=0.01)
