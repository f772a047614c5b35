// GPU page: risk now and why, telemetry over a chosen window, Xids and migrations on the axis.
//
// Samples are read once for the window, then only what arrived since the newest one (every
// update appends and trims), so a 24-hour window does not re-read 86,400 rows every 2 s.
// Cumulative counters are shown as rates per minute; a counter that went backwards (driver
// reload, reboot) restarts from its new value instead of drawing a negative spike.

import uPlot from "../vendor/uPlot.esm.js";
import { get, getAll, has, withQuery } from "./api.js";
import {
  ago, esc, fmtNum, fmtPct, fmtTime, nodeHref, parseTs, riskClass, unavailable,
} from "./util.js";
import { migrationGpu, migrationState, requestedAt, thresholdOf } from "./shapes.js";

export const section = "fleet";
export const title = (p) => `${p.node} GPU ${p.gpu}`;

const WINDOWS = [
  ["5m", 5 * 60],
  ["15m", 15 * 60],
  ["1h", 3600],
  ["6h", 6 * 3600],
  ["24h", 24 * 3600],
];
const FIELDS = [
  "temp_gpu_c", "temp_mem_c", "power_w", "sm_clock_mhz", "mem_clock_mhz",
  "ecc_sbe_volatile", "ecc_dbe_volatile", "remap_correctable", "remap_uncorrectable",
  "remap_pending", "remap_failure", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay",
  "nvlink_recovery", "pcie_replay", "pcie_link_width", "pcie_link_width_max",
];
const ROW_LIMIT = 100_000;

const C = {
  red: "#ff6b6b", orange: "#ffa94d", yellow: "#ffd43b", green: "#69db7c",
  blue: "#74c0fc", violet: "#b197fc", grey: "#adb5bd", pink: "#f783ac",
};

// Each chart: title, unit, series [label, colour, value(row arrays, i) or column name].
const CHARTS = [
  { id: "temps", title: "Temperature", unit: "°C", series: [["GPU", C.orange, "temp_gpu_c"], ["memory (HBM)", C.yellow, "temp_mem_c"]] },
  { id: "power", title: "Power", unit: "W", series: [["power", C.violet, "power_w"]] },
  { id: "clocks", title: "Clocks", unit: "MHz", series: [["SM", C.blue, "sm_clock_mhz"], ["memory", C.green, "mem_clock_mhz"]] },
  { id: "ecc", title: "ECC errors", unit: "/min", series: [["corrected", C.yellow, "rate:ecc_sbe_volatile"], ["uncorrected", C.red, "rate:ecc_dbe_volatile"]] },
  { id: "remap", title: "Row remapping", unit: "rows / flag", series: [["remapped (corr.)", C.yellow, "remap_correctable"], ["remapped (uncorr.)", C.orange, "remap_uncorrectable"], ["pending", C.red, "remap_pending"], ["failure", C.pink, "remap_failure"]] },
  { id: "nvlink", title: "NVLink errors", unit: "/min", series: [["CRC flit", C.orange, "rate:nvlink_crc_flit"], ["CRC data", C.red, "rate:nvlink_crc_data"], ["replay", C.yellow, "rate:nvlink_replay"], ["recovery", C.pink, "rate:nvlink_recovery"]] },
  { id: "pcie", title: "PCIe", unit: "replays/min · lanes", series: [["replays", C.red, "rate:pcie_replay"], ["link width", C.blue, "pcie_link_width"], ["max width", C.grey, "pcie_link_width_max"]] },
];

let root = null;
let mounts = 0; // which mount is current: one that awaited past its unmount stops there
let params = null;
let windowS = 3600;
let cols = null; // column arrays of the samples in the window
let risk = { t: [], v: [] };
let riskLatest = null; // [t seconds, risk] of the newest score, drawn after the history
let marks = [];
let charts = new Map();
let resize = null;
let threshold = null;
let xRange = [0, 1]; // seconds: the window, shared by every chart

export async function mount(el, p) {
  const mine = ++mounts;
  root = el;
  params = p;
  const chosen = WINDOWS.find(([k]) => k === p.window);
  windowS = chosen ? chosen[1] : 3600; // until the data says which window fits (below)
  cols = null;
  risk = { t: [], v: [] };
  riskLatest = null;
  marks = [];
  charts = new Map();
  threshold = null;
  const windowButtons = WINDOWS.map(([k, s]) =>
    `<button type="button" data-window="${s}" aria-pressed="${s === windowS}">${k}</button>`).join("");
  el.innerHTML = `
    <section class="gpu">
      <div class="page-head">
        <h1>${esc(p.node)} · GPU ${p.gpu}</h1>
        <a href="${nodeHref(p.node)}">node ${esc(p.node)} (drain, collectors)</a>
        <a href="#/">← fleet</a>
      </div>
      <div class="gpu-now" id="gpu-now"><p class="muted">loading…</p></div>
      <div class="toolbar" role="group" aria-label="Time window">
        <span class="muted">Window</span> ${windowButtons}
        <span class="muted" id="gpu-rows"></span>
      </div>
      <div class="charts">
        <figure class="chart wide" id="chart-risk" data-points="0"><figcaption>Risk of failing within the horizon</figcaption><div class="plot"></div></figure>
        ${CHARTS.map((c) => `<figure class="chart" id="chart-${c.id}" data-points="0"><figcaption>${esc(c.title)} <span class="muted">${esc(c.unit)}</span></figcaption><div class="plot"></div></figure>`).join("")}
      </div>
      <div class="two">
        <section><h2>Events</h2><div id="gpu-events"></div></section>
        <section><h2>Migrations</h2><div id="gpu-migrations"></div></section>
      </div>
    </section>`;
  for (const b of el.querySelectorAll("[data-window]")) {
    b.addEventListener("click", () => {
      windowS = Number(b.dataset.window);
      for (const o of el.querySelectorAll("[data-window]")) o.setAttribute("aria-pressed", String(o === b));
      cols = null;
      risk = { t: [], v: [] };
      riskLatest = null;
      refresh().catch(() => {});
    });
  }
  if (!chosen) {
    windowS = await fittingWindow(p);
    if (mine !== mounts || root !== el) return; // the operator left the page meanwhile
    for (const o of el.querySelectorAll("[data-window]")) {
      o.setAttribute("aria-pressed", String(Number(o.dataset.window) === windowS));
    }
  }
  resize = new ResizeObserver(() => {
    for (const [id, u] of charts) u.setSize(sizeOf(document.getElementById(id)));
  });
  resize.observe(el.querySelector(".charts"));
}

export function unmount() {
  if (resize) resize.disconnect();
  for (const u of charts.values()) u.destroy();
  charts = new Map();
  root = null;
}

const iso = (ms) => new Date(ms).toISOString();

// Without a window in the address: the smallest that holds this GPU's samples of the last
// day with some room (a demo's few minutes fill the charts instead of their right edge).
async function fittingWindow(p) {
  const day = 24 * 3600;
  try {
    const first = await get(withQuery(`/v1/gpus/${encodeURIComponent(p.node)}/${p.gpu}/samples`, {
      since: iso(Date.now() - day * 1000), fields: "temp_gpu_c", limit: 1,
    }));
    const ts = first.data && first.data.length ? parseTs(first.data[0].ts) : null;
    if (ts === null) return 3600;
    const span = (Date.now() - ts) / 1000;
    return (WINDOWS.find(([, s]) => s >= span * 1.25) || WINDOWS[WINDOWS.length - 1])[1];
  } catch {
    return 3600;
  }
}

export async function refresh() {
  const p = params;
  const now = Date.now();
  const since = now - windowS * 1000;
  const base = `/v1/gpus/${encodeURIComponent(p.node)}/${p.gpu}`;
  const from = cols && cols.ts.length ? cols.ts[cols.ts.length - 1] + 1 : since;
  const riskFrom = risk.t.length ? risk.t[risk.t.length - 1] * 1000 + 1 : since;
  const [items, rows, events, riskRows, migrations, policy] = await Promise.all([
    getAll(withQuery("/v1/gpus", { node: p.node })),
    get(withQuery(`${base}/samples`, {
      since: iso(from), fields: FIELDS.join(","), limit: ROW_LIMIT, shape: "columns", stats: "false",
    })),
    get(withQuery("/v1/events", { node: p.node, gpu: p.gpu, since: iso(since), limit: 500 })),
    has("GET /v1/gpus/{node}/{gpu}/risk") ? get(withQuery(`${base}/risk`, { since: iso(riskFrom) })).catch(() => null) : null,
    has("GET /v1/migrations") ? get("/v1/migrations?limit=500").then((b) => b.data).catch(() => null) : null,
    threshold === null && has("GET /v1/policy") ? get("/v1/policy").catch(() => null) : null,
  ]);
  if (!root || p !== params) return;
  if (policy) threshold = thresholdOf(policy);
  const item = items.find((it) => it.gpu === p.gpu) || null;
  appendSamples(rows.columns || { ts: [] }, since);
  appendRisk(riskRows, since);
  const mine = Array.isArray(migrations)
    ? migrations.filter((m) => {
        const g = migrationGpu(m);
        return g && g.node === p.node && g.gpu === p.gpu;
      })
    : null;
  marks = [
    ...(events.data || []).map((e) => ({
      t: parseTs(e.ts) / 1000,
      color: e.kind === "xid" ? C.red : C.grey,
      label: e.kind === "xid" ? `Xid ${e.xid}` : e.kind,
    })),
    ...(mine || []).map((m) => ({
      t: parseTs(requestedAt(m)) / 1000,
      color: C.blue,
      label: `migration ${migrationState(m)}`,
      dash: [4, 3],
    })),
  ];
  renderNow(item);
  renderEvents(events.data || []);
  renderMigrations(mine);
  drawCharts(since);
}

// `got`: the samples route's columns (shape=columns), each name's values in row order.
function appendSamples(got, since) {
  if (!cols) {
    cols = { ts: [] };
    for (const f of FIELDS) cols[f] = [];
  }
  const n = got.ts ? got.ts.length : 0;
  for (const t of got.ts || []) cols.ts.push(parseTs(t));
  for (const f of FIELDS) {
    const values = got[f] || [];
    for (let i = 0; i < n; i++) {
      const v = values[i];
      cols[f].push(v === true ? 1 : v === false ? 0 : v ?? null);
    }
  }
  let drop = 0;
  while (drop < cols.ts.length && cols.ts[drop] < since) drop++;
  if (drop) for (const k of Object.keys(cols)) cols[k].splice(0, drop);
  root.querySelector("#gpu-rows").textContent =
    `${cols.ts.length.toLocaleString("en")} samples${n >= ROW_LIMIT ? " (first 100,000 of the window)" : ""}`;
}

function appendRisk(body, since) {
  if (!body) return;
  const latest = body.latest;
  riskLatest = latest && typeof latest.risk === "number" && latest.scored_at
    ? [parseTs(latest.scored_at) / 1000, latest.risk] : null;
  const rows = body.data || [];
  for (const r of rows) {
    const t = parseTs(r.ts ?? r.scored_at ?? r.t);
    if (t === null || typeof r.risk !== "number") continue;
    risk.t.push(t / 1000);
    risk.v.push(r.risk);
  }
  let drop = 0;
  while (drop < risk.t.length && risk.t[drop] * 1000 < since) drop++;
  if (drop) {
    risk.t.splice(0, drop);
    risk.v.splice(0, drop);
  }
}

// Per-minute rate of a cumulative counter; null across gaps, restart after a reset.
function rate(name) {
  const ts = cols.ts;
  const v = cols[name];
  const out = new Array(ts.length).fill(null);
  let prevT = null;
  let prevV = null;
  for (let i = 0; i < ts.length; i++) {
    const x = v[i];
    if (x === null) continue;
    if (prevV !== null) {
      const dt = (ts[i] - prevT) / 60_000;
      const d = x >= prevV ? x - prevV : x;
      if (dt > 0) out[i] = d / dt;
    }
    prevT = ts[i];
    prevV = x;
  }
  return out;
}

function column(spec) {
  return spec.startsWith("rate:") ? rate(spec.slice(5)) : cols[spec];
}

function sizeOf(fig) {
  const w = Math.max(260, fig.clientWidth - 8);
  return { width: w, height: fig.classList.contains("wide") ? 180 : 150 };
}

function markersPlugin() {
  return {
    hooks: {
      draw: [
        (u) => {
          const { ctx } = u;
          const { left, top, width, height } = u.bbox;
          const dpr = devicePixelRatio || 1;
          ctx.save();
          ctx.font = `${11 * dpr}px system-ui, sans-serif`;
          ctx.lineWidth = dpr;
          let row = 0;
          for (const m of marks) {
            if (!Number.isFinite(m.t)) continue;
            const x = Math.round(u.valToPos(m.t, "x", true));
            if (x < left || x > left + width) continue;
            ctx.strokeStyle = m.color;
            ctx.setLineDash((m.dash || []).map((d) => d * dpr));
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
            ctx.fillStyle = m.color;
            ctx.fillText(m.label, x + 3 * dpr, top + (12 + 13 * (row++ % 3)) * dpr); // labels stack
          }
          ctx.restore();
        },
      ],
    },
  };
}

const axis = { stroke: "#c9d1d9", grid: { stroke: "#2a313b", width: 1 }, ticks: { stroke: "#2a313b" } };

// 0 to a little above the larger of the threshold and the highest risk: low risks stay visible.
const riskRange = (u, min, max) => [0, Math.min(1, Math.max((max || 0) * 1.15, (threshold ?? 0) * 1.5, 0.02))];

// The policy threshold as a dashed line across the risk chart.
function thresholdPlugin() {
  return {
    hooks: {
      draw: [
        (u) => {
          if (threshold === null) return;
          const { ctx } = u;
          const { left, width } = u.bbox;
          const dpr = devicePixelRatio || 1;
          const y = Math.round(u.valToPos(threshold, "y", true));
          ctx.save();
          ctx.strokeStyle = C.grey;
          ctx.lineWidth = dpr;
          ctx.setLineDash([6 * dpr, 4 * dpr]);
          ctx.beginPath();
          ctx.moveTo(left, y);
          ctx.lineTo(left + width, y);
          ctx.stroke();
          ctx.fillStyle = C.grey;
          ctx.font = `${11 * dpr}px system-ui, sans-serif`;
          ctx.textAlign = "right";
          ctx.fillText(`threshold ${(100 * threshold).toFixed(1)} %`, left + width - 4 * dpr, y - 4 * dpr);
          ctx.restore();
        },
      ],
    },
  };
}

function makeChart(id, labels, minMax, withThreshold = false) {
  const fig = document.getElementById(id);
  const opts = {
    ...sizeOf(fig),
    cursor: { sync: { key: "gpu" } },
    scales: { x: { time: true, range: () => xRange }, ...(minMax ? { y: { range: minMax } } : {}) },
    axes: [{ ...axis }, { ...axis, size: 56 }],
    legend: { live: true },
    series: [{}, ...labels.map(([label, color]) => ({
      label, stroke: color, width: 1.5, spanGaps: withThreshold,
      // few points (a sparse risk history): show them, a lone point has no line
      points: withThreshold ? { show: (u) => u.data[0].length < 120, size: 5 } : { show: false },
    }))],
    plugins: withThreshold ? [markersPlugin(), thresholdPlugin()] : [markersPlugin()],
  };
  const u = new uPlot(opts, [[], ...labels.map(() => [])], fig.querySelector(".plot"));
  charts.set(id, u);
  return u;
}

function setData(id, u, data) {
  u.setData(data, true);
  let points = 0;
  for (let s = 1; s < data.length; s++) for (const v of data[s]) if (v !== null && v !== undefined) points++;
  document.getElementById(id).dataset.points = String(points);
}

function drawCharts(since) {
  xRange = [since / 1000, Date.now() / 1000];
  const xs = cols.ts.map((t) => t / 1000);
  for (const c of CHARTS) {
    const id = `chart-${c.id}`;
    const u = charts.get(id) || makeChart(id, c.series.map(([l, col]) => [l, col]));
    setData(id, u, [xs, ...c.series.map(([, , spec]) => column(spec))]);
  }
  const riskFig = document.getElementById("chart-risk");
  if (!has("GET /v1/gpus/{node}/{gpu}/risk")) {
    if (!riskFig.querySelector(".unavailable")) {
      riskFig.querySelector(".plot").innerHTML = unavailable("Risk history", "GET /v1/gpus/{node}/{gpu}/risk");
    }
    return;
  }
  const u = charts.get("chart-risk") || makeChart("chart-risk", [["risk", C.red]], riskRange, true);
  const t = [...risk.t];
  const v = [...risk.v];
  if (riskLatest && (!t.length || riskLatest[0] > t[t.length - 1])) {
    t.push(riskLatest[0]);
    v.push(riskLatest[1]);
  }
  setData("chart-risk", u, [t, v]);
}

function renderNow(item) {
  const el = root.querySelector("#gpu-now");
  if (!item) {
    el.innerHTML = `<p class="note">No recent sample of this GPU.</p>`;
    return;
  }
  const failure = item.failure || null;
  if (item.failed) {
    el.innerHTML = `
      <div class="risk-now failed" data-state="failed"><span class="muted">state</span><strong>failed</strong>
        <span class="badge bad">failed</span>
        <span class="muted">${failure ? `${esc(failure.cause)} ${ago(failure.at)}` : ""}; last sample ${ago(item.ts)}</span></div>
      <div class="why"><h2>What now</h2><p>This GPU failed and has sent nothing since: its last risk score no
        longer applies. Any rank it served was moved (see Migrations below); replace or reset it, and
        it shows as recovered once its collector reports again.</p></div>`;
    return;
  }
  const reasons = item.reasons && item.reasons.length
    ? `<ul class="reasons">${item.reasons.map((r) => `<li>${esc(r)}</li>`).join("")}</ul>`
    : `<p class="muted">${typeof item.risk === "number" ? "Nothing stands out." : "Not scored yet."}</p>`;
  const riskText = typeof item.risk === "number" ? fmtPct(item.risk) : "–";
  const badges = [
    item.recovered ? `<span class="badge ok" data-state="recovered" title="${failure ? esc(`after ${failure.cause} ${ago(failure.at)}`) : ""}">recovered</span>` : "",
    item.alarm ? `<span class="badge bad">alarm</span>` : "",
    item.stale ? `<span class="badge warn">stale</span>` : "",
  ].join(" ");
  el.innerHTML = `
    <div class="risk-now ${riskClass(item)}"><span class="muted">risk</span><strong>${riskText}</strong>${badges}
      <span class="muted">${threshold !== null ? `threshold ${fmtPct(threshold)}` : ""}</span>
      <span class="muted">${item.scored_at ? `scored ${ago(item.scored_at)}` : ""}</span></div>
    <div class="why"><h2>Why</h2>${reasons}</div>
    <dl class="facts">
      <dt>last sample</dt><dd>${ago(item.ts)}</dd>
      <dt>temperature</dt><dd>${fmtNum(item.temp_gpu_c)} °C</dd>
      <dt>power</dt><dd>${fmtNum(item.power_w)} W</dd>
      <dt>PCIe</dt><dd>x${item.pcie_link_width ?? "–"}${item.pcie_link_width_max ? ` of x${item.pcie_link_width_max}` : ""} gen ${item.pcie_link_gen ?? "–"}</dd>
      <dt>remap pending</dt><dd>${item.remap_pending ? "yes" : item.remap_pending === false ? "no" : "–"}</dd>
      <dt>UUID</dt><dd class="mono">${esc(item.uuid ?? "–")}</dd>
    </dl>`;
}

function renderEvents(events) {
  const el = root.querySelector("#gpu-events");
  if (!events.length) {
    el.innerHTML = `<p class="muted">No events in this window.</p>`;
    return;
  }
  el.innerHTML = `<table class="compact"><thead><tr><th>time</th><th>kind</th><th>Xid</th><th>message</th></tr></thead><tbody>
    ${events.slice(0, 50).map((e) => `<tr><td>${fmtTime(e.ts)}</td><td>${esc(e.kind)}</td><td>${esc(e.xid ?? "")}</td><td>${esc(e.message ?? "")}</td></tr>`).join("")}
    </tbody></table>`;
}

function renderMigrations(list) {
  const el = root.querySelector("#gpu-migrations");
  if (list === null) {
    el.innerHTML = has("GET /v1/migrations") ? `<p class="muted">Could not read migrations.</p>` : unavailable("Migrations", "GET /v1/migrations");
    return;
  }
  if (!list.length) {
    el.innerHTML = `<p class="muted">No migration from this GPU.</p>`;
    return;
  }
  el.innerHTML = `<table class="compact"><thead><tr><th>requested</th><th>job/rank</th><th>trigger</th><th>state</th></tr></thead><tbody>
    ${list.slice(0, 20).map((m) => `<tr><td>${fmtTime(requestedAt(m))}</td><td><a href="#/jobs/${encodeURIComponent(m.job_id)}">${esc(m.job_id)}</a>/${esc(m.rank)}</td><td>${esc(m.trigger ?? "")}</td><td><a href="#/audit?migration=${encodeURIComponent(m.id)}">${esc(migrationState(m))}</a></td></tr>`).join("")}
    </tbody></table>`;
}
