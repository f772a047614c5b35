// Audit log: every decision the policy took or declined, with its reason, newest first.

import { get, has, withQuery } from "./api.js";
import { esc, fmtTime, gpuHref, unavailable } from "./util.js";

export const section = "audit";
export const title = () => "Audit";

let root = null;
let params = null;

export async function mount(el, p) {
  root = el;
  params = p;
  el.innerHTML = `<section><div class="page-head"><h1>Audit log</h1>
    ${p.migration ? `<span class="muted">entries of migration <code>${esc(p.migration)}</code> · <a href="#/audit">all</a></span>` : ""}</div>
    <div id="audit-list"></div></section>`;
}

export function unmount() {
  root = null;
}

function subject(e) {
  const parts = [];
  if (e.node) parts.push(e.gpu !== null && e.gpu !== undefined ? `<a href="${gpuHref(e.node, e.gpu)}">${esc(e.node)}/${esc(e.gpu)}</a>` : esc(e.node));
  if (e.job_id) parts.push(`job <a href="#/jobs/${encodeURIComponent(e.job_id)}">${esc(e.job_id)}</a>`);
  if (e.migration_id) parts.push(`migration <code>${esc(e.migration_id)}</code>`);
  return parts.join(" · ");
}

// An entry's data as "name: value" lines (a GPU as node/index, risks as percentages, lists
// joined), not as raw JSON; what has no plain form stays JSON.
function details(data) {
  if (!data || typeof data !== "object" || !Object.keys(data).length) return "";
  const plain = (key, v) => {
    if (v === null || v === undefined || v === "") return "–";
    if (typeof v === "number" && /risk|threshold/.test(key) && v >= 0 && v <= 1) return `${(v * 100).toFixed(1)} %`;
    if (Array.isArray(v)) return v.map((x) => plain(key, x)).join("; ");
    if (typeof v === "object" && "node" in v) return v.gpu !== null && v.gpu !== undefined ? `${v.node}/${v.gpu}${v.slot !== undefined && v.slot !== null ? ` (slot ${v.slot})` : ""}` : String(v.node);
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  };
  return `<dl class="audit-data" data-audit-data>${Object.entries(data)
    .map(([k, v]) => `<dt>${esc(k.replaceAll("_", " "))}</dt><dd>${esc(plain(k, v))}</dd>`).join("")}</dl>`;
}

export async function refresh() {
  if (!has("GET /v1/audit")) {
    root.innerHTML = `<section><h1>Audit log</h1>${unavailable("The audit log", "GET /v1/audit")}</section>`;
    return;
  }
  const since = new Date(Date.now() - 24 * 3600 * 1000).toISOString();
  const body = await get(withQuery("/v1/audit", { since, migration: params.migration }));
  if (!root) return;
  let rows = body.data || [];
  if (params.migration) {
    rows = rows.filter((e) => e.migration_id === params.migration);
  }
  const el = root.querySelector("#audit-list");
  el.innerHTML = rows.length
    ? `<table class="compact"><thead><tr><th>time</th><th>kind</th><th>action</th><th>reason</th><th>about</th><th>data</th></tr></thead><tbody>
      ${rows.slice(0, 500).map((e) => `<tr data-audit="${esc(e.seq)}"><td>${fmtTime(e.at)}</td><td>${esc(e.kind)}</td>
        <td><strong>${esc(e.action)}</strong></td><td>${esc(e.reason)}</td><td>${subject(e)}</td>
        <td class="small">${details(e.data)}</td></tr>`).join("")}
      </tbody></table>`
    : `<p class="muted">No audit entry in the last 24 hours${params.migration ? " for this migration" : ""}.</p>`;
}
