"""``POST /v1/embeddings``: OpenAI's embeddings API from the router's embedder.

What mem0, LlamaIndex and LangChain's ``OpenAIEmbeddings`` call. The vectors come from the embedder
the server routes with (the packaged all-MiniLM-L6-v2 by default, 384 dimensions, unit length), so
an application that stores its own vectors and the server's router agree on one space; the
response's ``model`` names that embedder (its ``model_id``), whatever model the request named. The
router (and torch) loads on the first request that needs it, as for routed recall; a server started
without a router answers 400 ``embeddings_unavailable``.

Supported: ``input`` as a string or a list of up to `MAX_INPUTS` non-empty strings (token-id arrays
are refused: the ids would be the chat model's, not the embedder's), ``encoding_format`` ``float`` or
``base64`` (little-endian float32, what the ``openai`` package asks for by default), ``dimensions``
only when it equals the embedder's (400 otherwise: these vectors are not truncatable), ``model`` and
``user`` accepted and not used. Each text is embedded on its own (see `EmbeddingRoutes.embeddings`),
so its vector does not depend on the rest of the batch. ``usage.prompt_tokens`` counts the embedder's word pieces when the
embedder can count them (``count_tokens``), else 0.
"""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING, Any, Optional

import anyio.to_thread
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..memory import validate as check
from ..memory.router import embedder_id
from .http import HTTPError, guarded

if TYPE_CHECKING:
    from .openai import OpenAIRoutes

__all__ = ["EmbeddingRoutes", "MAX_INPUTS"]

log = logging.getLogger("graftmem")

#: inputs one request may embed (OpenAI's own limit is 2,048)
MAX_INPUTS = 2048


def _inputs(body: dict[str, Any]) -> list[str]:
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or len(texts) > MAX_INPUTS:
        raise HTTPError(400, f"input must be a non-empty string or a list of 1 to {MAX_INPUTS} of them",
                        param="input")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise HTTPError(400, f"input[{i}] must be a string (token ids are not accepted: this embedder has "
                            "its own tokenizer)", param="input")
        if not t:
            raise HTTPError(400, f"input[{i}] is empty", param="input")
        check.text(f"input[{i}]", t)
    return texts


class EmbeddingRoutes:
    """``/v1/embeddings`` over the router an `OpenAIRoutes` holds (its body limits and parsing too)."""

    def __init__(self, oa: "OpenAIRoutes") -> None:
        self.oa = oa

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/embeddings", guarded(self.embeddings, str(self.oa.store.home)), methods=["POST"])]

    async def embeddings(self, request: Request) -> Response:
        body = await self.oa._parse(request)
        texts = _inputs(body)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise HTTPError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
        if not self.oa.router.available:
            raise HTTPError(400, "this server was started without a router: it has no embedder",
                            param="model", code="embeddings_unavailable")
        ref = self.oa.router

        def embed() -> tuple[np.ndarray, int, str]:
            embedder = ref.get().embedder
            # one text per call: in a batch the packaged int8 model quantizes its activations with one
            # scale for the whole padded batch, so a text's vector would depend on its batch-mates
            # (measured: cosine moves by about 1e-2); a vector store embeds documents in batches and
            # queries alone, and both must land on the same point
            vecs = np.concatenate([np.asarray(embedder.embed_batch([t]), dtype=np.float32).reshape(1, -1)
                                   for t in texts])
            norms = np.linalg.norm(vecs, axis=1, keepdims=True)
            vecs = vecs / np.where(norms > 0, norms, 1.0)  # unit length, as OpenAI's (the Embedder contract does not promise it)
            count = getattr(embedder, "count_tokens", None)
            return vecs.astype("<f4"), int(count(texts)) if callable(count) else 0, embedder_id(embedder)

        vecs, tokens, model = await anyio.to_thread.run_sync(embed)  # torch: never on the event loop
        dims: Optional[int] = body.get("dimensions")
        if dims is not None and dims != vecs.shape[1]:
            raise HTTPError(400, f"dimensions must be {vecs.shape[1]} (this embedder's) or left out, got {dims!r}",
                            param="dimensions")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()}
                for i, v in enumerate(vecs)]
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
