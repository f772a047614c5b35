// Small helpers shared by the views: escaping, formatting, confirmation, notices.

import { serverNow } from "./api.js";

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ESC[c]);
}

// Natural order: node-2 before node-10.
const collator = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });
export const natural = (a, b) => collator.compare(a, b);

export function fmtNum(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return esc(v);
  return Math.abs(v) >= 1000 ? Math.round(v).toLocaleString("en") : v.toFixed(digits);
}

export function fmtPct(v) {
  return v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`;
}

export function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = Number(v);
  while (x >= 1024 && i < units.length - 1) {
    x /= 1024;
    i++;
  }
  return `${x.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function fmtSeconds(v) {
  if (v === null || v === undefined) return "–";
  const s = Number(v);
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(s < 10 ? 2 : 1)} s`;
}

export function parseTs(ts) {
  if (ts === null || ts === undefined) return null;
  if (typeof ts === "number") return ts > 1e12 ? ts : ts * 1000;
  const ms = Date.parse(ts);
  return Number.isNaN(ms) ? null : ms;
}

export function fmtTime(ts) {
  const ms = parseTs(ts);
  if (ms === null) return "–";
  return new Date(ms).toISOString().replace("T", " ").slice(0, 19) + "Z";
}

export function ago(ts) {
  const ms = parseTs(ts);
  if (ms === null) return "never";
  const s = Math.max(0, (serverNow() - ms) / 1000);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 172800) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function gpuHref(node, gpu) {
  return `#/gpu/${encodeURIComponent(node)}/${gpu}`;
}

export function nodeHref(node) {
  return `#/node/${encodeURIComponent(node)}`;
}

// A view of a route this service does not have: said plainly, nothing called.
export function unavailable(what, routes) {
  return `<p class="note unavailable" data-unavailable="${esc(what)}">${esc(what)} is not
    available on this service (it has no <code>${esc(routes)}</code> route yet).</p>`;
}

export function errorNote(err) {
  const text = err && err.explain ? err.explain() : String(err);
  const cls = err && err.status === 403 ? "refused" : "error";
  return `<p class="note ${cls}" role="alert">${esc(text)}</p>`;
}

// Modal confirmation (keyboard: Enter confirms, Escape cancels). Resolves true or false.
export function confirmAction(title, text, okLabel = "Confirm") {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  dialog.returnValue = "";
  dialog.showModal();
  document.getElementById("confirm-cancel").focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}

// Risk value -> one of RISK_COLORS (low: dark slate, high: red; luminance rises with risk so
// the scale also reads without colour vision). With a threshold the scale is relative to it
// (the top colours start just below it); without one it is the probability itself.
export const RISK_COLORS = [
  "#1d4e63", "#24627a", "#3f7a78", "#6a9a5b", "#b5b43d",
  "#e0a526", "#ef7d22", "#ea5329", "#d7263d", "#ff3b5c",
];
export function riskBucket(risk, threshold = null) {
  if (risk === null || risk === undefined || Number.isNaN(risk)) return -1;
  const x = threshold ? risk / (threshold * 1.25) : risk;
  return Math.max(0, Math.min(RISK_COLORS.length - 1, Math.floor(x * RISK_COLORS.length)));
}

export function riskClass(item) {
  if (!item) return "";
  if (item.alarm) return "risk-alarm";
  if (item.risk === null || item.risk === undefined) return "risk-none";
  return item.risk >= 0.5 ? "risk-high" : item.risk >= 0.2 ? "risk-mid" : "risk-low";
}
