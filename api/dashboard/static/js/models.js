// Models: which risk model is in force, the one the control loop scored with, the models it
// replaced, and every decision of the lifecycle (a candidate judged against the model in
// force, with both judgements; pins, unpins, rollbacks), newest first. With the admin scope
// the operator pins a model, unpins, rolls back and starts a retraining, after a confirmation.

import { get, has, hasScope, post } from "./api.js";
import { confirmAction, errorNote, esc, fmtTime, unavailable } from "./util.js";

export const section = "models";
export const title = () => "Models";

let root = null;

export async function mount(el) {
  root = el;
  el.innerHTML = `<section><div class="page-head"><h1>Models</h1></div>
    <div id="models-now"></div><div id="models-actions"></div><div id="models-result"></div>
    <h2>Models</h2><div id="models-list"></div>
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

// What the operator can do here, each with its route (a button shows only where the
// service has the route; the token's scope is said, not guessed at by a click).
const ACTIONS = {
  pin: { route: "POST /v1/models/pin", label: "Pin", ask: (id) => [
    `Pin ${id}?`,
    `${id} goes in force at the control loop's next tick and stays there: no retrained candidate replaces it until you unpin.`,
  ] },
  unpin: { route: "POST /v1/models/unpin", label: "Unpin", ask: (id) => [
    `Unpin ${id}?`,
    `${id} stays in force, and a retrained candidate that beats it on the fleet's recent days may replace it again.`,
  ] },
  rollback: { route: "POST /v1/models/rollback", label: "Roll back", ask: (id) => [
    `Roll back to ${id}?`,
    `${id}, the model the last promotion or pin replaced, goes back in force at the control loop's next tick.`,
  ] },
  retrain: { route: "POST /v1/models/retrain", label: "Retrain now", ask: () => [
    "Retrain on the fleet's history?",
    "A candidate is trained on the fleet's own recorded history in the background (minutes) and judged against the model in force on the history's last day; it goes in force only if it does better.",
  ] },
};

function button(action, id = "") {
  const a = ACTIONS[action];
  if (!has(a.route) || hasScope("admin") === false) return "";
  return `<button type="button" data-model-action="${action}" data-model-id="${esc(id)}">${a.label}${action === "rollback" ? ` to <code>${esc(id)}</code>` : ""}</button>`;
}

async function act(action, id) {
  const [title, text] = ACTIONS[action].ask(id);
  if (!(await confirmAction(title, text, ACTIONS[action].label))) return;
  if (!root) return;
  const out = root.querySelector("#models-result");
  const path = { pin: "/v1/models/pin", unpin: "/v1/models/unpin", rollback: "/v1/models/rollback", retrain: "/v1/models/retrain" }[action];
  try {
    await post(path, action === "pin" ? { model_id: id } : {});
    out.innerHTML = action === "retrain"
      ? `<p class="note ok" data-result="retrain">Retraining started: its decision appears below when it ends.</p>`
      : `<p class="note ok" data-result="${action}">Done: the control loop scores with the model in force from its next tick.</p>`;
  } catch (err) {
    if (err.status !== 401) out.innerHTML = errorNote(err).replace("<p ", `<p data-result="refused" `);
  }
  if (root) await refresh();
}

function retraining(job) {
  if (!job || job.state === "idle") return "";
  const by = job.trigger === "schedule" ? "scheduled " : "";
  if (job.state === "running") return `<p class="note" data-retrain="running">A ${by}retraining is running since ${fmtTime(job.started_at)}.</p>`;
  if (job.state === "failed") return `<p class="note error" data-retrain="failed">The last ${by}retraining failed: ${esc(job.error)}</p>`;
  return `<p class="muted" data-retrain="done">The last ${by}retraining ended ${fmtTime(job.finished_at)}: see its decision below.</p>`;
}

export async function refresh() {
  if (!has("GET /v1/models")) {
    root.innerHTML = `<section><h1>Models</h1>${unavailable("The models page", "GET /v1/models")}</section>`;
    return;
  }
  const [body, job] = await Promise.all([
    get("/v1/models"),
    has("GET /v1/models/retrain") ? get("/v1/models/retrain").catch(() => null) : null,
  ]);
  if (!root) return;
  const scoring = body.scoring && body.scoring !== body.in_force
    ? ` · the control loop still scores with <code>${esc(body.scoring)}</code> until its next tick`
    : "";
  const previous = body.replaced.length ? body.replaced[body.replaced.length - 1] : null;
  root.querySelector("#models-now").innerHTML = `<p id="model-in-force" data-model="${esc(body.in_force)}" data-pinned="${body.pinned}">
    In force: <strong><code>${esc(body.in_force)}</code></strong>${body.pinned ? " <span class=\"badge\">pinned</span>" : ""}${scoring}
    ${previous ? ` · a rollback restores <code>${esc(previous)}</code>` : ""}</p>`;
  const hint = hasScope("admin") === false && has("POST /v1/models/pin")
    ? `<p class="note muted" data-scope-hint="admin">Pinning, rolling back and retraining need a token with the <code>admin</code> scope.</p>`
    : "";
  root.querySelector("#models-actions").innerHTML = `<div class="actions">
    ${body.pinned ? button("unpin", body.in_force) : ""}${previous ? button("rollback", previous) : ""}${job && job.state !== "running" ? button("retrain") : ""}</div>
    ${retraining(job)}${hint}`;
  root.querySelector("#models-list").innerHTML = `<table class="compact"><thead><tr><th>model</th><th>created</th><th></th></tr></thead><tbody>
    ${body.data.slice().reverse().map((m) => `<tr data-model-row="${esc(m.id)}"><td><code>${esc(m.id)}</code></td>
      <td>${fmtTime(m.created_at)}</td><td>${m.in_force ? "<strong>in force</strong>" : button("pin", m.id)}</td></tr>`).join("")}
    </tbody></table>`;
  for (const b of root.querySelectorAll("[data-model-action]")) {
    b.addEventListener("click", () => act(b.dataset.modelAction, b.dataset.modelId));
  }
  const history = body.history.slice().reverse();
  root.querySelector("#models-history").innerHTML = history.length
    ? `<table class="compact"><thead><tr><th>time</th><th>decision</th><th></th></tr></thead><tbody>
      ${history.map((h) => `<tr data-decision="${esc(h.action)}"><td>${fmtTime(h.at)}</td><td><strong>${esc(h.action.replace("_", " "))}</strong></td>
        <td>${decision(h)}</td></tr>`).join("")}</tbody></table>`
    : `<p class="muted">No decision yet: the model in force is the newest in the models directory, else the shipped one.</p>`;
}
