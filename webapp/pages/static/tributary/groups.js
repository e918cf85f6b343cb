// Seed averaging for the compare page: the runs of a group (runs sharing a config value) drawn
// as one line, their mean, with a band (their min and max, or the mean +- one standard
// deviation). Pure: no DOM, no uPlot (tests/js/groups.test.mjs); charts.js draws the result.
//
// Alignment. Runs of one setting usually log the same steps, and the series API downsamples
// equal step ranges into equal buckets, so the runs' points share their step values and the mean
// at a step is the plain mean of the runs' values there. Where they do not (a run logs every
// other step, one is still running and its buckets are narrower), a run's value at a step it did
// not log is interpolated linearly between its two neighbouring points. Nothing is extrapolated:
// the group is drawn only over the steps every run of it reached, [latest first step, earliest
// last step], so a missing run never pulls the mean towards the ones that went further.

// A series' finite points: {step, time, value} arrays (nulls and non-finite values left out).
function finite(s) {
  const step = [], time = [], value = [];
  for (let i = 0; i < s.step.length; i++) {
    const v = s.value[i];
    if (v == null || !Number.isFinite(v)) continue;
    step.push(s.step[i]); time.push(s.time ? s.time[i] : 0); value.push(v);
  }
  return { step, time, value };
}

// The sorted union of the steps of `runs` within [from, to].
function stepsBetween(runs, from, to) {
  const all = new Set();
  for (const s of runs) for (const x of s.step) if (x >= from && x <= to) all.add(x);
  return [...all].sort((a, b) => a - b);
}

// The mean of `list` (each {step, time, value}, sorted by step) on the steps all of them
// reached, with the band: {step, time, value, lo, hi, n}. `time` is the mean of the runs' times
// since their own first point (a group's runs started at different moments). `band` is
// "minmax" or "std" (the sample standard deviation, n - 1 in the denominator: seeds are a sample
// of the setting; 0 for a group of one run).
export function groupStats(list, band = "minmax") {
  if (band !== "minmax" && band !== "std") throw new Error(`band: "minmax" or "std", got ${JSON.stringify(band)}`);
  const runs = list.map(finite).filter((s) => s.step.length);
  const out = { step: [], time: [], value: [], lo: [], hi: [], n: runs.length };
  if (!runs.length) return out;
  const from = Math.max(...runs.map((s) => s.step[0]));
  const to = Math.min(...runs.map((s) => s.step[s.step.length - 1]));
  if (from > to) return out;
  const cursor = runs.map(() => 0);
  const n = runs.length;
  const vals = new Array(n);
  for (const x of stepsBetween(runs, from, to)) {
    let sum = 0, tsum = 0, lo = Infinity, hi = -Infinity;
    for (let k = 0; k < n; k++) {
      const s = runs[k];
      let i = cursor[k];
      while (i + 1 < s.step.length && s.step[i + 1] <= x) i++;
      cursor[k] = i;
      let v, t;
      if (s.step[i] === x || i + 1 >= s.step.length) { v = s.value[i]; t = s.time[i]; }
      else {
        const f = (x - s.step[i]) / (s.step[i + 1] - s.step[i]);
        v = s.value[i] + f * (s.value[i + 1] - s.value[i]);
        t = s.time[i] + f * (s.time[i + 1] - s.time[i]);
      }
      vals[k] = v; sum += v; tsum += t - s.time[0];
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    const mean = sum / n;
    out.step.push(x); out.time.push(tsum / n); out.value.push(mean);
    if (band === "minmax") { out.lo.push(lo); out.hi.push(hi); }
    else {
      let sq = 0;
      for (let k = 0; k < n; k++) sq += (vals[k] - mean) ** 2;
      const sd = n > 1 ? Math.sqrt(sq / (n - 1)) : 0;
      out.lo.push(mean - sd); out.hi.push(mean + sd);
    }
  }
  return out;
}

// Runs grouped by the value of config `key` (runs: [{slot, id, name, config}], in page order):
// [{label, value, slots, ids}] in first-seen order; a run without the key is its own "(unset)"
// group.
export function groupRuns(runs, key) {
  const groups = new Map();
  for (const run of runs) {
    const has = run.config && Object.prototype.hasOwnProperty.call(run.config, key);
    const value = has ? JSON.stringify(run.config[key]) : "(unset)";
    let g = groups.get(value);
    if (!g) { g = { value, label: `${key}=${has ? display(run.config[key]) : "(unset)"}`, slots: [], ids: [] }; groups.set(value, g); }
    g.slots.push(run.slot); g.ids.push(run.id);
  }
  return [...groups.values()];
}

function display(v) { return typeof v === "string" ? v : JSON.stringify(v); }
