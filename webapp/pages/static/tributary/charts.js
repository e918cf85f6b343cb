// uPlot panels for metric series: default RL panels plus one per prefix of any other metric,
// EMA smoothing (raw faint, smoothed solid), x by step or wall time, log scale, drag-zoom with
// double-click reset, cursors synced across charts, min/max bands where the history was
// downsampled, panels picked and pinned (localStorage). Updates are batched per animation frame.
// One grid serves a run (one run, colour per metric) and compare: one panel per metric, one
// colour per run (the run's slot on the page), or per group of runs with its mean and band.
// The data (merging, thinning, alignment, smoothing) is series.js's; this module is the DOM.

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { formatDuration, formatNumber, formatTick } from "./format.js";
import { groupStats } from "./groups.js";
import { SeriesStore, chartData, sparse, supersededView, xRange } from "./series.js";
import { drawStageMarks } from "./stages.js";

// Twelve colours told apart on white (compare shows up to 12 runs, one colour each): distinct
// hues first, then dark and light ones.
export const PALETTE = ["#2160c4", "#d9480f", "#2b8a3e", "#c92a2a", "#7048e8", "#1098ad", "#e64980", "#8c564b",
  "#868e96", "#b08900", "#212529", "#74c0fc"];
const DASHES = [null, [6, 3], [2, 3], [10, 3, 2, 3], [1, 4]];
const PIN_KEY = "tributary.charts.pins";
const HIDE_KEY = "tributary.charts.hidden";
const FRAME_BUDGET_MS = 12; // drawing per animation frame before the rest waits for the next
const X_PAD = { step: 1, time: 60 }; // steps / seconds either side of a chart's only x value
// Step ticks are whole steps (uPlot's default increments include 0.5, 0.2, ...).
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 2.5e4, 5e4,
  1e5, 2e5, 2.5e5, 5e5, 1e6, 2e6, 5e6, 1e7];

// A y axis as wide as its longest tick label (uPlot calls this with the formatted labels).
function axisWidth(u, values) {
  if (!values) return 48;
  const longest = values.reduce((n, v) => Math.max(n, String(v).length), 0);
  return Math.max(40, 14 + longest * 7);
}

// A linear y range around the data; a flat series (a reward stuck at 0, a constant learning
// rate) gets a band of +-10% (+-1 around zero) instead of uPlot's 0..100 default.
function yRange(u, min, max) {
  if (min == null || max == null) return [0, 1];
  if (min === max) { const pad = Math.abs(min) * 0.1 || 1; return [min - pad, max + pad]; }
  return uPlot.rangeNum(min, max, 0.1, true);
}

// The default panels, in order. A metric goes to the first panel that takes it; any other
// metric goes to a panel of its prefix (the part before the first "/").
const DEFAULT_PANELS = [
  { id: "reward", title: "Reward", take: (n) => n === "reward/mean" || /^reward\/.+\/mean$/.test(n) },
  { id: "accuracy", title: "Accuracy (train, eval)", take: (n) => n === "train/accuracy" || n === "eval/accuracy" },
  { id: "entropy", title: "Entropy", take: (n) => n === "actor/entropy" },
  { id: "kl", title: "KL", take: (n) => ["actor/kl_loss", "actor/ppo_kl", "rollout/mismatch_kl"].includes(n) },
  { id: "clipfrac", title: "PG clip fraction", take: (n) => n === "actor/pg_clipfrac" },
  { id: "response_length", title: "Response length (clip ratio right)",
    take: (n) => n === "response_length/mean" || n === "response_length/clip_ratio",
    y2: (n) => n === "response_length/clip_ratio" },
  { id: "grad_norm", title: "Gradient norm", take: (n) => n === "actor/grad_norm" },
  { id: "lr", title: "Learning rate", take: (n) => n === "actor/lr" },
  { id: "throughput", title: "Throughput",
    take: (n) => n.startsWith("perf/") || /(tokens?|tok)[_/ ]?(per[_ ]?s(ec)?|\/s)|throughput/i.test(n) },
  { id: "timing", title: "Time per step (s, stacked)", take: (n) => n.startsWith("timing_s/"), stacked: true },
  // System metrics of the run's processes (engine/system_metrics.py), memory by phase.
  { id: "system_cpu", title: "System: CPU (% of one core)", take: (n) => n === "system/cpu_percent" },
  { id: "system_memory", title: "System: memory (GB, max by phase)",
    take: (n) => n === "system/rss_gb" || n.startsWith("system/rss_gb/") },
  { id: "system_gpu_memory", title: "System: GPU memory (GB, max by phase)",
    take: (n) => n === "system/gpu_mem_gb" || n.startsWith("system/gpu_mem_gb/") || /^system\/gpu\d+\/mem_gb$/.test(n) },
  { id: "system_gpu", title: "System: GPU utilisation (%)", take: (n) => /^system\/gpu\d+\/util_percent$/.test(n) },
  { id: "system_gpu_power", title: "System: GPU power (W)", take: (n) => /^system\/gpu\d+\/power_w$/.test(n) },
];

// The default RL metrics among `names`, in the default panels' order: the panels compare opens with.
export function defaultMetrics(names) {
  const out = [];
  for (const def of DEFAULT_PANELS) for (const n of [...names].sort()) if (def.take(n) && !out.includes(n)) out.push(n);
  return out;
}

function panelFor(name) {
  for (const def of DEFAULT_PANELS) if (def.take(name)) return def.id;
  const slash = name.indexOf("/");
  return "group:" + (slash > 0 ? name.slice(0, slash) : "other");
}

function readList(key) {
  try { const v = JSON.parse(localStorage.getItem(key) || "[]"); return Array.isArray(v) ? v : []; }
  catch (err) { return []; }
}
function writeList(key, list) {
  try { localStorage.setItem(key, JSON.stringify(list)); } catch (err) { /* private mode */ }
}

// --- the grid ----------------------------------------------------------------------------

export class ChartGrid {
  // root: the grid element; runs: [{id, name}]; options: {stateEl, pickerEl, compare, syncKey}
  constructor(root, runs, options = {}) {
    this.root = root;
    this.runs = runs;
    this.compare = !!options.compare;
    this.stateEl = options.stateEl || null;
    this.pickerEl = options.pickerEl || null;
    this.syncKey = options.syncKey || "tributary";
    // superseded: draw the points a resume from an earlier step superseded, faded (run page).
    this.opts = { smoothing: 0.6, x: "step", log: false, superseded: false };
    this.store = new SeriesStore();
    this.alerts = []; // health alerts marked on the panels of their metric: {step, metric, rule}
    this.stages = []; // stage boundaries (data.stages, stages.js) marked on every panel: {step, name}
    this.panels = new Map(); // id -> panel state
    this.hiddenRuns = new Set();
    this.shown = []; // compare: the metrics that have a panel, in page order
    this.groups = null; // compare: {list: [{label, slots, colour}], band} while grouped
    this.pins = readList(PIN_KEY);
    this.hidden = new Set(readList(HIDE_KEY));
    this.frame = 0;
    this.loaded = false;
    this.message = "";
    this.resize = typeof ResizeObserver === "function"
      ? new ResizeObserver((entries) => { for (const e of entries) this.resized(e.target); }) : null;
    // Panels scrolled out of view keep their new points and are redrawn when they come back.
    this.seen = typeof IntersectionObserver === "function"
      ? new IntersectionObserver((entries) => {
        for (const e of entries) {
          const panel = this.panels.get(e.target.dataset.panel);
          if (!panel) continue;
          panel.visible = e.isIntersecting;
          if (panel.visible && panel.dirty) this.schedule();
        }
      }, { rootMargin: "200px" }) : null;
  }

  // History from /metrics/series for run `r` (index into runs).
  loadHistory(r, seriesList) {
    for (const s of seriesList) {
      if (!s.step.length || (this.compare && !this.shown.includes(s.name))) continue;
      this.series(r, s.name).load(s);
    }
  }

  // The panel of metric `name`: its default panel (or its prefix's) on a run; its own in compare.
  panelOf(name) { return this.compare ? "metric:" + name : panelFor(name); }

  // Compare: give metric `name` a panel (its history is the page's to load); false if it had one.
  showMetric(name) {
    if (this.shown.includes(name)) return false;
    this.shown.push(name);
    this.layoutDirty = true;
    this.schedule();
    return true;
  }

  // Compare: drop the panel of metric `name` and the series it drew.
  hideMetric(name) {
    const i = this.shown.indexOf(name);
    if (i < 0) return;
    this.shown.splice(i, 1);
    const panel = this.panels.get(this.panelOf(name));
    if (panel) this.dropPanel(panel);
    for (const [key, series] of this.store.series) if (series.name === name) this.store.series.delete(key);
    this.layoutDirty = true;
    this.schedule();
  }

  dropPanel(panel) {
    if (panel.plot) panel.plot.destroy();
    if (this.resize) this.resize.unobserve(panel.body);
    if (this.seen) this.seen.unobserve(panel.el);
    panel.el.remove();
    this.panels.delete(panel.id);
  }

  // Compare: run `r` (its slot) left the page: its series go, the panels redraw without it.
  removeRun(r) {
    for (const [key, series] of this.store.series) {
      if (series.run !== r) continue;
      this.store.series.delete(key);
      const panel = this.panels.get(this.panelOf(series.name));
      if (panel) { panel.keys = panel.keys.filter((k) => k !== key); panel.rebuild = true; }
    }
    this.hiddenRuns.delete(r);
    delete this.runs[r];
    this.schedule();
  }

  // Compare: draw groups of runs ({label, slots, colour} each) as their mean and `band`
  // ("minmax" or "std", groups.js), or each run again with null.
  setGroups(list, band = "minmax") {
    this.groups = list && list.length ? { list, band } : null;
    this.redraw(true);
  }

  // The series of metric `name` of run `r`; a new one gets its place in a panel.
  series(r, name) {
    const { key, series, created } = this.store.ensure(r, name);
    if (created) {
      const id = this.panelOf(name);
      let panel = this.panels.get(id);
      if (!panel) panel = this.addPanel(id);
      panel.keys.push(key);
      panel.keys.sort((a, b) => { const [ra, na] = a.split("|"); const [rb, nb] = b.split("|");
        return na === nb ? ra - rb : na < nb ? -1 : 1; });
      panel.rebuild = true;
      this.layoutDirty = true;
    }
    return series;
  }

  // A live metrics event of run `r`: {step, time, values}.
  addPoints(r, step, time, values) {
    for (const name in values) {
      const v = values[name];
      if (v == null) continue;
      if (this.compare && !this.shown.includes(name)) continue;
      if (this.series(r, name).push(step, time, v)) this.panels.get(this.panelOf(name)).dirty = true;
    }
    this.schedule();
  }

  // A rewind of run `r` (a later attempt took it up at `step`): its points at `step` and after
  // become superseded (webapp/runs/ingest.py did the same to the stored ones).
  rewind(r, step) {
    for (const series of this.store.series.values()) {
      if (series.run !== r || !series.rewind(step)) continue;
      const panel = this.panels.get(this.panelOf(series.name));
      if (panel) panel.rebuild = true;
    }
    this.schedule();
  }

  // The superseded history of run `r` (/metrics/series?superseded=true), replacing what it held.
  loadSuperseded(r, seriesList) {
    for (const s of seriesList) {
      if (!s.step.length) continue;
      this.series(r, s.name).loadSuperseded(s);
    }
    this.redraw(true);
  }

  setSuperseded(on) { this.opts.superseded = !!on; this.redraw(true); }

  // Superseded points drawn now (0 while they are hidden).
  supersededCount() { return Number(this.root.dataset.superseded || 0); }

  setMessage(text) { this.message = text || ""; this.updateState(); }

  schedule() {
    if (!this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.flush(); });
  }

  // What changed since the last frame, drawn once, within a frame budget: panels in page
  // order, at least one per frame, the rest in the next frames (so the first chart appears
  // after one panel's work, not all of them, and a stream touching every series never
  // blocks a frame for all panels at once). Off-screen panels wait until they are visible.
  flush() {
    if (this.layoutDirty) this.layout();
    // The widths the plots built below need, all read before any of them writes to the page:
    // one layout for the frame, not one forced by each panel after the previous one's writes.
    for (const panel of this.order()) {
      if (!this.hidden.has(panel.id) && (panel.rebuild || !panel.plot)) panel.width = panel.body.clientWidth;
    }
    const start = performance.now();
    let drawn = 0, pending = false, total = 0, faded = 0;
    for (const panel of this.order()) {
      const stale = !this.hidden.has(panel.id) && (panel.dirty || panel.rebuild || !panel.plot);
      if (stale && !(panel.plot && panel.visible === false)) {
        if (drawn && performance.now() - start > FRAME_BUDGET_MS) pending = true;
        else { this.draw(panel); drawn += 1; }
      }
      total += panel.points;
      faded += panel.faded || 0;
    }
    this.root.dataset.points = String(total);
    this.root.dataset.superseded = String(faded);
    this.updateState();
    if (pending) this.schedule();
  }

  updateState() {
    if (!this.stateEl) return;
    let text = this.message;
    if (!text && this.loaded && !this.store.size) text = "No metrics yet.";
    this.stateEl.textContent = text;
    this.stateEl.hidden = !text;
  }

  pointCount() { return Number(this.root.dataset.points || 0); }

  // --- panels ----------------------------------------------------------------------------

  addPanel(id) {
    const def = this.compare ? { id, title: id.slice(7), take: () => false }
      : DEFAULT_PANELS.find((d) => d.id === id) || { id, title: id.slice(6) + "/*", take: () => false };
    const el = document.createElement("section");
    el.className = "chart-panel";
    el.dataset.panel = id;
    el.dataset.points = "0";
    const head = document.createElement("header");
    const h = document.createElement("h3");
    h.id = "chart-title-" + id.replace(/[^a-z0-9_-]/gi, "_");
    h.textContent = def.title;
    el.setAttribute("aria-labelledby", h.id);
    const pin = document.createElement("button");
    pin.type = "button";
    pin.className = "pin secondary";
    pin.setAttribute("aria-label", "Pin " + def.title);
    pin.addEventListener("click", () => this.togglePin(id));
    head.append(h, pin);
    if (this.compare) {
      el.dataset.metric = def.title;
      const close = document.createElement("button");
      close.type = "button";
      close.className = "pin secondary panel-close";
      close.textContent = "✕";
      close.setAttribute("aria-label", "Remove the panel " + def.title);
      close.addEventListener("click", () => { this.hideMetric(def.title); if (this.onHide) this.onHide(def.title); });
      head.append(close);
    }
    const body = document.createElement("div");
    body.className = "chart-body";
    el.append(head, body);
    const panel = { id, def, el, body, pin, keys: [], plot: null, dirty: true, rebuild: true, points: 0, zoomed: false };
    this.panels.set(id, panel);
    this.syncPin(panel);
    if (this.resize) this.resize.observe(body);
    if (this.seen) this.seen.observe(el);
    return panel;
  }

  // Page order of panel ids: pinned first (in pin order), then the default RL panels, then the rest by name.
  sortIds(ids) {
    const defaults = DEFAULT_PANELS.map((d) => d.id);
    const rank = (id) => {
      const pinned = this.pins.indexOf(id);
      if (pinned >= 0) return [0, pinned, ""];
      const d = this.compare ? this.shown.indexOf(id.slice(7)) : defaults.indexOf(id);
      return d >= 0 ? [1, d, ""] : [2, 0, id];
    };
    return ids.slice().sort((a, b) => {
      const ra = rank(a), rb = rank(b);
      return ra[0] - rb[0] || ra[1] - rb[1] || (ra[2] < rb[2] ? -1 : ra[2] > rb[2] ? 1 : 0);
    });
  }

  order() { return this.sortIds([...this.panels.keys()]).map((id) => this.panels.get(id)); }

  // The metrics of the panel that comes first on the page (not hidden), among `names`: the
  // page fetches their history first so one chart is drawn before the rest has arrived.
  firstPanelNames(names) {
    const ids = this.sortIds([...new Set(names.map((n) => this.panelOf(n)))]).filter((id) => !this.hidden.has(id));
    return ids.length ? names.filter((n) => this.panelOf(n) === ids[0]) : [];
  }

  layout() {
    this.layoutDirty = false;
    for (const panel of this.order()) {
      panel.el.hidden = this.hidden.has(panel.id);
      this.root.appendChild(panel.el); // moves; uPlot instances survive
    }
    this.renderPicker();
  }

  togglePin(id) {
    const i = this.pins.indexOf(id);
    if (i >= 0) this.pins.splice(i, 1); else this.pins.push(id);
    writeList(PIN_KEY, this.pins);
    this.syncPin(this.panels.get(id));
    this.layout();
    this.panels.get(id).pin.focus();
  }

  syncPin(panel) {
    const on = this.pins.includes(panel.id);
    panel.pin.setAttribute("aria-pressed", on ? "true" : "false");
    panel.pin.textContent = on ? "★ pinned" : "☆ pin";
    panel.el.classList.toggle("pinned", on);
  }

  renderPicker() {
    if (!this.pickerEl) return;
    this.pickerEl.textContent = "";
    for (const panel of this.order()) {
      const label = document.createElement("label");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.checked = !this.hidden.has(panel.id);
      box.dataset.panel = panel.id;
      box.addEventListener("change", () => {
        if (box.checked) this.hidden.delete(panel.id); else this.hidden.add(panel.id);
        writeList(HIDE_KEY, [...this.hidden]);
        panel.el.hidden = !box.checked;
        if (box.checked) { panel.rebuild = true; this.schedule(); }
      });
      label.append(box, " " + panel.def.title);
      this.pickerEl.appendChild(label);
    }
  }

  resized(body) {
    for (const panel of this.panels.values()) {
      if (panel.body === body && panel.plot) {
        const w = body.clientWidth;
        if (w && w !== panel.plot.width) panel.plot.setSize({ width: w, height: panel.plot.height });
      }
    }
  }

  // --- options ---------------------------------------------------------------------------

  setSmoothing(w) { this.opts.smoothing = w; this.redraw(false); }
  setX(mode) { this.opts.x = mode; this.redraw(true); }
  setLog(on) { this.opts.log = on; this.redraw(true); }
  setRunVisible(r, show) {
    if (show) this.hiddenRuns.delete(r); else this.hiddenRuns.add(r);
    if (this.groups) { this.redraw(true); return; } // a group's mean is over its shown runs
    for (const panel of this.panels.values()) {
      if (!panel.plot) continue;
      panel.seriesRuns.forEach((run, i) => { if (run === r) panel.plot.setSeries(i + 1, { show }); });
    }
  }

  redraw(recreate) {
    for (const panel of this.panels.values()) {
      if (recreate && panel.plot) { panel.plot.destroy(); panel.plot = null; panel.zoomed = false; }
      if (recreate) panel.rebuild = true; else panel.dirty = true;
    }
    this.schedule();
  }

  colour(panel, r, nameIndex) {
    return this.compare ? PALETTE[r % PALETTE.length] : PALETTE[nameIndex % PALETTE.length];
  }

  // Compare, grouped: per group, the mean of its shown runs' series of this panel with its band,
  // as one series (groups.js); `group` carries the label and colour.
  groupSeries(list) {
    const out = [];
    for (const group of this.groups.list) {
      const members = list.filter((s) => group.slots.includes(s.run) && !this.hiddenRuns.has(s.run));
      if (!members.length) continue;
      const stats = groupStats(members, this.groups.band);
      if (!stats.step.length) continue;
      out.push({ run: group.slots[0], name: members[0].name, group, step: stats.step, time: stats.time,
        value: stats.value, lo: stats.lo, hi: stats.hi });
    }
    return out;
  }

  // Build the aligned arrays of a panel and hand them to uPlot (creating it when needed).
  draw(panel) {
    panel.dirty = false;
    const xMode = this.opts.x;
    const keys = panel.keys;
    const log = this.opts.log;
    let series = keys.map((key) => this.store.byKey(key));
    if (this.compare && this.groups) series = this.groupSeries(series);
    if (this.opts.superseded) {
      for (const one of keys.map((key) => this.store.byKey(key))) {
        const view = supersededView(one);
        if (view) series.push(view);
      }
    }
    const names = [...new Set(series.map((one) => one.name))];
    const { x, raw, smooth, lo, hi, ys, points } = chartData(series, {
      x: xMode, compare: this.compare, log, smoothing: this.opts.smoothing, stacked: !!panel.def.stacked,
      hiddenRuns: this.hiddenRuns,
    });
    panel.raw = raw; panel.lo = lo; panel.hi = hi; panel.own = smooth;
    panel.points = points;
    panel.faded = series.reduce((n, one) => n + (one.faded ? one.step.length : 0), 0);
    panel.el.dataset.points = String(points);
    panel.el.dataset.superseded = String(panel.faded);
    panel.el.dataset.series = String(keys.length);
    if (this.compare) {
      // Which colour each line has (the lines are canvas): "run id:colour", "group<i>:colour" grouped.
      panel.el.dataset.colours = series.map((one) => (one.group ? "group" + this.groups.list.indexOf(one.group) : this.runs[one.run]?.id) + ":"
        + (one.group ? one.group.colour : this.colour(panel, one.run, 0))).join(" ");
      panel.el.dataset.groups = String(series.filter((one) => one.group).length);
      panel.el.dataset.bands = String(series.filter((one) => one.group && one.lo.some((v, i) => v !== one.hi[i])).length);
    }
    const data = [x, ...ys];
    const signature = keys.join(",") + "|" + xMode + "|" + log + "|" + series.length + "|" + (this.groups ? "g" : "");
    if (panel.plot && panel.signature === signature && !panel.rebuild) {
      panel.plot.setData(data, !panel.zoomed);
      return;
    }
    panel.rebuild = false;
    if (panel.plot) { panel.plot.destroy(); panel.plot = null; }
    panel.signature = signature;
    panel.seriesRuns = series.map((one) => (one.group ? -1 : one.run));
    panel.plot = new uPlot(this.plotOptions(panel, series, names), data, panel.body);
    panel.zoomed = false;
    panel.plot.over.addEventListener("dblclick", () => { panel.zoomed = false; });
  }

  plotOptions(panel, list, names) {
    const xMode = this.opts.x;
    const def = panel.def;
    const hasY2 = !!def.y2 && list.some((one) => def.y2(one.name));
    const series = [{ label: xMode === "step" ? "step" : this.compare ? "elapsed" : "time",
      value: xMode === "time" && this.compare ? (u, v) => formatDuration(v) : undefined }];
    const bands = [];
    list.forEach((one, i) => {
      const nameIndex = names.indexOf(one.name);
      const colour = one.group ? one.group.colour : this.colour(panel, one.run, nameIndex);
      // Compare: a panel is one metric, so a line is named by its run (or group) alone.
      const named = one.group ? one.group.label : this.compare ? this.runs[one.run].name : one.name;
      const label = one.faded ? `${named} (superseded)` : named;
      const opt = {
        label, stroke: one.faded ? colour + "66" : colour, width: one.faded ? 1 : 1.5, spanGaps: true,
        // A line needs two points: show the dots while the series has fewer than three.
        points: { show: (u, si) => sparse(u.data[si]), size: 7, fill: colour },
        scale: hasY2 && def.y2(one.name) ? "y2" : "y",
        show: !!one.group || !this.hiddenRuns.has(one.run),
        value: (u, v, si, idx) => formatNumber(idx == null ? v : panel.own[si - 1][idx]),
      };
      if (this.compare) opt.dash = DASHES[nameIndex % DASHES.length] || undefined;
      if (one.faded) opt.dash = [4, 4];
      if (def.stacked) {
        opt.fill = colour + "55";
        if (i > 0) bands.push({ series: [i + 1, i], fill: colour + "55" });
      }
      series.push(opt);
    });
    const body = panel.body;
    const width = Math.max(240, panel.width || body.clientWidth || 400);
    panel.width = 0;  // read for this frame's flush only: a later build measures again
    const axes = [
      xMode === "time" && this.compare ? { values: (u, vals) => vals.map(formatDuration) }
        : xMode === "step" ? { incrs: STEP_INCRS } : {},
      { size: axisWidth, values: (u, vals) => this.yTicks(panel, vals) },
    ];
    if (hasY2) axes.push({ scale: "y2", side: 1, grid: { show: false }, size: axisWidth, values: (u, vals) => vals.map(formatTick) });
    const linear = { range: yRange };
    const xPad = X_PAD[xMode] || 1;
    const scales = {
      x: { time: xMode === "time" && !this.compare, range: (u, min, max) => xRange(u.data[0], min, max, xPad) },
      y: this.opts.log ? { distr: 3 } : linear,
    };
    if (hasY2) scales.y2 = linear;
    return {
      width, height: 220,
      series, axes, scales, bands: def.stacked ? bands : undefined,
      cursor: { sync: { key: this.syncKey, setSeries: false }, drag: { x: true, y: false } },
      legend: { live: true },
      hooks: {
        drawAxes: [(u) => this.drawUnder(panel, u)],
        draw: [(u) => this.drawAlerts(panel, u), (u) => this.drawStages(u)],
        setSelect: [(u) => { if (u.select.width > 0) panel.zoomed = true; }],
        // The x range on the panel element too (the axes are canvas): tests and tools read it.
        setScale: [(u, key) => { if (key === "x") panel.el.dataset.xRange = `${u.scales.x.min},${u.scales.x.max}`; }],
      },
    };
  }

  // Health alerts (alerts.js): a dashed red line at each alert's step, on the panels that show
  // its metric (every panel for an alert without one). Marks are drawn on the step axis only.
  markAlerts(list) {
    for (const a of list || []) this.alerts.push({ step: a.step, metric: a.metric || "", rule: a.rule });
    for (const panel of this.panels.values()) if (panel.plot) panel.plot.redraw(false);
  }

  // Stage boundaries (stages.js draws them): on every panel, on the step axis only.
  markStages(list) {
    this.stages = (list || []).map((m) => ({ step: m.step, name: m.name }));
    for (const panel of this.panels.values()) if (panel.plot) panel.plot.redraw(false);
  }

  // Every stage mark as {panel, step, name}: for the browser tests (the marks are canvas).
  stageMarks() {
    const out = [];
    for (const [id, panel] of this.panels) if (panel.plot) for (const m of this.stages) out.push({ panel: id, step: m.step, name: m.name });
    return out;
  }

  drawStages(u) {
    if (this.stages.length && this.opts.x === "step") drawStageMarks(u, this.stages);
  }

  alertsOn(panel) {
    const names = new Set((panel.keys || []).map((key) => this.store.byKey(key)?.name));
    return this.alerts.filter((a) => !a.metric || names.has(a.metric));
  }

  // Every mark as {panel, step, rule}: for the browser tests (the marks are canvas).
  alertMarks() {
    const out = [];
    for (const [id, panel] of this.panels) for (const a of this.alertsOn(panel)) out.push({ panel: id, step: a.step, rule: a.rule });
    return out;
  }

  drawAlerts(panel, u) {
    if (!this.alerts.length || this.opts.x !== "step") return; // every frame of every panel comes here
    const marks = this.alertsOn(panel);
    if (!marks.length) return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const dpr = window.devicePixelRatio || 1;
    ctx.save();
    ctx.strokeStyle = "#b42318";
    ctx.lineWidth = 1.5 * dpr;
    ctx.setLineDash([5 * dpr, 4 * dpr]);
    for (const a of marks) {
      const px = u.valToPos(a.step, "x", true);
      if (!(px >= left && px <= left + width)) continue;
      ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + height); ctx.stroke();
    }
    ctx.restore();
  }

  // The labels of a panel's y axis, also kept on the panel element (the axis is canvas).
  yTicks(panel, vals) {
    const labels = vals.map(formatTick);
    panel.el.dataset.yTicks = labels.filter((t) => t !== "").join(" ");
    return labels;
  }

  // Under the smoothed lines: the min/max band of downsampled history, and the raw values faint.
  drawUnder(panel, u) {
    if (panel.def.stacked) return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const x = u.data[0];
    ctx.save();
    ctx.beginPath(); ctx.rect(left, top, width, height); ctx.clip();
    for (let i = 0; i < panel.raw.length; i++) {
      const s = u.series[i + 1];
      if (!s.show) continue;
      const scale = s.scale || "y";
      const colour = typeof s.stroke === "function" ? s.stroke(u, i + 1) : s.stroke;
      const lo = panel.lo[i], hi = panel.hi[i];
      if (lo && hi) {
        ctx.fillStyle = colour; ctx.globalAlpha = 0.15;
        ctx.beginPath();
        let started = false;
        const upper = [];
        for (let j = 0; j < x.length; j++) {
          if (hi[j] == null || lo[j] == null) continue;
          const px = u.valToPos(x[j], "x", true);
          upper.push([px, u.valToPos(hi[j], scale, true)]);
          if (!started) { ctx.moveTo(px, u.valToPos(lo[j], scale, true)); started = true; }
          else ctx.lineTo(px, u.valToPos(lo[j], scale, true));
        }
        for (let k = upper.length - 1; k >= 0; k--) ctx.lineTo(upper[k][0], upper[k][1]);
        ctx.closePath();
        if (started) ctx.fill();
      }
      if (this.opts.smoothing > 0) {
        const raw = panel.raw[i];
        ctx.strokeStyle = colour; ctx.globalAlpha = 0.25; ctx.lineWidth = 1 * (window.devicePixelRatio || 1);
        ctx.beginPath();
        let pen = false;
        for (let j = 0; j < x.length; j++) {
          if (raw[j] == null) continue;
          const px = u.valToPos(x[j], "x", true), py = u.valToPos(raw[j], scale, true);
          if (pen) ctx.lineTo(px, py); else { ctx.moveTo(px, py); pen = true; }
        }
        ctx.stroke();
      }
    }
    ctx.restore();
  }

  // The step rate of the newest points (steps per second), for the ETA; null when unknown.
  stepRate(r = 0) { return this.store.stepRate(r); }
}

// Wire the shared controls (smoothing, x axis, log scale) of _chart_controls.html to a grid.
export function bindControls(grid, doc = document) {
  const smoothing = doc.getElementById("smoothing");
  const out = doc.getElementById("smoothing-value");
  const KEY = "tributary.charts.smoothing";
  const saved = Number(localStorage.getItem(KEY));
  if (smoothing) {
    if (localStorage.getItem(KEY) !== null && isFinite(saved)) smoothing.value = String(saved);
    grid.opts.smoothing = Number(smoothing.value);
    if (out) out.textContent = smoothing.value;
    smoothing.addEventListener("input", () => {
      if (out) out.textContent = smoothing.value;
      try { localStorage.setItem(KEY, smoothing.value); } catch (err) { /* private mode */ }
      grid.setSmoothing(Number(smoothing.value));
    });
  }
  for (const radio of doc.querySelectorAll("input[name=xaxis]")) {
    radio.addEventListener("change", () => { if (radio.checked) grid.setX(radio.value); });
  }
  const log = doc.getElementById("logscale");
  if (log) log.addEventListener("change", () => grid.setLog(log.checked));
}

// Fetch the history of one run, downsampled to about `maxPoints` per series: every series, or
// only `names`, or all but `exclude`; with `superseded`, the points resumes from an earlier step
// superseded instead.
export async function fetchSeries(api, maxPoints = 1000, { names = null, exclude = null, superseded = false } = {}) {
  const query = new URLSearchParams({ max_points: String(maxPoints), x: "step" });
  if (superseded) query.set("superseded", "true");
  if (names) query.set("names", names.join(","));
  if (exclude && exclude.length) query.set("exclude", exclude.join(","));
  const res = await fetch(`${api}/metrics/series?${query}`, { credentials: "same-origin" });
  if (!res.ok) throw new Error(`metrics: HTTP ${res.status}`);
  return (await res.json()).series;
}

