// Node page: its GPUs and collectors, and the drain / undrain action (operate scope).

import { getAll, has, hasScope, post, withQuery } from "./api.js";
import { ago, confirmAction, errorNote, esc, fmtNum, fmtPct, gpuHref, riskClass, unavailable } from "./util.js";

export const section = "fleet";
export const title = (p) => `node ${p.node}`;

let root = null;
let params = null;
let actionNote = "";

export async function mount(el, p) {
  root = el;
  params = p;
  actionNote = "";
  el.innerHTML = `
    <section class="node">
      <div class="page-head"><h1>node ${esc(p.node)}</h1><a href="#/?node=${encodeURIComponent(p.node)}">← fleet (this node)</a></div>
      <div class="toolbar" id="node-actions"></div>
      <p class="muted" id="node-drain-reason"></p>
      <div id="node-action-result" role="status" aria-live="polite"></div>
      <div class="two">
        <section><h2>GPUs</h2><div id="node-gpus"></div></section>
        <section><h2>Collectors</h2><div id="node-agents"></div></section>
      </div>
    </section>`;
  renderActions(null);
}

export function unmount() {
  root = null;
}

function drainedOf(drain) {
  return !!drain && drain.drained !== false;
}

function renderActions(drain) {
  const el = root.querySelector("#node-actions");
  if (!has("POST /v1/nodes/{node}/drain")) {
    el.innerHTML = unavailable("Drain", "POST /v1/nodes/{node}/drain");
    return;
  }
  const drained = drainedOf(drain);
  const wanted = `${drained}`;
  if (el.dataset.drained === wanted) return;
  el.dataset.drained = wanted;
  el.innerHTML = `
    <span class="badge ${drained ? "warn" : "ok"}" id="node-state">${drained ? "drained" : "in service"}</span>
    <button type="button" id="drain" class="danger" ${drained ? "disabled" : ""}>Drain node…</button>
    <button type="button" id="undrain" ${drained ? "" : "disabled"}>Undrain</button>
    ${hasScope("operate") === false ? `<span class="muted" data-scope-hint="operate">Draining needs a token with the <code>operate</code> scope.</span>` : ""}`;
  el.querySelector("#drain").addEventListener("click", () => act("drain"));
  el.querySelector("#undrain").addEventListener("click", () => act("undrain"));
}

async function act(action) {
  const node = params.node;
  const ok = await confirmAction(
    action === "drain" ? `Drain ${node}?` : `Undrain ${node}?`,
    action === "drain"
      ? `Every training rank on ${node} is moved to a spare elsewhere (planned migrations), and no new rank or spare is placed there until it is undrained.`
      : `${node} takes ranks and spares again.`,
    action === "drain" ? "Drain" : "Undrain",
  );
  if (!ok || !root) return;
  const result = root.querySelector("#node-action-result");
  try {
    const body = await post(`/v1/nodes/${encodeURIComponent(node)}/${action}`, action === "drain" ? { reason: "drained from the dashboard" } : undefined);
    const n = body ? body.ranks_to_move : null;
    actionNote = `<p class="note ok" data-result="${action}">${action === "drain" ? "Drained" : "Undrained"} ${esc(node)}${action === "drain" && n !== null && n !== undefined ? ` · ${esc(n)} rank(s) to move off it` : ""}.</p>`;
  } catch (err) {
    if (err.status === 401) return;
    actionNote = errorNote(err).replace("<p ", `<p data-result="refused" `);
  }
  if (root) result.innerHTML = actionNote;
  await refresh();
}

export async function refresh() {
  const p = params;
  const [nodes, gpus, drains] = await Promise.all([
    getAll("/v1/nodes"),
    getAll(withQuery("/v1/gpus", { node: p.node })),
    has("GET /v1/drains") ? getAll("/v1/drains") : [],
  ]);
  if (!root || p !== params) return;
  const info = nodes.find((n) => (n.node ?? n.name) === p.node) || null;
  const drain = drains.find((d) => d.node === p.node) || null;
  renderActions(drain);
  root.querySelector("#node-drain-reason").textContent = drain && drain.reason ? `drained ${drain.changed_at ? ago(drain.changed_at) : ""}: ${drain.reason}` : "";
  root.querySelector("#node-gpus").innerHTML = gpus.length
    ? `<table class="compact"><thead><tr><th>GPU</th><th>risk</th><th>temp</th><th>power</th><th>last sample</th></tr></thead><tbody>
      ${gpus.sort((a, b) => a.gpu - b.gpu).map((g) => `<tr class="${riskClass(g)}"><td><a href="${gpuHref(g.node, g.gpu)}">GPU ${g.gpu}</a></td>
        <td class="num">${typeof g.risk === "number" ? fmtPct(g.risk) : "–"}${g.alarm ? ` <span class="badge bad">alarm</span>` : ""}</td>
        <td class="num">${fmtNum(g.temp_gpu_c)} °C</td><td class="num">${fmtNum(g.power_w)} W</td><td>${ago(g.ts)}</td></tr>`).join("")}
      </tbody></table>`
    : `<p class="muted">No GPU has reported from this node.</p>`;
  const agents = info ? info.agents || [] : [];
  root.querySelector("#node-agents").innerHTML = agents.length
    ? `<table class="compact"><thead><tr><th>agent</th><th>source</th><th>last seen</th><th>spooled</th><th>dropped</th></tr></thead><tbody>
      ${agents.map((a) => `<tr><td class="mono">${esc(a.agent_id)}</td><td>${esc(a.source)}</td><td>${ago(a.last_seen)}</td><td class="num">${esc(a.spooled ?? "–")}</td><td class="num">${esc(a.dropped_total ?? "–")}</td></tr>`).join("")}
      </tbody></table>`
    : `<p class="muted">No collector heartbeat recorded.</p>`;
}
