"""docs/errors.md is true: each row of its table is provoked here, for real, and the message a user
meets must contain the row's excerpt (and be of the row's type). A row without a provoker, or a provoker
without a row, fails too, so the table and the messages cannot drift apart.

The rows are cheap on purpose: the tiny Llama (tests/tiny.py) for everything that needs an engine,
in-process ASGI for the server's key check, one tmpfs for the read-only home."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from graftmem import Memory
from graftmem.core.engine import Engine

from .conftest import long_text

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "errors.md"


def table() -> list[dict[str, str]]:
    """The rows of docs/errors.md's table: id, error, message (the excerpt, without its backticks),
    cause, fix."""
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or cells[0] in ("id", "") or set(cells[0]) <= {"-", ":"}:
            continue
        rid, error, said, cause, fix = cells
        rows.append({"id": rid.strip("`"), "error": error.strip("`"), "said": said.strip("`").replace("\\|", "|"),
                     "cause": cause, "fix": fix})
    return rows


def _raised(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the row names the type
        return type(exc).__name__, str(exc)
    raise AssertionError("no error was raised")


@pytest.fixture(scope="module")
def small_ctx(tiny_llama):
    """The tiny Llama with another n_ctx: a second engine configuration, as a user who changed --config has."""
    from tests.tiny import tiny_path

    with Engine(tiny_path("llama31"), {"n_threads": 1, "n_ctx": 256}) as e:
        yield e


def provoke_not_found(ctx) -> tuple[str, str]:
    return _raised(lambda: ctx.mem.get("abcd1234"))


def provoke_other_n_ctx(ctx) -> tuple[str, str]:
    b = ctx.mem.learn("Refunds: ask for the order number first.", name="refunds")
    with Memory(engine=ctx.small, home=ctx.mem.store.home) as other:
        return _raised(lambda: other.ask(b.id, " Then", max_tokens=1))


def provoke_too_long(ctx) -> tuple[str, str]:
    with Memory(engine=ctx.small, home=ctx.tmp / "short") as short:
        return _raised(lambda: short.learn(long_text(400, seed=3)))


def provoke_scope(ctx) -> tuple[str, str]:
    ctx.mem.learn("Alice takes her tea green, no sugar.", name="tea", user_id="alice")
    r = ctx.mem.recall("How does Alice take her tea?", user_id="carol", max_tokens=1)
    assert not r.matched
    return "Recall.reason", r.reason


def provoke_unverified(ctx) -> tuple[str, str]:
    b = ctx.mem.learn("Shipping: parcels leave the warehouse on Mondays.", name="shipping")
    ctx.mem.export(ctx.tmp / "b.gmbundle", [b.id])
    with Memory(engine=ctx.mem.engine, home=ctx.tmp / "other") as other:
        other.import_bundle(ctx.tmp / "b.gmbundle", rederive=False)
        return _raised(lambda: other.ask(b.id, " They", max_tokens=1))


def provoke_not_routed(ctx) -> tuple[str, str]:
    b = ctx.mem.learn("Shipping: parcels leave the warehouse on Mondays.", name="shipping",
                      when_to_use="when do parcels ship")
    ctx.mem.export(ctx.tmp / "r.gmbundle", [b.id])
    with Memory(engine=ctx.mem.engine, home=ctx.tmp / "routed", embedder=ctx.mem.embedder) as other:
        other.import_bundle(ctx.tmp / "r.gmbundle", rederive=False)
        r = other.recall("When do parcels ship?", max_tokens=1)
    assert not r.matched
    return "Recall.reason", r.reason


def provoke_read_only(ctx) -> tuple[str, str]:
    from tests.test_trust_store import tmpfs

    mnt = ctx.tmp / "ro"
    with tmpfs(mnt, "16m"):
        with Memory(engine=ctx.mem.engine, home=mnt / "home") as m:
            m.learn("A text so that the home exists.")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with Memory(engine=ctx.mem.engine, home=mnt / "home") as m:
            return _raised(lambda: m.learn("a new text to learn"))


def provoke_corrupted(ctx) -> tuple[str, str]:
    from .conftest import flip_bit

    b = ctx.mem.learn("Returns: within 30 days, with the receipt.", name="returns")
    path = next(ctx.mem.store.home.glob(f"blocks/*/{b.id}.gmb"))
    flip_bit(path, path.stat().st_size - 100)
    return _raised(lambda: ctx.mem.ask(b.id, " So", max_tokens=1))


def provoke_unknown_model(ctx) -> tuple[str, str]:
    return _raised(lambda: Engine("no-such-model"))


def provoke_config_typo(ctx) -> tuple[str, str]:
    """Both doors: ``config=`` in Python, and ``--config`` on a command that opens no engine (``ls``)."""
    from graftmem.cli import main

    kind, message = _raised(lambda: Memory(engine=None, home=ctx.tmp / "typo", config={"n_ctxx": 512}))
    assert main(["--json", "--home", str(ctx.tmp / "typo"), "--config", '{"n_ctxx": 512}', "ls"]) == 2
    err = json.loads(ctx.capsys.readouterr().out)["error"]
    assert (err["type"], err["message"]) == (kind, message), err
    return kind, message


def _asgi_401(headers: dict[str, str]) -> tuple[str, str]:
    import httpx
    from starlette.applications import Starlette

    from graftmem.server.http import ApiKeyMiddleware

    async def go() -> httpx.Response:
        app = ApiKeyMiddleware(Starlette(), "the-right-key")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/v1/models", headers=headers)

    import anyio

    r = anyio.run(go)
    assert r.status_code == 401
    err = r.json()["error"]
    return (err.get("type") if isinstance(err, dict) else err) or "", json.dumps(r.json())


def provoke_no_api_key(ctx) -> tuple[str, str]:
    kind, body = _asgi_401({})
    return "AccessDenied (401)", body


def provoke_wrong_api_key(ctx) -> tuple[str, str]:
    kind, body = _asgi_401({"Authorization": "Bearer not-the-key"})
    return "AccessDenied (401)", body


def provoke_cli_typo(ctx) -> tuple[str, str]:
    from graftmem.cli import main

    assert main(["--json", "lern", "notes.txt"]) == 2
    err = json.loads(ctx.capsys.readouterr().out)["error"]
    return err["type"], err["message"]


def provoke_empty_store(ctx) -> tuple[str, str]:
    r = ctx.mem.recall("Open a ticket for customer 7312.", max_tokens=1)
    assert not r.matched
    return "Recall.reason", r.reason


def provoke_no_file(ctx) -> tuple[str, str]:
    from graftmem.cli import main

    assert main(["--json", "--home", str(ctx.tmp / "cli-home"), "learn", str(ctx.tmp / "no-such-notes.txt")]) == 2
    err = json.loads(ctx.capsys.readouterr().out)["error"]
    return err["type"], err["message"]


PROVOKERS: dict[str, Callable] = {
    "not-found": provoke_not_found, "other-settings": provoke_other_n_ctx, "too-long": provoke_too_long,
    "scope": provoke_scope, "unverified": provoke_unverified, "read-only": provoke_read_only,
    "corrupted": provoke_corrupted, "unknown-model": provoke_unknown_model, "config-typo": provoke_config_typo,
    "no-api-key": provoke_no_api_key, "wrong-api-key": provoke_wrong_api_key, "cli-typo": provoke_cli_typo,
    "empty-store": provoke_empty_store, "not-routed": provoke_not_routed, "no-file": provoke_no_file,
}


def test_every_row_has_a_provoker_and_back():
    ids = [r["id"] for r in table()]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(PROVOKERS), (ids, sorted(PROVOKERS))
    for r in table():
        assert r["cause"] and r["fix"], r


@pytest.mark.parametrize("row", table(), ids=lambda r: r["id"])
def test_row_is_what_a_user_meets(row, tiny_llama, small_ctx, minilm, tmp_path, capsys):
    class Ctx:
        pass

    ctx = Ctx()
    ctx.tmp, ctx.small, ctx.capsys = tmp_path, small_ctx, capsys
    with Memory(engine=tiny_llama, home=tmp_path / "store", embedder=minilm) as mem:
        ctx.mem = mem
        kind, message = PROVOKERS[row["id"]](ctx)
    assert kind == row["error"], (row["id"], kind, message)
    # the excerpt, with "..." standing for a varying part (an id, a path, a number)
    pattern = ".*?".join(re.escape(part) for part in row["said"].split("..."))
    assert re.search(pattern, message, re.S), (row["id"], message)


def test_home_page_lists_every_error_class():
    """The Home page's tree names every exception class graftmem exports (it missed UnverifiedBlock and
    StoreReadOnly)."""
    from graftmem.core import errors

    home = (ROOT / "docs" / "index.md").read_text()
    missing = [n for n in errors.__all__ if n != "from_response" and f" {n} " not in home.replace("\n", " ")]
    assert not missing, missing
