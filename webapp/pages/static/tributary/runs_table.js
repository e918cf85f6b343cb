// The runs table: selection (Compare, Cancel selected), live status over the project socket,
// live durations of running runs. htmx does filtering, sorting and paging; this file only
// enhances what already works without JavaScript.

import { contracts } from "./contracts.js";
import { formatDuration } from "./format.js";
import { LiveSocket } from "./socket.js";
import { timeElement } from "./times.js";

// Each run state's label and badge class, as the server renders them.
const metaEl = document.getElementById("run-status-meta");
const STATUS = metaEl ? JSON.parse(metaEl.textContent) : {};
const isActive = (status) => contracts().activeStates.includes(status);

function results() { return document.getElementById("runs-results"); }
function selectedIds() {
  return Array.from(document.querySelectorAll("input.run-select:checked")).map((el) => el.value);
}

// --- selection -------------------------------------------------------------------------
function updateSelection() {
  const ids = selectedIds();
  const count = document.getElementById("selected-count");
  if (count) count.textContent = ids.length ? `${ids.length} selected` : "No runs selected";
  for (const id of ["compare-selected", "cancel-selected"]) {
    const button = document.getElementById(id);
    if (button) button.disabled = ids.length === 0;
  }
  const all = document.getElementById("select-all");
  if (all) {
    const boxes = document.querySelectorAll("input.run-select");
    all.checked = boxes.length > 0 && ids.length === boxes.length;
    all.indeterminate = ids.length > 0 && ids.length < boxes.length;
  }
}

document.addEventListener("change", (e) => {
  if (e.target.id === "select-all") {
    for (const box of document.querySelectorAll("input.run-select")) box.checked = e.target.checked;
  }
  if (e.target.id === "select-all" || e.target.classList.contains("run-select")) updateSelection();
});

document.addEventListener("click", (e) => {
  const button = e.target.closest("#compare-selected");
  if (!button) return;
  const ids = selectedIds();
  e.preventDefault();
  if (ids.length) window.location.href = `/compare/?runs=${ids.join(",")}`;
});

// --- after htmx swaps the results ------------------------------------------------------
function afterResults() {
  const box = results();
  if (!box) return;
  const sort = document.getElementById("filter-sort");
  if (sort && box.dataset.sort) sort.value = box.dataset.sort;
  // The column, group and filter forms (plain GET forms) keep the order the table has now.
  for (const input of document.querySelectorAll("#table-columns input.table-sort")) {
    if (box.dataset.sort) input.value = box.dataset.sort;
  }
  const back = document.getElementById("bulk-return-query");
  if (back && box.dataset.here) back.value = (box.dataset.here.split("?")[1] || "");
  const notice = document.getElementById("live-new-runs");
  if (notice) notice.remove();
  updateSelection();
  tickDurations();
}

document.addEventListener("htmx:afterSettle", afterResults);
// A refused filter (400) or an unavailable database (503) still shows its message.
document.addEventListener("htmx:beforeSwap", (e) => {
  const target = e.detail.target;
  if (target && target.id === "runs-results" && [400, 503].includes(e.detail.xhr.status)) {
    e.detail.shouldSwap = true;
    e.detail.isError = false;
  }
});

// --- durations ---------------------------------------------------------------------------
function tickDurations() {
  const now = Date.now() / 1000;
  for (const row of document.querySelectorAll("#runs-body tr[data-run-id]")) {
    const started = parseFloat(row.dataset.startedAt);
    const finished = parseFloat(row.dataset.finishedAt);
    if (isNaN(started)) continue;
    const end = !isNaN(finished) ? finished : (isActive(row.dataset.status) ? now : NaN);
    if (isNaN(end)) continue;
    const cell = row.querySelector('[data-role="duration"]');
    if (cell) cell.textContent = formatDuration(end - started);
  }
}
setInterval(tickDurations, 1000);

// --- live status ---------------------------------------------------------------------------
function applyStatus(msg) {
  const row = document.querySelector(`#runs-body tr[data-run-id="${Number(msg.run)}"]`);
  if (!row) {
    showNewRuns();
    return;
  }
  const meta = STATUS[msg.status];
  if (meta) {
    row.dataset.status = msg.status;
    const badge = row.querySelector('[data-role="status-badge"]');
    if (badge) {
      badge.className = `badge ${meta.badge}`;
      badge.textContent = meta.label;
      if (msg.message) badge.title = msg.message; else badge.removeAttribute("title");
    }
    if (!isActive(msg.status)) row.querySelector(".cancel-note")?.remove();
  }
  if (typeof msg.last_step === "number") {
    const step = row.querySelector('[data-role="last-step"]');
    if (step) step.textContent = String(msg.last_step);
  }
  row.dataset.startedAt = msg.started_at == null ? "" : String(msg.started_at);
  row.dataset.finishedAt = msg.finished_at == null ? "" : String(msg.finished_at);
  if (msg.started_at != null) {
    const started = row.querySelector(".run-started");
    if (started && !started.querySelector("time")) started.replaceChildren(timeElement(msg.started_at));
  }
  tickDurations();
}

// A run's step moved (at most once a second per run: webapp.live.announce.step_moved).
function applyProgress(msg) {
  const step = document.querySelector(`#runs-body tr[data-run-id="${msg.run}"] [data-role="last-step"]`);
  if (step && typeof msg.last_step === "number") step.textContent = String(msg.last_step);
}

// Health alerts fired on a run of the table (webapp/alerts): its row's count goes up.
function applyAlerts(msg) {
  const badge = document.querySelector(`#runs-body tr[data-run-id="${msg.run}"] [data-role="alert-count"]`);
  if (!badge) return;
  const n = Number(badge.dataset.count || 0) + (msg.alerts || []).length;
  badge.dataset.count = String(n);
  badge.textContent = `${n} alert${n === 1 ? "" : "s"}`;
  badge.hidden = n === 0;
}

function showNewRuns() {
  if (document.getElementById("live-new-runs")) return;
  const box = results();
  if (!box) return;
  const p = document.createElement("p");
  p.id = "live-new-runs";
  p.className = "muted";
  const link = document.createElement("a");
  link.href = box.dataset.here || window.location.href;
  link.textContent = "Runs not shown here changed: refresh the table";
  link.addEventListener("click", (e) => {
    if (window.htmx) {
      e.preventDefault();
      window.htmx.trigger(document.body, "runs-changed");
    }
  });
  p.appendChild(link);
  box.prepend(p);
}

function setLiveState(text) {
  const el = document.getElementById("live-state");
  if (!el) return;
  el.textContent = text || "";
  el.hidden = !text;
}

// Status changes of the project's runs. Changes missed while the socket was away are not
// replayed: the table is read again after a reconnect.
function follow(path) {
  const socket = new LiveSocket({
    path,
    handlers: {
      open: ({ reconnected }) => {
        if (reconnected && window.htmx) window.htmx.trigger(document.body, "runs-changed");
      },
      status: applyStatus,
      progress: applyProgress,
      alert: applyAlerts,
      error: (msg) => setLiveState(`Live updates unavailable: ${msg.message}`),
      state: (name, detail) => {
        if (name === "open") {
          setLiveState("");
          document.body.dataset.liveState = "open";
        } else if (name === "waiting") {
          document.body.dataset.liveState = "closed";
          setLiveState(`Live updates paused: reconnecting in ${detail} s…`);
        } else if (name === "closed") {
          document.body.dataset.liveState = "closed";
          if (!document.getElementById("live-state")?.textContent) setLiveState("Live updates unavailable.");
        }
      },
    },
  });
  socket.connect();
  return socket;
}

afterResults();
const box = results();
if (box && box.dataset.socket && "WebSocket" in window) follow(box.dataset.socket);
