// Fleet view: every GPU as one cell of a canvas, coloured by risk, grouped by node.
//
// One canvas, redrawn in one pass per update (every cell and its marks written into one pixel
// buffer, put on the canvas at once; the layout kept while the set of GPUs and the window stay the same),
// so 16,384 GPUs cost a few milliseconds and no DOM nodes; the pointer and the keyboard find
// a cell by arithmetic on the layout, not by listeners per cell. The text around it (counts,
// the GPUs most at risk) is one small innerHTML build per update.

import { get, getAll, has, parseTotalMs, serverNow } from "./api.js";
import { jobIdOf, ranksOf, thresholdOf } from "./shapes.js";
import {
  RISK_COLORS, ago, esc, fmtPct, gpuHref, natural, nodeHref, parseTs, riskBucket,
} from "./util.js";

export const section = "fleet";
export const title = () => "Fleet";

const STALE_AFTER_MS = 30_000; // used only when the service does not flag staleness itself
const TOP_AT_RISK = 12;
const COLOR_NONE = "#474d57"; // not scored yet
const COLOR_STALE = "#8b939e";
const COLOR_DRAINED = "#1b2430";
const FOCUS = "#ffffff";

let root = null;
let canvas = null;
let ctx = null;
let tip = null;
let data = null; // the last update: items, derived states, nodes, jobs, policy, migrations
let layout = null;
let focus = -1; // index into layout.order
let filter = { node: "", job: "", state: "all" };
let nodeOrder = { key: "", names: [] };
let resizeObserver = null;
let firstRender = true;
let nodesKey = ""; // which GPUs the last answer held (the layout is kept while it is the same)

export async function mount(el, params) {
  root = el;
  filter = { node: params.node || "", job: params.job || "", state: params.state || "all" };
  focus = -1;
  firstRender = true;
  el.innerHTML = `
    <section class="fleet">
      <div class="summary" id="fleet-summary" aria-live="off"></div>
      <form class="filters" id="fleet-filters" role="search">
        <label>Node <input id="f-node" type="search" placeholder="name contains…"
          value="${esc(filter.node)}" autocomplete="off"></label>
        <label>Job <select id="f-job"><option value="">all jobs</option></select></label>
        <label>State <select id="f-state">
          <option value="all">all GPUs</option>
          <option value="at-risk">at risk</option>
          <option value="failed">failed</option>
          <option value="recovered">recovered</option>
          <option value="stale">stale</option>
          <option value="drained">drained</option>
          <option value="spare">spares</option>
        </select></label>
        <span id="f-count" class="muted"></span>
      </form>
      <div class="fleet-body">
        <div class="map-wrap" id="map-wrap">
          <canvas id="fleet-map" tabindex="0" role="img"
            aria-label="GPU risk map. Arrow keys move between GPUs, Enter opens one."></canvas>
          <div class="tip" id="fleet-tip" hidden></div>
          <p class="sr-only" id="fleet-focus" aria-live="polite"></p>
        </div>
        <aside class="side">
          <h2>Most at risk</h2>
          <div id="fleet-top"></div>
          <h2>Legend</h2>
          <ul class="legend" id="fleet-legend"></ul>
        </aside>
      </div>
    </section>`;
  canvas = el.querySelector("#fleet-map");
  ctx = canvas.getContext("2d", { alpha: false });
  tip = el.querySelector("#fleet-tip");
  el.querySelector("#f-state").value = filter.state;
  el.querySelector("#fleet-legend").innerHTML = legendHtml();
  el.querySelector("#fleet-filters").addEventListener("submit", (ev) => ev.preventDefault());
  el.querySelector("#f-node").addEventListener("input", (ev) => setFilter({ node: ev.target.value }));
  el.querySelector("#f-job").addEventListener("change", (ev) => setFilter({ job: ev.target.value }));
  el.querySelector("#f-state").addEventListener("change", (ev) => setFilter({ state: ev.target.value }));
  canvas.addEventListener("mousemove", onHover);
  canvas.addEventListener("mouseleave", () => (tip.hidden = true));
  canvas.addEventListener("click", onClick);
  canvas.addEventListener("keydown", onKey);
  resizeObserver = new ResizeObserver(() => data && draw());
  resizeObserver.observe(el.querySelector("#map-wrap"));
}

export function unmount() {
  if (resizeObserver) resizeObserver.disconnect();
  resizeObserver = null;
  root = canvas = ctx = tip = data = layout = null;
}

function setFilter(change) {
  filter = { ...filter, ...change };
  focus = -1;
  const q = new URLSearchParams(Object.entries(filter).filter(([k, v]) => v && !(k === "state" && v === "all")));
  history.replaceState(null, "", q.toString() ? `#/?${q}` : "#/");
  if (data) draw();
}

// ---- data ---------------------------------------------------------------------------------

async function optional(route, fn) {
  if (!has(route)) return null;
  try {
    return await fn();
  } catch (err) {
    if (err.status === 401) throw err;
    return { error: err };
  }
}

// Slow-changing answers (placements, collectors) are read every SLOW_MS, not every tick.
const SLOW_MS = 10_000;
const slow = new Map();
async function every(key, fn) {
  const hit = slow.get(key);
  if (hit && performance.now() - hit.at < SLOW_MS) return hit.value;
  const value = await fn();
  slow.set(key, { at: performance.now(), value });
  return value;
}

// Every GPU as {node, gpu, risk, alarm, stale, failed, seen (ms), reasons}: from the map's own
// columnar route when the service has it, else from the newest samples (GET /v1/gpus).
async function readCells() {
  if (has("GET /v1/dashboard/cells")) {
    const c = await get("/v1/dashboard/cells");
    nodesKey = `${c.count}|${c.nodes.join("\n")}`;
    const items = new Array(c.count);
    for (let i = 0; i < c.count; i++) {
      items[i] = {
        node: c.nodes[c.node[i]], gpu: c.gpu[i], risk: c.risk[i], alarm: c.alarm[i],
        stale: c.stale[i], failed: c.failed[i], recovered: c.recovered ? c.recovered[i] : false,
        seen: c.last_seen_ms[i], reasons: c.reasons[i] || null,
      };
    }
    return items;
  }
  const now = serverNow();
  const gpus = await getAll("/v1/gpus");
  nodesKey = `${gpus.length}|${[...new Set(gpus.map((g) => g.node))].join("\n")}`;
  return gpus.map((g) => {
    const seen = parseTs(g.ts);
    return {
      node: g.node, gpu: g.gpu, risk: g.risk ?? null, alarm: g.alarm ?? false,
      stale: g.stale ?? now - seen > STALE_AFTER_MS, failed: g.failed ?? false, recovered: false,
      seen, reasons: g.reasons || null,
    };
  });
}

async function inFlight() {
  const states = ["requested", "acknowledged", "transferring"];
  const pages = await Promise.all(states.map((st) => get(`/v1/migrations?state=${st}&limit=10000`)));
  return pages.reduce((n, p) => n + (p.count ?? (p.data || []).length), 0);
}

export async function refresh() {
  const t0 = performance.now();
  const parsed0 = parseTotalMs();
  const [items, nodes, drains, jobs, policy, migrations] = await Promise.all([
    readCells(),
    every("nodes", () => getAll("/v1/nodes")),
    optional("GET /v1/drains", () => getAll("/v1/drains")),
    optional("GET /v1/jobs", () => every("jobs", () => getAll("/v1/jobs"))),
    optional("GET /v1/policy", () => get("/v1/policy")),
    optional("GET /v1/migrations", inFlight),
  ]);
  const t1 = performance.now();
  if (!root) return;
  data = derive(items, nodes, drains, jobs, policy, migrations);
  draw();
  const t2 = performance.now();
  const stats = window.__forewarn.stats;
  stats.fleet = {
    cells: items.length,
    fetchMs: t1 - t0, // network, server and parsing
    parseMs: parseTotalMs() - parsed0, // main thread: JSON.parse of this update's answers
    renderMs: t2 - t1, // main thread: derive states, lay out, draw, text
    updates: (stats.fleet?.updates || 0) + 1,
  };
  if (firstRender) {
    firstRender = false;
    performance.mark("fleet-first-render");
  }
}

function derive(items, nodes, drains, jobs, policy, migrations) {
  const nodeInfo = new Map(nodes.map((n) => [n.node ?? n.name, n]));
  const drained = new Set();
  if (Array.isArray(drains)) for (const d of drains) if (d.drained !== false) drained.add(d.node);
  const placement = new Map(); // "node/gpu" -> {job, rank, role}
  const jobIds = [];
  if (Array.isArray(jobs)) {
    for (const job of jobs) {
      const id = jobIdOf(job);
      jobIds.push(id);
      for (const p of ranksOf(job)) {
        if (p.gpu === null || p.gpu === undefined || p.role === "retired") continue;
        placement.set(`${p.node}/${p.gpu}`, { job: id, rank: p.rank, role: p.role || "active" });
      }
    }
  }
  const n = items.length;
  // bit 1 at risk, 2 stale, 4 drained, 8 spare, 16 failed, 32 recovered. A failed GPU is
  // only failed: its last risk and its silence say nothing more.
  const state = new Uint8Array(n);
  for (let i = 0; i < n; i++) {
    const it = items[i];
    let s = 0;
    if (it.failed) s |= 16;
    else {
      if (it.alarm) s |= 1;
      if (it.stale) s |= 2;
      if (it.recovered) s |= 32;
    }
    if (drained.has(it.node)) s |= 4;
    if (placement.size) {
      const p = placement.get(`${it.node}/${it.gpu}`);
      if (p && p.role === "spare") s |= 8;
    }
    state[i] = s;
  }
  return {
    items, state, nodeInfo, drained, placement, jobIds, jobs, policy, migrations,
    threshold: thresholdOf(policy), nodesKey,
  };
}

function matches(i) {
  const it = data.items[i];
  const s = data.state[i];
  if (filter.node && !it.node.toLowerCase().includes(filter.node.toLowerCase())) return false;
  if (filter.job) {
    const p = data.placement.get(`${it.node}/${it.gpu}`);
    if (!p || p.job !== filter.job) return false;
  }
  switch (filter.state) {
    case "at-risk": return (s & 1) !== 0;
    case "failed": return (s & 16) !== 0;
    case "recovered": return (s & 32) !== 0;
    case "stale": return (s & 2) !== 0;
    case "drained": return (s & 4) !== 0;
    case "spare": return (s & 8) !== 0;
    default: return true;
  }
}

// ---- layout and drawing ---------------------------------------------------------------------

function sortedNodes(byNode) {
  const names = [...byNode.keys()];
  const key = names.length + "|" + names.join("\u0000");
  if (key !== nodeOrder.key) nodeOrder = { key, names: names.sort(natural) };
  return nodeOrder.names;
}

function computeLayout() {
  const byNode = new Map();
  let maxPerNode = 1;
  for (let i = 0; i < data.items.length; i++) {
    if (!matches(i)) continue;
    const node = data.items[i].node;
    let list = byNode.get(node);
    if (!list) byNode.set(node, (list = []));
    list.push(i);
    if (list.length > maxPerNode) maxPerNode = list.length;
  }
  const names = sortedNodes(byNode);
  const wrap = root.querySelector("#map-wrap");
  const width = Math.max(200, wrap.clientWidth);
  const avail = Math.max(240, window.innerHeight - wrap.getBoundingClientRect().top - 16);
  const cols = Math.min(maxPerNode, 8);
  const rows = Math.ceil(maxPerNode / 8);
  let size = 4;
  let geo = null;
  for (const s of [28, 22, 18, 14, 11, 9, 7, 6, 5, 4]) {
    const g = geometry(s, cols, rows, names.length, width);
    if (g.height <= avail || s === 4) {
      size = s;
      geo = g;
      break;
    }
  }
  const count = [...byNode.values()].reduce((a, l) => a + l.length, 0);
  const order = new Int32Array(count);
  const x = new Float32Array(count);
  const y = new Float32Array(count);
  const blocks = [];
  let k = 0;
  names.forEach((name, b) => {
    const list = byNode.get(name).sort((p, q) => data.items[p].gpu - data.items[q].gpu);
    const bx = (b % geo.perRow) * geo.blockW;
    const by = Math.floor(b / geo.perRow) * geo.blockH;
    blocks.push({ name, start: k, count: list.length, x: bx, y: by });
    list.forEach((i, j) => {
      order[k] = i;
      x[k] = bx + (j % cols) * geo.pitch;
      y[k] = by + geo.labelH + Math.floor(j / cols) * geo.pitch;
      k++;
    });
  });
  return { order, x, y, blocks, size, cols, width, ...geo };
}

function geometry(s, cols, rows, nBlocks, width) {
  const gap = s >= 14 ? 10 : s >= 7 ? 5 : 3;
  const pitch = s + (s >= 9 ? 2 : 1);
  const labelH = s >= 14 ? 14 : 0;
  const blockW = cols * pitch + gap;
  const blockH = labelH + rows * pitch + gap;
  const perRow = Math.max(1, Math.floor((width + gap) / blockW));
  const height = Math.ceil(nBlocks / perRow) * blockH;
  return { gap, pitch, labelH, blockW, blockH, perRow, height: Math.max(height, 40) };
}

// Colours as 32-bit RGBA words (little-endian byte order: 0xAABBGGRR) for the pixel buffer.
function word(hex) {
  const v = parseInt(hex.slice(1), 16);
  return (0xff << 24) | ((v & 0xff) << 16) | (v & 0xff00) | ((v >> 16) & 0xff);
}
const BG = "#12161c";
const WORD_BG = word(BG);
const WORD_RISK = RISK_COLORS.map(word);
const WORD_NONE = word(COLOR_NONE);
const WORD_STALE = word(COLOR_STALE);
const WORD_DRAINED = word(COLOR_DRAINED);
const WORD_DRAINED_EDGE = word("#6ea8fe");
const WORD_HATCH = word("#3b4452");
const WORD_RING = word("#ffffff");
const WORD_SPARE = word("#e8ecf1");
const WORD_FAILED = word("#2a0d10");
const WORD_CROSS = word("#ff5d5d");
const WORD_RECOVERED = word("#4cc38a");

let pixels = null; // reused between updates: {image, words, w, h}

function cellWord(i) {
  const s = data.state[i];
  if (s & 16) return WORD_FAILED;
  if (s & 4) return WORD_DRAINED;
  if (s & 2) return WORD_STALE;
  const b = riskBucket(data.items[i].risk, data.threshold);
  return b < 0 ? WORD_NONE : WORD_RISK[b];
}

// Every cell and its marks are written straight into one pixel buffer, put on the canvas at
// once; only the node labels and the keyboard focus are drawn on top.
function draw() {
  if (!root) return;
  const key = layoutKey();
  if (!layout || key === null || key !== layout.key) {
    layout = computeLayout();
    layout.key = key;
  }
  const dpr = window.devicePixelRatio || 1;
  const W = Math.round(layout.width * dpr);
  const H = Math.round(layout.height * dpr);
  if (canvas.width !== W || canvas.height !== H) {
    canvas.width = W;
    canvas.height = H;
    canvas.style.width = `${layout.width}px`;
    canvas.style.height = `${layout.height}px`;
  }
  if (!pixels || pixels.w !== W || pixels.h !== H) {
    const image = ctx.createImageData(W, H);
    pixels = { image, words: new Uint32Array(image.data.buffer), w: W, h: H };
  }
  const words = pixels.words;
  words.fill(WORD_BG);
  const { order, x, y, size } = layout;
  const side = Math.max(1, Math.round(size * dpr));
  const line = Math.max(1, Math.round(dpr)); // one CSS pixel
  const ring = size >= 7;
  for (let k = 0; k < order.length; k++) {
    const i = order[k];
    const x0 = Math.round(x[k] * dpr);
    const y0 = Math.round(y[k] * dpr);
    for (let r = 0; r < side; r++) {
      const at = (y0 + r) * W + x0;
      words.fill(cellWord(i), at, at + side);
    }
    const s = data.state[i];
    if (s & 63) mark(words, W, x0, y0, side, line, s, ring);
  }
  ctx.setTransform(1, 0, 0, 1, 0, 0);
  ctx.putImageData(pixels.image, 0, 0);
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  if (layout.labelH) {
    ctx.fillStyle = "#aab4c0";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    for (const b of layout.blocks) {
      const label = b.name.length > 14 ? `…${b.name.slice(-13)}` : b.name;
      ctx.fillText(label, b.x, b.y + 1, layout.blockW - layout.gap);
    }
  }
  if (focus >= order.length) focus = order.length - 1;
  if (focus >= 0) {
    ctx.strokeStyle = FOCUS;
    ctx.lineWidth = 2;
    ctx.strokeRect(x[focus] - 1.5, y[focus] - 1.5, size + 3, size + 3);
  }
  canvas.dataset.cells = String(order.length);
  canvas.dataset.gpus = String(data.items.length);
  renderText();
}

// The marks of one cell, in the pixel buffer too: a red cross for a failed GPU, an outline
// for a drained node (blue) or a GPU back from a failure (green), a diagonal for stale
// telemetry, a white ring for an alarm, a dot for a spare.
function mark(words, W, x0, y0, side, line, s, ring) {
  if (s & 16) {
    for (let r = 0; r < side; r++) {
      const at = (y0 + r) * W + x0;
      words.fill(WORD_CROSS, at + r, Math.min(at + r + line, at + side));
      const back = side - 1 - r;
      words.fill(WORD_CROSS, at + back, Math.min(at + back + line, at + side));
    }
  }
  if (s & 4) outline(words, W, x0, y0, side, 0, line, WORD_DRAINED_EDGE);
  else if (s & 32) outline(words, W, x0, y0, side, 0, line, WORD_RECOVERED);
  else if (s & 2) {
    for (let r = 0; r < side; r++) {
      const at = (y0 + side - 1 - r) * W + x0 + r;
      words.fill(WORD_HATCH, at, Math.min(at + line, (y0 + side - r) * W));
    }
  } else if (s & 1 && ring) outline(words, W, x0, y0, side, line, line, WORD_RING);
  if (s & 8) {
    const d = Math.max(line, Math.round(side / 3));
    const o = Math.floor((side - d) / 2);
    for (let r = 0; r < d; r++) {
      const at = (y0 + o + r) * W + x0 + o;
      words.fill(WORD_SPARE, at, at + d);
    }
  }
}

function outline(words, W, x0, y0, side, inset, line, c) {
  const a = x0 + inset;
  const b = x0 + side - inset; // exclusive
  const t = y0 + inset;
  const u = y0 + side - inset; // exclusive
  if (b - a <= 2 * line || u - t <= 2 * line) return;
  for (let r = t; r < u; r++) {
    const at = r * W;
    if (r < t + line || r >= u - line) words.fill(c, at + a, at + b);
    else {
      words.fill(c, at + a, at + a + line);
      words.fill(c, at + b - line, at + b);
    }
  }
}

// The layout depends on the window, the filter and which GPUs there are, not on their risk:
// it is kept across updates while those stay the same (null: always recompute).
function layoutKey() {
  if (filter.state !== "all" || filter.job) return null;
  const wrap = root.querySelector("#map-wrap");
  return `${wrap.clientWidth}|${window.innerHeight}|${filter.node}|${data.items.length}|${data.nodesKey}`;
}

// ---- text around the map ------------------------------------------------------------------

function countText(value) {
  if (value === null) return `<span class="muted" title="not available on this service">–</span>`;
  if (value && value.error) return `<span class="muted" title="${esc(value.error.explain())}">?</span>`;
  return `<strong>${esc(value)}</strong>`;
}

function renderText() {
  const { items, state, nodeInfo, policy, migrations, jobIds } = data;
  let atRisk = 0;
  let stale = 0;
  let failed = 0;
  for (let i = 0; i < items.length; i++) {
    if (state[i] & 1) atRisk++;
    if (state[i] & 2) stale++;
    if (state[i] & 16) failed++;
  }
  const drainedNodes = data.drained.size;
  let staleAgents = 0;
  const now = serverNow();
  for (const n of nodeInfo.values()) {
    for (const a of n.agents || []) {
      const limit = Math.max(STALE_AFTER_MS, 3000 * (a.interval_s || 1));
      if (a.stale ?? now - parseTs(a.last_seen) > limit) staleAgents++;
    }
  }
  const inFlight = migrations;
  let policyHtml = `<span class="muted" title="not available on this service">policy –</span>`;
  if (policy && !policy.error) {
    const p = policy.policy || policy;
    const dry = p.dry_run ? `<span class="badge warn">dry-run</span>` : `<span class="badge ok">acting</span>`;
    const tripped = !!policy.breaker_tripped_at;
    const breaker = tripped ? `<span class="badge bad">breaker tripped</span>` : `<span class="badge ok">breaker closed</span>`;
    const thr = data.threshold !== null ? ` threshold ${fmtPct(data.threshold)}` : "";
    // Floor rules whose own false alarms exceed the alarm budget on this fleet: the model
    // alone alarms on the GPUs they trip (GET /v1/policy, floor_budget.demoted).
    const demoted = (policy.floor_budget?.demoted || []).map((d) => d.rule);
    const floorOff = demoted.length
      ? ` <span class="badge warn" data-stat="floor-demoted" title="rules whose false alarms on healthy GPUs exceed the alarm budget on this fleet: not a floor here, the model decides the GPUs they trip">not a floor here: ${esc(demoted.join(", "))}</span>`
      : "";
    policyHtml = `${dry} ${breaker}${floorOff}<span class="muted">${esc(thr)}</span>`;
  }
  setHtml("#fleet-summary", `
    <span class="stat">GPUs <strong>${items.length.toLocaleString("en")}</strong></span>
    <span class="stat" data-stat="at-risk">at risk <strong>${atRisk}</strong></span>
    <span class="stat" data-stat="failed">failed <strong>${failed}</strong></span>
    <span class="stat" data-stat="stale-gpus">stale GPUs <strong>${stale}</strong></span>
    <span class="stat" data-stat="in-flight">migrations in flight ${countText(inFlight)}</span>
    <span class="stat" data-stat="drained">drained nodes ${has("GET /v1/drains") ? `<strong>${drainedNodes}</strong>` : countText(null)}</span>
    <span class="stat" data-stat="stale-collectors">stale collectors <strong>${staleAgents}</strong></span>
    <span class="stat policy">${policyHtml}</span>`);
  const jobSelect = root.querySelector("#f-job");
  const have = [...jobSelect.options].slice(1).map((o) => o.value).join("\u0000");
  if (have !== jobIds.join("\u0000")) {
    jobSelect.innerHTML = `<option value="">${jobIds.length || has("GET /v1/jobs") ? "all jobs" : "jobs not available"}</option>` +
      jobIds.map((id) => `<option value="${esc(id)}">${esc(id)}</option>`).join("");
    jobSelect.value = filter.job;
  }
  root.querySelector("#f-count").textContent = !items.length
    ? "No GPU has reported yet: start a collector (forewarn collect) or the simulator."
    : layout.order.length === items.length ? "" : `${layout.order.length.toLocaleString("en")} shown`;
  setHtml("#fleet-top", topHtml());
}

// Replace a part's markup only when it changed (no style and layout work for nothing).
function setHtml(selector, html) {
  const el = root.querySelector(selector);
  if (el.__html !== html) {
    el.innerHTML = html;
    el.__html = html;
  }
}

function topHtml() {
  const { items, state } = data;
  // One pass keeping the best TOP_AT_RISK (alarms first, then risk): no sort of the fleet.
  const key = (i) => (state[i] & 16 ? 4 : state[i] & 1 ? 2 : 0) + (items[i].risk ?? -1);
  const top = [];
  for (let i = 0; i < items.length; i++) {
    if (items[i].risk === null && !(state[i] & 17)) continue;
    const k = key(i);
    if (top.length === TOP_AT_RISK && k <= key(top[top.length - 1])) continue;
    let j = top.length < TOP_AT_RISK ? top.length : TOP_AT_RISK - 1;
    while (j > 0 && key(top[j - 1]) < k) {
      if (j < TOP_AT_RISK) top[j] = top[j - 1];
      j--;
    }
    top[j] = i;
  }
  if (!top.length) {
    return `<p class="muted">No risk scores yet${has("GET /v1/gpus/{node}/{gpu}/risk") ? "" : " (this service does not score GPUs)"}.</p>`;
  }
  const rows = top.map((i) => {
    const it = items[i];
    const failed = (state[i] & 16) !== 0;
    const reason = (it.reasons || [])[0] || (failed ? "failed" : "");
    return `<tr class="${state[i] & 1 ? "alarm" : ""}${failed ? " failed" : ""}">
      <td><a href="${gpuHref(it.node, it.gpu)}">${esc(it.node)}/${it.gpu}</a></td>
      <td class="num">${failed ? "failed" : it.risk === null ? "–" : fmtPct(it.risk)}</td>
      <td class="reason">${esc(reason)}</td></tr>`;
  });
  return `<table class="compact"><thead><tr><th>GPU</th><th>risk</th><th>why</th></tr></thead>
    <tbody>${rows.join("")}</tbody></table>`;
}

function legendHtml() {
  const swatch = (cls, label) => `<li><span class="sw ${cls}"></span>${label}</li>`;
  return [
    swatch("sw-r0", "low risk"),
    swatch("sw-r5", "nearing the threshold"),
    swatch("sw-r9", "over the threshold"),
    swatch("sw-alarm", "alarm (white ring)"),
    swatch("sw-none", "not scored yet"),
    swatch("sw-stale", "stale telemetry"),
    swatch("sw-failed", "failed (red cross): lost or a fatal Xid, no sample since"),
    swatch("sw-recovered", "recovered (green edge): reporting again after a failure"),
    swatch("sw-drained", "node drained"),
    swatch("sw-spare", "warm spare (dot)"),
  ].join("");
}

// ---- pointer and keyboard -------------------------------------------------------------------

function hit(px, py) {
  if (!layout) return -1;
  const col = Math.floor(px / layout.blockW);
  const row = Math.floor(py / layout.blockH);
  if (col < 0 || col >= layout.perRow || row < 0) return -1;
  const block = layout.blocks[row * layout.perRow + col];
  if (!block) return -1;
  const cx = Math.floor((px - block.x) / layout.pitch);
  const cy = Math.floor((py - block.y - layout.labelH) / layout.pitch);
  if (cx < 0 || cx >= layout.cols || cy < 0) return -1;
  const j = cy * layout.cols + cx;
  return j < block.count ? block.start + j : -1;
}

function describe(k) {
  const i = layout.order[k];
  const it = data.items[i];
  const s = data.state[i];
  const p = data.placement.get(`${it.node}/${it.gpu}`);
  const parts = [`${it.node} GPU ${it.gpu}`];
  if (s & 16) parts.push(`FAILED, last sample ${ago(it.seen)}`);
  else parts.push(typeof it.risk === "number" ? `risk ${fmtPct(it.risk)}` : "not scored");
  if (s & 32) parts.push("recovered");
  if (s & 1) parts.push("ALARM");
  if (s & 2) parts.push(`stale (last sample ${ago(it.seen)})`);
  if (s & 4) parts.push("node drained");
  if (p) parts.push(`${p.role === "spare" ? "spare of" : "rank " + p.rank + " of"} ${p.job}`);
  if (it.reasons && it.reasons.length) parts.push(it.reasons[0]);
  return parts.join(" · ");
}

function onHover(ev) {
  const r = canvas.getBoundingClientRect();
  const k = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (k < 0) {
    tip.hidden = true;
    canvas.style.cursor = "default";
    return;
  }
  canvas.style.cursor = "pointer";
  tip.textContent = describe(k);
  tip.hidden = false;
  const x = Math.min(ev.clientX - r.left + 14, canvas.clientWidth - tip.offsetWidth - 4);
  tip.style.left = `${Math.max(0, x)}px`;
  tip.style.top = `${ev.clientY - r.top + canvas.offsetTop + 14}px`;
}

function open(k) {
  const it = data.items[layout.order[k]];
  location.hash = gpuHref(it.node, it.gpu);
}

function onClick(ev) {
  const r = canvas.getBoundingClientRect();
  const k = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (k >= 0) open(k);
}

function blockOf(k) {
  let lo = 0;
  let hi = layout.blocks.length - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (layout.blocks[mid].start <= k) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

function onKey(ev) {
  if (!layout || !layout.order.length) return;
  const n = layout.order.length;
  let k = focus < 0 ? 0 : focus;
  const moveBlocks = (delta) => {
    const b = blockOf(k);
    const j = k - layout.blocks[b].start;
    const t = layout.blocks[Math.max(0, Math.min(layout.blocks.length - 1, b + delta))];
    return t.start + Math.min(j, t.count - 1);
  };
  switch (ev.key) {
    case "ArrowRight": k = focus < 0 ? 0 : Math.min(n - 1, k + 1); break;
    case "ArrowLeft": k = Math.max(0, k - 1); break;
    case "ArrowDown": k = moveBlocks(layout.perRow); break;
    case "ArrowUp": k = moveBlocks(-layout.perRow); break;
    case "PageDown": k = moveBlocks(layout.perRow * 10); break;
    case "PageUp": k = moveBlocks(-layout.perRow * 10); break;
    case "Home": k = 0; break;
    case "End": k = n - 1; break;
    case "Enter":
    case " ":
      if (focus >= 0) open(focus);
      ev.preventDefault();
      return;
    default: return;
  }
  ev.preventDefault();
  focus = k;
  draw();
  root.querySelector("#fleet-focus").textContent = describe(k);
}

// For the tests: the GPUs drawn, in drawing order.
// What the map's tooltip says of one GPU (read by the tests).
window.__forewarnDescribe = (node, gpu) => {
  if (!layout || !data) return null;
  const k = layout.order.findIndex((i) => data.items[i].node === node && data.items[i].gpu === gpu);
  return k < 0 ? null : describe(k);
};
window.__forewarnFleetCells = () =>
  layout && data ? [...layout.order].map((i) => `${data.items[i].node}/${data.items[i].gpu}`) : [];
