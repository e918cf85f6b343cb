// The stages of a continual-training run on the run page (webapp/pages/static/tributary/stages.js):
// metric names to stages, the plan from untrusted page data, the chart marks, the heatmap's matrix.
import assert from "node:assert/strict";
import test from "node:test";

import { Matrix, boundaries, colour, readPlan, stageOfMetric } from "../../webapp/pages/static/tributary/stages.js";

test("only eval/<stage>/accuracy names a stage", () => {
  assert.equal(stageOfMetric("eval/add/accuracy"), "add");
  assert.equal(stageOfMetric("eval/count-down/accuracy"), "count-down");
  assert.equal(stageOfMetric("eval/accuracy"), null); // the run's mean over stages
  assert.equal(stageOfMetric("eval/add/reward"), null);
  assert.equal(stageOfMetric("eval/a/b/accuracy"), null);
});

test("the plan keeps well-formed stages only; the marks are each later stage's first step", () => {
  assert.deepEqual(readPlan(null), []);
  assert.deepEqual(readPlan([{ name: 1 }, "x"]), []);
  const plan = readPlan([{ name: "a", first: 1, last: 2 }, { name: "b", first: 3, last: 5 }, { name: "c", first: 6, last: 6 }]);
  assert.deepEqual(boundaries(plan), [{ step: 3, name: "b" }, { step: 6, name: "c" }]);
});

test("the matrix orders rows by the plan, else by first evaluation; a rewind drops later steps", () => {
  const m = new Matrix([{ name: "a", first: 1, last: 2 }, { name: "b", first: 3, last: 4 }]);
  m.add("b", 4, 0.5);
  m.add("a", 0, 0.25);
  m.add("a", 4, 0.125);
  m.add("z", 2, 1); // a stage the plan does not name (an external run): after the planned ones
  m.add("y", 3, 1);
  assert.equal(m.add("a", Number.NaN, 1), false);
  assert.deepEqual(m.rows(), ["a", "b", "z", "y"]);
  assert.deepEqual(m.steps(), [0, 2, 3, 4]);
  assert.equal(m.value("a", 4), 0.125);
  assert.equal(m.value("b", 0), null);
  m.rewind(3);
  assert.deepEqual(m.steps(), [0, 2]);
});

test("the colour scale runs from red (0) to green (1), grey for no value", () => {
  assert.equal(colour(0), "hsl(0, 65%, 78%)");
  assert.equal(colour(1), "hsl(120, 65%, 60%)");
  assert.equal(colour(7), colour(1));
  assert.equal(colour(null), "#eceff3");
});
