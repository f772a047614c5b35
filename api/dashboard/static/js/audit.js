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
        <td class="mono small">${esc(e.data && Object.keys(e.data).length ? JSON.stringify(e.data) : "")}</td></tr>`).join("")}
      </tbody></table>`
    : `<p class="muted">No audit entry in the last 24 hours${params.migration ? " for this migration" : ""}.</p>`;
}
