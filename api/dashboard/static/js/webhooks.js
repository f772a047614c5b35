// Webhooks: subscriptions and each one's recent deliveries (admin scope).

import { get, getAll, has } from "./api.js";
import { errorNote, esc, fmtTime, unavailable } from "./util.js";

export const section = "webhooks";
export const title = () => "Webhooks";

let root = null;
let selected = null;

export async function mount(el) {
  root = el;
  selected = null;
  el.innerHTML = `<section><div class="page-head"><h1>Webhooks</h1>
    <span class="muted">Reading subscriptions needs a token with the <code>admin</code> scope.</span></div>
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
      <td class="mono small">${esc(s.url)}</td><td>${esc((s.event_types ?? s.events ?? []).join(", "))}</td>
      <td>${esc([s.job_id ?? s.job, s.node].filter(Boolean).join(" "))}</td>
      <td>${s.enabled === false ? `<span class="badge warn">disabled</span>` : `<span class="badge ok">enabled</span>`}</td>
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
    ? `<table class="compact"><thead><tr><th>time</th><th>event</th><th>type</th><th>attempt</th><th>status</th><th>latency</th><th>next retry</th></tr></thead><tbody>
      ${rows.slice(0, 100).map((d) => {
        const ok = d.status_code >= 200 && d.status_code < 300;
        return `<tr><td>${fmtTime(d.attempted_at ?? d.created_at ?? d.ts)}</td><td class="mono small">${esc(d.event_id ?? d.message_id ?? "")}</td>
        <td>${esc(d.event_type ?? d.type ?? "")}</td><td class="num">${esc(d.attempt ?? d.attempts ?? "")}</td>
        <td><span class="badge ${ok ? "ok" : "bad"}">${esc(d.status_code ?? d.status ?? d.error ?? "–")}</span> ${esc(d.state ?? "")}</td>
        <td class="num">${d.latency_ms != null ? `${esc(Math.round(d.latency_ms))} ms` : "–"}</td>
        <td>${fmtTime(d.next_attempt_at ?? d.next_retry_at)}</td></tr>`;
      }).join("")}</tbody></table>`
    : `<p class="muted">No delivery yet.</p>`;
}
