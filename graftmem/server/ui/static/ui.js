// graftmem's /ui page: plain JS, no build step, nothing fetched but this server's own routes.
// Every value from the server is written as text (textContent), never as markup: a block's text and
// name are anybody's prompt. The API key lives in this tab's sessionStorage and goes out as
// Authorization: Bearer on each call (the page's files are served without a key; the data is not).
"use strict";

const KEY_SLOT = "graftmem.apiKey";
const state = { summaries: [], extras: new Map(), byId: new Map(), selected: null, tenant: null };

// ------------------------------------------------------------------ small helpers
function $(sel) { return document.querySelector(sel); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleString();
}

function short(id) { return id ? id.slice(0, 12) : ""; }

class AuthError extends Error {}

function key() { return sessionStorage.getItem(KEY_SLOT) || ""; }

function showError(msg) {
  const box = $("#error");
  box.textContent = msg || "";
  box.hidden = !msg;
}

// One call to this server: relative paths (the page may sit behind a proxy's path prefix), the key as a
// bearer token, no cookies. A 401 asks for the key; any other error carries the server's message.
async function api(path, opts = {}) {
  const headers = {};
  const k = key();
  if (k) headers["Authorization"] = "Bearer " + k;
  let body;
  if (opts.json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(opts.json); }
  const r = await fetch(path, { method: opts.method || "GET", headers, body, cache: "no-store", credentials: "omit" });
  const text = await r.text();
  if (r.status === 401) {
    document.body.dataset.state = "needs-key";
    $("#who").textContent = k ? "this key was refused: give another" : "this server needs an API key";
    $("#key-input").focus();
    throw new AuthError("API key needed");
  }
  let data = text;
  if ((r.headers.get("content-type") || "").includes("json")) {
    try { data = JSON.parse(text); } catch (e) { data = text; }
  }
  if (!r.ok) {
    const err = data && data.error;
    const msg = (err && (err.message || err)) || data.message || text || r.statusText;
    const e = new Error(typeof msg === "string" ? msg : JSON.stringify(msg));
    e.status = r.status;
    e.name = (err && err.code) || data.error || "Error";
    throw e;
  }
  return data;
}

// ------------------------------------------------------------------ what a block is, in words
function origin(s, x) {
  if (x && x.response) return { label: "stored response", cls: "origin-response" };
  if (s.kind === "auto") return { label: "chat prefix", cls: "origin-chat" };
  return { label: "learned", cls: "origin-learned" };
}

function trusted(prov) { return prov === "local" || prov === "rederived" || (prov || "").startsWith("signed"); }

function provenanceBadge(prov) {
  return el("span", { class: "badge " + (trusted(prov) ? "trusted" : "untrusted"), "data-field": "provenance" },
    prov || "unknown");
}

function owner(x) {
  if (!x) return "";
  if (x.tenant) return x.tenant === state.tenant ? x.tenant + " (own)" : x.tenant;
  if (x.shared_by) return "shared by " + x.shared_by;
  return "operator (shared)";
}

function scopeText(x) {
  if (!x || !x.scopes || !x.scopes.length) return "";
  return x.scopes.map(s => Object.entries(s).map(([k, v]) => k + "=" + v).join(" ")).join("; ");
}

function verifiedBadge(v) {
  if (v === null || v === undefined) return el("span", { class: "dim", "data-field": "verified" }, "not yet");
  return el("span", { class: "badge " + (v ? "trusted" : "bad"), "data-field": "verified" }, v ? "exact" : "FAILED");
}

// ------------------------------------------------------------------ the blocks
async function loadBlocks() {
  const [list, extra] = await Promise.all([api("v1/memory/blocks"), api("ui/api/blocks")]);
  state.tenant = extra.tenant;
  state.summaries = list.blocks;
  state.extras = new Map(extra.blocks.map(x => [x.id, x]));
  state.byId = new Map(list.blocks.map(s => [s.id, s]));
  $("#who").replaceChildren("connected as ",
    el("b", { id: "who-tenant" }, extra.tenant ? "tenant " + extra.tenant : "the server's one trust domain"),
    " \u00b7 " + list.blocks.length + " block(s) visible to this key");
  renderBlocks();
  renderTrees();
  renderConversations();
}

function renderBlocks() {
  const rows = [...state.summaries].sort((a, b) => (a.created_at < b.created_at ? -1 : 1));
  const tbody = $("#blocks tbody");
  tbody.replaceChildren(...rows.map(s => {
    const x = state.extras.get(s.id);
    const o = origin(s, x);
    const scope = scopeText(x);
    return el("tr", { "data-id": s.id, "data-kind": s.kind, "data-origin": o.label, "data-provenance": s.provenance || "",
                      "data-tenant": (x && x.tenant) || "", class: s.id === state.selected ? "selected" : null,
                      onclick: () => showBlock(s.id) },
      el("td", { "data-field": "name", class: "name", title: s.name }, s.name),
      el("td", { class: "mono", title: s.id }, short(s.id)),
      el("td", {}, el("span", { class: "badge " + o.cls, "data-field": "origin" }, o.label)),
      el("td", { "data-field": "kind" }, s.kind),
      el("td", {}, provenanceBadge(s.provenance)),
      el("td", { "data-field": "owner" }, owner(x), scope ? el("div", { class: "dim", "data-field": "scope" }, scope) : null),
      el("td", { class: "num", "data-field": "tokens" }, s.n_tokens),
      el("td", { class: "num", "data-field": "size", title: s.state_size + " bytes" }, bytes(s.state_size)),
      el("td", { "data-field": "last-used", title: x && x.used_here ? "grafted or learned by this server" : "not used since the server started: its creation" },
        x && x.last_used ? (x.used_here ? when(x.last_used) : el("span", { class: "dim" }, "created " + when(x.last_used))) : ""),
      el("td", {}, verifiedBadge(s.verified)));
  }));
  $("#blocks-count").textContent = "(" + rows.length + ")";
  $("#blocks").dataset.loaded = "true";
}

// A forest of the blocks by their parent links: a block whose parent this key does not see is a root.
function forest(items, parentOf) {
  const ids = new Set(items.map(i => i.id));
  const kids = new Map();
  const roots = [];
  for (const it of items) {
    const p = parentOf(it);
    if (p && ids.has(p)) { if (!kids.has(p)) kids.set(p, []); kids.get(p).push(it); }
    else roots.push(it);
  }
  return { roots, kids };
}

function treeList(nodes, kids, label, idOf) {
  return el("ul", { class: "tree" }, nodes.map(n => el("li", { "data-id": idOf(n) }, label(n),
    kids.has(n.id) ? treeList(kids.get(n.id), kids, label, idOf) : null)));
}

function renderTrees() {
  const { roots, kids } = forest(state.summaries, s => s.parent);
  const chained = roots.filter(r => kids.has(r.id));
  const box = $("#trees");
  if (!chained.length) { box.replaceChildren(el("p", { class: "note" }, "No chained blocks.")); return; }
  const label = s => {
    const x = state.extras.get(s.id);
    const o = origin(s, x);
    return el("span", { class: "node", onclick: ev => { ev.stopPropagation(); showBlock(s.id); } },
      el("span", { class: "badge " + o.cls }, o.label), " ", s.name, " ",
      el("span", { class: "dim" }, s.n_tokens + " tokens \u00b7 " + short(s.id)),
      x && x.response ? el("span", { class: "dim" }, " \u00b7 " + x.response.id) : null);
  };
  box.replaceChildren(...chained.map(r => treeList([r], kids, label, s => s.id)));
}

function renderConversations() {
  const responses = [];
  for (const [bid, x] of state.extras) {
    if (x.response) responses.push({ id: x.response.id, block: bid, rec: x.response });
  }
  const { roots, kids } = forest(responses, r => r.rec.previous_response_id);
  const box = $("#conversations");
  if (!roots.length) { box.replaceChildren(el("p", { class: "note" }, "No stored responses.")); return; }
  const label = r => el("span", { class: "node", "data-response": r.id, onclick: ev => { ev.stopPropagation(); showBlock(r.block); } },
    el("span", { class: "mono" }, r.id), r.rec.deleted ? el("span", { class: "badge bad" }, "deleted") : null,
    el("span", { class: "dim" }, " " + when(r.rec.created_at)),
    ...r.rec.turn.map(t => el("div", { class: "turn" }, el("b", {}, t.role + ": "), t.text)));
  roots.sort((a, b) => (a.rec.created_at < b.rec.created_at ? -1 : 1));
  box.replaceChildren(...roots.map(r => treeList([r], kids, label, n => n.id)));
}

// ------------------------------------------------------------------ one block: text, receipts, verify
function fields(pairs) {
  return el("dl", { class: "fields" }, pairs.filter(p => p[1] !== null && p[1] !== undefined && p[1] !== "")
    .map(([k, v]) => [el("dt", {}, k), el("dd", { "data-field": k }, v)]));
}

function pretty(obj) { return el("pre", { class: "mono" }, JSON.stringify(obj, null, 2)); }

async function showBlock(id) {
  state.selected = id;
  for (const tr of document.querySelectorAll("#blocks tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
  const box = $("#detail");
  box.dataset.id = id;
  box.dataset.loaded = "false";
  box.replaceChildren(el("p", { class: "note" }, "loading " + short(id) + "\u2026"));
  let m;
  try {
    m = await api("v1/memory/blocks/" + encodeURIComponent(id));
  } catch (e) {
    if (!(e instanceof AuthError)) box.replaceChildren(el("div", { class: "error" }, e.message));
    return;
  }
  const s = state.byId.get(id) || {};
  const x = state.extras.get(id);
  const meta = Object.assign({}, m.metadata || {});
  const response = meta.response;
  delete meta.response;
  const parts = [
    el("h3", { id: "detail-name" }, m.name),
    fields([
      ["id", el("span", { class: "mono" }, m.id)], ["origin", origin(s, x).label], ["kind", m.kind],
      ["provenance", provenanceBadge(s.provenance)], ["tenant", owner(x)], ["scopes", scopeText(x)],
      ["tokens", String(m.n_tokens)], ["positions", m.pos_start + " to " + (m.pos_start + m.n_tokens)],
      ["state", bytes(m.state_size) + " (" + m.storage + ")"], ["parent", m.parent ? el("span", { class: "node mono", onclick: () => showBlock(m.parent) }, short(m.parent)) : null],
      ["created", when(m.created_at)], ["last used", x && x.last_used ? (x.used_here ? when(x.last_used) : "not since the server started") : null],
      ["model", m.fingerprint && m.fingerprint.model_name], ["state digest", el("span", { class: "mono" }, m.state_digest)],
    ]),
    el("h3", {}, "Text"),
    el("pre", { id: "detail-text" }, m.text),
    el("h3", {}, "Receipts"),
  ];
  if (m.verification) {
    const v = m.verification;
    parts.push(el("div", { id: "verification-record" }, "last verification (" + when(v.checked_at) + "): ",
      el("span", { class: "badge " + (v.ok ? "trusted" : "bad") }, v.ok ? "exact" : "FAILED"),
      " " + v.sha_equal + "/" + v.samples + " logits SHA-256 equal, argmax " + v.argmax_agree + "/" + v.samples +
      ", max KL " + v.max_kl));
  } else {
    parts.push(el("p", { class: "note", id: "verification-record" }, "Not verified yet."));
  }
  if (response && response.object && response.object.graftmem) {
    parts.push(el("div", {}, "receipt of stored response ", el("span", { class: "mono" }, response.id), ":"),
      pretty(response.object.graftmem));
  }
  parts.push(
    el("div", { class: "verify-bar" },
      el("button", { id: "verify-button", type: "button", onclick: () => verify(m.id) }, "Verify"),
      el("label", {}, "samples ", el("input", { id: "verify-samples", type: "number", min: 1, max: 50, value: 4 })),
      el("label", {}, el("input", { id: "verify-allow", type: "checkbox" }), " allow unverified"),
      el("span", { class: "note" }, "graft vs fresh prefill, logits compared byte for byte")),
    el("div", { id: "verify-result", hidden: true }));
  if (Object.keys(meta).length) parts.push(el("h3", {}, "Metadata"), pretty(meta));
  if (response) {
    const rec = Object.assign({}, response);
    delete rec.object;
    parts.push(el("h3", {}, "Stored response record"), pretty(rec));
  }
  box.replaceChildren(...parts);
  box.dataset.loaded = "true";
}

async function verify(id) {
  const out = $("#verify-result");
  const button = $("#verify-button");
  out.hidden = false;
  out.dataset.ok = "pending";
  out.textContent = "verifying\u2026 (grafting and prefilling on an engine of the server)";
  button.disabled = true;
  try {
    const r = await api("ui/api/verify", { method: "POST", json: {
      id, samples: Number($("#verify-samples").value || 4), allow_unverified: $("#verify-allow").checked } });
    const ok = r.sha_equal === r.samples && r.floor_sha_equal === r.floor_samples;
    out.dataset.ok = String(ok);
    out.replaceChildren(el("b", {}, ok ? "exact" : "NOT exact"), ": " + r.sha_equal + "/" + r.samples +
      " logits SHA-256 equal (graft vs fresh prefill), argmax " + r.argmax_agree + "/" + r.samples +
      ", max KL " + r.max_kl + ", engine floor " + r.floor_sha_equal + "/" + r.floor_samples +
      " \u00b7 " + r.n_tokens + " tokens");
    out.dataset.shaEqual = String(r.sha_equal);
    out.dataset.samples = String(r.samples);
    await loadBlocks();  // the listing's "verified" now says it
  } catch (e) {
    out.dataset.ok = "false";
    out.replaceChildren(el("b", {}, "refused"), ": " + e.message);
    out.dataset.error = e.name || "";
  } finally {
    button.disabled = false;
  }
}

// ------------------------------------------------------------------ the router
async function route(ev) {
  ev.preventDefault();
  const query = $("#task-input").value.trim();
  const list = $("#router-hits");
  if (!query) return;
  list.dataset.query = "";
  list.replaceChildren(el("li", { class: "note" }, "routing\u2026 (the first search loads the embedder)"));
  try {
    const r = await api("v1/memory/search", { method: "POST", json: { query, top_k: 5 } });
    list.replaceChildren(...(r.hits.length ? r.hits.map(h => el("li", { "data-id": h.block_id, onclick: () => showBlock(h.block_id) },
      h.name, el("span", { class: "score" }, "score " + h.score.toFixed(3)), " ",
      el("span", { class: "dim" }, h.kind + " \u00b7 " + h.n_tokens + " tokens \u00b7 " + short(h.block_id)))) :
      [el("li", { class: "note" }, "No block is routed for this task.")]));
  } catch (e) {
    if (!(e instanceof AuthError)) list.replaceChildren(el("li", { class: "error" }, e.message));
  }
  list.dataset.query = query;
}

// ------------------------------------------------------------------ the metrics (Prometheus text)
async function loadMetrics() {
  const text = await api("metrics");
  const help = new Map();
  const rows = [];
  for (const line of String(text).split("\n")) {
    if (line.startsWith("# HELP ")) {
      const rest = line.slice(7);
      const i = rest.indexOf(" ");
      help.set(rest.slice(0, i), rest.slice(i + 1));
    } else if (line && !line.startsWith("#")) {
      const m = line.match(/^([a-zA-Z_][a-zA-Z0-9_]*)(\{.*\})?\s+(\S+)$/);
      if (m) rows.push({ name: m[1], labels: (m[2] || "").slice(1, -1), value: m[3] });
    }
  }
  $("#metrics tbody").replaceChildren(...rows.map(r => el("tr", { "data-metric": r.name, title: help.get(r.name) || "" },
    el("td", {}, r.name), el("td", { class: "mono" }, r.labels), el("td", { class: "num" }, r.value))));
  $("#metrics").dataset.loaded = "true";
}

// ------------------------------------------------------------------ start
async function refresh() {
  showError("");
  try {
    await loadBlocks();
    await loadMetrics();
    if (state.selected && state.byId.has(state.selected)) await showBlock(state.selected);
    document.body.dataset.state = "ready";
  } catch (e) {
    if (!(e instanceof AuthError)) { showError(e.message); document.body.dataset.state = "error"; }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("#key-form").addEventListener("submit", ev => {
    ev.preventDefault();
    const k = $("#key-input").value.trim();
    if (k) sessionStorage.setItem(KEY_SLOT, k); else sessionStorage.removeItem(KEY_SLOT);
    $("#key-input").value = "";
    state.selected = null;
    $("#detail").replaceChildren(el("p", { class: "note" }, "Click a block to see its text and receipts."));
    $("#router-hits").replaceChildren();
    refresh();
  });
  $("#key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_SLOT);
    location.reload();
  });
  $("#refresh").addEventListener("click", refresh);
  $("#metrics-refresh").addEventListener("click", () => loadMetrics().catch(e => showError(e.message)));
  $("#router-form").addEventListener("submit", route);
  refresh();
});
