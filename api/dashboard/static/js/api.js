// The one way the dashboard talks to the service: fetch with the bearer token.
//
// The token lives in sessionStorage (this tab) or, when the operator asks, localStorage; it is
// sent only in the Authorization header, never in a URL. Which routes exist is read once from
// the OpenAPI document, so a view whose routes this service does not have says so instead of
// calling them.

const KEY = "forewarn.token";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  // A sentence an operator can act on.
  explain() {
    if (this.status === 401) return "The service does not know this token. Enter another one.";
    if (this.status === 403) return `Refused: ${this.message}.`;
    if (this.status === 0) return `The service did not answer (${this.message}).`;
    return `${this.message} (${this.code}, HTTP ${this.status})`;
  }
}

export function getToken() {
  return sessionStorage.getItem(KEY) || localStorage.getItem(KEY) || "";
}

export function setToken(token, remember) {
  forgetToken();
  (remember ? localStorage : sessionStorage).setItem(KEY, token);
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
}

let onUnauthorized = () => {};
export function whenUnauthorized(fn) {
  onUnauthorized = fn;
}

// Main-thread time spent parsing answers, in total (the benchmark reads it per update).
let parseMs = 0;
export const parseTotalMs = () => parseMs;

// Last Date header seen: ages ("stale for 40 s") are measured on the service's clock.
let skewMs = 0;
export function serverNow() {
  return Date.now() + skewMs;
}

export async function request(method, path, body) {
  const headers = { Accept: "application/json", Authorization: `Bearer ${getToken()}` };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, "network", String(err.message || err));
  }
  const date = response.headers.get("Date");
  if (date) {
    const server = Date.parse(date);
    if (!Number.isNaN(server)) skewMs = server - Date.now();
  }
  const text = await response.text();
  let data = null;
  if (text) {
    const t0 = performance.now();
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
    parseMs += performance.now() - t0;
  }
  if (!response.ok) {
    const err = (data && data.error) || {};
    const e = new ApiError(response.status, err.code || "http_error", err.message || response.statusText);
    if (response.status === 401) onUnauthorized(e);
    throw e;
  }
  return data;
}

export const get = (path) => request("GET", path);
export const post = (path, body) => request("POST", path, body ?? {});

// GET a list, following pagination when the service pages it ({"next": url-or-cursor}).
export async function getAll(path, maxPages = 1000) {
  let page = await get(path);
  const items = [...(page.data || [])];
  for (let i = 0; i < maxPages; i++) {
    const next = page.next ?? page.next_cursor ?? null;
    if (!next) break;
    const url = String(next).startsWith("/") ? next : withQuery(path, { cursor: next });
    page = await get(url);
    items.push(...(page.data || []));
  }
  return items;
}

export function withQuery(path, params) {
  const [base, query] = path.split("?");
  const search = new URLSearchParams(query || "");
  for (const [k, v] of Object.entries(params)) {
    if (v === undefined || v === null || v === "") search.delete(k);
    else search.set(k, String(v));
  }
  const s = search.toString();
  return s ? `${base}?${s}` : base;
}

// ---- what the token may do ---------------------------------------------------------------

let scopes = null;
let scopesOf = null;

// The token's scopes (GET /v1/token), read once per token.
export async function loadScopes() {
  const token = getToken();
  if (!token || token === scopesOf) return;
  try {
    const answer = await get("/v1/token");
    scopes = new Set(answer.scopes || []);
    scopesOf = token;
  } catch {
    scopes = null;
    scopesOf = null;
  }
}

// true or false once the token's scopes are known; null before (say nothing then).
export function hasScope(scope) {
  return scopes && scopesOf === getToken() ? scopes.has(scope) : null;
}

// ---- which routes this service has -------------------------------------------------------

let routes = null;

export async function loadRoutes() {
  if (routes) return routes;
  try {
    const response = await fetch("/openapi.json", { cache: "no-store" });
    const spec = response.ok ? await response.json() : { paths: {} };
    routes = new Set();
    for (const [path, ops] of Object.entries(spec.paths || {})) {
      for (const method of Object.keys(ops)) routes.add(`${method.toUpperCase()} ${path}`);
    }
  } catch {
    routes = new Set();
  }
  return routes;
}

// has("GET /v1/jobs/{id}") — path parameters are matched by position, not name.
export function has(route) {
  if (!routes) return false;
  if (routes.has(route)) return true;
  const norm = (r) => r.replace(/\{[^}]+\}/g, "{}");
  const want = norm(route);
  for (const r of routes) if (norm(r) === want) return true;
  return false;
}
