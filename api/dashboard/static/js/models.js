// Models: which risk model is in force, the one the control loop scored with, the models it
// replaced, and every decision of the lifecycle (a candidate judged against the model in
// force, with both judgements; pins, unpins, rollbacks), newest first.

import { get, has } from "./api.js";
import { esc, fmtTime, unavailable } from "./util.js";

export const section = "models";
export const title = () => "Models";

let root = null;

export async function mount(el) {
  root = el;
  el.innerHTML = `<section><div class="page-head"><h1>Models</h1></div>
    <div id="models-now"></div><h2>Models</h2><div id="models-list"></div>
    <h2>Decisions</h2><div id="models-history"></div></section>`;
}

export function unmount() {
  root = null;
}

function judged(h) {
  const j = h.judgements || {};
  const side = (s) => s
    ? `${esc(s.caught_with_precursors)}/${esc(s.failures_with_precursors)} caught, ${Number(s.false_alarms_per_1000_gpu_days).toFixed(1)} FA/1k GPU-d`
    : "";
  return `candidate <code>${esc(h.candidate)}</code>: ${side(j.candidate)} · in force <code>${esc(h.in_force)}</code>: ${side(j.in_force)}
    · <strong>${h.promoted ? "promoted" : "not promoted"}</strong> (${esc(h.reason)})`;
}

function decision(h) {
  if (h.action === "judged") return judged(h);
  const model = h.model ? ` <code>${esc(h.model)}</code>` : "";
  const was = h.previous ? ` (was <code>${esc(h.previous)}</code>)` : "";
  return `${model}${was}${h.by ? ` by ${esc(h.by)}` : ""}`;
}

export async function refresh() {
  if (!has("GET /v1/models")) {
    root.innerHTML = `<section><h1>Models</h1>${unavailable("The models page", "GET /v1/models")}</section>`;
    return;
  }
  const body = await get("/v1/models");
  if (!root) return;
  const scoring = body.scoring && body.scoring !== body.in_force
    ? ` · the control loop still scores with <code>${esc(body.scoring)}</code> until its next tick`
    : "";
  root.querySelector("#models-now").innerHTML = `<p id="model-in-force" data-model="${esc(body.in_force)}">
    In force: <strong><code>${esc(body.in_force)}</code></strong>${body.pinned ? " <span class=\"badge\">pinned</span>" : ""}${scoring}
    ${body.replaced.length ? ` · a rollback restores <code>${esc(body.replaced[body.replaced.length - 1])}</code>` : ""}</p>`;
  root.querySelector("#models-list").innerHTML = `<table class="compact"><thead><tr><th>model</th><th>created</th><th></th></tr></thead><tbody>
    ${body.data.slice().reverse().map((m) => `<tr data-model-row="${esc(m.id)}"><td><code>${esc(m.id)}</code></td>
      <td>${fmtTime(m.created_at)}</td><td>${m.in_force ? "<strong>in force</strong>" : ""}</td></tr>`).join("")}
    </tbody></table>`;
  const history = body.history.slice().reverse();
  root.querySelector("#models-history").innerHTML = history.length
    ? `<table class="compact"><thead><tr><th>time</th><th>decision</th><th></th></tr></thead><tbody>
      ${history.map((h) => `<tr data-decision="${esc(h.action)}"><td>${fmtTime(h.at)}</td><td><strong>${esc(h.action.replace("_", " "))}</strong></td>
        <td>${decision(h)}</td></tr>`).join("")}</tbody></table>`
    : `<p class="muted">No decision yet: the model in force is the newest in the models directory, else the shipped one.</p>`;
}
