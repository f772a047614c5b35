// Webhooks: subscriptions and each one's recent deliveries (admin scope).

import { get, getAll, has, hasScope } from "./api.js";
import { errorNote, esc, fmtTime, unavailable } from "./util.js";

export const section = "webhooks";
export const title = () => "Webhooks";

let root = null;
let selected = null;

export async function mount(el) {
  root = el;
  selected = null;
  const hint = hasScope("admin") === false
    ? `<span class="muted" data-scope-hint="admin">Reading subscriptions needs a token with the <code>admin</code> scope.</span>`
    : "";
  el.innerHTML = `<section><div class="page-head"><h1>Webhooks</h1>${hint}</div>
    <div id="wh-list"></div><h2 id="wh-del-title">Recent deliveries</h2><div id="wh-deliveries"></div></section>`;
}

export function unmount() {
  root = null;
}

export async function refresh() {
  if (!has("GET /v1/webhooks")) {
    root.innerHTML = `<section><h1>Webhooks</h1>${unavailable("Webhook subscriptions", "GET /v1/webhooks")}</section>`;
    return;
  }
  let subs;
  try {
    subs = await getAll("/v1/webhooks");
  } catch (err) {
    if (err.status === 403 && root) {
      root.querySelector("#wh-list").innerHTML = errorNote(err);
      root.querySelector("#wh-deliveries").innerHTML = "";
      return;
    }
    throw err;
  }
  if (!root) return;
  const list = root.querySelector("#wh-list");
  if (!subs.length) {
    list.innerHTML = `<p class="muted">No subscription. Create one with <code>POST /v1/webhooks</code>.</p>`;
    root.querySelector("#wh-deliveries").innerHTML = "";
    return;
  }
  if (!selected || !subs.some((s) => s.id === selected)) selected = subs[0].id;
  list.innerHTML = `<table class="compact"><thead><tr><th>subscription</th><th>URL</th><th>events</th><th>filter</th><th>enabled</th><th>description</th></tr></thead><tbody>
    ${subs.map((s) => `<tr class="${s.id === selected ? "selected" : ""}"><td><button type="button" class="link" data-sub="${esc(s.id)}" aria-pressed="${s.id === selected}">${esc(s.id)}</button></td>
      <td class="mono small">${esc(s.url)}</td><td>${esc((s.event_types ?? []).join(", "))}</td>
      <td>${esc([s.job_id && `job ${s.job_id}`, s.node && `node ${s.node}`].filter(Boolean).join(" "))}</td>
      <td>${s.enabled === false ? `<span class="badge warn" title="${esc(s.disabled_reason ?? "")}">disabled</span>` : `<span class="badge ok">enabled</span>`}${s.consecutive_failures ? ` <span class="muted">${esc(s.consecutive_failures)} failures in a row</span>` : ""}</td>
      <td>${esc(s.description ?? "")}</td></tr>`).join("")}</tbody></table>`;
  for (const b of list.querySelectorAll("[data-sub]")) {
    b.addEventListener("click", () => {
      selected = b.dataset.sub;
      refresh().catch(() => {});
    });
  }
  await deliveries(selected);
}

async function deliveries(id) {
  const el = root.querySelector("#wh-deliveries");
  if (!has("GET /v1/webhooks/{id}/deliveries")) {
    el.innerHTML = unavailable("The delivery log", "GET /v1/webhooks/{id}/deliveries");
    return;
  }
  const body = await get(`/v1/webhooks/${encodeURIComponent(id)}/deliveries`);
  if (!root) return;
  root.querySelector("#wh-del-title").textContent = `Recent deliveries of ${id}`;
  const rows = body.data || [];
  el.innerHTML = rows.length
    ? `<table class="compact"><thead><tr><th>created</th><th>event</th><th>type</th><th>status</th><th>attempts</th>
        <th>last answer</th><th>latency</th><th>next retry</th></tr></thead><tbody>
      ${rows.slice(0, 100).map((d) => {
        const cls = d.status === "succeeded" ? "ok" : d.status === "failed" ? "bad" : "warn";
        const answer = d.last_status_code ?? d.last_error ?? "–";
        return `<tr data-delivery="${esc(d.id)}"><td>${fmtTime(d.created_at)}</td><td class="mono small">${esc(d.event_id)}</td>
        <td>${esc(d.event_type)}</td><td><span class="badge ${cls}">${esc(d.status)}</span></td>
        <td class="num">${esc(d.attempts)}</td><td>${esc(answer)}</td>
        <td class="num">${d.last_latency_ms != null ? `${esc(d.last_latency_ms)} ms` : "–"}</td>
        <td>${d.next_attempt_at ? fmtTime(d.next_attempt_at) : "–"}</td></tr>`;
      }).join("")}</tbody></table>`
    : `<p class="muted">No delivery yet.</p>`;
}
