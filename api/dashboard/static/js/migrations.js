// Migrations: a timeline of the recent ones (one lane each, requested -> finished, coloured by
// outcome, the pause marked) above the record of each: trigger, risk and reasons at the
// trigger, source and target, pause, bytes, outcome, and its audit entries.

import { getAll, has, post, serverNow } from "./api.js";
import { confirmAction, errorNote, esc, fmtBytes, fmtPct, fmtSeconds, fmtTime, gpuHref, parseTs, unavailable } from "./util.js";
import { TERMINAL, finishedAt, migrationGpu, migrationId, migrationState, migrationTarget, requestedAt } from "./shapes.js";

export const section = "migrations";
export const title = () => "Migrations";

const LANES = 40;
let root = null;

export async function mount(el) {
  root = el;
  el.innerHTML = `<section class="migrations"><div class="page-head"><h1>Migrations</h1>
      <span class="muted" id="mig-span"></span></div>
    <div id="mig-result" role="status" aria-live="polite"></div>
    <div class="timeline" id="mig-timeline" aria-label="Migration timeline"></div>
    <h2>Records</h2><div id="mig-table"></div></section>`;
}

export function unmount() {
  root = null;
}

const where = (p) => (p ? `<a href="${gpuHref(p.node, p.gpu)}">${esc(p.node)}/${esc(p.gpu)}</a>` : "–");

export async function refresh() {
  if (!has("GET /v1/migrations")) {
    root.innerHTML = `<section><h1>Migrations</h1>${unavailable("The migration timeline", "GET /v1/migrations")}</section>`;
    return;
  }
  const list = await getAll("/v1/migrations");
  if (!root) return;
  list.sort((a, b) => parseTs(requestedAt(b)) - parseTs(requestedAt(a)));
  renderTimeline(list.slice(0, LANES));
  renderTable(list);
}

function renderTimeline(list) {
  const el = root.querySelector("#mig-timeline");
  if (!list.length) {
    el.innerHTML = `<p class="muted">No migration yet.</p>`;
    root.querySelector("#mig-span").textContent = "";
    return;
  }
  const now = serverNow();
  const start = Math.min(...list.map((m) => parseTs(requestedAt(m)) ?? now), now - 5 * 60_000);
  const span = Math.max(1, now - start);
  root.querySelector("#mig-span").textContent = `${fmtTime(start)} → now`;
  el.innerHTML = list.map((m) => {
    const id = migrationId(m);
    const st = migrationState(m);
    const src = migrationGpu(m);
    return `<div class="lane" data-migration="${esc(id)}">
      <span class="lane-label"><a href="#/audit?migration=${encodeURIComponent(id)}">${esc(m.job_id ?? "")}/${esc(m.rank ?? "")}</a>
        <span class="muted">${src ? `${esc(src.node)}/${esc(src.gpu)}` : ""}</span></span>
      <span class="lane-track"><span class="bar state-${esc(st)}" data-from="${parseTs(requestedAt(m))}" data-to="${parseTs(finishedAt(m)) ?? ""}"
        title="${esc(`${m.trigger ?? m.reason ?? ""} · ${st}`)}"></span></span>
      <span class="lane-state state-${esc(st)}">${esc(st)}</span></div>`;
  }).join("");
  // Positions go through the CSSOM (the page's policy forbids inline style attributes).
  for (const bar of el.querySelectorAll(".bar")) {
    const from = Number(bar.dataset.from) || now;
    const to = Number(bar.dataset.to) || now;
    bar.style.left = `${(100 * (from - start)) / span}%`;
    bar.style.width = `max(4px, ${(100 * Math.max(0, to - from)) / span}%)`;
  }
}

function renderTable(list) {
  const canCancel = has("POST /v1/migrations/{id}/cancel");
  const el = root.querySelector("#mig-table");
  if (!list.length) {
    el.innerHTML = "";
    return;
  }
  el.innerHTML = `<table class="compact"><thead><tr><th>requested</th><th>job/rank</th><th>trigger</th><th>from → to</th>
    <th>risk at trigger</th><th>reasons at trigger</th><th>pause</th><th>bytes</th><th>outcome</th><th></th></tr></thead><tbody>
    ${list.map((m) => {
      const id = migrationId(m);
      const st = migrationState(m);
      const reasons = m.reasons ?? m.trigger_reasons ?? [];
      const cancel = canCancel && !TERMINAL.has(st) ? `<button type="button" data-cancel="${esc(id)}">Cancel…</button>` : "";
      return `<tr data-migration-row="${esc(id)}"><td>${fmtTime(requestedAt(m))}</td><td>${esc(m.job_id ?? "")}/${esc(m.rank ?? "")}</td>
        <td>${esc(m.trigger ?? m.reason ?? "")}</td><td>${where(migrationGpu(m))} → ${where(migrationTarget(m))}</td>
        <td class="num">${typeof (m.risk ?? m.trigger_risk) === "number" ? fmtPct(m.risk ?? m.trigger_risk) : "–"}</td>
        <td class="reason">${esc((Array.isArray(reasons) ? reasons : [reasons]).join("; "))}</td>
        <td class="num">${fmtSeconds(m.pause_s ?? (m.pause_ms != null ? m.pause_ms / 1000 : null))}</td>
        <td class="num">${fmtBytes(m.bytes ?? m.bytes_moved)}</td>
        <td><span class="state-${esc(st)}">${esc(st)}</span>${m.error ? ` <span class="muted">${esc(m.error)}</span>` : ""}</td>
        <td><a href="#/audit?migration=${encodeURIComponent(id)}">audit</a> ${cancel}</td></tr>`;
    }).join("")}</tbody></table>`;
  for (const b of el.querySelectorAll("[data-cancel]")) b.addEventListener("click", () => cancel(b.dataset.cancel));
}

async function cancel(id) {
  if (!(await confirmAction("Cancel migration?", `Migration ${id} is cancelled if it has not started transferring.`, "Cancel migration"))) return;
  const out = root && root.querySelector("#mig-result");
  try {
    await post(`/v1/migrations/${encodeURIComponent(id)}/cancel`);
    if (out) out.innerHTML = `<p class="note ok">Cancellation of ${esc(id)} requested.</p>`;
  } catch (err) {
    if (out && err.status !== 401) out.innerHTML = errorNote(err);
  }
}
