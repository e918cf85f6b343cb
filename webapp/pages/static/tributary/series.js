// The metric series the charts draw, without the charts: the history from /metrics/series merged
// with points streamed over the socket, thinned in the browser on long live sessions, and laid
// out on a shared x axis (gaps filled with nulls) ready for a chart. Pure: no DOM, no uPlot
// (tests/js/series.test.mjs); charts.js draws what this module computes.

export const MAX_KEEP = 20000; // points kept per series in the browser; older ones are merged in pairs

// One metric of one run: parallel arrays in step order; lo/hi (the min/max of each point's
// bucket) where the history was downsampled or the browser merged points.
export class Series {
  constructor(run, name, maxKeep = MAX_KEEP) {
    this.run = run; this.name = name; this.maxKeep = maxKeep;
    this.step = []; this.time = []; this.value = []; this.lo = null; this.hi = null;
    // Points a later attempt of the run superseded (a resume from an earlier step), in step
    // order: {step, time, value}, or null. Kept to be drawn faded on request, never counted.
    this.superseded = null;
  }

  // The history (one entry of /metrics/series), replacing what the series held.
  load(s) {
    this.step = s.step.slice(); this.time = s.time.slice(); this.value = s.value.slice();
    this.lo = null; this.hi = null;
    if (s.downsampled && s.min && s.max) { this.lo = s.min.slice(); this.hi = s.max.slice(); }
  }

  // A streamed point. Returns whether the series changed: a point older than the newest one is
  // in the history already; the newest step again replaces its value (unless that point stands
  // for a bucket of the history).
  push(step, time, value) {
    const n = this.step.length;
    if (n && step <= this.step[n - 1]) {
      if (step === this.step[n - 1] && !this.lo) { this.value[n - 1] = value; return true; }
      return false;
    }
    this.step.push(step); this.time.push(time); this.value.push(value);
    if (this.lo) { this.lo.push(value); this.hi.push(value); }
    if (this.step.length > this.maxKeep) this.compact();
    return true;
  }

  // A rewind: the points at `step` and after leave the series for its superseded points.
  // Returns whether any did.
  rewind(step) {
    let i = this.step.length;
    while (i > 0 && this.step[i - 1] >= step) i--;
    if (i === this.step.length) return false;
    const moved = { step: this.step.splice(i), time: this.time.splice(i), value: this.value.splice(i) };
    if (this.lo) { this.lo.splice(i); this.hi.splice(i); }
    this.addSuperseded(moved);
    return true;
  }

  // Superseded points ({step, time, value}) added to those held, in step order (several attempts
  // may have superseded a point at the same step).
  addSuperseded(s) {
    const rows = [];
    const take = (from) => { if (from) for (let i = 0; i < from.step.length; i++) rows.push([from.step[i], from.time[i], from.value[i]]); };
    take(this.superseded);
    take(s);
    rows.sort((a, b) => a[0] - b[0]);
    this.superseded = { step: rows.map((r) => r[0]), time: rows.map((r) => r[1]), value: rows.map((r) => r[2]) };
  }

  // The superseded history (one entry of /metrics/series?superseded=true), replacing what the
  // series held: it has every point a rewind moved here live too.
  loadSuperseded(s) {
    this.superseded = null;
    this.addSuperseded(s);
  }

  // Merge the older half in pairs (mean value, min/max band) so a long live session stays light.
  compact() {
    const half = Math.floor(this.step.length / 2) & ~1;
    const lo = this.lo || this.value.slice(), hi = this.hi || this.value.slice();
    const S = [], T = [], V = [], L = [], H = [];
    for (let i = 0; i < half; i += 2) {
      S.push(this.step[i]); T.push(this.time[i]);
      const a = this.value[i], b = this.value[i + 1];
      V.push(a == null ? b : b == null ? a : (a + b) / 2);
      L.push(Math.min(lo[i], lo[i + 1])); H.push(Math.max(hi[i], hi[i + 1]));
    }
    this.step = S.concat(this.step.slice(half)); this.time = T.concat(this.time.slice(half));
    this.value = V.concat(this.value.slice(half));
    this.lo = L.concat(lo.slice(half)); this.hi = H.concat(hi.slice(half));
  }

  get length() { return this.step.length; }
}

// Every series of every run on a page, by run index and metric name.
export class SeriesStore {
  constructor(maxKeep = MAX_KEEP) {
    this.maxKeep = maxKeep;
    this.series = new Map(); // key(run, name) -> Series
  }

  static key(run, name) { return run + "|" + name; }

  // The series, created when new; `created` says which.
  ensure(run, name) {
    const key = SeriesStore.key(run, name);
    let series = this.series.get(key);
    const created = !series;
    if (created) {
      series = new Series(run, name, this.maxKeep);
      this.series.set(key, series);
    }
    return { key, series, created };
  }

  byKey(key) { return this.series.get(key); }

  get size() { return this.series.size; }

  // The step rate of the newest points of run `run` (steps per second, over its longest series'
  // last 50 points), for the ETA; null when unknown.
  stepRate(run = 0) {
    let best = null;
    for (const s of this.series.values()) if (s.run === run && (!best || s.length > best.length)) best = s;
    if (!best || best.length < 2) return null;
    const n = best.length, k = Math.max(0, n - 50);
    const dt = best.time[n - 1] - best.time[k], ds = best.step[n - 1] - best.step[k];
    return dt > 0 && ds > 0 ? ds / dt : null;
  }
}

// Which points a resume from an earlier step supersedes, as the web app decides it
// (webapp/runs/ingest.py, _supersede): the first metrics or samples event of a later attempt of
// the run, at step s, supersedes what the earlier attempts logged at s and after. `seen` is the
// latest attempt whose points the page already holds (0: none).
export class Attempts {
  constructor(seen = 0) { this.seen = seen; }

  // The step from which the points held are superseded by `event` ({attempt, step}), or null.
  rewindAt(event) {
    const k = event.attempt;
    if (typeof k !== "number" || typeof event.step !== "number" || k <= this.seen) return null;
    const first = this.seen === 0 && k === 1;
    this.seen = k;
    return first ? null : event.step;
  }
}

// A series' superseded points as a series of their own to draw faded beside it (null: none).
export function supersededView(series) {
  const s = series.superseded;
  if (!s || !s.step.length) return null;
  return { run: series.run, name: series.name, faded: true, step: s.step, time: s.time, value: s.value, lo: null, hi: null };
}

// Smoothed copy of `values` (nulls stay null): TensorBoard's debiased exponential moving average.
export function ema(values, weight) {
  if (!weight) return values;
  const out = new Array(values.length);
  let last = 0, n = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v == null || !Number.isFinite(v)) { out[i] = null; continue; }
    last = last * weight + (1 - weight) * v; n += 1;
    out[i] = last / (1 - weight ** n);
  }
  return out;
}

// Align several sorted series {x, cols: [column, ...]} on the union of their x values (a k-way
// merge): each column gets a null where its series has no point at that x.
export function align(list) {
  if (list.length === 1) return { x: list[0].x, cols: [list[0].cols] };
  const xs = [];
  const idx = list.map(() => 0);
  for (;;) {
    let min = Infinity;
    for (let k = 0; k < list.length; k++) if (idx[k] < list[k].x.length && list[k].x[idx[k]] < min) min = list[k].x[idx[k]];
    if (min === Infinity) break;
    xs.push(min);
    for (let k = 0; k < list.length; k++) while (idx[k] < list[k].x.length && list[k].x[idx[k]] <= min) idx[k]++;
  }
  const cols = list.map((s) => {
    const out = s.cols.map(() => new Array(xs.length).fill(null));
    let j = 0;
    for (let i = 0; i < s.x.length; i++) {
      while (xs[j] < s.x[i]) j++;
      for (let c = 0; c < s.cols.length; c++) out[c][j] = s.cols[c][i];
    }
    return out;
  });
  return { x: xs, cols };
}

// Running sums of the columns (nulls skipped), for a stacked chart: column i is drawn on top of
// the ones before it.
export function stack(columns, length) {
  const out = [];
  let acc = new Array(length).fill(null);
  for (const col of columns) {
    acc = acc.map((a, j) => (col[j] == null ? a : (a || 0) + col[j]));
    out.push(acc.slice());
  }
  return out;
}

// The arrays one chart draws from `series` (a panel's Series, in legend order):
//   x       the union of their x values (steps; times; in compare, seconds since each run began);
//   raw     each series' values on x (null: no point there; on a log scale, no positive value);
//   smooth  raw smoothed by `smoothing` (raw itself on a stacked chart);
//   lo, hi  the min/max band of each series on x, or null when it has none;
//   ys      what the lines show: smooth, or its running sums on a stacked chart;
//   points  the points of the series whose run is not in `hiddenRuns` (not of a `faded` one: the
//           superseded points supersededView draws).
export function chartData(series, { x: xMode = "step", compare = false, log = false, smoothing = 0, stacked = false, hiddenRuns = new Set() } = {}) {
  const parts = series.map((s) => {
    let x = xMode === "time" ? s.time : s.step;
    if (xMode === "time" && compare && s.time.length) { const t0 = s.time[0]; x = s.time.map((t) => t - t0); }
    const cols = [s.value];
    if (s.lo) cols.push(s.lo, s.hi);
    return { x, cols };
  });
  const { x, cols } = align(parts);
  const clean = (arr) => (log ? arr.map((v) => (v != null && v > 0 ? v : null)) : arr);
  const raw = [], smooth = [], lo = [], hi = [];
  let points = 0;
  cols.forEach((c, i) => {
    const r = clean(c[0]);
    raw.push(r);
    smooth.push(stacked ? r : ema(r, smoothing));
    lo.push(c.length > 1 ? clean(c[1]) : null);
    hi.push(c.length > 1 ? clean(c[2]) : null);
    if (!hiddenRuns.has(series[i].run) && !series[i].faded) for (const v of c[0]) if (v != null) points++;
  });
  return { x, raw, smooth, lo, hi, ys: stacked ? stack(smooth, x.length) : smooth, points };
}

// Whether a line of `values` needs its points drawn: a line joins two points, so a series with
// fewer than `limit` values (nulls do not count: a panel's x axis is the union of its series'
// steps, so an eval metric logged once sits among the train metrics' hundreds of steps) would
// be invisible or a bare stub without them.
export function sparse(values, limit = 3) {
  let n = 0;
  for (const v of values) if (v != null && ++n >= limit) return false;
  return true;
}

// The x range of a chart over the points at `xs` (sorted): [min, max] as given (the data's own
// range, or a zoom) when there are several x values; one x value gets `pad` on either side, so
// a single eval point sits mid-chart on a narrow range around its step, not on uPlot's default
// 0..100 span (or a whole day on a time axis).
export function xRange(xs, min, max, pad = 1) {
  if (xs.length === 1 && xs[0] != null) return [xs[0] - pad, xs[0] + pad];
  return [min, max];
}
