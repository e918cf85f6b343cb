// The landing page: its lists of active and recent runs follow the caller's projects live. On
// every status change a project socket reports, htmx reads the lists again from the server
// (#home-runs-live, pages/_home_runs.html), so which runs are active and which recent is decided
// in one place; htmx queues the last trigger while a read is in flight, so the final swap shows
// the runs as they were after the last change. With more projects than the page opens sockets for,
// the server renders a poll instead (hx-trigger "every N s") and no socket is opened.

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

function refresh() {
  if (window.htmx) window.htmx.trigger(document.body, "home-runs-changed");
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
      status: refresh,
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
}
