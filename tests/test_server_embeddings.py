"""``POST /v1/embeddings`` with the real ``openai`` client (only ``base_url`` changed): the router's
embedder's vectors, batched, in both encodings the client uses."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from graftmem.memory.router import Router
from graftmem.server import api_server
from graftmem.store.local import Store


def test_embeddings_are_the_routers_vectors(smol, minilm, tmp_path):
    store = Store(tmp_path / "home")
    texts = ["How do I reset my password?", "The cat sat on the mat.", "Resetting a password: open settings."]
    with api_server(store, [smol], router=lambda: Router(minilm, store)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        batched = c.embeddings.create(model="any", input=texts)  # the client asks for base64 by default
        floats = c.embeddings.create(model="any", input=texts, encoding_format="float")
        one = c.embeddings.create(model="any", input=texts[0])
        assert [d.index for d in batched.data] == [0, 1, 2]
        got = np.array([d.embedding for d in batched.data], dtype=np.float32)
        assert got.shape == (3, minilm.dim)
        assert np.array_equal(got, np.array([d.embedding for d in floats.data], dtype=np.float32))
        # a text's vector does not depend on its batch-mates (a vector store embeds documents in batches
        # and queries alone)
        assert np.array_equal(got[0], np.array(one.data[0].embedding, dtype=np.float32))
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        want = np.concatenate([minilm.embed_batch([t]) for t in texts])
        assert np.allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-6)
        sims = got @ got.T
        assert sims[0, 2] > sims[0, 1]  # the two texts about passwords are the nearest pair
        assert batched.model == minilm.model_id
        assert batched.usage.prompt_tokens == minilm.count_tokens(texts) > 0
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input=[])
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input=[[1, 2, 3]])
        with pytest.raises(openai.BadRequestError):
            c.embeddings.create(model="any", input="x", dimensions=8)


def test_a_server_without_a_router_says_so(smol, tmp_path):
    with api_server(Store(tmp_path / "home"), [smol]) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as exc:
            c.embeddings.create(model="any", input="hello")
        assert exc.value.code == "embeddings_unavailable"
