"""ExPLoRA predict / embed on the shipped Sentinel-2 scene, through the CLI, with a tiny fine-tuned
run: the class-map GeoTIFF keeps the scene's CRS, transform and size; its classes are those of an
independent per-tile forward pass (bands picked by name, the run's statistics, the training
resize); embeddings are the model's pooled features with each tile's bounds; a scene with other
bands or another dtype is a one-line error (exit 2) that leaves no file; bf16 stays within the
documented tolerance of fp32; the run's retained capability equals an independent k-NN; the
class-map picture is a non-blank PNG."""
import json

import numpy as np
import pytest
import rasterio
import torch
import torch.nn.functional as TF

from domainfm import create_model
from domainfm.cli import main
from domainfm.data_loaders import satellite as S
from domainfm.finetune import explora as F

SCENE = S.sample_scene_path()
TINY = ["stages=[]", "arms=[random]", "train.max_epochs=1", "train.max_steps=4", "train.batch_size=64",
        "train.warmup_ratio=0.0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    assert main(["finetune", "--runs-dir", str(root), "--name", "tiny", "explora", *TINY]) == 0
    return root / "explora" / "tiny"


def _reference_tiles(run, origins, ts=12, size=32):
    """Independent per-tile forward pass in fp32: bands by their descriptions, the run's recorded
    statistics, the same antialiased bilinear resize as training, the arm's saved model."""
    report = json.loads((run / "report.json").read_text())
    stats = report["data"]["band_stats"]
    with rasterio.open(SCENE) as ds:
        names = list(ds.descriptions)
        pixels = ds.read([names.index(b) + 1 for b in ("B04", "B03", "B02")]).astype(np.float32)
    mean, std = np.array(stats["mean"])[:, None, None], np.array(stats["std"])[:, None, None]
    image = torch.from_numpy((pixels - mean) / std).float()
    x = torch.stack([image[:, r:r + ts, c:c + ts] for r, c in origins])
    x = TF.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    model = create_model(run / "random" / "model").eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        return model.forward_head(feats).softmax(-1), model.forward_head(feats, pre_logits=True), model


def test_predict_cli_writes_a_georeferenced_class_map_equal_to_per_tile_predictions(run, tmp_path):
    out, prob, png = tmp_path / "classmap.tif", tmp_path / "p.tif", tmp_path / "map.png"
    assert main(["predict", "explora", "--model", str(run), "--input", str(SCENE), "--output", str(out),
                 "--precision", "32-true", "--probability", str(prob), "--plot", str(png)]) == 0
    with rasterio.open(SCENE) as src, rasterio.open(out) as dst:
        assert (dst.crs, dst.transform, dst.width, dst.height) == (src.crs, src.transform, src.width, src.height)
        assert dst.count == 1 and dst.dtypes[0] == "uint8" and dst.nodata == 255
        assert json.loads(dst.tags()["classes"]) == list(S.INDEX_CLASSES)
        classes = dst.read(1)
    with rasterio.open(prob) as p:
        probability = p.read(1)
    # 323 x 321 px in 12-px tiles: 26 x 26 full tiles + a last row/column flush with the edge
    origins = S.tile_origins(323, 321, 12)
    assert len(origins) == 27 * 27 and origins[-1] == (311, 309)
    probs, _, _ = _reference_tiles(run, origins)
    expected = probs.argmax(-1).numpy()
    assert (classes != 255).all()  # every pixel is covered
    # each pixel belongs to the covering tile whose centre is nearest, along rows and columns
    starts_r, starts_c = sorted({r for r, _ in origins}), sorted({c for _, c in origins})

    def owner(y, starts):
        covering = [s for s in starts if s <= y < s + 12]
        return min(covering, key=lambda s: (abs(y - (s + 5.5)), s))

    index = {o: i for i, o in enumerate(origins)}
    rows, cols = [owner(y, starts_r) for y in range(323)], [owner(x, starts_c) for x in range(321)]
    own = np.array([[index[(r, c)] for c in cols] for r in rows])
    np.testing.assert_array_equal(classes, expected[own])
    np.testing.assert_allclose(probability, probs.max(-1).values.numpy()[own], rtol=0, atol=1e-5)
    # a regular tile away from the edge owns its whole footprint; the last ones own the strip the grid leaves
    assert (own[:300, :300] == np.array([[index[(r - r % 12, c - c % 12)] for c in range(300)] for r in range(300)])).all()
    assert own[322, 320] == len(origins) - 1 and (own[312:, 312:] == len(origins) - 1).all()
    assert len(np.unique(expected)) > 1  # a map, not a constant
    _assert_picture(png)


def test_embed_cli_gives_pooled_features_with_tile_bounds(run, tmp_path):
    out = tmp_path / "tiles.npz"
    assert main(["embed", "explora", "--model", str(run), "--input", str(SCENE), "--output", str(out),
                 "--precision", "32-true", "--stride", "9", "--edge", "drop"]) == 0
    z = np.load(out)
    origins = S.tile_origins(323, 321, 12, 9, edge="drop")  # overlapping tiles
    _, pooled, model = _reference_tiles(run, origins)
    assert z["embeddings"].shape == (len(origins), model.num_features) == (len(origins), 48)
    np.testing.assert_allclose(z["embeddings"], pooled.numpy(), rtol=0, atol=1e-4)
    assert [tuple(o) for o in np.stack([z["row"], z["col"]], 1)] == origins
    assert z["tile_row"].max() == (323 - 12) // 9 and z["tile_col"].max() == (321 - 12) // 9
    with rasterio.open(SCENE) as src:
        left, top = src.transform.c, src.transform.f
        assert str(z["crs"]) == src.crs.to_wkt() and tuple(z["transform"]) == tuple(src.transform)[:6]
    r, c = origins[-1]
    np.testing.assert_allclose(z["bounds"][-1], [left + 60 * c, top - 60 * (r + 12), left + 60 * (c + 12), top - 60 * r])


def test_a_scene_with_other_bands_or_dtype_is_a_one_line_error(run, tmp_path, capsys):
    transform = rasterio.transform.from_origin(435730, 4179460, 60, 60)
    two = S.write_geotiff(tmp_path / "two.tif", np.ones((2, 40, 40), np.uint16) * 900, transform=transform,
                          crs="EPSG:32618", band_names=["B02", "B03"])
    as_float = S.write_geotiff(tmp_path / "float.tif", np.ones((3, 40, 40), np.float32), transform=transform,
                               crs="EPSG:32618", band_names=["B04", "B03", "B02"])
    for bad, words in ((two, ["has 2 bands ['B02', 'B03']", "expects 3 bands ['B04', 'B03', 'B02']", "['B04']"]),
                       (as_float, ["pixels are float32", "trained on uint16"])):
        out = tmp_path / "never.tif"
        capsys.readouterr()
        assert main(["predict", "explora", "--model", str(run), "--input", str(bad), "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith(f"domainfm predict: error: {bad}:") and all(w in err[0] for w in words), err
        assert len(err) == 2 and "--debug" in err[1]
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(S.SatelliteDataError, match="missing"):
        main(["--debug", "predict", "explora", "--model", str(run), "--input", str(two), "--output", str(out)])
    # a file without band descriptions is taken in the model's order when the count matches
    plain = S.write_geotiff(tmp_path / "plain.tif", np.full((3, 24, 24), 900, np.uint16), transform=transform,
                            crs="EPSG:32618")
    assert main(["predict", "explora", "--model", str(run), "--input", str(plain), "--output", str(out)]) == 0


def test_bf16_stays_within_the_documented_tolerance_of_fp32(run):
    model = create_model(run / "random" / "model").eval()
    settings = F.inference_settings(model, run)
    fp32 = F.predict(SCENE, model, settings, precision="32-true")
    bf16 = F.predict(SCENE, model, settings, precision="bf16-mixed")
    assert (fp32.precision, bf16.precision) == ("32-true", "bf16-mixed")
    diff = np.abs(fp32.tile_probabilities - bf16.tile_probabilities).max()
    agree = (fp32.tile_classes == bf16.tile_classes).mean()
    assert 0 < diff <= 0.05 and agree >= 0.97, (diff, agree)  # bf16 really ran, and stays close


def test_card_settings_tile_at_the_model_input_size_with_the_scene_statistics(tmp_path):
    from domainfm import save_pretrained

    torch.manual_seed(0)
    model = create_model("explora-test", n_outputs=3)
    folder = save_pretrained(model, tmp_path / "saved")
    out = tmp_path / "cm.tif"
    assert main(["predict", "explora", "--model", str(folder), "--input", str(SCENE), "--output", str(out),
                 "--precision", "32-true", "--edge", "drop"]) == 0
    settings = F.inference_settings(create_model(folder), folder)
    assert settings.origin == "card" and settings.tile_size == settings.img_size == 32 and settings.stats is None
    assert settings.bands == ["red", "green", "blue"] and settings.classes == ["0", "1", "2"]
    with rasterio.open(SCENE) as ds:
        names = list(ds.descriptions)
        pixels = ds.read([names.index(b) + 1 for b in ("B04", "B03", "B02")]).astype(np.float64)
    mean, std = pixels.mean((1, 2), keepdims=True), pixels.std((1, 2), keepdims=True)
    x = torch.from_numpy((pixels - mean) / std).float()[None, :, 32:64, 64:96]
    with torch.no_grad():
        expected = int(model.eval()(x).argmax())
    with rasterio.open(out) as dst:
        assert (dst.width, dst.height) == (321, 323)
        classes = dst.read(1)
    assert (classes[32:64, 64:96] == expected).all()
    # 32-px tiles from 0 to 288: the last 3 rows and the last column are not covered -> nodata
    assert (classes[320:] == 255).all() and (classes[:, 320] == 255).all() and (classes[:320, :320] < 3).all()


def test_retained_capability_is_in_the_report_and_equals_an_independent_knn(run):
    from domainfm import config as cfgmod

    report = json.loads((run / "report.json").read_text())
    assert report["retained_capability"]["metric"] == "knn_accuracy"
    assert "CONSTRUCTED" in report["retained_capability"]["description"]
    before, after = report["retained_before"], report["arms"]["random"]["retained"]
    assert set(before) == set(after) == {"knn_texture", "knn_moisture", "knn_accuracy", "n_tiles"}
    # the retained tiles are neither training nor validation tiles
    assert report["data"]["n_train"] + report["data"]["n_val"] + before["n_tiles"] == 26 * 26
    cfg = cfgmod.from_dict(F.Config, cfgmod.load_yaml(run / "config.yaml"))
    held = F.build_task(cfg).extras["retained"]
    model = create_model(run / "random" / "model").eval()
    with torch.no_grad():
        z = model.forward_head(model.forward_features(held["images"]), pre_logits=True).numpy()
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    accs = {}
    for name, y in held["labels"].items():
        assert np.bincount(y).min() >= len(y) // 3 - 1  # terciles: three balanced classes
        per_fold = []
        for k in (0, 1):
            fit, score = held["folds"] != k, held["folds"] == k
            nearest = np.argsort(-(z[score] @ z[fit].T), axis=1)[:, :5]
            votes = y[fit][nearest]
            pred = np.array([np.bincount(v, minlength=3).argmax() for v in votes])
            per_fold.append((pred == y[score]).mean())
        accs[name] = np.mean(per_fold)
    assert after["knn_texture"] == pytest.approx(accs["texture"], abs=1e-9)
    assert after["knn_moisture"] == pytest.approx(accs["moisture"], abs=1e-9)
    assert after["knn_accuracy"] == pytest.approx((accs["texture"] + accs["moisture"]) / 2)
    assert 1 / 3 < after["knn_accuracy"] <= 1


def test_the_run_draws_its_class_map_beside_the_scene(run):
    report = json.loads((run / "report.json").read_text())
    rel = report["arms"]["random"]["pictures"]["class_map"]
    assert rel == "random/class_map.png"
    _assert_picture(run / rel)


def _assert_picture(path):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05 and len(np.unique((rgb * 255).astype(np.uint8), axis=0)) > 50  # not blank


def test_a_jp2_scene_gives_the_class_map_of_the_same_pixels_as_geotiff(run, tmp_path):
    """JPEG2000 (lossless, bands without descriptions, taken in the model's order) and GeoTIFF
    of the same pixels give the same map, each with its own georeferencing."""
    from rasterio.transform import from_origin
    from rasterio.windows import Window

    with rasterio.open(SCENE) as src:
        names = list(src.descriptions)
        window = Window(100, 40, 60, 50)
        pixels = src.read([names.index(b) + 1 for b in ("B04", "B03", "B02")], window=window)
        transform = src.window_transform(window)
    jp2 = tmp_path / "crop.jp2"
    with rasterio.open(jp2, "w", driver="JP2OpenJPEG", width=60, height=50, count=3, dtype="uint16",
                       crs="EPSG:32618", transform=transform, REVERSIBLE="YES", QUALITY="100") as dst:
        dst.write(pixels)
    assert np.array_equal(S.read_raster(jp2).data, pixels)  # lossless: the same pixels
    tif = S.write_geotiff(tmp_path / "crop.tif", pixels, transform=transform, crs="EPSG:32618",
                          band_names=["B04", "B03", "B02"])
    maps = []
    for scene in (jp2, tif):
        out = tmp_path / f"{scene.suffix[1:]}_classes.tif"
        assert main(["predict", "explora", "--model", str(run), "--input", str(scene), "--output", str(out),
                     "--precision", "32-true"]) == 0
        with rasterio.open(out) as dst:
            assert (dst.width, dst.height, dst.transform) == (60, 50, transform)
            maps.append(dst.read(1))
    np.testing.assert_array_equal(maps[0], maps[1])
    assert transform != from_origin(435730, 4179460, 60, 60)  # the crop's own origin, not the scene's
