// The series store of the charts (webapp/pages/static/tributary/series.js): merging streamed
// points into the history, thinning in the browser, aligning series on one x axis.
import assert from "node:assert/strict";
import test from "node:test";

import { Attempts, Series, SeriesStore, align, chartData, ema, sparse, stack, supersededView, xRange } from "../../webapp/pages/static/tributary/series.js";

const history = (steps, values, extra = {}) => ({ step: steps, time: steps.map((s) => 1000 + s), value: values, ...extra });

test("streamed points after the history are appended; older ones are the history's already", () => {
  const s = new Series(0, "reward/mean");
  s.load(history([1, 2, 3], [0.1, 0.2, 0.3]));
  assert.equal(s.push(2, 1002, 9), false); // replayed by the socket: the history has it
  assert.equal(s.push(4, 1004, 0.4), true);
  assert.equal(s.push(3, 1003, 9), false);
  assert.deepEqual(s.step, [1, 2, 3, 4]);
  assert.deepEqual(s.value, [0.1, 0.2, 0.3, 0.4]);
  assert.deepEqual(s.time, [1001, 1002, 1003, 1004]);
});

test("the newest step again replaces its value, unless that point stands for a history bucket", () => {
  const s = new Series(0, "x");
  s.push(5, 1, 1.0);
  assert.equal(s.push(5, 1, 2.0), true);
  assert.deepEqual([s.step, s.value], [[5], [2.0]]);

  const bucketed = new Series(0, "x");
  bucketed.load(history([1, 5], [1, 2], { downsampled: true, min: [0, 1], max: [2, 3] }));
  assert.equal(bucketed.push(5, 1, 99), false);
  assert.deepEqual(bucketed.value, [1, 2]);
});

test("a downsampled history keeps its band, and live points extend it with zero width", () => {
  const s = new Series(0, "x");
  s.load(history([10, 20], [1, 2], { downsampled: true, min: [0.5, 1.5], max: [1.5, 2.5] }));
  s.push(21, 1021, 3);
  assert.deepEqual(s.lo, [0.5, 1.5, 3]);
  assert.deepEqual(s.hi, [1.5, 2.5, 3]);
  // A history that was not downsampled has no band (and a reload drops an earlier one).
  s.load(history([1], [1]));
  assert.equal(s.lo, null);
  assert.equal(s.hi, null);
});

test("past the limit, the older half is merged in pairs: mean value, min/max band", () => {
  const s = new Series(0, "x", 8);
  const values = [1, 3, 5, 5, 2, 8, 4, 6, 7];
  values.forEach((v, i) => s.push(i + 1, 100 + i, v));
  // 9 points > 8: the first 4 (half of 9, rounded down to even) become 2.
  assert.deepEqual(s.step, [1, 3, 5, 6, 7, 8, 9]);
  assert.deepEqual(s.time, [100, 102, 104, 105, 106, 107, 108]);
  assert.deepEqual(s.value, [2, 5, 2, 8, 4, 6, 7]);
  assert.deepEqual(s.lo, [1, 5, 2, 8, 4, 6, 7]);
  assert.deepEqual(s.hi, [3, 5, 2, 8, 4, 6, 7]);
  // A long session stays under the limit, and the bands of merged buckets keep the extremes.
  for (let i = 10; i < 1000; i++) s.push(i, 100 + i, i % 2 ? -i : i);
  assert.ok(s.length <= 8);
  assert.equal(Math.min(...s.lo), -999);
  assert.equal(Math.max(...s.hi), 998);
  assert.deepEqual(s.step, [...s.step].sort((a, b) => a - b));
});

test("align fills each series' gaps with nulls on the union of the x values", () => {
  const a = { x: [1, 2, 4], cols: [[10, 20, 40]] };
  const b = { x: [2, 3, 4, 5], cols: [[200, 300, 400, 500], [1, 2, 3, 4]] };
  const { x, cols } = align([a, b]);
  assert.deepEqual(x, [1, 2, 3, 4, 5]);
  assert.deepEqual(cols[0], [[10, 20, null, 40, null]]);
  assert.deepEqual(cols[1], [[null, 200, 300, 400, 500], [null, 1, 2, 3, 4]]);
  // One series: as it is.
  assert.deepEqual(align([a]), { x: a.x, cols: [a.cols] });
});

test("ema is debiased (the first point is its own value) and skips gaps", () => {
  assert.deepEqual(ema([1, 2, 3], 0), [1, 2, 3]);
  const out = ema([4, null, 4, NaN, 4], 0.9);
  assert.equal(out[1], null);
  assert.equal(out[3], null);
  for (const i of [0, 2, 4]) assert.ok(Math.abs(out[i] - 4) < 1e-12);
  const [first, second] = ema([0, 10], 0.5);
  assert.equal(first, 0);
  assert.ok(Math.abs(second - (0.5 * 0 * 0.5 + 0.5 * 10) / (1 - 0.25)) < 1e-12);
});

test("stack sums columns on top of each other, leaving gaps where nothing is below", () => {
  assert.deepEqual(stack([[1, null, 2], [1, 1, null]], 3), [[1, null, 2], [2, 1, 2]]);
});

test("chartData lays out a panel: gaps, log scale, compare time, hidden runs", () => {
  const store = new SeriesStore();
  const a = store.ensure(0, "loss").series;
  a.load({ step: [1, 2, 3], time: [100, 110, 120], value: [1, -1, 4] });
  const b = store.ensure(1, "loss").series;
  b.load({ step: [2, 3], time: [500, 530], value: [2, 3] });

  const byStep = chartData([a, b], { hiddenRuns: new Set([1]) });
  assert.deepEqual(byStep.x, [1, 2, 3]);
  assert.deepEqual(byStep.raw, [[1, -1, 4], [null, 2, 3]]);
  assert.equal(byStep.points, 3); // run 1 is hidden
  assert.deepEqual(byStep.lo, [null, null]);

  const log = chartData([a], { log: true });
  assert.deepEqual(log.raw, [[1, null, 4]]); // no non-positive value on a log scale

  // Compare by time: each run from its own start.
  const elapsed = chartData([a, b], { x: "time", compare: true });
  assert.deepEqual(elapsed.x, [0, 10, 20, 30]);
  assert.deepEqual(elapsed.raw, [[1, -1, 4, null], [2, null, null, 3]]);

  const stacked = chartData([a, b], { stacked: true, smoothing: 0.9 });
  assert.deepEqual(stacked.smooth, stacked.raw); // a stacked chart is not smoothed
  assert.deepEqual(stacked.ys, [[1, -1, 4], [1, 1, 7]]);
});

test("the store creates each series once and measures the newest step rate", () => {
  const store = new SeriesStore();
  assert.equal(store.ensure(0, "a").created, true);
  const { series, created, key } = store.ensure(0, "a");
  assert.equal(created, false);
  assert.equal(store.byKey(key), series);
  assert.equal(store.stepRate(0), null);
  for (let step = 1; step <= 100; step++) series.push(step, 1000 + step * 2, 0);
  assert.equal(store.stepRate(0), 0.5); // one step every 2 s
  assert.equal(store.stepRate(1), null);
  assert.equal(store.size, 1);
});

test("a series shows its points while it has fewer than three values, gaps not counted", () => {
  assert.equal(sparse([]), true);
  assert.equal(sparse([0.5]), true);
  // One eval value among a train metric's steps (the panel's union x axis): still one point.
  assert.equal(sparse([null, null, 0.5, null, null]), true);
  assert.equal(sparse([0, null, 0]), true); // zero is a value, two of them a line
  assert.equal(sparse([1, 2, 3]), false);
  assert.equal(sparse([1, null, 2, null, 3]), false);
  assert.equal(sparse([1, 2], 2), false);
});

test("one x value gets a padded range around it; several keep the range uPlot computed", () => {
  // uPlot's own range for a single value at step 50 is 0..100: the chart fits the point instead.
  assert.deepEqual(xRange([50], 0, 100), [49, 51]);
  assert.deepEqual(xRange([1.7e9], 1.7e9, 1.7e9 + 86400, 60), [1.7e9 - 60, 1.7e9 + 60]);
  assert.deepEqual(xRange([0], -1, 1, 5), [-5, 5]);
  // Several x values: the data's range, or a drag-zoom, as given.
  assert.deepEqual(xRange([1, 2, 3], 1, 3), [1, 3]);
  assert.deepEqual(xRange([1, 2, 3], 1.5, 2.5), [1.5, 2.5]);
  assert.deepEqual(xRange([], null, null), [null, null]);
});

// A resume from an earlier step (webapp/runs/ingest.py, _supersede: the same rule).
test("the first point of a later attempt rewinds at its step; nothing else does", () => {
  const attempts = new Attempts(0);
  assert.equal(attempts.rewindAt({ attempt: 1, step: 1 }), null); // the launch supersedes nothing
  assert.equal(attempts.rewindAt({ attempt: 1, step: 2 }), null);
  assert.equal(attempts.rewindAt({ attempt: 2, step: 3 }), 3); // resumed from the checkpoint of step 2
  assert.equal(attempts.rewindAt({ attempt: 2, step: 4 }), null); // once per attempt
  assert.equal(attempts.rewindAt({ attempt: 1, step: 9 }), null); // an older attempt never does
  assert.equal(attempts.rewindAt({ step: 9 }), null); // an event of before attempts existed
  // A page opened after attempt 3 logged holds its points already: they are no rewind.
  const later = new Attempts(3);
  assert.equal(later.rewindAt({ attempt: 3, step: 21 }), null);
  assert.equal(later.rewindAt({ attempt: 4, step: 11 }), 11);
});

test("a rewind moves the points at its step and after aside, and the series goes on from there", () => {
  const s = new Series(0, "reward");
  for (let step = 1; step <= 6; step++) s.push(step, 1000 + step, step);
  assert.equal(s.rewind(7), false); // a resume from the last step: nothing superseded
  assert.equal(s.superseded, null);
  assert.equal(s.rewind(3), true);
  assert.deepEqual(s.step, [1, 2]);
  assert.deepEqual(s.superseded, { step: [3, 4, 5, 6], time: [1003, 1004, 1005, 1006], value: [3, 4, 5, 6] });
  assert.equal(s.push(3, 2003, 30), true); // the new attempt's step 3 is new to the series
  assert.deepEqual([s.step, s.value], [[1, 2, 3], [1, 2, 30]]);
  // A second rewind to the same step: two superseded points at step 3, in step order.
  s.rewind(3);
  assert.deepEqual(s.superseded.step, [3, 3, 4, 5, 6]);
  assert.deepEqual(s.superseded.value, [3, 30, 4, 5, 6]);
  // The superseded history from the API replaces what the page gathered (it has those too).
  s.loadSuperseded({ step: [3, 4], time: [1, 2], value: [9, 9] });
  assert.deepEqual(s.superseded.step, [3, 4]);
});

test("a downsampled history rewinds with its band", () => {
  const s = new Series(0, "x");
  s.load(history([1, 5, 9], [1, 2, 3], { downsampled: true, min: [0, 1, 2], max: [2, 3, 4] }));
  s.rewind(5);
  assert.deepEqual([s.step, s.lo, s.hi], [[1], [0], [2]]);
});

test("superseded points are drawn as a faded series of their own, never counted", () => {
  const s = new Series(0, "reward");
  assert.equal(supersededView(s), null);
  for (let step = 1; step <= 4; step++) s.push(step, step, step);
  s.rewind(3);
  const view = supersededView(s);
  assert.deepEqual([view.faded, view.name, view.step], [true, "reward", [3, 4]]);
  const data = chartData([s, view]);
  assert.deepEqual(data.x, [1, 2, 3, 4]);
  assert.deepEqual(data.raw, [[1, 2, null, null], [null, null, 3, 4]]);
  assert.equal(data.points, 2);
});
