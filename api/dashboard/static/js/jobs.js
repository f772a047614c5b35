// Jobs: every registered job, and one job's ranks with placement, spares, generation, step,
// health, step timing (compute before the first collective, wait in it) and the stragglers with
// what their GPU shows; a rank can be moved to a spare by hand (operate scope), after a
// confirmation.

import { get, getAll, has, hasScope, post, withQuery } from "./api.js";
import { ago, confirmAction, errorNote, esc, fmtPct, fmtSeconds, gpuHref, unavailable } from "./util.js";
import { jobIdOf, ranksOf } from "./shapes.js";

export const section = "jobs";
export const title = (p) => (p.job ? `job ${p.job}` : "Jobs");

let root = null;
let params = null;
let gpuRisk = new Map();

// A job in one of these states has no live rank: nothing of it can move.
const FINISHED = new Set(["completed", "failed", "stopped"]);

export async function mount(el, p) {
  root = el;
  params = p;
  el.innerHTML = p.job
    ? `<section><div class="page-head"><h1>job ${esc(p.job)}</h1><a href="#/jobs">← all jobs</a></div>
        <div id="job-summary"></div>
        <div id="job-stragglers"></div>
        <div id="job-action-result" role="status" aria-live="polite"></div>
        <h2>Ranks</h2><div id="job-ranks"></div></section>`
    : `<section><div class="page-head"><h1>Jobs</h1></div><div id="jobs-list"></div></section>`;
}

export function unmount() {
  root = null;
}

export async function refresh() {
  if (!has("GET /v1/jobs")) {
    root.innerHTML = `<section><h1>Jobs</h1>${unavailable("Jobs", "GET /v1/jobs")}</section>`;
    return;
  }
  if (params.job) return refreshJob(params);
  const jobs = await getAll("/v1/jobs");
  if (!root) return;
  const el = root.querySelector("#jobs-list");
  if (!jobs.length) {
    el.innerHTML = `<p class="muted">No job has registered. Start one with <code>forewarn launch --service …</code>.</p>`;
    return;
  }
  el.innerHTML = `<table><thead><tr><th>job</th><th>status</th><th>ranks</th><th>spares</th><th>generation</th><th>stragglers</th><th>message</th><th>heartbeat</th></tr></thead><tbody>
    ${jobs.map((j) => {
      const ranks = ranksOf(j);
      const active = ranks.filter((r) => (r.role || "active") === "active").length;
      const spares = ranks.filter((r) => r.role === "spare").length;
      return `<tr><td><a href="#/jobs/${encodeURIComponent(jobIdOf(j))}">${esc(jobIdOf(j))}</a></td>
        <td>${esc(j.status ?? j.health ?? "–")}</td>
        <td class="num">${ranks.length ? active : esc(j.world_size ?? "–")}</td>
        <td class="num">${ranks.length ? spares : esc(j.spares ?? "–")}</td>
        <td class="num">${esc(j.generation ?? "–")}</td>
        <td data-stragglers="${esc(jobIdOf(j))}">${stragglersOf(j).map((r) => `<span class="badge warn">rank ${esc(r)}</span>`).join(" ")}</td>
        <td>${esc(j.message ?? "")}</td>
        <td>${ago(j.heartbeat_at)}</td></tr>`;
    }).join("")}</tbody></table>`;
}

async function refreshJob(p) {
  const job = await get(`/v1/jobs/${encodeURIComponent(p.job)}`);
  // the risk of the GPUs under the job: one read per node it uses, not the whole fleet
  const nodes = [...new Set(ranksOf(job).map((r) => r.node))];
  const perNode = await Promise.all(
    nodes.map((n) => getAll(withQuery("/v1/gpus", { node: n })).catch(() => [])),
  );
  if (!root || p !== params) return;
  gpuRisk = new Map(perNode.flat().map((g) => [`${g.node}/${g.gpu}`, g]));
  const ranks = [...ranksOf(job)].sort((a, b) => (a.role === "spare") - (b.role === "spare") || a.rank - b.rank);
  const steps = job.step != null || ranks.some((r) => r.step != null); // shown when reported
  root.querySelector("#job-summary").innerHTML = `<dl class="facts inline">
    <dt>status</dt><dd>${esc(job.status ?? job.health ?? "–")}</dd>
    <dt>world size</dt><dd>${esc(job.world_size ?? "–")}</dd>
    <dt>spares</dt><dd>${esc(job.spares ?? ranks.filter((r) => r.role === "spare").length)}</dd>
    <dt>generation</dt><dd>${esc(job.generation ?? "–")}</dd>
    ${steps ? `<dt>step</dt><dd>${esc(job.step)}</dd>` : ""}
    ${job.message ? `<dt>message</dt><dd>${esc(job.message)}</dd>` : ""}
    <dt>heartbeat</dt><dd>${ago(job.heartbeat_at)}</dd></dl>`;
  const slow = ranks.filter((r) => r.straggler);
  root.querySelector("#job-stragglers").innerHTML = slow.length
    ? slow.map((r) => `<p class="note warn" data-straggler="${esc(r.rank)}">Rank ${esc(r.rank)} is a straggler: it computes ${fmtSeconds(r.compute_s)} a step, its peers ${fmtSeconds(r.peers_median_s)}${r.straggler_since ? ` (flagged ${ago(r.straggler_since)})` : ""}. Its GPU shows: <span data-reason>${esc(r.straggler_reason ?? "unknown")}</span>.</p>`).join("")
    : "";
  const timed = ranks.some((r) => r.compute_s !== null && r.compute_s !== undefined);
  const canMigrate = has("POST /v1/migrations");
  const finished = FINISHED.has(job.status);
  const mayMove = canMigrate && !finished; // a token without operate is refused, and told why
  let next = "";
  if (finished) {
    next = `<p class="note" data-next="finished">This job has ${esc(job.status)}: its ranks hold no GPU any more, and there is nothing to move.</p>`;
  } else if (canMigrate && hasScope("operate") === false) {
    next = `<p class="note muted" data-scope-hint="operate">Moving a rank to a spare needs a token with the <code>operate</code> scope.</p>`;
  }
  const el = root.querySelector("#job-ranks");
  el.innerHTML = `<table><thead><tr><th>rank</th><th>role</th><th>GPU</th><th>risk</th>${timed ? `<th title="step start to arrival at the step's first collective">compute</th><th title="arrival to that collective's end">wait</th><th>step time</th>` : ""}<th>generation</th>${steps ? "<th>step</th>" : ""}<th></th></tr></thead><tbody>
    ${ranks.map((r) => {
      const g = r.gpu !== null && r.gpu !== undefined ? gpuRisk.get(`${r.node}/${r.gpu}`) : null;
      const where = r.gpu !== null && r.gpu !== undefined ? `<a href="${gpuHref(r.node, r.gpu)}">${esc(r.node)}/${r.gpu}</a>` : esc(r.node);
      const action = mayMove && (r.role || "active") === "active"
        ? `<button type="button" data-migrate="${esc(r.rank)}">Move to a spare…</button>` : "";
      return `<tr class="${r.role === "retired" ? "muted" : ""}"><td class="num">${esc(r.rank)}</td><td>${esc(r.role || "active")}</td><td>${where}</td>
        <td class="num">${g && typeof g.risk === "number" ? fmtPct(g.risk) : "–"}${g && g.alarm ? ` <span class="badge bad">alarm</span>` : ""}</td>
        ${timed ? `<td class="num" data-compute="${esc(r.rank)}">${fmtSeconds(r.compute_s)}${r.straggler ? ` <span class="badge warn" title="${esc(r.straggler_reason ?? "")}">straggler</span>` : ""}</td><td class="num">${fmtSeconds(r.wait_s)}</td><td class="num">${fmtSeconds(r.step_s)}</td>` : ""}
        <td class="num">${esc(r.generation ?? job.generation ?? "–")}</td>${steps ? `<td class="num">${esc(r.step ?? job.step ?? "–")}</td>` : ""}<td>${action}</td></tr>`;
    }).join("")}</tbody></table>
    ${canMigrate ? next : unavailable("Manual migration", "POST /v1/migrations")}`;
  for (const b of el.querySelectorAll("[data-migrate]")) {
    b.addEventListener("click", () => migrate(p.job, Number(b.dataset.migrate)));
  }
}

function stragglersOf(job) {
  return job.stragglers ?? ranksOf(job).filter((r) => r.straggler).map((r) => r.rank);
}

async function migrate(job, rank) {
  const ok = await confirmAction(
    `Move rank ${rank} of ${job}?`,
    `Rank ${rank} hands its state to a warm spare at the next step boundary; the job pauses briefly and continues from the same step.`,
    "Move rank",
  );
  if (!ok || !root) return;
  const out = root.querySelector("#job-action-result");
  try {
    const m = await post("/v1/migrations", { job_id: job, rank, detail: "requested from the dashboard" });
    const id = m && (m.migration_id ?? m.id);
    out.innerHTML = `<p class="note ok" data-result="migration">Migration ${esc(id ?? "")} requested: <a href="#/migrations">follow it on the timeline</a>.</p>`;
  } catch (err) {
    if (err.status !== 401) out.innerHTML = errorNote(err).replace("<p ", `<p data-result="refused" `);
  }
}
