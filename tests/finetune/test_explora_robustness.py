"""ExPLoRA predict / embed on awkward scenes, with a tiny untrained model and small rasters written
here: a NaN or inf pixel is masked exactly as a nodata pixel is (statistics, tile forward and
class map); a scene with no data, a scene smaller than one tile and a raster too large to read
are one-line errors naming the file; ``--output``, ``--probability`` and ``--plot`` are committed
together, so an unwritable ``--plot`` leaves no class map behind."""
import re

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import from_origin

from domainfm import create_model, save_pretrained
from domainfm.cli import main
from domainfm.data_loaders import satellite as S
from domainfm.experiment import apply as layer
from domainfm.finetune import explora as F

TRANSFORM = from_origin(435730, 4179460, 60, 60)
RGB = ["B04", "B03", "B02"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("explora-test", n_outputs=3).eval()


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    return save_pretrained(model, tmp_path_factory.mktemp("saved") / "tiny")


def _write(path, data, nodata=None):
    return S.write_geotiff(path, data, transform=TRANSFORM, crs="EPSG:32618", band_names=RGB, nodata=nodata)


def _clean(h=48, w=40):
    return np.random.default_rng(0).normal(1000, 300, size=(3, h, w)).astype(np.float32)


@pytest.mark.parametrize("bad, bands", [(np.nan, [0, 1, 2]), (np.inf, [0, 1, 2]), (-np.inf, [1]), (np.nan, [2])],
                         ids=["nan", "inf", "minus_inf_one_band", "nan_one_band"])
def test_a_non_finite_value_is_masked_exactly_like_nodata(model, tmp_path, bad, bands):
    clean = _clean()
    with_bad, with_nodata = clean.copy(), clean.copy()
    with_bad[bands, 5, 7] = bad
    with_nodata[bands, 5, 7] = -9999.0
    bad_path, nodata_path = _write(tmp_path / "bad.tif", with_bad), _write(tmp_path / "nodata.tif", with_nodata, -9999.0)
    settings = F.inference_settings(model)  # the card's: the scene's own statistics, 32-px tiles
    a = F.predict(bad_path, model, settings, precision="32-true")
    b = F.predict(nodata_path, model, settings, precision="32-true")
    assert a.origins == b.origins == [(0, 0), (0, 8), (16, 0), (16, 8)]
    assert np.isfinite(a.tile_probabilities).all()
    np.testing.assert_allclose(a.tile_probabilities, b.tile_probabilities, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(a.classes, b.classes)
    np.testing.assert_allclose(a.probability, b.probability, rtol=0, atol=1e-5, equal_nan=True)
    all_bands = len(bands) == 3
    finite = np.isfinite(with_bad).all(0) if not all_bands else np.isfinite(with_bad).any(0)
    assert not np.isnan(a.probability[finite]).any() and (a.classes[finite] < 3).all()
    if all_bands:  # no band holds data there: the pixel is nodata in the map, as a nodata pixel is
        assert a.classes[5, 7] == b.classes[5, 7] == a.nodata == 255 and np.isnan(a.probability[5, 7])
    za, zb = F.embed(bad_path, model, settings, precision="32-true"), F.embed(nodata_path, model, settings,
                                                                              precision="32-true")
    assert np.isfinite(za["embeddings"]).all()
    np.testing.assert_allclose(za["embeddings"], zb["embeddings"], rtol=0, atol=1e-4)


def test_the_masked_pixel_is_left_out_of_the_statistics_and_fed_as_the_band_mean(model, tmp_path):
    """Independent of predict: per-band statistics over the finite pixels, the masked pixel set
    to the band mean (0 once normalised), the first tile through the model."""
    data = _clean()
    data[:, 5, 7] = np.nan
    path = _write(tmp_path / "nan.tif", data)
    result = F.predict(path, model, F.inference_settings(model), precision="32-true")
    flat = data.reshape(3, -1).astype(np.float64)
    mean, std = np.nanmean(flat, 1)[:, None, None], np.nanstd(flat, 1)[:, None, None]
    x = np.nan_to_num((data - mean) / std, nan=0.0).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x[None, :, :32, :32])).softmax(-1)[0].numpy()
    np.testing.assert_allclose(result.tile_probabilities[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["nan", "nodata"])
def test_a_scene_without_any_data_is_an_error_naming_the_file(model, model_dir, tmp_path, capsys, kind):
    if kind == "nan":
        path = _write(tmp_path / "empty.tif", np.full((3, 40, 40), np.nan, np.float32))
    else:
        path = _write(tmp_path / "empty.tif", np.zeros((3, 40, 40), np.uint16), nodata=0)
    given = F.InferenceSettings(bands=RGB, stats=S.BandStats([1000.0] * 3, [300.0] * 3))
    for settings in (F.inference_settings(model), given):  # the scene's own statistics, or the run's
        for apply in (F.predict, F.embed):
            with pytest.raises(S.SatelliteDataError, match=re.escape(str(path))):
                apply(path, model, settings, precision="32-true")
    out = tmp_path / "never.tif"
    capsys.readouterr()
    assert main(["predict", "explora", "--model", str(model_dir), "--input", str(path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    why = "not finite (NaN/inf)" if kind == "nan" else "nodata (0.0)"
    assert f"error: {path}:" in err and why in err and not out.exists(), err
    # data only in the strip that edge="drop" leaves uncovered: no tile to classify
    strip = np.zeros((3, 40, 40), np.float32) if kind == "nodata" else np.full((3, 40, 40), np.nan, np.float32)
    strip[:, 35:] = 900.0
    strip_path = _write(tmp_path / "strip.tif", strip, nodata=0 if kind == "nodata" else None)
    with pytest.raises(S.SatelliteDataError, match=re.escape(f"{strip_path}: no 32 x 32 tile (edge='drop') covers")):
        F.predict(strip_path, model, F.inference_settings(model), edge="drop")


def test_a_scene_smaller_than_one_tile_is_an_error_naming_the_file(model_dir, tmp_path, capsys):
    path = _write(tmp_path / "one_pixel.tif", np.full((3, 1, 1), 900, np.uint16))
    for command in ("predict", "embed"):
        out = tmp_path / ("never.tif" if command == "predict" else "never.npz")
        capsys.readouterr()
        assert main([command, "explora", "--model", str(model_dir), "--input", str(path), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: {path}:" in err and "1 x 1" in err and "32" in err and not out.exists(), err


def test_a_raster_too_large_to_read_is_refused_before_reading_it(model_dir, tmp_path, capsys):
    huge = tmp_path / "huge.tif"
    with rasterio.open(huge, "w", driver="GTiff", width=100000, height=100000, count=3, dtype="uint8", tiled=True,
                       sparse_ok=True, crs="EPSG:32618", transform=TRANSFORM):
        pass  # no pixel written: a few MB on disk that claim 27.9 GiB
    assert huge.stat().st_size < 16 * 2**20
    out = tmp_path / "never.tif"
    assert main(["predict", "explora", "--model", str(model_dir), "--input", str(huge), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {huge}:" in err and "27.9 GiB" in err and "2.0 GiB" in err and S.MAX_RASTER_BYTES_ENV in err
    assert not out.exists()


@pytest.mark.parametrize("unwritable", ["plot_under_a_file", "plot_is_a_folder", "probability_under_a_file",
                                        "plot_write_fails", "probability_write_fails"])
def test_an_unwritable_second_output_leaves_no_output_behind(model_dir, tmp_path, capsys, monkeypatch, unwritable):
    scene = _write(tmp_path / "scene.tif", np.full((3, 40, 40), 900, np.uint16))
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_folder.png").mkdir()  # a folder with the right extension: only its being a folder is wrong
    out, prob, png = tmp_path / "classes.tif", tmp_path / "prob.tif", tmp_path / "map.png"
    words = []
    if unwritable == "plot_under_a_file":
        png, words = tmp_path / "a_file" / "map.png", ["--plot", "a_file is a file"]
    elif unwritable == "plot_is_a_folder":
        png, words = tmp_path / "a_folder.png", ["--plot", "is a folder"]
    elif unwritable == "probability_under_a_file":
        prob, words = tmp_path / "a_file" / "prob.tif", ["--probability", "a_file is a file"]
    else:  # the disk fills up while the probability map or the picture is written, after the class map
        failing = ".map.png" if unwritable == "plot_write_fails" else ".prob.tif"
        real = layer.write

        def full_disk(value, path):  # the layer writes every output to a temporary named after its target
            if path.name.startswith(failing):
                raise OSError(28, "No space left on device", str(path))
            real(value, path)

        monkeypatch.setattr(layer, "write", full_disk)
        words = ["No space left on device"]
    argv = ["predict", "explora", "--model", str(model_dir), "--input", str(scene), "--output", str(out),
            "--probability", str(prob), "--plot", str(png)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("domainfm predict: error:") and len(err) == 2 and all(w in err[0] for w in words), err
    assert not out.exists() and not (tmp_path / "prob.tif").exists() and not (tmp_path / "map.png").exists()
    assert not [p for p in tmp_path.rglob(".*") if ".tmp-" in p.name]  # no temporary left either
    monkeypatch.undo()
    # the same command with writable paths writes all three
    ok = ["predict", "explora", "--model", str(model_dir), "--input", str(scene), "--output", str(out),
          "--probability", str(tmp_path / "prob.tif"), "--plot", str(tmp_path / "map.png")]
    assert main(ok) == 0 and out.is_file() and (tmp_path / "prob.tif").is_file() and (tmp_path / "map.png").is_file()
