// The run page (and the share page): tabs, the live header, charts fed by history then the
// socket, live logs and checkpoints, copy-a-share-link.

import { setupAlerts } from "./alerts.js";
import { ChartGrid, bindControls, fetchSeries } from "./charts.js";
import { Attempts } from "./series.js";
import { contracts } from "./contracts.js";
import { MISSING, formatBytes, formatDuration } from "./format.js";
import { setupLogs } from "./logs.js";
import { LiveSocket } from "./socket.js";
import { setupStages } from "./stages.js";
import { timeElement } from "./times.js";

const $ = (id) => document.getElementById(id);

// --- tabs (WAI-ARIA tabs: arrows move, Home/End jump; the URL hash remembers the tab) -------
function setupTabs() {
  const list = $("run-tabs");
  if (!list) return;
  const tabs = [...list.querySelectorAll("[role=tab]")];
  const select = (tab, focus) => {
    for (const t of tabs) {
      const on = t === tab;
      t.setAttribute("aria-selected", on ? "true" : "false");
      t.tabIndex = on ? 0 : -1;
      $(t.getAttribute("aria-controls")).hidden = !on;
    }
    if (focus) tab.focus();
    const name = tab.id.replace(/^tab-/, "");
    history.replaceState(null, "", name === "charts" ? location.pathname + location.search : "#" + name);
    window.dispatchEvent(new Event("resize"));
  };
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => select(tab, false));
    tab.addEventListener("keydown", (e) => {
      let j = null;
      if (e.key === "ArrowRight") j = (i + 1) % tabs.length;
      else if (e.key === "ArrowLeft") j = (i - 1 + tabs.length) % tabs.length;
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = tabs.length - 1;
      if (j !== null) { e.preventDefault(); select(tabs[j], true); }
    });
  });
  const wanted = location.hash && $("tab-" + location.hash.slice(1));
  if (wanted) select(wanted, false);
}

// --- header --------------------------------------------------------------------------------
// The header (state, facts, status line, actions) is the server's: after a status change htmx
// swaps in a fresh copy (_header.html, from its data-refresh URL), so which actions a state allows
// is decided in one place. Between swaps this keeps up to date what moves on its own: the badge
// at once, the step (header and status line), elapsed time, ETA and the socket's state.
function header(data, grid) {
  const run = data.run;
  const { isTerminal } = contracts();
  let liveState = "", liveText = "";
  // One read at a time; changes heard meanwhile make one more read after it, so the last swap
  // always shows the run as it was after the last change.
  let reading = false, again = false, afterAction = false;
  const acting = () => document.querySelector("#run-header .htmx-request") !== null;
  const writeStep = () => {
    const stepEl = $("run-step");
    if (stepEl) { stepEl.textContent = String(run.last_step); stepEl.dataset.step = String(run.last_step); }
    for (const el of document.querySelectorAll("[data-live-step]")) el.textContent = String(run.last_step);
  };
  const show = {
    // Shows `status` and records `message`; returns whether either differs from what the page had.
    status(status, message) {
      let differs = false;
      if (status && status !== run.status) {
        differs = true;
        run.status = status;
        const badge = $("run-status");
        badge.textContent = status;
        badge.className = "badge " + (data.badges[status] || "secondary");
        badge.dataset.status = status;
        run.is_final = isTerminal(status);
        if (run.is_final && !run.finished_at) run.finished_at = Date.now() / 1000;
      }
      if (message !== undefined && message !== null && message !== run.message) {
        differs = true;
        run.message = message;
      }
      this.tick();
      return differs;
    },
    // Read the header as the run is now and swap it in. An action of the header (Cancel, Resume,
    // a rename) on its way answers with the fresh header, swapped where its form is: replacing the
    // header under it would send that answer into the detached copy (htmx then reports its
    // out-of-band parts, the attempts list and the checkpoint count, as htmx:oobErrorNoTarget and
    // the page never shows it). So no read starts while an action is out, and a read that lands
    // while one is out is dropped; either way the header is read again once the action's answer
    // has settled. Fetched here and swapped with htmx.swap, so that check and the swap are one step.
    async refresh() {
      if (reading) { again = true; return; }
      if (acting()) { afterAction = true; return; }
      reading = true;
      try {
        do {
          again = false;
          const el = $("run-header");
          if (!el || !window.htmx) return;
          let html;
          try {
            const res = await fetch(el.dataset.refresh, {
              credentials: "same-origin", headers: { "HX-Request": "true" },
            });
            if (!res.ok) return; // signed out or gone; the next status change tries again
            html = await res.text();
          } catch (err) {
            return; // offline; the next status change tries again
          }
          if (acting()) { afterAction = true; return; }
          // A change heard while this read was out: its answer may show the run as it was
          // before (a resume heard while the read of the cancellation was out would put the
          // cancelled badge back over the queued one). Not swapped in; the loop reads again.
          if (again) continue;
          const current = $("run-header");
          if (current) window.htmx.swap(current, html, { swapStyle: "outerHTML" });
        } while (again);
      } finally {
        reading = false;
      }
    },
    step(step) {
      if (typeof step === "number" && step > run.last_step) {
        run.last_step = step;
        writeStep();
      }
    },
    // A rewind: the run's history now ends before `step` (the new attempt goes on from there).
    rewound(step) {
      run.last_step = Math.min(run.last_step, step - 1);
      writeStep();
    },
    live(state, text) {
      liveState = state;
      liveText = text;
      const el = $("live-state");
      if (el) { el.dataset.state = state; el.textContent = text; }
    },
    // After a swap: the server's step may be newer than the socket's, never older than shown.
    swapped() {
      const server = Number($("run-step")?.dataset.step);
      if (server > run.last_step) run.last_step = server;
      writeStep();
      this.live(liveState, liveText);
      this.tick();
    },
    tick() {
      const elapsed = $("run-elapsed"), eta = $("run-eta");
      if (!elapsed || !eta) return;
      if (run.started_at) {
        const end = run.is_final && run.finished_at ? run.finished_at : Date.now() / 1000;
        elapsed.textContent = formatDuration(end - run.started_at);
        const started = $("run-started");
        if (started && !started.querySelector("time")) started.replaceChildren(timeElement(run.started_at));
      }
      const rate = grid.stepRate(0);
      if (!run.is_final && run.total_steps && rate) {
        eta.textContent = formatDuration((run.total_steps - run.last_step) / rate);
        eta.title = `${rate.toFixed(3)} steps/s`;
      } else {
        eta.textContent = MISSING;
      }
    },
  };
  document.body.addEventListener("htmx:afterSettle", () => {
    show.swapped();
    if (afterAction) { afterAction = false; show.refresh(); }
  });
  setInterval(() => show.tick(), 1000);
  return show;
}

// --- checkpoints (the Logs tab is logs.js) ---------------------------------------------
function setupCheckpoints() {
  const table = $("checkpoints");
  if (!table) return () => {};
  return (event) => {
    const body = table.tBodies[0];
    if (body.querySelector(`tr[data-seq="${event.seq}"]`)) return;
    const tr = document.createElement("tr");
    tr.dataset.seq = String(event.seq);
    const cell = (...content) => { const td = document.createElement("td"); td.append(...content); tr.append(td); return td; };
    // No path: where the worker keeps it is no business of the page (the API has it).
    cell(String(event.step));
    cell(formatBytes(event.bytes));
    cell(timeElement(new Date())).className = "hide-narrow";
    body.append(tr);
    // The checkpoints this one's save deleted (checkpoint.keep_last): still listed, no longer offered.
    for (const seq of event.deleted_seqs || []) {
      const row = body.querySelector(`tr[data-seq="${seq}"]`);
      if (!row || row.classList.contains("deleted")) continue;
      row.className = "deleted";
      row.title = table.dataset.deletedTitle;
      row.querySelector("td .muted")?.remove();
      const note = document.createElement("span");
      note.className = "muted";
      note.textContent = "(deleted)";
      row.cells[0].append(" ", note);
    }
    table.hidden = false;
    $("checkpoints-empty").hidden = true;
    const count = $("checkpoint-count");
    if (count) count.textContent = String(body.rows.length);
  };
}

// --- superseded points (a resume from an earlier step) ----------------------------------------
// Hidden by default; the toggle draws them faded, reading them from the API the first time (a
// rewind heard live moves the page's own points there too).
function setupSuperseded(data, grid) {
  const box = $("show-superseded"), wrap = $("superseded-toggle");
  if (!box) return () => {};
  let loaded = false;
  box.addEventListener("change", async () => {
    if (box.checked && !loaded) {
      try {
        grid.loadSuperseded(0, await fetchSeries(data.api, 1000, { superseded: true }));
        loaded = true;
      } catch (err) {
        grid.setMessage("Could not load the superseded points: " + err.message);
      }
    }
    grid.setSuperseded(box.checked);
  });
  return () => { if (wrap) wrap.hidden = false; };
}

// --- copy a share link -------------------------------------------------------------------
document.addEventListener("click", async (e) => {
  const button = e.target.closest(".copy-share");
  if (!button) return;
  const url = location.origin + button.dataset.path;
  try {
    await navigator.clipboard.writeText(url);
    button.textContent = "Copied";
  } catch (err) {
    window.prompt("Copy this link:", url);
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
});

// --- start -----------------------------------------------------------------------------------
async function start() {
  const data = JSON.parse($("run-data").textContent);
  setupTabs();
  const grid = new ChartGrid($("charts"), [{ id: data.run.id, name: data.run.name }], {
    stateEl: $("charts-state"), pickerEl: $("panel-picker-list"),
  });
  window.tributaryCharts = grid; // for the browser tests: grid.pointCount(), grid.panels
  bindControls(grid);
  const show = header(data, grid);
  const logs = setupLogs();
  grid.markAlerts(data.alerts || []); // the alerts stored before the page loaded (listed by the server)
  const alerts = setupAlerts({ titles: data.alert_titles || {}, mark: (fresh) => grid.markAlerts(fresh) });
  const addCheckpoint = setupCheckpoints();
  const stages = setupStages(data, grid, $("charts")); // data.stages: marks and the accuracy heatmap
  const offerSuperseded = setupSuperseded(data, grid);
  // A resume from an earlier step, heard live: the first point of a later attempt supersedes
  // the points at its step and after (as the web app does to the stored ones).
  const attempts = new Attempts(data.run.points_attempt);
  const applyRewind = (e) => {
    const at = attempts.rewindAt(e);
    if (at === null) return;
    grid.rewind(0, at);
    stages.rewind(at);
    show.rewound(at);
    offerSuperseded();
  };
  show.tick();

  // History first (downsampled), from the cursor the run had when we asked; then the socket
  // replays everything after that cursor (a point the history already holds is skipped).
  let afterSeq = data.run.last_seq;
  try {
    if (!data.run.is_final) {
      const res = await fetch(data.api, { credentials: "same-origin" });
      if (res.ok) {
        const fresh = await res.json();
        afterSeq = fresh.last_seq;
        if (show.status(fresh.status, fresh.status_message)) show.refresh();
        show.step(fresh.last_step);
      }
    }
    // The first panel's series alone, drawn at once; then everything else.
    // (When the first panel holds every metric, its read is the only one.)
    const first = grid.firstPanelNames(data.metric_names);
    if (first.length) {
      grid.loadHistory(0, await fetchSeries(data.api, 1000, { names: first }));
      grid.schedule();
    }
    if (first.length < data.metric_names.length) {
      grid.loadHistory(0, await fetchSeries(data.api, 1000, { exclude: first }));
    }
    grid.setMessage("");
  } catch (err) {
    grid.setMessage("Could not load the metrics history: " + err.message);
  }
  grid.loaded = true;
  grid.schedule();
  stages.loadStore(grid.store);
  document.body.dataset.historyLoaded = "true";

  let hellos = 0;
  const client = new LiveSocket({
    path: data.socket,
    afterSeq,
    share: data.share,
    // A finished run may be resumed (the same run continues): the page keeps listening.
    stopOnFinal: false,
    handlers: {
      // Every connection starts with the run as it is now: after a reconnect, or when it differs
      // from what the page shows, the header is read again (a change may have gone unheard).
      hello: (m) => {
        logs.catchUp(); // output lines stored before this connection (its replay has the events)
        const differs = show.status(m.status, m.message);
        if (differs || hellos > 0) show.refresh();
        // Alerts fired while the socket was down: read them (each is added once, by id).
        if (hellos > 0 && !data.share) {
          fetch(`/api/runs/${data.run.id}/alerts`, { credentials: "same-origin" })
            .then((res) => (res.ok ? res.json() : [])).then((list) => alerts.add(list)).catch(() => {});
        }
        hellos += 1;
        show.step(m.last_step);
        if (m.started_at) data.run.started_at = m.started_at;
        if (m.finished_at) data.run.finished_at = m.finished_at;
        if (m.worker_host) $("run-worker").textContent = m.worker_host;
      },
      metrics: (e) => { applyRewind(e); grid.addPoints(0, e.step, e.time, e.values || {}); stages.add(e.step, e.values); show.step(e.step); },
      samples: applyRewind,
      status: (m) => {
        // A status message {status, message, ...}: the run changed (a cancel request included).
        // The engine's status event {state, message} comes after its status message: the badge only.
        if (m.status) {
          show.status(m.status, m.message);
          show.refresh();
          // The socket stops at a final status; the worker sends the output's tail after it.
          if (contracts().isTerminal(m.status)) for (const ms of [0, 1000, 3000, 10000, 30000, 60000]) setTimeout(() => logs.catchUp(), ms);
        } else {
          show.status(m.state);
        }
        if (typeof m.last_step === "number") show.step(m.last_step);
        if (m.worker_host) $("run-worker").textContent = m.worker_host;
        // A status message has the run's times as they are now: a resume clears them (not started yet).
        if (m.status && "started_at" in m) {
          data.run.started_at = m.started_at;
          data.run.finished_at = m.finished_at;
        }
      },
      log: logs.event,
      output: logs.output,
      alert: (m) => alerts.add(m.alerts),
      checkpoint: addCheckpoint,
      error: (m) => grid.setMessage(m.message || "The live connection was refused."),
      state: (name, detail) => {
        show.live(name, name === "open" ? "live" : name === "waiting" ? `reconnecting in ${detail}s`
          : name === "closed" ? "" : name + "…");
      },
    },
  });
  window.tributaryLive = client; // for the browser tests and bench/ui.py
  client.connect();
}

start();
