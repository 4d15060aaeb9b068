"""ExPLoRA through the shared apply layer: ``domainfm.predict`` / ``domainfm.embed`` on the shipped
Sentinel-2 scene give what the family's own functions and the CLI give, and ``--help`` of each
command lists the family's options (``--probability`` and ``--plot`` for predict only)."""
import numpy as np
import pytest
import rasterio
import torch

import domainfm
from domainfm import create_model, save_pretrained
from domainfm.cli import main
from domainfm.data_loaders import satellite as S
from domainfm.experiment import apply
from domainfm.finetune import explora as F

SCENE = S.sample_scene_path()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    # average pooling: untrained, its tiles already fall into all three classes (the class token does not)
    model = create_model("explora-test", n_outputs=3, global_pool="avg").eval()
    return model, save_pretrained(model, tmp_path_factory.mktemp("saved") / "tiny")


def test_domainfm_predict_is_the_family_predict_and_the_cli_class_map(saved, tmp_path):
    model, folder = saved
    # family= : apply.family_of_model does not yet read a model folder's config.json key "model_name"
    got = domainfm.predict(folder, SCENE, family="explora", precision="32-true", stride=16)
    ref = F.predict(SCENE, model, F.inference_settings(model), precision="32-true", stride=16)
    assert isinstance(got, F.ClassMap) and isinstance(got, apply.Raster)
    assert got.origins == ref.origins == S.tile_origins(323, 321, 32, 16)
    np.testing.assert_allclose(got.tile_probabilities, ref.tile_probabilities, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got.classes, ref.classes)
    assert len(np.unique(got.tile_classes)) == 3  # a map, not a constant
    assert domainfm.predict(model, SCENE, precision="32-true", stride=16).origins == got.origins  # a module: its card
    out = tmp_path / "classes.tif"
    assert main(["predict", "explora", "--model", str(folder), "--input", str(SCENE), "--output", str(out),
                 "--precision", "32-true", "--stride", "16"]) == 0
    with rasterio.open(out) as dst, rasterio.open(SCENE) as src:
        assert (dst.crs, dst.transform, dst.nodata) == (src.crs, src.transform, got.nodata)
        np.testing.assert_array_equal(dst.read(1), got.classes)


def test_domainfm_embed_is_the_cli_npz(saved, tmp_path):
    model, folder = saved
    got = domainfm.embed(folder, SCENE, family="explora", precision="32-true", edge="drop")
    out = tmp_path / "tiles.npz"
    assert main(["embed", "explora", "--model", str(folder), "--input", str(SCENE), "--output", str(out),
                 "--precision", "32-true", "--edge", "drop"]) == 0
    cli = np.load(out)
    assert set(cli.files) == set(got)
    assert got["embeddings"].shape == (10 * 10, model.num_features)
    np.testing.assert_allclose(cli["embeddings"], got["embeddings"], rtol=0, atol=1e-5)
    for key in set(got) - {"embeddings"}:
        np.testing.assert_array_equal(cli[key], got[key], err_msg=key)
    # independently: the first tile's pooled features, normalised by the scene's own statistics
    with rasterio.open(SCENE) as ds:
        names = list(ds.descriptions)
        pixels = ds.read([names.index(b) + 1 for b in ("B04", "B03", "B02")]).astype(np.float64)
    x = (pixels - pixels.mean((1, 2), keepdims=True)) / pixels.std((1, 2), keepdims=True)
    with torch.no_grad():
        first = model.forward_head(model.forward_features(torch.from_numpy(x[None, :, :32, :32]).float()),
                                   pre_logits=True)[0].numpy()
    np.testing.assert_allclose(got["embeddings"][0], first, rtol=0, atol=1e-4)


@pytest.mark.parametrize("command, listed, absent", [
    ("predict", ["--stride", "--tile-size", "--edge", "--probability", "--plot"], []),
    ("embed", ["--stride", "--tile-size", "--edge"], ["--probability", "--plot"]),
])
def test_help_lists_the_family_options(capsys, command, listed, absent):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "explora", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"domainfm {command} explora" in out and all(flag in out for flag in listed), out
    assert not any(flag in out for flag in absent), out
