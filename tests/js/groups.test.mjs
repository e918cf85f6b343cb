// Seed averaging on the compare page (webapp/pages/static/tributary/groups.js): the mean of a
// group's runs on the steps all of them reached, with a min/max or standard-deviation band.
import assert from "node:assert/strict";
import test from "node:test";

import { groupRuns, groupStats } from "../../webapp/pages/static/tributary/groups.js";

const run = (steps, values, t0 = 100) => ({ step: steps, time: steps.map((s) => t0 + 10 * s), value: values });
const close = (a, b) => a.forEach((v, i) => assert.ok(Math.abs(v - b[i]) < 1e-12, `${i}: ${v} != ${b[i]}`));

test("runs on the same steps: the plain mean, min and max at each step", () => {
  const g = groupStats([run([1, 2, 3], [1, 2, 3]), run([1, 2, 3], [3, 4, 8]), run([1, 2, 3], [2, 0, 4])]);
  assert.deepEqual(g.step, [1, 2, 3]);
  close(g.value, [2, 2, 5]);
  assert.deepEqual(g.lo, [1, 0, 3]);
  assert.deepEqual(g.hi, [3, 4, 8]);
  assert.equal(g.n, 3);
});

test("the std band is the mean +- the sample standard deviation (n - 1)", () => {
  // values 1, 3 at step 1: mean 2, sample std sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt(2)
  const g = groupStats([run([1], [1]), run([1], [3])], "std");
  close(g.value, [2]);
  close(g.lo, [2 - Math.SQRT2]);
  close(g.hi, [2 + Math.SQRT2]);
  const one = groupStats([run([1, 2], [5, 6])], "std");
  close(one.lo, [5, 6]); // a group of one run has no spread
  assert.throws(() => groupStats([run([1], [1])], "iqr"), /band: "minmax" or "std"/);
});

test("steps one run did not log are interpolated; nothing outside the steps all runs reached", () => {
  // a logs every step 0..4, b every other step 2..6: the common range is 2..4
  const a = run([0, 1, 2, 3, 4], [0, 10, 20, 30, 40]);
  const b = run([2, 4, 6], [0, 4, 8]);
  const g = groupStats([a, b]);
  assert.deepEqual(g.step, [2, 3, 4]);
  // step 3: a = 30, b halfway between 0 and 4 = 2 -> mean 16
  close(g.value, [10, 16, 22]);
  close(g.lo, [0, 2, 4]);
  close(g.hi, [20, 30, 40]);
  // time: each run's seconds since its own first point, interpolated, then averaged
  close(g.time, [(20 + 0) / 2, (30 + 10) / 2, (40 + 20) / 2]);
});

test("runs that never overlap give an empty group; missing values are left out", () => {
  assert.deepEqual(groupStats([run([1, 2], [1, 2]), run([3, 4], [3, 4])]).step, []);
  const g = groupStats([run([1, 2, 3], [1, null, 3]), run([1, 2, 3], [1, 2, NaN])]);
  // run 0 at step 2 is interpolated (2); run 1 ends at step 2
  assert.deepEqual(g.step, [1, 2]);
  close(g.value, [1, 2]);
  assert.deepEqual(groupStats([]).step, []);
});

test("runs are grouped by a config value in first-seen order, a missing key its own group", () => {
  const runs = [
    { slot: 0, id: 10, config: { lr: 1e-6, seed: 0 } },
    { slot: 1, id: 11, config: { lr: 2e-6, seed: 0 } },
    { slot: 2, id: 12, config: { lr: 1e-6, seed: 1 } },
    { slot: 3, id: 13, config: { seed: 2 } },
  ];
  assert.deepEqual(groupRuns(runs, "lr").map((g) => [g.label, g.slots, g.ids]), [
    ["lr=0.000001", [0, 2], [10, 12]],
    ["lr=0.000002", [1], [11]],
    ["lr=(unset)", [3], [13]],
  ]);
});
