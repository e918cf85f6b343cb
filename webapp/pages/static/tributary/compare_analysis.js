// The compare page's "config against results": a scatter (one config key against a metric's
// final, max or min value, one point per run in its colour; uPlot, points only) and parallel
// coordinates (one vertical axis per config key that differs and one for the metric, one line
// per run; drawn on a canvas here: no parallel-coordinates package is small and well kept
// enough to pull in for this). The values are canvas, so each figure also carries what it drew
// in data attributes (data-runs, data-colours, data-points / data-lines, data-axes).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { formatNumber, formatTick } from "./format.js";

// A run's value of a metric series ({value, lo?, hi?} from /metrics/series): "final" (its last
// point), "max" or "min" over its history (a downsampled series' buckets keep their extremes in
// lo/hi, so these are the exact extremes, not those of the bucket means). null without points.
export function runValue(series, agg = "final") {
  if (!series || !series.value || !series.value.length) return null;
  const finite = (v) => v != null && Number.isFinite(v);
  if (agg === "final") {
    for (let i = series.value.length - 1; i >= 0; i--) if (finite(series.value[i])) return series.value[i];
    return null;
  }
  const from = agg === "max" ? series.hi || series.max || series.value : series.lo || series.min || series.value;
  let best = null;
  for (const v of from) if (finite(v) && (best === null || (agg === "max" ? v > best : v < best))) best = v;
  return best;
}

// An axis over `values` (one per run; undefined: the run has no such key): numeric when every
// present value is a number, else one evenly spaced place per distinct value (sorted).
export function axisOf(values) {
  const present = values.filter((v) => v !== undefined && v !== null);
  if (present.length && present.every((v) => typeof v === "number" && Number.isFinite(v))) {
    let min = Math.min(...present), max = Math.max(...present);
    if (min === max) { min -= 1; max += 1; }
    return { numeric: true, min, max, pos: (v) => (typeof v === "number" ? (v - min) / (max - min) : null),
      ticks: [[0, formatTick(min)], [1, formatTick(max)]] };
  }
  const cats = [...new Set(present.map(String))].sort();
  const at = (v) => (cats.length === 1 ? 0.5 : cats.indexOf(String(v)) / (cats.length - 1));
  return { numeric: false, cats, pos: (v) => (v === undefined || v === null ? null : at(v)),
    ticks: cats.map((c) => [at(c), c.length > 14 ? c.slice(0, 13) + "…" : c]) };
}

function mark(fig, rows, drawn) {
  fig.dataset.runs = rows.map((r) => r.id).join(",");
  fig.dataset.colours = rows.map((r) => `${r.id}:${r.colour}`).join(" ");
  return drawn;
}

// rows: [{id, name, colour, config, value}]; key: the config key on x; label: the metric's.
export function drawScatter(fig, rows, key, label) {
  const body = fig.querySelector(".chart-body");
  if (fig.plot) { fig.plot.destroy(); fig.plot = null; }
  const points = rows.filter((r) => r.value != null);
  fig.dataset.points = String(points.length);
  mark(fig, points, null);
  if (!points.length) return;
  const axis = axisOf(points.map((r) => r.config[key]));
  const xOf = (r) => (axis.numeric ? r.config[key] : axis.cats.indexOf(String(r.config[key])));
  const xs = [...new Set(points.map(xOf).filter((x) => x != null && x >= 0))].sort((a, b) => a - b);
  const data = [xs];
  const series = [{ label: key || "x" }];
  for (const r of points) {
    const col = new Array(xs.length).fill(null);
    const x = xOf(r);
    if (x != null && x >= 0) col[xs.indexOf(x)] = r.value;
    data.push(col);
    series.push({ label: r.name, stroke: r.colour, paths: () => null, value: (u, v) => formatNumber(v),
      points: { show: true, size: 10, fill: r.colour, stroke: r.colour } });
  }
  const xAxis = axis.numeric ? { values: (u, vals) => vals.map(formatTick) } : { values: (u, vals) => vals.map((v) => (Number.isInteger(v) ? axis.cats[v] ?? "" : "")) };
  const pad = axis.numeric ? (axis.max - axis.min) * 0.05 : 0.5;
  // No key on x (one run: no config key differs) has no category: the range stays [-0.5, 0.5]
  // (an empty one, [-0.5, -0.5], threw "Invalid array length" in uPlot's ticks).
  fig.plot = new uPlot({
    width: Math.max(240, body.clientWidth || 400), height: 260, series,
    scales: { x: { time: false, range: () => (axis.numeric ? [axis.min - pad, axis.max + pad] : [-pad, Math.max(axis.cats.length - 1, 0) + pad]) },
      y: { range: (u, min, max) => (min === max ? [min - (Math.abs(min) * 0.1 || 1), max + (Math.abs(max) * 0.1 || 1)] : uPlot.rangeNum(min, max, 0.1, true)) } },
    axes: [{ label: key, ...xAxis }, { label, values: (u, vals) => vals.map(formatTick), size: 60 }],
    legend: { live: false }, cursor: { drag: { x: false, y: false } },
  }, data, body);
}

// The config keys worth an axis: those whose values tell runs apart as settings; a text key with
// a different value for every run (the run's name, an output path) is an identifier, not a
// setting, and would only cross every line.
export function settingKeys(rows, keys) {
  return keys.filter((k) => {
    const values = rows.map((r) => r.config[k]);
    if (rows.length < 3 || values.every((v) => typeof v === "number" || typeof v === "boolean")) return true;
    return new Set(values.map(String)).size < values.length;
  });
}

// Parallel coordinates: one axis per key of `keys` and a last one for the metric (`label`).
export function drawParallel(fig, rows, keys, label) {
  const canvas = fig.querySelector("canvas");
  keys = settingKeys(rows, keys);
  const axes = [...keys.map((k) => ({ name: k, values: rows.map((r) => r.config[k]) })),
    { name: label, values: rows.map((r) => r.value ?? undefined) }];
  fig.dataset.axes = JSON.stringify(axes.map((a) => a.name));
  fig.querySelector("#parallel-axes").textContent = axes.length > 1 ? "Axes: " + axes.map((a) => a.name).join(" · ") : "";
  const dpr = window.devicePixelRatio || 1;
  const width = Math.max(240, fig.clientWidth - 16), height = 260;
  canvas.width = width * dpr; canvas.height = height * dpr;
  canvas.style.width = width + "px"; canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const drawn = rows.filter((r) => r.value != null);
  fig.dataset.lines = String(drawn.length);
  mark(fig, drawn, null);
  if (!drawn.length || !label) return;
  const scales = axes.map((a) => axisOf(a.values));
  const left = 48, right = width - 64, top = 40, bottom = height - 20;
  const xAt = (i) => (axes.length === 1 ? (left + right) / 2 : left + (i * (right - left)) / (axes.length - 1));
  const yAt = (p) => bottom - p * (bottom - top);
  ctx.font = "11px system-ui, sans-serif";
  ctx.textAlign = "center";
  axes.forEach((a, i) => {
    const x = xAt(i);
    ctx.strokeStyle = "#868e96"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, bottom); ctx.stroke();
    ctx.fillStyle = "#212529";
    const name = a.name.length > 22 ? "…" + a.name.slice(-21) : a.name;
    ctx.fillText(name, Math.min(Math.max(x, 60), width - 70), 14);
    ctx.fillStyle = "#495057";
    for (const [p, text] of scales[i].ticks) ctx.fillText(text, x, p === 0 ? bottom + 13 : yAt(p) - 5);
  });
  ctx.lineWidth = 2;
  for (const r of drawn) {
    ctx.strokeStyle = r.colour;
    ctx.beginPath();
    let pen = false;
    axes.forEach((a, i) => {
      const p = scales[i].pos(i === axes.length - 1 ? r.value : r.config[a.name]);
      if (p == null) { pen = false; return; } // the run has no such key: a gap
      if (pen) ctx.lineTo(xAt(i), yAt(p)); else { ctx.moveTo(xAt(i), yAt(p)); pen = true; }
    });
    ctx.stroke();
  }
}
