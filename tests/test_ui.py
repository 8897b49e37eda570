"""The web page ``/ui`` (issue 41, item 4) in a real browser: Playwright driving Debian's ``chromium``.

A real ``graftmem serve --ui`` (the tiny Llama 3.1 of tests/tiny.py, tenants from a key file) over a store
with blocks of every origin: learned by the operator (one chained on another, one ``unverified``, one whose
name is markup), a tenant's own learned block with a scope, a chat prefix the prompt cache learned, two
stored responses (a conversation), and another tenant's block. The page, opened in headless Chromium with
a tenant's key, must show every block that key sees, with the provenance, kind, origin and owner the store
holds (read from the store's files and through the API), and none of the other tenant's; verify must show
its result (and refuse an ``unverified`` block); the router's hits for a typed task must be the API's.
Screenshots go to ``$GRAFTMEM_TEST_ARTIFACTS/ui`` (default tests/artifacts/ui/), their paths printed.

Chromium and Playwright come from the test setup (scripts/dev.sh: DEBIAN_NEEDS, the dev extra); the tests
skip when either is missing, except under CI, where they fail. Every socket is on 127.0.0.1, opened here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from graftmem import Memory
from graftmem.cli.parser import build_parser
from graftmem.cli.serve import serve_config
from graftmem.core.blocks import AUTO_KIND, PROVENANCE_UNVERIFIED
from graftmem.core.errors import ConfigError
from graftmem.memory.access import owner_of
from graftmem.server import ApiKeys, api_server
from graftmem.server.config import ServeConfig
from graftmem.server.tenants import hash_key
from graftmem.store.local import Store

from .served import serve_process
from .tiny import tiny_path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("GRAFTMEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
MARKUP = '<img src=x onerror="window.__xss=1">notes'
TASK = "how do I rotate the backup keys"


def _need(what: str, why: str) -> None:
    """Skip for a missing tool, except under CI, where it must fail loudly."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing on CI: {why}")
    pytest.skip(f"{what} is not installed: {why}")


def artifacts() -> Path:
    base = os.environ.get("GRAFTMEM_TEST_ARTIFACTS")
    out = (Path(base) / "ui") if base else ROOT / "tests" / "artifacts" / "ui"
    out.mkdir(parents=True, exist_ok=True)
    return out


# ------------------------------------------------------------------ the store and the server
def _operator_blocks(engine: Any, home: Path) -> dict[str, str]:
    """What the operator learns into the home with the SDK before serving: shared with every tenant."""
    with Memory(engine=engine, home=home) as mem:
        keys = mem.learn("To rotate the backup keys: run keyctl rotate --all, then update the vault and "
                         "restart the backup agent.", name="backup-keys",
                         when_to_use="rotating or renewing the backup encryption keys")
        more = mem.learn("If the vault refuses the new key, re-run keyctl with --force.", name="backup-keys-force",
                         parent=keys.id)
        note = mem.learn("Lunch menu: soup on Mondays, pasta on Fridays.", name="lunch-menu")
        odd = mem.learn("<script>window.__xss=2</script> a note whose text is markup", name=MARKUP)
    store = Store(home)
    try:  # a block dropped into the store from elsewhere: nothing here vouches for it
        store.set_provenance(note.id, PROVENANCE_UNVERIFIED)
    finally:
        store.close()
    return {"keys": keys.id, "more": more.id, "note": note.id, "odd": odd.id}


def _wait(cond: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll ``cond()`` until it is truthy (bounded): the prompt cache writes a learned prefix after the answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("ui") / "home"
    ids = _operator_blocks(tiny_llama, home)
    keyfile = home.parent / "keys.txt"
    keyfile.write_text(f"alice {hash_key(ALICE)}\nbob {hash_key(BOB)}\n")
    args = ("--ui", "--model", str(tiny_path("llama31")), "--config", json.dumps({"n_threads": 1}),
            "--api-key-file", str(keyfile), "--no-warm", "--min-prefix-tokens", "8", "--sightings", "1")
    with serve_process(*args, home=home) as (_, url):
        alice = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ALICE}"}, timeout=120)
        bob = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {BOB}"}, timeout=120)
        r = alice.post("/v1/memory/learn", json={"text": "Alice's deploy checklist: tag, build, canary, promote.",
                                                "name": "alice-deploy", "user_id": "u-alice"})
        assert r.status_code == 200, r.text
        ids["alice"] = r.json()["block"]["id"]
        r = bob.post("/v1/memory/learn", json={"text": "Bob's private note: the staging password rotates weekly.",
                                              "name": "bob-private"})
        assert r.status_code == 200, r.text
        ids["bob"] = r.json()["block"]["id"]
        r = bob.post("/v1/memory/learn", json={"text": "The team's on-call rota is in the wiki.", "name": "bob-shared",
                                              "shared": True, "user_id": "u-bob"})
        assert r.status_code == 200, r.text
        ids["bob-shared"] = r.json()["block"]["id"]  # every tenant sees it; bob's scope row is bob's business
        ask = {"model": "tiny", "instructions": "You are terse.", "max_output_tokens": 6, "temperature": 0}
        r1 = alice.post("/v1/responses", json={**ask, "input": "Name a primary colour."}).json()
        r2 = alice.post("/v1/responses", json={**ask, "input": "Name another one.",
                                               "previous_response_id": r1["id"]}).json()
        ids["resp1"], ids["resp2"] = r1["id"], r2["id"]
        chat = {"model": "tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "You are the release assistant of the platform team."},
                             {"role": "user", "content": "Which step comes after canary?"}]}
        assert alice.post("/v1/chat/completions", json=chat).status_code == 200

        # the chat prefix, written by the cache's one writer thread after the answer, in order: once it is
        # there, every prefix learned before it is too, and the store holds still while the page is checked
        def prefix_stored() -> bool:
            rows = alice.get("/v1/memory/blocks", params={"kind": AUTO_KIND}).json()["blocks"]
            return any("release assistant" in (alice.get(f"/v1/memory/blocks/{b['id']}").json()["text"])
                       for b in rows)
        _wait(prefix_stored, "the chat prefix block")
        try:
            yield {"url": url, "home": home, "ids": ids, "alice": alice, "bob": bob}
        finally:
            alice.close()
            bob.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("playwright (pip)", "pip install -e '.[dev]' installs it")
    if not os.path.exists(CHROMIUM):
        _need("chromium (Debian)", "apt-get install chromium (scripts/dev.sh test installs it)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, served) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(120_000)  # the first router search loads the embedder in the server
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        context.close()


def _shot(pg: Any, name: str, record_property: Any) -> Path:
    """A full-page screenshot, its path listed at the end of the run (tests/conftest.py: "test artifacts")."""
    path = artifacts() / name
    pg.screenshot(path=str(path), full_page=True)
    record_property("artifact", str(path))
    return path


def _login(pg: Any, url: str, key: str) -> None:
    pg.goto(url + "/ui")
    pg.wait_for_selector("body[data-state=needs-key]")
    pg.fill("#key-input", key)
    pg.click("#key-use")
    pg.wait_for_selector("body[data-state=ready]")


def _truth(home: Path, tenant: str) -> dict[str, Any]:
    """What ``tenant`` may see, read from the store's own files (the rule: its own blocks and the shared ones)."""
    store = Store(home)
    try:
        return {b.id: (b, store.provenance(b.id)) for b in store.list() if owner_of(b) in (None, tenant)}
    finally:
        store.close()


def _origin(block: Any) -> str:
    if block.kind == AUTO_KIND:
        return "stored response" if isinstance(block.metadata.get("response"), dict) else "chat prefix"
    return "learned"


# ------------------------------------------------------------------ the page
def test_the_page_shows_every_block_a_key_sees_with_its_provenance(served, page, record_property):
    pg, ids = page, served["ids"]
    pg.goto(served["url"] + "/ui")
    pg.wait_for_selector("body[data-state=needs-key]")  # the data needs the key; the page asked for it
    assert pg.locator("#blocks tbody tr").count() == 0
    _shot(pg, "01-asks-for-the-key.png", record_property)
    pg.fill("#key-input", ALICE)
    pg.click("#key-use")
    pg.wait_for_selector("body[data-state=ready]")
    rows = {r.get_attribute("data-id"): r for r in pg.locator("#blocks tbody tr").all()}

    truth = _truth(served["home"], "alice")
    api = {b["id"]: b for b in served["alice"].get("/v1/memory/blocks").json()["blocks"]}
    assert set(rows) == set(truth) == set(api)  # every block alice sees, from the files and the API, no other
    assert ids["bob"] not in rows and "bob-private" not in pg.inner_text("body")
    origins = {_origin(b) for b, _ in truth.values()}
    assert origins == {"learned", "chat prefix", "stored response"}, origins
    assert {p for _, p in truth.values()} >= {"local", PROVENANCE_UNVERIFIED}
    for bid, (block, provenance) in truth.items():
        row = rows[bid]
        assert row.get_attribute("data-provenance") == provenance == api[bid]["provenance"], block.name
        assert row.get_attribute("data-kind") == block.kind
        assert row.get_attribute("data-origin") == _origin(block)
        assert row.get_attribute("data-tenant") == (owner_of(block) or "")
        assert row.locator("[data-field=name]").inner_text() == block.name  # markup shown as text
        assert row.locator("[data-field=tokens]").inner_text() == str(block.n_tokens)
        assert row.locator("[data-field=provenance]").inner_text() == provenance
    assert rows[ids["alice"]].locator("[data-field=scope]").inner_text() == "user_id=u-alice"
    assert rows[ids["alice"]].locator("[data-field=owner]").inner_text().startswith("alice (own)")
    assert rows[ids["keys"]].locator("[data-field=owner]").inner_text() == "operator (shared)"
    shared = rows[ids["bob-shared"]]
    assert shared.locator("[data-field=owner]").inner_text() == "shared by bob"
    assert shared.locator("[data-field=scope]").count() == 0 and "u-bob" not in pg.inner_text("body")
    assert pg.evaluate("window.__xss") is None  # a block's name and text never run as markup

    # chains and conversations as trees: a child sits inside its parent's node
    assert pg.locator(f"#trees li[data-id='{ids['keys']}'] li[data-id='{ids['more']}']").count() == 1
    assert pg.locator(f"#conversations li[data-id='{ids['resp1']}'] li[data-id='{ids['resp2']}']").count() == 1
    assert "Name another one." in pg.inner_text(f"#conversations li[data-id='{ids['resp2']}']")
    # the metrics: this key's /metrics
    assert pg.locator("#metrics tr[data-metric=graftmem_requests_total]").count() > 0
    _shot(pg, "02-blocks-trees-metrics.png", record_property)
    assert not pg.errors  # type: ignore[attr-defined]

    # another tenant's key: its own blocks, never alice's
    pg.fill("#key-input", BOB)
    pg.click("#key-use")
    pg.wait_for_selector(f"#blocks tbody tr[data-id='{ids['bob']}']")
    shown = {r.get_attribute("data-id") for r in pg.locator("#blocks tbody tr").all()}
    assert shown == set(_truth(served["home"], "bob")) and ids["alice"] not in shown
    assert not any(served["ids"][k] in shown for k in ("resp1", "resp2"))
    _shot(pg, "03-another-tenant.png", record_property)


def test_a_click_on_verify_shows_its_result(served, page, record_property):
    pg, ids = page, served["ids"]
    _login(pg, served["url"], ALICE)
    pg.click(f"#blocks tbody tr[data-id='{ids['keys']}']")
    pg.wait_for_selector(f"#detail[data-id='{ids['keys']}'][data-loaded=true]")
    store = Store(served["home"])
    try:
        block = store.get(ids["keys"])
    finally:
        store.close()
    assert pg.inner_text("#detail-text") == block.text
    pg.click("#verify-button")
    pg.wait_for_selector("#verify-result[data-ok=true], #verify-result[data-ok=false]")
    result = pg.locator("#verify-result")
    assert result.get_attribute("data-ok") == "true", result.inner_text()
    assert result.get_attribute("data-sha-equal") == result.get_attribute("data-samples") == "4"
    assert "4/4 logits SHA-256 equal" in result.inner_text()
    # kept as `graftmem verify` keeps it: the manifest's record, and the listing says so
    pg.wait_for_selector(f"#blocks tbody tr[data-id='{ids['keys']}'] [data-field=verified]:text('exact')")
    store = Store(served["home"])
    try:
        rec = store.get(ids["keys"]).verification
    finally:
        store.close()
    assert rec is not None and rec.ok and rec.samples == 4 and rec.sha_equal == 4
    _shot(pg, "04-verified.png", record_property)

    # a block nothing here vouches for: refused without the consent, as a graft for an answer is
    pg.click(f"#blocks tbody tr[data-id='{ids['note']}']")
    pg.wait_for_selector(f"#detail[data-id='{ids['note']}'][data-loaded=true]")
    pg.click("#verify-button")
    pg.wait_for_selector("#verify-result[data-ok=false]")
    assert "unverified" in pg.inner_text("#verify-result").lower()
    _shot(pg, "05-verify-refused.png", record_property)
    assert not pg.errors  # type: ignore[attr-defined]


def test_a_typed_task_shows_the_routers_top_hits(served, page, record_property):
    pg, ids = page, served["ids"]
    _login(pg, served["url"], ALICE)
    pg.fill("#task-input", TASK)
    pg.click("#router-go")
    pg.wait_for_selector(f"#router-hits[data-query='{TASK}']")
    shown = [li.get_attribute("data-id") for li in pg.locator("#router-hits li[data-id]").all()]
    hits = served["alice"].post("/v1/memory/search", json={"query": TASK, "top_k": 5}).json()["hits"]
    assert shown == [h["block_id"] for h in hits] and shown[0] == ids["keys"]
    assert ids["bob"] not in shown
    _shot(pg, "06-router-hits.png", record_property)


# ------------------------------------------------------------------ the routes, without a browser
def test_the_page_is_public_and_its_data_is_behind_the_keys(served):
    url = served["url"]
    with httpx.Client(base_url=url, timeout=30) as anon:
        page = anon.get("/ui")
        assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
        assert "backup-keys" not in page.text
        assert anon.get("/ui/static/ui.js").status_code == 200
        for path in ("/ui/api/blocks", "/v1/memory/blocks", "/metrics"):
            assert anon.get(path).status_code == 401, path
        assert anon.post("/ui/api/verify", json={"id": served["ids"]["keys"]}).status_code == 401
        for path in ("/ui/static/nothing.js", "/ui/static/..%2fapi%2fblocks", "/ui/static/%2e%2e%2f%2e%2e%2fv1%2fmemory%2fblocks"):
            r = anon.get(path)
            assert r.status_code == 404 and "backup-keys" not in r.text, path
    alice = served["alice"]
    # another tenant's block is not there for this key: 404, as a missing one
    assert alice.post("/ui/api/verify", json={"id": served["ids"]["bob"]}).status_code == 404
    for bad, field in (({"id": served["ids"]["keys"], "samples": 0}, "samples"),
                       ({"id": served["ids"]["keys"], "samples": 51}, "samples"), ({"samples": 2}, "id"),
                       ({"id": served["ids"]["keys"], "allow_unverified": "yes"}, "allow_unverified")):
        r = alice.post("/ui/api/verify", json=bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    extra = {b["id"]: b for b in alice.get("/ui/api/blocks").json()["blocks"]}
    assert extra[served["ids"]["alice"]]["scopes"] == [{"user_id": "u-alice"}]
    assert served["ids"]["bob"] not in extra
    assert extra[served["ids"]["bob-shared"]]["scopes"] == []  # bob's scope of a block it shared: bob's only
    assert extra[served["ids"]["bob-shared"]]["shared_by"] == "bob"


def test_the_page_is_off_unless_asked_for(tiny_llama, tmp_path):
    with pytest.raises(ConfigError) as err:
        ServeConfig(ui=True)  # the block server alone has no REST routes to read
    assert err.value.param == "ui"
    assert ServeConfig().ui is False
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", "--ui"]), api_key=None, push_token=None).ui is True
    assert serve_config(parse(["serve"]), api_key=None, push_token=None).ui is False
    with pytest.raises(ConfigError) as err:  # refused before any model loads
        serve_config(parse(["serve", "--blocks-only", "--ui"]), api_key=None, push_token=None)
    assert err.value.param == "ui"
    store = Store(tmp_path / "home")
    try:
        keys = ApiKeys.single("k" * 12)
        with api_server(store, [tiny_llama], api_key=keys, warm=False) as srv:
            assert httpx.get(srv.url + "/ui").status_code == 404
            assert httpx.get(srv.url + "/ui/api/blocks", headers={"Authorization": "Bearer " + "k" * 12}).status_code == 404
    finally:
        store.close()
