// The compare page: runs picked from a server-side search and dropped again without a reload
// (the link keeps ?runs=, history.replaceState), one panel per metric with one colour per run
// (the run's slot, the same on every panel, in the runs table and the legend), a metric search
// that adds panels, runs grouped by a config key and drawn as their mean with a band, and a
// scatter and parallel coordinates of config against a metric's final or best value.
//
// The server renders what follows the selection (runs table, summary, config diff and the JSON
// below them: webapp/pages/runs/compare.py); after an add or a drop this module asks
// compare/parts/ for them again, swaps them in and reconciles the charts with the new list.

import { ChartGrid, PALETTE, bindControls, defaultMetrics, fetchSeries } from "./charts.js";
import { drawParallel, drawScatter, runValue } from "./compare_analysis.js";
import { groupRuns } from "./groups.js";
import { Attempts } from "./series.js";
import { LiveSocket } from "./socket.js";

const $ = (id) => document.getElementById(id);
// Points per series: the API downsamples beyond it into buckets that keep their min and max. A
// compare panel (about 450 px wide at 1440 px, one column on a phone) overlays up to 12 runs, so
// 500 points (about one per pixel) lose nothing a line can show, and halve the history every
// page load reads (the run page, one run per panel, asks for 1000).
const POINTS = 500;

const params = new URLSearchParams(location.search);
const state = {
  data: null, // the latest compare-data (runs, diff_keys, metric_names, max_runs)
  ids: [], // run ids in page order
  slots: new Map(), // run id -> slot (colour index), kept while the run stays on the page
  live: new Map(), // run id -> LiveSocket
  names: new Set(), // metric names of any shown run
  urlMetrics: params.has("metrics"), // the panels came from the link, not the defaults
  extra: new Map(), // "slot|name" -> series fetched for the analysis only (no panel)
};

const grid = new ChartGrid($("charts"), [], { compare: true, stateEl: $("charts-state"), syncKey: "tributary-compare" });
window.tributaryCharts = grid;
bindControls(grid);
grid.onHide = () => { state.urlMetrics = true; writeUrl(); fillMetricList(); };

// A run's history into the charts, unless the run was dropped while it was on its way.
async function loadSeries(run, names) {
  const slot = state.slots.get(run.id);
  const list = await fetchSeries(run.api, POINTS, { names });
  if (state.slots.get(run.id) === slot) grid.loadHistory(slot, list);
}

function colourOf(id) { return PALETTE[state.slots.get(id) % PALETTE.length]; }

function runOf(id) { return state.data.runs.find((r) => r.id === id); }

// --- the link -------------------------------------------------------------------------------

function writeUrl() {
  const q = new URLSearchParams();
  q.set("runs", state.ids.join(","));
  if (state.urlMetrics) q.set("metrics", grid.shown.join(","));
  const key = $("group-key").value;
  if (key) { q.set("group", key); q.set("band", $("group-band").value); }
  const metric = $("analysis-metric").value.trim();
  if (metric) q.set("metric", metric);
  if ($("analysis-agg").value !== "final") q.set("agg", $("analysis-agg").value);
  if ($("scatter-key").value) q.set("x", $("scatter-key").value);
  history.replaceState(null, "", `${location.pathname}?${q.toString().replace(/%2C/g, ",")}`);
}

// --- runs in, runs out ------------------------------------------------------------------------

// The slot of a new run: the lowest one no shown run holds, so colours never repeat on a page.
function takeSlot() {
  const used = new Set(state.slots.values());
  let s = 0;
  while (used.has(s)) s++;
  return s;
}

// Where a live run's socket starts: its cursor as the server read it for the page's data
// (compare.py; compare/parts/ after an add), before any of the history read next. Reading it
// there, not from the run's API, spares a request per live run ahead of the first panel.
function lastSeq(run) { return run.is_final ? 0 : run.last_seq; }

// Follow a live run (its points appended, a rewind redrawn past its branch point, as on its page).
function follow(run, afterSeq) {
  const slot = state.slots.get(run.id);
  const attempts = new Attempts(run.points_attempt);
  const rewind = (e) => { const at = attempts.rewindAt(e); if (at !== null) grid.rewind(slot, at); };
  const client = new LiveSocket({
    path: run.socket, afterSeq, stopOnFinal: true,
    handlers: {
      metrics: (e) => { rewind(e); grid.addPoints(slot, e.step, e.time, e.values || {}); },
      samples: rewind,
    },
  });
  state.live.set(run.id, client);
  client.connect();
}

// Bring the charts to the runs of state.data: new runs get a slot and their history (the first
// panel's metric for every run first, so one chart is drawn before the rest arrives), dropped
// runs leave every panel.
async function reconcile() {
  const data = state.data;
  const wanted = new Set(data.runs.map((r) => r.id));
  for (const [id, slot] of [...state.slots]) {
    if (wanted.has(id)) continue;
    state.live.get(id)?.stop("dropped");
    state.live.delete(id);
    grid.removeRun(slot);
    state.slots.delete(id);
    for (const key of [...state.extra.keys()]) if (key.startsWith(slot + "|")) state.extra.delete(key);
  }
  const fresh = data.runs.filter((r) => !state.slots.has(r.id));
  for (const run of fresh) { const slot = takeSlot(); state.slots.set(run.id, slot); grid.runs[slot] = run; }
  state.ids = data.runs.map((r) => r.id);
  state.names = new Set(data.metric_names);
  if (!state.urlMetrics) for (const name of defaultMetrics(state.names)) grid.showMetric(name);
  paintSwatches();
  fillMetricList();
  fillKeyLists();
  writeUrl();
  grid.loaded = false;
  grid.setMessage(data.runs.length ? "Loading metrics…" : "Add runs to draw their metrics.");
  const shown = grid.shown.filter((n) => state.names.has(n));
  const [first, ...rest] = shown;
  const failures = [];
  const each = (load) => Promise.all(fresh.map(async (run) => {
    try { return await load(run); } catch (err) { failures.push(`${run.name}: ${err.message}`); return null; }
  }));
  // A live run's cursor is read before any of its history (it comes with the page's data):
  // every point stored after it is replayed by the socket, every point before it is in the
  // history read next (a point in both is skipped by the series). Read after the first panel's
  // series, the points stored in between were in neither: a gap in the first panel.
  const afterSeqs = new Map();
  await each(async (run) => {
    afterSeqs.set(run.id, lastSeq(run));
    if (first) await loadSeries(run, [first]);
  });
  if (first) grid.schedule();
  // The rest of every run's history, handed to the charts together: a panel is built once with
  // all its runs rather than once per run's answer (8 runs: 8 rebuilds of every panel).
  const got = await each(async (run) => {
    if (!afterSeqs.has(run.id)) return null; // its cursor or first panel failed (said below)
    const afterSeq = afterSeqs.get(run.id);
    return { run, afterSeq, slot: state.slots.get(run.id), list: rest.length ? await fetchSeries(run.api, POINTS, { names: rest }) : [] };
  });
  for (const one of got) if (one && state.slots.get(one.run.id) === one.slot) grid.loadHistory(one.slot, one.list);
  grid.schedule();
  for (const one of got) if (one && !one.run.is_final && state.slots.get(one.run.id) === one.slot) follow(one.run, one.afterSeq);
  grid.loaded = true;
  grid.setMessage(failures.length ? "Could not load " + failures.join("; ") : data.runs.length ? "" : "Add runs to draw their metrics.");
  applyGroups();
  await analysis();
  grid.schedule();
}

function paintSwatches() {
  for (const swatch of document.querySelectorAll(".swatch[data-run-id]")) {
    const id = Number(swatch.dataset.runId);
    if (!state.slots.has(id)) continue;
    swatch.style.background = colourOf(id);
    swatch.dataset.colour = colourOf(id);
  }
  for (const row of document.querySelectorAll("#compare-runs tr[data-run-id]")) row.dataset.colour = colourOf(Number(row.dataset.runId));
  const count = $("compare-count");
  count.textContent = `(${state.ids.length} of at most ${count.dataset.max})`;
}

// The selection asked for last (run ids in page order): an add or a drop changes it at once, so
// a second add while the first is on its way extends the first's list, never the page's older
// one. One update runs at a time (`updating`); it catches up with `wanted` until they agree.
let wanted = [];
let updating = null;

// Show the runs of `ids` (the server's parts for them swapped in, then the charts follow).
function select(ids) {
  wanted = [...new Set(ids)];
  if (!updating) updating = catchUp();
  return updating;
}

const same = (a, b) => a.length === b.length && a.every((id, i) => id === b[i]);

// Bring the page to `wanted`: ask compare/parts/ for it, swap the parts in, reconcile the charts;
// again while `wanted` moved meanwhile (an answer for a list no longer wanted is not swapped in).
async function catchUp(initial = false) {
  try {
    if (initial) await reconcile();
    while (!same(wanted, state.ids)) {
      document.body.dataset.historyLoaded = "false";
      const ids = wanted.slice();
      const parts = $("compare-parts");
      const res = await fetch(`${parts.dataset.url}?runs=${ids.join(",")}`, { credentials: "same-origin" });
      if (!res.ok) {
        $("compare-search-state").textContent = `Could not update the comparison: HTTP ${res.status}`;
        wanted = state.ids.slice();
        break;
      }
      const html = await res.text();
      if (!same(ids, wanted)) continue; // asked for another list meanwhile: ask for that one
      parts.innerHTML = html;
      bindParts();
      // The server leaves out runs the user may not see: what it showed is what was wanted.
      wanted = state.data.runs.map((r) => r.id);
      await reconcile();
      if (same(wanted, state.ids)) search(); // the runs offered: those not shown now
    }
  } catch (err) {
    $("compare-search-state").textContent = `Could not update the comparison: ${err.message}`;
    wanted = state.ids.slice();
  } finally {
    updating = null;
  }
  document.body.dataset.historyLoaded = "true";
}

function bindParts() {
  const node = $("compare-data");
  state.data = JSON.parse(node.textContent);
  const only = $("only-diff"), table = $("config-diff");
  if (only && table) only.addEventListener("change", () => table.classList.toggle("only-diff", only.checked));
  for (const box of document.querySelectorAll("input.run-visible")) {
    box.addEventListener("change", () => { grid.setRunVisible(state.slots.get(Number(box.dataset.runId)), box.checked); analysis(); });
  }
  for (const button of document.querySelectorAll("button.run-drop")) {
    button.addEventListener("click", () => select(wanted.filter((id) => id !== Number(button.dataset.runId))));
  }
}

// --- the run search ------------------------------------------------------------------------------

let searchTimer = 0, searchSeq = 0;
async function search() {
  const input = $("compare-search"), list = $("compare-results"), status = $("compare-search-state");
  const seq = ++searchSeq;
  const q = new URLSearchParams({ q: input.value.trim(), exclude: wanted.join(",") });
  const res = await fetch(`${input.dataset.url}?${q}`, { credentials: "same-origin" });
  if (seq !== searchSeq) return; // a later search answered first
  const body = await res.json().catch(() => ({}));
  list.textContent = "";
  if (!res.ok) { status.textContent = body.detail || `Search failed: HTTP ${res.status}`; list.dataset.count = "0"; return; }
  const full = wanted.length >= state.data.max_runs;
  status.textContent = full ? `${state.data.max_runs} runs are shown, the most a comparison holds: drop one to add another.`
    : body.runs.length ? "" : "No run matches.";
  for (const run of body.runs) {
    const li = document.createElement("li");
    li.dataset.runId = String(run.id);
    const add = document.createElement("button");
    add.type = "button";
    add.className = "secondary compare-add-run";
    add.textContent = "Add";
    add.disabled = full;
    add.setAttribute("aria-label", `Add ${run.name} to the comparison`);
    add.addEventListener("click", () => {
      if (wanted.length >= state.data.max_runs) { status.textContent = `${state.data.max_runs} runs are shown, the most a comparison holds: drop one to add another.`; return; }
      add.disabled = true; // on its way: the list is asked again once it is shown
      select([...wanted, run.id]);
    });
    const label = document.createElement("span");
    label.textContent = `${run.name} #${run.id} · ${run.status} · step ${run.last_step ?? 0} · ${run.project}`
      + (run.tags.length ? ` · ${run.tags.join(", ")}` : "");
    li.append(add, " ", label);
    list.appendChild(li);
  }
  list.dataset.count = String(body.runs.length);
}

// --- panels, groups, analysis ------------------------------------------------------------------

function fillMetricList() {
  const list = $("metric-names");
  list.textContent = "";
  for (const name of [...state.names].sort()) {
    const option = document.createElement("option");
    option.value = name;
    list.appendChild(option);
  }
}

async function addPanel(name) {
  if (!state.names.has(name)) { grid.setMessage(`No shown run logged a metric named ${JSON.stringify(name)}.`); return; }
  if (!grid.showMetric(name)) return;
  state.urlMetrics = true;
  writeUrl();
  await Promise.all(state.data.runs.map((run) => loadSeries(run, [name])));
  grid.schedule();
}

function fillKeyLists() {
  const keys = state.data.diff_keys;
  for (const [id, blank] of [["group-key", "no grouping"], ["scatter-key", null]]) {
    const select = $(id);
    const before = select.value || params.get(id === "group-key" ? "group" : "x") || "";
    select.textContent = "";
    if (blank) select.append(new Option(blank, ""));
    for (const key of keys) select.append(new Option(key, key));
    if (keys.includes(before)) select.value = before;
    else if (!blank && keys.length) select.value = keys.find((k) => typeof state.data.runs[0]?.config[k] === "number") || keys[0];
  }
  params.delete("group"); params.delete("x");
}

function applyGroups() {
  const key = $("group-key").value;
  if (!key) { grid.setGroups(null); return; }
  const runs = state.data.runs.map((r) => ({ ...r, slot: state.slots.get(r.id) }));
  const groups = groupRuns(runs, key).map((g) => ({ ...g, label: `${g.label} (${g.slots.length})`, colour: PALETTE[g.slots[0] % PALETTE.length] }));
  grid.setGroups(groups, $("group-band").value);
}

// Each shown run's value of metric `name` (agg: final, max, min): a live run's from the series
// its panel holds (the freshest), else from the summary ingest keeps (final, min and max over the
// whole history: webapp.analysis), else from its series fetched once for the analysis.
const AGG = { final: 0, min: 1, max: 2 };
async function valuesOf(name, agg) {
  const out = new Map();
  await Promise.all(state.data.runs.map(async (run) => {
    const key = `${state.slots.get(run.id)}|${name}`;
    let series = grid.store.byKey(key);
    if (!(series && !run.is_final) && run.summaries[name]) { out.set(run.id, run.summaries[name][AGG[agg]]); return; }
    series = series || state.extra.get(key);
    if (!series) {
      series = (await fetchSeries(run.api, POINTS, { names: [name] }))[0] || { step: [], value: [] };
      state.extra.set(key, series);
    }
    out.set(run.id, runValue(series, agg));
  }));
  return out;
}

async function analysis() {
  const input = $("analysis-metric"), note = $("analysis-state");
  if (!input.value.trim()) input.value = params.get("metric") || grid.shown.find((n) => state.names.has(n)) || "";
  const name = input.value.trim(), agg = $("analysis-agg").value, key = $("scatter-key").value;
  writeUrl();
  const shown = state.data.runs.filter((r) => !grid.hiddenRuns.has(state.slots.get(r.id)));
  if (!shown.length || !name) { note.textContent = "Add runs to plot their config against a metric."; drawScatter($("scatter"), [], "", ""); drawParallel($("parallel"), [], [], ""); return; }
  if (!state.names.has(name)) { note.textContent = `No shown run logged a metric named ${JSON.stringify(name)}: pick one from the list.`; return; }
  const values = await valuesOf(name, agg);
  const label = `${name} (${agg})`;
  const rows = shown.map((run) => ({ id: run.id, name: run.name, colour: colourOf(run.id), config: run.config,
    value: values.get(run.id) }));
  const missing = rows.filter((r) => r.value == null).map((r) => r.name);
  note.textContent = (state.data.diff_keys.length ? "" : "The configs are identical: the scatter has one x value and parallel coordinates only the metric. ")
    + (missing.length ? `Not logged by ${missing.join(", ")}.` : "");
  drawScatter($("scatter"), rows, key, label);
  drawParallel($("parallel"), rows, state.data.diff_keys.slice(0, 8), label);
}

// --- start -----------------------------------------------------------------------------------------

function start() {
  $("group-band").value = params.get("band") === "std" ? "std" : "minmax";
  $("analysis-agg").value = ["max", "min"].includes(params.get("agg")) ? params.get("agg") : "final";
  if (params.has("metrics")) for (const name of params.get("metrics").split(",").filter(Boolean).slice(0, 60)) grid.showMetric(name);
  bindParts();
  const input = $("compare-search");
  input.addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(search, 200); });
  const metric = $("metric-search");
  metric.addEventListener("change", () => { const name = metric.value.trim(); metric.value = ""; if (name) addPanel(name); });
  $("group-key").addEventListener("change", () => { applyGroups(); writeUrl(); });
  $("group-band").addEventListener("change", () => { applyGroups(); writeUrl(); });
  for (const id of ["analysis-metric", "analysis-agg", "scatter-key"]) $(id).addEventListener("change", analysis);
  let resize = 0;
  window.addEventListener("resize", () => { clearTimeout(resize); resize = setTimeout(analysis, 200); });
  // Without JavaScript the pick section is a GET form (compare.html): here it searches in place,
  // and an Add button the server rendered into it adds in place too.
  $("compare-pick-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const add = event.submitter?.name === "add" ? Number(event.submitter.value) : 0;
    if (add) select([...wanted, add]);
    else { clearTimeout(searchTimer); search(); }
  });
  wanted = state.data.runs.map((r) => r.id);
  updating = catchUp(true);
  search();
}

start();
