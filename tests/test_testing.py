"""graftmem.testing.HashEmbedder: deterministic (across processes), close for shared words, no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from graftmem.memory.router import Embedder
from graftmem.testing import HashEmbedder


def test_rows_are_normalized_and_close_only_when_words_are_shared():
    e = HashEmbedder()
    assert isinstance(e, Embedder)
    v = e.embed_batch(["open a support ticket", "open a ticket", "write the date as YYYY-MM-DD", ""])
    assert v.shape == (4, 256) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[:3], axis=1), 1.0) and not v[3].any()  # no words: the zero row
    assert v[0] @ v[1] > 0.5 > abs(float(v[0] @ v[2]))
    assert e.count_tokens(["open a ticket", "YYYY-MM-DD"]) == 6
    with pytest.raises(ValueError):
        HashEmbedder(dim=4)


def test_same_vectors_in_another_process():
    """BLAKE2, not Python's salted hash(): an index built in one process is valid in the next."""
    here = HashEmbedder(dim=64).embed_batch(["refund order NW-20417 within 30 days"])[0]
    code = ("from graftmem.testing import HashEmbedder; import sys; "
            "sys.stdout.write(HashEmbedder(dim=64).embed_batch(['refund order NW-20417 within 30 days'])[0].tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, timeout=120).stdout
    assert bytes.fromhex(out) == here.tobytes()
    assert HashEmbedder(dim=64).model_id != HashEmbedder(dim=128).model_id  # an index records which


def test_a_router_over_it_routes_by_shared_words_without_torch():
    code = ("import sys; from graftmem.memory.router import Router; from graftmem.testing import HashEmbedder\n"
            "e = HashEmbedder(); r = Router(e)\n"
            "texts = {'refunds': 'refund an order: ask for the order number', 'dates': 'write a calendar date as YYYY-MM-DD'}\n"
            "r.add_vectors(list(texts), e.embed_batch(list(texts.values())), digests=['fp', 'fp'])\n"
            "print(r.search('please refund my order', 1, fingerprint_digest='fp')[0][0])\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["refunds", "False"]
