// Audit log: every decision the policy took or declined, with its reason, newest first.

import { get, has, withQuery } from "./api.js";
import { esc, fmtTime, unavailable } from "./util.js";

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

function summary(entry) {
  const skip = new Set(["id", "ts", "timestamp", "at", "kind", "type", "message", "reason", "decision"]);
  const rest = Object.entries(entry).filter(([k, v]) => !skip.has(k) && v !== null && v !== undefined);
  return rest.map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
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
    rows = rows.filter((e) => JSON.stringify(e).includes(params.migration));
  }
  const el = root.querySelector("#audit-list");
  el.innerHTML = rows.length
    ? `<table class="compact"><thead><tr><th>time</th><th>kind</th><th>decision / message</th><th>details</th></tr></thead><tbody>
      ${rows.slice(0, 500).map((e) => `<tr><td>${fmtTime(e.ts ?? e.timestamp ?? e.at)}</td><td>${esc(e.kind ?? e.type ?? "")}</td>
        <td>${esc(e.decision ?? "")} ${esc(e.message ?? e.reason ?? "")}</td><td class="mono small">${esc(summary(e))}</td></tr>`).join("")}
      </tbody></table>`
    : `<p class="muted">No audit entry in the last 24 hours${params.migration ? " for this migration" : ""}.</p>`;
}
