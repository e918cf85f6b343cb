// The compare page: every run's metrics overlaid on the same panels (one colour per run), run
// toggles, live updates for runs still going, and the "only differences" switch of the config
// diff.

import { ChartGrid, PALETTE, bindControls, fetchSeries } from "./charts.js";
import { Attempts } from "./series.js";
import { LiveSocket } from "./socket.js";

const $ = (id) => document.getElementById(id);

async function start() {
  const only = $("only-diff"), table = $("config-diff");
  if (only && table) only.addEventListener("change", () => table.classList.toggle("only-diff", only.checked));

  const node = $("compare-data");
  if (!node) return;
  const data = JSON.parse(node.textContent);
  const grid = new ChartGrid($("charts"), data.runs, {
    compare: true, stateEl: $("charts-state"), pickerEl: $("panel-picker-list"), syncKey: "tributary-compare",
  });
  window.tributaryCharts = grid;
  bindControls(grid);

  for (const swatch of document.querySelectorAll(".swatch[data-run-index]")) {
    swatch.style.background = PALETTE[Number(swatch.dataset.runIndex) % PALETTE.length];
  }
  for (const box of document.querySelectorAll("input.run-visible")) {
    box.addEventListener("change", () => grid.setRunVisible(Number(box.dataset.runIndex), box.checked));
  }

  const failures = [];
  await Promise.all(data.runs.map(async (run, r) => {
    try {
      let afterSeq = 0;
      if (!run.is_final) {
        const res = await fetch(run.api, { credentials: "same-origin" });
        if (res.ok) afterSeq = (await res.json()).last_seq;
      }
      grid.loadHistory(r, await fetchSeries(run.api, 1000));
      if (!run.is_final) {
        // A run resumed from an earlier step (a rewind) redraws past its branch point, as on its page.
        const attempts = new Attempts(run.points_attempt);
        const rewind = (e) => { const at = attempts.rewindAt(e); if (at !== null) grid.rewind(r, at); };
        const client = new LiveSocket({
          path: run.socket, afterSeq, stopOnFinal: true,
          handlers: {
            metrics: (e) => { rewind(e); grid.addPoints(r, e.step, e.time, e.values || {}); },
            samples: rewind,
          },
        });
        client.connect();
      }
    } catch (err) {
      failures.push(`${run.name}: ${err.message}`);
    }
  }));
  grid.loaded = true;
  grid.setMessage(failures.length ? "Could not load " + failures.join("; ") : "");
  grid.schedule();
  document.body.dataset.historyLoaded = "true";
}

start();
