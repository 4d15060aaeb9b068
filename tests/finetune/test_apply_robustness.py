"""predict / embed refuse bad input in one line, before any model is loaded or run: SToFM slices with
duplicated ``obs_names`` or that are not AnnData, an output of the wrong kind, a headless model
asked for predictions (SToFM and GIT), and a ``key_added`` that would overwrite the coordinates.

Everything runs on tiny saved models (``stofm-test``, ``git-test``) and a 70-cell cut of the
shipped tissue with precomputed cell embeddings, so no cell encoder and no fine-tuning run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import domainfm
from domainfm.cli import main
from domainfm.data_loaders import spatial as S
from domainfm.errors import InputError
from domainfm.finetune import stofm as FS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Saved models (SToFM with and without a head, a headless GIT) and slices."""
    from torch_geometric.data import Data

    root = tmp_path_factory.mktemp("apply")
    domainfm.save_pretrained(domainfm.create_model("stofm-test", n_outputs=None), root / "stofm_headless")
    domainfm.save_pretrained(domainfm.create_model("stofm-test", n_outputs=4), root / "stofm_head")
    domainfm.save_pretrained(domainfm.create_model("git-test", n_outputs=0), root / "git_headless")
    adata = S.demo_tissue()[::10].copy()
    adata.obsm["X_cells"] = np.random.default_rng(0).normal(size=(adata.n_obs, 256)).astype(np.float32)
    adata.write_h5ad(root / "slice.h5ad")
    dup = adata.copy()
    names = list(dup.obs_names)
    names[1], names[3] = names[0], names[2]
    dup.obs_names = names
    dup.write_h5ad(root / "dup.h5ad")
    whole = (root / "slice.h5ad").read_bytes()
    (root / "truncated.h5ad").write_bytes(whole[: len(whole) // 2])
    (root / "text.h5ad").write_text("not an AnnData file, just text\n")
    (root / "table.h5ad").write_text("cell,x,y\nc1,1.0,2.0\nc2,3.0,4.0\n")
    torch.save(Data(x=torch.randn(6, 16), edge_index=torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]])),
               root / "graph16.pt")
    return root, adata, names[0], names[2]


def _one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1].strip().startswith("(run again with --debug"), err
    return lines[0]


# ------------------------------------------------------------------------------ 1. duplicated obs_names


@pytest.mark.parametrize("command, model, output", [("embed", "stofm_headless", "cells.npz"),
                                                    ("embed", "stofm_headless", "cells.h5ad"),
                                                    ("predict", "stofm_head", "cells.csv")])
def test_duplicated_obs_names_are_refused_naming_file_field_and_names(files, tmp_path, capsys, command, model, output):
    root, _, first, second = files
    out = tmp_path / output
    line = _one_line_error(capsys, [command, "stofm", "--model", str(root / model), "--input", str(root / "dup.h5ad"),
                                    "--output", str(out), "--embedding-key", "X_cells"])
    assert "dup.h5ad" in line and "obs_names" in line and "obs_names_make_unique()" in line, line
    assert first in line and second in line, line
    assert not out.exists()


# ------------------------------------------------------------------------------ 2. not an AnnData file


@pytest.mark.parametrize("name", ["truncated.h5ad", "text.h5ad", "table.h5ad"])
def test_an_unreadable_h5ad_is_one_line_naming_the_file(files, tmp_path, capsys, name):
    root = files[0]
    out = tmp_path / "cells.npz"
    line = _one_line_error(capsys, ["embed", "stofm", "--model", str(root / "stofm_headless"), "--input",
                                    str(root / name), "--output", str(out), "--embedding-key", "X_cells"])
    assert str(root / name) in line and "not a readable AnnData .h5ad file" in line, line
    assert not out.exists()
    with pytest.raises(S.SpatialDataError, match="not a readable AnnData .h5ad file"):
        S.read_spatial(root / name)  # fine-tuning's reader says the same


# ------------------------------------------------------------------------------ 3. --output of the wrong kind


def test_embed_output_of_another_kind_is_refused_before_anything_is_read(tmp_path, capsys):
    # neither the model nor the input exists: the output is checked first, so its error is the one shown
    line = _one_line_error(capsys, ["embed", "stofm", "--model", str(tmp_path / "no_model"), "--input",
                                    str(tmp_path / "no_slice.h5ad"), "--output", str(tmp_path / "x.txt")])
    assert "--output" in line and "x.txt" in line and ".h5ad" in line and ".npz" in line, line
    with pytest.raises(InputError):
        main(["--debug", "embed", "stofm", "--model", "m", "--input", "i.h5ad", "--output", str(tmp_path / "x.txt")])


def test_stofm_predict_to_an_h5ad_is_refused_before_anything_is_read(tmp_path, capsys):
    # predict writes a table; an .h5ad path used to receive CSV text silently
    out = tmp_path / "cells.h5ad"
    line = _one_line_error(capsys, ["predict", "stofm", "--model", str(tmp_path / "no_model"), "--input",
                                    str(tmp_path / "no_slice.h5ad"), "--output", str(out)])
    assert "--output" in line and "cells.h5ad" in line and ".csv" in line and ".parquet" in line, line
    assert not out.exists()


# ------------------------------------------------------------------------------ 4. predict with a headless model


def test_stofm_predict_with_a_headless_model_says_use_embed(files, tmp_path, capsys):
    root = files[0]
    out = tmp_path / "cells.csv"
    model = root / "stofm_headless"
    line = _one_line_error(capsys, ["predict", "stofm", "--model", str(model), "--input", str(root / "slice.h5ad"),
                                    "--output", str(out), "--embedding-key", "X_cells"])
    assert str(model) in line and "head" in line and "fine-tuned" in line and "embed" in line, line
    assert not out.exists()


def test_git_predict_with_a_headless_model_says_use_embed(files, tmp_path, capsys):
    root = files[0]
    out = tmp_path / "nodes.csv"
    model = root / "git_headless"
    line = _one_line_error(capsys, ["predict", "git", "--model", str(model), "--input", str(root / "graph16.pt"),
                                    "--output", str(out), "--precision", "32-true"])
    assert str(model) in line and "head" in line and "fine-tuned" in line and "embed" in line, line
    assert not out.exists()
    # embed accepts the same model and graph
    assert main(["embed", "git", "--model", str(model), "--input", str(root / "graph16.pt"), "--output",
                 str(tmp_path / "e.npz"), "--precision", "32-true"]) == 0


# ------------------------------------------------------------------------------ 5. key_added over an input


@pytest.mark.parametrize("key", ["spatial", "X_cells"])
def test_embed_refuses_a_key_added_that_holds_its_input(files, key):
    adata = files[1].copy()
    before = {k: np.array(v, copy=True) for k, v in adata.obsm.items()}
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    with pytest.raises(InputError, match=f"key_added={key!r}"):
        FS.embed(adata, model, embedding_key="X_cells", key_added=key)
    with pytest.raises(InputError, match=f"key_added={key!r}"):
        FS.embed(adata, model, embedding_key="X_cells", key_added=key, overwrite=True)
    assert set(adata.obsm) == set(before)
    for k, v in before.items():
        np.testing.assert_array_equal(adata.obsm[k], v)


def test_embed_replaces_other_data_only_when_asked(files):
    adata = files[1].copy()
    adata.obsm["spatial_raw"] = np.asarray(adata.obsm["spatial"]) * 2  # coordinates not used by this call
    kept = adata.obsm["spatial_raw"].copy()
    model = domainfm.create_model("stofm-test", n_outputs=None).eval()
    with pytest.raises(InputError, match="key_added='spatial_raw'.*overwrite=True"):
        FS.embed(adata, model, embedding_key="X_cells", key_added="spatial_raw")
    np.testing.assert_array_equal(adata.obsm["spatial_raw"], kept)
    FS.embed(adata, model, embedding_key="X_cells", key_added="spatial_raw", overwrite=True)
    assert adata.obsm["spatial_raw"].shape == (adata.n_obs, model.num_features)
    # an embedding key (scanpy's X_ names) is replaced by a re-run, as sc.pp.pca replaces X_pca
    FS.embed(adata, model, embedding_key="X_cells")
    first = adata.obsm["X_stofm"].copy()
    FS.embed(adata, model, embedding_key="X_cells")
    np.testing.assert_allclose(adata.obsm["X_stofm"], first, rtol=1e-5, atol=1e-5)


def test_embed_cli_refuses_key_added_over_the_coordinates(files, tmp_path, capsys):
    root = files[0]
    out = tmp_path / "cells.h5ad"
    line = _one_line_error(capsys, ["embed", "stofm", "--model", str(root / "stofm_headless"), "--input",
                                    str(root / "slice.h5ad"), "--output", str(out), "--embedding-key", "X_cells",
                                    "--key-added", "spatial"])
    assert "--key-added" in line and "'spatial'" in line, line
    assert not out.exists()
