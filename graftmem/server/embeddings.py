"""``POST /v1/embeddings``: OpenAI's embeddings API from the router's embedder.

What mem0, LlamaIndex and LangChain's ``OpenAIEmbeddings`` call. The vectors come from the embedder
the server routes with (the packaged all-MiniLM-L6-v2 by default, 384 dimensions, unit length), so
an application that stores its own vectors and the server's router agree on one space; the
response's ``model`` names that embedder (its ``model_id``), whatever model the request named. The
router (and torch) loads on the first request that needs it, as for routed recall; a server started
without a router answers 400 ``embeddings_unavailable``.

Supported: ``input`` as a string or a list of up to ``Limits.max_embedding_inputs`` (2,048) non-empty
strings of ``Limits.max_embedding_chars`` characters in all (token-id arrays are refused: the ids would be
the chat model's, not the embedder's), ``encoding_format`` ``float`` or
``base64`` (little-endian float32, what the ``openai`` package asks for by default), ``dimensions``
only when it equals the embedder's (400 otherwise: these vectors are not truncatable), ``model`` and
``user`` accepted and not used. Each text is embedded on its own (see `EmbeddingRoutes.embeddings`),
so its vector does not depend on the rest of the batch. ``usage.prompt_tokens`` counts the embedder's word pieces when the
embedder can count them (``count_tokens``), else 0.

An embeddings request is admitted as a chat request is (`EnginePool.on_engine`): it computes on an
engine's thread while it holds that engine, waits in the same queue, and gets the same 429 when the
queue is full; a client that goes away stops it at its next text. One request of 2,048 long texts was
measured at about 108 CPU-seconds, computed beside the engines' work rather than queued with it, and on
after its client had left; its characters are bounded now (one full 256-word-piece text costs about
40 ms of one core here, so the default bounds a request to roughly 10 s). It runs in slices of
`EMBED_SLICE_CHARS` (4 Ki) characters, each a turn on an engine that yields to any chat request waiting
(background work, `EnginePool.acquire`): `bench/hostile.py` measured 4 clients flooding embeddings
beside 8 chat agents at 11.5x the agents' p95 time to first token when a request held the engine whole.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import anyio.to_thread
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..memory import validate as check
from ..memory.router import embedder_id
from .http import HTTPError, Limits, client_gone, guarded

if TYPE_CHECKING:
    from .pipeline import ChatPipeline

__all__ = ["EmbeddingRoutes"]

log = logging.getLogger("graftmem")


#: Characters of texts one embeddings request embeds per turn on an engine (a quarter of a second or
#: so of one core here) before it lets a waiting request have the engine (`EnginePool.acquire(background=True)`).
EMBED_SLICE_CHARS = 4 << 10


def _on_engine(embed: Callable[[list[str]], bool], chunk: list[str], _engine: Any) -> bool:
    return embed(chunk)


def _slices(texts: list[str], max_chars: int) -> list[list[str]]:
    """``texts`` in consecutive slices of at most ``max_chars`` characters (a longer text alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for t in texts:
        if out[-1] and size + len(t) > max_chars:
            out.append([])
            size = 0
        out[-1].append(t)
        size += len(t)
    return out


def _inputs(body: dict[str, Any], limits: Limits) -> list[str]:
    raw = body.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    most = limits.max_embedding_inputs
    if not isinstance(texts, list) or not texts or len(texts) > most:
        got = f", got {len(texts)}" if isinstance(texts, list) and texts else ""
        raise HTTPError(400, f"input must be a non-empty string or a list of 1 to {most} of them{got} (this "
                             "server's max_embedding_inputs): send fewer texts per request", param="input")
    chars = 0
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise HTTPError(400, f"input[{i}] must be a string (token ids are not accepted: this embedder has "
                            "its own tokenizer)", param="input")
        if not t:
            raise HTTPError(400, f"input[{i}] is empty", param="input")
        chars += len(t)
        if chars > limits.max_embedding_chars:
            raise HTTPError(400, f"input has more than {limits.max_embedding_chars} characters in all (this "
                                 "server's max_embedding_chars): send fewer or shorter texts per request",
                            param="input")
        check.text(f"input[{i}]", t)
    return texts


class EmbeddingRoutes:
    """``/v1/embeddings`` over the router the chat pipeline holds (`ChatPipeline`: its body limits and parsing too)."""

    def __init__(self, pipe: "ChatPipeline") -> None:
        self.pipe = pipe

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/embeddings", guarded(self.embeddings, str(self.pipe.store.home)), methods=["POST"])]

    async def embeddings(self, request: Request) -> Response:
        body = await self.pipe.read_json(request)
        texts = _inputs(body, self.pipe.limits)
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise HTTPError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format")
        if not self.pipe.router.available:
            raise HTTPError(400, "this server was started without a router: it has no embedder",
                            param="model", code="embeddings_unavailable")
        ref = self.pipe.router
        cancel = threading.Event()

        rows: list[np.ndarray] = []

        def embed(chunk: list[str]) -> bool:
            embedder = ref.get().embedder
            # one text per call: in a batch the packaged int8 model quantizes its activations with one
            # scale for the whole padded batch, so a text's vector would depend on its batch-mates
            # (measured: cosine moves by about 1e-2); a vector store embeds documents in batches and
            # queries alone, and both must land on the same point
            for t in chunk:
                if cancel.is_set():  # the client went away: nobody reads the rest
                    log.info("serve: an embeddings request was cancelled (its client went away) after %d of "
                             "%d text(s)", len(rows), len(texts))
                    return False
                rows.append(np.asarray(embedder.embed_batch([t]), dtype=np.float32).reshape(1, -1))
            return True

        # torch computes on an engine's thread while the request holds that engine: queued (429 when the
        # queue is full) with the engines' work, never beside it; in slices of `EMBED_SLICE_CHARS` that
        # yield to any request waiting (background work): an embeddings flood once held the one engine
        # for seconds per request and made honest chat turns wait behind a queue of them
        # the router (torch, MiniLM) loads on the first request that needs it: not on the engine's turn,
        # which chat requests would wait out (the first embeddings request held the one engine ~10 s)
        await anyio.to_thread.run_sync(ref.get)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            ok = True
            for i, chunk in enumerate(_slices(texts, EMBED_SLICE_CHARS)):
                ok = await self.pipe.pool.on_engine(functools.partial(_on_engine, embed, chunk), gone, cancel,
                                                  background=True, admitted=i > 0)
                if not ok:
                    break
        finally:
            gone.cancel()
        done: Optional[tuple[np.ndarray, int, str]] = None
        if ok:
            embedder = ref.get().embedder
            vecs: np.ndarray = np.concatenate(rows)
            norms = np.linalg.norm(vecs, axis=1, keepdims=True)
            vecs = vecs / np.where(norms > 0, norms, 1.0)  # unit length, as OpenAI's (the Embedder contract does not promise it)
            count = getattr(embedder, "count_tokens", None)
            done = vecs.astype("<f4"), int(count(texts)) if callable(count) else 0, embedder_id(embedder)
        if done is None:
            return Response(status_code=499)
        vecs, tokens, model = done
        dims: Optional[int] = body.get("dimensions")
        if dims is not None and dims != vecs.shape[1]:
            raise HTTPError(400, f"dimensions must be {vecs.shape[1]} (this embedder's) or left out, got {dims!r}",
                            param="dimensions")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()}
                for i, v in enumerate(vecs)]
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
