// The rollout browser's analysis helpers (webapp/pages/static/tributary/rollout_views.js).
import assert from "node:assert/strict";
import test from "node:test";

import { binsOf, pointsOf, tokenReadout } from "../../webapp/pages/static/tributary/rollout_views.js";

test("a 0/1 reward's two bars span their gap, with half a bar of margin", () => {
  const bins = binsOf({ x: [0, 1], count: [3, 5], width: 1 });
  assert.deepEqual([bins.x, bins.count], [[0, 1], [3, 5]]);
  assert.equal(bins.fraction, 0.9);
  assert.deepEqual(bins.range(), [-0.5, 1.5]);
});

test("equal-width bins fill most of each slot; uneven discrete values keep bars apart", () => {
  const even = binsOf({ x: [0.05, 0.15, 0.25], count: [1, 2, 3], width: 0.1 });
  assert.ok(Math.abs(even.fraction - 0.9) < 1e-12);
  const uneven = binsOf({ x: [0, 0.2, 1], count: [1, 1, 1], width: 0.2 });
  assert.ok(Math.abs(uneven.fraction - 0.9) < 1e-12); // a bar 0.9 of the smallest gap
  assert.deepEqual(uneven.range(), [-0.1, 1.1]);
  const one = binsOf({ x: [0.5], count: [4], width: 1 });
  assert.equal(one.fraction, 0.6);
  assert.deepEqual(one.range(), [0, 1]);
});

test("scatter ranges are padded by 5%, a single value gets a unit range", () => {
  const p = pointsOf({ length: [2, 3, 22], reward: [0, 0.5, 1] });
  assert.deepEqual([p.x, p.y], [[2, 3, 22], [0, 0.5, 1]]);
  assert.deepEqual(p.xRange(), [1, 23]);
  assert.deepEqual(p.yRange(), [-0.05, 1.05]);
  assert.deepEqual(pointsOf({ length: [7], reward: [1] }).yRange(), [0.5, 1.5]);
});

test("a token's readout shows its spaces and newlines, then its values", () => {
  assert.equal(
    tokenReadout(" 4\n", "logprob -0.105 (p 0.900) · entropy 0.300"),
    "“␣4\\n”: logprob -0.105 (p 0.900) · entropy 0.300",
  );
  assert.equal(tokenReadout("a", "logprob -1.000 (p 0.368)"), "“a”: logprob -1.000 (p 0.368)");
});
