// The dashboard's shell: token entry, the hash router and the live-update loop.
//
// Each view is a module exporting { title, mount(el, params), refresh(), unmount() }. The loop
// calls refresh() of the current view every REFRESH_MS (timed from the start of the previous
// refresh, never overlapping it), so a slow answer delays the next poll instead of piling up.

import { ApiError, forgetToken, get, getToken, loadRoutes, loadScopes, setToken, whenUnauthorized } from "./api.js";
import { esc } from "./util.js";
import * as fleet from "./fleet.js";
import * as gpu from "./gpu.js";
import * as node from "./node.js";
import * as jobs from "./jobs.js";
import * as migrations from "./migrations.js";
import * as audit from "./audit.js";
import * as webhooks from "./webhooks.js";
import * as models from "./models.js";

export const REFRESH_MS = 2000;

const ROUTES = [
  [/^$/, fleet, () => ({})],
  [/^gpu\/([^/]+)\/(\d+)$/, gpu, (m) => ({ node: decodeURIComponent(m[1]), gpu: Number(m[2]) })],
  [/^node\/([^/]+)$/, node, (m) => ({ node: decodeURIComponent(m[1]) })],
  [/^jobs$/, jobs, () => ({})],
  [/^jobs\/([^/]+)$/, jobs, (m) => ({ job: decodeURIComponent(m[1]) })],
  [/^migrations$/, migrations, () => ({})],
  [/^audit$/, audit, () => ({})],
  [/^webhooks$/, webhooks, () => ({})],
  [/^models$/, models, () => ({})],
];

const state = { view: null, timer: null, generation: 0, lastOk: 0 };
const live = () => document.getElementById("live");

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  const params = Object.fromEntries(new URLSearchParams(query || ""));
  for (const [re, view, pick] of ROUTES) {
    const m = path.match(re);
    if (m) return { view, params: { ...params, ...pick(m) } };
  }
  return null;
}

async function route() {
  const target = parseHash();
  const main = document.getElementById("main");
  clearTimeout(state.timer);
  state.generation++;
  if (state.view && state.view.unmount) state.view.unmount();
  state.view = null;
  if (!target) {
    main.innerHTML = `<p class="note">No such page. <a href="#/">Back to the fleet</a>.</p>`;
    return;
  }
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.toggleAttribute("aria-current", a.dataset.nav === target.view.section);
  }
  document.title = `${target.view.title(target.params)} · Forewarn`;
  main.innerHTML = "";
  await loadScopes(); // hints about a missing scope only where the token lacks it
  state.view = target.view;
  await target.view.mount(main, target.params);
  tick(state.generation);
}

async function tick(generation) {
  if (generation !== state.generation || !state.view) return;
  const started = performance.now();
  if (!document.hidden && getToken()) {
    try {
      await state.view.refresh();
      state.lastOk = Date.now();
      live().textContent = `live · updated ${new Date().toLocaleTimeString("en-GB")}`;
      live().classList.remove("stale");
    } catch (err) {
      live().textContent = err instanceof ApiError ? err.explain() : `update failed: ${err}`;
      live().classList.add("stale");
      if (!(err instanceof ApiError)) console.warn(err);
    }
  }
  if (generation !== state.generation) return;
  const wait = Math.max(0, REFRESH_MS - (performance.now() - started));
  state.timer = setTimeout(() => tick(generation), wait);
}

// ---- token entry -----------------------------------------------------------------------

function askToken(message = "") {
  const dialog = document.getElementById("token-dialog");
  document.getElementById("token-error").textContent = message;
  document.getElementById("token-input").value = "";
  if (!dialog.open) dialog.showModal();
  document.getElementById("token-input").focus();
}

function setupToken() {
  const form = document.getElementById("token-form");
  const dialog = document.getElementById("token-dialog");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const token = document.getElementById("token-input").value.trim();
    if (!token) return;
    setToken(token, document.getElementById("token-remember").checked);
    try {
      await get("/v1/nodes");
    } catch (err) {
      if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
        forgetToken();
        document.getElementById("token-error").textContent =
          err.status === 401 ? "The service does not know this token." : err.explain();
        return;
      }
    }
    dialog.close();
    route();
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    forgetToken();
    askToken("Token forgotten.");
  });
  document.getElementById("token-button").addEventListener("click", () => askToken());
  dialog.addEventListener("cancel", (ev) => {
    if (!getToken()) ev.preventDefault(); // nothing to show without one
  });
  whenUnauthorized(() => {
    forgetToken();
    askToken("The service refused the token (unknown or revoked). Enter another one.");
  });
}

async function start() {
  setupToken();
  await loadRoutes();
  window.addEventListener("hashchange", route);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && state.view) {
      clearTimeout(state.timer);
      tick(state.generation);
    }
  });
  if (!getToken()) askToken();
  await route();
}

// Read by the tests and the benchmark: what the last updates cost.
window.__forewarn = { stats: {} };

start().catch((err) => {
  document.getElementById("main").innerHTML = `<p class="note error">${esc(err)}</p>`;
  throw err;
});
