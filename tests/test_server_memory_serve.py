"""Memory.serve(api=True): the OpenAI API and the memory's REST routes in the app's own process,
started in the background (the call returns at once with the URL), stopped by close()."""

from __future__ import annotations

import httpx
import openai

from graftmem import Memory


def test_memory_serve_api_in_the_background(tmp_path):
    with Memory("smollm2", home=tmp_path / "home", config={"probe": False}) as mem:
        block = mem.learn("Refunds take 14 days and need the receipt.", chat=True, name="refunds")
        srv = mem.serve(api=True).start()  # returns while the server runs in its thread
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            r = c.chat.completions.create(model="smollm2", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}])
            assert r.choices[0].message.content and r.usage.completion_tokens >= 1
            listed = httpx.get(srv.url + "/v1/memory/blocks").json()["blocks"]
            assert [b["id"] for b in listed] == [block.id]
            # the app keeps using its memory while the server runs (they take turns on the engine)
            assert mem.ask(block.id, "How long?", max_tokens=4).receipt.tokens_restored == block.n_tokens
        finally:
            srv.close()
        try:
            httpx.get(srv.url + "/v1/models", timeout=2)
            raise AssertionError("the server still answers after close()")
        except httpx.HTTPError:
            pass
