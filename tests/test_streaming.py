"""Prepared corpora (domainfm.streaming on LitData) and the engine's sampler over their chunks:
what went in is recorded, a failed or interrupted preparation is finished by running it again,
and the global order of samples depends on the seed only, never on the number of ranks."""
from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from domainfm import streaming
from domainfm.engine import ResumableSampler


def _rows(path: str, fail_on: str | None = None, calls: str | None = None):
    """A toy per-file conversion: every row of a .npy file is one sample."""
    if calls:
        with open(calls, "a") as fh:
            fh.write(Path(path).name + "\n")
    if fail_on and Path(path).name == fail_on and not Path(path).with_suffix(".fixed").exists():
        raise ValueError("bad header")
    x = np.load(path)
    return [{"x": x[i], "file": int(Path(path).stem), "row": i} for i in range(len(x))]


def _files(folder: Path, n: int = 7, rows: int = 5) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n):
        path = folder / f"{k}.npy"
        np.save(path, np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 100 * k)
        out.append(path)
    return out


def _prepare(files, out, **kw):
    kw.setdefault("num_workers", 1)
    kw.setdefault("files_per_part", 3)
    kw.setdefault("chunk_bytes", "200B")
    fn = kw.pop("fn", _rows)
    return streaming.prepare(files, fn, out, family="toy", settings=kw.pop("settings", {"rows": "all"}), **kw)


def test_a_prepared_corpus_holds_every_sample_and_records_what_went_in(tmp_path):
    files = _files(tmp_path / "in")
    manifest = _prepare(files, tmp_path / "corpus")
    assert manifest["samples"] == 35 and manifest["family"] == "toy" and manifest["settings"] == {"rows": "all"}
    assert [r["sha256"] for r in manifest["inputs"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    corpus = streaming.PreparedCorpus(tmp_path / "corpus", family="toy")
    assert len(corpus) == 35
    seen = {}
    for i in range(len(corpus)):
        item = corpus[i]
        seen[(int(item["file"]), int(item["row"]))] = np.asarray(item["x"])
    assert sorted(seen) == [(f, r) for f in range(7) for r in range(5)]
    for (f, r), x in seen.items():
        np.testing.assert_array_equal(x, np.arange(15, dtype=np.float32).reshape(5, 3)[r] + 100 * f)
    # the chunks tile the corpus, and each holds whole samples of consecutive indices
    blocks = corpus.blocks
    assert len(blocks) > 3 and blocks[0][0] == 0 and blocks[-1][1] == 35
    assert all(a1 == b0 for (_, b0), (a1, _) in zip(blocks, blocks[1:]))
    with pytest.raises(streaming.PrepareError, match="prepared for family 'toy', not 'eeg'"):
        streaming.PreparedCorpus(tmp_path / "corpus", family="eeg")


def test_preparing_again_keeps_a_finished_corpus_and_refuses_other_settings(tmp_path):
    files = _files(tmp_path / "in")
    first = _prepare(files, tmp_path / "corpus")
    assert _prepare(files, tmp_path / "corpus") == first
    with pytest.raises(streaming.PrepareError, match="other settings"):
        _prepare(files, tmp_path / "corpus", settings={"rows": "first"})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(streaming.PrepareError, match="not empty"):
        _prepare(files, tmp_path / "other")


def test_a_failed_file_is_named_and_running_again_converts_only_the_parts_not_done(tmp_path):
    files = _files(tmp_path / "in")
    calls = tmp_path / "calls.txt"
    fn = functools.partial(_rows, fail_on="4.npy", calls=str(calls))
    with pytest.raises(streaming.PrepareError, match=r"4\.npy: ValueError: bad header"):
        _prepare(files, tmp_path / "corpus", fn=fn)
    with pytest.raises(streaming.PrepareError, match="did not finish"):
        streaming.PreparedCorpus(tmp_path / "corpus")
    assert sorted(calls.read_text().split()) == [f"{k}.npy" for k in range(6)]  # parts 0 and 1 (failed)
    files[4].with_suffix(".fixed").write_text("")
    calls.unlink()
    manifest = _prepare(files, tmp_path / "corpus", fn=fn)
    assert sorted(calls.read_text().split()) == ["3.npy", "4.npy", "5.npy", "6.npy"]  # part 0 kept
    assert manifest["samples"] == 35 and len(streaming.PreparedCorpus(tmp_path / "corpus")) == 35


def test_a_folder_that_is_no_corpus_is_refused_with_the_command_that_makes_one(tmp_path):
    with pytest.raises(streaming.PrepareError, match="domainfm prepare FAMILY"):
        streaming.PreparedCorpus(tmp_path)


# --------------------------------------------------------------------------- the sampler over chunks


def _global_batches(blocks, length, world, batch, epoch=0, seed=3):
    """The samples of each global step, for ``world`` ranks of batch ``batch``."""
    shares = []
    for rank in range(world):
        sampler = ResumableSampler(length, num_replicas=world, rank=rank, seed=seed, blocks=blocks, window=2)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    steps = len(shares[0]) // batch
    return [sorted(i for share in shares for i in share[s * batch:(s + 1) * batch]) for s in range(steps)]


def test_chunked_order_is_a_permutation_drawn_window_by_window_and_the_same_for_any_world_size():
    blocks = [(0, 6), (6, 12), (12, 16), (16, 22), (22, 24), (24, 28), (28, 32)]
    sampler = ResumableSampler(32, seed=3, blocks=blocks, window=2)
    order = list(sampler)
    assert sorted(order) == list(range(32))
    # each run of 2 blocks is read before the next: the order is a concatenation of window sets
    block_of = {i: k for k, (a, b) in enumerate(blocks) for i in range(a, b)}
    windows, pos = [], 0
    while pos < 32:
        first = block_of[order[pos]]
        members = {first}
        span = [order[pos]]
        pos += 1
        while pos < 32 and (block_of[order[pos]] in members or len(members) < 2):
            members.add(block_of[order[pos]])
            span.append(order[pos])
            pos += 1
        windows.append(members)
        assert sorted(span) == sorted(i for k in members for i in range(*blocks[k]))
    assert len(windows) == 4
    sampler.set_epoch(1)
    assert list(sampler) != order  # a new order each epoch
    # one process with batch 8 and two with batch 4 take the same samples at every step
    assert _global_batches(blocks, 32, 1, 8) == _global_batches(blocks, 32, 2, 4) == _global_batches(blocks, 32, 4, 2)


def test_blocks_that_do_not_tile_the_dataset_are_refused():
    with pytest.raises(ValueError, match="must tile"):
        ResumableSampler(10, blocks=[(0, 4), (5, 10)])


# --------------------------------------------------------------------------- training from a corpus

sys.path.insert(0, str(Path(__file__).parent))
from _engine_toys import ClassifyRecipe, TinyNet  # noqa: E402


def _labelled(path: str):
    x = np.load(path)
    return [{"x": torch.from_numpy(x[i]), "y": int(x[i].sum() > 0)} for i in range(len(x))]


def test_the_engine_trains_from_a_corpus_exactly_as_from_the_same_samples_in_memory(tmp_path):
    from domainfm.engine import TrainConfig, Trainer

    g = np.random.default_rng(0)
    files = []
    for k in range(6):
        path = tmp_path / f"{k}.npy"
        np.save(path, g.standard_normal((16, 8)).astype(np.float32))
        files.append(path)
    streaming.prepare(files, _labelled, tmp_path / "corpus", family="toy", num_workers=1, files_per_part=2,
                      chunk_bytes="400B")
    corpus = streaming.PreparedCorpus(tmp_path / "corpus", transform=lambda d: (d["x"], torch.tensor(d["y"])))
    memory = [corpus[i] for i in range(len(corpus))]

    class Listed(torch.utils.data.Dataset):
        blocks = corpus.blocks

        def __len__(self):
            return len(memory)

        def __getitem__(self, i):
            return memory[i]

    weights = []
    for data in (corpus, Listed()):
        torch.manual_seed(0)
        model = TinyNet(dropout=0.0)
        cfg = TrainConfig(max_epochs=2, batch_size=16, lr=1e-2, progress=False, accelerator="cpu", precision="32-true")
        Trainer(cfg).fit(ClassifyRecipe(model, data))
        weights.append(model.state_dict())
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0, msg=key)
    assert json.loads((tmp_path / "corpus" / streaming.MANIFEST).read_text())["samples"] == 96


def test_input_folders_are_searched_by_the_end_of_each_name(tmp_path):
    for name in ("a.edf", "b.fif.gz", "c.EDF", "notes.txt", "sub/d.edf"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    found = streaming.iter_files([str(tmp_path)], (".edf", ".fif.gz"))
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["a.edf", "b.fif.gz", "c.EDF", "sub/d.edf"]
