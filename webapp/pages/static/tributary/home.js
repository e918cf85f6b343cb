// The landing page: its lists of active and recent runs follow the caller's projects live. On
// every status change a project socket reports, htmx reads the lists again from the server
// (#home-runs-live, pages/_home_runs.html), so which runs are active and which recent is decided
// in one place; htmx queues the last trigger while a read is in flight, so the final swap shows
// the runs as they were after the last change. With more projects than the page opens sockets for,
// the server renders a poll instead (hx-trigger "every N s") and no socket is opened.
// A run's step moves without a read: the sockets' `progress` messages (at most one a second per
// run) are written into its row, and a status message that changes only the words (a preparing
// run's phase) reads nothing either, as the lists show no words.

import { LiveSocket } from "./socket.js";

// The one status line of all the sockets, from each socket's last state ({name, detail}, as
// LiveSocket reports it): the worst of them. Pure (tests/js/home.test.mjs).
export function liveSummary(states) {
  const waiting = states.filter((s) => s.name === "waiting");
  if (states.some((s) => s.name === "closed")) {
    return {
      state: "closed",
      text: "Live updates unavailable for some projects: reload the page to see their runs as they are now.",
    };
  }
  if (waiting.length) {
    const seconds = Math.max(...waiting.map((s) => s.detail || 0));
    return { state: "closed", text: `Live updates paused: reconnecting in ${seconds} s…` };
  }
  return { state: states.every((s) => s.name === "open") ? "open" : "connecting", text: "" };
}

// Whether a status message {run, status} changes the lists: a run not listed, or listed with
// another status. Pure (tests/js/home.test.mjs).
export function changesLists(listedStatus, msg) {
  return listedStatus === undefined || listedStatus !== msg.status;
}

// The step to show after a read of the lists: the one a progress message said if it came after
// the read was sent (the read may be older), else the server's. A step can go down (a resume from
// an earlier checkpoint), so the latest word wins, not the highest. Pure (tests/js/home.test.mjs).
export function stepAfterRead(rendered, heard, readSentAt) {
  return heard && heard.at >= readSentAt ? heard.step : rendered;
}

function refresh() {
  if (window.htmx) window.htmx.trigger(document.body, "home-runs-changed");
}

const heardSteps = new Map(); // run id -> {step, at}: the last progress message of each run
let readSentAt = 0; // when the last read of the lists was sent

function writeStep(runId, step) {
  const el = document.querySelector(`#active-run-${Number(runId)} [data-role="last-step"]`);
  if (!el || typeof step !== "number" || String(step) === el.dataset.step) return;
  el.dataset.step = String(step);
  el.textContent = String(step);
}

function onStatus(msg) {
  const row = document.getElementById(`active-run-${Number(msg.run)}`);
  if (changesLists(row?.dataset.status, msg)) refresh();
  else if (typeof msg.last_step === "number") onProgress(msg);
}

function onProgress(msg) {
  if (typeof msg.last_step !== "number") return;
  heardSteps.set(Number(msg.run), { step: msg.last_step, at: performance.now() });
  writeStep(msg.run, msg.last_step);
}

const states = new Map();
function showState() {
  const { state, text } = liveSummary([...states.values()]);
  document.body.dataset.liveState = state;
  const el = document.getElementById("live-state");
  if (el) {
    el.textContent = text;
    el.hidden = !text;
  }
}

function follow(projectId) {
  const socket = new LiveSocket({
    path: `/ws/projects/${Number(projectId)}/`,
    handlers: {
      // Changes missed while the socket was away are not replayed: read the lists again.
      open: ({ reconnected }) => { if (reconnected) refresh(); },
      status: onStatus,
      progress: onProgress,
      state: (name, detail) => {
        states.set(projectId, { name, detail });
        showState();
      },
    },
  });
  states.set(projectId, { name: "connecting" });
  socket.connect();
  return socket;
}

// Under Node (the tests) there is no page to follow.
const dataEl = globalThis.document?.getElementById("home-live");
const projects = dataEl ? JSON.parse(dataEl.textContent).projects || [] : [];
if (projects.length && "WebSocket" in window) {
  for (const id of projects) follow(id);
  showState();
  // A fresh copy of the lists shows what the server read: steps heard since it was sent are put back.
  document.body.addEventListener("htmx:beforeRequest", () => { readSentAt = performance.now(); });
  document.body.addEventListener("htmx:afterSettle", () => {
    for (const [runId, heard] of heardSteps) writeStep(runId, stepAfterRead(null, heard, readSentAt));
  });
}
